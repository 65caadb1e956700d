//! The passive side of AD-PSGD: the engine averages its rank's model with an active peer's,
//! atomically per pair, while the rank's compute side keeps working.

use super::{Action, Engine};
use crate::payload::Payload;
use crate::transport::{Envelope, Meta, Tag};

/// The live model of a passive rank and the corrections made to it since the last publish.
pub(super) struct Passive {
    live: Payload,
    delta: Payload,
}

impl Passive {
    pub fn new(initial: Payload) -> Passive {
        let delta = Payload::zeros_like(&initial, initial.len());
        Passive {
            live: initial,
            delta,
        }
    }

    /// The compute side publishes its model after a local step; it gets back the corrections
    /// made since its last publish and must add them to its model (the engine's live model is
    /// the published one plus those corrections).
    pub fn publish(&mut self, data: Payload) -> Payload {
        let zeros = Payload::zeros_like(&data, data.len());
        let delta = std::mem::replace(&mut self.delta, zeros);
        self.live = data;
        self.live.add(&delta);
        delta
    }

    /// Averages `theirs` into the live model and returns the pair's average.
    fn average(&mut self, mut theirs: Payload) -> Payload {
        theirs.add(&self.live);
        theirs.scale(0.5);
        self.delta.add(&theirs);
        self.delta.sub(&self.live);
        self.live = theirs.clone();
        theirs
    }
}

impl Engine {
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
        assert_eq!(delta, Payload::Data(vec![1.0, 2.0]));
        assert_eq!(p.live, Payload::Data(vec![1.0, 3.0]));
        assert_eq!(
            p.publish(Payload::Data(vec![1.0, 3.0])),
            Payload::Data(vec![0.0, 0.0])
        );
    }
}
