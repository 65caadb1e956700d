//! The binomial activation tree rooted at any rank.
//!
//! Ranks are numbered relative to the root: `v = rank XOR root` when P is a power of two (the
//! hypercube of the paper and of fflib), `v = (rank - root) mod P` otherwise. The root sends on
//! every dimension `j` with `2^j < P` to `v + 2^j`; a rank that received on dimension `k`
//! forwards on the dimensions above `k` (to `v + 2^j`, `j > k`, while `v + 2^j < P`). It reaches
//! every rank exactly once, in at most `ceil(log2 P)` hops.
//!
//! # Forwarding without duplicates ([`activation_edges`])
//! The engine forwards with [`activation_edges`], where an edge depends only on its sender and
//! its dimension, never on the root: on dimension j rank r sends to `r XOR 2^j` (P a power of
//! two: the tree above) or `(r + 2^j) mod P` (otherwise), for every `j < ceil(log2 P)` above the
//! dimension it received on. For P not a power of two this is the binomial tree of the
//! `2^ceil(log2 P)` positions `root + v mod P`, so the positions `v >= P` fold back onto ranks
//! that already have it: one activator sends fewer than `2P` messages instead of `P - 1`.
//! What it buys: a message on dimension k makes its receiver x responsible for the ranks
//! `x + (sums of distinct 2^j, k < j < ceil(log2 P))`, whatever the root. So a rank that
//! already sent on dimension j for another activator's tree can skip that edge: its receiver
//! already holds the same responsibility. By induction from the highest dimension down every
//! responsibility is met, and the root's covers everyone. Each rank therefore sends a round's
//! activation at most once per dimension, at most `ceil(log2 P)` messages per round however
//! many ranks activate it, `P * ceil(log2 P)` in all.

use crate::Rank;

/// A child in the activation tree: the rank and the dimension it is reached on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeEdge {
    /// The child rank.
    pub rank: Rank,
    /// The dimension of the edge.
    pub dim: u32,
}

/// The children of `rank` in the binomial tree rooted at `root` among `ranks` ranks.
/// `received_on` is the dimension on which `rank` received the activation (`None` for the root).
pub fn tree_children(
    root: Rank,
    rank: Rank,
    ranks: usize,
    received_on: Option<u32>,
) -> Vec<TreeEdge> {
    let v = relative(root, rank, ranks);
    let first = received_on.map_or(0, |k| k + 1);
    let mut out = Vec::new();
    let mut j = first;
    while j < usize::BITS && (1usize << j) < ranks {
        let child = v + (1usize << j);
        if child < ranks {
            out.push(TreeEdge {
                rank: absolute(root, child, ranks),
                dim: j,
            });
        }
        j += 1;
    }
    out
}

/// The edges on which `rank` forwards an activation received on dimension `received_on`
/// (`None`: it activates the round itself): one per dimension `j < ceil(log2 P)` above it, to
/// `rank XOR 2^j` when P is a power of two and to `(rank + 2^j) mod P` otherwise. Unlike
/// [`tree_children`] the edges do not depend on the root, so a rank can send each at most once
/// per round (module documentation). Ranks may receive a round's activation more than once.
pub fn activation_edges(
    rank: Rank,
    ranks: usize,
    received_on: Option<u32>,
) -> impl ExactSizeIterator<Item = TreeEdge> + Clone {
    let dims = if ranks <= 1 {
        0
    } else {
        super::grouping::ceil_log2(ranks)
    };
    let first = received_on.map_or(0, |k| k + 1);
    (first..dims).map(move |j| TreeEdge {
        rank: if ranks.is_power_of_two() {
            rank ^ (1usize << j)
        } else {
            (rank + (1usize << j)) % ranks
        },
        dim: j,
    })
}

/// The parent of `rank` in the tree rooted at `root` and the dimension it is reached on
/// (`None` for the root).
pub fn tree_parent(root: Rank, rank: Rank, ranks: usize) -> Option<TreeEdge> {
    let v = relative(root, rank, ranks);
    if v == 0 {
        return None;
    }
    let dim = usize::BITS - 1 - v.leading_zeros();
    Some(TreeEdge {
        rank: absolute(root, v - (1usize << dim), ranks),
        dim,
    })
}

fn relative(root: Rank, rank: Rank, ranks: usize) -> usize {
    if ranks.is_power_of_two() {
        rank ^ root
    } else {
        (rank + ranks - root) % ranks
    }
}

fn absolute(root: Rank, v: usize, ranks: usize) -> Rank {
    if ranks.is_power_of_two() {
        v ^ root
    } else {
        (v + root) % ranks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaches_every_rank_once() {
        for p in 1..70 {
            for root in 0..p {
                let mut seen = vec![0u32; p];
                seen[root] += 1;
                let mut frontier = vec![(root, None)];
                let mut depth = 0;
                while !frontier.is_empty() {
                    let mut next = Vec::new();
                    for (r, recv) in frontier {
                        for e in tree_children(root, r, p, recv) {
                            seen[e.rank] += 1;
                            assert_eq!(tree_parent(root, e.rank, p).unwrap().rank, r);
                            next.push((e.rank, Some(e.dim)));
                        }
                    }
                    frontier = next;
                    depth += 1;
                }
                assert!(seen.iter().all(|&c| c == 1), "p={p} root={root}");
                assert!(depth <= 1 + super::super::grouping::ceil_log2(p) as usize);
            }
        }
    }

    /// Flood with per-dimension de-duplication, from any set of activators and in any order of
    /// delivery (LIFO, FIFO and a seeded shuffle): everyone is reached, no rank sends on a
    /// dimension twice.
    #[test]
    fn deduplicated_edges_reach_everyone_from_any_activators() {
        for p in 1..40usize {
            let dims = if p <= 1 {
                0
            } else {
                super::super::grouping::ceil_log2(p)
            };
            for pattern in 0..6usize {
                let roots: Vec<Rank> = match pattern {
                    0 => vec![0],
                    1 => vec![p - 1],
                    2 => (0..p).collect(),
                    3 => (0..p).step_by(3).collect(),
                    4 => (0..p).rev().step_by(2).collect(),
                    _ => vec![p / 2, 0],
                };
                let mut sent = vec![0u64; p];
                let mut reached = vec![false; p];
                let mut queue: std::collections::VecDeque<(Rank, Option<u32>)> =
                    roots.iter().map(|&r| (r, None)).collect();
                let mut step = 0usize;
                while let Some((r, recv)) = if pattern.is_multiple_of(2) {
                    queue.pop_front()
                } else {
                    queue.pop_back()
                } {
                    step += 1;
                    reached[r] = true;
                    for e in activation_edges(r, p, recv) {
                        assert!(e.dim < dims);
                        if sent[r] & (1 << e.dim) == 0 {
                            sent[r] |= 1 << e.dim;
                            queue.push_back((e.rank, Some(e.dim)));
                        }
                    }
                    if step.is_multiple_of(5) && queue.len() > 1 {
                        queue.rotate_left(step % queue.len());
                    }
                }
                assert!(reached.iter().all(|&b| b), "p={p} pattern {pattern}");
                assert!(sent.iter().all(|m| m.count_ones() <= dims));
            }
        }
    }

    #[test]
    fn paper_figure_one() {
        // P = 4, root 1: P1 activates P0 (dim 0) and P3 (dim 1); P0 forwards to P2 (dim 1).
        let c = tree_children(1, 1, 4, None);
        assert_eq!(c.iter().map(|e| e.rank).collect::<Vec<_>>(), vec![0, 3]);
        assert_eq!(tree_children(1, 0, 4, Some(0))[0].rank, 2);
        assert!(tree_children(1, 3, 4, Some(1)).is_empty());
    }
}
