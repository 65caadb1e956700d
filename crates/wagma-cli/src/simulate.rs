//! `wagma simulate`: the very engines and algorithms in virtual time, at up to thousands of
//! ranks, over a LogGP network and the imbalance profiles (or recorded compute traces).

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args as ClapArgs, Subcommand};
use comfy_table::Table;
use serde::{Deserialize, Serialize};
use wagma::algo::{AlgoConfig, Algorithm, LateGradients, SendOrder};
use wagma::imbalance::{Imbalance, Profile};
use wagma::topology::PeerOffsets;
use wagma_sim::compute::{Compute, Trace};
use wagma_sim::{LogGp, SimResult, SimSpec, simulate};

use crate::plot::{self, Series};

/// `wagma simulate ...`.
#[derive(Subcommand)]
pub enum Simulate {
    /// Simulates one algorithm.
    Run(RunArgs),
    /// Throughput of every algorithm at several rank counts, with the ideal: JSON and a plot.
    Scaling(ScalingArgs),
    /// Measures the local transport and writes fitted network parameters.
    Calibrate(crate::calibrate::Args),
    /// Compares predictions with `wagma bench imbalance` on this machine, side by side.
    Validate(crate::calibrate::ValidateArgs),
}

/// The network, the compute model and the model size shared by the subcommands.
#[derive(ClapArgs, Debug, Clone, Serialize, Deserialize)]
pub struct Common {
    /// Model size in f32 parameters (sizes only: nothing is allocated).
    #[arg(long, default_value_t = 25_600_000)]
    pub model_params: usize,
    /// Compute profile: none, paper-resnet, lengths, heavy-tail.
    #[arg(long, default_value = "paper-resnet")]
    pub profile: Profile,
    /// Multiplies the profile's times (1 = the paper's; at most 10000).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Replay compute times recorded by `wagma train --trace-compute FILE` instead.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Iterations.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Samples per local step.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// WAGMA's tau.
    #[arg(long, default_value_t = 10)]
    pub tau: u64,
    /// WAGMA's group size S (default: sqrt(P) rounded up to a power of two).
    #[arg(long)]
    #[serde(default)]
    pub group_size: Option<usize>,
    /// eager-SGD: blocking gradient allreduce every N steps, or "never" (default: 32).
    #[arg(long)]
    #[serde(default)]
    pub eager_sync: Option<String>,
    /// local SGD's period H (default: 1).
    #[arg(long)]
    #[serde(default)]
    pub period: Option<u64>,
    /// WAGMA: blocking group averaging instead of wait-avoiding (lock-step).
    #[arg(long)]
    #[serde(default)]
    pub blocking: bool,
    /// SGP's peers.
    #[arg(long, default_value_t = 1)]
    pub peers: usize,
    /// D-PSGD and SGP: exchange the model as this many chained pieces per iteration (the
    /// authors' baselines exchange one tensor at a time: 161 for ResNet-50).
    #[arg(long, default_value_t = 1)]
    #[serde(default = "one_piece")]
    pub exchange_pieces: u32,
    /// D-PSGD: send to both ring neighbours together, or right-then-left (the authors'
    /// blocking sends, which also wait for the rank two to the right).
    #[arg(long, default_value_t = SendOrder::Together)]
    #[serde(default)]
    pub send_order: SendOrder,
    /// SGP's offsets, eager-SGD's late gradients and AD-PSGD's gossip.
    #[command(flatten)]
    #[serde(flatten)]
    pub variants: Variants,
    /// Network parameters from `wagma simulate calibrate` (default: a Cray XC50 with the Aries
    /// interconnect; the README lists where each value comes from).
    #[arg(long)]
    pub network: Option<PathBuf>,
    /// LogGP latency L, seconds (overrides the file).
    #[arg(long)]
    pub latency: Option<f64>,
    /// LogGP bandwidth, bytes per second (overrides the file).
    #[arg(long)]
    pub bandwidth: Option<f64>,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

fn one_piece() -> u32 {
    1
}

/// The baselines' variants that every algorithm list accepts (each applies to one algorithm).
#[derive(ClapArgs, Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Variants {
    /// SGP: peer offsets, disjoint (each iteration the next powers of two) or sliding
    /// (consecutive iterations share all but one, as the authors' baseline).
    #[arg(long, default_value_t = PeerOffsets::Disjoint)]
    #[serde(default)]
    pub sgp_offsets: PeerOffsets,
    /// eager-SGD: a gradient that misses its round is contributed to the next (accumulate) or
    /// dropped (drop, as the authors' code).
    #[arg(long, default_value_t = LateGradients::Accumulate)]
    #[serde(default)]
    pub late_gradients: LateGradients,
    /// AD-PSGD: the authors' gossip loop, K pairwise averages per step run by the engine
    /// while the step never waits (absent: one awaited pairwise average per step).
    #[arg(long, value_name = "K")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ad_psgd_gossip: Option<u32>,
}

impl Variants {
    /// Sets them on `algorithm` (where they apply).
    pub fn apply(&self, algorithm: &mut Algorithm) {
        algorithm.set_variants(self.sgp_offsets, self.late_gradients, self.ad_psgd_gossip);
    }
}

/// A LogGP network: from a calibration file (default: [`LogGp::aries`]), with the latency and
/// the bandwidth overridden when given.
pub fn network_model(
    file: Option<&std::path::Path>,
    latency: Option<f64>,
    bandwidth: Option<f64>,
) -> anyhow::Result<LogGp> {
    let mut n = match file {
        Some(p) => {
            serde_json::from_slice::<crate::calibrate::Calibration>(
                &std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
            )
            .with_context(|| format!("parsing {}", p.display()))?
            .network
        }
        None => LogGp::aries(),
    };
    if let Some(l) = latency {
        n.latency_s = l;
    }
    if let Some(b) = bandwidth {
        if !(b.is_finite() && b > 0.0) {
            bail!("--bandwidth must be positive");
        }
        n.per_byte_s = 1.0 / b;
    }
    n.validate().map_err(anyhow::Error::msg)?;
    Ok(n)
}

impl Common {
    /// The network model.
    pub fn network(&self) -> anyhow::Result<LogGp> {
        network_model(self.network.as_deref(), self.latency, self.bandwidth)
    }

    /// The compute model.
    pub fn compute(&self) -> anyhow::Result<Compute> {
        Ok(match &self.trace {
            Some(p) => Compute::Trace(Trace::load(p)?),
            None => {
                let im = Imbalance {
                    profile: self.profile,
                    time_scale: self.time_scale,
                    seed: self.seed,
                };
                im.validate()?;
                Compute::Profile(im)
            }
        })
    }

    /// The algorithm called `name`, with these options.
    pub fn algo(&self, name: &str, ranks: usize) -> anyhow::Result<AlgoConfig> {
        let mut c = crate::bench::algo_config(
            name,
            ranks,
            self.group_size,
            self.tau,
            self.peers,
            self.seed,
        )?;
        match &mut c.algorithm {
            Algorithm::EagerSgd { sync_period, .. } => {
                if let Some(s) = &self.eager_sync {
                    *sync_period = crate::train::never_or(s, "eager-sync")?;
                }
            }
            Algorithm::LocalSgd { period } => *period = self.period.unwrap_or(*period),
            Algorithm::Wagma(o) => o.wait_avoiding = !self.blocking,
            _ => {}
        }
        c.exchange_pieces = self.exchange_pieces;
        c.send_order = self.send_order;
        self.variants.apply(&mut c.algorithm);
        c.validate(ranks)?;
        Ok(c)
    }

    /// The simulation of `name` on `ranks` ranks over `network` with `compute` (both resolved
    /// once by the caller: they may come from files).
    pub fn spec(
        &self,
        name: &str,
        ranks: usize,
        network: LogGp,
        compute: &Compute,
    ) -> anyhow::Result<SimSpec> {
        if self.steps == 0 {
            bail!("--steps must be at least 1");
        }
        Ok(SimSpec {
            ranks,
            algo: self.algo(name, ranks)?,
            steps: self.steps,
            model_params: self.model_params,
            batch: self.batch,
            compute: compute.clone(),
            network,
            seed: self.seed,
        })
    }
}

/// Options of `wagma simulate run`.
#[derive(ClapArgs, Debug, Clone)]
pub struct RunArgs {
    /// Ranks.
    #[arg(long, default_value_t = 64)]
    pub ranks: usize,
    /// Algorithm.
    #[arg(long, default_value = "wagma")]
    pub algo: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    common: Common,
}

/// Options of `wagma simulate scaling`.
#[derive(ClapArgs, Debug, Clone, Serialize, Deserialize)]
pub struct ScalingArgs {
    /// Algorithms, comma-separated, or `all`.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub algos: Vec<String>,
    /// Rank counts.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256,1024")]
    pub ranks: Vec<usize>,
    /// Output directory (JSON, plot).
    #[arg(long, default_value = "runs/scaling")]
    pub out: PathBuf,
    #[command(flatten)]
    common: Common,
}

/// Runs `wagma simulate`.
pub fn run(s: Simulate) -> anyhow::Result<()> {
    match s {
        Simulate::Run(a) => {
            let (network, compute) = (a.common.network()?, a.common.compute()?);
            let r = simulate(&a.common.spec(&a.algo, a.ranks, network, &compute)?)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print_results(&[r]);
            }
            Ok(())
        }
        Simulate::Scaling(a) => scaling(a),
        Simulate::Calibrate(a) => crate::calibrate::calibrate(a),
        Simulate::Validate(a) => crate::calibrate::validate(a),
    }
}

fn print_results(rs: &[SimResult]) {
    let mut t = Table::new();
    t.set_header(vec![
        "algorithm",
        "ranks",
        "samples/s",
        "x ideal",
        "bound samples/s",
        "waiting",
        "staleness mean/max",
        "simulated in",
    ]);
    for r in rs {
        let st = &r.stats.staleness;
        t.add_row(vec![
            r.algorithm.clone(),
            r.ranks.to_string(),
            format!("{:.1}", r.samples_per_s),
            format!("{:.3}", r.samples_per_s / r.ideal_samples_per_s),
            format!("{:.1}", r.bound_samples_per_s),
            format!("{:.1}%", 100.0 * r.stats.wait_fraction()),
            if st.total() == 0 {
                "-".into()
            } else {
                format!("{:.2}/{}", st.mean(), st.max().unwrap_or(0))
            },
            format!("{:.1} s", r.simulation_s),
        ]);
    }
    println!("{t}");
}

/// `scaling.json`.
#[derive(Debug, Serialize, Deserialize)]
struct ScalingResults {
    args: ScalingArgs,
    network: LogGp,
    results: Vec<SimResult>,
}

fn scaling(a: ScalingArgs) -> anyhow::Result<()> {
    let names: Vec<String> = if a.algos.iter().any(|x| x == "all") {
        Algorithm::NAMES.iter().map(|s| s.to_string()).collect()
    } else {
        a.algos.clone()
    };
    if a.ranks.is_empty() || a.ranks.contains(&0) {
        bail!("--ranks needs positive rank counts");
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let (network, compute) = (a.common.network()?, a.common.compute()?);
    let mut results = Vec::new();
    for &p in &a.ranks {
        for n in &names {
            eprint!("{n} on {p} ranks ... ");
            let r = simulate(&a.common.spec(n, p, network, &compute)?)?;
            eprintln!(
                "{:.1} samples/s (simulated in {:.1} s)",
                r.samples_per_s, r.simulation_s
            );
            results.push(r);
        }
    }
    print_results(&results);
    let mut series: Vec<Series> = names
        .iter()
        .map(|n| Series {
            name: n.clone(),
            points: Vec::new(),
        })
        .collect();
    let mut ideal = Series {
        name: "ideal".into(),
        points: Vec::new(),
    };
    for (i, r) in results.iter().enumerate() {
        let x = r.ranks as f64;
        series[i % names.len()]
            .points
            .push((x.log2(), r.samples_per_s));
        if i % names.len() == 0 {
            ideal.points.push((x.log2(), r.ideal_samples_per_s));
        }
    }
    series.push(ideal);
    let plotted = plot::lines(
        &a.out.join("scaling"),
        "simulated throughput",
        "log2(ranks)",
        "samples/s",
        &series,
        None,
    );
    if let Err(e) = &plotted {
        eprintln!("no plot: {e}");
    }
    let out = ScalingResults {
        network,
        args: a.clone(),
        results,
    };
    std::fs::write(a.out.join("scaling.json"), serde_json::to_vec_pretty(&out)?)?;
    println!("results: {}", a.out.join("scaling.json").display());
    Ok(())
}
