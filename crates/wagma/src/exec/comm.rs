//! The compute side's handle on its rank's engine.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Pending, Port};
use crate::Rank;
use crate::engine::{
    CollectiveRun, EngineConfig, EngineStats, Request, Response, RoundResult, StreamConfig,
};
use crate::error::{Error, Op};
use crate::payload::{Payload, Reduce};
use crate::schedule::{self, AlgorithmChoice, AllreduceAlgorithm, Schedule};
use crate::trace::{COMPUTE, TraceEvent, Tracer};
use crate::transport::{Contribution, Kind};
use crate::util::Histogram;

/// A request handed to the engine, and what a timeline calls its wait.
struct Submitted {
    pending: Pending,
    name: String,
}

/// A gather of `u64`s in flight ([`Comm::start_gather_u64`]).
#[must_use = "every rank must finish a gather it started"]
pub struct Gathering {
    call: Submitted,
    /// Values per rank.
    k: usize,
}

/// Bits of a `u64` a gather carries in one `f32` slot of a sum (exact: at most 2^24).
const PART: u32 = 22;

/// Counters kept by the compute side.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CommStats {
    /// Seconds the compute side spent waiting for communication.
    pub wait_s: f64,
    /// Seconds of emulated compute.
    pub compute_s: f64,
    /// Staleness (in rounds) of every contribution in the round results this rank used.
    pub staleness: Histogram,
    /// Round results in which this rank's own contribution was fresh.
    pub fresh_rounds: u64,
    /// Round results in which it was stale.
    pub stale_rounds: u64,
}

/// The result of a neighbour exchange, a push-sum step or a collective.
#[derive(Debug, Clone)]
pub struct Exchanged {
    /// Sum (in rank order) of the local buffer and the received ones; their maximum for
    /// [`Comm::allreduce_max`].
    pub data: Payload,
    /// Sum of the weights.
    pub weight: f64,
    /// Contributions folded in.
    pub contributions: Vec<Contribution>,
}

/// A rank's handle on its progress engine: collectives, wait-avoiding rounds, emulated compute.
pub struct Comm {
    rank: Rank,
    size: usize,
    cfg: EngineConfig,
    port: Arc<dyn Port>,
    collective_seq: u64,
    stats: CommStats,
    left: bool,
    tracer: Tracer,
}

impl Comm {
    pub(crate) fn new(rank: Rank, size: usize, cfg: EngineConfig, port: Arc<dyn Port>) -> Comm {
        Comm {
            rank,
            size,
            cfg,
            port,
            collective_seq: 0,
            stats: CommStats::default(),
            left: false,
            tracer: Tracer::new(rank, cfg.trace),
        }
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Number of ranks P.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The engine settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Time since the job started: wall-clock, or virtual under the deterministic executor.
    pub fn now(&self) -> Duration {
        self.port.now()
    }

    /// The compute side's counters.
    pub fn stats(&self) -> &CommStats {
        &self.stats
    }

    /// Emulates `d` of compute: a sleep under the threaded executor, virtual time under the
    /// deterministic one.
    pub async fn compute(&mut self, d: Duration) {
        self.stats.compute_s += d.as_secs_f64();
        let t0 = self.port.now();
        // A sleep cannot fail: its slot completes with `Done`.
        let _ = self.port.sleep(d).await;
        let t1 = self.port.now();
        self.tracer.span(
            COMPUTE,
            "compute",
            "emulated compute",
            t0,
            t1,
            serde_json::Value::Null,
        );
    }

    async fn call(&mut self, req: Request) -> Result<Response, Error> {
        let call = self.submit(req);
        self.wait(call).await
    }

    /// Hands `req` to the engine without waiting for its answer.
    fn submit(&mut self, req: Request) -> Submitted {
        let name = if self.tracer.enabled() {
            match &req {
                Request::Arrive { round, .. } => format!("wait: round {round}"),
                Request::Run(CollectiveRun { kind, seq, .. }) => {
                    format!("wait: {} #{seq}", kind.name())
                }
                // A model is too long to print.
                Request::GossipMix { .. } => "wait: gossip mix".into(),
                Request::PassivePublish { .. } => "wait: passive publish".into(),
                other => format!("wait: {other:?}").chars().take(40).collect(),
            }
        } else {
            String::new()
        };
        Submitted {
            pending: self.port.submit(req),
            name,
        }
    }

    /// Waits for the answer to a submitted request; the time it takes is waiting.
    async fn wait(&mut self, call: Submitted) -> Result<Response, Error> {
        let t0 = self.port.now();
        let r = call.pending.await;
        let t1 = self.port.now();
        self.stats.wait_s += t1.saturating_sub(t0).as_secs_f64();
        self.tracer
            .span(COMPUTE, "wait", call.name, t0, t1, serde_json::Value::Null);
        r
    }

    /// Adds a span of the compute side to the timeline (a local step, a checkpoint).
    pub fn trace_span(
        &mut self,
        cat: &'static str,
        name: impl Into<String>,
        start: Duration,
        end: Duration,
    ) {
        self.tracer
            .span(COMPUTE, cat, name, start, end, serde_json::Value::Null);
    }

    /// True when this rank records a timeline.
    pub fn tracing(&self) -> bool {
        self.tracer.enabled()
    }

    /// The timeline recorded so far (engine and compute side), taken out.
    pub async fn take_trace(&mut self) -> Result<Vec<TraceEvent>, Error> {
        let mut events = self.tracer.take();
        match self.port.submit(Request::TakeTrace).await? {
            Response::Trace(e) => events.extend(e),
            _ => return Err(self.unexpected("take trace")),
        }
        Ok(events)
    }

    fn unexpected(&self, what: &'static str) -> Error {
        Error::Protocol {
            rank: self.rank,
            op: Op::Other(what),
            detail: "the engine answered with the wrong kind of response".into(),
        }
    }

    /// Runs a schedule built by one of the [`crate::schedule`] functions, as messages of
    /// `kind`: [`Kind::Collective`], [`Kind::Exchange`] or [`Kind::Pair`]. A schedule this rank
    /// cannot run ([`Schedule::check`], or a buffer of another length), or one of the kinds the
    /// engine keeps for itself, is rejected with [`Error::Protocol`] before anything is sent.
    pub async fn run(
        &mut self,
        kind: Kind,
        seq: u64,
        schedule: Schedule,
        data: Payload,
        weight: f64,
        steps: u64,
    ) -> Result<Exchanged, Error> {
        let call = self.submit(Request::Run(CollectiveRun {
            kind,
            seq,
            schedule,
            data,
            weight,
            steps,
        }));
        self.exchanged(call).await
    }

    /// Blocking sum over all ranks. Every rank must call it the same number of times.
    pub async fn allreduce(&mut self, data: Payload) -> Result<Payload, Error> {
        self.world_collective(data, self.cfg.algorithm, Reduce::Sum)
            .await
            .map(|e| e.data)
    }

    /// Blocking sum over every rank folded left in rank order, `((x0 + x1) + x2) + ...`: the
    /// bits of a sequential sum, whatever the transport and the number of ranks (a sum of
    /// replicas reproduces the one computed in one process). Rank 0 receives every buffer and
    /// sends the sum back to each, so it carries `2 (P - 1)` buffers: for results off the
    /// training path. In elastic mode it is an exchange among the ranks still alive, like
    /// every collective there.
    pub async fn allreduce_in_rank_order(&mut self, data: Payload) -> Result<Payload, Error> {
        let choice = AlgorithmChoice {
            algorithm: AllreduceAlgorithm::ReduceBroadcast,
            ..self.cfg.algorithm
        };
        self.world_collective(data, choice, Reduce::Sum)
            .await
            .map(|e| e.data)
    }

    /// The next collective over every rank, reducing by `op`, with its members'
    /// contributions. The list of members exists only while the schedule is built: thousands
    /// of simulated ranks waiting in the collective would otherwise each hold one, `O(P^2)`
    /// memory in all.
    async fn world_collective(
        &mut self,
        data: Payload,
        choice: AlgorithmChoice,
        op: Reduce,
    ) -> Result<Exchanged, Error> {
        let call = self.start_world_collective(data, choice, op);
        self.exchanged(call).await
    }

    /// Starts a collective over every rank of the job without waiting for it.
    fn start_world_collective(
        &mut self,
        data: Payload,
        choice: AlgorithmChoice,
        op: Reduce,
    ) -> Submitted {
        let seq = self.collective_seq;
        self.collective_seq += 1;
        let schedule = {
            let members: Vec<Rank> = (0..self.size).collect();
            self.allreduce_schedule(&members, data.len(), &choice)
                .with_reduction(op)
        };
        self.submit(Request::Run(CollectiveRun {
            kind: Kind::Collective,
            seq,
            schedule,
            data,
            // A collective of the job, not of training: no weight, no steps.
            weight: 0.0,
            steps: 0,
        }))
    }

    /// The result of a submitted run.
    async fn exchanged(&mut self, call: Submitted) -> Result<Exchanged, Error> {
        match self.wait(call).await? {
            Response::Data {
                data,
                weight,
                contributions,
            } => Ok(Exchanged {
                data,
                weight,
                contributions,
            }),
            _ => Err(self.unexpected("run")),
        }
    }

    /// Blocking sum over `members` (strictly ascending ranks of the job, this rank among
    /// them), identified by `seq`.
    pub async fn allreduce_in(
        &mut self,
        members: &[Rank],
        seq: u64,
        data: Payload,
        steps: u64,
    ) -> Result<Exchanged, Error> {
        let choice = self.cfg.algorithm;
        self.allreduce_with(members, seq, data, steps, &choice)
            .await
    }

    /// Like [`Comm::allreduce_in`] with an explicit algorithm choice. A list of members that
    /// is not strictly ascending, names a rank outside the job or leaves this rank out is
    /// rejected with [`Error::Protocol`].
    pub async fn allreduce_with(
        &mut self,
        members: &[Rank],
        seq: u64,
        data: Payload,
        steps: u64,
        choice: &AlgorithmChoice,
    ) -> Result<Exchanged, Error> {
        // Rejected, not sorted here: every member builds its program from the list, and a
        // list in another order at another member would build a mismatched one.
        let fault = if !members.windows(2).all(|w| w[0] < w[1]) {
            Some("members must be strictly ascending (sorted, each rank once)")
        } else if members.last().is_some_and(|&m| m >= self.size) {
            Some("a member is outside the job's ranks")
        } else if members.binary_search(&self.rank).is_err() {
            Some("this rank is not a member")
        } else {
            None
        };
        if let Some(fault) = fault {
            return Err(Error::Protocol {
                rank: self.rank,
                op: Op::Collective {
                    kind: "allreduce",
                    seq,
                },
                detail: format!("{fault}: {members:?} (P = {})", self.size),
            });
        }
        let schedule = self.allreduce_schedule(members, data.len(), choice);
        self.run(Kind::Collective, seq, schedule, data, 0.0, steps)
            .await
    }

    /// This rank's program of a sum of `len` elements over `members`.
    fn allreduce_schedule(
        &self,
        members: &[Rank],
        len: usize,
        choice: &AlgorithmChoice,
    ) -> Schedule {
        if self.cfg.elastic {
            schedule::exchange_among(self.rank, members.iter().copied(), len)
        } else {
            schedule::allreduce(self.rank, members, len, choice)
        }
    }

    /// Blocking elementwise maximum over all ranks ([`Reduce::Max`]: the same bits on every
    /// transport and schedule). Every rank must call it the same number of times, in the same
    /// order as its other collectives over all ranks. It costs what [`Comm::allreduce`] costs.
    /// In elastic mode it is the maximum over the ranks still alive.
    pub async fn allreduce_max(&mut self, data: Payload) -> Result<Payload, Error> {
        self.world_collective(data, self.cfg.algorithm, Reduce::Max)
            .await
            .map(|e| e.data)
    }

    /// The mean over all ranks (in elastic mode, over the ranks still alive). Every rank must
    /// call it the same number of times.
    pub async fn allreduce_mean(&mut self, data: Payload) -> Result<Payload, Error> {
        let e = self
            .world_collective(data, self.cfg.algorithm, Reduce::Sum)
            .await?;
        let n = if self.cfg.elastic {
            e.contributions.len().max(1)
        } else {
            self.size
        };
        let mut mean = e.data;
        mean.scale(1.0 / n as f32);
        Ok(mean)
    }

    /// Waits until every rank has called `barrier` as often.
    pub async fn barrier(&mut self) -> Result<(), Error> {
        self.allreduce(Payload::Data(Vec::new())).await.map(|_| ())
    }

    /// Every rank's `values` (each rank passes as many), indexed by rank: a blocking
    /// collective. Ranks that contributed nothing (lost in elastic mode) read as zeros.
    pub async fn gather_u64(&mut self, values: &[u64]) -> Result<Vec<Vec<u64>>, Error> {
        let g = self.start_gather_u64(values);
        self.finish_gather_u64(g).await
    }

    /// [`Comm::gather_u64`] started without waiting for it: the engine runs it while this
    /// rank goes on, and [`Comm::finish_gather_u64`] takes its result. Every rank starts its
    /// gathers in the same order as its other collectives over the whole job.
    pub fn start_gather_u64(&mut self, values: &[u64]) -> Gathering {
        let (p, k) = (self.size, values.len());
        let mut v = vec![0f32; 3 * k * p];
        for (i, &x) in values.iter().enumerate() {
            for j in 0..3 {
                v[3 * (self.rank * k + i) + j] = ((x >> (PART * j as u32)) & 0x3f_ffff) as f32;
            }
        }
        let call = self.start_world_collective(Payload::Data(v), self.cfg.algorithm, Reduce::Sum);
        Gathering { call, k }
    }

    /// The result of a gather started with [`Comm::start_gather_u64`]; the time this waits is
    /// counted as waiting.
    pub async fn finish_gather_u64(&mut self, g: Gathering) -> Result<Vec<Vec<u64>>, Error> {
        let (p, k) = (self.size, g.k);
        let all = self.exchanged(g.call).await?.data.into_vec();
        if k == 0 {
            return Ok(vec![Vec::new(); p]);
        }
        Ok(all
            .chunks_exact(3 * k)
            .take(p)
            .map(|rank| {
                rank.chunks_exact(3)
                    .map(|c| (0..3).fold(0u64, |acc, j| acc | (c[j] as u64) << (PART * j as u32)))
                    .collect()
            })
            .collect())
    }

    /// A barrier after which, under the deterministic executor, every rank continues at the
    /// same instant: the ranks agree on the latest virtual clock among them and each waits
    /// until 10 ms after it, which makes what follows independent of what came before (a run
    /// resumed here replays the uninterrupted one). Under threads it is a plain barrier: the
    /// ranks' wall clocks start when their processes do, and do not compare.
    pub async fn align(&mut self) -> Result<(), Error> {
        const MARGIN: Duration = Duration::from_millis(10);
        if !self.port.virtual_clock() {
            return self.barrier().await;
        }
        let t = u64::try_from(self.now().as_nanos()).unwrap_or(u64::MAX);
        let latest = self
            .gather_u64(&[t])
            .await?
            .iter()
            .filter_map(|v| v.first().copied())
            .max()
            .unwrap_or(t);
        let target = Duration::from_nanos(latest) + MARGIN;
        let now = self.now();
        if target > now {
            self.compute(target - now).await;
        }
        Ok(())
    }

    /// Sends the buffer to `send_to`, sums what `recv_from` send (in rank order, with the local
    /// buffer and weights). `seq` must be the same at both ends (the iteration). A peer outside
    /// the job, or this rank itself, is rejected with [`Error::Protocol`].
    pub async fn exchange(
        &mut self,
        seq: u64,
        send_to: &[Rank],
        recv_from: &[Rank],
        data: Payload,
        weight: f64,
        steps: u64,
    ) -> Result<Exchanged, Error> {
        let schedule = schedule::exchange(send_to, recv_from, data.len());
        self.run(Kind::Exchange, seq, schedule, data, weight, steps)
            .await
    }

    /// D-PSGD's exchange with the ring neighbours `left` and `right` as blocking rendezvous
    /// sends, right first ([`schedule::exchange_right_then_left`]); the same sum as
    /// [`Comm::exchange`] with both neighbours, later.
    pub async fn exchange_right_then_left(
        &mut self,
        seq: u64,
        left: Rank,
        right: Rank,
        data: Payload,
        steps: u64,
    ) -> Result<Exchanged, Error> {
        let schedule = schedule::exchange_right_then_left(left, right, data.len());
        self.run(Kind::Exchange, seq, schedule, data, 0.0, steps)
            .await
    }

    /// Opens the wait-avoiding stream.
    pub async fn open_stream(&mut self, cfg: StreamConfig) -> Result<(), Error> {
        self.expect_done(Request::OpenStream(Box::new(cfg)), "open stream")
            .await
    }

    /// Arrives at round `round` of the stream with a contribution embodying `steps` local
    /// steps; returns the round's result (or a later one's when this rank was far behind).
    pub async fn arrive(
        &mut self,
        round: u64,
        data: Payload,
        steps: u64,
    ) -> Result<RoundResult, Error> {
        match self.call(Request::Arrive { round, data, steps }).await? {
            Response::Round(r) => {
                r.record_staleness(&mut self.stats.staleness);
                if r.fresh {
                    self.stats.fresh_rounds += 1;
                } else {
                    self.stats.stale_rounds += 1;
                }
                Ok(r)
            }
            _ => Err(self.unexpected("arrive")),
        }
    }

    /// Makes this rank a passive AD-PSGD rank starting from `initial`.
    pub async fn open_passive(&mut self, initial: Payload) -> Result<(), Error> {
        self.expect_done(Request::OpenPassive { initial }, "open passive")
            .await
    }

    /// As a passive rank, publishes the model after a local step; returns the corrections the
    /// engine made meanwhile (add them to the model).
    pub async fn passive_publish(&mut self, data: Payload) -> Result<Payload, Error> {
        match self.call(Request::PassivePublish { data }).await? {
            Response::Delta(d) => Ok(d),
            _ => Err(self.unexpected("passive publish")),
        }
    }

    /// Joins the AD-PSGD gossip (the WAGMA-SGD authors' baseline) with `initial` as the
    /// shared copy; an active rank's engine runs `exchanges` pairwise averages after each mix.
    pub async fn open_gossip(&mut self, initial: Payload, exchanges: u32) -> Result<(), Error> {
        self.expect_done(Request::OpenGossip { initial, exchanges }, "open gossip")
            .await
    }

    /// Gossip: mixes the model after a local step with the engine's shared copy and returns
    /// `(data + shared) / 2`; with `start`, an active rank's engine then runs its exchanges.
    /// Never waits for a peer.
    pub async fn gossip_mix(&mut self, data: Payload, start: bool) -> Result<Payload, Error> {
        match self.call(Request::GossipMix { data, start }).await? {
            Response::Mixed(m) => Ok(m),
            _ => Err(self.unexpected("gossip mix")),
        }
    }

    /// As an active rank, averages the model with passive rank `peer`; returns the average.
    pub async fn pair_average(
        &mut self,
        peer: Rank,
        seq: u64,
        data: Payload,
        steps: u64,
    ) -> Result<Payload, Error> {
        let schedule = schedule::pair_request(peer, data.len());
        self.run(Kind::Pair, seq, schedule, data, 0.0, steps)
            .await
            .map(|e| e.data)
    }

    /// The ranks still in the job: all of them, or in elastic mode those this rank has not
    /// declared dead.
    pub async fn living_ranks(&mut self) -> Result<Vec<Rank>, Error> {
        if !self.cfg.elastic {
            return Ok((0..self.size).collect());
        }
        let dead = self.engine_stats().await?.dead;
        Ok((0..self.size).filter(|r| !dead.contains(r)).collect())
    }

    /// Rejoining (elastic mode; a process restarted in place of a rank declared dead): tells
    /// every peer that this process has taken over its rank. Then wait for the welcome with
    /// [`Comm::await_welcome`]. The protocol: each living rank notes the announcement
    /// ([`Comm::joining_ranks`]); at a point where nothing is in flight (a global average) the
    /// living ranks agree on whom to admit (for example by an allreduce of flags), all call
    /// [`Comm::admit`], one sends each joiner its starting state ([`Comm::welcome`]), and all,
    /// joiners included, meet in a collective (such as [`Comm::barrier`]) before going on.
    pub async fn announce_rejoin(&mut self) -> Result<(), Error> {
        self.expect_done(Request::Announce, "announce").await
    }

    /// Ranks that restarted and asked to rejoin, as far as this rank has heard (elastic mode).
    pub async fn joining_ranks(&mut self) -> Result<Vec<Rank>, Error> {
        Ok(self.engine_stats().await?.joining)
    }

    /// Includes `ranks` (joiners, see [`Comm::joining_ranks`]) in every collective and round
    /// from now on. Every living rank admits the same ranks at the same point of its program,
    /// before a collective that the joiners take part in (such as [`Comm::barrier`]).
    pub async fn admit(&mut self, ranks: &[Rank]) -> Result<(), Error> {
        let ranks = ranks.to_vec();
        self.expect_done(Request::Admit { ranks }, "admit").await
    }

    /// Sends the admitted joiner `to` the state to start from and the caller's `info` values,
    /// with this rank's collective sequence number so that the joiner's collectives match.
    pub async fn welcome(&mut self, to: Rank, data: Payload, info: &[u64]) -> Result<(), Error> {
        let mut all = Vec::with_capacity(info.len() + 1);
        all.push(self.collective_seq);
        all.extend_from_slice(info);
        let req = Request::Welcome {
            to,
            data,
            info: all,
        };
        self.expect_done(req, "welcome").await
    }

    /// Joiner: waits at most `timeout` to be admitted; returns the state sent by
    /// [`Comm::welcome`] and its `info` values.
    pub async fn await_welcome(&mut self, timeout: Duration) -> Result<(Payload, Vec<u64>), Error> {
        match self.call(Request::AwaitWelcome { timeout }).await? {
            Response::Welcome(w) => {
                let Some((&seq, info)) = w.info.split_first() else {
                    return Err(Error::Protocol {
                        rank: self.rank,
                        op: Op::Other("rejoining"),
                        detail: format!("rank {} sent a welcome without its counters", w.from),
                    });
                };
                self.collective_seq = seq;
                Ok((w.data, info.to_vec()))
            }
            _ => Err(self.unexpected("await welcome")),
        }
    }

    async fn expect_done(&mut self, req: Request, what: &'static str) -> Result<(), Error> {
        match self.call(req).await? {
            Response::Done => Ok(()),
            _ => Err(self.unexpected(what)),
        }
    }

    /// The engine's counters.
    pub async fn engine_stats(&mut self) -> Result<EngineStats, Error> {
        match self.port.submit(Request::Stats).await? {
            Response::Stats(s) => Ok(*s),
            _ => Err(self.unexpected("stats")),
        }
    }

    /// Leaves the job cleanly after a barrier, so that no peer still needs this rank.
    pub async fn finish(mut self) -> Result<CommStats, Error> {
        let r = self.barrier().await;
        self.left = true;
        self.port.leave(r.is_err());
        r.map(|()| self.stats.clone())
    }

    /// Leaves the job at once, telling the peers that this rank failed.
    pub fn abort(mut self) {
        self.left = true;
        self.port.leave(true);
    }

    pub(crate) fn mark_left(&mut self) {
        self.left = true;
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.left {
            self.port.leave(true);
        }
    }
}
