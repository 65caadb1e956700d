//! What an algorithm's own waiting rules allow on given compute-time draws, with free
//! communication: replay the draws through the rules. Measured throughput over this bound is
//! the implementation's efficiency.

use super::config::{Algorithm, EagerMode, WagmaOptions};
use crate::engine::initiator;
use crate::topology::{ExponentialGraph, Grouping, default_group_size, ring_neighbors};

/// Wall time of the whole job (seconds) under `algorithm`'s waiting rules, for compute times
/// `draws[step][rank]` and free communication. `seed` is the shared seed (majority initiators).
pub fn bound_wall(algorithm: &Algorithm, draws: &[Vec<f64>], seed: u64) -> f64 {
    let Some(p) = draws.first().map(Vec::len) else {
        return 0.0;
    };
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
    for (t, c) in draws.iter().enumerate() {
        let t = t as u64;
        let a: Vec<f64> = f.iter().zip(c).map(|(x, y)| x + y).collect();
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
            Algorithm::DPsgd => (0..p)
                .map(|r| {
                    ring_neighbors(r, p)
                        .iter()
                        .map(|&m| a[m])
                        .fold(a[r], f64::max)
                })
                .collect(),
            Algorithm::Sgp { .. } => match &graph {
                Some(g) => (0..p)
                    .map(|r| g.in_peers(r, t).iter().map(|&m| a[m]).fold(a[r], f64::max))
                    .collect(),
                None => a,
            },
            Algorithm::EagerSgd { sync_period, .. } if every(*sync_period) => vec![slowest; p],
            Algorithm::EagerSgd {
                mode: EagerMode::Majority,
                ..
            } => {
                let i = initiator(seed, t, p);
                a.iter().map(|&x| x.max(a[i])).collect()
            }
            _ => a,
        };
    }
    f.into_iter().fold(0.0, f64::max)
}

/// Wall time with no waiting and no communication at all: the slowest rank's total compute.
pub fn ideal_wall(draws: &[Vec<f64>]) -> f64 {
    let p = draws.first().map_or(0, Vec::len);
    (0..p)
        .map(|r| draws.iter().map(|c| c[r]).sum::<f64>())
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
        let wagma = bound_wall(&Algorithm::Wagma(WagmaOptions::default()), &draws, 0);
        let ar = bound_wall(&Algorithm::AllreduceSgd, &draws, 0);
        let ideal = ideal_wall(&draws);
        let speedup = ar / wagma;
        let of_ideal = ideal / wagma;
        assert!((speedup - 1.37).abs() < 0.05, "{speedup}");
        assert!((of_ideal - 0.88).abs() < 0.03, "{of_ideal}");
        // Free communication and no waiting: AD-PSGD and solo eager-SGD without syncs reach
        // the ideal; every rule waits at least as long as no rule.
        assert_eq!(bound_wall(&Algorithm::AdPsgd, &draws, 0), ideal);
        for name in Algorithm::NAMES {
            let a = Algorithm::from_name(name).unwrap();
            assert!(bound_wall(&a, &draws, 0) >= ideal - 1e-9, "{name}");
            assert!(bound_wall(&a, &draws, 0) <= ar + 1e-9, "{name}");
        }
    }
}
