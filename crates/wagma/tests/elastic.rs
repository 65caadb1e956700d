//! Elastic continuation: when a rank dies, WAGMA goes on with the survivors.

mod common;

use std::time::Duration;

use wagma::algo::{AlgoConfig, Algorithm, OptimizerConfig, WagmaOptions, Worker};
use wagma::exec::threaded;
use wagma::{Comm, EngineConfig, Error, Payload};

#[test]
fn wagma_goes_on_without_a_dead_rank() {
    let p = 8;
    let cfg = EngineConfig {
        timeout: Duration::from_secs(10),
        heartbeat: Some(Duration::from_millis(250)),
        elastic: true,
        ..EngineConfig::default()
    };
    let algo = AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        tau: Some(5),
        ..WagmaOptions::default()
    }));
    // Every rank pulls its model towards 1.0; rank 5 dies half-way.
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
        for t in 0..60 {
            if rank == 5 && t == 30 {
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
    for (rank, r) in out.ranks.iter().enumerate() {
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
    let cfg = EngineConfig {
        timeout: Duration::from_secs(10),
        heartbeat: Some(Duration::from_millis(250)),
        elastic: true,
        ..EngineConfig::default()
    };
    let out = threaded::run(4, cfg, async |c: &mut Comm| {
        let rank = c.rank();
        let before = c
            .allreduce_mean(Payload::Data(vec![rank as f32; 3]))
            .await?;
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
        Ok((before.into_vec(), after, c.living_ranks().await?))
    })
    .unwrap();
    for r in out.ranks.iter().take(3) {
        let (before, after, living) = r.as_ref().unwrap();
        assert_eq!(before, &vec![1.5; 3]);
        for a in after {
            assert_eq!(a, &vec![1.0; 3]);
        }
        assert_eq!(living, &vec![0, 1, 2]);
    }
}
