//! # wagma-train
//!
//! Training with wagma on burn (`=0.22.1`, CPU backend `flex`): a flat view of any burn model
//! ([`flat::FlatModel`]), three workloads mirroring the paper's (image classification with a
//! ResNet-style CNN, English-German translation of variable-length sentences with a Transformer,
//! point-goal navigation with PPO), the training loop with evaluation of the consensus model,
//! metrics, summaries and checkpoints.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod distributed;
mod elastic;
pub mod error;
mod evaluation;
pub mod flat;
pub mod metrics;
pub mod nav;
mod offload;
mod outputs;
pub mod trainer;
pub mod workloads;

pub use config::{Execution, TrainConfig, WorkloadKind};
pub use device::DeviceChoice;
pub use distributed::DistributedOptimizer;
pub use error::TrainError;
pub use flat::FlatModel;
pub use trainer::{EvalRecord, Observer, Summary};
