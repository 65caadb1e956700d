//! Settings of a training run (readable from TOML; the command line overrides them).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use wagma::algo::{AlgoConfig, Algorithm, LrSchedule, OptimizerConfig, SendOrder};
use wagma::imbalance::Imbalance;

use crate::error::TrainError;
use crate::workloads::image::Dataset;

/// Which workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Image classification.
    Image,
    /// English to German translation.
    Translate,
    /// Point-goal navigation with PPO.
    Navigate,
}

impl std::str::FromStr for WorkloadKind {
    type Err = TrainError;
    fn from_str(s: &str) -> Result<Self, TrainError> {
        match s {
            "image" => Ok(WorkloadKind::Image),
            "translate" => Ok(WorkloadKind::Translate),
            "navigate" => Ok(WorkloadKind::Navigate),
            _ => Err(TrainError::Config(format!(
                "unknown workload {s:?} (expected image, translate or navigate)"
            ))),
        }
    }
}

impl WorkloadKind {
    /// The compute profile of the paper's counterpart (what virtual time uses by default).
    pub fn paper_profile(self) -> wagma::imbalance::Profile {
        use wagma::imbalance::Profile;
        match self {
            WorkloadKind::Image => Profile::PaperResnet,
            WorkloadKind::Translate => Profile::Lengths,
            WorkloadKind::Navigate => Profile::HeavyTail,
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WorkloadKind::Image => "image",
            WorkloadKind::Translate => "translate",
            WorkloadKind::Navigate => "navigate",
        })
    }
}

/// How the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Execution {
    /// Threads of this process over the in-process transport.
    Threads,
    /// Real gradients on real data in virtual time: every rank is a task of the deterministic
    /// virtual-time scheduler (bit-reproducible), compute times come from an imbalance profile
    /// at the paper's scale or from a recorded trace, and messages cross the simulator's LogGP
    /// network (what the time reported measures; the real cost of the computation does not
    /// count).
    #[serde(alias = "deterministic")]
    Virtual,
    /// This process is one rank of a TCP job (rendezvous from the environment).
    Tcp,
    /// This process is one rank of an MPI job (`mpirun`, `srun`; needs the `mpi` feature).
    Mpi,
}

impl Execution {
    /// True when each rank is its own process (the job's size is the launcher's).
    pub fn is_multi_process(self) -> bool {
        matches!(self, Execution::Tcp | Execution::Mpi)
    }
}

/// A training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Workload.
    pub workload: WorkloadKind,
    /// Image dataset.
    pub dataset: Dataset,
    /// Directory of gettext catalogs (translation).
    pub catalogs: Option<PathBuf>,
    /// Algorithm and options.
    pub algo: AlgoConfig,
    /// Local optimizer (`None`: the workload's default).
    pub optimizer: Option<OptimizerConfig>,
    /// Ranks (ignored over TCP, where the job decides).
    pub ranks: usize,
    /// Iterations (at most, with a budget).
    pub steps: u64,
    /// Stop once this much training time is spent: at the evaluation after the first one at
    /// which it is (the ranks vote with their clocks at every evaluation and learn the outcome
    /// at the next, so that none waits for another).
    #[serde(default)]
    pub budget: Option<f64>,
    /// Evaluate every this many iterations (and at the end).
    pub eval_every: u64,
    /// Samples (or sentences, or environment episodes) per local step; `None`: the workload's.
    pub batch: Option<usize>,
    /// Image: base width of the CNN (channels of its first stage; `None`: 16).
    #[serde(default)]
    pub width: Option<usize>,
    /// Image: label-skewed shards (each rank sees few classes) instead of uniform ones.
    #[serde(default)]
    pub non_iid: bool,
    /// Seed of data order, initialization and imbalance.
    pub seed: u64,
    /// Injected imbalance (in virtual time: the compute times themselves).
    pub imbalance: Option<Imbalance>,
    /// Virtual time: compute times replayed from a trace written by `--trace-compute`
    /// (simulated rank r replays recorded rank `r mod R`), instead of a profile.
    #[serde(default)]
    pub compute_trace: Option<PathBuf>,
    /// Virtual time: the network (default: the paper's Cray XC50 with Aries, as in
    /// `wagma simulate`).
    #[serde(default)]
    pub network: Option<wagma_sim::LogGp>,
    /// How ranks run.
    pub execution: Execution,
    /// The device the models train on.
    #[serde(default)]
    pub device: crate::device::DeviceChoice,
    /// Output directory.
    pub out: PathBuf,
    /// Checkpoint every this many iterations (rounded up to the algorithm's next clean point).
    pub checkpoint_every: Option<u64>,
    /// Write a timeline per rank (Chrome trace format) to this path with `.rank-N` added.
    #[serde(default)]
    pub trace: Option<PathBuf>,
    /// Record each rank's local compute time per step here (JSON lines: rank, step, seconds),
    /// for `--trace` of `wagma simulate run` and `wagma simulate scaling`.
    #[serde(default)]
    pub trace_compute: Option<PathBuf>,
    /// Resume from this checkpoint (a checkpoint directory or one with a `LATEST` pointer).
    pub resume: Option<PathBuf>,
    /// Elastic continuation: when a rank dies the others go on without it and the run ends
    /// with the survivors' consensus model (rank 0 must survive: it writes the outputs).
    #[serde(default)]
    pub elastic: bool,
    /// This process replaces a rank that an elastic TCP job lost: it asks to rejoin and starts
    /// from the consensus model at the job's next global average (WAGMA-SGD only).
    #[serde(default)]
    pub rejoin: bool,
    /// TCP: run without a secret although the job listens beyond loopback, where anyone who
    /// can reach it could join (otherwise such a job refuses to start).
    #[serde(default)]
    pub allow_empty_secret: bool,
    /// Also evaluate rank 0's replica.
    pub eval_replica: bool,
    /// End-to-end timeout of any collective.
    #[serde(with = "wagma::util::serde_secs")]
    pub timeout: Duration,
    /// Show a progress bar.
    pub progress: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            workload: WorkloadKind::Image,
            dataset: Dataset::Auto,
            catalogs: None,
            algo: AlgoConfig::new(Algorithm::from_name("wagma").unwrap_or(Algorithm::AllreduceSgd)),
            optimizer: None,
            ranks: 8,
            steps: 600,
            budget: None,
            eval_every: 100,
            batch: None,
            width: None,
            non_iid: false,
            seed: 1,
            imbalance: None,
            compute_trace: None,
            network: None,
            execution: Execution::Threads,
            device: crate::device::DeviceChoice::Flex,
            out: PathBuf::from("runs/latest"),
            checkpoint_every: None,
            trace_compute: None,
            trace: None,
            resume: None,
            elastic: false,
            rejoin: false,
            allow_empty_secret: false,
            eval_replica: true,
            timeout: Duration::from_secs(120),
            progress: true,
        }
    }
}

impl TrainConfig {
    /// True when iteration `done` (counted from 1) is evaluated.
    pub fn is_eval_point(&self, done: u64) -> bool {
        done.is_multiple_of(self.eval_every.max(1)) || done == self.steps
    }

    /// True when a restarted process may rejoin this job: an elastic WAGMA-SGD run over TCP,
    /// whose global averages are where the living ranks admit it. Other runs never pay for
    /// the admission vote.
    pub fn admits_rejoins(&self) -> bool {
        self.elastic
            && self.execution == Execution::Tcp
            && matches!(self.algo.algorithm, Algorithm::Wagma(_))
    }

    /// Checks what can be checked before anything runs.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.ranks == 0 {
            return Err(TrainError::Config("ranks must be at least 1".into()));
        }
        if self.steps == 0 {
            return Err(TrainError::Config("steps must be at least 1".into()));
        }
        if self.eval_every == 0 {
            return Err(TrainError::Config("eval-every must be at least 1".into()));
        }
        if self.width == Some(0) {
            return Err(TrainError::Config("width must be at least 1".into()));
        }
        if self.batch == Some(0) {
            return Err(TrainError::Config("batch must be at least 1".into()));
        }
        if self.checkpoint_every == Some(0) {
            return Err(TrainError::Config(
                "checkpoint-every must be at least 1".into(),
            ));
        }
        if self.budget.is_some_and(|b| !(b.is_finite() && b > 0.0)) {
            return Err(TrainError::Config(
                "the time budget must be positive".into(),
            ));
        }
        wagma::util::check_timeout("timeout", self.timeout)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        if !self.execution.is_multi_process() {
            self.algo.validate(self.ranks)?;
        }
        if self.elastic && self.algo.send_order != SendOrder::Together {
            // Its rendezvous makes a two-phase exchange, which elastic continuation cannot
            // finish without a silent neighbour.
            return Err(TrainError::Config(
                "elastic continuation needs d-psgd's sends together, not right-then-left".into(),
            ));
        }
        if self.elastic && matches!(self.algo.algorithm, Algorithm::AdPsgd { gossip: Some(_) }) {
            // An exchange of the gossip loop to a lost peer would stop the loop for good.
            return Err(TrainError::Config(
                "elastic continuation needs the canonical ad-psgd, not its gossip loop".into(),
            ));
        }
        if self.rejoin && (!self.admits_rejoins() || self.resume.is_some()) {
            return Err(TrainError::Config(
                "only an elastic WAGMA-SGD run over the tcp transport that does not resume from \
                 a checkpoint can be rejoined"
                    .into(),
            ));
        }
        if let Some(o) = &self.optimizer {
            o.validate()?;
        }
        if let Some(im) = &self.imbalance {
            im.validate()?;
        }
        if let Some(n) = &self.network {
            n.validate().map_err(TrainError::Config)?;
        }
        Ok(())
    }

    /// The optimizer: the configured one, or the workload's default.
    pub fn optimizer_or_default(&self) -> OptimizerConfig {
        self.optimizer.clone().unwrap_or_else(|| {
            default_optimizer(self.workload, self.steps, self.ranks * self.image_batch())
        })
    }

    /// Samples per local step of the image workload.
    pub fn image_batch(&self) -> usize {
        self.batch.unwrap_or(IMAGE_BATCH)
    }
}

/// Samples per local step of the image workload by default.
pub const IMAGE_BATCH: usize = 32;

/// Global batch (all ranks) at which the image workload's peak learning rate is
/// [`IMAGE_LR`].
pub const IMAGE_REFERENCE_BATCH: usize = 256;

/// Peak learning rate of the image workload at [`IMAGE_REFERENCE_BATCH`].
pub const IMAGE_LR: f32 = 0.05;

/// A workload's default local optimizer: SGD with momentum for the image CNN (the paper's
/// ResNet recipe, with the linear scaling rule of Goyal et al.: the peak rate grows with the
/// global batch, `IMAGE_LR * global_batch / IMAGE_REFERENCE_BATCH`, after a linear warm-up
/// over the first 5% of the steps), Adam with warm-up for the Transformer (as the paper's), and
/// Adam for PPO (as DD-PPO); these two do not scale with the batch. `global_batch` is the
/// samples of one iteration over all ranks.
pub fn default_optimizer(w: WorkloadKind, steps: u64, global_batch: usize) -> OptimizerConfig {
    let warmup = (steps / 20).min(200);
    match w {
        WorkloadKind::Image => OptimizerConfig {
            lr: LrSchedule::Cosine {
                lr: IMAGE_LR * global_batch.max(1) as f32 / IMAGE_REFERENCE_BATCH as f32,
                warmup,
                total: steps,
                min_lr: 0.0,
            },
            momentum: 0.9,
            weight_decay: 5e-4,
            ..OptimizerConfig::default()
        },
        WorkloadKind::Translate => OptimizerConfig {
            lr: LrSchedule::Cosine {
                lr: 1e-3,
                warmup,
                total: steps,
                min_lr: 0.0,
            },
            // Vaswani et al. (and fairseq's Transformer recipe): betas 0.9, 0.98.
            betas: (0.9, 0.98),
            eps: 1e-9,
            ..OptimizerConfig::adam(1e-3)
        },
        WorkloadKind::Navigate => OptimizerConfig {
            lr: LrSchedule::Constant { lr: 1e-3 },
            eps: 1e-5,
            clip_norm: Some(0.5),
            ..OptimizerConfig::adam(1e-3)
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elastic_runs_refuse_what_continuation_cannot_finish() {
        let algo = |send_order| AlgoConfig {
            send_order,
            ..AlgoConfig::new(Algorithm::DPsgd)
        };
        let run = |elastic, send_order| TrainConfig {
            elastic,
            algo: algo(send_order),
            ..TrainConfig::default()
        };
        assert!(run(true, SendOrder::Together).validate().is_ok());
        assert!(run(false, SendOrder::RightThenLeft).validate().is_ok());
        assert!(matches!(
            run(true, SendOrder::RightThenLeft).validate(),
            Err(TrainError::Config(m)) if m.contains("right-then-left")
        ));
        let gossip = TrainConfig {
            elastic: true,
            algo: AlgoConfig::new(Algorithm::AdPsgd { gossip: Some(2) }),
            ..TrainConfig::default()
        };
        assert!(matches!(
            gossip.validate(),
            Err(TrainError::Config(m)) if m.contains("gossip")
        ));
    }

    #[test]
    fn a_network_with_a_negative_latency_is_refused_before_anything_runs() {
        let mut network = wagma_sim::LogGp::aries();
        network.latency_s = -1.0;
        let c = TrainConfig {
            network: Some(network),
            ..TrainConfig::default()
        };
        assert!(matches!(c.validate(), Err(TrainError::Config(m)) if m.contains("latency")));
    }

    #[test]
    fn only_an_elastic_wagma_run_over_tcp_can_be_rejoined() {
        let ok = TrainConfig {
            rejoin: true,
            elastic: true,
            execution: Execution::Tcp,
            ..TrainConfig::default()
        };
        assert!(ok.validate().is_ok());
        for bad in [
            TrainConfig {
                elastic: false,
                ..ok.clone()
            },
            TrainConfig {
                execution: Execution::Threads,
                ..ok.clone()
            },
            TrainConfig {
                algo: AlgoConfig::new(Algorithm::AllreduceSgd),
                ..ok.clone()
            },
            TrainConfig {
                resume: Some(PathBuf::from("runs/old")),
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(TrainError::Config(m)) if m.contains("rejoin")),
                "{bad:?}"
            );
        }
    }
}
