//! `wagma bench imbalance`: every algorithm on the same per-rank compute-time draws, with real
//! communication of a model of M floats; throughput, waiting and staleness next to the ideal
//! (no waiting, no communication) and to each algorithm's own bound (its waiting rules replayed
//! on the same draws with free communication).

use std::sync::Arc;

use anyhow::bail;
use clap::Args as ClapArgs;
use comfy_table::Table;
use serde::{Deserialize, Serialize};
use wagma::Comm;
use wagma::algo::measure::{self, JobStats, Spec};
use wagma::algo::{AlgoConfig, Algorithm, bound_wall, ideal_wall};
use wagma::imbalance::{Imbalance, Profile};
use wagma::topology::default_group_size;

use super::TransportKind;

/// Options of `wagma bench imbalance`.
#[derive(ClapArgs, Debug, Clone, Serialize, Deserialize)]
pub struct Args {
    /// Transport.
    #[arg(long, value_enum, default_value_t = TransportKind::Mem)]
    pub transport: TransportKind,
    /// Number of ranks P.
    #[arg(long, default_value_t = 16)]
    pub ranks: usize,
    /// Imbalance profile: none, paper-resnet, lengths, heavy-tail.
    #[arg(long, default_value = "paper-resnet")]
    pub profile: Profile,
    /// Multiplies every compute time of the profile (1 = the paper's times: 450 ms per
    /// ResNet step, 1.7-43.5 s per DD-PPO step; at most 10000).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Iterations per algorithm.
    #[arg(long, default_value_t = 50)]
    pub steps: u64,
    /// Model size in f32 elements.
    #[arg(long, default_value_t = 1 << 20)]
    pub model_params: usize,
    /// Samples per local step (for samples/s).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Algorithms, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    pub algos: Vec<String>,
    /// WAGMA's group size (default sqrt(P) rounded up to a power of two).
    #[arg(long)]
    pub group_size: Option<usize>,
    /// WAGMA's global synchronization period.
    #[arg(long, default_value_t = 10)]
    pub tau: u64,
    /// SGP's peers per iteration.
    #[arg(long, default_value_t = 1)]
    pub peers: usize,
    /// Seed of the draws and of majority initiators.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One algorithm's line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Algorithm and options.
    pub algorithm: String,
    /// Measured totals.
    pub measured: JobStats,
    /// Iterations per second.
    pub iterations_per_s: f64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Share of time spent waiting.
    pub wait_fraction: f64,
    /// Samples per second its waiting rules allow with free communication.
    pub bound_samples_per_s: f64,
    /// Measured over bound.
    pub efficiency: f64,
    /// Throughput relative to allreduce-sgd's measured throughput, when it ran.
    pub vs_allreduce: Option<f64>,
}

/// The report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Options.
    pub args: Args,
    /// Samples per second with no waiting and no communication.
    pub ideal_samples_per_s: f64,
    /// One line per algorithm.
    pub rows: Vec<Row>,
}

fn algorithms(args: &Args) -> anyhow::Result<Vec<AlgoConfig>> {
    let names: Vec<String> = if args.algos.is_empty() {
        Algorithm::NAMES.iter().map(|s| s.to_string()).collect()
    } else {
        args.algos.clone()
    };
    names
        .iter()
        .map(|n| {
            super::algo_config(
                n,
                args.ranks,
                args.group_size,
                args.tau,
                args.peers,
                args.seed,
            )
        })
        .collect()
}

fn specs(args: &Args) -> anyhow::Result<Vec<Spec>> {
    let im = Imbalance {
        profile: args.profile,
        time_scale: args.time_scale,
        seed: args.seed,
    };
    im.validate()?;
    let draws = Arc::new(im.table(args.steps, args.ranks));
    Ok(algorithms(args)?
        .into_iter()
        .map(|algo| Spec {
            algo,
            steps: args.steps,
            model_len: args.model_params,
            batch: args.batch,
            draws: Arc::clone(&draws),
            real_data: true,
        })
        .collect())
}

async fn run_all(c: &mut Comm, specs: &[Spec]) -> Result<Vec<JobStats>, wagma::Error> {
    let mut out = Vec::with_capacity(specs.len());
    for s in specs {
        if c.rank() == 0 {
            eprintln!("running {} ...", s.algo.label());
        }
        out.push(measure::run(c, s).await?);
    }
    Ok(out)
}

/// Runs the benchmark (or, in a process it started, one TCP rank).
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let specs = specs(&args)?;
    let Some(stats) = super::run_job(
        args.transport,
        args.ranks,
        super::engine_config(),
        async |c: &mut Comm| run_all(c, &specs).await,
    )?
    else {
        return Ok(());
    };
    let report = build(&args, &specs, stats);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&report);
    }
    Ok(())
}

fn build(args: &Args, specs: &[Spec], stats: Vec<JobStats>) -> Report {
    let draws = &specs[0].draws;
    let samples = (args.ranks * args.batch) as f64 * args.steps as f64;
    let ideal = samples / ideal_wall(draws);
    let allreduce = specs
        .iter()
        .zip(&stats)
        .find(|(s, _)| s.algo.algorithm == Algorithm::AllreduceSgd)
        .map(|(_, st)| st.samples_per_s());
    let rows = specs
        .iter()
        .zip(stats)
        .map(|(s, st)| {
            let bound = samples / bound_wall(&s.algo, draws);
            let sps = st.samples_per_s();
            Row {
                algorithm: s.algo.label(),
                iterations_per_s: st.iterations_per_s(),
                samples_per_s: sps,
                wait_fraction: st.wait_fraction(),
                bound_samples_per_s: bound,
                efficiency: sps / bound,
                vs_allreduce: allreduce.map(|a| sps / a),
                measured: st,
            }
        })
        .collect();
    Report {
        args: args.clone(),
        ideal_samples_per_s: ideal,
        rows,
    }
}

fn print(r: &Report) {
    let a = &r.args;
    println!(
        "{} ranks over {}, profile {} x {}, {} steps, model {} floats, S = {}, tau = {}",
        a.ranks,
        a.transport.name(),
        a.profile,
        a.time_scale,
        a.steps,
        a.model_params,
        a.group_size.unwrap_or_else(|| default_group_size(a.ranks)),
        a.tau
    );
    println!(
        "ideal (no waiting, no communication): {:.1} samples/s",
        r.ideal_samples_per_s
    );
    let mut t = Table::new();
    t.set_header(vec![
        "algorithm",
        "it/s",
        "samples/s",
        "x allreduce",
        "wait",
        "overhead ms/step",
        "bound samples/s",
        "efficiency",
        "x ideal",
        "staleness mean/max",
    ]);
    for row in &r.rows {
        let s = &row.measured.staleness;
        t.add_row(vec![
            row.algorithm.clone(),
            format!("{:.2}", row.iterations_per_s),
            format!("{:.1}", row.samples_per_s),
            row.vs_allreduce.map_or("-".into(), |x| format!("{x:.2}")),
            format!("{:.1}%", 100.0 * row.wait_fraction),
            format!("{:.2}", row.measured.overhead_ms_per_step()),
            format!("{:.1}", row.bound_samples_per_s),
            format!("{:.3}", row.efficiency),
            format!("{:.2}", row.samples_per_s / r.ideal_samples_per_s),
            if s.total() == 0 {
                "-".into()
            } else {
                format!("{:.2}/{}", s.mean(), s.max().unwrap_or(0))
            },
        ]);
    }
    println!("{t}");
}
