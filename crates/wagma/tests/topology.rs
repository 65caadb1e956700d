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

fn ceil_log(p: usize, s: usize) -> usize {
    let (mut m, mut r) = (0, 1);
    while r < p {
        r *= s;
        m += 1;
    }
    m
}

/// Checks that every round in `rounds` is a partition into sorted groups of at most `s`
/// members whose sizes differ by at most one, consistent with `group_of`.
fn check_partitions(g: &Grouping, rounds: std::ops::Range<u64>) -> Result<(), String> {
    let (p, s) = (g.ranks(), g.group_size());
    for t in rounds {
        let part = g.partition(t);
        let mut count = vec![0; p];
        for group in &part {
            if group.is_empty() || group.len() > s || !group.windows(2).all(|w| w[0] < w[1]) {
                return Err(format!("P={p} S={s} round {t}: bad group {group:?}"));
            }
            for &m in group {
                count[m] += 1;
                if &g.group_of(m, t) != group {
                    return Err(format!("P={p} S={s} round {t}: group_of({m}) disagrees"));
                }
            }
        }
        if !count.iter().all(|&c| c == 1) {
            return Err(format!("P={p} S={s} round {t}: not a partition: {part:?}"));
        }
        let lo = part.iter().map(Vec::len).min().unwrap_or(0);
        let hi = part.iter().map(Vec::len).max().unwrap_or(0);
        if hi - lo > 1 {
            return Err(format!("P={p} S={s} round {t}: unbalanced {part:?}"));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn butterfly_partitions_and_mixes(p in 1usize..=64, s_frac in 0.0f64..1.0, start in 0u64..50) {
        let s = 1 + ((p - 1) as f64 * s_frac).round() as usize;
        let g = Grouping::new(p, s, GroupingKind::Butterfly).unwrap();
        // Up to 64 ranks every round is balanced (sizes differ by at most one).
        prop_assert_eq!(check_partitions(&g, start..start + 8), Ok(()));
        if s >= 2 || p == 1 {
            let d = g.mixing_rounds().expect("butterfly with S >= 2 mixes");
            prop_assert!(fully_mixed(&reach(&g, start, d)), "P={p} S={s}: not mixed after {d} rounds");
            prop_assert_eq!(g.optimal_mixing_rounds(), ceil_log(p, s));
            // Never below the proven bound, never above the merged radix's 2m; up to 40 ranks
            // `every_small_configuration_mixes_optimally` pins the exact value.
            let bound = g.mixing_lower_bound().unwrap();
            prop_assert!(bound >= ceil_log(p, s) && d >= bound && d <= 2 * ceil_log(p, s).max(1));
        } else {
            prop_assert_eq!(g.mixing_rounds(), None);
            prop_assert_eq!(g.mixing_lower_bound(), None);
        }
    }

    #[test]
    fn partitions_repeat_after_the_period(p in 1usize..=130, s_frac in 0.0f64..1.0, start in 0u64..50, fixed: bool) {
        let s = 1 + ((p - 1) as f64 * s_frac).round() as usize;
        let kind = if fixed { GroupingKind::Fixed } else { GroupingKind::Butterfly };
        let g = Grouping::new(p, s, kind).unwrap();
        let period = g.period().expect("deterministic groupings repeat") as u64;
        prop_assert!(period >= 1);
        for t in start..start + period {
            prop_assert_eq!(g.partition(t), g.partition(t + period), "P={} S={} round {}", p, s, t);
            prop_assert_eq!(g.partition(t), g.partition(t + 3 * period), "P={} S={} round {}", p, s, t);
        }
        prop_assert_eq!(Grouping::new(p, s, GroupingKind::Random { seed: 7 }).unwrap().period(), None);
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

/// Every P up to 40 and every S: balanced partitions, and the mixing window is the lower bound
/// of the module documentation (so it is the optimum), from every start of the period.
#[test]
fn every_small_configuration_mixes_optimally() {
    for p in 1..=40usize {
        for s in 1..=p {
            let g = Grouping::new(p, s, GroupingKind::Butterfly).unwrap();
            let d = g.mixing_rounds();
            if s == 1 && p > 1 {
                assert_eq!(d, None, "P={p} S=1");
                assert_eq!(g.mixing_lower_bound(), None);
                assert!(!fully_mixed(&reach(&g, 0, 3)));
                continue;
            }
            let d = d.unwrap();
            check_partitions(&g, 0..2 * d as u64 + 2).unwrap();
            assert_eq!(Some(d), g.mixing_lower_bound(), "P={p} S={s}");
            // Every schedule here repeats with a period below 24 (at most log2 P for the
            // powers of two, the window itself otherwise): every start counts.
            for start in 0..24 {
                assert!(
                    fully_mixed(&reach(&g, start, d)),
                    "P={p} S={s}: start {start} not mixed after {d} rounds"
                );
            }
            // The bound is tight for the schedule itself: one round fewer never suffices from
            // every start (a consistency check of the bound's proof).
            if d > 0 {
                assert!(
                    (0..24).any(|start| !fully_mixed(&reach(&g, start, d - 1))),
                    "P={p} S={s}: mixes in {} rounds, below the proven bound",
                    d - 1
                );
            }
        }
    }
}

/// The cases of the issue: the lower bound exceeds `ceil(log_S P)` only where a round has a
/// group too small to spread fast enough.
#[test]
fn examples_of_the_optimum() {
    // (P, S, ceil(log_S P), optimum)
    for (p, s, m, best) in [
        (7, 4, 2, 2),
        (5, 4, 2, 2),
        (7, 2, 3, 4),
        (7, 3, 2, 3),
        (5, 2, 3, 4),
        (6, 4, 2, 2),
        (12, 4, 2, 2),
        (12, 5, 2, 2),
        (24, 5, 2, 3),
        (40, 3, 4, 4),
        (40, 6, 3, 3),
    ] {
        let g = Grouping::new(p, s, GroupingKind::Butterfly).unwrap();
        assert_eq!(g.optimal_mixing_rounds(), m, "P={p} S={s}");
        assert_eq!(g.mixing_lower_bound(), Some(best), "P={p} S={s}");
        assert_eq!(g.mixing_rounds(), Some(best), "P={p} S={s}");
    }
    // P = 7, S = 4: two rounds.
    let g = Grouping::new(7, 4, GroupingKind::Butterfly).unwrap();
    assert!((0..4).all(|t| fully_mixed(&reach(&g, t, 2))));
}

/// Above 64 ranks a P that is not a product of small factors keeps the merged mixed radix and
/// its proven `2m` window.
#[test]
fn large_unfactorizable_groupings_still_mix() {
    for (p, s) in [(67, 4), (100, 3), (71, 8)] {
        let g = Grouping::new(p, s, GroupingKind::Butterfly).unwrap();
        let d = g.mixing_rounds().unwrap();
        assert!(d >= g.mixing_lower_bound().unwrap(), "P={p} S={s}");
        for start in 0..2 * d as u64 {
            assert!(
                fully_mixed(&reach(&g, start, d)),
                "P={p} S={s} start {start}"
            );
        }
    }
}
