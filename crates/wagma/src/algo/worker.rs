//! The API a training loop uses: hand over the gradient of each local step, read back the
//! model. The [`Worker`] applies the local optimizer (wagma's own, or the caller's through
//! [`Worker::step_external`]) and the algorithm's communication.

use serde::{Deserialize, Serialize};

use super::config::{
    AlgoConfig, Algorithm, CombineRule, EagerMode, LateGradients, Order, Scope, SendOrder,
};
use super::optim::{LocalOptimizer, OptimizerConfig};
use crate::Rank;
use crate::engine::{ContributionMode, ReadMode, RoundKind, RoundResult, StreamConfig, Trigger};
use crate::error::{ConfigError, Error, Op};
use crate::exec::{Comm, Exchanged};
use crate::payload::{Payload, pool};
use crate::schedule::chunk;
use crate::topology::{
    ExponentialGraph, GroupingKind, PairRole, Pairing, default_group_size, ring_neighbors,
};

/// What one step did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// The iteration just finished (0-based).
    pub iteration: u64,
    /// Seconds spent waiting for communication in this step.
    pub waited_s: f64,
    /// Wait-avoiding rounds: whether this rank's own contribution was in the sum.
    pub fresh: Option<bool>,
    /// Wait-avoiding rounds: the round whose result was used.
    pub round: Option<u64>,
    /// True when this step ended with a global average of all models.
    pub synced: bool,
    /// Push-sum weight after the step (SGP).
    pub weight: Option<f64>,
}

/// Where a resumed worker starts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Resume {
    /// Iterations already done.
    pub iteration: u64,
    /// The optimizer's state (SGD's momentum, Adam's moments; empty when stateless or when
    /// the update is computed outside wagma).
    pub optimizer_state: Vec<f32>,
    /// SGP's push-sum weight.
    pub weight: Option<f64>,
}

/// Parameters, non-trainable buffers and the optimizer of one replica.
struct ModelState {
    params: Payload,
    buffers: Payload,
    /// `None`: the update is computed outside wagma ([`Worker::step_external`]).
    opt: Option<Box<dyn LocalOptimizer>>,
}

impl ModelState {
    fn is_virtual(&self) -> bool {
        self.params.is_virtual()
    }

    fn opt_state(&self) -> &[f32] {
        self.opt.as_ref().map_or(&[], |o| o.state())
    }

    fn opt_state_mut(&mut self) -> &mut [f32] {
        match &mut self.opt {
            Some(o) => o.state_mut(),
            None => &mut [],
        }
    }

    fn state_len(&self) -> usize {
        self.opt_state().len()
    }

    /// Lengths of the segments the scope averages: params, buffers, optimizer state.
    fn segments(&self, scope: Scope) -> [usize; 3] {
        [
            self.params.len(),
            if scope.average_buffers {
                self.buffers.len()
            } else {
                0
            },
            if scope.average_optimizer_state && !self.is_virtual() {
                self.state_len()
            } else {
                0
            },
        ]
    }

    /// The averaged part of the replica as one vector.
    fn pack(&self, scope: Scope) -> Payload {
        let lens = self.segments(scope);
        let total: usize = lens.iter().sum();
        if self.is_virtual() {
            return Payload::Size(total);
        }
        let mut v = pool::take(total);
        v.extend_from_slice(self.params.as_slice());
        v.extend_from_slice(&self.buffers.as_slice()[..lens[1]]);
        v.extend_from_slice(&self.opt_state()[..lens[2]]);
        Payload::Data(v)
    }

    /// Sets each averaged value to `sum * k` (`keep_own`: `(sum + own) * k`).
    fn mix(&mut self, scope: Scope, sum: &Payload, k: f32, keep_own: bool) {
        if self.is_virtual() || sum.is_virtual() {
            return;
        }
        let lens = self.segments(scope);
        let s = sum.as_slice();
        let mix = |dst: &mut [f32], src: &[f32]| {
            if keep_own {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = (x + *d) * k;
                }
            } else {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = x * k;
                }
            }
        };
        let (a, rest) = s.split_at(lens[0].min(s.len()));
        let (b, c) = rest.split_at(lens[1].min(rest.len()));
        mix(self.params.as_mut_slice(), a);
        mix(&mut self.buffers.as_mut_slice()[..lens[1]], b);
        mix(&mut self.opt_state_mut()[..lens[2]], c);
    }

    /// Adds `delta` (laid out like [`ModelState::pack`]) to the averaged values.
    fn add(&mut self, scope: Scope, delta: &Payload) {
        if self.is_virtual() || delta.is_virtual() {
            return;
        }
        let lens = self.segments(scope);
        let d = delta.as_slice();
        let (a, rest) = d.split_at(lens[0].min(d.len()));
        let (b, c) = rest.split_at(lens[1].min(rest.len()));
        let add =
            |dst: &mut [f32], src: &[f32]| dst.iter_mut().zip(src).for_each(|(x, y)| *x += *y);
        add(self.params.as_mut_slice(), a);
        add(&mut self.buffers.as_mut_slice()[..lens[1]], b);
        add(&mut self.opt_state_mut()[..lens[2]], c);
    }

    /// The local update of step `t` with `grad`: wagma's optimizer, or the caller's.
    fn local_step(&mut self, t: u64, grad: &Grad<'_>, update: &mut Update<'_>) {
        if let (false, Some(g)) = (self.is_virtual(), grad.values()) {
            let params = self.params.as_mut_slice();
            match (update.take(), &mut self.opt) {
                (Some(f), _) => f(params, g),
                (None, Some(opt)) => opt.step(t, params, g),
                // Rejected before the step: see `Worker::run_step`.
                (None, None) => {}
            }
        }
    }
}

/// An update computed outside wagma, called once per step with the parameters (to update in
/// place) and the gradient to use; `None` once called, or for wagma's own optimizer.
type Update<'u> = Option<&'u mut dyn FnMut(&mut [f32], &[f32])>;

/// A gradient handed to [`Worker`]: borrowed (model-averaging algorithms only read it) or
/// owned (gradient-averaging algorithms send it).
enum Grad<'a> {
    Borrowed(&'a [f32]),
    Owned(Payload),
}

impl Grad<'_> {
    fn len(&self) -> usize {
        match self {
            Grad::Borrowed(s) => s.len(),
            Grad::Owned(p) => p.len(),
        }
    }

    /// The values; `None` for a virtual gradient.
    fn values(&self) -> Option<&[f32]> {
        match self {
            Grad::Borrowed(s) => Some(s),
            Grad::Owned(p) => (!p.is_virtual()).then(|| p.as_slice()),
        }
    }

    fn into_payload(self) -> Payload {
        match self {
            Grad::Borrowed(s) => Payload::Data(pool::copy_of(s)),
            Grad::Owned(p) => p,
        }
    }

    fn recycle(self) {
        if let Grad::Owned(p) = self {
            p.recycle();
        }
    }
}

/// Algorithm-specific state.
enum Role {
    Plain,
    Pair(Pairing),
    PushSum {
        graph: ExponentialGraph,
        weight: f64,
    },
}

/// One rank's replica and algorithm. Every rank of the job creates one with the same
/// configuration and calls [`Worker::step`] once per local step.
pub struct Worker<'c> {
    comm: &'c mut Comm,
    cfg: AlgoConfig,
    state: ModelState,
    role: Role,
    t: u64,
    scratch: Vec<f32>,
}

impl<'c> Worker<'c> {
    /// A replica starting from `params` (trainable) and `buffers` (non-trainable), updated by
    /// wagma's optimizer `opt`. Virtual payloads give a replica without data, for throughput
    /// simulations; real parameters beside virtual (non-empty) buffers are rejected with
    /// [`ConfigError::Invalid`], by every constructor.
    pub async fn new(
        comm: &'c mut Comm,
        cfg: AlgoConfig,
        opt: OptimizerConfig,
        params: Payload,
        buffers: Payload,
    ) -> Result<Worker<'c>, Error> {
        Self::resume(comm, cfg, opt, params, buffers, Resume::default()).await
    }

    /// A replica resumed at `resume.iteration`: every rank resumes at the same iteration, which
    /// must be a point where the algorithm has no communication in flight (see
    /// [`AlgoConfig::is_clean_point`]).
    pub async fn resume(
        comm: &'c mut Comm,
        cfg: AlgoConfig,
        opt: OptimizerConfig,
        params: Payload,
        buffers: Payload,
        resume: Resume,
    ) -> Result<Worker<'c>, Error> {
        let len = if params.is_virtual() { 0 } else { params.len() };
        let opt = opt.build(len)?;
        Self::start(comm, cfg, Some(opt), params, buffers, resume).await
    }

    /// A replica updated by any [`LocalOptimizer`].
    pub async fn with_optimizer(
        comm: &'c mut Comm,
        cfg: AlgoConfig,
        opt: Box<dyn LocalOptimizer>,
        params: Payload,
        buffers: Payload,
        resume: Resume,
    ) -> Result<Worker<'c>, Error> {
        Self::start(comm, cfg, Some(opt), params, buffers, resume).await
    }

    /// A replica whose update is computed outside wagma, by the caller's optimizer: drive it
    /// with [`Worker::step_external`]. Its optimizer state is the caller's and stays local.
    pub async fn external(
        comm: &'c mut Comm,
        cfg: AlgoConfig,
        params: Payload,
        buffers: Payload,
        resume: Resume,
    ) -> Result<Worker<'c>, Error> {
        Self::start(comm, cfg, None, params, buffers, resume).await
    }

    async fn start(
        comm: &'c mut Comm,
        cfg: AlgoConfig,
        mut opt: Option<Box<dyn LocalOptimizer>>,
        params: Payload,
        buffers: Payload,
        resume: Resume,
    ) -> Result<Worker<'c>, Error> {
        let p = comm.size();
        if !cfg.is_clean_point(resume.iteration) {
            return Err(Error::Protocol {
                rank: comm.rank(),
                op: Op::Other("resume"),
                detail: format!(
                    "{} cannot resume at iteration {}: communication is in flight there",
                    cfg.label(),
                    resume.iteration
                ),
            });
        }
        cfg.validate(p)?;
        // Real parameters are averaged with the buffers' values laid out after them (in
        // scope, and always for the consensus): a virtual buffer has none to lay out.
        if !params.is_virtual() && buffers.is_virtual() && !buffers.is_empty() {
            return Err(Error::Config(ConfigError::Invalid {
                what: "model buffers",
                detail: format!(
                    "virtual buffers ({} elements) beside real parameters: pass the buffers' \
                     values, or virtual parameters too",
                    buffers.len()
                ),
            }));
        }
        if !resume.optimizer_state.is_empty() {
            let have = opt.as_ref().map_or(0, |o| o.state().len());
            match opt.as_mut() {
                Some(o) if have == resume.optimizer_state.len() => {
                    o.state_mut().copy_from_slice(&resume.optimizer_state)
                }
                _ => {
                    return Err(Error::Protocol {
                        rank: comm.rank(),
                        op: Op::Other("resume"),
                        detail: format!(
                            "optimizer state of {} elements for an optimizer with {have}",
                            resume.optimizer_state.len(),
                        ),
                    });
                }
            }
        }
        let state = ModelState {
            opt,
            params,
            buffers,
        };
        let rank = comm.rank();
        let role = match &cfg.algorithm {
            Algorithm::AdPsgd { .. } => Role::Pair(Pairing::new(p)?),
            Algorithm::Sgp { peers, offsets } if p > 1 => Role::PushSum {
                graph: ExponentialGraph::with_offsets(p, *peers, *offsets)?,
                weight: resume.weight.unwrap_or(1.0),
            },
            _ => Role::Plain,
        };
        let w = Worker {
            comm,
            cfg,
            state,
            role,
            t: resume.iteration,
            scratch: Vec::new(),
        };
        match w.cfg.algorithm.clone() {
            Algorithm::Wagma(o) => {
                let initial = w.state.pack(w.cfg.scope);
                w.comm
                    .open_stream(StreamConfig {
                        group_size: o.group_size.unwrap_or_else(|| default_group_size(p)),
                        grouping: o.groups,
                        trigger: if o.wait_avoiding {
                            Trigger::Solo
                        } else {
                            Trigger::Lockstep
                        },
                        mode: ContributionMode::Model,
                        read: ReadMode::Latest,
                        sync_period: o.tau,
                        initial,
                        initial_steps: w.t,
                    })
                    .await?;
            }
            Algorithm::EagerSgd {
                mode,
                sync_period,
                late,
            } => {
                let len = w.state.params.len();
                let zeros = Payload::zeros_like(&w.state.params, len);
                let seed = w.cfg.seed;
                w.comm
                    .open_stream(StreamConfig {
                        group_size: p,
                        grouping: GroupingKind::Butterfly,
                        trigger: match mode {
                            EagerMode::Solo => Trigger::Solo,
                            EagerMode::Majority => Trigger::Majority { seed },
                        },
                        mode: match late {
                            LateGradients::Accumulate => ContributionMode::Accumulate,
                            LateGradients::Drop => ContributionMode::DropLate,
                        },
                        read: ReadMode::Exact,
                        sync_period,
                        initial: zeros,
                        initial_steps: w.t,
                    })
                    .await?;
            }
            Algorithm::AdPsgd { gossip: Some(k) } if p > 1 => {
                if w.comm.config().elastic {
                    // A gossip exchange to a lost peer would stop the loop for good.
                    return Err(Error::Config(ConfigError::Invalid {
                        what: "ad-psgd gossip",
                        detail: "elastic continuation needs the canonical ad-psgd".into(),
                    }));
                }
                let initial = w.state.pack(w.cfg.scope);
                w.comm.open_gossip(initial, k).await?;
            }
            Algorithm::AdPsgd { gossip: None } => {
                if let Role::Pair(pairing) = &w.role
                    && pairing.role(rank) == PairRole::Passive
                {
                    let initial = w.state.pack(w.cfg.scope);
                    w.comm.open_passive(initial).await?;
                }
            }
            _ => {}
        }
        Ok(w)
    }

    /// The trainable parameters (for SGP, the de-biased model `x / w`).
    pub fn params(&self) -> &[f32] {
        self.state.params.as_slice()
    }

    /// The trainable parameters as a payload (virtual in simulations).
    pub fn params_payload(&self) -> &Payload {
        &self.state.params
    }

    /// The non-trainable buffers.
    pub fn buffers(&self) -> &[f32] {
        self.state.buffers.as_slice()
    }

    /// The non-trainable buffers, to store what the local step computed (BatchNorm statistics).
    pub fn buffers_mut(&mut self) -> &mut [f32] {
        self.state.buffers.as_mut_slice()
    }

    /// The parameters, mutably (to restore a checkpoint).
    pub fn params_mut(&mut self) -> &mut [f32] {
        self.state.params.as_mut_slice()
    }

    /// The state of wagma's optimizer (empty for an external update).
    pub fn optimizer_state(&self) -> &[f32] {
        self.state.opt_state()
    }

    /// Iterations done.
    pub fn iteration(&self) -> u64 {
        self.t
    }

    /// The push-sum weight (SGP).
    pub fn weight(&self) -> Option<f64> {
        match &self.role {
            Role::PushSum { weight, .. } => Some(*weight),
            _ => None,
        }
    }

    /// Brings the replica to a state that a checkpoint can hold: every rank calls it at the
    /// same iteration, at a clean point. Ranks wait for each other, a passive AD-PSGD rank
    /// folds in the averaging its engine did since its last step, and all continue together
    /// (at the same virtual instant under the deterministic executor: [`Comm::align`]).
    pub async fn quiesce(&mut self) -> Result<(), Error> {
        self.comm.barrier().await?;
        let gossips = matches!(self.cfg.algorithm, Algorithm::AdPsgd { gossip: Some(_) });
        if gossips && self.comm.size() > 1 {
            // The barrier ended every gossip loop: fold the shared copy in without starting
            // another, so that the model alone is the state (a resumed run starts its copy
            // from it).
            self.gossip_mix(false).await?;
        } else if let Role::Pair(pairing) = &self.role
            && pairing.role(self.comm.rank()) == PairRole::Passive
            && self.comm.size() > 1
        {
            let scope = self.cfg.scope;
            let own = self.state.pack(scope);
            let delta = self.comm.passive_publish(own).await?;
            self.state.add(scope, &delta);
            delta.recycle();
        }
        self.comm.align().await
    }

    /// The configuration.
    pub fn config(&self) -> &AlgoConfig {
        &self.cfg
    }

    /// This rank's communicator.
    pub fn comm(&mut self) -> &mut Comm {
        self.comm
    }

    /// One iteration: the local optimizer step with `grad` (the gradient of the loss at
    /// [`Worker::params`]) and the algorithm's communication.
    pub async fn step(&mut self, grad: &[f32]) -> Result<StepReport, Error> {
        if self.state.is_virtual() {
            return self
                .run_step(Grad::Owned(Payload::Size(grad.len())), None)
                .await;
        }
        self.run_step(Grad::Borrowed(grad), None).await
    }

    /// Like [`Worker::step`], taking the gradient buffer (virtual in simulations).
    pub async fn step_with(&mut self, grad: Payload) -> Result<StepReport, Error> {
        self.run_step(Grad::Owned(grad), None).await
    }

    /// One iteration with an update computed outside wagma (the caller's optimizer).
    /// `update(params, grad)` is called exactly once and must apply the optimizer step to
    /// `params` in place, using `grad`: the averaged gradient for gradient-averaging algorithms
    /// (allreduce-SGD, eager-SGD), this rank's `grad` for model-averaging ones, which then
    /// average the model it produced (or, with `order = average-then-step`, average the model
    /// before the step and add the step's change after). A model-averaging algorithm only
    /// passes `grad` on to `update`: pass `&[]` when `update` has the gradient already.
    ///
    /// ```
    /// use wagma::algo::{AlgoConfig, Algorithm, Resume, Worker};
    /// use wagma::exec::threaded;
    /// use wagma::{EngineConfig, Payload};
    ///
    /// // Two ranks minimise (w - 3)^2 with a hand-written update rule (lr 0.25); local SGD
    /// // averages the models after every step.
    /// let cfg = AlgoConfig::new(Algorithm::LocalSgd { period: 1 });
    /// let job = threaded::run(2, EngineConfig::default(), async |comm| {
    ///     let start = Payload::Data(vec![0.0]);
    ///     let mut w = Worker::external(comm, cfg.clone(), start, Payload::default(), Resume::default()).await?;
    ///     for _ in 0..50 {
    ///         let grad = [2.0 * (w.params()[0] - 3.0)];
    ///         w.step_external(&grad, &mut |p: &mut [f32], g: &[f32]| p[0] -= 0.25 * g[0]).await?;
    ///     }
    ///     Ok(w.params()[0])
    /// })?;
    /// for w in job.into_all()? {
    ///     assert!((w - 3.0).abs() < 1e-4);
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn step_external(
        &mut self,
        grad: &[f32],
        update: &mut dyn FnMut(&mut [f32], &[f32]),
    ) -> Result<StepReport, Error> {
        if self.state.is_virtual() {
            return self
                .run_step(Grad::Owned(Payload::Size(grad.len())), Some(update))
                .await;
        }
        self.run_step(Grad::Borrowed(grad), Some(update)).await
    }

    async fn run_step(
        &mut self,
        grad: Grad<'_>,
        mut update: Update<'_>,
    ) -> Result<StepReport, Error> {
        let len = self.state.params.len();
        // An external update of a model-averaging algorithm may keep its gradient to itself.
        let passed_through = update.is_some() && self.cfg.algorithm.averages_models();
        if grad.len() != len && !(passed_through && grad.len() == 0) {
            return Err(Error::Protocol {
                rank: self.comm.rank(),
                op: Op::Other("step"),
                detail: format!("gradient of {} elements for {len} parameters", grad.len()),
            });
        }
        if update.is_none() && self.state.opt.is_none() {
            return Err(Error::Protocol {
                rank: self.comm.rank(),
                op: Op::Other("step"),
                detail: "this worker's update is computed outside wagma: call step_external".into(),
            });
        }
        let t = self.t;
        let waited0 = self.comm.stats().wait_s;
        let mut report = StepReport {
            iteration: t,
            ..StepReport::default()
        };
        let p = self.comm.size();
        let scope = self.cfg.scope;
        let algorithm = self.cfg.algorithm.clone();
        match algorithm {
            Algorithm::AllreduceSgd => {
                let avg = self.allreduce_gradient(grad.into_payload()).await?;
                let avg = Grad::Owned(avg);
                self.state.local_step(t, &avg, &mut update);
                avg.recycle();
                report.synced = true;
            }
            Algorithm::EagerSgd { .. } => {
                let r = self.comm.arrive(t, grad.into_payload(), t + 1).await?;
                let mut avg = r.sum.duplicate();
                avg.scale(1.0 / contributors(&r, p) as f32);
                let avg = Grad::Owned(avg);
                self.state.local_step(t, &avg, &mut update);
                avg.recycle();
                report.fresh = Some(r.fresh);
                report.round = Some(r.round);
                report.synced = r.kind == RoundKind::Sync;
                r.recycle();
                if report.synced {
                    // The gradient stream carries no buffers: average them at the rounds
                    // everybody waits for.
                    self.average_buffers().await?;
                }
            }
            model_averaging => {
                // The step's change, when it is added after the averaging.
                let delta = match self.cfg.order {
                    Order::StepThenAverage => {
                        self.state.local_step(t, &grad, &mut update);
                        None
                    }
                    Order::AverageThenStep => Some(self.step_aside(t, &grad, &mut update)),
                };
                grad.recycle();
                self.average_model(&model_averaging, t, p, scope, &mut report)
                    .await?;
                if let Some(d) = delta {
                    self.state.params.add(&d);
                    if let Payload::Data(v) = d {
                        self.scratch = v;
                    }
                }
            }
        }
        self.t += 1;
        report.waited_s = self.comm.stats().wait_s - waited0;
        Ok(report)
    }

    /// The communication of a model-averaging algorithm after step `t`.
    async fn average_model(
        &mut self,
        algorithm: &Algorithm,
        t: u64,
        p: usize,
        scope: Scope,
        report: &mut StepReport,
    ) -> Result<(), Error> {
        let pieces = self.cfg.exchange_pieces;
        match algorithm {
            Algorithm::LocalSgd { period } => {
                if (t + 1).is_multiple_of(*period) {
                    self.global_average().await?;
                    report.synced = true;
                }
            }
            Algorithm::Wagma(o) => {
                let own = self.state.pack(scope);
                let r = self.comm.arrive(t, own, t + 1).await?;
                self.fold_round(&r, o.combine, p);
                report.fresh = Some(r.fresh);
                report.round = Some(r.round);
                report.synced = r.kind == RoundKind::Sync;
                r.recycle();
            }
            Algorithm::DPsgd => {
                let rank = self.comm.rank();
                let nb = ring_neighbors(rank, p);
                let own = self.state.pack(scope);
                let pattern = match self.cfg.send_order {
                    SendOrder::RightThenLeft if p > 1 => Neighbours::RightThenLeft {
                        left: (rank + p - 1) % p,
                        right: (rank + 1) % p,
                    },
                    _ => Neighbours::Sets(&nb, &nb),
                };
                let e = Self::neighbour_exchange(self.comm, pieces, t, pattern, own, 0.0).await?;
                // In elastic mode a dead neighbour sends nothing: average who contributed.
                let n = if self.comm.config().elastic {
                    e.contributions.len().max(1)
                } else {
                    nb.len() + 1
                };
                self.state.mix(scope, &e.data, 1.0 / n as f32, false);
                e.data.recycle();
            }
            Algorithm::AdPsgd { gossip: Some(_) } if p > 1 => self.gossip_mix(true).await?,
            Algorithm::AdPsgd { .. } => {
                let rank = self.comm.rank();
                let own = self.state.pack(scope);
                if let Role::Pair(pairing) = &self.role {
                    match pairing.peer(rank, t) {
                        Some(peer) => {
                            let avg = self.comm.pair_average(peer, t, own, t + 1).await?;
                            self.state.mix(scope, &avg, 1.0, false);
                            avg.recycle();
                        }
                        None if p > 1 => {
                            let delta = self.comm.passive_publish(own).await?;
                            self.state.add(scope, &delta);
                            delta.recycle();
                        }
                        None => own.recycle(),
                    }
                }
            }
            Algorithm::Sgp { .. } => {
                if let Role::PushSum { graph, weight } = &mut self.role {
                    let rank = self.comm.rank();
                    let share = *weight / (graph.peers() + 1) as f64;
                    let mut x = self.state.pack(scope);
                    x.scale(share as f32);
                    let out = graph.out_peers(rank, t);
                    let inn = graph.in_peers(rank, t);
                    let pattern = Neighbours::Sets(&out, &inn);
                    let e =
                        Self::neighbour_exchange(self.comm, pieces, t, pattern, x, share).await?;
                    *weight = e.weight;
                    self.state
                        .mix(scope, &e.data, (1.0 / e.weight) as f32, false);
                    e.data.recycle();
                    report.weight = Some(e.weight);
                }
            }
            Algorithm::AllreduceSgd | Algorithm::EagerSgd { .. } => {}
        }
        Ok(())
    }

    /// AD-PSGD's gossip: the model becomes its mix with the engine's shared copy; with
    /// `start`, an active rank's engine then runs its exchanges.
    async fn gossip_mix(&mut self, start: bool) -> Result<(), Error> {
        let scope = self.cfg.scope;
        let own = self.state.pack(scope);
        let mixed = self.comm.gossip_mix(own, start).await?;
        self.state.mix(scope, &mixed, 1.0, false);
        mixed.recycle();
        Ok(())
    }

    /// The neighbour exchange after step `t`: the whole buffer at once, or as
    /// `exchange_pieces` consecutive pieces, each exchanged after the previous one completed
    /// (the authors' per-tensor chain). Either way the result holds the same sums.
    async fn neighbour_exchange(
        comm: &mut Comm,
        pieces: u32,
        t: u64,
        pattern: Neighbours<'_>,
        mut data: Payload,
        weight: f64,
    ) -> Result<Exchanged, Error> {
        let pieces = u64::from(pieces.max(1));
        if pieces == 1 {
            return pattern.exchange(comm, t, data, weight, t + 1).await;
        }
        let len = data.len();
        let mut sum = Payload::zeros_like(&data, len);
        let mut total = Exchanged {
            data: Payload::default(),
            weight,
            contributions: Vec::new(),
        };
        for k in 0..pieces {
            let range = chunk(k as usize, pieces as usize, len);
            // Sequence numbers stay unique and increasing across iterations and pieces.
            let seq = t * pieces + k;
            let part = data.view(range.clone());
            let e = pattern.exchange(comm, seq, part, weight, t + 1).await?;
            sum.copy_at(range, &e.data);
            total.weight = e.weight;
            total.contributions = e.contributions;
            e.data.recycle();
        }
        data.recycle();
        total.data = sum;
        Ok(total)
    }

    /// Folds a wait-avoiding round's result into the model (WAGMA's combination rules).
    fn fold_round(&mut self, r: &RoundResult, combine: CombineRule, p: usize) {
        let scope = self.cfg.scope;
        match r.kind {
            RoundKind::Sync => {
                self.state
                    .mix(scope, &r.sum, 1.0 / contributors(r, p) as f32, false)
            }
            // A rank alone in its group learns nothing from anyone: its model stays as its
            // step left it (averaging with its own earlier contribution would undo half a step).
            RoundKind::Group if r.members.len() <= 1 => {}
            RoundKind::Group => {
                let k = r.members.len();
                if r.fresh && combine == CombineRule::Paper {
                    self.state.mix(scope, &r.sum, 1.0 / k as f32, false);
                } else {
                    self.state.mix(scope, &r.sum, 1.0 / (k + 1) as f32, true);
                }
            }
        }
    }

    /// Runs the local update of step `t` and returns its change to the parameters, leaving
    /// the parameters as they were (bit for bit) for an average-then-step order.
    fn step_aside(&mut self, t: u64, grad: &Grad<'_>, update: &mut Update<'_>) -> Payload {
        if self.state.is_virtual() || grad.values().is_none() {
            return Payload::Size(grad.len());
        }
        let mut before = std::mem::take(&mut self.scratch);
        before.clear();
        before.extend_from_slice(self.state.params.as_slice());
        self.state.local_step(t, grad, update);
        for (w, b) in self.state.params.as_mut_slice().iter_mut().zip(&mut before) {
            let stepped = *w;
            *w = *b;
            *b = stepped - *b;
        }
        Payload::Data(before)
    }

    /// Sets the buffers to their average over all ranks, when the scope says so.
    async fn average_buffers(&mut self) -> Result<(), Error> {
        if !self.cfg.scope.average_buffers || self.state.buffers.is_empty() {
            return Ok(());
        }
        let own = self.state.buffers.duplicate();
        let mean = self.comm.allreduce_mean(own).await?;
        if !mean.is_virtual() && !self.state.buffers.is_virtual() {
            self.state
                .buffers
                .as_mut_slice()
                .copy_from_slice(mean.as_slice());
        }
        mean.recycle();
        Ok(())
    }

    /// Averages the gradient (and, in scope, the buffers) over all ranks.
    async fn allreduce_gradient(&mut self, grad: Payload) -> Result<Payload, Error> {
        let n = grad.len();
        let with_buffers = self.cfg.scope.average_buffers && !self.state.buffers.is_empty();
        let v = match (with_buffers, grad) {
            (true, Payload::Data(mut g)) => {
                g.extend_from_slice(self.state.buffers.as_slice());
                Payload::Data(g)
            }
            (true, Payload::Size(k)) => Payload::Size(k + self.state.buffers.len()),
            (_, g) => g,
        };
        let sum = self.comm.allreduce_mean(v).await?;
        if with_buffers && !sum.is_virtual() {
            let nb = self.state.buffers.len();
            self.state
                .buffers
                .as_mut_slice()
                .copy_from_slice(&sum.as_slice()[n..n + nb]);
            let mut g = sum.into_vec();
            g.truncate(n);
            return Ok(Payload::Data(g));
        }
        Ok(match sum {
            Payload::Size(_) => Payload::Size(n),
            s => s,
        })
    }

    /// Sets every replica to the global average (a blocking collective of all ranks).
    async fn global_average(&mut self) -> Result<(), Error> {
        let scope = self.cfg.scope;
        let own = self.state.pack(scope);
        let mean = self.comm.allreduce_mean(own).await?;
        self.state.mix(scope, &mean, 1.0, false);
        mean.recycle();
        Ok(())
    }

    /// The consensus model (global average of the parameters and buffers) without changing
    /// the replicas. Every rank must call it at the same iteration.
    pub async fn consensus(&mut self) -> Result<(Payload, Payload), Error> {
        let scope = Scope {
            average_buffers: true,
            average_optimizer_state: false,
        };
        let own = self.state.pack(scope);
        let sum = self.comm.allreduce_mean(own).await?;
        let n = self.state.params.len();
        if sum.is_virtual() {
            return Ok((Payload::Size(n), Payload::Size(self.state.buffers.len())));
        }
        let mut params = sum.into_vec();
        let buffers = params.split_off(n);
        Ok((Payload::Data(params), Payload::Data(buffers)))
    }

    /// Mean squared distance of the replicas to their average (a blocking collective).
    pub async fn consensus_distance(&mut self) -> Result<f64, Error> {
        let (avg, _) = self.consensus().await?;
        let d: f64 = self
            .params()
            .iter()
            .zip(avg.as_slice())
            .map(|(&a, &b)| f64::from(a - b).powi(2))
            .sum();
        let mean = self
            .comm
            .allreduce_mean(Payload::Data(vec![d as f32]))
            .await?;
        Ok(mean.as_slice().first().map_or(0.0, |&x| f64::from(x)))
    }
}

/// How many contributions the sum of round `r` holds in a job of `p`: its members, passive
/// ones included (a pending gradient, a published model); after a loss (elastic mode) only
/// the living. All `p` when no member is reported. Without failures every rank is a member
/// of an eager-SGD round or a sync, so this is `p`.
fn contributors(r: &RoundResult, p: usize) -> usize {
    if r.members.is_empty() {
        p
    } else {
        r.members.len()
    }
}

/// Whom a neighbour exchange sends to and sums from.
#[derive(Clone, Copy)]
enum Neighbours<'a> {
    /// Send to the first set, all at once, and sum what the second sends.
    Sets(&'a [Rank], &'a [Rank]),
    /// D-PSGD's ring as the authors' baseline: blocking sends, right first.
    RightThenLeft { left: Rank, right: Rank },
}

impl Neighbours<'_> {
    async fn exchange(
        self,
        comm: &mut Comm,
        seq: u64,
        data: Payload,
        weight: f64,
        steps: u64,
    ) -> Result<Exchanged, Error> {
        match self {
            Neighbours::Sets(send_to, recv_from) => {
                comm.exchange(seq, send_to, recv_from, data, weight, steps)
                    .await
            }
            Neighbours::RightThenLeft { left, right } => {
                comm.exchange_right_then_left(seq, left, right, data, steps)
                    .await
            }
        }
    }
}
