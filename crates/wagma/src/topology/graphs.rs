//! Peer graphs of the decentralized baselines: the ring of D-PSGD, the time-varying directed
//! exponential graph of SGP and the active/passive pairing of AD-PSGD.

use serde::{Deserialize, Serialize};

use crate::Rank;
use crate::error::ConfigError;

use super::grouping::ceil_log2;

/// The distinct ring neighbours of `rank` (left and right), sorted; empty for P = 1 and a single
/// neighbour for P = 2.
pub fn ring_neighbors(rank: Rank, ranks: usize) -> Vec<Rank> {
    if ranks <= 1 {
        return Vec::new();
    }
    let left = (rank + ranks - 1) % ranks;
    let right = (rank + 1) % ranks;
    let mut n = vec![left, right];
    n.sort_unstable();
    n.dedup();
    n
}

/// Which powers of two SGP's n peers sit at in iteration t, with `L = ceil(log2 P)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PeerOffsets {
    /// `2^((t*n + k) mod L)`, `k < n`: each iteration takes the next n powers, so a rank's
    /// pushes cover all L distances every `L/n` iterations (the SGP paper's schedule).
    #[default]
    Disjoint,
    /// `2^((t + k) mod L)`, `k < n`: consecutive iterations share n - 1 offsets, as the
    /// WAGMA-SGD authors' SGP baseline does (with n = 2).
    Sliding,
}

impl std::str::FromStr for PeerOffsets {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "disjoint" => Ok(PeerOffsets::Disjoint),
            "sliding" => Ok(PeerOffsets::Sliding),
            _ => Err(ConfigError::Invalid {
                what: "peer offsets",
                detail: format!("{s:?} (expected disjoint or sliding)"),
            }),
        }
    }
}

impl std::fmt::Display for PeerOffsets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerOffsets::Disjoint => "disjoint",
            PeerOffsets::Sliding => "sliding",
        })
    }
}

/// The time-varying directed exponential graph of SGP: in iteration t every rank pushes to the
/// ranks at n power-of-two offsets below P chosen by a [`PeerOffsets`] rule. All ranks use the
/// same offsets in an iteration, so every rank also receives from exactly n ranks.
#[derive(Debug, Clone)]
pub struct ExponentialGraph {
    ranks: usize,
    peers: usize,
    levels: u32,
    rule: PeerOffsets,
}

impl ExponentialGraph {
    /// `peers` out-neighbours per iteration among `ranks` ranks, at disjoint offsets.
    pub fn new(ranks: usize, peers: usize) -> Result<Self, ConfigError> {
        Self::with_offsets(ranks, peers, PeerOffsets::Disjoint)
    }

    /// `peers` out-neighbours per iteration among `ranks` ranks, at the offsets of `rule`.
    pub fn with_offsets(
        ranks: usize,
        peers: usize,
        rule: PeerOffsets,
    ) -> Result<Self, ConfigError> {
        if ranks == 0 {
            return Err(ConfigError::ZeroRanks);
        }
        let levels = if ranks > 1 { ceil_log2(ranks) } else { 0 };
        if peers == 0 || peers >= ranks || peers > levels as usize {
            return Err(ConfigError::TooManyPeers {
                peers,
                ranks,
                max: levels as usize,
            });
        }
        Ok(ExponentialGraph {
            ranks,
            peers,
            levels,
            rule,
        })
    }

    /// Number of out-neighbours per iteration.
    pub fn peers(&self) -> usize {
        self.peers
    }

    fn offsets(&self, iteration: u64) -> impl Iterator<Item = usize> + '_ {
        let levels = u64::from(self.levels);
        let first = match self.rule {
            PeerOffsets::Disjoint => iteration.wrapping_mul(self.peers as u64),
            PeerOffsets::Sliding => iteration,
        };
        (0..self.peers as u64).map(move |k| 1usize << (first.wrapping_add(k) % levels))
    }

    /// Ranks `rank` pushes to in `iteration`, sorted.
    pub fn out_peers(&self, rank: Rank, iteration: u64) -> Vec<Rank> {
        let mut v: Vec<Rank> = self
            .offsets(iteration)
            .map(|o| (rank + o) % self.ranks)
            .collect();
        v.sort_unstable();
        v
    }

    /// Ranks that push to `rank` in `iteration`, sorted.
    pub fn in_peers(&self, rank: Rank, iteration: u64) -> Vec<Rank> {
        let mut v: Vec<Rank> = self
            .offsets(iteration)
            .map(|o| (rank + self.ranks - o) % self.ranks)
            .collect();
        v.sort_unstable();
        v
    }
}

/// Role of a rank in AD-PSGD's bipartite pairing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairRole {
    /// Initiates an averaging with a passive peer after each local step.
    Active,
    /// Answers averaging requests from its engine; never initiates.
    Passive,
}

/// AD-PSGD's pairing: even ranks are active, odd ranks passive (with an odd P the last rank is
/// passive too). Active rank `2i` in its iteration t averages with the passive rank at index
/// `(i + 2^(t mod L) - 1) mod Q` among the Q passive ranks: peers at changing distances, and an
/// active rank never talks to another active one.
#[derive(Debug, Clone)]
pub struct Pairing {
    ranks: usize,
    passive: Vec<Rank>,
    levels: u32,
}

impl Pairing {
    /// The pairing for `ranks` ranks.
    pub fn new(ranks: usize) -> Result<Self, ConfigError> {
        if ranks == 0 {
            return Err(ConfigError::ZeroRanks);
        }
        let passive: Vec<Rank> = (0..ranks)
            .filter(|&r| r % 2 == 1 || (ranks % 2 == 1 && r == ranks - 1 && ranks > 1))
            .collect();
        let levels = ceil_log2(passive.len().max(1)) + 1;
        Ok(Pairing {
            ranks,
            passive,
            levels,
        })
    }

    /// The role of `rank` (a single rank is passive: it has nobody to average with).
    pub fn role(&self, rank: Rank) -> PairRole {
        if self.ranks == 1 || self.passive.binary_search(&rank).is_ok() {
            PairRole::Passive
        } else {
            PairRole::Active
        }
    }

    /// The passive peer of active rank `rank` in its iteration `iteration`.
    pub fn peer(&self, rank: Rank, iteration: u64) -> Option<Rank> {
        if self.role(rank) != PairRole::Active {
            return None;
        }
        let q = self.passive.len();
        let distance = (1usize << (iteration % u64::from(self.levels))) - 1;
        Some(self.passive[(rank / 2 + distance) % q])
    }

    /// The passive peer of active rank `rank` in its `n`-th exchange of the WAGMA-SGD
    /// authors' gossip loop: exchanges alternate forward and backward, and each pair of them
    /// moves one level further, cycling through floor(log2 P) levels. For active rank r
    /// (P even) level 0 gives r + 1 and r - 1, level k > 0 gives r + 2^k + 1 and r - 2^k - 1.
    pub fn gossip_peer(&self, rank: Rank, n: u64) -> Option<Rank> {
        if self.role(rank) != PairRole::Active {
            return None;
        }
        let q = self.passive.len() as u64;
        let levels = u64::from(self.ranks.max(2).ilog2());
        let level = (n / 2) % levels;
        let forward = (if level == 0 { 0 } else { 1u64 << (level - 1) }) % q;
        let i = (rank / 2) as u64 % q;
        let index = if n.is_multiple_of(2) {
            (i + forward) % q
        } else {
            (i + 2 * q - forward - 1) % q
        };
        Some(self.passive[index as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring() {
        assert_eq!(ring_neighbors(0, 1), Vec::<Rank>::new());
        assert_eq!(ring_neighbors(0, 2), vec![1]);
        assert_eq!(ring_neighbors(0, 3), vec![1, 2]);
        assert_eq!(ring_neighbors(4, 8), vec![3, 5]);
    }

    #[test]
    fn exponential_graph_is_regular() {
        for p in 2..40 {
            for n in 1..=ceil_log2(p) as usize {
                if n >= p {
                    continue;
                }
                for rule in [PeerOffsets::Disjoint, PeerOffsets::Sliding] {
                    let g = ExponentialGraph::with_offsets(p, n, rule).unwrap();
                    for t in 0..10 {
                        let mut indeg = vec![0; p];
                        for r in 0..p {
                            let out = g.out_peers(r, t);
                            assert_eq!(out.len(), n, "p={p} n={n}");
                            assert!(!out.contains(&r));
                            for o in out {
                                indeg[o] += 1;
                                assert!(g.in_peers(o, t).contains(&r));
                            }
                        }
                        assert!(indeg.iter().all(|&d| d == n));
                    }
                }
            }
        }
        assert!(ExponentialGraph::new(8, 8).is_err());
        assert!(ExponentialGraph::new(8, 4).is_err());
        assert!(ExponentialGraph::new(8, 0).is_err());
    }

    #[test]
    fn offsets_follow_their_rule() {
        let peers_at = |rule, t| {
            let g = ExponentialGraph::with_offsets(64, 2, rule).unwrap();
            g.out_peers(0, t)
        };
        // L = 6: disjoint takes two new powers per iteration, sliding moves one power along.
        let disjoint: Vec<_> = (0..4).map(|t| peers_at(PeerOffsets::Disjoint, t)).collect();
        assert_eq!(disjoint, [[1, 2], [4, 8], [16, 32], [1, 2]]);
        let sliding: Vec<_> = (0..7).map(|t| peers_at(PeerOffsets::Sliding, t)).collect();
        assert_eq!(
            sliding,
            [[1, 2], [2, 4], [4, 8], [8, 16], [16, 32], [1, 32], [1, 2]]
        );
        let g = ExponentialGraph::with_offsets(64, 2, PeerOffsets::Sliding).unwrap();
        assert_eq!(g.in_peers(0, 5), [32, 63]);
        for rule in ["disjoint", "sliding"] {
            assert_eq!(rule.parse::<PeerOffsets>().unwrap().to_string(), rule);
        }
        assert!("cycling".parse::<PeerOffsets>().is_err());
    }

    #[test]
    fn pairing_is_bipartite() {
        for p in 1..20 {
            let pairing = Pairing::new(p).unwrap();
            for r in 0..p {
                for t in 0..12 {
                    match pairing.peer(r, t) {
                        Some(q) => {
                            assert_eq!(pairing.role(r), PairRole::Active);
                            assert_eq!(pairing.role(q), PairRole::Passive);
                        }
                        None => assert_eq!(pairing.role(r), PairRole::Passive),
                    }
                }
            }
        }
        let p = Pairing::new(8).unwrap();
        let peers: Vec<_> = (0..4).map(|t| p.peer(0, t).unwrap()).collect();
        assert_eq!(peers, vec![1, 3, 7, 1]);
    }

    #[test]
    fn gossip_peers_are_passive_and_follow_the_authors_distances() {
        for p in 1..40 {
            let pairing = Pairing::new(p).unwrap();
            for r in 0..p {
                for n in 0..30 {
                    match pairing.gossip_peer(r, n) {
                        Some(q) => assert_eq!(pairing.role(q), PairRole::Passive, "p={p} r={r}"),
                        None => assert_eq!(pairing.role(r), PairRole::Passive),
                    }
                }
            }
        }
        // P = 64: forward r+1, r+3, r+5, r+9, r+17, r+33; backward r-1, r-3, r-5, ...
        let pairing = Pairing::new(64).unwrap();
        let peers: Vec<_> = (0..14)
            .map(|n| pairing.gossip_peer(10, n).unwrap())
            .collect();
        assert_eq!(
            peers,
            vec![11, 9, 13, 7, 15, 5, 19, 1, 27, 57, 43, 41, 11, 9]
        );
    }
}
