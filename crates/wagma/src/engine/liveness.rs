//! Liveness: heartbeats to the peers a rank depends on (its activation-tree neighbours on every
//! hypercube dimension, its ring neighbours and the members of its recent groups), declaring a
//! peer dead when it has been silent longer than the timeout, and stall reports while an
//! operation waits.

use std::time::Duration;

use super::run::Members;
use super::{Action, Engine, Time};
use crate::Rank;
use crate::payload::Payload;
use crate::transport::Meta;

/// Step of a heartbeat control message (its `aux` carries the sender's iteration).
pub(super) const CONTROL_HEARTBEAT: u16 = 2;

pub(super) struct Liveness {
    interval: Duration,
    watched: Vec<bool>,
    last_heard: Vec<Option<Time>>,
    iteration: Vec<Option<u64>>,
    next_beat: Time,
}

impl Liveness {
    pub fn new(rank: Rank, ranks: usize, interval: Duration) -> Liveness {
        let mut watched = vec![false; ranks];
        let mut j = 0;
        while j < usize::BITS && (1usize << j) < ranks {
            let d = 1usize << j;
            if ranks.is_power_of_two() {
                watched[rank ^ d] = true;
            } else {
                watched[(rank + d) % ranks] = true;
                watched[(rank + ranks - d) % ranks] = true;
            }
            j += 1;
        }
        for n in crate::topology::ring_neighbors(rank, ranks) {
            watched[n] = true;
        }
        if let Some(w) = watched.get_mut(rank) {
            *w = false;
        }
        Liveness {
            interval,
            watched,
            last_heard: vec![None; ranks],
            iteration: vec![None; ranks],
            next_beat: Duration::ZERO,
        }
    }

    /// The last iteration `peer` reported, if any.
    pub fn iteration_of(&self, peer: Rank) -> Option<u64> {
        self.iteration.get(peer).copied().flatten()
    }

    /// A peer came back (rejoined): judge its silence from `now`.
    pub fn restart(&mut self, peer: Rank, now: Time) {
        if let Some(t) = self.last_heard.get_mut(peer) {
            *t = Some(now);
        }
        if let Some(i) = self.iteration.get_mut(peer) {
            *i = None;
        }
    }

    /// True when `peer` was heard from within two heartbeat intervals of `now`: it is alive,
    /// whatever keeps it from sending what an operation waits for.
    pub fn heard_lately(&self, peer: Rank, now: Time) -> bool {
        self.last_heard
            .get(peer)
            .copied()
            .flatten()
            .is_some_and(|t| now.saturating_sub(t) <= 2 * self.interval)
    }

    pub fn next_deadline(&self) -> Time {
        self.next_beat
    }
}

impl Engine {
    /// Notes that `peer` is alive (any message counts).
    pub(super) fn heard_from(&mut self, now: Time, peer: Rank, iteration: Option<u64>) {
        if let Some(l) = self.liveness.as_mut() {
            if let Some(t) = l.last_heard.get_mut(peer) {
                *t = Some(now);
            }
            if let (Some(i), Some(slot)) = (iteration, l.iteration.get_mut(peer)) {
                *slot = Some(i);
            }
        }
    }

    /// Starts watching `members` (the ranks of a group this rank is in).
    pub(super) fn watch(&mut self, now: Time, members: &Members) {
        let rank = self.rank;
        if let Some(l) = self.liveness.as_mut() {
            for &m in members.ranks().iter() {
                if m != rank && !l.watched[m] {
                    l.watched[m] = true;
                    l.last_heard[m].get_or_insert(now);
                }
            }
        }
    }

    /// Sends heartbeats when due, declares silent peers dead, reports stalls. True when the
    /// engine failed.
    pub(super) fn liveness_tick(&mut self, now: Time, out: &mut Vec<Action>) -> bool {
        let Some(l) = self.liveness.as_mut() else {
            return false;
        };
        let timeout = self.cfg.timeout;
        // A silent watched peer is dead; in elastic mode, every one of them at once (one
        // left for the next tick could time out an operation first).
        let silent: Vec<(Rank, Duration)> = (0..l.watched.len())
            .filter(|&p| {
                !self.rejoining
                    && l.watched[p]
                    && !self.departed.contains(p)
                    && !self.dead.contains(p)
            })
            .filter_map(|p| {
                let since = now.saturating_sub(l.last_heard[p]?);
                (since > timeout).then_some((p, since))
            })
            .collect();
        for (p, since) in silent {
            let reason = format!("silent for {:.1} s", since.as_secs_f64());
            if !self.cfg.elastic {
                self.on_peer_lost(now, p, &reason, out);
                return true;
            }
            let (_, context) = self.blame(p);
            self.declare_dead(now, p, &format!("{reason}{context}"), out);
            if self.failed.is_some() {
                return true;
            }
        }
        let Some(l) = self.liveness.as_mut() else {
            return false;
        };
        for (p, w) in l.watched.iter().enumerate() {
            if *w && l.last_heard[p].is_none() {
                l.last_heard[p] = Some(now);
            }
        }
        if now >= l.next_beat {
            l.next_beat = now + l.interval;
            let targets: Vec<Rank> = (0..l.watched.len())
                .filter(|&p| l.watched[p] && !self.departed.contains(p))
                .collect();
            let iteration = self.iteration;
            for to in targets {
                let meta = Meta {
                    aux: iteration,
                    ..Meta::default()
                };
                let env = self.control(CONTROL_HEARTBEAT, meta, Payload::Size(0));
                self.send(to, env, out);
            }
        }
        self.report_stalls(now);
        false
    }

    /// Warns, while it lasts, about every operation that has waited a multiple of the heartbeat
    /// interval: which peer it waits for and how far that peer is.
    fn report_stalls(&mut self, now: Time) {
        let Some(l) = self.liveness.as_ref() else {
            return;
        };
        let every = l.interval.max(Duration::from_secs(1));
        for r in &mut self.running {
            let waited = now.saturating_sub(r.started);
            let due = (waited.as_secs_f64() / every.as_secs_f64()) as u32;
            if due > r.stall_reports && due >= 1 {
                r.stall_reports = due;
                let missing = r.missing();
                let details: Vec<String> = missing
                    .iter()
                    .map(|&p| match l.iteration_of(p) {
                        Some(i) => format!("rank {p}, whose last reported iteration is {i}"),
                        None => format!("rank {p}"),
                    })
                    .collect();
                tracing::warn!(
                    rank = self.rank,
                    "{} has waited {:.1} s on {}",
                    r.describe(),
                    waited.as_secs_f64(),
                    if details.is_empty() {
                        "its own compute side".to_string()
                    } else {
                        details.join(", ")
                    }
                );
            }
        }
    }
}
