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
use crate::elastic::{admit_joiners, rejoin};
use crate::error::TrainError;
pub use crate::evaluation::EvalRecord;
use crate::evaluation::{
    Evaluation, LossSum, Snapshot, Totals, evaluate_in_process, evaluate_snapshots, latest_in,
    secs_to_ns, sum_over_ranks,
};
use crate::flat::{FlatModel, Layout, train_device};
use crate::offload::Pool;
use crate::outputs::Outputs;
pub use crate::outputs::{FINAL_MODEL, PROGRESS, ProgressLine, check_writable};
use crate::workloads::Workload;
use wagma_sim::compute::{Compute, Trace, TraceLine};
use wagma_sim::{LogGp, LogGpNetwork};

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
    /// Real seconds the whole run took on this machine (training and evaluation; in virtual
    /// time, what the simulation cost).
    #[serde(default)]
    pub real_s: f64,
    /// In virtual time: the no-wait ideal, the slowest rank's own compute time over the steps
    /// run (no algorithm can take less; `wall_s` below it would be a measurement bug).
    #[serde(default)]
    pub ideal_s: Option<f64>,
}

/// Receives progress from rank 0.
pub trait Observer: Sync {
    /// After each iteration.
    fn step(&self, iteration: u64, samples: u64, train_s: f64);
    /// For each evaluation, after training (metrics come from snapshots).
    fn eval(&self, record: &EvalRecord);
    /// When rank 0 passes an evaluation iteration during training.
    fn progress(&self, _line: &ProgressLine) {}
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

/// Held while a model is built: burn's random generator is global to the process, so another
/// build between seeding and building would change the initial model.
static BUILDING: Mutex<()> = Mutex::new(());

/// A model of the workload's architecture (its values are overwritten; see [`BUILDING`]).
pub(crate) fn build_flat<W: Workload>(w: &W) -> FlatModel<W::Model> {
    let _only = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    FlatModel::new(w.build(&train_device()))
}

/// Builds the initial model once (seeded, on this thread) so that every rank starts from the
/// same values whatever the threads do with burn's global random generator.
pub fn initial_model<W: Workload>(w: &W, seed: u64) -> Initial {
    let device = train_device();
    let fm = {
        let _only = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
        device.seed(seed);
        FlatModel::new(w.build(&device))
    };
    Initial {
        params: fm.params(),
        buffers: fm.buffers(),
        layout: fm.layout().clone(),
    }
}

/// Appends a rank's trace lines in one write (ranks of one job share the file).
fn append_trace(path: &Path, lines: &[TraceLine]) -> Result<(), TrainError> {
    let mut text = String::new();
    for l in lines {
        text.push_str(&serde_json::to_string(l).map_err(|e| TrainError::Internal(e.to_string()))?);
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

/// What every rank of a job reads.
pub(crate) struct Shared<'a, W: Workload> {
    pub(crate) w: &'a W,
    pub(crate) cfg: &'a TrainConfig,
    pub(crate) init: &'a Initial,
    /// Compute seconds per step: injected delays, or in virtual time the compute itself.
    compute: Option<ComputeTimes>,
    data: String,
    resume: Option<(PathBuf, Meta)>,
    outputs: Option<Outputs>,
    observer: &'a dyn Observer,
}

impl<W: Workload> Shared<'_, W> {
    /// The training time a resumed run carries from before its resume (0 for a fresh run).
    pub(crate) fn resumed_s(&self) -> f64 {
        self.resume.as_ref().map_or(0.0, |(_, m)| m.train_s)
    }
}

/// Compute times drawn once per step for all ranks (a draw costs O(P)), kept for the ranks
/// that get there later.
struct ComputeTimes {
    model: Compute,
    rows: Mutex<BTreeMap<u64, std::sync::Arc<Vec<f64>>>>,
}

impl ComputeTimes {
    /// Seconds of `rank` (of `ranks`) at `step`.
    fn of(&self, step: u64, rank: usize, ranks: usize) -> f64 {
        let row = {
            let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
            rows.entry(step)
                .or_insert_with(|| std::sync::Arc::new(self.model.step_times(step, ranks)))
                .clone()
        };
        row.get(rank).copied().unwrap_or(0.0)
    }

    /// The largest sum over steps `from..to` of one rank's times (of `ranks`).
    fn ideal(&self, from: u64, to: u64, ranks: usize) -> f64 {
        // As the ranks wait them: whole nanoseconds per step.
        let mut sums = vec![Duration::ZERO; ranks];
        for t in from..to {
            for (s, d) in sums.iter_mut().zip(self.model.step_times(t, ranks)) {
                *s += Duration::from_secs_f64(d);
            }
        }
        sums.into_iter().max().unwrap_or_default().as_secs_f64()
    }
}

/// The compute time of every rank at every step: in virtual time from the trace or the profile
/// (nothing: no compute time at all), otherwise the injected delays of the profile.
fn compute_times(cfg: &TrainConfig) -> Result<Option<ComputeTimes>, TrainError> {
    let model = match (&cfg.compute_trace, &cfg.imbalance) {
        (Some(path), _) if cfg.execution == Execution::Virtual => {
            Compute::Trace(Trace::load(path).map_err(|e| match e {
                wagma_sim::SimError::File { message, .. } => TrainError::data(path, message),
                other => TrainError::data(path, other.to_string()),
            })?)
        }
        (Some(_), _) => {
            return Err(TrainError::Config(
                "a compute trace is replayed in virtual time only".into(),
            ));
        }
        (None, Some(im)) => Compute::Profile(*im),
        (None, None) => return Ok(None),
    };
    Ok(Some(ComputeTimes {
        model,
        rows: Mutex::default(),
    }))
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
    /// Its snapshots, for evaluation after the job (in-process runs).
    snapshots: Vec<Snapshot>,
    /// The evaluated points (multi-process runs evaluate before the processes part).
    evaluated: Option<Vec<Evaluation>>,
    /// [`Totals::local`] at the end (summed over ranks when `evaluated` is set).
    totals: Vec<f64>,
    steps_done: u64,
    samples: u64,
    last_ckpt: Option<PathBuf>,
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
    let real_t0 = std::time::Instant::now();
    let engine = EngineConfig {
        timeout: if cfg.execution == Execution::Virtual {
            wagma::exec::virtual_time::TIMEOUT_OFF
        } else {
            cfg.timeout
        },
        // Real processes can die or stall: watch the peers (not needed in virtual time).
        heartbeat: (cfg.execution != Execution::Virtual)
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
            tcp.accept_rejoins = cfg.admits_rejoins();
            tcp.allow_empty_secret |= cfg.allow_empty_secret;
            // A write blocked longer than the job's timeout would silence this rank's
            // heartbeats past the point where its peers give up on it.
            if std::env::var_os(wagma::transport::tcp::env::IO_TIMEOUT).is_none() {
                tcp.io_timeout = cfg.timeout;
            }
            Some(threaded::connect_tcp(&tcp, engine)?)
        }
        Execution::Mpi => Some(connect_mpi(engine)?),
        Execution::Threads | Execution::Virtual => None,
    };
    let ranks = process.as_ref().map_or(cfg.ranks, |(c, _)| c.size());
    if process.is_some() {
        cfg.algo.validate(ranks)?;
    }
    if let Some(n) = w.train_samples().filter(|&n| n < ranks) {
        // A rank with an empty shard would train on empty batches.
        return Err(TrainError::Config(format!(
            "{ranks} ranks but {n} training samples: each rank trains on a shard of its own, so \
             this data allows at most {n} ranks"
        )));
    }
    let resume = match &cfg.resume {
        Some(p) => {
            let ckpt = checkpoint::locate(p)?;
            let meta = checkpoint::read_meta(&ckpt)?;
            let run = checkpoint::Identity {
                workload: w.name(),
                layout: &init.layout,
                config: &cfg.algo,
                ranks,
                seed: cfg.seed,
            };
            checkpoint::check_compatible(&meta, &run, &ckpt)?;
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
    let compute = compute_times(cfg)?;
    let shared = Shared {
        w,
        cfg,
        init: &init,
        compute,
        data,
        resume,
        outputs: if is_rank0 {
            Some(Outputs::create(&cfg.out)?)
        } else {
            None
        },
        observer,
    };
    let job: JobResult<RankEnd> = std::thread::scope(|scope| -> Result<_, TrainError> {
        // Virtual-time ranks compute their steps on every core (see `offload`).
        let pool = (cfg.execution == Execution::Virtual).then(|| {
            Pool::new(
                scope,
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )
        });
        let task = async |c: &mut Comm| -> Result<RankEnd, Error> {
            run_rank(c, &shared, pool.as_ref())
                .await
                .map_err(|e| match e {
                    TrainError::Engine(e) => e,
                    other => Error::Task {
                        rank: c.rank(),
                        message: other.to_string(),
                    },
                })
        };
        Ok(match process {
            None if cfg.execution == Execution::Virtual => virtual_time::run(
                cfg.ranks,
                engine,
                virtual_time::VirtualConfig {
                    seed: cfg.seed,
                    network: Box::new(LogGpNetwork::new(
                        cfg.network.unwrap_or_else(LogGp::aries),
                        cfg.ranks,
                    )),
                },
                task,
            )?,
            None => threaded::run(cfg.ranks, engine, task)?,
            Some((mut c, handle)) => {
                let r = block_on(task(&mut c));
                let finished = match &r {
                    Ok(_) => block_on(c.finish()).map(drop),
                    Err(_) => {
                        c.abort();
                        Ok(())
                    }
                };
                // The engine thread writes the farewells (an abort names its culprit) before
                // it ends: wait for it before this process can exit.
                let _ = handle.join();
                finished?;
                JobResult {
                    first_failure: r.is_err().then_some(0),
                    ranks: vec![r],
                }
            }
        })
    })?;
    let mut ends = job.into_all()?;
    let points = match ends.first_mut().and_then(|e| e.evaluated.take()) {
        Some(points) => points,
        None => evaluate_in_process(
            &shared,
            ends.iter_mut()
                .map(|e| std::mem::take(&mut e.snapshots))
                .collect(),
        )?,
    };
    let mut totals = vec![0.0; ends.first().map_or(0, |e| e.totals.len())];
    for e in &ends {
        for (t, x) in totals.iter_mut().zip(&e.totals) {
            *t += x;
        }
    }
    let end = ends
        .first()
        .ok_or_else(|| TrainError::Config("the job has no rank".into()))?;
    let totals = Totals::read(&totals);
    if let Some(o) = &shared.outputs {
        for (j, e) in points.iter().enumerate() {
            o.record(&e.record)?;
            if j + 1 == points.len() {
                let (cp, cb) = e.consensus.clone();
                o.save_model(e.record.iteration, (Payload::Data(cp), Payload::Data(cb)))?;
            }
            observer.eval(&e.record);
        }
    }
    let resumed_s = shared.resumed_s();
    let wall = points.last().map_or(resumed_s, |e| e.record.wall_s);
    let summary = Summary {
        workload: w.name().into(),
        data: shared.data.clone(),
        label: cfg.algo.label(),
        algo: cfg.algo.clone(),
        optimizer: cfg.optimizer_or_default(),
        ranks,
        steps: end.steps_done,
        seed: cfg.seed,
        execution: cfg.execution,
        imbalance: cfg.imbalance,
        wall_s: wall,
        samples: end.samples,
        samples_per_s: end.samples as f64 / wall.max(1e-9),
        final_metrics: points
            .last()
            .map(|e| e.record.consensus.clone())
            .unwrap_or_default(),
        // The waiting counted is this run's, since its resume.
        wait_fraction: totals.wait_fraction(wall - resumed_s),
        ranks_alive: totals.alive,
        staleness: totals.staleness,
        params: init.params.len(),
        checkpoint: end.last_ckpt.clone(),
        real_s: real_t0.elapsed().as_secs_f64(),
        ideal_s: shared
            .compute
            .as_ref()
            .filter(|_| cfg.execution == Execution::Virtual)
            // From step 0, as `wall_s` (a resumed run carries the time before it).
            .map(|c| c.ideal(0, end.steps_done, ranks)),
    };
    if let Some(o) = &shared.outputs {
        o.finish(&summary)?;
    }
    Ok(summary)
}

/// What a local step produced.
struct LocalStep {
    /// The loss, when it could be read.
    loss: Option<f32>,
    /// Samples used.
    samples: usize,
    /// The gradient, flat.
    grads: Vec<f32>,
    /// The buffers after the forward pass (BatchNorm statistics), if the model has any.
    buffers: Option<Vec<f32>>,
    /// Real seconds of forward and backward.
    seconds: f64,
}

/// Forward and backward of `fm` (already holding the replica) on the rank's next batch.
fn local_step<W: Workload>(
    w: &W,
    fm: &mut FlatModel<W::Model>,
    local: &mut W::Local,
    t: u64,
    has_buffers: bool,
) -> LocalStep {
    let t0 = std::time::Instant::now();
    let (loss, samples) = w.loss(fm.model(), local, t);
    let value = loss.clone().into_data().iter::<f32>().next();
    let grads = fm.backward(loss);
    LocalStep {
        loss: value,
        samples,
        grads,
        buffers: has_buffers.then(|| fm.buffers()),
        seconds: t0.elapsed().as_secs_f64(),
    }
}

async fn run_rank<'s, W: Workload>(
    comm: &mut Comm,
    s: &Shared<'s, W>,
    pool: Option<&Pool<'s>>,
) -> Result<RankEnd, TrainError> {
    let (cfg, w) = (s.cfg, s.w);
    let rank = comm.rank();
    let p = comm.size();
    let mut fm = build_flat(w);
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
            // A rank an elastic job had lost when the checkpoint was taken starts from the
            // lowest held rank's replica with a fresh data shard, as a rejoining rank does.
            let held = meta
                .file(rank)
                .map_or_else(|| meta.files.first().map_or(0, |f| f.rank), |f| f.rank);
            if held != rank {
                tracing::info!(
                    rank,
                    from = held,
                    iteration = meta.iteration,
                    "the checkpoint holds no state of this rank; it starts from rank {held}'s"
                );
            }
            let mut st = checkpoint::read_rank(ckpt, meta, held)?;
            if held != rank {
                st.local = w.save_local(&local);
            }
            if st.params.len() != s.init.params.len() || st.buffers.len() != s.init.buffers.len() {
                return Err(TrainError::checkpoint(
                    ckpt,
                    format!("rank {rank}'s state does not fit this model"),
                ));
            }
            w.load_local(&mut local, &st.local, st.iteration)
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
    // This rank's training clock: everything since the start but its own evaluation and
    // checkpoint work (never its waiting). The reported time of an iteration is the latest of
    // these clocks over the ranks.
    let mut excluded = 0.0f64;
    let t0 = worker.comm().now();
    let clock = |c: &Comm, excluded: f64| train_s + (c.now() - t0).as_secs_f64() - excluded;
    let mut last_ckpt = None;
    let ckpt_every = cfg.checkpoint_every;
    let mut next_ckpt = ckpt_every.map(|k| start_iter + k);
    let mut steps_done = start_iter;
    let mut trace: Vec<TraceLine> = Vec::new();
    let mut losses = LossSum::default();
    let mut snapshots: Vec<Snapshot> = Vec::new();
    // The budget vote of the last evaluation point, in flight.
    let mut vote: Option<wagma::exec::Gathering> = None;
    for t in start_iter..cfg.steps {
        let d = s.compute.as_ref().map_or(0.0, |c| c.of(t, rank, p));
        let d = Duration::from_secs_f64(d);
        fm.set_params(worker.params());
        if has_buffers {
            fm.set_buffers(worker.buffers());
        }
        let step_start = worker.comm().now();
        let done_step = match pool {
            Some(pool) => {
                // The step runs on the pool while this rank's virtual compute time passes.
                let job = pool.submit(move || {
                    let r = local_step(w, &mut fm, &mut local, t, has_buffers);
                    (fm, local, r)
                });
                worker.comm().compute(d).await;
                let (f, l, r) = job.wait()?;
                (fm, local) = (f, l);
                r
            }
            None => {
                if !d.is_zero() {
                    worker.comm().compute(d).await;
                }
                local_step(w, &mut fm, &mut local, t, has_buffers)
            }
        };
        let LocalStep {
            loss,
            samples: n,
            grads,
            buffers: new_buffers,
            seconds,
        } = done_step;
        if let Some(l) = loss {
            losses.add(l);
        }
        if worker.comm().tracing() {
            let end = worker
                .comm()
                .now()
                .max(step_start + Duration::from_secs_f64(seconds));
            worker
                .comm()
                .trace_span("compute", format!("local step {t}"), step_start, end);
        }
        if cfg.trace_compute.is_some() {
            trace.push(TraceLine {
                rank,
                step: t,
                seconds,
            });
        }
        if let Some(b) = new_buffers {
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
        if cfg.is_eval_point(done) {
            let e0 = worker.comm().now();
            let now = clock(worker.comm(), excluded);
            let taken = std::mem::take(&mut losses);
            if cfg.elastic {
                alive = worker.comm().living_ranks().await?.len();
            }
            if rank == 0 {
                let line = ProgressLine {
                    iteration: done,
                    clock_s: now,
                    train_loss: taken.mean(),
                    ranks_alive: alive,
                };
                if let Some(o) = &s.outputs {
                    o.progress(&line)?;
                }
                s.observer.progress(&line);
            }
            snapshots.push(Snapshot::take(&mut worker, done, samples, now, taken));
            excluded += (worker.comm().now() - e0).as_secs_f64();
            if let Some(budget) = cfg.budget {
                // A time budget needs an agreement on when it is spent. The ranks vote with
                // their clocks at every evaluation point and learn the outcome at the next:
                // by then the vote has long completed, so that no rank waits for another
                // (evaluation must not synchronise the run). Where a rank may be admitted,
                // which a vote in flight would span, the vote completes at once, at a point
                // WAGMA's global average synchronises anyway.
                let spent = |clocks: Vec<Vec<u64>>| latest_in(&clocks, 0) >= budget;
                if let Some(earlier) = vote.take() {
                    out_of_budget = spent(worker.comm().finish_gather_u64(earlier).await?);
                }
                if !out_of_budget && done < cfg.steps {
                    let started = worker.comm().start_gather_u64(&[secs_to_ns(now)]);
                    if cfg.admits_rejoins() {
                        out_of_budget = spent(worker.comm().finish_gather_u64(started).await?);
                    } else {
                        vote = Some(started);
                    }
                }
            }
        }
        steps_done = done;
        if out_of_budget {
            break;
        }
        if cfg.admits_rejoins() && cfg.algo.is_clean_point(done) && done < cfg.steps {
            let now = clock(worker.comm(), excluded);
            if let Some(n) = admit_joiners(&mut worker, done, samples, now).await? {
                alive = n;
            }
        }
        if next_ckpt.is_some_and(|k| done >= k) && cfg.algo.is_clean_point(done) && done < cfg.steps
        {
            // Waiting for the others is training time; writing is not.
            worker.quiesce().await?;
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
    if let Some(path) = &cfg.trace_compute {
        append_trace(path, &trace)?;
    }
    if let Some(path) = &cfg.trace {
        let events = worker.comm().take_trace().await?;
        let file = wagma::trace::rank_path(path, rank);
        wagma::trace::write(&file, rank, events).map_err(|e| TrainError::io(&file, e))?;
    }
    let mut totals = Totals::local(worker.comm().stats());
    let mut evaluated = None;
    if cfg.execution.is_multi_process() {
        // Training is over: evaluate what the ranks kept, off the clock. (In one process the
        // snapshots are evaluated after the job, so that no message of a rank that is done
        // can delay one that is still training.)
        evaluated = Some(
            evaluate_snapshots(&mut worker, &mut fm, s, std::mem::take(&mut snapshots)).await?,
        );
        totals = sum_over_ranks(&mut worker, &totals).await?;
    }
    Ok(RankEnd {
        snapshots,
        evaluated,
        totals,
        steps_done,
        samples,
        last_ckpt,
    })
}

/// Writes a checkpoint at `iteration` (see [`checkpoint`]). In an elastic job that has lost
/// ranks it holds the living ones.
async fn write_checkpoint<W: Workload>(
    worker: &mut Worker<'_>,
    s: &Shared<'_, W>,
    local: &W::Local,
    iteration: u64,
    samples: u64,
    train_s: f64,
) -> Result<PathBuf, TrainError> {
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
    // One vote: whether each rank wrote its part, and its clock; the checkpoint's time is the
    // latest (the time of an iteration is when its last rank finished it, and rank 0's clock,
    // which leaves out the most evaluation output, is often the earliest).
    let votes = worker
        .comm()
        .gather_u64(&[u64::from(mine.is_err()), secs_to_ns(train_s)])
        .await?;
    let any_failed = votes.iter().any(|v| v.first().is_some_and(|&f| f > 0));
    let train_s = latest_in(&votes, 1);
    let mut committed = Ok(dir.clone());
    if rank == 0 {
        if any_failed {
            checkpoint::abandon(dir, iteration);
        } else {
            // Every rank that took part in the vote above has its part written; a rank that
            // died before it is no longer among the living.
            let held = worker.comm().living_ranks().await?;
            let meta = Meta {
                format: checkpoint::FORMAT_VERSION,
                workload: s.w.name().into(),
                layout: s.init.layout.clone(),
                algorithm: s.cfg.algo.label(),
                config: Some(s.cfg.algo.clone()),
                ranks: worker.comm().size(),
                iteration,
                seed: s.cfg.seed,
                samples,
                train_s,
                files: Vec::new(),
            };
            committed = checkpoint::commit(dir, meta, &held, 2);
        }
    }
    // Rank 0's verdict, which every rank learns: 0 committed, 1 failed.
    let verdict = f32::from(u8::from(committed.is_err()));
    let ok = worker
        .comm()
        .allreduce(Payload::Data(vec![verdict]))
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
