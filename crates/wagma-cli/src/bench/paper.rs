//! `wagma bench paper`: the paper's comparison at small scale. Every algorithm trains the same
//! workload (same data, seed, initial model and imbalance draws); for each we record the metric
//! over wall time and over samples, the time to reach a target (given, or 98% of what
//! allreduce-SGD finally reaches), throughput, waiting and staleness; optionally the paper's
//! ablations of WAGMA. Outputs: `results.json`, `results.csv`, plots (PNG and SVG) and
//! `report.md`, all produced by this command.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args as ClapArgs;
use serde::{Deserialize, Serialize};
use wagma::algo::{AlgoConfig, Algorithm, OptimizerConfig, WagmaOptions};
use wagma::imbalance::{Imbalance, Profile};
use wagma::topology::{GroupingKind, default_group_size};
use wagma_train::config::default_optimizer;
use wagma_train::trainer::EvalRecord;
use wagma_train::workloads::image::Dataset;
use wagma_train::{Execution, Summary, TrainConfig, WorkloadKind};

use crate::plot::{self, Series};
use crate::train::{execute, primary_metric, without_end};

/// Options of `wagma bench paper`.
#[derive(ClapArgs, Debug, Clone, Serialize, Deserialize)]
pub struct Args {
    /// Workload: image, translate or navigate.
    #[arg(long, default_value = "image")]
    pub workload: String,
    /// Ranks.
    #[arg(long, default_value_t = 8)]
    pub ranks: usize,
    /// Compute profile (virtual time: the compute times; threads: injected delays). Default
    /// in virtual time: paper-resnet, lengths, heavy-tail for image, translate, navigate;
    /// with threads: paper-resnet for image, none for the others (their imbalance is natural).
    #[arg(long)]
    pub imbalance: Option<Profile>,
    /// Scale of the profile's times (1 = the paper's; default 1 in virtual time, 0.05 with
    /// threads).
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// virtual (real gradients in virtual time over the simulator's network, reproducible) or
    /// threads (in-process workers in real time, with the profile's delays as sleeps).
    #[arg(long, default_value = "virtual")]
    pub execution: String,
    /// Iterations per algorithm.
    #[arg(long, conflicts_with = "budget_seconds")]
    pub steps: Option<u64>,
    /// Training seconds per algorithm instead of a number of iterations. The length of a run is
    /// then unknown, so the learning rate does not decay: after the warm-up of the workload's
    /// default run (600 iterations for image, 900 for translate, 2000 for navigate) it stays at
    /// its peak. A run stops at the evaluation after the first one at or past the budget (the
    /// ranks learn it one evaluation later, without waiting for each other), and evaluations
    /// come every default run / --eval-points iterations.
    #[arg(long)]
    pub budget_seconds: Option<f64>,
    /// Evaluations per run (with --budget-seconds: per default run, which sets the evaluation
    /// period).
    #[arg(long, default_value_t = 10)]
    pub eval_points: u64,
    /// Target metric (default: 98% of allreduce-sgd's final value).
    #[arg(long)]
    pub target: Option<f64>,
    /// Also run the paper's four ablations of WAGMA: no group averaging (local SGD with period
    /// tau), fixed groups, a smaller group size (half the default) and S = P.
    #[arg(long)]
    pub ablations: bool,
    /// Reuse the runs of an earlier invocation into the same `--out` whose configuration is
    /// identical (kept in each run's `bench-config.json`); runs that differ or did not finish
    /// are made again. Lets a long benchmark be completed after an interruption. (Not part
    /// of the results: they are the same either way.)
    #[arg(long)]
    #[serde(skip)]
    pub resume: bool,
    /// Algorithms, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    pub algos: Vec<String>,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Image data: auto (Fashion-MNIST if installed) or builtin.
    #[arg(long, default_value = "builtin")]
    pub dataset: String,
    /// Samples per local step.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Image: base width of the CNN (default 16).
    #[arg(long)]
    pub width: Option<usize>,
    /// Image: label-skewed shards (the non-IID ablation).
    #[arg(long)]
    pub non_iid: bool,
    /// SGP's offsets and eager-SGD's late gradients.
    #[command(flatten)]
    #[serde(flatten)]
    pub variants: crate::simulate::Variants,
    /// Output directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One training run in the comparison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    /// Algorithm label.
    pub label: String,
    /// `main`, or the ablation it belongs to.
    pub group: String,
    /// The configuration.
    pub algo: AlgoConfig,
    /// The run's summary.
    pub summary: Summary,
    /// Every evaluation.
    pub curve: Vec<EvalRecord>,
    /// Seconds of training until the target was first reached.
    pub time_to_target_s: Option<f64>,
    /// Samples until the target was first reached.
    pub samples_to_target: Option<u64>,
}

/// What a run cost on this machine (`cost.json`; not in `results.json`, which a virtual-time
/// comparison reproduces bit for bit).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cost {
    /// Algorithm label.
    pub label: String,
    /// `main`, or the ablation it belongs to.
    pub group: String,
    /// Real seconds of the run (training and evaluation).
    pub real_s: f64,
    /// Real milliseconds per rank and iteration.
    pub real_ms_per_rank_iteration: f64,
}

/// Facts about the machine, for the report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// Cores available.
    pub cores: usize,
    /// CPU model.
    pub cpu: String,
    /// Memory in GiB.
    pub memory_gib: f64,
}

/// `results.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    /// The command that produced this.
    pub command: String,
    /// Options.
    pub args: Args,
    /// Machine.
    pub machine: Machine,
    /// The metric compared.
    pub metric: String,
    /// The target.
    pub target: Option<f64>,
    /// Every run.
    pub runs: Vec<Run>,
}

fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    Machine {
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu,
        memory_gib: kib / (1 << 20) as f64,
    }
}

/// The runs to make: every algorithm, then (optionally) WAGMA's ablations.
fn plan(args: &Args) -> anyhow::Result<Vec<(String, AlgoConfig)>> {
    let names: Vec<String> = if args.algos.is_empty() {
        Algorithm::NAMES.iter().map(|s| s.to_string()).collect()
    } else {
        args.algos.clone()
    };
    let mut out = Vec::new();
    for n in &names {
        let mut a = Algorithm::from_name(n.trim())?;
        args.variants.apply(&mut a);
        a.validate(args.ranks)?;
        out.push(("main".to_string(), seeded(a, args.seed)));
    }
    if args.ablations {
        out.extend(ablations(args.ranks, args.seed));
    }
    Ok(out)
}

fn seeded(a: Algorithm, seed: u64) -> AlgoConfig {
    let mut c = AlgoConfig::new(a);
    c.seed = seed;
    c
}

/// The ablations the paper ran at 64 ranks for the image workload, each changing one thing
/// against the default WAGMA run of the main group.
fn ablations(p: usize, seed: u64) -> Vec<(String, AlgoConfig)> {
    let base = WagmaOptions::default();
    let wagma = |o: WagmaOptions| seeded(Algorithm::Wagma(o), seed);
    let mut out = Vec::new();
    // Without group averaging only the global average every tau steps is left: local SGD.
    if let Some(tau) = base.tau {
        out.push((
            "no group averaging".into(),
            seeded(Algorithm::LocalSgd { period: tau }, seed),
        ));
    }
    out.push((
        "fixed groups".into(),
        wagma(WagmaOptions {
            groups: GroupingKind::Fixed,
            ..base.clone()
        }),
    ));
    let default = default_group_size(p);
    let mut sizes = vec![(default / 2).max(2), p];
    sizes.dedup();
    for s in sizes.into_iter().filter(|&s| s != default && s <= p) {
        out.push((
            "group size".into(),
            wagma(WagmaOptions {
                group_size: Some(s),
                ..base.clone()
            }),
        ));
    }
    out
}

/// This command as a user would type it: `wagma` wherever the binary lies, and without
/// `--resume`, which changes nothing in the results.
fn command_line() -> String {
    let args = std::env::args().skip(1).filter(|a| a != "--resume");
    std::iter::once("wagma".to_string())
        .chain(args)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The summary of a run in `dir` made with exactly `config`, if one finished there. The
/// configurations are compared as values, so that options added since (with their defaults)
/// do not make an identical run look different.
fn finished_run(dir: &Path, config: &TrainConfig) -> Option<Summary> {
    let earlier: TrainConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("bench-config.json")).ok()?).ok()?;
    let summary = std::fs::read_to_string(dir.join("summary.json")).ok()?;
    (earlier == *config)
        .then(|| serde_json::from_str(&summary).ok())
        .flatten()
}

fn read_curve(dir: &Path) -> anyhow::Result<Vec<EvalRecord>> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .with_context(|| format!("reading the metrics of {}", dir.display()))?;
    text.lines().map(|l| Ok(serde_json::from_str(l)?)).collect()
}

fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect::<String>()
        .split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

/// Runs the comparison.
pub fn run(args: Args) -> anyhow::Result<()> {
    let workload: WorkloadKind = args.workload.parse()?;
    if args.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    if args.eval_points == 0 {
        bail!("--eval-points must be at least 1");
    }
    let metric = primary_metric(workload);
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("runs/paper-{workload}")));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let plan = plan(&args)?;
    // With a budget, the default stands in for the unknown length: it sets the warm-up and the
    // evaluation period.
    let steps = args.steps.unwrap_or(match workload {
        WorkloadKind::Image => 600,
        WorkloadKind::Translate => 900,
        WorkloadKind::Navigate => 2000,
    });
    let execution = match args.execution.as_str() {
        "virtual" => Execution::Virtual,
        "threads" => Execution::Threads,
        e => bail!("invalid execution {e:?} (virtual or threads)"),
    };
    let virtual_time = execution == Execution::Virtual;
    let profile = args.imbalance.unwrap_or(match workload {
        _ if virtual_time => workload.paper_profile(),
        WorkloadKind::Image => Profile::PaperResnet,
        _ => Profile::None,
    });
    let time_scale = args
        .time_scale
        .unwrap_or(if virtual_time { 1.0 } else { 0.05 });
    let mut runs = Vec::with_capacity(plan.len());
    let mut costs = Vec::with_capacity(plan.len());
    for (i, (group, algo)) in plan.iter().enumerate() {
        let label = algo.label();
        let dir = out.join("runs").join(format!("{i:02}-{}", slug(&label)));
        let mut c = TrainConfig {
            workload,
            algo: algo.clone(),
            ranks: args.ranks,
            steps: if args.budget_seconds.is_some() {
                u64::MAX / 4
            } else {
                steps
            },
            budget: args.budget_seconds,
            eval_every: (steps / args.eval_points).max(1),
            batch: args.batch,
            width: args.width,
            non_iid: args.non_iid,
            seed: args.seed,
            imbalance: (profile != Profile::None || virtual_time).then_some(Imbalance {
                profile,
                time_scale,
                seed: args.seed,
            }),
            execution,
            dataset: match args.dataset.as_str() {
                "builtin" => Dataset::Builtin,
                "auto" => Dataset::Auto,
                d => Dataset::Idx(d.into()),
            },
            out: dir.clone(),
            progress: false,
            ..TrainConfig::default()
        };
        c.optimizer = Some(optimizer(
            workload,
            steps,
            c.ranks * c.image_batch(),
            args.budget_seconds.is_some(),
        ));
        c.validate()?;
        eprint!("[{}/{}] {label} ({group}) ... ", i + 1, plan.len());
        let config_file = dir.join("bench-config.json");
        let config = serde_json::to_string_pretty(&c)?;
        let earlier = args.resume.then(|| finished_run(&dir, &c)).flatten();
        let reused = earlier.is_some();
        let mut summary = match earlier {
            Some(s) => s,
            None => {
                // Written after the run, so that an interrupted run is never taken as finished.
                let _ = std::fs::remove_file(&config_file);
                let s = execute(&mut c)?;
                std::fs::write(&config_file, &config)
                    .with_context(|| format!("writing {}", config_file.display()))?;
                s
            }
        };
        if reused {
            eprint!("(reused) ");
        }
        eprintln!(
            "{metric} {:.4} in {:.1} s ({:.0} samples/s; {:.1} s real)",
            summary
                .final_metrics
                .get(metric)
                .copied()
                .unwrap_or(f64::NAN),
            summary.wall_s,
            summary.samples_per_s,
            summary.real_s
        );
        let rank_iterations = (summary.steps * summary.ranks as u64).max(1);
        costs.push(Cost {
            label: label.clone(),
            group: group.clone(),
            real_s: summary.real_s,
            real_ms_per_rank_iteration: 1e3 * summary.real_s / rank_iterations as f64,
        });
        summary.real_s = 0.0;
        runs.push(Run {
            label,
            group: group.clone(),
            algo: algo.clone(),
            curve: read_curve(&dir)?,
            summary,
            time_to_target_s: None,
            samples_to_target: None,
        });
    }
    let target = args.target.or_else(|| {
        runs.iter()
            .find(|r| r.group == "main" && r.algo.algorithm == Algorithm::AllreduceSgd)
            .and_then(|r| r.summary.final_metrics.get(metric))
            .map(|v| 0.98 * v)
    });
    if let Some(t) = target {
        for r in &mut runs {
            if let Some(e) = r
                .curve
                .iter()
                .find(|e| e.consensus.get(metric).is_some_and(|&v| v >= t))
            {
                r.time_to_target_s = Some(e.wall_s);
                r.samples_to_target = Some(e.samples);
            }
        }
    }
    let results = Results {
        command: command_line(),
        args,
        machine: machine(),
        metric: metric.to_string(),
        target,
        runs,
    };
    std::fs::write(
        out.join("results.json"),
        serde_json::to_vec_pretty(&results)?,
    )?;
    std::fs::write(out.join("cost.json"), serde_json::to_vec_pretty(&costs)?)?;
    std::fs::write(out.join("results.csv"), csv(&results))?;
    let plots = plots(&results, &out);
    std::fs::write(
        out.join("report.md"),
        report(&results, &costs, profile, time_scale, &plots),
    )?;
    println!("{}", table(&results));
    println!("report: {}", out.join("report.md").display());
    Ok(())
}

/// The workload's default optimizer for a run of `steps`. With a time budget the run has no
/// known end for a decay to aim at: the rate stays at its peak after the warm-up.
fn optimizer(
    workload: WorkloadKind,
    steps: u64,
    global_batch: usize,
    budget: bool,
) -> OptimizerConfig {
    let mut opt = default_optimizer(workload, steps, global_batch);
    if budget {
        opt.lr = without_end(&opt.lr);
    }
    opt
}

fn csv(r: &Results) -> String {
    let mut s = String::from(
        "label,group,final_metric,time_to_target_s,samples_to_target,samples_per_s,wait_fraction,staleness_mean,staleness_max,wall_s,steps\n",
    );
    for run in &r.runs {
        let m = run
            .summary
            .final_metrics
            .get(&r.metric)
            .copied()
            .unwrap_or(f64::NAN);
        let _ = writeln!(
            s,
            "{},{},{m:.5},{},{},{:.2},{:.4},{:.3},{},{:.2},{}",
            run.label,
            run.group,
            run.time_to_target_s
                .map_or(String::new(), |t| format!("{t:.2}")),
            run.samples_to_target
                .map_or(String::new(), |t| t.to_string()),
            run.summary.samples_per_s,
            run.summary.wait_fraction,
            run.summary.staleness.mean(),
            run.summary
                .staleness
                .max()
                .map_or(String::new(), |x| x.to_string()),
            run.summary.wall_s,
            run.summary.steps
        );
    }
    s
}

/// Markdown table of the runs.
fn table(r: &Results) -> String {
    let mut s = format!(
        "| algorithm | group | final {m} (consensus) | final {m} (rank 0) | time to target (s) | samples/s | time / no-wait ideal | waiting | consensus distance | staleness mean/max |\n|---|---|---|---|---|---|---|---|---|---|\n",
        m = r.metric
    );
    for run in &r.runs {
        let st = &run.summary.staleness;
        let last = run.curve.last();
        let replica = last
            .and_then(|e| e.replica0.as_ref())
            .and_then(|m| m.get(&r.metric))
            .copied()
            .unwrap_or(f64::NAN);
        let distance = last.map_or(f64::NAN, |e| e.consensus_distance);
        let ideal = run
            .summary
            .ideal_s
            .filter(|&i| i > 0.0)
            .map_or("-".into(), |i| format!("{:.3}", run.summary.wall_s / i));
        let _ = writeln!(
            s,
            "| {} | {} | {:.4} | {replica:.4} | {} | {:.0} | {ideal} | {:.1}% | {distance:.2e} | {} |",
            run.label,
            run.group,
            run.summary
                .final_metrics
                .get(&r.metric)
                .copied()
                .unwrap_or(f64::NAN),
            run.time_to_target_s
                .map_or("not reached".into(), |t| format!("{t:.1}")),
            run.summary.samples_per_s,
            100.0 * run.summary.wait_fraction,
            if st.total() == 0 {
                "-".into()
            } else {
                format!("{:.2}/{}", st.mean(), st.max().unwrap_or(0))
            }
        );
    }
    s
}

/// Draws the plots; returns their file names (relative to `out`) or why there are none.
fn plots(r: &Results, out: &Path) -> Result<Vec<(String, String)>, String> {
    let main: Vec<&Run> = r.runs.iter().filter(|x| x.group == "main").collect();
    let series = |runs: &[&Run], x: fn(&EvalRecord) -> f64| -> Vec<Series> {
        runs.iter()
            .map(|run| Series {
                name: run.label.clone(),
                points: run
                    .curve
                    .iter()
                    .filter_map(|e| e.consensus.get(&r.metric).map(|&m| (x(e), m)))
                    .collect(),
            })
            .collect()
    };
    let hline = r.target.map(|t| (t, "target"));
    let mut made = Vec::new();
    let mut add =
        |name: &str, caption: &str, res: anyhow::Result<Vec<PathBuf>>| -> Result<(), String> {
            res.map_err(|e| e.to_string())?;
            made.push((format!("{name}.png"), caption.to_string()));
            Ok(())
        };
    add(
        "metric_vs_time",
        &format!("{} of the consensus model over training time", r.metric),
        plot::lines(
            &out.join("metric_vs_time"),
            &format!("{} over time", r.metric),
            "training seconds",
            &r.metric,
            &series(&main, |e| e.wall_s),
            hline,
        ),
    )?;
    add(
        "metric_vs_samples",
        &format!("{} over samples processed", r.metric),
        plot::lines(
            &out.join("metric_vs_samples"),
            &format!("{} over samples", r.metric),
            "samples (all ranks)",
            &r.metric,
            &series(&main, |e| e.samples as f64),
            hline,
        ),
    )?;
    let labels: Vec<String> = main.iter().map(|x| short(&x.label)).collect();
    let measured: Vec<f64> = main.iter().map(|x| x.summary.samples_per_s).collect();
    let no_wait: Vec<f64> = main
        .iter()
        .map(|x| x.summary.samples_per_s / (1.0 - x.summary.wait_fraction).max(1e-3))
        .collect();
    add(
        "throughput",
        "throughput, measured and without the time spent waiting",
        plot::bars(
            &out.join("throughput"),
            "throughput",
            "samples/s",
            &labels,
            &[
                ("measured".into(), measured),
                ("without waiting".into(), no_wait),
            ],
        ),
    )?;
    let stale: Vec<&Run> = r
        .runs
        .iter()
        .filter(|x| x.group == "main" && x.summary.staleness.total() > 0)
        .collect();
    if !stale.is_empty() {
        let maxs = stale
            .iter()
            .filter_map(|x| x.summary.staleness.max())
            .max()
            .unwrap_or(0)
            .min(12);
        let cats: Vec<String> = (0..=maxs).map(|v| v.to_string()).collect();
        let groups: Vec<(String, Vec<f64>)> = stale
            .iter()
            .map(|x| {
                let h = &x.summary.staleness;
                let n = h.total().max(1) as f64;
                (
                    short(&x.label),
                    (0..=maxs).map(|v| h.count(v) as f64 / n).collect(),
                )
            })
            .collect();
        add(
            "staleness",
            "staleness of the contributions used (share per number of rounds behind)",
            plot::bars(
                &out.join("staleness"),
                "staleness (rounds behind)",
                "share of contributions",
                &cats,
                &groups,
            ),
        )?;
    }
    let ablation: Vec<&Run> = r
        .runs
        .iter()
        .filter(|x| x.group != "main" || matches!(x.algo.algorithm, Algorithm::Wagma(_)))
        .collect();
    if ablation.len() > 1 {
        add(
            "ablations",
            "WAGMA's ablations over training time",
            plot::lines(
                &out.join("ablations"),
                "ablations",
                "training seconds",
                &r.metric,
                &series(&ablation, |e| e.wall_s),
                hline,
            ),
        )?;
    }
    Ok(made)
}

fn short(label: &str) -> String {
    label.replace("eager-sgd ", "eager ").replace(" tau=10", "")
}

fn report(
    r: &Results,
    costs: &[Cost],
    profile: Profile,
    time_scale: f64,
    plots: &Result<Vec<(String, String)>, String>,
) -> String {
    let a = &r.args;
    let mut s = format!("# {} workload: WAGMA-SGD and its baselines\n\n", a.workload);
    let _ = writeln!(s, "Produced by `{}`.\n", r.command);
    let _ = writeln!(
        s,
        "Machine: {} cores ({}), {:.0} GiB; seed {}; {} ranks.\n",
        r.machine.cores, r.machine.cpu, r.machine.memory_gib, a.seed, a.ranks,
    );
    if a.execution == "virtual" {
        let _ = writeln!(
            s,
            "Execution: real gradients on real data in virtual time. Each rank's compute time per \
             iteration is drawn from the {profile} profile x {time_scale} (1 = the paper's times); \
             messages cross the LogGP model of a Cray XC50 with Aries (as `wagma simulate`). The time \
             of iteration t is when the last rank finished it; evaluation works on snapshots after \
             training and costs no time. Results are reproducible bit for bit.\n"
        );
    } else {
        let _ = writeln!(
            s,
            "Execution: {} in-process ranks share {} cores in real time, so ranks are oversubscribed and \
             the measured throughput includes that contention; the {profile} profile x {time_scale} adds \
             delays as sleeps. The time of iteration t is when the last rank finished it.\n",
            a.ranks, r.machine.cores
        );
    }
    s.push_str(
        "Metrics are of the consensus model (the global average of the replicas) and of rank 0's \
         replica, each at the same iteration.\n\n",
    );
    match r.target {
        Some(t) => {
            let _ = writeln!(
                s,
                "Target {}: {t:.4} ({}).\n",
                r.metric,
                if a.target.is_some() {
                    "given"
                } else {
                    "98% of allreduce-sgd's final value"
                }
            );
        }
        None => s.push_str("No target (allreduce-sgd did not run and none was given).\n\n"),
    }
    s.push_str(&table(r));
    s.push('\n');
    s.push_str("Real cost on this machine:\n\n| algorithm | group | real seconds | ms per rank-iteration |\n|---|---|---|---|\n");
    for c in costs {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} | {:.2} |",
            c.label, c.group, c.real_s, c.real_ms_per_rank_iteration
        );
    }
    s.push('\n');
    match plots {
        Ok(list) => {
            for (file, caption) in list {
                let _ = writeln!(s, "![{caption}]({file})\n\n*{caption}* (also as SVG).\n");
            }
        }
        Err(why) => {
            let _ = writeln!(s, "No plots: {why}.\n");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_budget_keeps_the_peak_rate_after_the_warm_up() {
        for w in [
            WorkloadKind::Image,
            WorkloadKind::Translate,
            WorkloadKind::Navigate,
        ] {
            let fixed = optimizer(w, 600, 256, false).lr;
            let open = optimizer(w, 600, 256, true).lr;
            let peak = (0..600).map(|t| fixed.at(t)).fold(0.0, f32::max);
            // The same warm-up and peak; past the default run's end the rate is still the peak.
            assert_eq!(open.at(0), fixed.at(0), "{w}");
            assert_eq!(open.at(100), peak, "{w}");
            assert_eq!(open.at(600), peak, "{w}");
            assert_eq!(open.at(1_000_000), peak, "{w}");
        }
        // Without a budget the image schedule ends at the run's end.
        assert_eq!(
            optimizer(WorkloadKind::Image, 600, 256, false).lr.at(600),
            0.0
        );
    }
}
