//! # wagma
//!
//! Wait-Avoiding Group Model Averaging (WAGMA-SGD, Li et al., IEEE TPDS 2021) and the
//! algorithms it is measured against, as a library for distributed data-parallel training on
//! flat `f32` model buffers.
//!
//! Layers, bottom up:
//! * [`topology`]: groups per round, peer graphs, activation trees (pure functions);
//! * [`schedule`]: collectives as per-rank programs of sends, receives and reductions;
//! * [`transport`]: tagged messages between ranks ([`transport::mem`], [`transport::tcp`]);
//! * [`engine`]: the per-rank progress engine (wait-avoiding rounds, syncs, timeouts);
//! * [`exec`]: executors of the engines and the compute side's [`Comm`]: threads over a real
//!   transport, or a deterministic virtual-time scheduler;
//! * [`algo`]: WAGMA-SGD and the baselines as policies over flat buffers, driven by a
//!   [`algo::Worker`], with the local optimizer;
//! * [`imbalance`]: load-imbalance profiles of the paper's workloads.

pub mod algo;
pub mod engine;
pub mod error;
pub mod exec;
pub mod imbalance;
pub mod payload;
pub(crate) mod prefetch;
pub mod schedule;
pub mod topology;
pub mod trace;
pub mod transport;
pub(crate) mod uncached;
pub mod util;

/// A rank id, `0..P`.
pub type Rank = usize;

pub use engine::{EngineConfig, RoundMembers, RoundResult, StreamConfig};
pub use error::{ConfigError, Error, Result};
pub use exec::{Comm, CommStats, JobResult, block_on};
pub use payload::Payload;
