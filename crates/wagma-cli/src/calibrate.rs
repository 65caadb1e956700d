//! `wagma simulate calibrate` (measure the local transport, fit the network model) and
//! `wagma simulate validate` (predictions next to measurements of `wagma bench imbalance`).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};
use clap::Args as ClapArgs;
use comfy_table::Table;
use serde::{Deserialize, Serialize};
use wagma::algo::SendOrder;
use wagma::imbalance::Profile;
use wagma::schedule::AllreduceAlgorithm;
use wagma::topology::default_group_size;
use wagma::{Comm, Payload};
use wagma_sim::calibrate::{Collective, Measurement, fit, simulated, time_collective};
use wagma_sim::{LogGp, simulate};

use crate::bench::{self, TransportKind, median};

/// Options of `wagma simulate calibrate`.
#[derive(ClapArgs, Debug, Clone, Serialize, Deserialize)]
pub struct Args {
    /// Transport to measure.
    #[arg(long, value_enum, default_value_t = TransportKind::Mem)]
    pub transport: TransportKind,
    /// Ranks.
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Buffer sizes in f32 elements.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,65536,1048576,4194304"
    )]
    pub sizes: Vec<usize>,
    /// Repetitions per measurement (the median is kept).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Where to write the parameters.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A calibration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Calibration {
    /// The transport measured.
    pub transport: String,
    /// Ranks.
    pub ranks: usize,
    /// The fitted network.
    pub network: LogGp,
    /// What was measured, and what the fitted network predicts for it.
    pub measurements: Vec<(Measurement, f64)>,
}

const CASES: [Collective; 5] = [
    Collective::Allreduce(AllreduceAlgorithm::RecursiveDoubling),
    Collective::Allreduce(AllreduceAlgorithm::ReduceScatterAllgather),
    Collective::GroupAllreduce(AllreduceAlgorithm::RecursiveDoubling),
    Collective::GroupAllreduce(AllreduceAlgorithm::ReduceScatterAllgather),
    Collective::NeighbourExchange,
];

async fn measure(c: &mut Comm, a: &Args) -> Result<Vec<Measurement>, wagma::Error> {
    let (p, s) = (c.size(), default_group_size(c.size()));
    let mut seq = 1u64 << 41;
    let mut out = Vec::new();
    for &n in &a.sizes {
        for case in CASES {
            let mut times = Vec::with_capacity(a.reps);
            for rep in 0..a.reps + 1 {
                seq += 1;
                let dt = time_collective(c, case, s, Payload::Data(vec![1.0; n]), seq).await?;
                let slowest = bench::slowest(c, dt).await?;
                if rep > 0 {
                    times.push(slowest);
                }
            }
            out.push(Measurement {
                collective: case,
                ranks: p,
                group_size: s,
                elements: n,
                seconds: median(&mut times),
            });
        }
    }
    Ok(out)
}

/// Runs `wagma simulate calibrate` (or, in a process it started, one TCP rank).
pub fn calibrate(a: Args) -> anyhow::Result<()> {
    if a.ranks < 2 {
        bail!("--ranks must be at least 2");
    }
    if a.sizes.is_empty() || a.reps == 0 {
        bail!("--sizes and --reps must not be empty");
    }
    let Some(ms) = bench::run_job(
        a.transport,
        a.ranks,
        bench::engine_config(),
        async |c: &mut Comm| measure(c, &a).await,
    )?
    else {
        return Ok(());
    };
    let template = LogGp {
        latency_s: 0.0,
        overhead_s: 0.0,
        gap_s: 0.0,
        per_byte_s: 0.0,
        node_limit: true,
    };
    let network = fit(&ms, template)?;
    let measurements = ms
        .iter()
        .map(|m| Ok((*m, simulated(m, network)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let cal = Calibration {
        transport: a.transport.name().into(),
        ranks: a.ranks,
        network,
        measurements,
    };
    let out = a.out.clone().unwrap_or_else(|| {
        PathBuf::from(format!(
            "runs/calibration-{}-{}.json",
            a.transport.name(),
            a.ranks
        ))
    });
    if let Some(d) = out.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    std::fs::write(&out, serde_json::to_vec_pretty(&cal)?)?;
    println!(
        "{} with {} ranks: latency {:.1} us, bandwidth {:.2} GB/s",
        cal.transport,
        cal.ranks,
        network.latency_s * 1e6,
        1e-9 / network.per_byte_s.max(1e-30)
    );
    let mut t = Table::new();
    t.set_header(vec![
        "collective",
        "elements",
        "measured ms",
        "fitted ms",
        "ratio",
    ]);
    for (m, p) in &cal.measurements {
        t.add_row(vec![
            format!("{:?}", m.collective),
            m.elements.to_string(),
            format!("{:.3}", m.seconds * 1e3),
            format!("{:.3}", p * 1e3),
            format!("{:.2}", p / m.seconds),
        ]);
    }
    println!("{t}");
    println!("parameters: {}", out.display());
    Ok(())
}

/// Options of `wagma simulate validate`.
#[derive(ClapArgs, Debug, Clone, Serialize, Deserialize)]
pub struct ValidateArgs {
    /// Transports.
    #[arg(long, value_delimiter = ',', default_value = "mem,tcp")]
    pub transports: Vec<String>,
    /// Rank counts.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    pub ranks: Vec<usize>,
    /// Algorithms.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "wagma,allreduce-sgd,local-sgd,sgp,d-psgd"
    )]
    pub algos: Vec<String>,
    /// Compute profile.
    #[arg(long, default_value = "paper-resnet")]
    pub profile: Profile,
    /// Scale of the profile's times.
    #[arg(long, default_value_t = 0.5)]
    pub time_scale: f64,
    /// Iterations.
    #[arg(long, default_value_t = 30)]
    pub steps: u64,
    /// Model size in f32 parameters.
    #[arg(long, default_value_t = 1 << 20)]
    pub model_params: usize,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write the comparison (JSON).
    #[arg(long, default_value = "runs/validation.json")]
    pub out: PathBuf,
}

/// One comparison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    /// Transport.
    pub transport: String,
    /// Ranks.
    pub ranks: usize,
    /// Algorithm.
    pub algorithm: String,
    /// Measured samples/s.
    pub measured: f64,
    /// Predicted samples/s.
    pub predicted: f64,
    /// Predicted over measured.
    pub ratio: f64,
}

fn wagma_cmd() -> anyhow::Result<Command> {
    Ok(Command::new(
        std::env::current_exe().context("locating the wagma binary")?,
    ))
}

/// Runs `wagma simulate validate`.
pub fn validate(a: ValidateArgs) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for t in &a.transports {
        if t != "mem" && t != "tcp" {
            bail!("unknown transport {t:?} (mem or tcp)");
        }
        for &p in &a.ranks {
            let cal_path = std::env::temp_dir().join(format!(
                "wagma-calibration-{}-{t}-{p}.json",
                std::process::id()
            ));
            eprintln!("calibrating {t} with {p} ranks ...");
            let st = wagma_cmd()?
                .args([
                    "simulate",
                    "calibrate",
                    "--transport",
                    t,
                    "--ranks",
                    &p.to_string(),
                    "--sizes",
                    "1024,262144,1048576",
                    "--reps",
                    "3",
                    "--out",
                ])
                .arg(&cal_path)
                .stdout(std::process::Stdio::null())
                .status()?;
            if !st.success() {
                bail!("calibration over {t} with {p} ranks failed");
            }
            let cal: Calibration = serde_json::from_slice(&std::fs::read(&cal_path)?)?;
            let _ = std::fs::remove_file(&cal_path);
            eprintln!("measuring {t} with {p} ranks ...");
            let out = wagma_cmd()?
                .args([
                    "bench",
                    "imbalance",
                    "--json",
                    "--transport",
                    t,
                    "--ranks",
                    &p.to_string(),
                    "--algos",
                    &a.algos.join(","),
                ])
                .args([
                    "--profile",
                    &a.profile.to_string(),
                    "--time-scale",
                    &a.time_scale.to_string(),
                ])
                .args([
                    "--steps",
                    &a.steps.to_string(),
                    "--model-params",
                    &a.model_params.to_string(),
                    "--seed",
                    &a.seed.to_string(),
                ])
                .stderr(std::process::Stdio::null())
                .output()?;
            if !out.status.success() {
                bail!("bench imbalance over {t} with {p} ranks failed");
            }
            let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            let measured = report["rows"].as_array().context("no rows")?;
            // The benchmark's own settings (its defaults for what validate does not set).
            let setting = |k: &str| {
                report["args"][k]
                    .as_u64()
                    .with_context(|| format!("the benchmark report has no {k}"))
            };
            let common = crate::simulate::Common {
                model_params: a.model_params,
                profile: a.profile,
                time_scale: a.time_scale,
                trace: None,
                steps: a.steps,
                batch: setting("batch")? as usize,
                tau: setting("tau")?,
                group_size: report["args"]["group_size"].as_u64().map(|g| g as usize),
                eager_sync: None,
                period: None,
                blocking: false,
                peers: setting("peers")? as usize,
                exchange_pieces: 1,
                send_order: SendOrder::Together,
                variants: Default::default(),
                network: None,
                latency: None,
                bandwidth: None,
                seed: a.seed,
            };
            let compute = common.compute()?;
            for (name, row) in a.algos.iter().zip(measured) {
                let spec = common.spec(name, p, cal.network, &compute)?;
                let sim = simulate(&spec)?;
                let m = row["samples_per_s"].as_f64().unwrap_or(f64::NAN);
                rows.push(Comparison {
                    transport: t.clone(),
                    ranks: p,
                    algorithm: sim.algorithm.clone(),
                    measured: m,
                    predicted: sim.samples_per_s,
                    ratio: sim.samples_per_s / m,
                });
            }
        }
    }
    let mut table = Table::new();
    table.set_header(vec![
        "transport",
        "ranks",
        "algorithm",
        "measured samples/s",
        "predicted samples/s",
        "predicted / measured",
    ]);
    for r in &rows {
        table.add_row(vec![
            r.transport.clone(),
            r.ranks.to_string(),
            r.algorithm.clone(),
            format!("{:.1}", r.measured),
            format!("{:.1}", r.predicted),
            format!("{:.3}", r.ratio),
        ]);
    }
    println!("{table}");
    let worst = rows
        .iter()
        .map(|r| (r.ratio - 1.0).abs())
        .fold(0.0, f64::max);
    println!("largest deviation: {:.1}%", 100.0 * worst);
    if let Some(d) = a.out.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(&a.out, serde_json::to_vec_pretty(&rows)?)?;
    println!("comparison: {}", a.out.display());
    Ok(())
}
