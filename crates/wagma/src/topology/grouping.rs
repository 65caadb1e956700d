//! Groups per round: the dynamic butterfly, its generalization to any P and S, and the fixed and
//! random groupings used by the ablations.
//!
//! # The rule
//! * **P and S powers of two** (the paper's rule, with wrap-around): in round t the group of rank
//!   r is every rank that differs from r only in the bit positions
//!   `{(t*log2 S + j) mod log2 P : j < log2 S}`. Example P = 8, S = 4: round 0 gives
//!   `{0,1,2,3},{4,5,6,7}`, round 1 gives `{0,1,4,5},{2,3,6,7}`.
//! * **Other P, S** (mixed radix): let `m = ceil(log_S P)`. If P is the product of `m` factors
//!   no larger than S, the ranks are numbered in that mixed radix (the most balanced factors are
//!   chosen) and round t groups the ranks that differ only in digit `t mod m`. Every group of a
//!   round has the same size and any `m` consecutive rounds mix every rank with every other (the
//!   optimum: a group of at most S members can spread a model at most S-fold per round).
//!   Otherwise (P has a prime factor above S, for example) the digits are balanced with a
//!   product just above P; numbers `>= P` are missing, so some groups of the round come out
//!   short, and short groups are merged while the merged size stays at most S. Mixing is then
//!   guaranteed within `2m` rounds: a model first walks down (each digit to the smaller of the
//!   two ranks' digits) and then up, never through a missing number. Mixing within `m` rounds is
//!   impossible for some of these (P, S): with P = 7, S = 2 the rank left alone in a round reaches
//!   at most 4 ranks in 3 rounds. [`Grouping::mixing_rounds`] returns the bound that holds.
//! * **Fixed**: round 0's partition in every round (never mixes across groups).
//! * **Random(seed)**: each round a seeded permutation cut into `ceil(P/S)` groups of as equal
//!   sizes as possible.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::Rank;
use crate::error::ConfigError;

/// How groups are formed each round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum GroupingKind {
    /// The dynamic butterfly (default).
    #[default]
    Butterfly,
    /// Round 0's groups forever.
    Fixed,
    /// A fresh seeded random partition each round.
    Random {
        /// Seed shared by all ranks.
        seed: u64,
    },
}

impl std::str::FromStr for GroupingKind {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "butterfly" => Ok(GroupingKind::Butterfly),
            "fixed" => Ok(GroupingKind::Fixed),
            "random" => Ok(GroupingKind::Random { seed: 0 }),
            _ => match s.strip_prefix("random(").and_then(|r| r.strip_suffix(')')) {
                Some(seed) => seed
                    .trim()
                    .parse()
                    .map(|seed| GroupingKind::Random { seed })
                    .map_err(|_| ConfigError::Invalid {
                        what: "groups",
                        detail: format!("bad seed in {s:?}"),
                    }),
                None => Err(ConfigError::Invalid {
                    what: "groups",
                    detail: format!("{s:?} (expected butterfly, fixed, random or random(SEED))"),
                }),
            },
        }
    }
}

impl std::fmt::Display for GroupingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GroupingKind::Butterfly => f.write_str("butterfly"),
            GroupingKind::Fixed => f.write_str("fixed"),
            GroupingKind::Random { seed } => write!(f, "random({seed})"),
        }
    }
}

/// The default group size: `2^ceil(log2(P)/2)`, sqrt(P) rounded up to a power of two, capped at
/// P (P = 8: 4, P = 16: 4, P = 64: 8, P = 12: 4).
pub fn default_group_size(ranks: usize) -> usize {
    if ranks <= 1 {
        return 1;
    }
    let log2 = ceil_log2(ranks);
    (1usize << log2.div_ceil(2)).min(ranks)
}

/// `ceil(log2 n)` for n >= 1.
pub(crate) fn ceil_log2(n: usize) -> u32 {
    debug_assert!(n >= 1);
    usize::BITS - (n - 1).leading_zeros()
}

/// Smallest m with `s^m >= p` (p >= 1, s >= 2).
fn ceil_log(p: usize, s: usize) -> usize {
    let mut m = 0;
    let mut reach = 1usize;
    while reach < p {
        reach = reach.saturating_mul(s);
        m += 1;
    }
    m
}

#[derive(Debug, Clone)]
enum Layout {
    /// P == 1, S == 1 or S == P: the same partition every round.
    Trivial,
    /// Powers of two: `bits` bits per round out of `total` bits.
    Bits { bits: u32, total: u32 },
    /// Mixed radix (digit 0 least significant); `exact` when the product is P.
    Radix { radices: Vec<usize>, exact: bool },
}

/// Partition of the P ranks into groups, per round.
#[derive(Debug, Clone)]
pub struct Grouping {
    ranks: usize,
    group_size: usize,
    kind: GroupingKind,
    layout: Layout,
}

impl Grouping {
    /// Groups of at most `group_size` among `ranks` ranks.
    pub fn new(ranks: usize, group_size: usize, kind: GroupingKind) -> Result<Self, ConfigError> {
        if ranks == 0 {
            return Err(ConfigError::ZeroRanks);
        }
        if group_size == 0 {
            return Err(ConfigError::ZeroGroupSize);
        }
        if group_size > ranks {
            return Err(ConfigError::GroupSizeTooLarge { group_size, ranks });
        }
        let layout = if ranks == 1 || group_size == 1 || group_size == ranks {
            Layout::Trivial
        } else if ranks.is_power_of_two() && group_size.is_power_of_two() {
            Layout::Bits {
                bits: group_size.trailing_zeros(),
                total: ranks.trailing_zeros(),
            }
        } else {
            let m = ceil_log(ranks, group_size);
            match balanced_factorization(ranks, m, group_size) {
                Some(radices) => Layout::Radix {
                    radices,
                    exact: true,
                },
                None => Layout::Radix {
                    radices: truncated_radices(ranks, m, group_size),
                    exact: false,
                },
            }
        };
        Ok(Grouping {
            ranks,
            group_size,
            kind,
            layout,
        })
    }

    /// The dynamic butterfly with the default group size.
    pub fn butterfly(ranks: usize) -> Result<Self, ConfigError> {
        Self::new(ranks, default_group_size(ranks), GroupingKind::Butterfly)
    }

    /// Number of ranks P.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Largest group size S.
    pub fn group_size(&self) -> usize {
        self.group_size
    }

    /// The grouping rule.
    pub fn kind(&self) -> GroupingKind {
        self.kind
    }

    /// The partition of round `round`: groups sorted by their smallest member, members sorted.
    pub fn partition(&self, round: u64) -> Vec<Vec<Rank>> {
        let round = match self.kind {
            GroupingKind::Fixed => 0,
            _ => round,
        };
        if let GroupingKind::Random { seed } = self.kind {
            return random_partition(self.ranks, self.group_size, seed, round);
        }
        match &self.layout {
            Layout::Trivial => {
                if self.group_size == 1 {
                    (0..self.ranks).map(|r| vec![r]).collect()
                } else {
                    vec![(0..self.ranks).collect()]
                }
            }
            Layout::Bits { bits, total } => {
                let mask = bit_mask(*bits, *total, round);
                let mut groups = Vec::with_capacity(self.ranks / self.group_size);
                for r in 0..self.ranks {
                    if r & mask == 0 {
                        groups.push(subset_members(r, mask));
                    }
                }
                groups
            }
            Layout::Radix { radices, exact } => {
                let digit = (round % radices.len() as u64) as usize;
                let stride: usize = radices[..digit].iter().product();
                let radix = radices[digit];
                let mut groups = Vec::new();
                for r in 0..self.ranks {
                    if (r / stride).is_multiple_of(radix) {
                        groups.push(
                            (0..radix)
                                .map(|d| r + d * stride)
                                .filter(|&x| x < self.ranks)
                                .collect::<Vec<_>>(),
                        );
                    }
                }
                if *exact {
                    groups
                } else {
                    merge_short_groups(groups, radix, self.group_size)
                }
            }
        }
    }

    /// The sorted members of `rank`'s group in round `round`.
    pub fn group_of(&self, rank: Rank, round: u64) -> Vec<Rank> {
        if let (Layout::Bits { bits, total }, false) = (
            &self.layout,
            matches!(self.kind, GroupingKind::Random { .. }),
        ) {
            let round = if self.kind == GroupingKind::Fixed {
                0
            } else {
                round
            };
            let mask = bit_mask(*bits, *total, round);
            return subset_members(rank & !mask, mask);
        }
        self.partition(round)
            .into_iter()
            .find(|g| g.binary_search(&rank).is_ok())
            .unwrap_or_else(|| vec![rank])
    }

    /// A number of consecutive rounds after which every rank's model has reached every other
    /// rank (the product of the rounds' averaging matrices has no zero entry), starting at any
    /// round. `None` when that never happens (S = 1 or fixed groups with P > S).
    /// For random groupings this is not guaranteed and `None` is returned.
    pub fn mixing_rounds(&self) -> Option<usize> {
        if self.ranks == 1 {
            return Some(0);
        }
        if self.group_size == self.ranks {
            return Some(1);
        }
        if self.group_size == 1 || self.kind != GroupingKind::Butterfly {
            return None;
        }
        match &self.layout {
            Layout::Trivial => Some(1),
            Layout::Bits { bits, total } => Some(total.div_ceil(*bits) as usize),
            Layout::Radix { radices, exact } => Some(if *exact {
                radices.len()
            } else {
                2 * radices.len()
            }),
        }
    }

    /// `ceil(log_S P)`: the fewest rounds in which groups of S can mix P ranks.
    pub fn optimal_mixing_rounds(&self) -> usize {
        if self.ranks == 1 {
            0
        } else if self.group_size == 1 {
            usize::MAX
        } else {
            ceil_log(self.ranks, self.group_size)
        }
    }
}

/// Bits of the window used in round `round`: `{(round*bits + j) mod total : j < bits}`.
fn bit_mask(bits: u32, total: u32, round: u64) -> usize {
    let start = (round % u64::from(total)) * u64::from(bits) % u64::from(total);
    (0..bits).fold(0usize, |m, j| {
        m | 1 << ((start + u64::from(j)) % u64::from(total))
    })
}

/// All `base | s` for subsets `s` of `mask`, ascending.
fn subset_members(base: usize, mask: usize) -> Vec<Rank> {
    let mut out = Vec::with_capacity(1 << mask.count_ones());
    let mut s = 0usize;
    loop {
        out.push(base | s);
        if s == mask {
            break;
        }
        // Next subset of `mask` in increasing order.
        s = (s.wrapping_sub(mask)) & mask;
    }
    out.sort_unstable();
    out
}

/// The most balanced way to write `p` as a product of at most `m` factors in `2..=s`: the
/// largest factor is as small as possible. Factors are returned largest first.
fn balanced_factorization(p: usize, m: usize, s: usize) -> Option<Vec<usize>> {
    fn find(p: usize, m: usize, cap: usize, cur: &mut Vec<usize>) -> bool {
        if p == 1 {
            return true;
        }
        if m == 0 {
            return false;
        }
        for d in (2..=cap.min(p)).rev() {
            if p.is_multiple_of(d) {
                cur.push(d);
                if find(p / d, m - 1, d, cur) {
                    return true;
                }
                cur.pop();
            }
        }
        false
    }
    // The first cap that admits a factorization is the smallest possible largest factor.
    (2..=s).find_map(|cap| {
        let mut cur = Vec::with_capacity(m);
        find(p, m, cap, &mut cur).then_some(cur)
    })
}

/// Balanced radices whose product is at least `p`, each at most `s`, `m` of them.
fn truncated_radices(p: usize, m: usize, s: usize) -> Vec<usize> {
    let mut radices = vec![1usize; m];
    // Grow the smallest digit until the product reaches p: the result is as balanced as it
    // gets and never exceeds s because s^m >= p.
    while radices.iter().product::<usize>() < p {
        let i = (0..m)
            .min_by_key(|&i| radices[i])
            .expect("m >= 1 because p > s >= 2");
        radices[i] += 1;
    }
    debug_assert!(radices.iter().all(|&r| r <= s));
    radices
}

/// Merge the groups shorter than `full` (smallest first) while the merged size stays within
/// `s`; output sorted.
fn merge_short_groups(groups: Vec<Vec<Rank>>, full: usize, s: usize) -> Vec<Vec<Rank>> {
    let (mut short, mut out): (Vec<_>, Vec<_>) = groups.into_iter().partition(|g| g.len() < full);
    short.sort_by_key(|g| g.len());
    let mut merged: Vec<Vec<Rank>> = Vec::with_capacity(short.len());
    for g in short {
        if let Some(last) = merged.last_mut()
            && last.len() + g.len() <= s
        {
            last.extend(g);
            continue;
        }
        merged.push(g);
    }
    out.extend(merged);
    for g in &mut out {
        g.sort_unstable();
    }
    out.sort_by_key(|g| g[0]);
    out
}

fn random_partition(p: usize, s: usize, seed: u64, round: u64) -> Vec<Vec<Rank>> {
    let mut order: Vec<Rank> = (0..p).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
    let groups = p.div_ceil(s);
    let (base, extra) = (p / groups, p % groups);
    let mut out = Vec::with_capacity(groups);
    let mut at = 0;
    for g in 0..groups {
        let len = base + usize::from(g < extra);
        let mut members = order[at..at + len].to_vec();
        members.sort_unstable();
        out.push(members);
        at += len;
    }
    out.sort_by_key(|g| g[0]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paper_example_p8_s4() {
        let g = Grouping::new(8, 4, GroupingKind::Butterfly).unwrap();
        assert_eq!(g.partition(0), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(g.partition(1), vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
        // Round 2 starts at bit (2*2) mod 3 = 1: bits {1, 2}.
        assert_eq!(g.partition(2), vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        assert_eq!(g.group_of(5, 1), vec![0, 1, 4, 5]);
        assert_eq!(g.mixing_rounds(), Some(2));
    }

    #[test]
    fn default_sizes() {
        assert_eq!(default_group_size(1), 1);
        assert_eq!(default_group_size(2), 2);
        assert_eq!(default_group_size(4), 2);
        assert_eq!(default_group_size(8), 4);
        assert_eq!(default_group_size(12), 4);
        assert_eq!(default_group_size(16), 4);
        assert_eq!(default_group_size(64), 8);
        assert_eq!(default_group_size(3), 2);
    }

    #[test]
    fn bad_configurations() {
        assert_eq!(
            Grouping::new(0, 1, GroupingKind::Butterfly).unwrap_err(),
            ConfigError::ZeroRanks
        );
        assert_eq!(
            Grouping::new(4, 0, GroupingKind::Butterfly).unwrap_err(),
            ConfigError::ZeroGroupSize
        );
        assert!(matches!(
            Grouping::new(4, 5, GroupingKind::Butterfly).unwrap_err(),
            ConfigError::GroupSizeTooLarge { .. }
        ));
    }

    #[test]
    fn factorization_is_balanced() {
        assert_eq!(balanced_factorization(12, 2, 4), Some(vec![4, 3]));
        assert_eq!(balanced_factorization(36, 2, 6), Some(vec![6, 6]));
        assert_eq!(balanced_factorization(7, 2, 4), None);
        assert_eq!(balanced_factorization(6, 3, 2), None);
        assert_eq!(balanced_factorization(6, 2, 4), Some(vec![3, 2]));
        assert_eq!(truncated_radices(7, 3, 2), vec![2, 2, 2]);
    }

    #[test]
    fn fixed_and_random() {
        let f = Grouping::new(8, 2, GroupingKind::Fixed).unwrap();
        assert_eq!(f.partition(5), f.partition(0));
        let r = Grouping::new(10, 4, GroupingKind::Random { seed: 3 }).unwrap();
        let p = r.partition(7);
        assert_eq!(p.iter().map(Vec::len).sum::<usize>(), 10);
        assert_eq!(p.len(), 3);
        assert_eq!(p, r.partition(7));
        assert_ne!(p, r.partition(8));
    }

    #[test]
    fn parse_kind() {
        assert_eq!(
            "random(7)".parse::<GroupingKind>().unwrap(),
            GroupingKind::Random { seed: 7 }
        );
        assert!("bogus".parse::<GroupingKind>().is_err());
    }
}
