//! The API a training loop uses: hand over the gradient of each local step, read back the
//! model. The [`Worker`] applies the local optimizer and the algorithm's communication.

use serde::{Deserialize, Serialize};

use super::config::{AlgoConfig, Algorithm, CombineRule, EagerMode, Order, Scope};
use super::optim::{OptimizerConfig, Sgd};
use crate::engine::{ContributionMode, ReadMode, RoundKind, RoundResult, StreamConfig, Trigger};
use crate::error::{Error, Op};
use crate::exec::Comm;
use crate::payload::{Payload, pool};
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
    /// The optimizer's momentum (empty without momentum).
    pub momentum: Vec<f32>,
    /// SGP's push-sum weight.
    pub weight: Option<f64>,
}

/// Parameters, non-trainable buffers and the optimizer of one replica.
struct ModelState {
    params: Payload,
    buffers: Payload,
    opt: Sgd,
}

impl ModelState {
    fn is_virtual(&self) -> bool {
        self.params.is_virtual()
    }

    fn momentum_len(&self) -> usize {
        self.opt.momentum().len()
    }

    /// Lengths of the segments the scope averages: params, buffers, momentum.
    fn segments(&self, scope: Scope) -> [usize; 3] {
        [
            self.params.len(),
            if scope.average_buffers {
                self.buffers.len()
            } else {
                0
            },
            if scope.average_optimizer_state && !self.is_virtual() {
                self.momentum_len()
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
        v.extend_from_slice(&self.opt.momentum()[..lens[2]]);
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
        mix(&mut self.opt.momentum_mut()[..lens[2]], c);
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
        add(&mut self.opt.momentum_mut()[..lens[2]], c);
    }

    fn local_step(&mut self, t: u64, grad: &Grad<'_>) {
        if let (false, Some(g)) = (self.is_virtual(), grad.values()) {
            let params = self.params.as_mut_slice();
            self.opt.step(t, params, g);
        }
    }
}

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
    /// A replica starting from `params` (trainable) and `buffers` (non-trainable). Virtual
    /// payloads give a replica without data, for throughput simulations.
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
        let p = comm.size();
        if !cfg.is_clean_point(resume.iteration) {
            return Err(Error::Protocol {
                rank: comm.rank(),
                op: Op::Other("resume"),
                detail: format!(
                    "{} cannot resume at iteration {}: communication is in flight there",
                    cfg.algorithm.label(),
                    resume.iteration
                ),
            });
        }
        cfg.algorithm.validate(p)?;
        let opt_len = if params.is_virtual() { 0 } else { params.len() };
        let mut sgd = Sgd::new(opt, opt_len)?;
        if !resume.momentum.is_empty() {
            if resume.momentum.len() != sgd.momentum().len() {
                return Err(Error::Protocol {
                    rank: comm.rank(),
                    op: Op::Other("resume"),
                    detail: format!(
                        "momentum of {} elements for an optimizer of {}",
                        resume.momentum.len(),
                        sgd.momentum().len()
                    ),
                });
            }
            sgd.momentum_mut().copy_from_slice(&resume.momentum);
        }
        let state = ModelState {
            opt: sgd,
            params,
            buffers,
        };
        let rank = comm.rank();
        let role = match &cfg.algorithm {
            Algorithm::AdPsgd => Role::Pair(Pairing::new(p)?),
            Algorithm::Sgp { peers } if p > 1 => Role::PushSum {
                graph: ExponentialGraph::new(p, *peers)?,
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
            Algorithm::EagerSgd { mode, sync_period } => {
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
                        mode: ContributionMode::Accumulate,
                        read: ReadMode::Exact,
                        sync_period,
                        initial: zeros,
                        initial_steps: w.t,
                    })
                    .await?;
            }
            Algorithm::AdPsgd => {
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

    /// The parameters and buffers, mutably (to restore a checkpoint).
    pub fn state_mut(&mut self) -> (&mut [f32], &mut [f32], &mut [f32]) {
        let ModelState {
            params,
            buffers,
            opt,
        } = &mut self.state;
        (
            params.as_mut_slice(),
            buffers.as_mut_slice(),
            opt.momentum_mut(),
        )
    }

    /// The optimizer's momentum.
    pub fn momentum(&self) -> &[f32] {
        self.state.opt.momentum()
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
    /// folds in the averaging its engine did since its last step, and all continue at the same
    /// instant ([`Comm::align`]).
    pub async fn quiesce(&mut self) -> Result<(), Error> {
        self.comm.barrier().await?;
        if let Role::Pair(pairing) = &self.role
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
            return self.run_step(Grad::Owned(Payload::Size(grad.len()))).await;
        }
        self.run_step(Grad::Borrowed(grad)).await
    }

    /// Like [`Worker::step`], taking the gradient buffer (virtual in simulations).
    pub async fn step_with(&mut self, grad: Payload) -> Result<StepReport, Error> {
        self.run_step(Grad::Owned(grad)).await
    }

    async fn run_step(&mut self, grad: Grad<'_>) -> Result<StepReport, Error> {
        let len = self.state.params.len();
        if grad.len() != len {
            return Err(Error::Protocol {
                rank: self.comm.rank(),
                op: Op::Other("step"),
                detail: format!("gradient of {} elements for {len} parameters", grad.len()),
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
        match self.cfg.algorithm.clone() {
            Algorithm::AllreduceSgd => {
                let avg = self.allreduce_gradient(grad.into_payload()).await?;
                let avg = Grad::Owned(avg);
                self.state.local_step(t, &avg);
                avg.recycle();
                report.synced = true;
            }
            Algorithm::LocalSgd { period } => {
                self.state.local_step(t, &grad);
                grad.recycle();
                if (t + 1).is_multiple_of(period) {
                    self.global_average().await?;
                    report.synced = true;
                }
            }
            Algorithm::Wagma(o) => {
                let delta = match self.cfg.order {
                    Order::StepThenAverage => {
                        self.state.local_step(t, &grad);
                        None
                    }
                    Order::AverageThenStep => Some(self.delta(t, &grad)),
                };
                grad.recycle();
                let own = self.state.pack(scope);
                let r = self.comm.arrive(t, own, t + 1).await?;
                self.fold_round(&r, o.combine, p);
                report.fresh = Some(r.fresh);
                report.round = Some(r.round);
                report.synced = r.kind == RoundKind::Sync;
                r.recycle();
                if let Some(d) = delta {
                    self.apply_delta(d);
                }
            }
            Algorithm::DPsgd => {
                self.state.local_step(t, &grad);
                grad.recycle();
                let nb = ring_neighbors(self.comm.rank(), p);
                let own = self.state.pack(scope);
                let e = self.comm.exchange(t, &nb, &nb, own, 0.0, t + 1).await?;
                self.state
                    .mix(scope, &e.data, 1.0 / (nb.len() + 1) as f32, false);
                e.data.recycle();
            }
            Algorithm::AdPsgd => {
                self.state.local_step(t, &grad);
                grad.recycle();
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
                self.state.local_step(t, &grad);
                grad.recycle();
                if let Role::PushSum { graph, weight } = &mut self.role {
                    let rank = self.comm.rank();
                    let share = *weight / (graph.peers() + 1) as f64;
                    let mut x = self.state.pack(scope);
                    x.scale(share as f32);
                    let out = graph.out_peers(rank, t);
                    let inn = graph.in_peers(rank, t);
                    let e = self.comm.exchange(t, &out, &inn, x, share, t + 1).await?;
                    *weight = e.weight;
                    self.state
                        .mix(scope, &e.data, (1.0 / e.weight) as f32, false);
                    e.data.recycle();
                    report.weight = Some(e.weight);
                }
            }
            Algorithm::EagerSgd { .. } => {
                let r = self.comm.arrive(t, grad.into_payload(), t + 1).await?;
                let mut avg = r.sum.duplicate();
                avg.scale(1.0 / p as f32);
                let avg = Grad::Owned(avg);
                self.state.local_step(t, &avg);
                avg.recycle();
                report.fresh = Some(r.fresh);
                report.round = Some(r.round);
                report.synced = r.kind == RoundKind::Sync;
                r.recycle();
            }
        }
        self.t += 1;
        report.waited_s = self.comm.stats().wait_s - waited0;
        Ok(report)
    }

    /// Folds a wait-avoiding round's result into the model (WAGMA's combination rules).
    fn fold_round(&mut self, r: &RoundResult, combine: CombineRule, p: usize) {
        let scope = self.cfg.scope;
        match r.kind {
            RoundKind::Sync => {
                // Every rank, or in elastic mode every rank still alive.
                let n = if r.members.is_empty() {
                    p
                } else {
                    r.members.len()
                };
                self.state.mix(scope, &r.sum, 1.0 / n as f32, false)
            }
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

    /// The local optimizer's update at the current parameters (advances momentum).
    fn delta(&mut self, t: u64, grad: &Grad<'_>) -> Payload {
        let (false, Some(g)) = (self.state.is_virtual(), grad.values()) else {
            return Payload::Size(grad.len());
        };
        let mut d = std::mem::take(&mut self.scratch);
        d.resize(g.len(), 0.0);
        self.state
            .opt
            .delta(t, self.state.params.as_slice(), g, &mut d);
        Payload::Data(d)
    }

    fn apply_delta(&mut self, d: Payload) {
        self.state.params.add(&d);
        if let Payload::Data(v) = d {
            self.scratch = v;
        }
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
