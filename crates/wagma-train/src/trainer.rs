//! The training loop: every rank runs the workload's local step on its replica, hands the
//! gradient to its [`Worker`], evaluates the consensus model, writes metrics and checkpoints.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use wagma::algo::{AlgoConfig, OptimizerConfig, Resume, Worker};
use wagma::exec::{JobResult, threaded, virtual_time};
use wagma::transport::tcp::TcpConfig;
use wagma::util::Histogram;
use wagma::{Comm, EngineConfig, Error, Payload, block_on};

use crate::checkpoint::{self, Meta, RankState};
use crate::config::{Execution, TrainConfig};
use crate::error::TrainError;
use crate::flat::{FlatModel, Layout, train_device};
use crate::workloads::Workload;

/// One evaluation: a line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// Iterations done.
    pub iteration: u64,
    /// Seconds since the start, evaluation and checkpoints excluded.
    pub wall_s: f64,
    /// Samples processed by all ranks.
    pub samples: u64,
    /// Metrics of the consensus model (the global average).
    pub consensus: BTreeMap<String, f64>,
    /// Metrics of rank 0's replica.
    pub replica0: Option<BTreeMap<String, f64>>,
    /// Mean squared distance of the replicas to their average.
    pub consensus_distance: f64,
    /// Share of the ranks' time spent waiting so far.
    #[serde(default)]
    pub wait_fraction: f64,
    /// Staleness of the contributions used so far, all ranks (values above 63 are counted
    /// at 63).
    #[serde(default)]
    pub staleness: Histogram,
    /// Ranks taking part (fewer than the job's after a loss in elastic mode).
    #[serde(default)]
    pub ranks_alive: usize,
    /// Training loss since the previous evaluation, mean over ranks and steps.
    #[serde(default)]
    pub train_loss: Option<f64>,
}

/// Staleness buckets carried by a summation over ranks (the last one collects the rest).
const STALENESS_BUCKETS: usize = 64;

/// Waiting, staleness and liveness of the ranks, summed over them.
struct Totals {
    wait_s: f64,
    staleness: Histogram,
    alive: usize,
}

impl Totals {
    /// This rank's part, as numbers to sum over ranks.
    fn local(cs: &wagma::exec::CommStats) -> Vec<f64> {
        let mut v = vec![0.0; 2 + STALENESS_BUCKETS];
        v[0] = cs.wait_s;
        v[1] = 1.0;
        for (k, c) in cs.staleness.iter() {
            v[2 + (k as usize).min(STALENESS_BUCKETS - 1)] += c as f64;
        }
        v
    }

    /// Reads the sums of [`Totals::local`] from the front of `sums`.
    fn read(sums: &[f64]) -> Totals {
        let mut staleness = Histogram::default();
        for (k, &c) in sums[2..2 + STALENESS_BUCKETS].iter().enumerate() {
            staleness.record_n(k as u64, c.round() as u64);
        }
        Totals {
            wait_s: sums[0],
            alive: sums[1].round() as usize,
            staleness,
        }
    }

    /// Share of the living ranks' time spent waiting over `wall_s`.
    fn wait_fraction(&self, wall_s: f64) -> f64 {
        self.wait_s / (wall_s.max(1e-9) * self.alive.max(1) as f64)
    }
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Workload.
    pub workload: String,
    /// Data description.
    pub data: String,
    /// Algorithm, with its options.
    pub algo: AlgoConfig,
    /// Short algorithm label.
    pub label: String,
    /// Local optimizer.
    pub optimizer: OptimizerConfig,
    /// Ranks.
    pub ranks: usize,
    /// Iterations.
    pub steps: u64,
    /// Seed.
    pub seed: u64,
    /// How ranks ran.
    pub execution: Execution,
    /// Injected imbalance.
    pub imbalance: Option<wagma::imbalance::Imbalance>,
    /// Seconds of training (evaluation and checkpoints excluded).
    pub wall_s: f64,
    /// Samples processed by all ranks.
    pub samples: u64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Metrics of the final consensus model.
    pub final_metrics: BTreeMap<String, f64>,
    /// Share of the ranks' time spent waiting for communication.
    pub wait_fraction: f64,
    /// Ranks still training at the end (fewer than `ranks` after a loss in elastic mode).
    #[serde(default)]
    pub ranks_alive: usize,
    /// Staleness of the contributions used, all ranks.
    pub staleness: Histogram,
    /// Trainable parameters.
    pub params: usize,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
}

/// Receives progress from rank 0.
pub trait Observer: Sync {
    /// After each iteration.
    fn step(&self, iteration: u64, samples: u64, train_s: f64);
    /// After each evaluation.
    fn eval(&self, record: &EvalRecord);
}

/// An observer that does nothing.
pub struct Quiet;

impl Observer for Quiet {
    fn step(&self, _: u64, _: u64, _: f64) {}
    fn eval(&self, _: &EvalRecord) {}
}

/// The initial model shared by every rank.
#[derive(Debug, Clone)]
pub struct Initial {
    /// Trainable parameters.
    pub params: Vec<f32>,
    /// Buffers.
    pub buffers: Vec<f32>,
    /// The model's layout.
    pub layout: Layout,
}

/// Builds the initial model once (seeded, on this thread) so that every rank starts from the
/// same values whatever the threads do with burn's global random generator.
pub fn initial_model<W: Workload>(w: &W, seed: u64) -> Initial {
    let device = train_device();
    device.seed(seed);
    let fm = FlatModel::new(w.build(&device));
    Initial {
        params: fm.params(),
        buffers: fm.buffers(),
        layout: fm.layout().clone(),
    }
}

/// One line of a compute trace (`wagma train --trace-compute FILE`): the real seconds a rank's
/// local step took (forward and backward), without injected delays or communication.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ComputeLine {
    /// The rank.
    pub rank: usize,
    /// The iteration.
    pub step: u64,
    /// Seconds.
    pub seconds: f64,
}

/// Appends a rank's trace lines in one write (ranks of one job share the file).
fn append_trace(path: &Path, lines: &[ComputeLine]) -> Result<(), TrainError> {
    let mut text = String::new();
    for l in lines {
        text.push_str(&serde_json::to_string(l).map_err(|e| TrainError::Config(e.to_string()))?);
        text.push('\n');
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| TrainError::io(path, e))?;
    f.write_all(text.as_bytes())
        .map_err(|e| TrainError::io(path, e))
}

/// The consensus model at the end of a run, in the output directory.
pub const FINAL_MODEL: &str = "final-model.bin";

/// Files of the run, written by rank 0.
struct Outputs {
    dir: PathBuf,
    metrics: Mutex<Option<std::fs::File>>,
}

impl Outputs {
    fn metrics_partial(dir: &Path) -> PathBuf {
        dir.join("metrics.jsonl.partial")
    }

    fn create(dir: &Path) -> Result<Outputs, TrainError> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
        let p = Self::metrics_partial(dir);
        let f = std::fs::File::create(&p).map_err(|e| TrainError::io(&p, e))?;
        Ok(Outputs {
            dir: dir.to_path_buf(),
            metrics: Mutex::new(Some(f)),
        })
    }

    fn record(&self, r: &EvalRecord) -> Result<(), TrainError> {
        let mut g = self.metrics.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = g.as_mut() {
            let line = serde_json::to_string(r).map_err(|e| TrainError::Config(e.to_string()))?;
            writeln!(f, "{line}").map_err(|e| TrainError::io(&self.dir, e))?;
            f.flush().map_err(|e| TrainError::io(&self.dir, e))?;
        }
        Ok(())
    }

    /// Writes the consensus model as `final-model.bin` (a checkpoint file of rank 0).
    fn save_model(
        &self,
        iteration: u64,
        (params, buffers): (Payload, Payload),
    ) -> Result<(), TrainError> {
        let state = RankState {
            rank: 0,
            iteration,
            params: params.into_vec(),
            buffers: buffers.into_vec(),
            momentum: Vec::new(),
            weight: None,
            local: serde_json::Value::Null,
        };
        checkpoint::write_model(&self.dir.join(FINAL_MODEL), &state)
    }

    /// Renames the metrics into place and writes the summary (both atomically).
    fn finish(&self, summary: &Summary) -> Result<(), TrainError> {
        self.metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let dst = self.dir.join("metrics.jsonl");
        std::fs::rename(Self::metrics_partial(&self.dir), &dst)
            .map_err(|e| TrainError::io(&dst, e))?;
        let s = self.dir.join("summary.json");
        let tmp = self.dir.join("summary.json.partial");
        let json =
            serde_json::to_vec_pretty(summary).map_err(|e| TrainError::Config(e.to_string()))?;
        std::fs::write(&tmp, json).map_err(|e| TrainError::io(&tmp, e))?;
        std::fs::rename(&tmp, &s).map_err(|e| TrainError::io(&s, e))
    }
}

/// Checks that `dir` can be written, without touching earlier outputs in it.
pub fn check_writable(dir: &Path) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    let probe = dir.join(format!(".wagma-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| TrainError::io(dir, e))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

struct Shared<'a, W: Workload> {
    w: &'a W,
    cfg: &'a TrainConfig,
    init: &'a Initial,
    data: String,
    resume: Option<(PathBuf, Meta)>,
    outputs: Option<Outputs>,
    observer: &'a dyn Observer,
}

/// Joins the MPI job this process was started in; an error when built without MPI support.
#[cfg(feature = "mpi")]
pub fn connect_mpi(
    engine: EngineConfig,
) -> Result<(Comm, std::thread::JoinHandle<()>), TrainError> {
    Ok(threaded::connect_mpi(
        engine,
        wagma::transport::DEFAULT_MAX_FRAME,
    )?)
}

/// Joins the MPI job this process was started in; an error when built without MPI support.
#[cfg(not(feature = "mpi"))]
pub fn connect_mpi(
    _engine: EngineConfig,
) -> Result<(Comm, std::thread::JoinHandle<()>), TrainError> {
    Err(TrainError::Config(
        "this build has no MPI support (build with --features mpi)".into(),
    ))
}

/// What a rank reports at the end.
struct RankEnd {
    summary: Summary,
}

/// Runs the whole training as configured and returns the summary (from rank 0; over TCP, every
/// process returns it, but only rank 0 writes the outputs).
pub fn run<W: Workload>(
    w: &W,
    cfg: &TrainConfig,
    data: String,
    observer: &dyn Observer,
) -> Result<Summary, TrainError> {
    cfg.validate()?;
    crate::device::select(cfg.device)?;
    let init = initial_model(w, cfg.seed);
    let engine = EngineConfig {
        timeout: cfg.timeout,
        // Real processes can die or stall: watch the peers (not needed in virtual time).
        heartbeat: (cfg.execution != Execution::Deterministic)
            .then(|| (cfg.timeout / 4).clamp(Duration::from_millis(200), Duration::from_secs(5))),
        trace: cfg.trace.is_some(),
        elastic: cfg.elastic,
        ..EngineConfig::default()
    };
    // In a multi-process job this process is one rank: join the job first.
    let process = match cfg.execution {
        Execution::Tcp => {
            let mut tcp = TcpConfig::from_env()?;
            tcp.rejoin = cfg.rejoin;
            tcp.accept_rejoins = cfg.elastic;
            Some(threaded::connect_tcp(&tcp, engine)?)
        }
        Execution::Mpi => Some(connect_mpi(engine)?),
        Execution::Threads | Execution::Deterministic => None,
    };
    let ranks = process.as_ref().map_or(cfg.ranks, |(c, _)| c.size());
    if process.is_some() {
        cfg.algo.validate(ranks)?;
    }
    let resume = match &cfg.resume {
        Some(p) => {
            let ckpt = checkpoint::locate(p)?;
            let meta = checkpoint::read_meta(&ckpt)?;
            checkpoint::check_compatible(&meta, w.name(), &init.layout, ranks, &ckpt)?;
            if !cfg.algo.is_clean_point(meta.iteration) {
                return Err(TrainError::checkpoint(
                    &ckpt,
                    "was not taken at a point this algorithm can resume from",
                ));
            }
            Some((ckpt, meta))
        }
        None => None,
    };
    let is_rank0 = process.as_ref().is_none_or(|(c, _)| c.rank() == 0);
    if is_rank0 {
        check_writable(&cfg.out)?;
        if let Some(t) = &cfg.trace_compute {
            // A fresh trace; every rank appends its lines at the end of the run.
            std::fs::write(t, b"").map_err(|e| TrainError::io(t, e))?;
        }
    }
    let shared = Shared {
        w,
        cfg,
        init: &init,
        data,
        resume,
        outputs: if is_rank0 {
            Some(Outputs::create(&cfg.out)?)
        } else {
            None
        },
        observer,
    };
    let task = async |c: &mut Comm| -> Result<RankEnd, Error> {
        run_rank(c, &shared).await.map_err(|e| match e {
            TrainError::Engine(e) => e,
            other => Error::Task {
                rank: c.rank(),
                message: other.to_string(),
            },
        })
    };
    let job: JobResult<RankEnd> = match process {
        None if cfg.execution == Execution::Deterministic => virtual_time::run(
            cfg.ranks,
            engine,
            virtual_time::VirtualConfig::seeded(cfg.seed),
            task,
        )?,
        None => threaded::run(cfg.ranks, engine, task)?,
        Some((mut c, handle)) => {
            let r = block_on(task(&mut c));
            match &r {
                Ok(_) => {
                    block_on(c.finish())?;
                }
                Err(_) => c.abort(),
            }
            let _ = handle.join();
            JobResult {
                first_failure: r.is_err().then_some(0),
                ranks: vec![r],
            }
        }
    };
    let summary = job
        .into_all()?
        .into_iter()
        .next()
        .map(|e| e.summary)
        .ok_or_else(|| TrainError::Config("the job has no rank".into()))?;
    if let Some(o) = &shared.outputs {
        o.finish(&summary)?;
    }
    Ok(summary)
}

async fn run_rank<W: Workload>(comm: &mut Comm, s: &Shared<'_, W>) -> Result<RankEnd, TrainError> {
    let (cfg, w) = (s.cfg, s.w);
    let rank = comm.rank();
    let p = comm.size();
    let device = train_device();
    let mut fm = FlatModel::new(w.build(&device));
    let mut local = w.local(rank, p, cfg.seed);
    let mut alive = p;
    let (mut params, mut buffers, resume, mut samples, train_s) = match &s.resume {
        None if cfg.rejoin => {
            let start = rejoin(comm, s.init, cfg.timeout).await?;
            alive = start.alive;
            (
                start.params,
                start.buffers,
                start.resume,
                start.samples,
                start.train_s,
            )
        }
        Some((ckpt, meta)) => {
            let st = checkpoint::read_rank(ckpt, rank)?;
            if st.params.len() != s.init.params.len() || st.buffers.len() != s.init.buffers.len() {
                return Err(TrainError::checkpoint(
                    ckpt,
                    format!("rank {rank}'s state does not fit this model"),
                ));
            }
            w.load_local(&mut local, &st.local)
                .map_err(|m| TrainError::checkpoint(ckpt, format!("rank {rank}: {m}")))?;
            let resume = Resume {
                iteration: st.iteration,
                optimizer_state: st.momentum,
                weight: st.weight,
            };
            (st.params, st.buffers, resume, meta.samples, meta.train_s)
        }
        None => (
            s.init.params.clone(),
            s.init.buffers.clone(),
            Resume::default(),
            0,
            0.0,
        ),
    };
    let layout = s.init.layout.fingerprint();
    // (A joiner gets the consensus state in its welcome: the others are already training.)
    if !cfg.rejoin {
        if s.resume.is_some() {
            // Every rank resumes its own replica: they must at least agree on the model.
            comm.check_layout(&layout).await?;
        } else {
            // Every rank starts from rank 0's model, whatever it built itself.
            comm.share_model(&layout, &mut params, &mut buffers).await?;
        }
    }
    let has_buffers = !buffers.is_empty();
    let opt = cfg.optimizer_or_default();
    let start_iter = resume.iteration;
    let mut worker = Worker::resume(
        comm,
        cfg.algo.clone(),
        opt.clone(),
        Payload::Data(params),
        Payload::Data(buffers),
        resume,
    )
    .await?;
    if cfg.rejoin {
        // The living ranks wait here for the joiners they admitted.
        worker.comm().barrier().await?;
    } else if start_iter > 0 {
        // The uninterrupted run quiesced here to checkpoint; so does the resumed one.
        worker.quiesce().await?;
    }
    let mut excluded = 0.0f64;
    let t0 = worker.comm().now();
    let clock = |c: &Comm, excluded: f64| train_s + (c.now() - t0).as_secs_f64() - excluded;
    let mut last_ckpt = None;
    let mut last_metrics = BTreeMap::new();
    let ckpt_every = cfg.checkpoint_every;
    let mut next_ckpt = ckpt_every.map(|k| start_iter + k);
    let mut steps_done = start_iter;
    // Ranks still training (fewer after a loss in elastic mode; learnt at evaluations and
    // admissions).
    let mut trace: Vec<ComputeLine> = Vec::new();
    let mut losses = LossSum::default();
    for t in start_iter..cfg.steps {
        if let Some(im) = &cfg.imbalance {
            let d = im.step_times(t, p).get(rank).copied().unwrap_or(0.0);
            worker.comm().compute(Duration::from_secs_f64(d)).await;
        }
        fm.set_params(worker.params());
        if has_buffers {
            fm.set_buffers(worker.buffers());
        }
        let local_t0 = std::time::Instant::now();
        let step_start = worker.comm().now();
        let (loss, n) = w.loss(fm.model(), &mut local, t);
        if let Some(l) = loss.clone().into_data().iter::<f32>().next() {
            losses.add(l);
        }
        let grads = fm.backward(loss);
        if worker.comm().tracing() {
            let end = worker.comm().now().max(step_start + local_t0.elapsed());
            worker
                .comm()
                .trace_span("compute", format!("local step {t}"), step_start, end);
        }
        if cfg.trace_compute.is_some() {
            trace.push(ComputeLine {
                rank,
                step: t,
                seconds: local_t0.elapsed().as_secs_f64(),
            });
        }
        if has_buffers {
            let b = fm.buffers();
            worker.buffers_mut().copy_from_slice(&b);
        }
        worker.step(&grads).await?;
        // Every living rank processed a batch of the same size.
        samples += (n * alive) as u64;
        let done = t + 1;
        if rank == 0 {
            s.observer
                .step(done, samples, clock(worker.comm(), excluded));
        }
        let mut out_of_budget = false;
        if done % cfg.eval_every == 0 || done == cfg.steps {
            let e0 = worker.comm().now();
            let now = clock(worker.comm(), excluded);
            let ev = evaluate(&mut worker, &mut fm, s, done, samples, now, &mut losses).await?;
            excluded += (worker.comm().now() - e0).as_secs_f64();
            out_of_budget = ev.out_of_budget;
            alive = ev.record.ranks_alive;
            if rank == 0 {
                if let Some(o) = &s.outputs {
                    o.record(&ev.record)?;
                    if done == cfg.steps || out_of_budget {
                        o.save_model(done, ev.consensus)?;
                    }
                }
                s.observer.eval(&ev.record);
            }
            last_metrics = ev.record.consensus;
        }
        steps_done = done;
        if out_of_budget {
            break;
        }
        if cfg.elastic && cfg.algo.is_clean_point(done) && done < cfg.steps {
            let now = clock(worker.comm(), excluded);
            if let Some(n) = admit_joiners(&mut worker, done, samples, now).await? {
                alive = n;
            }
        }
        if next_ckpt.is_some_and(|k| done >= k) && cfg.algo.is_clean_point(done) && done < cfg.steps
        {
            let e0 = worker.comm().now();
            let now = clock(worker.comm(), excluded);
            last_ckpt = Some(write_checkpoint(&mut worker, s, &local, done, samples, now).await?);
            let e1 = worker.comm().now();
            worker
                .comm()
                .trace_span("checkpoint", format!("checkpoint at {done}"), e0, e1);
            excluded += (e1 - e0).as_secs_f64();
            next_ckpt = ckpt_every.map(|k| done + k);
        }
    }
    let wall = clock(worker.comm(), excluded);
    if let Some(path) = &cfg.trace_compute {
        append_trace(path, &trace)?;
    }
    if let Some(path) = &cfg.trace {
        let events = worker.comm().take_trace().await?;
        let file = wagma::trace::rank_path(path, rank);
        wagma::trace::write(&file, rank, events).map_err(|e| TrainError::io(&file, e))?;
    }
    let local = Totals::local(worker.comm().stats());
    let totals = Totals::read(&sum_over_ranks(&mut worker, &local).await?);
    let summary = Summary {
        workload: w.name().into(),
        data: s.data.clone(),
        label: cfg.algo.algorithm.label(),
        algo: cfg.algo.clone(),
        optimizer: opt,
        ranks: p,
        steps: steps_done,
        seed: cfg.seed,
        execution: cfg.execution,
        imbalance: cfg.imbalance,
        wall_s: wall,
        samples,
        samples_per_s: samples as f64 / wall.max(1e-9),
        final_metrics: last_metrics,
        wait_fraction: totals.wait_fraction(wall),
        ranks_alive: totals.alive,
        staleness: totals.staleness,
        params: s.init.params.len(),
        checkpoint: last_ckpt,
    };
    Ok(RankEnd { summary })
}

/// Where a rejoining rank starts.
struct Rejoined {
    params: Vec<f32>,
    buffers: Vec<f32>,
    resume: Resume,
    samples: u64,
    train_s: f64,
    alive: usize,
}

/// A restarted rank: announces itself and waits (at most ten collective timeouts) to be
/// admitted at the job's next global average, receiving the consensus state.
async fn rejoin(
    comm: &mut Comm,
    init: &Initial,
    timeout: Duration,
) -> Result<Rejoined, TrainError> {
    comm.announce_rejoin().await?;
    tracing::info!(
        rank = comm.rank(),
        "asked to rejoin; waiting for the next global average"
    );
    let (state, info) = comm.await_welcome(timeout.saturating_mul(10)).await?;
    let (np, nb) = (init.params.len(), init.buffers.len());
    let state = state.into_vec();
    let &[iteration, samples, train_s, alive] = info.as_slice() else {
        return Err(TrainError::Config(format!(
            "the welcome carries {} values instead of 4",
            info.len()
        )));
    };
    if state.len() < np + nb {
        return Err(TrainError::Config(format!(
            "the welcome carries {} values for a model of {}",
            state.len(),
            np + nb
        )));
    }
    tracing::info!(rank = comm.rank(), iteration, "rejoined the job");
    Ok(Rejoined {
        params: state[..np].to_vec(),
        buffers: state[np..np + nb].to_vec(),
        resume: Resume {
            iteration,
            optimizer_state: state[np + nb..].to_vec(),
            weight: None,
        },
        samples,
        train_s: f64::from_bits(train_s),
        alive: usize::try_from(alive).unwrap_or(usize::MAX),
    })
}

/// Living ranks at a global average (elastic mode): agree on the restarted ranks to admit,
/// admit them, and have the lowest living rank send each its starting state; returns the
/// number of ranks training from now on when some were admitted.
async fn admit_joiners(
    worker: &mut Worker<'_>,
    done: u64,
    samples: u64,
    train_s: f64,
) -> Result<Option<usize>, TrainError> {
    let comm = worker.comm();
    let p = comm.size();
    let mut asked = vec![0.0f32; p];
    for r in comm.joining_ranks().await? {
        asked[r] = 1.0;
    }
    // Every living rank must admit the same ranks: those that any of them heard from.
    let asked = comm.allreduce(Payload::Data(asked)).await?;
    let joiners: Vec<usize> = (0..p).filter(|&r| asked.as_slice()[r] > 0.0).collect();
    if joiners.is_empty() {
        return Ok(None);
    }
    let living = comm.living_ranks().await?;
    let leader = living.first().copied();
    let alive = living.len() + joiners.len();
    comm.admit(&joiners).await?;
    if leader == Some(comm.rank()) {
        let mut state = worker.params().to_vec();
        state.extend_from_slice(worker.buffers());
        state.extend_from_slice(worker.optimizer_state());
        let info = [done, samples, train_s.to_bits(), alive as u64];
        for &r in &joiners {
            let data = Payload::Data(state.clone());
            worker.comm().welcome(r, data, &info).await?;
        }
    }
    // A barrier, not `quiesce`: a joiner's clock started later than the others', so aligning
    // clocks would stall it (and WAGMA has nothing in flight at a global average).
    worker.comm().barrier().await?;
    tracing::info!(
        rank = worker.comm().rank(),
        ?joiners,
        iteration = done,
        "admitted"
    );
    Ok(Some(alive))
}

/// This rank's training losses since the last evaluation.
#[derive(Default)]
struct LossSum {
    sum: f64,
    steps: u64,
}

impl LossSum {
    fn add(&mut self, loss: f32) {
        self.sum += f64::from(loss);
        self.steps += 1;
    }
}

async fn evaluate<W: Workload>(
    worker: &mut Worker<'_>,
    fm: &mut FlatModel<W::Model>,
    s: &Shared<'_, W>,
    iteration: u64,
    samples: u64,
    wall_s: f64,
    losses: &mut LossSum,
) -> Result<Evaluation, TrainError> {
    let rank = worker.comm().rank();
    let distance = worker.consensus_distance().await?;
    let (cp, cb) = worker.consensus().await?;
    // The held-out set is split among the living ranks (all of them unless some were lost).
    let living = worker.comm().living_ranks().await?;
    let shard = living.iter().position(|&r| r == rank).unwrap_or(0);
    let mut stats = eval_with(fm, s.w, cp.as_slice(), cb.as_slice(), shard, living.len());
    let k = stats.len();
    if s.cfg.eval_replica {
        // Rank 0's replica, sent to everyone (the others contribute zeros).
        let n = worker.params().len();
        let nb = worker.buffers().len();
        let mut mine = vec![0f32; n + nb];
        if rank == 0 {
            mine[..n].copy_from_slice(worker.params());
            mine[n..].copy_from_slice(worker.buffers());
        }
        let r0 = worker
            .comm()
            .allreduce(Payload::Data(mine))
            .await?
            .into_vec();
        stats.extend(eval_with(fm, s.w, &r0[..n], &r0[n..], shard, living.len()));
    }
    // Waiting, staleness and liveness so far, summed over ranks.
    let m = stats.len();
    stats.extend(Totals::local(worker.comm().stats()));
    let t = stats.len();
    stats.extend([losses.sum, losses.steps as f64]);
    *losses = LossSum::default();
    // Rank 0's training clock rides along: every rank learns whether the budget is spent.
    stats.push(if rank == 0 { wall_s } else { 0.0 });
    let sums = sum_over_ranks(worker, &stats).await?;
    let train_loss = (sums[t + 1] > 0.0).then(|| sums[t] / sums[t + 1]);
    let named = |xs: &[f64]| -> BTreeMap<String, f64> {
        s.w.metrics(xs)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    };
    let clock0 = sums.last().copied().unwrap_or(0.0);
    let totals = Totals::read(&sums[m..t]);
    let record = EvalRecord {
        iteration,
        wall_s,
        samples,
        consensus: named(&sums[..k]),
        replica0: s.cfg.eval_replica.then(|| named(&sums[k..m])),
        consensus_distance: distance,
        wait_fraction: totals.wait_fraction(wall_s),
        staleness: totals.staleness,
        ranks_alive: totals.alive,
        train_loss,
    };
    Ok(Evaluation {
        record,
        consensus: (cp, cb),
        out_of_budget: s.cfg.budget.is_some_and(|b| clock0 >= b),
    })
}

/// Sums `xs` over the ranks (in `f32`, as the engine reduces).
async fn sum_over_ranks(worker: &mut Worker<'_>, xs: &[f64]) -> Result<Vec<f64>, TrainError> {
    let f: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
    let sums = worker.comm().allreduce(Payload::Data(f)).await?;
    Ok(sums.into_vec().into_iter().map(f64::from).collect())
}

/// An evaluation and what it implies.
struct Evaluation {
    record: EvalRecord,
    consensus: (Payload, Payload),
    /// Rank 0's training time has reached the budget: every rank stops here.
    out_of_budget: bool,
}

fn eval_with<W: Workload>(
    fm: &mut FlatModel<W::Model>,
    w: &W,
    params: &[f32],
    buffers: &[f32],
    rank: usize,
    p: usize,
) -> Vec<f64> {
    fm.set_params(params);
    if !buffers.is_empty() {
        fm.set_buffers(buffers);
    }
    w.evaluate(&fm.eval_model(), rank, p)
}

async fn write_checkpoint<W: Workload>(
    worker: &mut Worker<'_>,
    s: &Shared<'_, W>,
    local: &W::Local,
    iteration: u64,
    samples: u64,
    train_s: f64,
) -> Result<PathBuf, TrainError> {
    worker.quiesce().await?;
    let rank = worker.comm().rank();
    let dir = &s.cfg.out.join("checkpoints");
    let state = RankState {
        rank,
        iteration,
        params: worker.params().to_vec(),
        buffers: worker.buffers().to_vec(),
        momentum: worker.optimizer_state().to_vec(),
        weight: worker.weight(),
        local: s.w.save_local(local),
    };
    let mine = checkpoint::write_rank(dir, &state);
    let failed = worker
        .comm()
        .allreduce(Payload::Data(vec![f32::from(u8::from(mine.is_err()))]))
        .await?
        .into_vec();
    let any_failed = failed.first().is_some_and(|&x| x > 0.0);
    let mut committed = Ok(dir.clone());
    if rank == 0 {
        if any_failed {
            checkpoint::abandon(dir, iteration);
        } else {
            let meta = Meta {
                format: checkpoint::FORMAT_VERSION,
                workload: s.w.name().into(),
                layout: s.init.layout.clone(),
                algorithm: s.cfg.algo.algorithm.label(),
                ranks: worker.comm().size(),
                iteration,
                seed: s.cfg.seed,
                samples,
                train_s,
            };
            committed = checkpoint::commit(dir, &meta, 2);
        }
    }
    let ok = worker
        .comm()
        .allreduce(Payload::Data(vec![f32::from(u8::from(committed.is_err()))]))
        .await?
        .into_vec();
    mine?;
    // Leave exactly as a resumed run starts: from a double barrier (see `run_rank`).
    worker.quiesce().await?;
    if any_failed {
        return Err(TrainError::checkpoint(
            dir,
            format!(
                "another rank failed to write its part at iteration {iteration}; the previous checkpoint is kept"
            ),
        ));
    }
    if ok.first().is_some_and(|&x| x > 0.0) {
        return Err(committed.err().unwrap_or_else(|| {
            TrainError::checkpoint(dir, "rank 0 could not complete the checkpoint")
        }));
    }
    committed
}
