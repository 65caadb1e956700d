//! `wagma train`: flags, a TOML configuration file that flags override, the progress bar and
//! the final table.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args as ClapArgs;
use comfy_table::Table;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use wagma::algo::{
    Algorithm, CombineRule, LateGradients, LrSchedule, OptimizerConfig, OptimizerKind, Order,
    SendOrder, WagmaOptions,
};
use wagma::exec::launch::TransportChoice;
use wagma::imbalance::{Imbalance, Profile};
use wagma::topology::{GroupingKind, PeerOffsets};
use wagma_train::config::default_optimizer;
use wagma_train::nav::NavConfig;
use wagma_train::trainer::{self, EvalRecord, Observer, ProgressLine};
use wagma_train::workloads::image::{self, Dataset, ImageWorkload};
use wagma_train::workloads::navigate::{NavigateWorkload, PpoConfig};
use wagma_train::workloads::translate::TranslateWorkload;
use wagma_train::{Execution, Summary, TrainConfig, WorkloadKind};

/// Options of `wagma train`. Every option can also be set in the `--config` TOML file (same
/// names); the command line wins, also over the file's alternative to an option it sets
/// (`--steps` over the file's `epochs` and the reverse; `--data` and `--dataset` likewise).
#[derive(ClapArgs, Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Args {
    /// TOML file with any of these options.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Workload: image, translate or navigate.
    #[arg(long)]
    pub workload: Option<String>,
    /// Algorithm: wagma, allreduce-sgd, local-sgd, d-psgd, ad-psgd, sgp, eager-sgd-solo,
    /// eager-sgd-majority.
    #[arg(long)]
    pub algo: Option<String>,
    /// Number of ranks (in-process workers or, with --deterministic, simulated ones).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// WAGMA: group size S.
    #[arg(long)]
    pub group_size: Option<usize>,
    /// WAGMA: global synchronization period tau, or "never".
    #[arg(long)]
    pub tau: Option<String>,
    /// WAGMA: combination rule, paper or damped.
    #[arg(long)]
    pub combine: Option<String>,
    /// WAGMA: butterfly, fixed, random or random(SEED).
    #[arg(long)]
    pub groups: Option<String>,
    /// WAGMA: blocking group averaging instead of wait-avoiding (lock-step).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub blocking: Option<bool>,
    /// Step and average order: step-then-average or average-then-step.
    #[arg(long)]
    pub order: Option<String>,
    /// local-sgd: period H.
    #[arg(long)]
    pub period: Option<u64>,
    /// sgp: peers per iteration.
    #[arg(long)]
    pub peers: Option<usize>,
    /// eager-sgd: blocking gradient allreduce every N steps, or "never".
    #[arg(long)]
    pub eager_sync: Option<String>,
    /// sgp: peer offsets, disjoint (default) or sliding (the authors' baseline).
    #[arg(long)]
    pub sgp_offsets: Option<PeerOffsets>,
    /// eager-sgd: a gradient that misses its round is accumulated (default) or dropped (the
    /// authors' code).
    #[arg(long)]
    pub late_gradients: Option<LateGradients>,
    /// ad-psgd: the authors' gossip loop, K pairwise averages per step run by the engine
    /// while the step never waits (absent: one awaited pairwise average per step).
    #[arg(long, value_name = "K")]
    pub ad_psgd_gossip: Option<u32>,
    /// Average BatchNorm statistics with the parameters.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub average_buffers: Option<bool>,
    /// D-PSGD and SGP: exchange the model as this many chained pieces per iteration, as the
    /// authors' baselines do (one per tensor); 1: the whole model at once.
    #[arg(long)]
    pub exchange_pieces: Option<u32>,
    /// d-psgd: send to both ring neighbours together (default) or right-then-left (the
    /// authors' blocking sends).
    #[arg(long)]
    pub send_order: Option<SendOrder>,
    /// Average wagma's optimizer state (momentum, Adam's moments) with the model too.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub average_optimizer_state: Option<bool>,
    /// Seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Iterations (default: 600 for image, 1500 for translate, 3000 for navigate).
    #[arg(long, conflicts_with = "epochs")]
    pub steps: Option<u64>,
    /// Stop once this many seconds of training are spent (at the evaluation after the first at
    /// or past it: the ranks learn it one evaluation later, without waiting for each other).
    #[arg(long)]
    pub budget_seconds: Option<f64>,
    /// Epochs over the training data (image and translate), converted to iterations once the
    /// data is loaded, before the schedule and the evaluation points are set.
    #[arg(long)]
    pub epochs: Option<f64>,
    /// Evaluate every N iterations (default: a sixth of the iterations).
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Samples (sentences; episodes for navigate) per local step.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Image: base width of the CNN (default 16; the cost of a step grows with its square).
    #[arg(long)]
    pub width: Option<usize>,
    /// Image: label-skewed shards (each rank sees few classes; the non-IID ablation).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub non_iid: Option<bool>,
    /// Local optimizer: sgd, adam or adamw (default: the workload's; image uses SGD with
    /// momentum, translate and navigate use Adam).
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Peak learning rate (keeps the workload's schedule shape).
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f32>,
    /// Learning-rate schedule: constant, cosine or step (x0.1 at half and three quarters of
    /// the steps), after the warm-up.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Linear warm-up steps.
    #[arg(long)]
    pub warmup: Option<u64>,
    /// Momentum (sgd).
    #[arg(long, allow_negative_numbers = true)]
    pub momentum: Option<f32>,
    /// Adam's beta1 (0 < b < 1).
    #[arg(long, allow_negative_numbers = true)]
    pub beta1: Option<f32>,
    /// Adam's beta2 (0 < b < 1).
    #[arg(long, allow_negative_numbers = true)]
    pub beta2: Option<f32>,
    /// Adam's epsilon (> 0).
    #[arg(long, allow_negative_numbers = true)]
    pub eps: Option<f32>,
    /// Clip the gradient to this global L2 norm, or "never".
    #[arg(long)]
    pub clip_norm: Option<String>,
    /// Weight decay.
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f32>,
    /// Injected imbalance: none, paper-resnet, lengths, heavy-tail.
    #[arg(long)]
    pub imbalance: Option<String>,
    /// Scale of the injected times (1 = the paper's; at most 10000).
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// mem (threads of this process), tcp (this process is one rank; see `wagma launch`) or
    /// mpi (this process is one rank of an `mpirun`/`srun` job; needs a build with
    /// `--features mpi`).
    #[arg(long)]
    pub transport: Option<String>,
    /// Training device: flex (CPU, default), cuda, cuda:N or wgpu (GPU backends need a build
    /// with `--features cuda` or `--features wgpu`).
    #[arg(long)]
    pub device: Option<String>,
    /// Real gradients in virtual time: every rank is a task of the deterministic
    /// virtual-time scheduler (bit-reproducible); compute times come from the imbalance profile
    /// at the paper's scale (default: the workload's: paper-resnet, lengths, heavy-tail) or
    /// from --compute-trace, messages cross a LogGP network (--network; default: the paper's
    /// Cray XC50 with Aries). The real cost of the computation does not count.
    #[arg(long, alias = "deterministic", num_args = 0..=1, default_missing_value = "true")]
    #[serde(alias = "deterministic")]
    pub virtual_time: Option<bool>,
    /// Virtual time: replay the compute times of a trace written by --trace-compute.
    #[arg(long)]
    pub compute_trace: Option<PathBuf>,
    /// Virtual time: network parameters from `wagma simulate calibrate` (default: Aries).
    #[arg(long)]
    pub network: Option<PathBuf>,
    /// Virtual time: LogGP latency L in seconds (overrides --network).
    #[arg(long)]
    pub latency: Option<f64>,
    /// Virtual time: LogGP bandwidth in bytes per second (overrides --network).
    #[arg(long)]
    pub bandwidth: Option<f64>,
    /// Image data: a directory of MNIST-format IDX files.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Image data: auto (Fashion-MNIST if installed, else built-in) or builtin.
    #[arg(long)]
    pub dataset: Option<String>,
    /// Translation data: directory of gettext catalogs (default: German ones).
    #[arg(long)]
    pub catalogs: Option<PathBuf>,
    /// Output directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Checkpoint every N iterations (at the algorithm's next clean point).
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Write a timeline per rank (Chrome trace JSON, for Perfetto): FILE gets `.rank-N`.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Record each rank's local compute time per step in this file (for `--trace` of `wagma
    /// simulate run` and `wagma simulate scaling`).
    #[arg(long)]
    pub trace_compute: Option<PathBuf>,
    /// Elastic continuation: when a rank dies, the others go on without it (rank 0 must
    /// survive; it writes the outputs).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub elastic: Option<bool>,
    /// TCP: run without a secret although the job listens beyond loopback, where anyone who
    /// can reach it could join (also `WAGMA_ALLOW_EMPTY_SECRET=1`). Without it such a job
    /// refuses to start.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub allow_empty_secret: Option<bool>,
    /// Start this process in place of a rank that an elastic TCP job has lost (same rank,
    /// world size, rendezvous and arguments): it rejoins at the job's next global average,
    /// starting from the consensus model. WAGMA-SGD only; rank 0 cannot rejoin.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub rejoin: Option<bool>,
    /// Resume from a checkpoint (directory, or output directory of an earlier run).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// End-to-end timeout of any collective, seconds (at most 1e9).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// No progress bar.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub quiet: Option<bool>,
}

/// Options that exclude each other. The file and the command line may each set one of a pair:
/// the command line's then replaces the file's (clap only sees the command line).
const ALTERNATIVES: [(&str, &str); 2] = [("steps", "epochs"), ("data", "dataset")];

impl Args {
    /// Flags over the file's values.
    fn merged(self) -> anyhow::Result<Args> {
        let Some(path) = &self.config else {
            return Ok(self);
        };
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let file: Args =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let mut merged = serde_json::to_value(file)?;
        if let (Some(m), serde_json::Value::Object(flags)) =
            (merged.as_object_mut(), serde_json::to_value(&self)?)
        {
            let given = |k: &str| flags.get(k).is_some_and(|v| !v.is_null());
            for (x, y) in ALTERNATIVES {
                if given(x) {
                    m.remove(y);
                }
                if given(y) {
                    m.remove(x);
                }
            }
            for (k, v) in flags {
                if !v.is_null() {
                    m.insert(k, v);
                }
            }
        }
        let mut out: Args = serde_json::from_value(merged)?;
        out.config = self.config;
        Ok(out)
    }
}

/// `None` for "never", else the number `s` names.
pub(crate) fn never_or<T: std::str::FromStr>(s: &str, what: &str) -> anyhow::Result<Option<T>> {
    if s == "never" {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|_| anyhow::anyhow!("invalid {what}: {s:?} (a number or \"never\")"))
}

/// How the ranks run. Started by a launcher (`wagma launch`, mpirun, srun, torchrun) without
/// `--transport`, this process joins the launcher's job (rather than starting a job of its own
/// in every process).
fn execution(a: &Args) -> anyhow::Result<Execution> {
    let launcher = wagma::transport::discover::discover_env()?;
    let deterministic = a.virtual_time.unwrap_or(false);
    Ok(match (a.transport.as_deref(), deterministic, &launcher) {
        (None, false, Some(_)) => match TransportChoice::from_lookup(&|k| std::env::var(k).ok())? {
            TransportChoice::Mpi => Execution::Mpi,
            _ => Execution::Tcp,
        },
        (None | Some("mem"), _, Some(d)) => bail!(
            "started by a launcher ({} says rank {} of {}), but {} runs every rank in this \
             process: every process would train a job of its own. Use --transport tcp or mpi \
             to join the launcher's job, or start wagma train without a launcher",
            d.source,
            d.rank,
            d.world,
            if deterministic {
                "--virtual-time"
            } else {
                "--transport mem"
            }
        ),
        (None | Some("mem"), false, None) => Execution::Threads,
        (None | Some("mem"), true, None) => Execution::Virtual,
        (Some("tcp"), false, _) => Execution::Tcp,
        (Some("mpi"), false, _) => Execution::Mpi,
        (Some(t @ ("tcp" | "mpi")), true, _) => {
            bail!("--virtual-time runs in one process; it cannot use --transport {t}")
        }
        (Some(t), _, _) => bail!("invalid transport {t:?} (mem, tcp or mpi)"),
    })
}

/// The local optimizer: the workload's default, with the flags over it.
fn optimizer(
    a: &Args,
    w: WorkloadKind,
    steps: u64,
    global_batch: usize,
) -> anyhow::Result<OptimizerConfig> {
    let mut opt = default_optimizer(w, steps, global_batch);
    if let Some(k) = &a.optimizer {
        let kind: OptimizerKind = k.parse()?;
        if kind != opt.kind {
            // Another rule: its customary peak rate, the workload's schedule shape.
            let (lr, momentum) = match kind {
                OptimizerKind::Sgd => (0.05, 0.9),
                OptimizerKind::Adam | OptimizerKind::AdamW => (1e-3, 0.0),
            };
            set_peak(&mut opt.lr, lr);
            opt = OptimizerConfig {
                kind,
                momentum,
                nesterov: false,
                ..opt
            };
        }
    }
    if let Some(lr) = a.lr {
        set_peak(&mut opt.lr, lr);
    }
    let peak = peak(&opt.lr);
    let warmup = a.warmup.unwrap_or(warmup_of(&opt.lr));
    let step = |milestones: Vec<u64>, gamma: f32| LrSchedule::WarmupStep {
        lr: peak,
        warmup,
        milestones,
        gamma,
    };
    match a.schedule.as_deref() {
        None if a.warmup.is_none() => {}
        None => match &mut opt.lr {
            LrSchedule::Constant { .. } => opt.lr = step(vec![], 1.0),
            LrSchedule::WarmupStep { warmup: w, .. } | LrSchedule::Cosine { warmup: w, .. } => {
                *w = warmup
            }
        },
        Some("constant") => opt.lr = constant_after_warmup(peak, warmup),
        Some("cosine") => {
            opt.lr = LrSchedule::Cosine {
                lr: peak,
                warmup,
                total: steps,
                min_lr: 0.0,
            }
        }
        Some("step") => opt.lr = step(vec![steps / 2, steps * 3 / 4], 0.1),
        Some(x) => bail!("invalid schedule {x:?} (constant, cosine or step)"),
    }
    if let Some(m) = a.momentum {
        opt.momentum = m;
        if m == 0.0 {
            opt.nesterov = false;
        }
    }
    if let Some(w) = a.weight_decay {
        opt.weight_decay = w;
    }
    if let Some(b) = a.beta1 {
        opt.betas.0 = b;
    }
    if let Some(b) = a.beta2 {
        opt.betas.1 = b;
    }
    if let Some(e) = a.eps {
        opt.eps = e;
    }
    if let Some(c) = &a.clip_norm {
        opt.clip_norm = never_or(c, "clip-norm")?;
    }
    opt.validate()?;
    Ok(opt)
}

fn set_peak(s: &mut LrSchedule, lr: f32) {
    match s {
        LrSchedule::Constant { lr: x }
        | LrSchedule::WarmupStep { lr: x, .. }
        | LrSchedule::Cosine { lr: x, .. } => *x = lr,
    }
}

fn peak(s: &LrSchedule) -> f32 {
    match s {
        LrSchedule::Constant { lr }
        | LrSchedule::WarmupStep { lr, .. }
        | LrSchedule::Cosine { lr, .. } => *lr,
    }
}

fn warmup_of(s: &LrSchedule) -> u64 {
    match s {
        LrSchedule::Constant { .. } => 0,
        LrSchedule::WarmupStep { warmup, .. } | LrSchedule::Cosine { warmup, .. } => *warmup,
    }
}

/// A linear warm-up to `peak` over `warmup` steps, then `peak` for good.
fn constant_after_warmup(peak: f32, warmup: u64) -> LrSchedule {
    if warmup == 0 {
        LrSchedule::Constant { lr: peak }
    } else {
        LrSchedule::WarmupStep {
            lr: peak,
            warmup,
            milestones: vec![],
            gamma: 1.0,
        }
    }
}

/// `s` without its decay: its warm-up, then its peak rate for good. For a run whose length is
/// unknown (a time budget), which a decay towards a fixed end would stop early or never reach.
pub(crate) fn without_end(s: &LrSchedule) -> LrSchedule {
    constant_after_warmup(peak(s), warmup_of(s))
}

fn algorithm(a: &Args) -> anyhow::Result<Algorithm> {
    let mut alg = Algorithm::from_name(a.algo.as_deref().unwrap_or("wagma"))?;
    match &mut alg {
        Algorithm::Wagma(o) => {
            let tau = match &a.tau {
                Some(t) => never_or(t, "tau")?,
                None => WagmaOptions::default().tau,
            };
            *o = WagmaOptions {
                group_size: a.group_size,
                tau,
                combine: match a.combine.as_deref() {
                    None | Some("paper") => CombineRule::Paper,
                    Some("damped") => CombineRule::Damped,
                    Some(x) => bail!("invalid combine rule {x:?} (paper or damped)"),
                },
                groups: match a.groups.as_deref() {
                    None => GroupingKind::Butterfly,
                    Some(g) => g.parse()?,
                },
                wait_avoiding: !a.blocking.unwrap_or(false),
            };
        }
        Algorithm::LocalSgd { period } => *period = a.period.unwrap_or(1),
        Algorithm::Sgp { peers, .. } => *peers = a.peers.unwrap_or(1),
        Algorithm::EagerSgd { sync_period, .. } => {
            if let Some(s) = &a.eager_sync {
                *sync_period = never_or(s, "eager-sync")?;
            }
        }
        _ => {}
    }
    alg.set_variants(
        a.sgp_offsets.unwrap_or_default(),
        a.late_gradients.unwrap_or_default(),
        a.ad_psgd_gossip,
    );
    Ok(alg)
}

/// An option that one algorithm reads and the others ignore.
struct AlgorithmOption {
    flag: &'static str,
    /// Set to something else than its default.
    given: bool,
    /// The algorithm that reads it, by name and by kind.
    of: &'static str,
    reads: fn(&Algorithm) -> bool,
}

/// The options of one algorithm, as `a` sets them.
fn algorithm_options(a: &Args) -> [AlgorithmOption; 11] {
    let non_default = |x: Option<&str>, default: &str| x.is_some_and(|v| v != default);
    let option = |flag, given, of, reads| AlgorithmOption {
        flag,
        given,
        of,
        reads,
    };
    let wagma: fn(&Algorithm) -> bool = |x| matches!(x, Algorithm::Wagma(_));
    let sgp: fn(&Algorithm) -> bool = |x| matches!(x, Algorithm::Sgp { .. });
    let eager: fn(&Algorithm) -> bool = |x| matches!(x, Algorithm::EagerSgd { .. });
    [
        option("--tau", a.tau.is_some(), "wagma", wagma),
        option("--group-size", a.group_size.is_some(), "wagma", wagma),
        option(
            "--combine",
            non_default(a.combine.as_deref(), "paper"),
            "wagma",
            wagma,
        ),
        option(
            "--groups",
            non_default(a.groups.as_deref(), "butterfly"),
            "wagma",
            wagma,
        ),
        option("--blocking", a.blocking == Some(true), "wagma", wagma),
        option(
            "--period",
            a.period.is_some_and(|h| h != 1),
            "local-sgd",
            |x| matches!(x, Algorithm::LocalSgd { .. }),
        ),
        option("--peers", a.peers.is_some_and(|n| n != 1), "sgp", sgp),
        option(
            "--sgp-offsets",
            a.sgp_offsets.is_some_and(|o| o != PeerOffsets::default()),
            "sgp",
            sgp,
        ),
        option("--eager-sync", a.eager_sync.is_some(), "eager-sgd", eager),
        option(
            "--late-gradients",
            a.late_gradients
                .is_some_and(|l| l != LateGradients::default()),
            "eager-sgd",
            eager,
        ),
        option(
            "--ad-psgd-gossip",
            a.ad_psgd_gossip.is_some(),
            "ad-psgd",
            |x| matches!(x, Algorithm::AdPsgd { .. }),
        ),
    ]
}

/// Options of another algorithm than the merged configuration's (a run would ignore them: local
/// SGD given `--tau 5` would average every step): refused when the command line sets them,
/// reported when only the configuration file does (a file shared by runs of several
/// algorithms may hold them all).
fn check_algorithm_options(cli: &Args, merged: &Args) -> anyhow::Result<()> {
    let alg = Algorithm::from_name(merged.algo.as_deref().unwrap_or("wagma"))?;
    let on_command_line = algorithm_options(cli);
    for (o, cli) in algorithm_options(merged).iter().zip(&on_command_line) {
        if !o.given || (o.reads)(&alg) {
            continue;
        }
        let (flag, of) = (o.flag, o.of);
        if cli.given {
            bail!(
                "{flag} applies to {of}, not to {} (remove it, or choose {of} with --algo)",
                alg.label()
            );
        }
        eprintln!(
            "warning: the configuration file's {} applies to {of}, not to {}; ignored",
            flag.trim_start_matches('-'),
            alg.label()
        );
    }
    Ok(())
}

/// Builds the run's configuration (everything but the workload's data).
fn config(a: &Args) -> anyhow::Result<TrainConfig> {
    let mut c = TrainConfig::default();
    if let Some(w) = &a.workload {
        c.workload = w.parse()?;
    }
    c.algo.algorithm = algorithm(a)?;
    if let Some(o) = &a.order {
        c.algo.order = match o.as_str() {
            "step-then-average" => Order::StepThenAverage,
            "average-then-step" => Order::AverageThenStep,
            _ => bail!("invalid order {o:?} (step-then-average or average-then-step)"),
        };
    }
    if let Some(b) = a.average_buffers {
        c.algo.scope.average_buffers = b;
    }
    if let Some(n) = a.exchange_pieces {
        c.algo.exchange_pieces = n;
    }
    if let Some(o) = a.send_order {
        c.algo.send_order = o;
    }
    if let Some(b) = a.average_optimizer_state {
        c.algo.scope.average_optimizer_state = b;
    }
    c.seed = a.seed.unwrap_or(c.seed);
    c.algo.seed = c.seed;
    c.ranks = a.ranks.unwrap_or(c.ranks);
    c.budget = a.budget_seconds;
    c.batch = a.batch;
    c.width = a.width;
    c.non_iid = a.non_iid.unwrap_or(false);
    if c.non_iid && c.workload != WorkloadKind::Image {
        bail!("--non-iid applies to the image workload");
    }
    c.execution = execution(a)?;
    let virtual_time = c.execution == Execution::Virtual;
    if let Some(p) = &a.imbalance {
        let profile: Profile = p.parse()?;
        // In virtual time the profile is the compute time itself ("none": 450 ms each).
        if profile != Profile::None || virtual_time {
            c.imbalance = Some(Imbalance {
                profile,
                time_scale: a
                    .time_scale
                    .unwrap_or(if virtual_time { 1.0 } else { 0.02 }),
                seed: c.seed,
            });
        }
    } else if virtual_time && a.compute_trace.is_none() {
        c.imbalance = Some(Imbalance {
            profile: c.workload.paper_profile(),
            time_scale: a.time_scale.unwrap_or(1.0),
            seed: c.seed,
        });
    } else if a.time_scale.is_some() {
        bail!("--time-scale needs --imbalance");
    }
    if a.compute_trace.is_some() && !virtual_time {
        bail!("--compute-trace replays compute times in virtual time: add --virtual-time");
    }
    c.compute_trace = a.compute_trace.clone();
    if a.network.is_some() || a.latency.is_some() || a.bandwidth.is_some() {
        if !virtual_time {
            bail!(
                "--network, --latency and --bandwidth model the network in virtual time: add --virtual-time"
            );
        }
        c.network = Some(crate::simulate::network_model(
            a.network.as_deref(),
            a.latency,
            a.bandwidth,
        )?);
    }
    if c.execution.is_multi_process() {
        // One process per rank: the launcher says how many (what `--epochs` divides by).
        if let Some(d) = wagma::transport::discover::discover_env()? {
            if a.ranks.is_some_and(|r| r != d.world) {
                bail!(
                    "--ranks {} contradicts the launcher ({} says {} ranks)",
                    c.ranks,
                    d.source,
                    d.world
                );
            }
            c.ranks = d.world;
        }
    }
    c.dataset = match (&a.data, a.dataset.as_deref()) {
        (Some(d), None) => Dataset::Idx(d.clone()),
        (Some(_), Some(_)) => bail!("--data and --dataset exclude each other"),
        (None, None | Some("auto")) => Dataset::Auto,
        (None, Some("builtin")) => Dataset::Builtin,
        (None, Some(x)) => {
            bail!("invalid dataset {x:?} (auto or builtin; --data DIR for IDX files)")
        }
    };
    c.catalogs = a.catalogs.clone();
    c.checkpoint_every = a.checkpoint_every;
    c.trace_compute = a.trace_compute.clone();
    c.trace = a.trace.clone();
    c.resume = a.resume.clone();
    if let Some(e) = a.elastic {
        c.elastic = e;
    }
    c.allow_empty_secret = a.allow_empty_secret.unwrap_or(false);
    if let Some(r) = a.rejoin {
        c.rejoin = r;
    }
    if let Some(t) = a.timeout {
        c.timeout = wagma::util::timeout_from_secs(t).ok_or_else(|| {
            anyhow::anyhow!(
                "invalid timeout {t} (a positive number of seconds up to {})",
                wagma::util::MAX_TIMEOUT.as_secs()
            )
        })?;
    }
    c.progress = !a.quiet.unwrap_or(false);
    // The data is not loaded yet: with --epochs this checks the options on a stand-in number
    // of steps, and `run` sets the real one before training.
    set_steps(a, &mut c, None)?;
    if let Some(d) = &a.device {
        c.device = d.parse()?;
    }
    c.out = a.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let label = c.algo.label().replace([' ', '='], "-");
        PathBuf::from(format!("runs/{}-{label}-{secs}", c.workload))
    });
    c.validate()?;
    Ok(c)
}

struct Bar {
    bar: ProgressBar,
    primary: &'static str,
}

impl Observer for Bar {
    fn step(&self, iteration: u64, samples: u64, train_s: f64) {
        self.bar.set_position(iteration);
        if train_s > 0.0 {
            self.bar
                .set_prefix(format!("{:.0} samples/s", samples as f64 / train_s));
        }
    }

    fn progress(&self, p: &ProgressLine) {
        if let Some(l) = p.train_loss {
            self.bar
                .set_message(format!("training loss {l:.4} at {}", p.iteration));
        }
    }

    fn eval(&self, r: &EvalRecord) {
        if let Some(v) = r.consensus.get(self.primary) {
            let loss = r
                .train_loss
                .map(|l| format!("  loss {l:.4}"))
                .unwrap_or_default();
            self.bar.set_message(format!(
                "{} {:.4} at {}{loss}",
                self.primary, v, r.iteration
            ));
        }
    }
}

fn observer(c: &TrainConfig, primary: &'static str) -> Bar {
    let bar = if c.progress {
        ProgressBar::new(c.steps)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} it  {prefix}  {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    Bar { bar, primary }
}

/// The workload's iterations when neither `--steps` nor `--epochs` says.
fn default_steps(w: WorkloadKind) -> u64 {
    match w {
        WorkloadKind::Image => 600,
        WorkloadKind::Translate => 1500,
        WorkloadKind::Navigate => 3000,
    }
}

/// Samples per local step of the translation workload by default (sentences).
const TRANSLATE_BATCH: usize = 32;

/// Samples per local step (sentences for translate, episodes for navigate).
fn local_batch(c: &TrainConfig) -> usize {
    match c.workload {
        WorkloadKind::Image => c.image_batch(),
        WorkloadKind::Translate => c.batch.unwrap_or(TRANSLATE_BATCH),
        WorkloadKind::Navigate => c.batch.unwrap_or(PpoConfig::default().episodes),
    }
}

/// Sets the iterations and what is derived from them: the default evaluation period and the
/// learning-rate schedule (whose warm-up, decay and end are fractions of the run). The only
/// place that does, so that they always agree. `train_len` is the number of training samples,
/// which `--epochs` needs; until the data is loaded (`None`) the workload's default stands in.
fn set_steps(a: &Args, c: &mut TrainConfig, train_len: Option<usize>) -> anyhow::Result<()> {
    c.steps = match (a.steps, a.epochs) {
        (Some(_), Some(_)) => bail!(
            "steps and epochs exclude each other (a --steps or --epochs on the command line \
             replaces the config file's)"
        ),
        (Some(s), None) => s,
        (None, Some(_)) if c.workload == WorkloadKind::Navigate => {
            bail!("--epochs does not apply to navigate (use --steps)")
        }
        (None, Some(e)) if !(e.is_finite() && e > 0.0) => bail!("invalid --epochs {e}"),
        (None, Some(e)) => match train_len {
            Some(n) => epochs_to_steps(e, n, local_batch(c), c.ranks),
            None => default_steps(c.workload),
        },
        (None, None) => default_steps(c.workload),
    };
    c.eval_every = a.eval_every.unwrap_or((c.steps / 6).max(1));
    c.optimizer = Some(optimizer(
        a,
        c.workload,
        c.steps,
        c.ranks * c.image_batch(),
    )?);
    Ok(())
}

/// Runs `wagma train`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let a = args.clone().merged()?;
    check_algorithm_options(&args, &a)?;
    let mut c = config(&a)?;
    // Only epochs depend on the data's size; the trainer validates what results.
    let summary = execute_with(&mut c, |c, train_len| match a.epochs {
        Some(_) => set_steps(&a, c, Some(train_len)),
        None => Ok(()),
    })?;
    print_summary(&summary, &c);
    Ok(())
}

/// Loads the workload's data and trains as `c` says.
pub fn execute(c: &mut TrainConfig) -> anyhow::Result<Summary> {
    execute_with(c, |_, _| Ok(()))
}

/// Loads the workload's data and trains as `c` says, once `sized` has seen the number of
/// training samples (image and translate: what an epoch is) and adjusted `c` to it.
fn execute_with(
    c: &mut TrainConfig,
    sized: impl FnOnce(&mut TrainConfig, usize) -> anyhow::Result<()>,
) -> anyhow::Result<Summary> {
    Ok(match c.workload {
        WorkloadKind::Image => {
            let (train, test, name) = image::load(&c.dataset, c.seed)?;
            sized(c, train.len())?;
            let batch = local_batch(c);
            let held_out = test.len();
            let w = ImageWorkload::new(train, test, batch, c.width.unwrap_or(16))
                .with_label_skew(c.non_iid);
            let data = format!(
                "{name}: {} training samples, {held_out} held out",
                w.train_len()
            );
            go(&w, c, data)?
        }
        WorkloadKind::Translate => {
            let w =
                TranslateWorkload::from_catalogs(c.catalogs.as_deref(), local_batch(c), c.seed)?;
            sized(c, w.train_len())?;
            let data = w.describe();
            go(&w, c, data)?
        }
        WorkloadKind::Navigate => {
            let ppo = PpoConfig {
                episodes: local_batch(c),
                ..PpoConfig::default()
            };
            let w = NavigateWorkload::new(NavConfig::default(), ppo, 64);
            let data = w.describe();
            go(&w, c, data)?
        }
    })
}

/// The metric that decides "better" for a workload.
pub fn primary_metric(w: WorkloadKind) -> &'static str {
    match w {
        WorkloadKind::Image => "accuracy",
        WorkloadKind::Translate => "bleu",
        WorkloadKind::Navigate => "spl",
    }
}

/// Iterations of `e` epochs over `n` samples, `batch` per rank and step (at least one).
fn epochs_to_steps(e: f64, n: usize, batch: usize, ranks: usize) -> u64 {
    ((e * n as f64) / (batch * ranks) as f64).ceil().max(1.0) as u64
}

fn go<W: wagma_train::workloads::Workload>(
    w: &W,
    c: &TrainConfig,
    data: String,
) -> anyhow::Result<Summary> {
    let obs = observer(c, primary_metric(c.workload));
    if c.progress {
        eprintln!(
            "training {} with {} on {} ranks ({data}); outputs in {}",
            c.workload,
            c.algo.label(),
            c.ranks,
            c.out.display()
        );
    }
    let r = trainer::run(w, c, data, &obs);
    obs.bar.finish_and_clear();
    Ok(r?)
}

fn print_summary(s: &Summary, c: &TrainConfig) {
    let mut t = Table::new();
    t.set_header(vec!["", ""]);
    t.add_row(vec![
        "workload".to_string(),
        format!("{} ({})", s.workload, s.data),
    ]);
    t.add_row(vec![
        "algorithm".to_string(),
        if s.ranks_alive < s.ranks {
            format!(
                "{} on {} ranks ({} lost; elastic continuation)",
                s.label,
                s.ranks,
                s.ranks - s.ranks_alive
            )
        } else {
            format!("{} on {} ranks", s.label, s.ranks)
        },
    ]);
    t.add_row(vec!["iterations".to_string(), s.steps.to_string()]);
    t.add_row(vec![
        "training time".to_string(),
        format!("{:.1} s", s.wall_s),
    ]);
    t.add_row(vec![
        "throughput".to_string(),
        format!("{:.1} samples/s", s.samples_per_s),
    ]);
    t.add_row(vec![
        "waiting".to_string(),
        format!("{:.1}%", 100.0 * s.wait_fraction),
    ]);
    if s.staleness.total() > 0 {
        t.add_row(vec![
            "staleness".to_string(),
            format!("{} (mean {:.2})", s.staleness, s.staleness.mean()),
        ]);
    }
    for (k, v) in &s.final_metrics {
        t.add_row(vec![format!("final {k}"), format!("{v:.4}")]);
    }
    println!("{t}");
    println!("metrics: {}", c.out.join("metrics.jsonl").display());
    println!("summary: {}", c.out.join("summary.json").display());
    if let Some(ck) = &s.checkpoint {
        println!("last checkpoint: {}", ck.display());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// `flags` merged over a config file holding `file`.
    fn merged(file: &str, flags: Args) -> Args {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "wagma-train-merge-{}-{}.toml",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, file).unwrap();
        let out = Args {
            config: Some(path.clone()),
            ..flags
        }
        .merged();
        let _ = std::fs::remove_file(&path);
        out.unwrap()
    }

    /// The schedule's warm-up and end, of a cosine schedule.
    fn cosine(c: &TrainConfig) -> (u64, u64) {
        match c.optimizer.as_ref().map(|o| &o.lr) {
            Some(LrSchedule::Cosine { warmup, total, .. }) => (*warmup, *total),
            other => panic!("not a cosine schedule: {other:?}"),
        }
    }

    #[test]
    fn epochs_set_the_schedule_and_the_evaluations_of_the_run() {
        let a = Args {
            epochs: Some(5.0),
            ..Args::default()
        };
        let mut c = TrainConfig::default();
        // Until the data is loaded, the default stands in.
        set_steps(&a, &mut c, None).unwrap();
        assert_eq!(c.steps, 600);
        // 5 epochs of 60,000 samples at 8 ranks x 32: 1,171.9 iterations, rounded up.
        set_steps(&a, &mut c, Some(60_000)).unwrap();
        assert_eq!(c.steps, 1172);
        assert_eq!(cosine(&c), (c.steps / 20, c.steps));
        assert_eq!(c.eval_every, c.steps / 6);
        let lr = &c.optimizer.as_ref().unwrap().lr;
        assert!(lr.at(c.steps / 2) > 0.0, "the second half learns");
        // An explicit evaluation period stays; a step schedule's milestones follow the steps.
        let a = Args {
            epochs: Some(5.0),
            eval_every: Some(7),
            schedule: Some("step".into()),
            ..Args::default()
        };
        set_steps(&a, &mut c, Some(60_000)).unwrap();
        assert_eq!(c.eval_every, 7);
        assert!(matches!(
            &c.optimizer.as_ref().unwrap().lr,
            LrSchedule::WarmupStep { milestones, .. } if milestones[..] == [586, 879]
        ));
        // Translate counts epochs in sentences of its own default batch.
        let mut t = TrainConfig {
            workload: WorkloadKind::Translate,
            ranks: 2,
            ..TrainConfig::default()
        };
        set_steps(&Args::default(), &mut t, Some(1000)).unwrap();
        assert_eq!(t.steps, 1500);
        set_steps(&a, &mut t, Some(1000)).unwrap();
        assert_eq!(t.steps, 79);
    }

    #[test]
    fn epochs_are_refused_where_they_mean_nothing() {
        let mut c = TrainConfig {
            workload: WorkloadKind::Navigate,
            ..TrainConfig::default()
        };
        let epochs = |e| Args {
            epochs: Some(e),
            ..Args::default()
        };
        let err = set_steps(&epochs(1.0), &mut c, None).unwrap_err();
        assert!(err.to_string().contains("navigate"), "{err}");
        let mut c = TrainConfig::default();
        for e in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(set_steps(&epochs(e), &mut c, None).is_err(), "{e}");
        }
    }

    #[test]
    fn an_option_of_another_algorithm_is_refused_on_the_command_line() {
        let with = |algo: &str, f: fn(&mut Args)| {
            let mut a = Args {
                algo: Some(algo.into()),
                ..Args::default()
            };
            f(&mut a);
            check_algorithm_options(&a, &a)
        };
        let err = with("local-sgd", |a| a.tau = Some("5".into())).unwrap_err();
        assert!(err.to_string().contains("--tau applies to wagma"), "{err}");
        assert!(with("wagma", |a| a.period = Some(4)).is_err());
        assert!(with("d-psgd", |a| a.peers = Some(2)).is_err());
        assert!(with("sgp", |a| a.eager_sync = Some("5".into())).is_err());
        // Each algorithm's own options are taken, and another's at its default value.
        assert!(with("wagma", |a| a.tau = Some("5".into())).is_ok());
        assert!(with("local-sgd", |a| a.period = Some(4)).is_ok());
        assert!(with("sgp", |a| a.peers = Some(2)).is_ok());
        assert!(with("eager-sgd-solo", |a| a.eager_sync = Some("5".into())).is_ok());
        assert!(with("sgp", |a| a.blocking = Some(false)).is_ok());
        // Only in the configuration file: reported, not refused.
        let file = Args {
            algo: Some("local-sgd".into()),
            tau: Some("10".into()),
            ..Args::default()
        };
        assert!(check_algorithm_options(&Args::default(), &file).is_ok());
    }

    #[test]
    fn the_command_line_wins_over_the_files_alternative() {
        let steps = |s| Args {
            steps: Some(s),
            ..Args::default()
        };
        let epochs = |e| Args {
            epochs: Some(e),
            ..Args::default()
        };
        let a = merged("epochs = 5.0\n", steps(100));
        assert_eq!((a.steps, a.epochs), (Some(100), None));
        let a = merged("steps = 100\n", epochs(2.0));
        assert_eq!((a.steps, a.epochs), (None, Some(2.0)));
        let a = merged("steps = 100\nepochs = 2.0\n", steps(10));
        assert_eq!((a.steps, a.epochs), (Some(10), None));
        // A flag that is no alternative leaves the file's choice alone.
        let a = merged(
            "epochs = 5.0\n",
            Args {
                seed: Some(3),
                ..Args::default()
            },
        );
        assert_eq!((a.steps, a.epochs, a.seed), (None, Some(5.0), Some(3)));
        let a = merged(
            "dataset = \"builtin\"\n",
            Args {
                data: Some("/data/fashion".into()),
                ..Args::default()
            },
        );
        assert_eq!(a.dataset, None);
        // Both in the file: refused, before any data is loaded.
        let a = merged("steps = 100\nepochs = 2.0\n", Args::default());
        let err = set_steps(&a, &mut TrainConfig::default(), None).unwrap_err();
        assert!(err.to_string().contains("exclude each other"), "{err}");
    }
}
