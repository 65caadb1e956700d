//! Runs an algorithm on emulated compute times with real communication, as
//! `wagma bench imbalance` and the simulator do, and sums up the job.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::bound::draw;
use super::config::AlgoConfig;
use super::optim::OptimizerConfig;
use super::worker::Worker;
use crate::error::Error;
use crate::exec::Comm;
use crate::payload::Payload;
use crate::util::Histogram;

/// What to run.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The algorithm.
    pub algo: AlgoConfig,
    /// Iterations.
    pub steps: u64,
    /// Model size in f32 elements.
    pub model_len: usize,
    /// Samples per local step (only for samples/s).
    pub batch: usize,
    /// Compute time per step and rank, seconds: `draws[step][rank]`.
    pub draws: Arc<Vec<Vec<f64>>>,
    /// Carry real data (`false`: sizes only, for simulations).
    pub real_data: bool,
}

/// The job's totals, identical on every rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobStats {
    /// Ranks.
    pub ranks: usize,
    /// Iterations per rank.
    pub steps: u64,
    /// Samples per local step.
    pub batch: usize,
    /// Seconds until the last rank finished.
    pub wall_s: f64,
    /// Seconds waited for communication, summed over ranks.
    pub wait_s: f64,
    /// Seconds of emulated compute, summed over ranks.
    pub compute_s: f64,
    /// Seconds each rank spent neither computing nor waiting (copies, publishing, the
    /// optimizer step, the engine's work on the caller's thread): its own wall time less its
    /// own waiting and compute, at least zero, summed over ranks.
    #[serde(default)]
    pub overhead_s: f64,
    /// Staleness of the contributions used by every rank.
    pub staleness: Histogram,
}

impl JobStats {
    /// Iterations per second (of the job: each iteration is one step of every rank).
    pub fn iterations_per_s(&self) -> f64 {
        self.steps as f64 / self.wall_s
    }

    /// Samples per second over all ranks.
    pub fn samples_per_s(&self) -> f64 {
        (self.ranks * self.batch) as f64 * self.steps as f64 / self.wall_s
    }

    /// Share of the ranks' time spent waiting.
    pub fn wait_fraction(&self) -> f64 {
        self.wait_s / (self.wall_s * self.ranks as f64)
    }

    /// Milliseconds per local step neither computing nor waiting, averaged over ranks.
    pub fn overhead_ms_per_step(&self) -> f64 {
        1e3 * self.overhead_s / (self.ranks as f64 * self.steps.max(1) as f64)
    }
}

/// Staleness buckets carried in the totals (larger values land in the last one).
const STALENESS_BUCKETS: usize = 65;

/// Runs `spec` on this rank and returns the job's totals (a collective of all ranks).
pub async fn run(comm: &mut Comm, spec: &Spec) -> Result<JobStats, Error> {
    let rank = comm.rank();
    let p = comm.size();
    let params = if spec.real_data {
        Payload::Data(vec![0.5; spec.model_len])
    } else {
        Payload::Size(spec.model_len)
    };
    let grad: Vec<f32> = if spec.real_data {
        (0..spec.model_len)
            .map(|i| 1e-3 * ((i % 7) as f32 - 3.0))
            .collect()
    } else {
        Vec::new()
    };
    let opt = OptimizerConfig::sgd(0.01);
    comm.barrier().await?;
    let base_wait = comm.stats().wait_s;
    let base_staleness = comm.stats().staleness.clone();
    let start = comm.now();
    let mut compute = 0.0;
    {
        let mut w = Worker::new(
            comm,
            spec.algo.clone(),
            opt,
            params,
            Payload::Data(Vec::new()),
        )
        .await?;
        for t in 0..spec.steps {
            let c = draw(&spec.draws, t as usize, rank);
            compute += c;
            w.comm().compute(Duration::from_secs_f64(c)).await;
            if spec.real_data {
                w.step(&grad).await?;
            } else {
                w.step_with(Payload::Size(spec.model_len)).await?;
            }
        }
    }
    let wall = (comm.now() - start).as_secs_f64();
    let wait = comm.stats().wait_s - base_wait;
    let mut staleness = vec![0f32; STALENESS_BUCKETS];
    for (v, c) in comm.stats().staleness.iter() {
        let before = base_staleness.count(v);
        staleness[(v as usize).min(STALENESS_BUCKETS - 1)] += (c - before) as f32;
    }
    // Totals over ranks: the job's wall time is the longest, the rest are sums. This rank's
    // overhead is taken from its own exact times, not from the difference of rounded sums.
    let longest = comm
        .allreduce_max(Payload::Data(vec![wall as f32]))
        .await?
        .into_vec();
    let overhead = (wall - wait - compute).max(0.0);
    let mut v = vec![0f32; 3 + STALENESS_BUCKETS];
    v[0] = wait as f32;
    v[1] = compute as f32;
    v[2] = overhead as f32;
    v[3..].copy_from_slice(&staleness);
    let sum = comm.allreduce(Payload::Data(v)).await?.into_vec();
    let mut hist = Histogram::default();
    for (s, &c) in sum[3..].iter().enumerate() {
        hist.record_n(s as u64, c.round() as u64);
    }
    Ok(JobStats {
        ranks: p,
        steps: spec.steps,
        batch: spec.batch,
        wall_s: longest.first().copied().map_or(0.0, f64::from),
        wait_s: f64::from(sum[0]),
        compute_s: f64::from(sum[1]),
        overhead_s: f64::from(sum[2]),
        staleness: hist,
    })
}
