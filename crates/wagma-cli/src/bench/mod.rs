//! `wagma bench ...`: benchmarks that compare side by side in one run and report ratios.

mod collectives;
mod imbalance;
mod paper;
mod wrapper;

use std::io::{BufRead, BufReader};

use anyhow::Context;
use clap::{Subcommand, ValueEnum};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use wagma::algo::{AlgoConfig, Algorithm, WagmaOptions};
use wagma::exec::threaded;
use wagma::transport::tcp::TcpConfig;
use wagma::{Comm, EngineConfig, block_on};

use crate::local::LocalJob;

/// Set in the processes a multi-process benchmark starts (they report to it).
pub const WORKER: &str = "WAGMA_BENCH_WORKER";
/// Prefix of the result line rank 0 of a TCP benchmark prints.
pub const RESULT: &str = "WAGMA-BENCH-RESULT ";

/// Where the ranks of a benchmark run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Threads of this process.
    Mem,
    /// Processes on loopback, started by this command.
    Tcp,
    /// MPI processes (started with mpirun by this command unless already under MPI; needs a
    /// wagma built with `--features mpi`).
    Mpi,
}

impl TransportKind {
    /// A name for reports.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Mem => "mem",
            TransportKind::Tcp => "tcp",
            TransportKind::Mpi => "mpi",
        }
    }
}

/// Benchmarks.
#[derive(Subcommand)]
pub enum Bench {
    /// Collectives (global and group allreduce, wait-avoiding round, neighbour exchange) next
    /// to a memcpy of the same buffer.
    Collectives(collectives::Args),
    /// Every algorithm on the same emulated compute-time draws, with real communication:
    /// throughput, waiting, staleness, next to the ideal and each algorithm's own bound.
    Imbalance(imbalance::Args),
    /// The paper's comparison at small scale: every algorithm (and optionally WAGMA's
    /// ablations) trains a workload; time to a target metric, curves, plots and a report.
    Paper(Box<paper::Args>),
    /// The per-step cost of training a burn model through `DistributedOptimizer` against the
    /// same model and optimizer in a plain burn loop, at P = 1.
    Wrapper(wrapper::Args),
}

/// Runs a benchmark.
pub fn run(b: Bench) -> anyhow::Result<()> {
    match b {
        Bench::Collectives(a) => collectives::run(a),
        Bench::Imbalance(a) => imbalance::run(a),
        Bench::Paper(a) => paper::run(*a),
        Bench::Wrapper(a) => wrapper::run(a),
    }
}

/// True in a process started by [`run_tcp_workers`] or [`crate::mpirun::run_and_collect`].
fn is_worker() -> bool {
    std::env::var_os(WORKER).is_some()
}

/// True when a launcher (`wagma launch`, this command's own worker start, a script, srun,
/// torchrun, mpirun) started this process as one rank of a job: it must join that job rather
/// than start its own ranks. Conflicting launcher variables are an error.
fn started_as_rank() -> anyhow::Result<bool> {
    Ok(wagma::transport::discover::discover_env()?.is_some())
}

/// The algorithm `name` as the throughput benchmarks and the simulator run it: WAGMA with
/// group size `group_size` (`None`: the default) and period `tau`, SGP with `peers` peers,
/// every other algorithm with its defaults; checked against `ranks`.
pub fn algo_config(
    name: &str,
    ranks: usize,
    group_size: Option<usize>,
    tau: u64,
    peers: usize,
    seed: u64,
) -> anyhow::Result<AlgoConfig> {
    let mut a = Algorithm::from_name(name.trim())?;
    match &mut a {
        Algorithm::Wagma(o) => {
            *o = WagmaOptions {
                group_size,
                tau: Some(tau),
                ..WagmaOptions::default()
            }
        }
        Algorithm::Sgp { peers: n, .. } => *n = peers,
        _ => {}
    }
    a.validate(ranks)?;
    let mut c = AlgoConfig::new(a);
    c.seed = seed;
    Ok(c)
}

/// Engine settings of the benchmarks: a generous timeout, for slow shared machines.
pub fn engine_config() -> EngineConfig {
    EngineConfig {
        timeout: std::time::Duration::from_secs(600),
        ..EngineConfig::default()
    }
}

/// Every rank's `x`, in rank order, exactly (every rank must call it).
async fn every_rank(c: &mut Comm, x: f64) -> Result<Vec<f64>, wagma::Error> {
    let all = c.gather_u64(&[x.to_bits()]).await?;
    Ok(all.iter().flatten().map(|&b| f64::from_bits(b)).collect())
}

/// The slowest rank's `dt` (every rank must call it).
pub async fn slowest(c: &mut Comm, dt: f64) -> Result<f64, wagma::Error> {
    Ok(every_rank(c, dt).await?.into_iter().fold(0.0, f64::max))
}

/// The sum of every rank's `x` (every rank must call it).
pub async fn total(c: &mut Comm, x: f64) -> Result<f64, wagma::Error> {
    Ok(every_rank(c, x).await?.into_iter().sum())
}

/// CPU time used so far, in seconds: by this process, or by the calling thread alone.
pub fn cpu_seconds(thread_only: bool) -> f64 {
    let clock = if thread_only {
        libc::CLOCK_THREAD_CPUTIME_ID
    } else {
        libc::CLOCK_PROCESS_CPUTIME_ID
    };
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given.
    if unsafe { libc::clock_gettime(clock, &mut t) } != 0 {
        return f64::NAN;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Runs `task` on `ranks` ranks over `transport` and returns rank 0's result.
///
/// Over TCP and MPI this command re-runs itself as the ranks (local processes, or `mpirun`);
/// in such a rank process it runs one rank, rank 0 prints the result for the parent, and it
/// returns `None`. In a job the user started (`wagma launch`, `mpirun`, `srun`, a script
/// setting the rendezvous variables), rank 0 gets the result (to report it) and the other
/// ranks `None`.
pub fn run_job<T, F>(
    transport: TransportKind,
    ranks: usize,
    cfg: EngineConfig,
    task: F,
) -> anyhow::Result<Option<T>>
where
    T: Serialize + DeserializeOwned + Send + 'static,
    F: AsyncFn(&mut Comm) -> Result<T, wagma::Error> + Sync,
{
    match transport {
        TransportKind::Mem => Ok(Some(
            threaded::run(ranks, cfg, task)?.into_all()?.swap_remove(0),
        )),
        TransportKind::Tcp if started_as_rank()? => {
            let tcp = TcpConfig::from_env()?;
            let (c, engine) = threaded::connect_tcp(&tcp, cfg)?;
            run_rank(c, engine, ranks, task)
        }
        TransportKind::Tcp => Ok(Some(run_tcp_workers(ranks)?)),
        TransportKind::Mpi if crate::mpirun::under_mpi() => {
            let (c, engine) = wagma_train::trainer::connect_mpi(cfg)?;
            run_rank(c, engine, ranks, task)
        }
        TransportKind::Mpi => Ok(Some(crate::mpirun::run_and_collect(ranks)?)),
    }
}

/// One rank of a multi-process job: runs `task`; rank 0 prints the result for the process that
/// started the job, or returns it when the user started the job.
fn run_rank<T: Serialize>(
    mut c: Comm,
    engine: std::thread::JoinHandle<()>,
    ranks: usize,
    task: impl AsyncFnOnce(&mut Comm) -> Result<T, wagma::Error>,
) -> anyhow::Result<Option<T>> {
    if c.size() != ranks {
        anyhow::bail!(
            "the job has {} ranks but --ranks says {ranks}; pass --ranks {}",
            c.size(),
            c.size()
        );
    }
    let rank = c.rank();
    let out = block_on(task(&mut c))?;
    block_on(c.finish())?;
    let _ = engine.join();
    if rank != 0 {
        return Ok(None);
    }
    if !is_worker() {
        return Ok(Some(out));
    }
    println!("{RESULT}{}", serde_json::to_string(&out)?);
    Ok(None)
}

/// Runs this very command as `ranks` local processes over TCP and returns what rank 0 reports.
fn run_tcp_workers<T: DeserializeOwned + Send + 'static>(ranks: usize) -> anyhow::Result<T> {
    let exe = std::env::current_exe().context("locating the wagma binary")?;
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let binding = crate::local::Binding::from_env()?;
    let mut job = LocalJob::spawn(ranks, &exe, &argv, &[(WORKER, "1".into())], true, binding)?;
    let out = job.children_mut()[0]
        .stdout
        .take()
        .context("rank 0 has no stdout")?;
    let reader = std::thread::spawn(move || read_result(out));
    job.wait(None)?;
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("reading rank 0's output failed"))?
}

/// The result rank 0 of a job this command started prints on `out` (its standard output).
pub fn read_result<T: DeserializeOwned>(out: impl std::io::Read) -> anyhow::Result<T> {
    let line = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix(RESULT).map(str::to_string))
        .context("rank 0 printed no result")?;
    Ok(serde_json::from_str(&line)?)
}

/// Median of `xs` (sorted in place).
pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}
