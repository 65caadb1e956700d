//! Fault injection: a transport wrapper that drops, delays and reorders messages, seeded, for
//! testing that every failure ends in a named error within its timeout and that the engine
//! tolerates late and out-of-order messages.

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{Envelope, Kind, Transport};
use crate::Rank;
use crate::error::TransportError;

/// What to do to the messages that pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// Probability that a message is dropped.
    pub drop: f64,
    /// Probability that a message is held back for `delay`.
    pub delay_probability: f64,
    /// How long a delayed message is held.
    pub delay: Duration,
    /// Probability that a message is held until the next one to the same peer has gone.
    pub reorder: f64,
    /// Only messages of these kinds are touched (all if empty).
    pub kinds: Vec<Kind>,
    /// Seed.
    pub seed: u64,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            drop: 0.0,
            delay_probability: 0.0,
            delay: Duration::ZERO,
            reorder: 0.0,
            kinds: Vec::new(),
            seed: 0,
        }
    }
}

/// A transport that injects [`Faults`] into another.
pub struct FaultyTransport<T> {
    inner: T,
    faults: Faults,
    rng: ChaCha8Rng,
    delayed: Vec<(Instant, Rank, Envelope)>,
    reordered: Vec<(Rank, Envelope)>,
    /// Messages dropped so far.
    pub dropped: u64,
}

impl<T: Transport> FaultyTransport<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, faults: Faults, rank: Rank) -> FaultyTransport<T> {
        let rng = ChaCha8Rng::seed_from_u64(
            faults.seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        FaultyTransport {
            inner,
            faults,
            rng,
            delayed: Vec::new(),
            reordered: Vec::new(),
            dropped: 0,
        }
    }

    fn release_due(&mut self) -> Result<(), TransportError> {
        let now = Instant::now();
        let mut keep = Vec::with_capacity(self.delayed.len());
        for (at, to, env) in std::mem::take(&mut self.delayed) {
            if at <= now {
                self.inner.send(to, env)?;
            } else {
                keep.push((at, to, env));
            }
        }
        self.delayed = keep;
        Ok(())
    }
}

impl<T: Transport> Transport for FaultyTransport<T> {
    fn send(&mut self, to: Rank, env: Envelope) -> Result<(), TransportError> {
        let touched = self.faults.kinds.is_empty() || self.faults.kinds.contains(&env.tag.kind);
        if touched {
            if self.rng.random::<f64>() < self.faults.drop {
                self.dropped += 1;
                return Ok(());
            }
            if self.rng.random::<f64>() < self.faults.delay_probability {
                self.delayed
                    .push((Instant::now() + self.faults.delay, to, env));
                return Ok(());
            }
            if self.rng.random::<f64>() < self.faults.reorder {
                self.reordered.push((to, env));
                return Ok(());
            }
        }
        self.inner.send(to, env)?;
        // Held messages to this peer go after the one that overtook them.
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reordered)
            .into_iter()
            .partition(|(t, _)| *t == to);
        self.reordered = later;
        for (t, e) in now {
            self.inner.send(t, e)?;
        }
        self.release_due()
    }

    fn poll(&mut self) -> Result<(), TransportError> {
        self.release_due()?;
        // Nothing follows a held message for too long: release it after one delay period.
        if !self.reordered.is_empty() && self.delayed.is_empty() {
            for (t, e) in std::mem::take(&mut self.reordered) {
                self.delayed.push((
                    Instant::now() + self.faults.delay.max(Duration::from_millis(1)),
                    t,
                    e,
                ));
            }
        }
        self.inner.poll()
    }

    fn poll_interval(&self) -> Option<Duration> {
        Some(Duration::from_millis(1))
    }

    fn leaving(&mut self) {
        self.inner.leaving();
    }

    fn taken(&self, from: Rank) {
        self.inner.taken(from);
    }

    fn disconnect(&mut self, peer: Rank) {
        self.inner.disconnect(peer);
    }

    fn folds(&self) -> bool {
        self.inner.folds()
    }

    fn fold(&mut self, from: Rank, fold: super::Fold) {
        self.inner.fold(from, fold);
    }

    fn expect_fold(&mut self, from: Rank, tag: super::Tag) {
        self.inner.expect_fold(from, tag);
    }

    fn unfold(&mut self, from: Rank, tag: super::Tag) {
        self.inner.unfold(from, tag);
    }
}
