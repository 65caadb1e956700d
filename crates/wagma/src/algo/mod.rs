//! Training algorithms on flat `f32` buffers: WAGMA-SGD with every option of the paper and its
//! released code, and the baselines it is measured against, all driven through one API
//! ([`Worker`]): hand over the gradient of each local step, read back the model.
//!
//! | algorithm | each iteration | waits for | per rank and iteration |
//! |---|---|---|---|
//! | `wagma` | local step, wait-avoiding group allreduce of the model; global average every tau | nobody, except at global averages | activation: `<= log2 P` tiny messages; group allreduce of the model in a group of S |
//! | `allreduce-sgd` | allreduce of the gradient, then the local step | everyone | one global allreduce of the gradient |
//! | `local-sgd` (H) | local step; global model average every H steps | everyone, every H steps | one global allreduce every H |
//! | `d-psgd` | local step, average with both ring neighbours (1/3 each) | both neighbours | 2 sends, 2 receives of the model |
//! | `ad-psgd` | local step; active ranks average pairwise with a passive rank's engine | one peer's engine | active: 1 send, 1 receive of the model |
//! | `sgp` (n) | local step, push-sum to n peers of the exponential graph | its n in-peers | n sends, n receives of the model |
//! | `eager-sgd` solo / majority | partial gradient allreduce; late gradients join a later round | nobody / the round's initiator | activation + global allreduce of the gradient |

mod bound;
mod config;
pub mod measure;
pub mod optim;
mod worker;

pub use bound::{bound_wall, ideal_wall};
pub use config::{
    AlgoConfig, Algorithm, CombineRule, EagerMode, LateGradients, Order, Scope, SendOrder,
    WagmaOptions,
};
pub use optim::{Adam, LocalOptimizer, LrSchedule, OptimizerConfig, OptimizerKind, Sgd};
pub use worker::{Resume, StepReport, Worker};
