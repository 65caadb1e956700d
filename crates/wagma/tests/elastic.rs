//! Elastic continuation: when a rank dies, WAGMA goes on with the survivors.

mod common;

use std::time::Duration;

use wagma::algo::{
    AlgoConfig, Algorithm, EagerMode, LateGradients, OptimizerConfig, WagmaOptions, Worker,
};
use wagma::exec::threaded;
use wagma::{Comm, EngineConfig, Error, Payload};

#[test]
fn wagma_goes_on_without_a_dead_rank() {
    // Every rank pulls its model towards 1.0; rank 5 dies half-way.
    assert_survivors_converge(elastic_run(8, 60, wagma(), |r| (r == 5).then_some(30)));
}

fn wagma() -> Algorithm {
    Algorithm::Wagma(WagmaOptions {
        tau: Some(5),
        ..WagmaOptions::default()
    })
}

#[test]
fn d_psgd_averages_over_the_living_neighbours_after_a_loss() {
    // Ranks 4 and 6 lose a ring neighbour: they must average two models, not divide the sum
    // of two by three (which would pull them towards 0 at every step).
    assert_survivors_converge(elastic_run(8, 60, Algorithm::DPsgd, |r| {
        (r == 5).then_some(30)
    }));
}

#[test]
fn eager_sgd_averages_gradients_over_the_living_after_a_loss() {
    // Every gradient is 1 and every round a sync, so the average gradient is exactly 1 and each
    // step moves a parameter by the learning rate 0.125: with all 8 ranks, and with the 7 left
    // once rank 5 dies at step 10 (dividing their sum by 8 would shorten the last 10 steps).
    let cfg = elastic_engine();
    let algo = AlgoConfig::new(Algorithm::EagerSgd {
        mode: EagerMode::Solo,
        sync_period: Some(1),
        late: LateGradients::Accumulate,
    });
    let out = threaded::run(8, cfg, async |c: &mut Comm| {
        let rank = c.rank();
        let mut w = Worker::new(
            c,
            algo.clone(),
            OptimizerConfig::sgd(0.125),
            Payload::Data(vec![0.0; 2]),
            Payload::default(),
        )
        .await?;
        for t in 0..20 {
            if rank == 5 && t == 10 {
                return Err(Error::Task {
                    rank,
                    message: "killed".into(),
                });
            }
            w.step(&[1.0; 2]).await?;
        }
        Ok(w.params().to_vec())
    })
    .unwrap();
    for (rank, r) in out.ranks.iter().enumerate() {
        if rank == 5 {
            assert!(r.is_err());
            continue;
        }
        let params = r
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {rank} failed: {e}"));
        assert_eq!(params, &vec![-2.5; 2], "rank {rank}");
    }
}

/// Every rank but rank 5 (which died) ends within 0.05 of the optimum 1.0.
fn assert_survivors_converge(out: Vec<Result<Vec<f32>, Error>>) {
    for (rank, r) in out.iter().enumerate() {
        if rank == 5 {
            assert!(r.is_err());
            continue;
        }
        let m = r
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {rank} failed: {e}"));
        assert!(
            m.iter().all(|&x| (x - 1.0).abs() < 0.05),
            "rank {rank}: {m:?}"
        );
    }
}

#[test]
fn collectives_average_over_the_living_after_a_loss() {
    let cfg = elastic_engine();
    let out = threaded::run(4, cfg, async |c: &mut Comm| {
        let rank = c.rank();
        let before = c
            .allreduce_mean(Payload::Data(vec![rank as f32; 3]))
            .await?;
        let max_before = c.allreduce_max(Payload::Data(vec![rank as f32; 3])).await?;
        if rank == 3 {
            return Err(Error::Task {
                rank,
                message: "killed".into(),
            });
        }
        let mut after = Vec::new();
        for _ in 0..5 {
            after.push(
                c.allreduce_mean(Payload::Data(vec![rank as f32; 3]))
                    .await?
                    .into_vec(),
            );
        }
        // The maximum is over the living too: the lost rank held the largest value.
        let max_after = c.allreduce_max(Payload::Data(vec![rank as f32; 3])).await?;
        let maxima = (max_before.into_vec(), max_after.into_vec());
        Ok((before.into_vec(), after, maxima, c.living_ranks().await?))
    })
    .unwrap();
    for r in out.ranks.iter().take(3) {
        let (before, after, maxima, living) = r.as_ref().unwrap();
        assert_eq!(before, &vec![1.5; 3]);
        assert_eq!(maxima, &(vec![3.0; 3], vec![2.0; 3]));
        for a in after {
            assert_eq!(a, &vec![1.0; 3]);
        }
        assert_eq!(living, &vec![0, 1, 2]);
    }
}

/// Trains `p` elastic ranks for `steps` steps, each pulling its model towards 1.0;
/// `dies(rank)` is the step at which a rank stops (if ever). Returns each rank's consensus
/// model or error.
fn elastic_run(
    p: usize,
    steps: u64,
    algorithm: Algorithm,
    dies: impl Fn(usize) -> Option<u64> + Sync,
) -> Vec<Result<Vec<f32>, Error>> {
    let cfg = elastic_engine();
    let algo = AlgoConfig::new(algorithm);
    let out = threaded::run(p, cfg, async |c: &mut Comm| {
        let rank = c.rank();
        let mut w = Worker::new(
            c,
            algo.clone(),
            OptimizerConfig::sgd(0.1),
            Payload::Data(vec![0.0; 4]),
            Payload::default(),
        )
        .await?;
        for t in 0..steps {
            if dies(rank) == Some(t) {
                return Err(Error::Task {
                    rank,
                    message: "killed".into(),
                });
            }
            w.comm()
                .compute(Duration::from_millis(1 + (rank as u64 + t) % 3))
                .await;
            let grad: Vec<f32> = w.params().iter().map(|x| x - 1.0).collect();
            w.step(&grad).await?;
        }
        let (consensus, _) = w.consensus().await?;
        Ok(consensus.into_vec())
    })
    .unwrap();
    out.ranks
}

/// The quorum error behind `r`, whether reported directly or as the cause of a stop.
fn no_quorum<T>(r: &Result<T, Error>) -> Option<&Error> {
    match r {
        Err(e @ Error::NoQuorum { .. }) => Some(e),
        Err(Error::Stopped { cause: Some(c), .. }) if matches!(**c, Error::NoQuorum { .. }) => {
            Some(c)
        }
        _ => None,
    }
}

#[test]
fn survivors_without_a_strict_majority_stop_naming_the_partition() {
    // 4 ranks: losing rank 3 leaves 3 of 4 (a majority); losing rank 2 as well leaves 2 of 4.
    let out = elastic_run(4, 40, wagma(), |r| match r {
        3 => Some(5),
        2 => Some(20),
        _ => None,
    });
    for (rank, r) in out.iter().enumerate().take(2) {
        match no_quorum(r) {
            Some(
                e @ Error::NoQuorum {
                    lost, alive, ranks, ..
                },
            ) => {
                assert_eq!((*lost, alive.as_slice(), *ranks), (2, &[0, 1][..], 4));
                assert!(e.to_string().contains("no strict majority"), "{e}");
            }
            _ => panic!("rank {rank}: {r:?}"),
        }
    }
}

#[test]
fn losing_rank_0_ends_an_elastic_job_on_every_survivor() {
    let out = elastic_run(3, 40, wagma(), |r| (r == 0).then_some(10));
    for r in &out[1..] {
        match no_quorum(r) {
            Some(e @ Error::NoQuorum { lost: 0, .. }) => {
                assert!(e.to_string().contains("without rank 0"), "{e}");
            }
            _ => panic!("{r:?}"),
        }
    }
}

/// An elastic engine that finds a dead peer by its heartbeats within a fraction of a second.
fn elastic_engine() -> EngineConfig {
    EngineConfig {
        timeout: Duration::from_secs(10),
        heartbeat: Some(Duration::from_millis(250)),
        elastic: true,
        ..EngineConfig::default()
    }
}
