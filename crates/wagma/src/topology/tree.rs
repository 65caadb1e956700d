//! The binomial activation tree rooted at any rank.
//!
//! Ranks are numbered relative to the root: `v = rank XOR root` when P is a power of two (the
//! hypercube of the paper and of fflib), `v = (rank - root) mod P` otherwise. The root sends on
//! every dimension `j` with `2^j < P` to `v + 2^j`; a rank that received on dimension `k`
//! forwards on the dimensions above `k` (to `v + 2^j`, `j > k`, while `v + 2^j < P`). It reaches
//! every rank exactly once, in at most `ceil(log2 P)` hops.

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

    #[test]
    fn paper_figure_one() {
        // P = 4, root 1: P1 activates P0 (dim 0) and P3 (dim 1); P0 forwards to P2 (dim 1).
        let c = tree_children(1, 1, 4, None);
        assert_eq!(c.iter().map(|e| e.rank).collect::<Vec<_>>(), vec![0, 3]);
        assert_eq!(tree_children(1, 0, 4, Some(0))[0].rank, 2);
        assert!(tree_children(1, 3, 4, Some(1)).is_empty());
    }
}
