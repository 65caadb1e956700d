//! The WAGMA-SGD authors' AD-PSGD baseline: each rank keeps a shared copy of its model in its
//! engine, an active rank's engine averages that copy with passive peers' copies in a loop of
//! its own, and the compute side only mixes its model with the copy after each local step
//! (`W <- (W + shared) / 2`, then `shared <- W`). The compute side never waits for a peer.
//!
//! Their loop runs without pause, so its rate is whatever the machine allows; here each mix
//! starts a budget of exchanges (one after the other, each with the next peer of
//! [`Pairing::gossip_peer`]), which keeps the rate defined in virtual time too. A blocking
//! collective of the compute side ends the budget and starts once the exchange in flight is
//! done, so that no exchange can outlive a barrier (a passive peer may leave after one).

use std::sync::Arc;

use super::run::{Members, Owner};
use super::{CollectiveRun, Engine, ReqId, Time};
use crate::error::{Error, Op};
use crate::payload::Payload;
use crate::schedule;
use crate::topology::Pairing;
use crate::transport::{Contribution, Kind};

/// The gossip loop of an active rank.
pub(super) struct Gossip {
    shared: Payload,
    pairing: Pairing,
    per_mix: u32,
    budget: u32,
    /// Exchanges completed (also the sequence number of the next one).
    done: u64,
    /// An exchange is in flight.
    in_flight: bool,
    /// What the compute side's mixes changed in the shared copy since the exchange in flight
    /// sent it (`None`: nothing).
    mixed_since_sent: Option<Payload>,
    /// Blocking collectives held back behind the exchange in flight (outstanding requests
    /// of the engine, which a failure answers).
    held: Vec<(ReqId, CollectiveRun)>,
}

impl Gossip {
    pub fn new(initial: Payload, pairing: Pairing, per_mix: u32) -> Gossip {
        Gossip {
            shared: initial,
            pairing,
            per_mix,
            budget: 0,
            done: 0,
            in_flight: false,
            mixed_since_sent: None,
            held: Vec::new(),
        }
    }

    /// Holds `run` back while an exchange is in flight (and ends the budget either way);
    /// gives it back when it can start now.
    pub fn hold(&mut self, id: ReqId, run: CollectiveRun) -> Option<CollectiveRun> {
        self.budget = 0;
        if self.in_flight {
            self.held.push((id, run));
            None
        } else {
            Some(run)
        }
    }

    /// Drops the collectives held back, once a failure has answered them.
    pub fn drop_held(&mut self) {
        for (_, run) in self.held.drain(..) {
            run.data.recycle();
        }
    }
}

/// `shared <- (w + shared) / 2`; returns the mix for the compute side.
pub(super) fn mix(shared: &mut Payload, mut w: Payload) -> Payload {
    w.add(shared);
    w.scale(0.5);
    let mixed = w.duplicate();
    std::mem::replace(shared, w).recycle();
    mixed
}

fn not_gossiping(rank: crate::Rank) -> Error {
    Error::Protocol {
        rank,
        op: Op::Other("gossip mix"),
        detail: "the rank does not gossip (open it first)".into(),
    }
}

impl Engine {
    /// The compute side mixes its model `data` with the shared copy; with `start`, the
    /// engine then runs this rank's budget of exchanges (active ranks).
    pub(super) fn gossip_mix(
        &mut self,
        now: Time,
        data: Payload,
        start: bool,
    ) -> Result<Payload, Error> {
        let rank = self.rank;
        let shared = match (&mut self.gossip, &mut self.passive) {
            (Some(g), _) => {
                if g.in_flight && g.shared.len() == data.len() {
                    // The mix changes the copy by (data - shared) / 2.
                    let mut change = data.duplicate();
                    change.sub(&g.shared);
                    change.scale(0.5);
                    match &mut g.mixed_since_sent {
                        Some(m) => {
                            m.add(&change);
                            change.recycle();
                        }
                        None => g.mixed_since_sent = Some(change),
                    }
                }
                if start {
                    g.budget = g.per_mix;
                }
                &mut g.shared
            }
            (None, Some(p)) => match p.gossip_copy() {
                Some(live) => live,
                None => return Err(not_gossiping(rank)),
            },
            (None, None) => return Err(not_gossiping(rank)),
        };
        if shared.len() != data.len() {
            return Err(Error::Protocol {
                rank,
                op: Op::Other("gossip mix"),
                detail: format!(
                    "model of {} elements for a shared copy of {}",
                    data.len(),
                    shared.len()
                ),
            });
        }
        let mixed = mix(shared, data);
        self.next_exchange(now);
        Ok(mixed)
    }

    /// Starts the next exchange of the budget, if nothing is in flight or held back.
    fn next_exchange(&mut self, now: Time) {
        let rank = self.rank;
        let Some(g) = self.gossip.as_mut() else {
            return;
        };
        if g.budget == 0 || g.in_flight || !g.held.is_empty() {
            return;
        }
        let Some(peer) = g.pairing.gossip_peer(rank, g.done) else {
            return;
        };
        let seq = g.done;
        let len = g.shared.len();
        g.in_flight = true;
        let data = g.shared.duplicate();
        let contributions = vec![Contribution {
            rank,
            steps: self.iteration,
        }];
        self.start(
            now,
            Members::Job(self.ranks),
            Owner::Gossip,
            Op::Collective {
                kind: "gossip exchange",
                seq,
            },
            Kind::Pair,
            seq,
            Arc::new(schedule::pair_request(peer, len)),
            data,
            0.0,
            contributions,
        );
    }

    /// An exchange came back with the pair's average `avg` of what it sent: the shared copy
    /// takes the average plus what the compute side mixed in meanwhile.
    pub(super) fn on_gossip_done(&mut self, now: Time, mut avg: Payload) {
        let Some(g) = self.gossip.as_mut() else {
            return;
        };
        if let Some(m) = g.mixed_since_sent.take() {
            avg.add(&m);
            m.recycle();
        }
        std::mem::replace(&mut g.shared, avg).recycle();
        g.in_flight = false;
        g.done += 1;
        g.budget = g.budget.saturating_sub(1);
        self.stats.gossip_exchanges += 1;
        for (id, run) in std::mem::take(&mut g.held) {
            self.begin_run(now, id, run);
        }
        self.next_exchange(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mix_averages_and_keeps_the_result_in_the_shared_copy() {
        let mut shared = Payload::Data(vec![1.0, 3.0]);
        let mixed = mix(&mut shared, Payload::Data(vec![3.0, 5.0]));
        assert_eq!(mixed, Payload::Data(vec![2.0, 4.0]));
        assert_eq!(shared, mixed);
        let mut virtual_copy = Payload::Size(2);
        assert_eq!(mix(&mut virtual_copy, Payload::Size(2)), Payload::Size(2));
    }
}
