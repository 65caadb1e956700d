//! One simulated job, and its ideal and bound.

use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use wagma::algo::measure::{self, JobStats, Spec};
use wagma::algo::{AlgoConfig, bound_wall, ideal_wall};
use wagma::exec::virtual_time::{self, NetworkModel, VirtualConfig};

use crate::SimError;
use crate::compute::Compute;
use crate::loggp::{LogGp, LogGpNetwork};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimSpec {
    /// Ranks.
    pub ranks: usize,
    /// Algorithm.
    pub algo: AlgoConfig,
    /// Iterations.
    pub steps: u64,
    /// Model size in f32 elements (carried as a size only).
    pub model_params: usize,
    /// Samples per local step.
    pub batch: usize,
    /// Compute times.
    pub compute: Compute,
    /// Network.
    pub network: LogGp,
    /// Seed of the scheduler.
    pub seed: u64,
}

/// The outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimResult {
    /// Algorithm label.
    pub algorithm: String,
    /// Ranks.
    pub ranks: usize,
    /// The simulated job's totals (times are virtual).
    pub stats: JobStats,
    /// Samples per second in virtual time.
    pub samples_per_s: f64,
    /// Samples per second with no waiting and no communication, same draws.
    pub ideal_samples_per_s: f64,
    /// Samples per second the algorithm's waiting rules allow with free communication.
    pub bound_samples_per_s: f64,
    /// Real seconds the simulation took.
    pub simulation_s: f64,
}

/// Runs a simulation over the LogGP network of `spec`.
pub fn simulate(spec: &SimSpec) -> Result<SimResult, SimError> {
    spec.network.validate().map_err(SimError::Config)?;
    let network = Box::new(LogGpNetwork::new(spec.network, spec.ranks));
    simulate_on(spec, network)
}

/// Runs a simulation over another network model (for example one that wraps the LogGP model to
/// record every message); `spec.network` is ignored.
pub fn simulate_on(spec: &SimSpec, network: Box<dyn NetworkModel>) -> Result<SimResult, SimError> {
    if spec.steps == 0 {
        return Err(SimError::Config("steps must be at least 1".into()));
    }
    spec.algo.algorithm.validate(spec.ranks)?;
    spec.compute.validate()?;
    let draws = Arc::new(spec.compute.table(spec.steps, spec.ranks));
    let m = Spec {
        algo: spec.algo.clone(),
        steps: spec.steps,
        model_len: spec.model_params,
        batch: spec.batch,
        draws: Arc::clone(&draws),
        real_data: false,
    };
    let vcfg = VirtualConfig {
        seed: spec.seed,
        network,
    };
    let t0 = Instant::now();
    let stats = virtual_time::run(spec.ranks, crate::virtual_engine(), vcfg, async |c| {
        measure::run(c, &m).await
    })?
    .into_all()?
    .swap_remove(0);
    let samples = (spec.ranks * spec.batch) as f64 * spec.steps as f64;
    Ok(SimResult {
        algorithm: spec.algo.label(),
        ranks: spec.ranks,
        samples_per_s: stats.samples_per_s(),
        ideal_samples_per_s: samples / ideal_wall(&draws),
        bound_samples_per_s: samples / bound_wall(&spec.algo, &draws),
        stats,
        simulation_s: t0.elapsed().as_secs_f64(),
    })
}
