//! Property tests of the groupings: partitions every round, group sizes, mixing.

use proptest::prelude::*;
use wagma::topology::{Grouping, GroupingKind, tree_children};

/// Which ranks' models each rank has seen after applying `rounds` rounds from `start`.
fn reach(g: &Grouping, start: u64, rounds: usize) -> Vec<Vec<bool>> {
    let p = g.ranks();
    let mut seen: Vec<Vec<bool>> = (0..p).map(|i| (0..p).map(|j| i == j).collect()).collect();
    for t in start..start + rounds as u64 {
        for group in g.partition(t) {
            let mut union = vec![false; p];
            for &m in &group {
                for (u, &s) in union.iter_mut().zip(&seen[m]) {
                    *u |= s;
                }
            }
            for &m in &group {
                seen[m] = union.clone();
            }
        }
    }
    seen
}

fn fully_mixed(seen: &[Vec<bool>]) -> bool {
    seen.iter().all(|row| row.iter().all(|&b| b))
}

/// True when `p` is a product of at most `m` factors no larger than `s`.
fn factorizable(p: usize, m: usize, s: usize) -> bool {
    if p == 1 {
        return true;
    }
    m > 0 && (2..=s.min(p)).any(|d| p.is_multiple_of(d) && factorizable(p / d, m - 1, s))
}

fn ceil_log(p: usize, s: usize) -> usize {
    let (mut m, mut r) = (0, 1);
    while r < p {
        r *= s;
        m += 1;
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn butterfly_partitions_and_mixes(p in 1usize..=40, s_frac in 0.0f64..1.0, start in 0u64..50) {
        let s = 1 + ((p - 1) as f64 * s_frac).round() as usize;
        let g = Grouping::new(p, s, GroupingKind::Butterfly).unwrap();
        for t in start..start + 6 {
            let part = g.partition(t);
            let mut count = vec![0; p];
            for group in &part {
                prop_assert!(!group.is_empty() && group.len() <= s, "group {group:?} with S = {s}");
                prop_assert!(group.windows(2).all(|w| w[0] < w[1]));
                for &m in group {
                    count[m] += 1;
                    prop_assert_eq!(&g.group_of(m, t), group);
                }
            }
            prop_assert!(count.iter().all(|&c| c == 1), "not a partition: {part:?}");
        }
        if s >= 2 || p == 1 {
            let d = g.mixing_rounds().expect("butterfly with S >= 2 mixes");
            prop_assert!(fully_mixed(&reach(&g, start, d)), "P={p} S={s}: not mixed after {d} rounds");
            let m = ceil_log(p, s);
            prop_assert_eq!(g.optimal_mixing_rounds(), m);
            if factorizable(p, m, s) {
                // Exact mixed radix (all powers of two among them): optimal, equal groups.
                prop_assert_eq!(d, m, "P={} S={}", p, s);
                for t in start..start + 4 {
                    let part = g.partition(t);
                    prop_assert!(part.iter().all(|grp| grp.len() == part[0].len()));
                }
            } else {
                prop_assert_eq!(d, 2 * m);
            }
        } else {
            prop_assert_eq!(g.mixing_rounds(), None);
        }
    }

    #[test]
    fn random_groups_are_balanced(p in 1usize..=40, s_frac in 0.0f64..1.0, seed: u64, t: u64) {
        let s = 1 + ((p - 1) as f64 * s_frac).round() as usize;
        let g = Grouping::new(p, s, GroupingKind::Random { seed }).unwrap();
        let part = g.partition(t);
        prop_assert_eq!(part.len(), p.div_ceil(s));
        let (lo, hi) = (part.iter().map(Vec::len).min().unwrap(), part.iter().map(Vec::len).max().unwrap());
        prop_assert!(hi <= s && hi - lo <= 1);
        let mut all: Vec<usize> = part.concat();
        all.sort_unstable();
        prop_assert_eq!(all, (0..p).collect::<Vec<_>>());
    }

    #[test]
    fn activation_reaches_everyone(p in 1usize..=200, root_frac in 0.0f64..1.0) {
        let root = ((p - 1) as f64 * root_frac) as usize;
        let mut seen = vec![false; p];
        seen[root] = true;
        let mut stack = vec![(root, None)];
        while let Some((r, recv)) = stack.pop() {
            for e in tree_children(root, r, p, recv) {
                prop_assert!(!seen[e.rank]);
                seen[e.rank] = true;
                stack.push((e.rank, Some(e.dim)));
            }
        }
        prop_assert!(seen.iter().all(|&b| b));
    }
}

#[test]
fn powers_of_two_follow_the_paper() {
    for log_p in 0..=10u32 {
        for log_s in 0..=log_p {
            let (p, s) = (1usize << log_p, 1usize << log_s);
            let g = Grouping::new(p, s, GroupingKind::Butterfly).unwrap();
            for t in 0..(2 * log_p.max(1)) as u64 {
                for r in [0, p / 3, p - 1] {
                    let group = g.group_of(r, t);
                    let mask = group.iter().fold(0, |m, &x| m | (x ^ r));
                    let expect_bits: Vec<u32> = (0..log_s)
                        .map(|j| (t as u32 * log_s + j) % log_p.max(1))
                        .collect();
                    let expect = expect_bits.iter().fold(0usize, |m, &b| m | 1 << b);
                    let want = if s == 1 || log_p == 0 { 0 } else { expect };
                    assert_eq!(mask, want, "P={p} S={s} round {t}");
                    assert_eq!(group.len(), s);
                }
            }
        }
    }
}

#[test]
fn fixed_groups_never_mix() {
    let g = Grouping::new(8, 4, GroupingKind::Fixed).unwrap();
    assert_eq!(g.mixing_rounds(), None);
    assert!(!fully_mixed(&reach(&g, 0, 10)));
}

#[test]
fn some_pairs_cannot_mix_optimally() {
    // P = 7, S = 2: the rank left alone in the first round reaches at most 4 ranks in 3.
    let g = Grouping::new(7, 2, GroupingKind::Butterfly).unwrap();
    assert_eq!(g.optimal_mixing_rounds(), 3);
    assert_eq!(g.mixing_rounds(), Some(6));
    for start in 0..6 {
        assert!(fully_mixed(&reach(&g, start, 6)));
    }
}
