//! Groups per round: the dynamic butterfly, its generalization to any P and S, and the fixed and
//! random groupings used by the ablations.
//!
//! # The rule
//! * **P and S powers of two** (the paper's rule, with wrap-around): in round t the group of rank
//!   r is every rank that differs from r only in the bit positions
//!   `{(t*log2 S + j) mod log2 P : j < log2 S}`. Example P = 8, S = 4: round 0 gives
//!   `{0,1,2,3},{4,5,6,7}`, round 1 gives `{0,1,4,5},{2,3,6,7}`.
//! * **P a product of `m = ceil(log_S P)` factors no larger than S** (mixed radix): the ranks are
//!   numbered in that mixed radix (the most balanced factors are chosen) and round t groups the
//!   ranks that differ only in digit `t mod m`. Every group of a round has the same size and any
//!   `m` consecutive rounds mix every rank with every other: the optimum (see below).
//! * **Any other P <= 64** (searched table): each round is a partition into `c = ceil(P/S)`
//!   groups whose sizes are `floor(P/c)` or `ceil(P/c)` (the fewest groups, sizes differing by at
//!   most one), and the schedule repeats with period R, where R is the smallest number for which
//!   a deterministic local search (seeded, integer only, so every rank computes the same table)
//!   finds R partitions whose every cyclic window of R rounds mixes. The search starts at the
//!   lower bound below, so when it succeeds there the schedule is optimal. For S = 2 and
//!   P = 26, 28, 29, 30, 31, 38 and 40, where the local search stops a round above the bound,
//!   pair schedules found offline reach it (`PAIR_SCHEDULES`, checked before use). P = 26 has
//!   no period-5 schedule among the circulant bipartite ones (round t pairs `x < 13` with
//!   `13 + (x + o_t) mod 13`, Knödel's gossip graphs), but one of period 4 whose every window
//!   of 5 consecutive rounds mixes; so the window can exceed the period. Every P <= 40 with
//!   every S reaches the bound (checked by `tests/topology.rs`). Between 41 and 64 ranks it
//!   finds the bound for most S and one or two rounds
//!   more for some S <= 4 (P = 60, S = 4: 4 rounds for a bound of 3, where the merged radix
//!   needs 6). The P = 7, S = 4 table is, for example, 2 rounds where the old mixed radix
//!   needed 4. The search costs up to about a second (optimized build) for the hardest P, once
//!   per process.
//! * **Larger P that is not such a product**: the digits are balanced with a product just above
//!   P; numbers `>= P` are missing, so some groups of the round come out short, and short groups
//!   are merged while the merged size stays at most S. Mixing is then guaranteed within `2m`
//!   rounds: a model first walks down (each digit to the smaller of the two ranks' digits) and
//!   then up, never through a missing number. (Not balanced and not optimal; a search over
//!   P > 64 ranks would be too slow to run when a stream opens.)
//!
//! [`Grouping::mixing_rounds`] returns the window that holds for the schedule in use.
//!
//! # The lower bound
//! Let `c = ceil(P/S)`: a round whose groups have at most S members has at least c groups, so
//! with sizes differing by at most one its smallest group has at most `lo = floor(P/c)` members
//! and every group at most `hi = ceil(P/c)` (both only shrink with more groups). Take a window of
//! R rounds and a smallest group G of its last round. The ranks whose models reach G's members
//! over the window are found walking backwards: at the last round they are G itself, and every
//! earlier round replaces each rank by its group, multiplying the count by at most `hi`. So at
//! most `lo * hi^(R-1)` ranks reach G; mixing needs all P of them:
//! `R >= min { R : lo * hi^(R-1) >= P }` ([`Grouping::mixing_lower_bound`]). This is at least
//! `ceil(log_S P)` (`lo <= hi <= S`) and can exceed it: P = 7, S = 3 gives `c = 3`, `lo = 2`,
//! `hi = 3`, so 2 rounds reach at most 6 ranks and the optimum is 3 although `3^2 >= 7`; with
//! S = 2 and P odd some rank is alone in every round and the optimum is `ceil(log2 P) + 1`
//! (P = 7, S = 2: 4 rounds, so the old claim that `ceil(log_S P)` is out of reach holds there,
//! but not for P = 7, S = 4 or P = 5, S = 4, which mix in 2). The powers of two and the exact
//! mixed radix reach `ceil(log_S P)`, so the bound equals it for them. In two rounds the bound
//! is also sufficient: `lo * hi >= P` holds iff `c^2 <= P`, and then c consecutive blocks
//! followed by the residues mod c meet pairwise.
//! * **Fixed**: round 0's partition in every round (never mixes across groups).
//! * **Random(seed)**: each round a seeded permutation cut into `ceil(P/S)` groups of as equal
//!   sizes as possible.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
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
    /// A searched periodic schedule: `rounds[t mod rounds.len()]` is round t's partition, and
    /// every `window` consecutive rounds mix.
    Table {
        rounds: Vec<Vec<Vec<Rank>>>,
        window: usize,
    },
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
                None => match searched_schedule(ranks, group_size) {
                    Some((rounds, window)) => Layout::Table { rounds, window },
                    None => Layout::Radix {
                        radices: truncated_radices(ranks, m, group_size),
                        exact: false,
                    },
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
            Layout::Table { rounds, .. } => rounds[(round % rounds.len() as u64) as usize].clone(),
        }
    }

    /// `(base, mask)` when `rank`'s group in round `round` is every `base | s` for the
    /// subsets `s` of `mask`, as it is in the butterfly and fixed groupings of powers of two;
    /// `None` for other groupings.
    pub(crate) fn group_mask(&self, rank: Rank, round: u64) -> Option<(Rank, Rank)> {
        let Layout::Bits { bits, total } = self.layout else {
            return None;
        };
        let round = match self.kind {
            GroupingKind::Butterfly => round,
            GroupingKind::Fixed => 0,
            GroupingKind::Random { .. } => return None,
        };
        let mask = bit_mask(bits, total, round);
        Some((rank & !mask, mask))
    }

    /// The sorted members of `rank`'s group in round `round`.
    pub fn group_of(&self, rank: Rank, round: u64) -> Vec<Rank> {
        if let Some((base, mask)) = self.group_mask(rank, round) {
            return subset_members(base, mask);
        }
        self.partition(round)
            .into_iter()
            .find(|g| g.binary_search(&rank).is_ok())
            .unwrap_or_else(|| vec![rank])
    }

    /// The number of rounds after which the partitions repeat: round `t + period` has round
    /// `t`'s groups. `None` for random groupings, which never repeat.
    pub fn period(&self) -> Option<usize> {
        match self.kind {
            GroupingKind::Random { .. } => return None,
            GroupingKind::Fixed => return Some(1),
            GroupingKind::Butterfly => {}
        }
        Some(match &self.layout {
            Layout::Trivial => 1,
            // Round t's window starts at bit t * bits mod total.
            Layout::Bits { bits, total } => (total / gcd(*bits, *total)) as usize,
            Layout::Radix { radices, .. } => radices.len(),
            Layout::Table { rounds, .. } => rounds.len(),
        })
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
            Layout::Table { window, .. } => Some(*window),
        }
    }

    /// The fewest rounds in which partitions into groups of at most S members whose sizes
    /// differ by at most one within a round can mix P ranks (the module's "lower bound":
    /// `min { R : floor(P/c) * ceil(P/c)^(R-1) >= P }` with `c = ceil(P/S)`). `None` for S = 1
    /// with P > 1. The butterfly reaches it whenever [`Grouping::mixing_rounds`] equals it.
    pub fn mixing_lower_bound(&self) -> Option<usize> {
        if self.ranks == 1 {
            Some(0)
        } else if self.group_size == 1 {
            None
        } else {
            Some(balanced_lower_bound(self.ranks, self.group_size))
        }
    }

    /// `ceil(log_S P)`: a model spreads at most S-fold per round, so no grouping with groups of
    /// at most S mixes P ranks in fewer rounds (balanced groups may need more:
    /// [`Grouping::mixing_lower_bound`]).
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

/// The module's lower bound for balanced groups (2 <= s, 2 <= p).
fn balanced_lower_bound(p: usize, s: usize) -> usize {
    if s >= p {
        return 1;
    }
    let c = p.div_ceil(s);
    let (lo, hi) = (p / c, p.div_ceil(c));
    let (mut rounds, mut reach) = (1, lo);
    while reach < p {
        reach = reach.saturating_mul(hi);
        rounds += 1;
    }
    rounds
}

/// Largest P for which a schedule is searched: the reachability check then fits one `u64` per
/// rank, and the search takes milliseconds.
const SEARCH_MAX_RANKS: usize = 64;

/// Work allowed to the search per window length tried, in rank-rounds of reachability checks:
/// an evaluation of a window of R rounds costs about `R^2 * P`. About a second in an optimized
/// build for the hardest P <= 64; the result is cached per process.
const SEARCH_WORK: usize = 600_000_000;

/// Window lengths tried above the lower bound before giving up on the search.
const SEARCH_SLACK: usize = 2;

/// Sum over the windows of `window` consecutive rounds of the periodic schedule `rounds`, one
/// starting at each round of the period, of the (rank, rank) pairs not yet mixed at its end:
/// zero when every window mixes. `rounds[k][g]` lists group g of round k; `p <= 64`.
fn unmixed_pairs(p: usize, rounds: &[Vec<Vec<Rank>>], window: usize) -> u32 {
    let mut seen = [0u64; SEARCH_MAX_RANKS];
    let mut total = 0;
    for start in 0..rounds.len() {
        for (r, s) in seen.iter_mut().enumerate().take(p) {
            *s = 1 << r;
        }
        for k in 0..window {
            for group in &rounds[(start + k) % rounds.len()] {
                let union = group.iter().fold(0, |u, &m| u | seen[m]);
                for &m in group {
                    seen[m] = union;
                }
            }
        }
        total += seen[..p]
            .iter()
            .map(|s| p as u32 - s.count_ones())
            .sum::<u32>();
    }
    total
}

/// A periodic schedule of balanced partitions (`ceil(p/s)` groups, sizes differing by at most
/// one) and its window: the schedule's every window of that many rounds mixes. The window is
/// the shortest the search finds
/// from the lower bound up to [`SEARCH_SLACK`] more (and never beyond `2 ceil(log_s p)`, what the
/// merged mixed radix guarantees); `None` when p is too large to search or nothing is found.
///
/// The search is a local search on the number of unmixed pairs: swap two ranks of different
/// groups of one round (which keeps the sizes) and keep the swap unless it makes things worse.
/// (Accepting worse tables now and then, as simulated annealing does, found fewer optima.)
/// It is seeded by (p, s) and uses integers only, so every rank computes the same table.
fn searched_schedule(p: usize, s: usize) -> Option<Schedule> {
    if p > SEARCH_MAX_RANKS || s < 2 || s >= p {
        return None;
    }
    // Every engine of a process (and every stream it opens) builds the same grouping: search
    // once per (P, S).
    type Cache = Mutex<HashMap<(usize, usize), Option<Schedule>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Cache::default);
    // A poisoned lock only means another thread panicked while holding it; the map itself is
    // always complete entries, so it stays usable.
    if let Some(hit) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&(p, s)) {
        return hit.clone();
    }
    let found = search_schedule(p, s);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((p, s), found.clone());
    found
}

/// A periodic schedule (its partitions, one per round of the period) and its mixing window.
type Schedule = (Vec<Vec<Vec<Rank>>>, usize);

/// One round of a tabled pair schedule: its pairs, a singleton as `(x, x)`.
type PairRound = &'static [(u8, u8)];

/// A pair schedule (S = 2) found offline where the local search below stops a round above the
/// lower bound. [`tabled_schedule`] checks every window before one is used.
enum PairTable {
    /// Round t pairs `x` with `(c_t - x) mod P` (P even, every `c_t` odd: perfect matchings).
    Reflections(&'static [usize]),
    /// The rounds, listed.
    Rounds(&'static [PairRound]),
    /// Round t pairs `x < P/2` with `P/2 + (x + o_t) mod P/2` (P even): Knödel's circulant
    /// matchings, with offsets `o_t` found by a search over windows of the lower bound.
    Bipartite(&'static [usize]),
}

/// Schedules reaching the lower bound: by simulated annealing (28, 29, 31), by powers of one
/// permutation applied to the first round (30), by a search over reflections (38, 40), by a
/// search for a cycle in the graph of mixing windows of bipartite offsets (26: period 4,
/// window 5).
#[rustfmt::skip]
const PAIR_SCHEDULES: &[(usize, PairTable)] = &[
    (26, PairTable::Bipartite(&[11, 0, 8, 12])),
    (38, PairTable::Reflections(&[1, 17, 3, 13, 7, 3])),
    (40, PairTable::Reflections(&[1, 21, 5, 15, 7, 3])),
    (
        28,
        PairTable::Rounds(&[
            &[(6, 14), (25, 8), (1, 23), (7, 26), (18, 16), (19, 17), (0, 13), (22, 9), (4, 11), (5, 3), (15, 21), (10, 20), (27, 24), (2, 12)],
            &[(13, 15), (19, 26), (16, 25), (23, 0), (4, 3), (14, 1), (5, 2), (7, 10), (9, 17), (6, 12), (27, 18), (22, 8), (24, 20), (11, 21)],
            &[(22, 12), (21, 10), (19, 3), (26, 4), (15, 24), (16, 14), (25, 1), (20, 13), (6, 8), (11, 7), (23, 27), (18, 0), (2, 9), (17, 5)],
            &[(22, 20), (12, 15), (18, 9), (2, 0), (5, 13), (17, 24), (23, 3), (4, 14), (27, 19), (25, 10), (16, 26), (21, 1), (11, 8), (7, 6)],
            &[(24, 26), (27, 8), (0, 7), (25, 17), (23, 15), (4, 12), (20, 19), (2, 1), (16, 22), (11, 9), (3, 6), (18, 10), (5, 21), (14, 13)],
        ]),
    ),
    (
        29,
        PairTable::Rounds(&[
            &[(10, 3), (13, 6), (4, 0), (15, 8), (21, 17), (28, 19), (20, 12), (5, 11), (14, 23), (25, 7), (18, 22), (24, 2), (1, 9), (16, 26), (27, 27)],
            &[(12, 1), (28, 11), (21, 25), (15, 16), (19, 5), (14, 13), (24, 23), (22, 10), (18, 2), (26, 4), (3, 20), (6, 17), (8, 27), (9, 0), (7, 7)],
            &[(8, 3), (11, 16), (10, 17), (2, 15), (5, 21), (14, 9), (28, 18), (19, 25), (0, 13), (6, 22), (23, 12), (24, 1), (27, 26), (7, 20), (4, 4)],
            &[(13, 25), (6, 4), (28, 21), (22, 19), (3, 24), (14, 20), (2, 18), (12, 27), (8, 1), (5, 15), (16, 17), (23, 26), (9, 7), (11, 10), (0, 0)],
            &[(11, 0), (6, 7), (26, 28), (15, 12), (3, 4), (27, 5), (23, 22), (16, 25), (17, 14), (20, 18), (1, 19), (9, 10), (21, 24), (8, 2), (13, 13)],
            &[(10, 28), (17, 5), (2, 13), (18, 21), (1, 16), (12, 0), (15, 7), (27, 14), (19, 3), (25, 8), (11, 22), (20, 4), (26, 9), (6, 24), (23, 23)],
        ]),
    ),
    (
        30,
        PairTable::Rounds(&[
            &[(1, 22), (6, 29), (4, 27), (11, 14), (3, 0), (25, 13), (12, 28), (9, 18), (24, 2), (20, 5), (16, 17), (10, 21), (19, 26), (7, 8), (23, 15)],
            &[(2, 23), (7, 25), (0, 28), (12, 10), (4, 1), (26, 14), (13, 29), (5, 19), (20, 3), (21, 6), (17, 18), (11, 22), (15, 27), (8, 9), (24, 16)],
            &[(3, 24), (8, 26), (1, 29), (13, 11), (0, 2), (27, 10), (14, 25), (6, 15), (21, 4), (22, 7), (18, 19), (12, 23), (16, 28), (9, 5), (20, 17)],
            &[(4, 20), (9, 27), (2, 25), (14, 12), (1, 3), (28, 11), (10, 26), (7, 16), (22, 0), (23, 8), (19, 15), (13, 24), (17, 29), (5, 6), (21, 18)],
            &[(0, 21), (5, 28), (3, 26), (10, 13), (2, 4), (29, 12), (11, 27), (8, 17), (23, 1), (24, 9), (15, 16), (14, 20), (18, 25), (6, 7), (22, 19)],
        ]),
    ),
    (
        31,
        PairTable::Rounds(&[
            &[(15, 18), (16, 0), (24, 28), (22, 12), (9, 27), (21, 23), (5, 29), (19, 20), (13, 30), (3, 1), (25, 6), (17, 7), (14, 11), (4, 2), (10, 26), (8, 8)],
            &[(18, 8), (5, 28), (0, 26), (4, 14), (19, 30), (15, 27), (2, 16), (3, 24), (9, 25), (13, 20), (23, 6), (29, 7), (22, 10), (21, 12), (1, 17), (11, 11)],
            &[(29, 22), (9, 0), (27, 3), (10, 2), (11, 7), (15, 24), (13, 23), (14, 1), (19, 18), (26, 25), (30, 8), (5, 12), (6, 20), (21, 28), (17, 4), (16, 16)],
            &[(4, 18), (29, 24), (25, 5), (16, 15), (30, 17), (27, 2), (19, 21), (13, 12), (9, 28), (6, 22), (8, 7), (11, 26), (10, 3), (14, 0), (23, 1), (20, 20)],
            &[(20, 28), (22, 16), (15, 7), (24, 6), (18, 9), (11, 30), (26, 19), (1, 27), (4, 10), (3, 12), (0, 17), (29, 13), (2, 8), (21, 14), (23, 5), (25, 25)],
            &[(12, 11), (10, 13), (8, 23), (16, 19), (30, 27), (25, 18), (2, 5), (20, 0), (22, 14), (17, 28), (3, 21), (4, 29), (6, 15), (7, 24), (26, 1), (9, 9)],
        ]),
    ),
];

/// The tabled pair schedule for `p` with the lower bound as its window, when it is a balanced
/// schedule whose every window mixes.
fn tabled_schedule(p: usize) -> Option<Schedule> {
    let (_, table) = PAIR_SCHEDULES.iter().find(|(q, _)| *q == p)?;
    let pair = |a: Rank, b: Rank| if a == b { vec![a] } else { vec![a, b] };
    let rounds: Vec<Vec<Vec<Rank>>> = match table {
        PairTable::Reflections(cs) => cs
            .iter()
            .map(|&c| {
                (0..p)
                    .filter(|&x| x < (c + p - x) % p)
                    .map(|x| pair(x, (c + p - x) % p))
                    .collect()
            })
            .collect(),
        PairTable::Bipartite(offsets) => {
            let half = p / 2;
            offsets
                .iter()
                .map(|&o| (0..half).map(|x| pair(x, half + (x + o) % half)).collect())
                .collect()
        }
        PairTable::Rounds(rounds) => rounds
            .iter()
            .map(|round| {
                round
                    .iter()
                    .map(|&(a, b)| pair(Rank::from(a), Rank::from(b)))
                    .collect()
            })
            .collect(),
    };
    let partitions = rounds.iter().all(|round| {
        let mut seen = vec![false; p];
        round
            .iter()
            .flatten()
            .all(|&r| r < p && !std::mem::replace(&mut seen[r], true))
            && seen.iter().all(|&x| x)
    });
    let window = balanced_lower_bound(p, 2);
    if !partitions || unmixed_pairs(p, &rounds, window) != 0 {
        return None;
    }
    Some((canonical(rounds), window))
}

/// Groups sorted, and each round's groups by their first member.
fn canonical(mut rounds: Vec<Vec<Vec<Rank>>>) -> Vec<Vec<Vec<Rank>>> {
    for round in &mut rounds {
        for group in round.iter_mut() {
            group.sort_unstable();
        }
        round.sort_by_key(|g| g.first().copied());
    }
    rounds
}

fn search_schedule(p: usize, s: usize) -> Option<Schedule> {
    if s == 2
        && let Some(t) = tabled_schedule(p)
    {
        return Some(t);
    }
    let c = p.div_ceil(s);
    let lengths: Vec<usize> = (0..c).map(|g| p / c + usize::from(g < p % c)).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(0x5741_474D_u64 ^ ((p as u64) << 32) ^ s as u64);
    let bound = balanced_lower_bound(p, s);
    let give_up = (2 * ceil_log(p, s)).min(bound + SEARCH_SLACK);
    for window in bound..=give_up {
        let mut rounds: Vec<Vec<Vec<Rank>>> = (0..window)
            .map(|_| {
                let mut order: Vec<Rank> = (0..p).collect();
                order.shuffle(&mut rng);
                let mut at = 0;
                lengths
                    .iter()
                    .map(|&len| {
                        at += len;
                        order[at - len..at].to_vec()
                    })
                    .collect()
            })
            .collect();
        let mut current = unmixed_pairs(p, &rounds, window);
        for _ in 0..SEARCH_WORK / (window * window * p) {
            if current == 0 {
                break;
            }
            let k = rng.random_range(0..window);
            let a = rng.random_range(0..c);
            let b = (a + rng.random_range(1..c)) % c;
            let i = rng.random_range(0..lengths[a]);
            let j = rng.random_range(0..lengths[b]);
            let (x, y) = (rounds[k][a][i], rounds[k][b][j]);
            rounds[k][a][i] = y;
            rounds[k][b][j] = x;
            let next = unmixed_pairs(p, &rounds, window);
            if next <= current {
                current = next;
            } else {
                rounds[k][a][i] = x;
                rounds[k][b][j] = y;
            }
        }
        if current == 0 {
            return Some((canonical(rounds), window));
        }
    }
    None
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Bits of the window used in round `round`: `{(round*bits + j) mod total : j < bits}`.
fn bit_mask(bits: u32, total: u32, round: u64) -> usize {
    let start = (round % u64::from(total)) * u64::from(bits) % u64::from(total);
    (0..bits).fold(0usize, |m, j| {
        m | 1 << ((start + u64::from(j)) % u64::from(total))
    })
}

/// All `base | s` for subsets `s` of `mask`, ascending.
pub(crate) fn subset_members(base: usize, mask: usize) -> Vec<Rank> {
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
    fn masks_only_where_groups_are_subsets_of_bits() {
        let f = Grouping::new(8, 2, GroupingKind::Fixed).unwrap();
        assert_eq!(f.group_mask(5, 3), f.group_mask(5, 0));
        let b = Grouping::new(8, 4, GroupingKind::Butterfly).unwrap();
        for round in 0..4 {
            for rank in 0..8 {
                let (base, mask) = b.group_mask(rank, round).unwrap();
                assert_eq!(subset_members(base, mask), b.group_of(rank, round));
            }
        }
        let random = Grouping::new(8, 4, GroupingKind::Random { seed: 3 }).unwrap();
        assert_eq!(random.group_mask(1, 1), None);
        assert_eq!(Grouping::butterfly(12).unwrap().group_mask(1, 1), None);
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
