//! The three workloads, mirroring the paper's: image classification (ResNet-style CNN),
//! translation of variable-length sentences (Transformer), point-goal navigation (PPO).

pub mod image;
pub mod navigate;
pub mod translate;

use burn::module::Module;
use burn::prelude::*;

/// A training task the trainer can run on any algorithm.
pub trait Workload: Sync {
    /// The network.
    type Model: Module;
    /// Per-rank state: the rank's data shard and sampler, its environments, its random state.
    type Local: Send;

    /// The workload's name.
    fn name(&self) -> &'static str;

    /// Builds the network on `device` (its initial values are replaced by the shared initial
    /// model, so only the architecture matters).
    fn build(&self, device: &Device) -> Self::Model;

    /// The training samples the ranks shard among themselves (every rank needs at least one),
    /// or `None` where each rank makes its own (episodes).
    fn train_samples(&self) -> Option<usize>;

    /// The state of `rank` among `ranks`.
    fn local(&self, rank: usize, ranks: usize, seed: u64) -> Self::Local;

    /// The loss of one local step on the training device, and the samples it used. `step` is
    /// the iteration.
    fn loss(&self, model: &Self::Model, local: &mut Self::Local, step: u64) -> (Tensor<1>, usize);

    /// Additive evaluation statistics of `model` (on the evaluation device) over this rank's
    /// share of the held-out data.
    fn evaluate(&self, model: &Self::Model, rank: usize, ranks: usize) -> Vec<f64>;

    /// Metrics from the statistics summed over ranks.
    fn metrics(&self, sums: &[f64]) -> Vec<(&'static str, f64)>;

    /// The metric that decides "better" (accuracy, BLEU, SPL).
    fn primary(&self) -> &'static str;

    /// The per-rank state to put in a checkpoint.
    fn save_local(&self, local: &Self::Local) -> serde_json::Value;

    /// Restores per-rank state from a checkpoint taken at `iteration` (no rank's state
    /// embodies more local steps than that).
    fn load_local(
        &self,
        local: &mut Self::Local,
        saved: &serde_json::Value,
        iteration: u64,
    ) -> Result<(), String>;
}

/// Index of the largest value in each row of `logits` `[n, k]`.
pub(crate) fn argmax_rows(logits: Tensor<2>) -> Vec<i64> {
    logits
        .argmax(1)
        .into_data()
        .convert::<i64>()
        .iter::<i64>()
        .collect()
}
