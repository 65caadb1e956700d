//! What an algorithm's own waiting rules allow on given compute-time draws, with free
//! communication: replay the draws through the rules. Measured throughput over this bound is
//! the implementation's efficiency.

use super::config::{AlgoConfig, Algorithm, EagerMode, SendOrder, WagmaOptions};
use crate::engine::initiator;
use crate::topology::{ExponentialGraph, Grouping, default_group_size, ring_neighbors};

/// Compute time of `rank` in step `t` of `draws[step][rank]`: a draw missing from an uneven
/// table is 0 (a rank without a draw does not compute).
pub(super) fn draw(draws: &[Vec<f64>], t: usize, rank: usize) -> f64 {
    draws
        .get(t)
        .and_then(|row| row.get(rank))
        .copied()
        .unwrap_or(0.0)
}

/// Ranks of a table of draws: its widest row.
fn ranks(draws: &[Vec<f64>]) -> usize {
    draws.iter().map(Vec::len).max().unwrap_or(0)
}

/// Wall time of the whole job (seconds) under `algo`'s waiting rules, for compute times
/// `draws[step][rank]` and free communication. The job has as many ranks as the widest row;
/// a draw missing from a shorter row is 0.
pub fn bound_wall(algo: &AlgoConfig, draws: &[Vec<f64>]) -> f64 {
    finish_times(algo, draws).into_iter().fold(0.0, f64::max)
}

/// When each rank finishes the last step under `algo`'s waiting rules, with free communication.
fn finish_times(algo: &AlgoConfig, draws: &[Vec<f64>]) -> Vec<f64> {
    let algorithm = &algo.algorithm;
    let p = ranks(draws);
    let mut f = vec![0.0f64; p];
    let grouping = match algorithm {
        Algorithm::Wagma(WagmaOptions {
            group_size,
            groups,
            wait_avoiding: false,
            ..
        }) => Grouping::new(
            p,
            group_size.unwrap_or_else(|| default_group_size(p)),
            *groups,
        )
        .ok(),
        _ => None,
    };
    let graph = match algorithm {
        Algorithm::Sgp { peers, offsets } if p > 1 => {
            ExponentialGraph::with_offsets(p, *peers, *offsets).ok()
        }
        _ => None,
    };
    // Each piece of a neighbour exchange starts once the previous one is done at the rank and
    // at the peers it receives from: `waits_on(r)` are those peers for one piece.
    let pieces = algo.exchange_pieces.max(1);
    let exchange = |a: Vec<f64>, waits_on: &dyn Fn(usize) -> Vec<usize>| {
        let peers: Vec<Vec<usize>> = (0..p).map(waits_on).collect();
        (0..pieces).fold(a, |e, _| {
            peers
                .iter()
                .enumerate()
                .map(|(r, w)| w.iter().map(|&m| e[m]).fold(e[r], f64::max))
                .collect()
        })
    };
    for step in 0..draws.len() {
        let t = step as u64;
        let a: Vec<f64> = f
            .iter()
            .enumerate()
            .map(|(r, x)| x + draw(draws, step, r))
            .collect();
        let slowest = a.iter().copied().fold(0.0, f64::max);
        let every = |period: Option<u64>| period.is_some_and(|k| (t + 1).is_multiple_of(k));
        f = match algorithm {
            Algorithm::AllreduceSgd => vec![slowest; p],
            Algorithm::LocalSgd { period } if every(Some(*period)) => vec![slowest; p],
            Algorithm::Wagma(o) if every(o.tau) => vec![slowest; p],
            Algorithm::Wagma(_) => match &grouping {
                Some(g) => (0..p)
                    .map(|r| g.group_of(r, t).iter().map(|&m| a[m]).fold(0.0, f64::max))
                    .collect(),
                None => a,
            },
            Algorithm::DPsgd => match algo.send_order {
                SendOrder::Together => exchange(a, &|r| ring_neighbors(r, p)),
                // The data from the right neighbour leaves once the rank two to the right has
                // entered: a window of r - 1 ..= r + 2 per piece.
                SendOrder::RightThenLeft => exchange(a, &|r| {
                    let mut w: Vec<usize> = [p - 1, 1, 2].iter().map(|d| (r + d) % p).collect();
                    w.retain(|&m| m != r);
                    w
                }),
            },
            Algorithm::Sgp { .. } => match &graph {
                Some(g) => exchange(a, &|r| g.in_peers(r, t)),
                None => a,
            },
            Algorithm::EagerSgd { sync_period, .. } if every(*sync_period) => vec![slowest; p],
            Algorithm::EagerSgd {
                mode: EagerMode::Majority,
                ..
            } => {
                let i = initiator(algo.seed, t, p);
                a.iter().map(|&x| x.max(a[i])).collect()
            }
            _ => a,
        };
    }
    f
}

/// Wall time with no waiting and no communication at all: the slowest rank's total compute
/// (ranks and missing draws as in [`bound_wall`]).
pub fn ideal_wall(draws: &[Vec<f64>]) -> f64 {
    (0..ranks(draws))
        .map(|r| (0..draws.len()).map(|t| draw(draws, t, r)).sum::<f64>())
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::imbalance::{Imbalance, Profile};

    #[test]
    fn reference_figures() {
        // Compute c, two of 16 ranks delayed by 0.71c per step, tau = 10: WAGMA's bound is about
        // 1.37x allreduce-sgd's and 0.88 of the ideal.
        let im = Imbalance {
            profile: Profile::PaperResnet,
            time_scale: 1.0,
            seed: 3,
        };
        let draws = im.table(2000, 16);
        let wagma = bound_wall(
            &AlgoConfig::new(Algorithm::Wagma(WagmaOptions::default())),
            &draws,
        );
        let ar = bound_wall(&AlgoConfig::new(Algorithm::AllreduceSgd), &draws);
        let ideal = ideal_wall(&draws);
        let speedup = ar / wagma;
        let of_ideal = ideal / wagma;
        assert!((speedup - 1.37).abs() < 0.05, "{speedup}");
        assert!((of_ideal - 0.88).abs() < 0.03, "{of_ideal}");
        // Free communication and no waiting: AD-PSGD and solo eager-SGD without syncs reach
        // the ideal; every rule waits at least as long as no rule.
        for gossip in [None, Some(2)] {
            let ad = AlgoConfig::new(Algorithm::AdPsgd { gossip });
            assert_eq!(bound_wall(&ad, &draws), ideal);
        }
        for name in Algorithm::NAMES {
            let a = AlgoConfig::new(Algorithm::from_name(name).unwrap());
            assert!(bound_wall(&a, &draws) >= ideal - 1e-9, "{name}");
            assert!(bound_wall(&a, &draws) <= ar + 1e-9, "{name}");
        }
    }

    #[test]
    fn a_draw_missing_from_an_uneven_table_is_zero() {
        // Rank 2 has no draw in step 1: it computes nothing there; the widest row sets P.
        let uneven = vec![vec![1.0, 2.0], vec![3.0, 1.0, 4.0], vec![1.0, 1.0, 1.0]];
        let filled = vec![
            vec![1.0, 2.0, 0.0],
            vec![3.0, 1.0, 4.0],
            vec![1.0, 1.0, 1.0],
        ];
        assert_eq!(ideal_wall(&uneven), 5.0);
        for name in Algorithm::NAMES {
            let a = AlgoConfig::new(Algorithm::from_name(name).unwrap());
            assert_eq!(bound_wall(&a, &uneven), bound_wall(&a, &filled), "{name}");
        }
        let ar = AlgoConfig::new(Algorithm::AllreduceSgd);
        assert_eq!(bound_wall(&ar, &uneven), 2.0 + 4.0 + 1.0);
        assert_eq!(bound_wall(&ar, &[]), 0.0);
        assert_eq!(ideal_wall(&[vec![], vec![1.5]]), 1.5);
    }

    #[test]
    fn chained_pieces_widen_what_a_rank_waits_for() {
        // One step on a ring of 13; rank 0 computes 10 s longer. With k pieces a rank waits for
        // every rank within k hops, or with right-then-left sends for ranks r - k ..= r + 2k.
        let p = 13;
        let mut step = vec![1.0; p];
        step[0] = 11.0;
        let draws = vec![step];
        let delayed = |algo: &AlgoConfig| -> Vec<usize> {
            let f = finish_times(algo, &draws);
            (0..p).filter(|&r| f[r] > 5.0).collect()
        };
        for k in [1u32, 2, 4] {
            let mut d = AlgoConfig::new(Algorithm::DPsgd);
            d.exchange_pieces = k;
            let k = k as usize;
            let mut hops: Vec<usize> = (0..=k).chain(p - k..p).collect();
            hops.sort_unstable();
            assert_eq!(delayed(&d), hops, "together, {k} pieces");
            d.send_order = SendOrder::RightThenLeft;
            let mut window: Vec<usize> = (0..=k).chain(p - 2 * k..p).collect();
            window.sort_unstable();
            assert_eq!(delayed(&d), window, "right-then-left, {k} pieces");
        }
        // SGP: each piece waits for that iteration's in-peers (offsets 1 and 2 at t = 0).
        let mut sgp = AlgoConfig::new(Algorithm::Sgp {
            peers: 2,
            offsets: crate::topology::PeerOffsets::Disjoint,
        });
        let one = delayed(&sgp);
        sgp.exchange_pieces = 2;
        let two = delayed(&sgp);
        assert!(
            one.len() < two.len() && one.iter().all(|r| two.contains(r)),
            "{one:?} {two:?}"
        );
    }
}
