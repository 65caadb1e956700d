//! Collectives as data: per-rank programs of tagged sends, receives and reductions, built by pure
//! functions of (rank, members, length, algorithm). The progress engine runs them over a real
//! transport; the virtual-time executor runs the very same programs over a network model.
//!
//! A [`Schedule`] is a list of [`Phase`]s executed in order. A phase posts its sends (each a
//! copy of a range of the working buffer, taken when the phase starts), waits for all its
//! receives, then combines them into the buffer: [`Combine::Reduce`] folds the contributions of
//! a range in ascending rank order of their senders (the local buffer included), by a sum or a
//! maximum, [`Combine::Copy`] overwrites. Every transfer carries a `step`
//! number that the two sides agree on, so a message that arrives early is matched to the right
//! phase.
//!
//! Reduction order is part of the contract: every algorithm except recursive doubling computes
//! each element as the left fold `((x_a + x_b) + x_c) + ...` over the contributors sorted by
//! rank; recursive doubling computes a balanced tree in rank order. Two schedules with the same
//! contributors and algorithm therefore give bit-identical results.
//!
//! The builders depend on the members only through their order, so a schedule built for
//! position `i` over the members `0..n` names its peers by position: the engine builds a group
//! round's schedule that way and shares it among every rank at the same position of a group
//! of the same size, mapping positions to ranks as it runs.

mod allreduce;
mod exchange;

use std::ops::Range;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::Rank;
use crate::payload::Reduce;

pub(crate) use allreduce::chunk;
pub use allreduce::{allreduce, recursive_doubling, reduce_broadcast, reduce_scatter_allgather};
pub use exchange::{
    activation_cost, exchange, exchange_among, exchange_right_then_left, pair_request,
};

/// A transfer of `range` of the working buffer to or from `peer`, matched by `step`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// The other rank.
    pub peer: Rank,
    /// Elements of the working buffer.
    pub range: Range<usize>,
    /// Step number both sides use to match the message.
    pub step: u16,
}

/// How a phase folds its received ranges into the working buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    /// Fold the contributors elementwise, in ascending rank order (the local buffer
    /// included); the weights are summed whatever the reduction. All receives of the phase
    /// cover the same range.
    Reduce(Reduce),
    /// Overwrite each received range.
    Copy,
}

/// The transfers of one side of a phase. Most phases send and receive one message, held in
/// place: a phase is read when a message reaches its rank, and a separate allocation for each
/// side was a cache miss per message in simulations of thousands of ranks.
pub type Transfers = SmallVec<[Transfer; 1]>;

/// One phase: post the sends, wait for the receives, combine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phase {
    /// Sends, posted when the phase starts.
    pub sends: Transfers,
    /// Receives that must all arrive before the phase completes.
    pub recvs: Transfers,
    /// How the receives are folded in.
    pub combine: Combine,
}

/// A per-rank program of phases over a working buffer of `len` elements.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Schedule {
    /// Number of elements of the working buffer.
    pub len: usize,
    /// Phases, executed in order.
    pub phases: Vec<Phase>,
}

/// Why a schedule cannot be run by a rank: schedules built by callers are checked before they
/// start, so that a wrong one fails as an error instead of in an executor or a reduction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSchedule {
    /// A transfer names a rank outside the job.
    #[error("phase {phase} names peer {peer}, outside the job's ranks 0..{ranks}")]
    PeerOutOfRange {
        /// The phase.
        phase: usize,
        /// The peer named.
        peer: Rank,
        /// Ranks of the job.
        ranks: usize,
    },
    /// A transfer names the rank running the schedule.
    #[error("phase {phase} names rank {rank}, which runs the schedule, as its own peer")]
    OwnRank {
        /// The phase.
        phase: usize,
        /// The rank running the schedule.
        rank: Rank,
    },
    /// A transfer's range is reversed or reaches past the working buffer.
    #[error("phase {phase} transfers elements {range:?} of a buffer of {len}")]
    RangeOutOfBounds {
        /// The phase.
        phase: usize,
        /// The range.
        range: Range<usize>,
        /// Elements of the working buffer.
        len: usize,
    },
    /// A reducing phase receives different ranges (it folds one range).
    #[error("phase {phase} reduces receives of different ranges, {first:?} and {other:?}")]
    UnevenReduction {
        /// The phase.
        phase: usize,
        /// Its first receive's range.
        first: Range<usize>,
        /// A receive's range that differs.
        other: Range<usize>,
    },
}

/// What a schedule costs one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cost {
    /// Messages sent.
    pub messages: usize,
    /// Payload bytes sent (f32 elements times 4).
    pub bytes: usize,
    /// Phases (latency-bound steps).
    pub phases: usize,
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            messages: self.messages + o.messages,
            bytes: self.bytes + o.bytes,
            phases: self.phases + o.phases,
        }
    }
}

impl Schedule {
    /// The same program reducing by `op` wherever this one reduces: the same messages, so a
    /// maximum costs what a sum costs.
    pub fn with_reduction(mut self, op: Reduce) -> Schedule {
        for p in &mut self.phases {
            if let Combine::Reduce(r) = &mut p.combine {
                *r = op;
            }
        }
        self
    }

    /// Messages and bytes this rank sends, and the number of phases.
    pub fn cost(&self) -> Cost {
        let mut c = Cost {
            phases: self.phases.len(),
            ..Cost::default()
        };
        for p in &self.phases {
            c.messages += p.sends.len();
            c.bytes += p.sends.iter().map(|t| t.range.len() * 4).sum::<usize>();
        }
        c
    }

    /// Bytes of memory this rank reads and writes to fold in what it receives: each reduced
    /// element is read once per operand and written once; copied ranges are moved in, not
    /// copied, by the in-process transport (so they cost nothing here).
    pub fn reduction_traffic(&self) -> usize {
        self.phases
            .iter()
            .filter(|p| matches!(p.combine, Combine::Reduce(_)))
            .filter_map(|p| p.recvs.first().map(|r| (p.recvs.len(), r.range.len())))
            .map(|(k, len)| (k + 2) * len * 4)
            .sum()
    }

    /// Checks that `rank` of a job of `ranks` can run this schedule over the job's ranks:
    /// every peer is another rank of the job, every range lies within the buffer, and a
    /// reducing phase receives one range.
    pub fn check(&self, rank: Rank, ranks: usize) -> Result<(), InvalidSchedule> {
        for (phase, p) in self.phases.iter().enumerate() {
            for t in p.sends.iter().chain(&p.recvs) {
                if t.peer >= ranks {
                    return Err(InvalidSchedule::PeerOutOfRange {
                        phase,
                        peer: t.peer,
                        ranks,
                    });
                }
                if t.peer == rank {
                    return Err(InvalidSchedule::OwnRank { phase, rank });
                }
                if t.range.start > t.range.end || t.range.end > self.len {
                    return Err(InvalidSchedule::RangeOutOfBounds {
                        phase,
                        range: t.range.clone(),
                        len: self.len,
                    });
                }
            }
            if let (Combine::Reduce(_), Some(first)) = (p.combine, p.recvs.first())
                && let Some(other) = p.recvs.iter().find(|t| t.range != first.range)
            {
                return Err(InvalidSchedule::UnevenReduction {
                    phase,
                    first: first.range.clone(),
                    other: other.range.clone(),
                });
            }
        }
        Ok(())
    }

    /// Every peer this rank sends to or receives from.
    pub fn peers(&self) -> Vec<Rank> {
        let mut v: Vec<Rank> = self
            .phases
            .iter()
            .flat_map(|p| p.sends.iter().chain(&p.recvs).map(|t| t.peer))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// The algorithm of an allreduce inside a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum AllreduceAlgorithm {
    /// Recursive doubling for small buffers on power-of-two groups, reduce-scatter + allgather
    /// otherwise; for pairs, reduce-broadcast where they share memory and recursive doubling
    /// where the transport sums on arrival (see [`AlgorithmChoice`]).
    #[default]
    Auto,
    /// Latency-optimal: log2(S) exchanges of the whole buffer (groups that are not a power of
    /// two fold their extra members in first and out last).
    RecursiveDoubling,
    /// Bandwidth-optimal: each member reduces one chunk, then every chunk is gathered.
    ReduceScatterAllgather,
    /// The lowest member sums every buffer in rank order and hands the result to the others:
    /// with shared memory the result is read by every member, not computed by each (for two
    /// members it gives the same bits as the other two).
    ReduceBroadcast,
}

impl std::str::FromStr for AllreduceAlgorithm {
    type Err = crate::ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "recursive-doubling" | "rd" => Ok(Self::RecursiveDoubling),
            "reduce-scatter-allgather" | "rsag" => Ok(Self::ReduceScatterAllgather),
            "reduce-broadcast" => Ok(Self::ReduceBroadcast),
            _ => Err(crate::ConfigError::Invalid {
                what: "allreduce algorithm",
                detail: format!(
                    "{s:?} (expected auto, recursive-doubling, reduce-scatter-allgather or \
                     reduce-broadcast)"
                ),
            }),
        }
    }
}

/// The rule that picks an allreduce algorithm from the group and buffer size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlgorithmChoice {
    /// Forced algorithm, or `Auto`.
    pub algorithm: AllreduceAlgorithm,
    /// With `Auto`, buffers up to this many bytes use recursive doubling on power-of-two groups.
    pub small_bytes: usize,
    /// The ranks share memory (the in-process transport, where a sent buffer is shared, not
    /// copied): with `Auto`, pairs use [`AllreduceAlgorithm::ReduceBroadcast`], so one sum
    /// serves both members. Set by the executor, never by a simulation (whose network model
    /// would then time a different pattern).
    #[serde(default)]
    pub shared_memory: bool,
    /// The transport sums a large received part into the rank's own as it arrives (TCP; see
    /// [`crate::engine::Engine::fold_on_arrival`]): with `Auto`, pairs use
    /// [`AllreduceAlgorithm::RecursiveDoubling`] at any size. It sends the least bytes, as
    /// reduce-scatter + allgather does, in one message instead of two, and its sum of the
    /// whole buffer overlaps the transfer. Set by the executor, never by a simulation.
    #[serde(default)]
    pub fold_on_arrival: bool,
}

impl Default for AlgorithmChoice {
    fn default() -> Self {
        AlgorithmChoice {
            algorithm: AllreduceAlgorithm::Auto,
            small_bytes: 64 * 1024,
            shared_memory: false,
            fold_on_arrival: false,
        }
    }
}

impl AlgorithmChoice {
    /// The concrete algorithm for a group of `members` ranks and a buffer of `len` f32s.
    pub fn resolve(&self, members: usize, len: usize) -> AllreduceAlgorithm {
        match self.algorithm {
            AllreduceAlgorithm::Auto => {
                // Same bits as the others for a pair: a + b in rank order either way.
                if self.shared_memory && members == 2 {
                    AllreduceAlgorithm::ReduceBroadcast
                } else if self.fold_on_arrival && members == 2
                    || members.is_power_of_two() && len * 4 <= self.small_bytes
                {
                    AllreduceAlgorithm::RecursiveDoubling
                } else {
                    AllreduceAlgorithm::ReduceScatterAllgather
                }
            }
            a => a,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_refuses_peers_outside_the_job_the_own_rank_and_ranges_past_the_buffer() {
        // Rank 1 of 4, a buffer of 6.
        let check = |s: Schedule| s.check(1, 4);
        assert_eq!(check(exchange(&[0, 2], &[0, 3], 6)), Ok(()));
        assert_eq!(check(exchange_right_then_left(0, 2, 6)), Ok(()));
        assert_eq!(check(exchange_among(1, 0..4, 6)), Ok(()));
        assert_eq!(check(pair_request(3, 6)), Ok(()));
        assert_eq!(
            check(exchange(&[0], &[9], 6)),
            Err(InvalidSchedule::PeerOutOfRange {
                phase: 0,
                peer: 9,
                ranks: 4
            })
        );
        assert_eq!(
            check(exchange_right_then_left(0, 1, 6)),
            Err(InvalidSchedule::OwnRank { phase: 0, rank: 1 })
        );
        let t = |peer, range, step| Transfer { peer, range, step };
        let mut past = pair_request(0, 6);
        past.phases[1].recvs[0].range = 2..7;
        assert_eq!(
            check(past),
            Err(InvalidSchedule::RangeOutOfBounds {
                phase: 1,
                range: 2..7,
                len: 6
            })
        );
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 4..2;
        let mut backwards = pair_request(0, 6);
        backwards.phases[0].sends[0].range = reversed.clone();
        assert!(matches!(
            check(backwards),
            Err(InvalidSchedule::RangeOutOfBounds { phase: 0, range, .. }) if range == reversed
        ));
        let uneven = Schedule {
            len: 6,
            phases: vec![Phase {
                sends: Transfers::new(),
                recvs: [t(0, 0..3, 0), t(2, 3..6, 0)].into_iter().collect(),
                combine: Combine::Reduce(Reduce::Sum),
            }],
        };
        assert_eq!(
            check(uneven.clone()),
            Err(InvalidSchedule::UnevenReduction {
                phase: 0,
                first: 0..3,
                other: 3..6
            })
        );
        // Copies may receive different ranges (an allgather does).
        let gather = Schedule {
            phases: vec![Phase {
                combine: Combine::Copy,
                ..uneven.phases[0].clone()
            }],
            ..uneven
        };
        assert_eq!(check(gather), Ok(()));
    }
}
