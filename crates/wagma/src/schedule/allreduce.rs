//! Allreduce (sum) schedules inside a group of ranks.

use smallvec::smallvec;

use super::{AlgorithmChoice, AllreduceAlgorithm, Combine, Phase, Schedule, Transfer};
use crate::Rank;
use crate::payload::Reduce;

/// The allreduce of a buffer of `len` elements among `members` (sorted, containing `rank`),
/// with the algorithm `choice` resolves to. A rank outside `members` gets an empty schedule.
pub fn allreduce(rank: Rank, members: &[Rank], len: usize, choice: &AlgorithmChoice) -> Schedule {
    match choice.resolve(members.len(), len) {
        AllreduceAlgorithm::RecursiveDoubling => recursive_doubling(rank, members, len),
        AllreduceAlgorithm::ReduceBroadcast => reduce_broadcast(rank, members, len),
        _ => reduce_scatter_allgather(rank, members, len),
    }
}

/// Reduce then broadcast: every other member hands its buffer to the lowest (step 0), which
/// folds them in rank order, and the lowest hands the sum back to each (step 1). Each member
/// sends one whole buffer, the lowest `n - 1`.
pub fn reduce_broadcast(rank: Rank, members: &[Rank], len: usize) -> Schedule {
    let (Some(&root), true) = (members.first(), members.contains(&rank)) else {
        return Schedule::default();
    };
    if members.len() <= 1 {
        return Schedule {
            len,
            phases: Vec::new(),
        };
    }
    let others: Vec<Rank> = members[1..].to_vec();
    let phases = if rank == root {
        vec![
            Phase {
                sends: smallvec![],
                recvs: others.iter().map(|&m| whole(m, len, 0)).collect(),
                combine: Combine::Reduce(Reduce::Sum),
            },
            Phase {
                sends: others.iter().map(|&m| whole(m, len, 1)).collect(),
                recvs: smallvec![],
                combine: Combine::Copy,
            },
        ]
    } else {
        vec![
            Phase {
                sends: smallvec![whole(root, len, 0)],
                recvs: smallvec![],
                combine: Combine::Copy,
            },
            Phase {
                sends: smallvec![],
                recvs: smallvec![whole(root, len, 1)],
                combine: Combine::Copy,
            },
        ]
    };
    Schedule { len, phases }
}

fn whole(peer: Rank, len: usize, step: u16) -> Transfer {
    Transfer {
        peer,
        range: 0..len,
        step,
    }
}

/// Recursive doubling: with `q` the largest power of two not above the group size, the members
/// beyond `q` first hand their buffer to a partner (step 0), the first `q` members exchange
/// whole buffers with the member `2^k` positions away (steps 1..=log2 q), and the partners hand
/// the result back (last step). Each rank sends `log2 q` whole buffers (plus one if folded).
pub fn recursive_doubling(rank: Rank, members: &[Rank], len: usize) -> Schedule {
    let Ok(idx) = members.binary_search(&rank) else {
        return Schedule::default();
    };
    let n = members.len();
    let mut phases = Vec::new();
    if n <= 1 {
        return Schedule { len, phases };
    }
    let q = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let levels = q.trailing_zeros() as u16;
    let out_step = levels + 1;
    if idx >= q {
        let partner = members[idx - q];
        phases.push(Phase {
            sends: smallvec![whole(partner, len, 0)],
            recvs: smallvec![],
            combine: Combine::Copy,
        });
        phases.push(Phase {
            sends: smallvec![],
            recvs: smallvec![whole(partner, len, out_step)],
            combine: Combine::Copy,
        });
        return Schedule { len, phases };
    }
    let extra = (idx + q < n).then(|| members[idx + q]);
    if let Some(e) = extra {
        phases.push(Phase {
            sends: smallvec![],
            recvs: smallvec![whole(e, len, 0)],
            combine: Combine::Reduce(Reduce::Sum),
        });
    }
    for k in 0..levels {
        let partner = members[idx ^ (1 << k)];
        phases.push(Phase {
            sends: smallvec![whole(partner, len, k + 1)],
            recvs: smallvec![whole(partner, len, k + 1)],
            combine: Combine::Reduce(Reduce::Sum),
        });
    }
    if let Some(e) = extra {
        phases.push(Phase {
            sends: smallvec![whole(e, len, out_step)],
            recvs: smallvec![],
            combine: Combine::Copy,
        });
    }
    Schedule { len, phases }
}

/// Chunk `c` of `n` over `len` elements: `[c*len/n, (c+1)*len/n)`.
pub(crate) fn chunk(c: usize, n: usize, len: usize) -> std::ops::Range<usize> {
    (c * len / n)..((c + 1) * len / n)
}

/// Reduce-scatter + allgather, bandwidth-optimal (each rank sends `2(S-1)/S` of the buffer).
/// Power-of-two groups use recursive halving then recursive doubling (Rabenseifner's
/// algorithm: `2 log2 S` messages, and the same reduction tree as recursive doubling, so the
/// two give identical bits); other groups use the direct exchange (`2(S-1)` messages, sums in
/// rank order).
pub fn reduce_scatter_allgather(rank: Rank, members: &[Rank], len: usize) -> Schedule {
    let Ok(idx) = members.binary_search(&rank) else {
        return Schedule::default();
    };
    let n = members.len();
    if n <= 1 {
        return Schedule {
            len,
            phases: Vec::new(),
        };
    }
    if n.is_power_of_two() {
        return halving_doubling(idx, members, len);
    }
    direct(idx, members, len)
}

/// Recursive halving (step k: keep the half of the current range selected by bit k of the
/// position, send the other half to the member differing in bit k, sum) then recursive
/// doubling of the owned ranges in reverse order.
fn halving_doubling(idx: usize, members: &[Rank], len: usize) -> Schedule {
    let levels = members.len().trailing_zeros() as u16;
    let mut phases = Vec::with_capacity(2 * levels as usize);
    let mut spans = Vec::with_capacity(levels as usize);
    let (mut lo, mut hi) = (0usize, len);
    let split = |lo: usize, hi: usize, k: u16| {
        let mid = lo + (hi - lo) / 2;
        if idx & (1 << k) == 0 {
            (lo..mid, mid..hi)
        } else {
            (mid..hi, lo..mid)
        }
    };
    for k in 0..levels {
        let peer = members[idx ^ (1 << k)];
        let (keep, give) = split(lo, hi, k);
        spans.push((lo, hi));
        phases.push(Phase {
            sends: smallvec![Transfer {
                peer,
                range: give,
                step: k,
            }],
            recvs: smallvec![Transfer {
                peer,
                range: keep.clone(),
                step: k,
            }],
            combine: Combine::Reduce(Reduce::Sum),
        });
        (lo, hi) = (keep.start, keep.end);
    }
    for k in (0..levels).rev() {
        let peer = members[idx ^ (1 << k)];
        let (plo, phi) = spans[k as usize];
        let (mine, theirs) = split(plo, phi, k);
        let step = 2 * levels - 1 - k;
        phases.push(Phase {
            sends: smallvec![Transfer {
                peer,
                range: mine,
                step,
            }],
            recvs: smallvec![Transfer {
                peer,
                range: theirs,
                step,
            }],
            combine: Combine::Copy,
        });
    }
    Schedule { len, phases }
}

/// Direct reduce-scatter + allgather: member `i` owns chunk `i`; every member sends each
/// chunk to its owner (step 0), the owner sums its chunk in rank order, then sends it to every
/// member (step 1).
fn direct(idx: usize, members: &[Rank], len: usize) -> Schedule {
    let n = members.len();
    let mine = chunk(idx, n, len);
    // Send order starts after our own position so that owners are not all hit at once.
    let others: Vec<usize> = (1..n).map(|k| (idx + k) % n).collect();
    let scatter = Phase {
        sends: others
            .iter()
            .map(|&j| Transfer {
                peer: members[j],
                range: chunk(j, n, len),
                step: 0,
            })
            .collect(),
        recvs: others
            .iter()
            .map(|&j| Transfer {
                peer: members[j],
                range: mine.clone(),
                step: 0,
            })
            .collect(),
        combine: Combine::Reduce(Reduce::Sum),
    };
    let gather = Phase {
        sends: others
            .iter()
            .map(|&j| Transfer {
                peer: members[j],
                range: mine.clone(),
                step: 1,
            })
            .collect(),
        recvs: others
            .iter()
            .map(|&j| Transfer {
                peer: members[j],
                range: chunk(j, n, len),
                step: 1,
            })
            .collect(),
        combine: Combine::Copy,
    };
    Schedule {
        len,
        phases: vec![scatter, gather],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends and receives must pair up exactly across the members, and each member's program
    /// must pass the engine's check.
    fn check_matching(members: &[Rank], len: usize, f: fn(Rank, &[Rank], usize) -> Schedule) {
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let ranks = members.iter().max().map_or(0, |m| m + 1);
        for &r in members {
            let schedule = f(r, members, len);
            assert_eq!(schedule.check(r, ranks), Ok(()), "rank {r} of {members:?}");
            for p in schedule.phases {
                for t in p.sends {
                    sends.push((r, t.peer, t.step, t.range.len()));
                }
                for t in p.recvs {
                    recvs.push((t.peer, r, t.step, t.range.len()));
                }
            }
        }
        sends.sort_unstable();
        recvs.sort_unstable();
        assert_eq!(sends, recvs, "members {members:?}");
    }

    #[test]
    fn transfers_pair_up() {
        for n in 1..20 {
            let members: Vec<Rank> = (0..n).map(|i| 3 * i + 1).collect();
            for len in [0, 1, 5, 64] {
                check_matching(&members, len, recursive_doubling);
                check_matching(&members, len, reduce_scatter_allgather);
                check_matching(&members, len, reduce_broadcast);
            }
        }
    }

    #[test]
    fn a_maximum_runs_the_same_program_taking_the_maximum_where_it_summed() {
        let members: Vec<Rank> = (0..6).collect();
        for f in [
            recursive_doubling,
            reduce_scatter_allgather,
            reduce_broadcast,
        ] {
            for &r in &members {
                let sum = f(r, &members, 40);
                let max = sum.clone().with_reduction(Reduce::Max);
                assert_eq!(max.cost(), sum.cost());
                assert_eq!(max.reduction_traffic(), sum.reduction_traffic());
                assert_eq!(max.phases.len(), sum.phases.len());
                for (m, s) in max.phases.iter().zip(&sum.phases) {
                    assert_eq!((&m.sends, &m.recvs), (&s.sends, &s.recvs));
                    let want = match s.combine {
                        Combine::Reduce(Reduce::Sum) => Combine::Reduce(Reduce::Max),
                        other => other,
                    };
                    assert_eq!(m.combine, want);
                }
            }
        }
    }

    #[test]
    fn pairs_reduce_once_with_shared_memory_and_exchange_once_where_parts_fold() {
        let shared = AlgorithmChoice {
            shared_memory: true,
            ..AlgorithmChoice::default()
        };
        assert_eq!(
            shared.resolve(2, 1 << 20),
            AllreduceAlgorithm::ReduceBroadcast
        );
        assert_eq!(shared.resolve(4, 10), AllreduceAlgorithm::RecursiveDoubling);
        assert_eq!(
            AlgorithmChoice::default().resolve(2, 1 << 20),
            AllreduceAlgorithm::ReduceScatterAllgather
        );
        // Where the transport sums on arrival: recursive doubling, the least bytes in one
        // message, whatever the size; groups of four as before.
        let folding = AlgorithmChoice {
            fold_on_arrival: true,
            ..AlgorithmChoice::default()
        };
        for len in [10, 1 << 20] {
            assert_eq!(
                folding.resolve(2, len),
                AllreduceAlgorithm::RecursiveDoubling
            );
        }
        assert_eq!(
            folding.resolve(4, 1 << 20),
            AllreduceAlgorithm::ReduceScatterAllgather
        );
        // The lowest member sums once; the other sends its buffer and receives the result.
        let (lo, hi) = (
            reduce_broadcast(3, &[3, 8], 100),
            reduce_broadcast(8, &[3, 8], 100),
        );
        assert_eq!(lo.reduction_traffic(), 1200);
        assert_eq!(hi.reduction_traffic(), 0);
        assert_eq!((lo.cost().messages, hi.cost().messages), (1, 1));
        assert_eq!(reduce_broadcast(5, &[3, 8], 100), Schedule::default());
    }

    #[test]
    fn costs() {
        let m: Vec<Rank> = (0..8).collect();
        let rd = recursive_doubling(3, &m, 1000).cost();
        assert_eq!((rd.messages, rd.bytes, rd.phases), (3, 12000, 3));
        let rs = reduce_scatter_allgather(3, &m, 1000).cost();
        assert_eq!(rs.messages, 6);
        assert_eq!(rs.bytes, 2 * 4 * (500 + 250 + 125));
        let m6: Vec<Rank> = (0..6).collect();
        let d = reduce_scatter_allgather(3, &m6, 600).cost();
        assert_eq!(d.messages, 10);
        assert_eq!(d.bytes, 4 * (600 - 100) + 4 * 100 * 5);
        // Folded member of a 5-group: one send in, one result back.
        let m5: Vec<Rank> = (0..5).collect();
        assert_eq!(recursive_doubling(4, &m5, 10).cost().messages, 1);
        assert_eq!(recursive_doubling(0, &m5, 10).cost().messages, 3);
        assert_eq!(recursive_doubling(9, &m5, 10), Schedule::default());
    }

    #[test]
    fn reduction_traffic_counts_every_operand_and_the_result() {
        // A pair: read both buffers, write the sum (3 buffers of 4000 bytes).
        let pair: Vec<Rank> = vec![0, 1];
        assert_eq!(
            recursive_doubling(0, &pair, 1000).reduction_traffic(),
            12000
        );
        // Recursive doubling over 8: three whole-buffer sums.
        let m: Vec<Rank> = (0..8).collect();
        assert_eq!(recursive_doubling(3, &m, 1000).reduction_traffic(), 36000);
        // Reduce-scatter over 8: halves, quarters, eighths summed; the allgather copies.
        let rs = reduce_scatter_allgather(3, &m, 1000).reduction_traffic();
        assert_eq!(rs, 3 * 4 * (500 + 250 + 125));
    }

    proptest::proptest! {
        /// The engine builds a group's schedule over positions `0..n` and maps each peer to
        /// the member at that position: every builder may depend on the members only through
        /// their order.
        #[test]
        fn a_schedule_over_positions_is_the_schedule_over_the_members(
            gaps in proptest::collection::vec(1usize..50, 1..40),
            first in 0usize..1000,
            len in 0usize..200,
        ) {
            let members: Vec<Rank> = gaps
                .iter()
                .scan(first, |r, &gap| { *r += gap; Some(*r) })
                .collect();
            let positions: Vec<Rank> = (0..members.len()).collect();
            let relabel = |mut s: Schedule| {
                for phase in &mut s.phases {
                    for t in phase.sends.iter_mut().chain(phase.recvs.iter_mut()) {
                        t.peer = members[t.peer];
                    }
                }
                s
            };
            for (pos, &rank) in members.iter().enumerate() {
                for f in [recursive_doubling, reduce_scatter_allgather, reduce_broadcast] {
                    proptest::prop_assert_eq!(relabel(f(pos, &positions, len)), f(rank, &members, len));
                }
                let living = |m: &[Rank]| m.iter().copied().step_by(2).collect::<Vec<_>>();
                proptest::prop_assert_eq!(
                    relabel(crate::schedule::exchange_among(pos, living(&positions), len)),
                    crate::schedule::exchange_among(rank, living(&members), len)
                );
            }
        }
    }

    #[test]
    fn auto_choice() {
        let c = AlgorithmChoice::default();
        assert_eq!(c.resolve(4, 100), AllreduceAlgorithm::RecursiveDoubling);
        assert_eq!(
            c.resolve(3, 100),
            AllreduceAlgorithm::ReduceScatterAllgather
        );
        assert_eq!(
            c.resolve(4, 1 << 20),
            AllreduceAlgorithm::ReduceScatterAllgather
        );
    }
}
