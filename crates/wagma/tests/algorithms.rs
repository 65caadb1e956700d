//! The algorithms on a convex problem with a known optimum: exact degenerate equivalences,
//! convergence of every algorithm under injected delays, push-sum mass, bounded staleness,
//! replay.

mod common;

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wagma::algo::{
    AlgoConfig, Algorithm, CombineRule, EagerMode, LateGradients, LrSchedule, OptimizerConfig,
    Order, Resume, Scope, StepReport, WagmaOptions, Worker,
};
use wagma::exec::{JobResult, threaded, virtual_time};
use wagma::imbalance::{Imbalance, Profile};
use wagma::topology::PeerOffsets;
use wagma::{ConfigError, EngineConfig, Error, Payload};

const D: usize = 12;
const M: usize = 24;

/// Each rank's least-squares shard: rows `a` (M x D) and targets `b`.
struct Shard {
    a: Vec<f64>,
    b: Vec<f64>,
}

fn shards(p: usize, seed: u64) -> (Vec<Shard>, Vec<f64>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let truth: Vec<f64> = (0..D).map(|_| rng.random_range(-1.0..1.0)).collect();
    let shards: Vec<Shard> = (0..p)
        .map(|r| {
            // Heterogeneous shards: each rank's features are shifted and scaled differently.
            let shift = r as f64 * 0.3 - 0.5;
            let a: Vec<f64> = (0..M * D)
                .map(|_| rng.random_range(-1.0..1.0) + shift * 0.5)
                .collect();
            let b = (0..M)
                .map(|i| {
                    (0..D).map(|j| a[i * D + j] * truth[j]).sum::<f64>()
                        + rng.random_range(-0.3..0.3)
                })
                .collect();
            Shard { a, b }
        })
        .collect();
    let optimum = solve(&shards);
    (shards, optimum)
}

/// The minimizer of sum over shards of |A w - b|^2 (normal equations, Gaussian elimination).
fn solve(shards: &[Shard]) -> Vec<f64> {
    let mut m = vec![vec![0.0; D + 1]; D];
    for s in shards {
        for i in 0..M {
            let row = &s.a[i * D..(i + 1) * D];
            for j in 0..D {
                for k in 0..D {
                    m[j][k] += row[j] * row[k];
                }
                m[j][D] += row[j] * s.b[i];
            }
        }
    }
    for c in 0..D {
        let piv = (c..D)
            .max_by(|&x, &y| m[x][c].abs().total_cmp(&m[y][c].abs()))
            .unwrap();
        m.swap(c, piv);
        let pivot = m[c].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot[c];
                for (x, p) in row.iter_mut().zip(&pivot).skip(c) {
                    *x -= f * p;
                }
            }
        }
    }
    (0..D).map(|i| m[i][D] / m[i][i]).collect()
}

fn gradient(s: &Shard, w: &[f32]) -> Vec<f32> {
    let mut g = vec![0.0f64; D];
    for i in 0..M {
        let row = &s.a[i * D..(i + 1) * D];
        let r: f64 = row
            .iter()
            .zip(w)
            .map(|(a, &x)| a * f64::from(x))
            .sum::<f64>()
            - s.b[i];
        for j in 0..D {
            g[j] += row[j] * r / M as f64;
        }
    }
    g.into_iter().map(|x| x as f32).collect()
}

#[derive(Debug)]
struct Outcome {
    replica: Vec<f32>,
    consensus: Vec<f32>,
    reports: Vec<StepReport>,
    max_staleness: u64,
}

#[derive(Clone, Copy)]
enum Exec {
    /// Deterministic; `jitter` 0 gives simultaneous arrivals when compute times are equal.
    Virtual {
        seed: u64,
        jitter: f64,
    },
    Threads,
}

fn train(
    exec: Exec,
    p: usize,
    algo: AlgoConfig,
    opt: OptimizerConfig,
    steps: u64,
    delays: Option<Imbalance>,
) -> JobResult<Outcome> {
    let (data, _) = shards(p, 42);
    let task = async |c: &mut wagma::Comm| -> Result<Outcome, Error> {
        let rank = c.rank();
        let mut w = Worker::new(
            c,
            algo.clone(),
            opt.clone(),
            Payload::Data(vec![0.0; D]),
            Payload::Data(Vec::new()),
        )
        .await?;
        let mut reports = Vec::new();
        for t in 0..steps {
            let d = delays.map_or(0.001, |im| im.step_times(t, p)[rank]);
            w.comm().compute(Duration::from_secs_f64(d)).await;
            let g = gradient(&data[rank], w.params());
            reports.push(w.step(&g).await?);
        }
        let replica = w.params().to_vec();
        let (consensus, _) = w.consensus().await?;
        let max_staleness = w.comm().stats().staleness.max().unwrap_or(0);
        Ok(Outcome {
            replica,
            consensus: consensus.into_vec(),
            reports,
            max_staleness,
        })
    };
    match exec {
        Exec::Virtual { seed, jitter } => {
            let network = virtual_time::JitterNetwork {
                jitter,
                ..virtual_time::JitterNetwork::default()
            };
            let cfg = virtual_time::VirtualConfig {
                seed,
                network: Box::new(network),
            };
            virtual_time::run(p, EngineConfig::default(), cfg, task).unwrap()
        }
        Exec::Threads => threaded::run(p, EngineConfig::default(), task).unwrap(),
    }
}

fn replicas(
    exec: Exec,
    p: usize,
    algo: Algorithm,
    opt: &OptimizerConfig,
    steps: u64,
) -> Vec<Outcome> {
    train(exec, p, AlgoConfig::new(algo), opt.clone(), steps, None)
        .into_all()
        .unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn momentum_sgd() -> OptimizerConfig {
    OptimizerConfig {
        lr: LrSchedule::Constant { lr: 0.05 },
        momentum: 0.9,
        nesterov: false,
        weight_decay: 1e-3,
        ..OptimizerConfig::default()
    }
}

const EXACT: Exec = Exec::Virtual {
    seed: 1,
    jitter: 0.0,
};

#[test]
fn wagma_with_tau_one_is_local_sgd_with_period_one() {
    let opt = momentum_sgd();
    let local = replicas(EXACT, 8, Algorithm::LocalSgd { period: 1 }, &opt, 30);
    let wagma = replicas(
        EXACT,
        8,
        Algorithm::Wagma(WagmaOptions {
            tau: Some(1),
            ..WagmaOptions::default()
        }),
        &opt,
        30,
    );
    for (a, b) in local.iter().zip(&wagma) {
        assert_eq!(bits(&a.replica), bits(&b.replica));
    }
}

#[test]
fn wagma_with_one_group_and_no_late_rank_is_local_sgd_with_period_one() {
    let opt = momentum_sgd();
    for p in [4, 6] {
        let local = replicas(EXACT, p, Algorithm::LocalSgd { period: 1 }, &opt, 25);
        let wagma = replicas(
            EXACT,
            p,
            Algorithm::Wagma(WagmaOptions {
                group_size: Some(p),
                tau: Some(5),
                ..WagmaOptions::default()
            }),
            &opt,
            25,
        );
        for (a, b) in local.iter().zip(&wagma) {
            assert!(
                b.reports.iter().all(|r| r.fresh == Some(true)),
                "a rank was late"
            );
            assert_eq!(bits(&a.replica), bits(&b.replica), "P = {p}");
        }
    }
}

#[test]
fn d_psgd_on_three_ranks_is_global_averaging() {
    let opt = momentum_sgd();
    let local = replicas(EXACT, 3, Algorithm::LocalSgd { period: 1 }, &opt, 30);
    let dpsgd = replicas(EXACT, 3, Algorithm::DPsgd, &opt, 30);
    for (a, b) in local.iter().zip(&dpsgd) {
        assert_eq!(bits(&a.replica), bits(&b.replica));
    }
}

#[test]
fn local_sgd_with_plain_sgd_equals_allreduce_sgd() {
    let opt = OptimizerConfig::sgd(0.1);
    let local = replicas(EXACT, 8, Algorithm::LocalSgd { period: 1 }, &opt, 40);
    let ar = replicas(EXACT, 8, Algorithm::AllreduceSgd, &opt, 40);
    for (a, b) in local.iter().zip(&ar) {
        for (x, y) in a.replica.iter().zip(&b.replica) {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1e-3), "{x} vs {y}");
        }
    }
}

fn all_algorithms() -> Vec<Algorithm> {
    let mut v: Vec<Algorithm> = Algorithm::NAMES
        .iter()
        .map(|n| Algorithm::from_name(n).unwrap())
        .collect();
    v.push(Algorithm::Sgp {
        peers: 2,
        offsets: PeerOffsets::Disjoint,
    });
    v.push(Algorithm::Sgp {
        peers: 2,
        offsets: PeerOffsets::Sliding,
    });
    for mode in [EagerMode::Solo, EagerMode::Majority] {
        v.push(Algorithm::EagerSgd {
            mode,
            sync_period: Some(32),
            late: LateGradients::Drop,
        });
    }
    v.push(Algorithm::AdPsgd { gossip: Some(2) });
    v.push(Algorithm::LocalSgd { period: 4 });
    v.push(Algorithm::Wagma(WagmaOptions {
        combine: CombineRule::Damped,
        groups: wagma::topology::GroupingKind::Random { seed: 3 },
        ..WagmaOptions::default()
    }));
    v
}

#[test]
fn every_algorithm_converges_to_the_optimum_under_delays() {
    let p = 8;
    let (_, optimum) = shards(p, 42);
    let steps = 600;
    let opt = OptimizerConfig {
        lr: LrSchedule::Cosine {
            lr: 0.2,
            warmup: 0,
            total: steps,
            min_lr: 0.0,
        },
        momentum: 0.5,
        ..OptimizerConfig::default()
    };
    let delays = Imbalance {
        profile: Profile::PaperResnet,
        time_scale: 0.01,
        seed: 7,
    };
    let norm = optimum.iter().map(|x| x * x).sum::<f64>().sqrt();
    for (i, algo) in all_algorithms().into_iter().enumerate() {
        for order in [Order::StepThenAverage, Order::AverageThenStep] {
            if order == Order::AverageThenStep && !matches!(algo, Algorithm::Wagma(_)) {
                continue;
            }
            let mut cfg = AlgoConfig::new(algo.clone());
            cfg.order = order;
            cfg.seed = 5;
            let out = train(
                Exec::Virtual {
                    seed: i as u64,
                    jitter: 0.5,
                },
                p,
                cfg,
                opt.clone(),
                steps,
                Some(delays),
            )
            .into_all()
            .unwrap();
            let dist = out[0]
                .consensus
                .iter()
                .zip(&optimum)
                .map(|(&x, y)| (f64::from(x) - y).powi(2))
                .sum::<f64>()
                .sqrt()
                / norm;
            println!(
                "{:<28} {order:?}: relative distance of the consensus to the optimum {dist:.2e}",
                algo.label()
            );
            assert!(
                dist < 1e-2,
                "{} ({order:?}) ended at relative distance {dist}",
                algo.label()
            );
            if let Algorithm::Wagma(WagmaOptions { tau: Some(tau), .. }) = algo {
                for o in &out {
                    assert!(
                        o.max_staleness <= tau,
                        "staleness {} > tau {tau}",
                        o.max_staleness
                    );
                }
            }
        }
    }
}

/// On real threads every algorithm runs to the end and moves its consensus toward the
/// optimum. How close it gets depends on the interleaving (which gradients a solo round
/// drops or defers depends on who arrives first), so the precise bound is asserted in virtual
/// time (above); this one holds for any interleaving on a loaded machine.
#[test]
fn threaded_algorithms_run_and_head_for_the_optimum() {
    let p = 4;
    let (_, optimum) = shards(p, 42);
    let steps = 300;
    let opt = OptimizerConfig {
        lr: LrSchedule::Cosine {
            lr: 0.2,
            warmup: 0,
            total: steps,
            min_lr: 0.0,
        },
        momentum: 0.5,
        ..OptimizerConfig::default()
    };
    let norm = optimum.iter().map(|x| x * x).sum::<f64>().sqrt();
    for algo in all_algorithms() {
        let out = train(
            Exec::Threads,
            p,
            AlgoConfig::new(algo.clone()),
            opt.clone(),
            steps,
            None,
        )
        .into_all()
        .unwrap();
        let dist = out[0]
            .consensus
            .iter()
            .zip(&optimum)
            .map(|(&x, y)| (f64::from(x) - y).powi(2))
            .sum::<f64>()
            .sqrt()
            / norm;
        // From the zero model the distance is 1.
        assert!(dist < 0.5, "{} ended at {dist}", algo.label());
    }
}

#[test]
fn push_sum_conserves_mass_in_every_round() {
    let p = 8;
    let out = train(
        Exec::Virtual {
            seed: 3,
            jitter: 0.5,
        },
        p,
        AlgoConfig::new(Algorithm::Sgp {
            peers: 2,
            offsets: PeerOffsets::Disjoint,
        }),
        momentum_sgd(),
        50,
        Some(Imbalance {
            profile: Profile::Lengths,
            time_scale: 0.01,
            seed: 1,
        }),
    )
    .into_all()
    .unwrap();
    for t in 0..50 {
        let mass: f64 = out.iter().map(|o| o.reports[t].weight.unwrap()).sum();
        assert!((mass - p as f64).abs() < 1e-9, "round {t}: mass {mass}");
    }
}

#[test]
fn a_replay_with_the_same_seed_gives_identical_models() {
    let cfg = AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        tau: Some(4),
        ..WagmaOptions::default()
    }));
    let delays = Imbalance {
        profile: Profile::HeavyTail,
        time_scale: 0.01,
        seed: 9,
    };
    let run = |seed| {
        train(
            Exec::Virtual { seed, jitter: 0.5 },
            8,
            cfg.clone(),
            momentum_sgd(),
            60,
            Some(delays),
        )
        .into_all()
        .unwrap()
    };
    let (a, b) = (run(11), run(11));
    let stale = a
        .iter()
        .flat_map(|o| &o.reports)
        .filter(|r| r.fresh == Some(false))
        .count();
    assert!(stale > 0, "the heavy tail should make ranks late");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(bits(&x.replica), bits(&y.replica));
        assert_eq!(x.reports, y.reports);
    }
}

/// Per rank after `steps` zero-gradient steps from the model `[rank; 3]` (with a checkpoint
/// quiesce half-way): the replica, each step's wait, and the gossip exchanges its engine ran.
fn ad_psgd_without_gradients(
    gossip: Option<u32>,
    p: usize,
    steps: u64,
) -> Vec<(Vec<f32>, Vec<f64>, u64)> {
    let algo = AlgoConfig::new(Algorithm::AdPsgd { gossip });
    let task = async |c: &mut wagma::Comm| -> Result<_, Error> {
        let start = Payload::Data(vec![c.rank() as f32; 3]);
        let mut w = Worker::external(
            c,
            algo.clone(),
            start,
            Payload::default(),
            Resume::default(),
        )
        .await?;
        let mut waits = Vec::new();
        for t in 0..steps {
            w.comm().compute(Duration::from_millis(1 + t % 3)).await;
            waits.push(w.step_external(&[], &mut |_, _| {}).await?.waited_s);
            if t == steps / 2 {
                w.quiesce().await?;
            }
        }
        let replica = w.params().to_vec();
        w.comm().barrier().await?;
        let exchanges = w.comm().engine_stats().await?.gossip_exchanges;
        Ok((replica, waits, exchanges))
    };
    let cfg = virtual_time::VirtualConfig {
        seed: 4,
        network: Box::new(virtual_time::JitterNetwork::default()),
    };
    virtual_time::run(p, EngineConfig::default(), cfg, task)
        .unwrap()
        .into_all()
        .unwrap()
}

#[test]
fn ad_psgd_gossip_never_waits_and_mixes_every_replica_to_the_mean() {
    let (p, steps, k) = (6, 80, 2);
    let mean = (p - 1) as f32 / 2.0;
    let gossip = ad_psgd_without_gradients(Some(k), p, steps);
    let pairing = wagma::topology::Pairing::new(p).unwrap();
    for (r, (replica, waits, exchanges)) in gossip.iter().enumerate() {
        // Mixing and the pairwise averages keep the sum of models and shared copies: the
        // replicas meet at the mean of the initial models.
        for x in replica {
            assert!((x - mean).abs() < 1e-3, "rank {r} ended at {replica:?}");
        }
        assert!(
            waits.iter().all(|&w| w == 0.0),
            "rank {r} waited: {waits:?}"
        );
        // An exchange is far shorter than a step, so each step's budget runs in full except
        // before the quiesce and at the end, where a blocking collective ends it after the
        // exchange in flight.
        let want = match pairing.role(r) {
            wagma::topology::PairRole::Active => u64::from(k) * (steps - 2) + 2,
            wagma::topology::PairRole::Passive => 0,
        };
        assert_eq!(*exchanges, want, "rank {r}");
    }
    // The canonical rule makes every active rank wait for its passive peer's reply.
    let canonical = ad_psgd_without_gradients(None, p, steps);
    for (r, (replica, waits, _)) in canonical.iter().enumerate() {
        for x in replica {
            assert!((x - mean).abs() < 1e-2, "rank {r} ended at {replica:?}");
        }
        let waited = waits.iter().filter(|&&w| w > 0.0).count();
        match pairing.role(r) {
            wagma::topology::PairRole::Active => assert_eq!(waited, steps as usize, "rank {r}"),
            wagma::topology::PairRole::Passive => assert_eq!(waited, 0, "rank {r}"),
        }
    }
    // Deterministic: the same run again gives the same bits.
    let again = ad_psgd_without_gradients(Some(k), p, steps);
    for (a, b) in gossip.iter().zip(&again) {
        assert_eq!(bits(&a.0), bits(&b.0));
        assert_eq!(a.2, b.2);
    }
}

#[test]
fn ad_psgd_gossip_refuses_elastic_runs_and_empty_budgets() {
    assert!(matches!(
        AlgoConfig::new(Algorithm::AdPsgd { gossip: Some(0) }).validate(4),
        Err(ConfigError::Invalid { .. })
    ));
    let elastic = EngineConfig {
        elastic: true,
        ..EngineConfig::default()
    };
    let algo = AlgoConfig::new(Algorithm::AdPsgd { gossip: Some(1) });
    let job = threaded::run(2, elastic, async |c: &mut wagma::Comm| {
        let start = Payload::Data(vec![0.0; 2]);
        Worker::new(c, algo.clone(), momentum_sgd(), start, Payload::default())
            .await
            .map(drop)
    })
    .unwrap();
    for r in job.ranks {
        assert!(
            matches!(
                r,
                Err(Error::Config(ConfigError::Invalid {
                    what: "ad-psgd gossip",
                    ..
                }))
            ),
            "{r:?}"
        );
    }
}

#[test]
fn bad_configurations_are_typed_errors() {
    let opt = OptimizerConfig::sgd(0.1);
    let try_algo = |algo: Algorithm| -> Error {
        train(EXACT, 4, AlgoConfig::new(algo), opt.clone(), 1, None)
            .into_all()
            .unwrap_err()
    };
    assert!(matches!(
        try_algo(Algorithm::LocalSgd { period: 0 }),
        Error::Config(ConfigError::ZeroPeriod)
    ));
    assert!(matches!(
        try_algo(Algorithm::Sgp {
            peers: 4,
            offsets: PeerOffsets::Disjoint,
        }),
        Error::Config(ConfigError::TooManyPeers { .. })
    ));
    assert!(matches!(
        try_algo(Algorithm::Wagma(WagmaOptions {
            tau: Some(0),
            ..WagmaOptions::default()
        })),
        Error::Config(ConfigError::ZeroTau)
    ));
    assert!(matches!(
        Algorithm::from_name("adam-sgd"),
        Err(ConfigError::Invalid { .. })
    ));
    let _ = Scope::default();
}
