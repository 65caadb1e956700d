//! The passive side of AD-PSGD: the engine averages its rank's model with an active peer's,
//! atomically per pair, while the rank's compute side keeps working.

use super::{Action, Engine};
use crate::payload::Payload;
use crate::transport::{Envelope, Meta, Tag};

/// The live model of a passive rank and, in the canonical AD-PSGD, the corrections made to it
/// since the last publish (the gossip variant's compute side mixes with the live model
/// instead, see [`super::gossip`]).
pub(super) struct Passive {
    live: Payload,
    delta: Option<Payload>,
}

impl Passive {
    /// The canonical AD-PSGD: the compute side publishes and takes the corrections.
    pub fn new(initial: Payload) -> Passive {
        let delta = Payload::zeros_like(&initial, initial.len());
        Passive {
            live: initial,
            delta: Some(delta),
        }
    }

    /// The gossip variant: the live model is the shared copy the compute side mixes with.
    pub fn gossip(initial: Payload) -> Passive {
        Passive {
            live: initial,
            delta: None,
        }
    }

    /// The shared copy, in the gossip variant.
    pub fn gossip_copy(&mut self) -> Option<&mut Payload> {
        self.delta.is_none().then_some(&mut self.live)
    }

    /// The compute side publishes its model after a local step; it gets back the corrections
    /// made since its last publish and must add them to its model (the engine's live model is
    /// the published one plus those corrections). `None` in the gossip variant.
    pub fn publish(&mut self, data: Payload) -> Option<Payload> {
        let delta = self.delta.as_mut()?;
        let zeros = Payload::zeros_like(&data, data.len());
        let delta = std::mem::replace(delta, zeros);
        self.live = data;
        self.live.add(&delta);
        Some(delta)
    }

    /// Averages `theirs` into the live model and returns the pair's average.
    fn average(&mut self, mut theirs: Payload) -> Payload {
        theirs.add(&self.live);
        theirs.scale(0.5);
        if let Some(delta) = self.delta.as_mut() {
            delta.add(&theirs);
            delta.sub(&self.live);
        }
        self.live = theirs.clone();
        theirs
    }
}

impl Engine {
    /// Makes this rank passive and answers the averaging requests that came before.
    pub(super) fn become_passive(&mut self, passive: Passive, out: &mut Vec<Action>) {
        self.passive = Some(Box::new(passive));
        for env in std::mem::take(&mut self.early_pairs) {
            self.on_pair_request(env, out);
        }
    }

    pub(super) fn on_pair_request(&mut self, env: Envelope, out: &mut Vec<Action>) {
        let Some(p) = self.passive.as_mut() else {
            self.early_pairs.push(env);
            return;
        };
        if env.data.len() != p.live.len() {
            let err = crate::Error::LengthMismatch {
                rank: self.rank,
                op: crate::error::Op::Collective {
                    kind: "pairwise averaging",
                    seq: env.tag.seq,
                },
                peer: env.from,
                local: p.live.len(),
                remote: env.data.len(),
            };
            self.fail(err, out);
            return;
        }
        let avg = p.average(env.data);
        let reply = Envelope {
            from: self.rank,
            tag: Tag { step: 1, ..env.tag },
            meta: Meta {
                total_len: avg.len() as u64,
                ..Meta::default()
            },
            data: avg,
        };
        self.send(env.from, reply, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corrections_track_averages() {
        let mut p = Passive::new(Payload::Data(vec![1.0, 1.0]));
        let avg = p.average(Payload::Data(vec![3.0, 5.0]));
        assert_eq!(avg, Payload::Data(vec![2.0, 3.0]));
        // The compute side stepped from [1, 1] to [0, 1]; it must end at [1, 3] = step + delta.
        let delta = p.publish(Payload::Data(vec![0.0, 1.0]));
        assert_eq!(delta, Some(Payload::Data(vec![1.0, 2.0])));
        assert_eq!(p.live, Payload::Data(vec![1.0, 3.0]));
        assert_eq!(
            p.publish(Payload::Data(vec![1.0, 3.0])),
            Some(Payload::Data(vec![0.0, 0.0]))
        );
        assert!(p.gossip_copy().is_none());
    }

    #[test]
    fn a_gossiping_passive_rank_averages_into_its_shared_copy() {
        let mut p = Passive::gossip(Payload::Data(vec![1.0, 1.0]));
        let avg = p.average(Payload::Data(vec![3.0, 5.0]));
        assert_eq!(avg, Payload::Data(vec![2.0, 3.0]));
        assert_eq!(p.gossip_copy(), Some(&mut Payload::Data(vec![2.0, 3.0])));
        assert_eq!(p.publish(Payload::Data(vec![0.0, 0.0])), None);
    }
}
