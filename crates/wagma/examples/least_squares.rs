//! Eight in-process ranks fit a least-squares model with WAGMA-SGD, each on its own shard of
//! generated data, with two random ranks delayed every step; the consensus model is compared
//! with the exact solution.
//!
//! `cargo run --release -p wagma --example least_squares`

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wagma::algo::{AlgoConfig, Algorithm, LrSchedule, OptimizerConfig, WagmaOptions, Worker};
use wagma::exec::threaded;
use wagma::imbalance::{Imbalance, Profile};
use wagma::{Comm, EngineConfig, Error, Payload};

const RANKS: usize = 8;
const DIM: usize = 10;
const ROWS: usize = 64;
const STEPS: u64 = 300;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let truth: Vec<f32> = (0..DIM).map(|_| rng.random_range(-1.0..1.0)).collect();
    // Rank r's shard: rows a (ROWS x DIM) and noiseless targets b = a . truth.
    let shards: Vec<(Vec<f32>, Vec<f32>)> = (0..RANKS)
        .map(|_| {
            let a: Vec<f32> = (0..ROWS * DIM)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let b = a
                .chunks(DIM)
                .map(|row| row.iter().zip(&truth).map(|(x, w)| x * w).sum())
                .collect();
            (a, b)
        })
        .collect();
    let algo = AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        tau: Some(10),
        ..WagmaOptions::default()
    }));
    let opt = OptimizerConfig {
        lr: LrSchedule::Cosine {
            lr: 0.1,
            warmup: 10,
            total: STEPS,
            min_lr: 0.0,
        },
        momentum: 0.9,
        ..OptimizerConfig::default()
    };
    let delays = Imbalance {
        profile: Profile::PaperResnet,
        time_scale: 0.005,
        seed: 2,
    };

    let results = threaded::run(RANKS, EngineConfig::default(), async |c: &mut Comm| {
        let rank = c.rank();
        let (a, b) = &shards[rank];
        let mut w = Worker::new(
            c,
            algo.clone(),
            opt.clone(),
            Payload::Data(vec![0.0; DIM]),
            Payload::default(),
        )
        .await?;
        for t in 0..STEPS {
            // The local step: emulated compute time, then the gradient of the shard's loss.
            let delay = delays.step_times(t, RANKS)[rank];
            w.comm().compute(Duration::from_secs_f64(delay)).await;
            let x = w.params();
            let mut grad = vec![0.0f32; DIM];
            for (row, &y) in a.chunks(DIM).zip(b) {
                let err: f32 = row.iter().zip(x).map(|(r, w)| r * w).sum::<f32>() - y;
                for (g, r) in grad.iter_mut().zip(row) {
                    *g += err * r / ROWS as f32;
                }
            }
            w.step(&grad).await?;
        }
        let (consensus, _) = w.consensus().await?;
        let stats = w.comm().stats().clone();
        Ok::<_, Error>((consensus.into_vec(), stats))
    })?
    .into_all()?;

    let (model, _) = &results[0];
    let err = model
        .iter()
        .zip(&truth)
        .map(|(m, t)| (m - t).powi(2))
        .sum::<f32>()
        .sqrt();
    println!("distance of the consensus to the true model: {err:.2e}");
    for (rank, (_, s)) in results.iter().enumerate() {
        println!(
            "rank {rank}: waited {:.3} s, fresh in {} rounds, stale in {}, staleness {}",
            s.wait_s, s.fresh_rounds, s.stale_rounds, s.staleness
        );
    }
    Ok(())
}
