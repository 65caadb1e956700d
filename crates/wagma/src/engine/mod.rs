//! The per-rank progress engine, written as a state machine without I/O.
//!
//! The engine takes events (a request from the rank's compute side, a message from a peer, a
//! lost peer, the passing of time) and answers with [`Action`]s (messages to send, requests to
//! complete). Two executors drive it: the threaded executor (one engine thread per rank over a
//! real transport) and the virtual-time executor (all engines in one thread, deterministic,
//! also used by the simulator). Everything the paper's wait-avoiding group allreduce needs lives
//! here: activation along binomial trees, in-order rounds consumed once, passive contributions
//! of the published model, results kept until read, global sync rounds, timeouts.

mod buffer;
mod contributions;
mod gossip;
mod join;
mod liveness;
mod passive;
mod rank_set;
mod round_map;
mod run;
mod schedule_cache;
mod stream;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Op};
use crate::payload::Payload;
use crate::schedule::{AlgorithmChoice, Schedule};
use crate::trace::{ENGINE, TraceEvent, Tracer};
use crate::transport::{Contribution, Envelope, Fold, Kind, Meta, Tag};

const CONTROL_BYE: u16 = 0;
const CONTROL_ABORT: u16 = 1;
use crate::Rank;

pub use join::Welcome;
pub use stream::{
    ContributionMode, ReadMode, RoundKind, RoundMembers, RoundResult, StreamConfig, Trigger,
    initiator,
};

use passive::Passive;
use rank_set::RankSet;
use run::{Owner, Running};
use stream::Stream;

/// Time since the start of the job (wall-clock or virtual).
pub type Time = Duration;

/// Identifies a request of the compute side.
pub type ReqId = u64;

/// Timeouts an elastic operation waits in all for a peer that is still heard from but sends
/// nothing for it (held up behind a lost peer, which its own timeout settles within about
/// one), before giving up on it too.
const LATE_PEER_TIMEOUTS: u32 = 3;

/// Most messages one peer may have waiting for operations this rank has not started. A
/// correct peer runs at most a few rounds ahead (WAGMA's tau bounds it), each a handful of
/// messages; a peer beyond this is treated as lost.
pub const MAX_KEPT_PER_PEER: usize = 4096;

/// Settings of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// End-to-end limit for any one operation.
    #[serde(with = "crate::util::serde_secs")]
    pub timeout: Duration,
    /// Allreduce algorithm selection.
    pub algorithm: AlgorithmChoice,
    /// Send heartbeats this often to the peers this rank depends on, declare a peer dead after
    /// `timeout` of silence, and report stalls at this interval (`None`: off, as in
    /// simulations).
    #[serde(default, with = "crate::util::serde_opt_secs")]
    pub heartbeat: Option<Duration>,
    /// Record a timeline ([`crate::trace`]).
    #[serde(default)]
    pub trace: bool,
    /// Elastic continuation: a lost peer is declared dead and the job goes on without it
    /// (collectives become full exchanges among the living; see the crate documentation).
    #[serde(default)]
    pub elastic: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            timeout: Duration::from_secs(60),
            algorithm: AlgorithmChoice::default(),
            heartbeat: None,
            trace: false,
            elastic: false,
        }
    }
}

/// A blocking collective the compute side asks for: a schedule to run now.
#[derive(Debug)]
pub struct CollectiveRun {
    /// Message namespace.
    pub kind: Kind,
    /// Sequence number shared by all participants.
    pub seq: u64,
    /// This rank's program.
    pub schedule: Schedule,
    /// Working buffer.
    pub data: Payload,
    /// Push-sum weight travelling with the data.
    pub weight: f64,
    /// Local steps embodied in `data`.
    pub steps: u64,
}

impl CollectiveRun {
    /// The operation, for errors and traces.
    fn op(&self) -> Op {
        Op::Collective {
            kind: self.kind.name(),
            seq: self.seq,
        }
    }
}

/// What the compute side asks of its engine.
#[derive(Debug)]
pub enum Request {
    /// Open the wait-avoiding stream (every rank opens it with the same configuration). Opening
    /// it again, once every rank is done with it, starts a fresh stream.
    OpenStream(Box<StreamConfig>),
    /// Arrive at round `round` of the stream with a new contribution embodying `steps` local
    /// steps; answered with the round's (or a later round's) result.
    Arrive {
        /// Round (iteration) number.
        round: u64,
        /// The new published model (or gradient, in accumulate mode).
        data: Payload,
        /// Local steps embodied.
        steps: u64,
    },
    /// Run a schedule now (a blocking collective).
    Run(CollectiveRun),
    /// Become a passive AD-PSGD rank whose engine answers pairwise averaging requests.
    OpenPassive {
        /// The initial model.
        initial: Payload,
    },
    /// As a passive rank, publish the model after a local step; answered with the sum of the
    /// corrections the engine applied since the last publish.
    PassivePublish {
        /// Model after the local step.
        data: Payload,
    },
    /// Take part in the WAGMA-SGD authors' AD-PSGD gossip ([`crate::topology::Pairing`] says
    /// who is active): keep `initial` as the shared copy; an active rank's engine runs
    /// `exchanges` pairwise averages of it after each mix.
    OpenGossip {
        /// The initial model.
        initial: Payload,
        /// Exchanges per mix (active ranks).
        exchanges: u32,
    },
    /// Gossip: mix the model after a local step with the shared copy; answered with
    /// `(data + shared) / 2`, which also becomes the shared copy. With `start`, an active
    /// rank's engine then runs its exchanges.
    GossipMix {
        /// Model after the local step.
        data: Payload,
        /// Start the exchanges (off to only fold the copy in, as before a checkpoint).
        start: bool,
    },
    /// Rejoining: announce to every peer that this process has taken over its rank (see
    /// [`crate::exec::Comm::announce_rejoin`] for the whole protocol).
    Announce,
    /// Rejoining: include these announced joiners in every collective and round from now on.
    /// Every living rank admits the same ranks at the same point of its program.
    Admit {
        /// The joiners.
        ranks: Vec<Rank>,
    },
    /// Rejoining: send an admitted joiner the state to start from and `info` values.
    Welcome {
        /// The joiner.
        to: Rank,
        /// The state to start from.
        data: Payload,
        /// The caller's values (iteration and the like).
        info: Vec<u64>,
    },
    /// Rejoining: wait (at most `timeout`) for this rank's welcome.
    AwaitWelcome {
        /// How long to wait.
        timeout: Duration,
    },
    /// Read the engine's counters.
    Stats,
    /// Take the engine's timeline events.
    TakeTrace,
}

/// The engine's answer to a request.
#[derive(Debug)]
pub enum Response {
    /// Nothing to return.
    Done,
    /// A round of the stream.
    Round(RoundResult),
    /// Result of a schedule.
    Data {
        /// The working buffer after the schedule.
        data: Payload,
        /// Push-sum weight after the schedule.
        weight: f64,
        /// Contributions folded into `data`, sorted by rank.
        contributions: Vec<Contribution>,
    },
    /// Corrections applied by a passive engine since the last publish.
    Delta(Payload),
    /// A gossip mix.
    Mixed(Payload),
    /// Counters (boxed: the largest answer by far, it would size every [`Action`] the
    /// simulator moves).
    Stats(Box<EngineStats>),
    /// Timeline events.
    Trace(Vec<TraceEvent>),
    /// A joiner's welcome.
    Welcome(Welcome),
}

/// What the engine wants done.
#[derive(Debug)]
pub enum Action {
    /// Send a message.
    Send {
        /// Destination rank.
        to: Rank,
        /// The message.
        env: Envelope,
    },
    /// Complete a request.
    Complete {
        /// The request.
        id: ReqId,
        /// Its outcome.
        result: Result<Response, Error>,
    },
    /// `peer` was declared dead (elastic mode): drop the connection to it. A process that hung
    /// may still hold it open (its kernel answers keepalive), and a process restarted in its
    /// place can only take the rank once it is gone.
    Disconnect {
        /// The dead peer.
        peer: Rank,
    },
}

/// What an engine asks of a transport that folds received parts as they arrive
/// ([`Engine::fold_on_arrival`], [`crate::transport::Transport::fold`]). Kept apart from the
/// [`Action`]s, which the simulator handles by the million: it never asks for these.
#[derive(Debug)]
pub enum FoldRequest {
    /// A message from `from` is expected, to be combined with this rank's own part as `fold`
    /// says.
    Ask {
        /// The sender.
        from: Rank,
        /// The expected message and how it combines.
        fold: Fold,
    },
    /// A message from `from` tagged `tag` is for the phase after the one just started, which
    /// will ask for it as [`FoldRequest::Ask`] does: the transport may hold it for that.
    Expect {
        /// The sender.
        from: Rank,
        /// The message's tag.
        tag: Tag,
    },
    /// The message of an earlier request arrived without it: drop the request.
    Withdraw {
        /// The sender.
        from: Rank,
        /// The message's tag.
        tag: Tag,
    },
}

/// Counters of one engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Messages sent.
    pub messages_sent: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Messages received.
    pub messages_received: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Activation messages sent (own and forwarded).
    pub activations_sent: u64,
    /// Group rounds executed.
    pub rounds: u64,
    /// Group rounds this rank executed before its compute side arrived.
    pub passive_rounds: u64,
    /// Global sync rounds executed.
    pub syncs: u64,
    /// Gossip exchanges this rank's engine completed (AD-PSGD's gossip variant, active ranks).
    #[serde(default)]
    pub gossip_exchanges: u64,
    /// Peers declared dead (elastic mode), in rank order.
    #[serde(default)]
    pub dead: Vec<Rank>,
    /// Dead peers that restarted and asked to rejoin (elastic mode), in rank order.
    #[serde(default)]
    pub joining: Vec<Rank>,
    /// Messages from peers declared dead, dropped on arrival (elastic mode).
    #[serde(default)]
    pub dropped_from_dead: u64,
    /// Received messages the transport had already combined with this rank's part as they
    /// arrived ([`FoldRequest`]).
    #[serde(default)]
    pub folded_on_arrival: u64,
}

/// The lists a schedule's phase fills (its sends, the parts it reduces), kept for their capacity.
#[derive(Default)]
struct PhaseScratch {
    sends: Vec<(Rank, Envelope)>,
    reducing: run::ReduceScratch,
}

/// Cache lines an [`Engine`] spans.
const ENGINE_LINES: usize = size_of::<Engine>().div_ceil(64);

thread_local! {
    /// One [`PhaseScratch`] for every engine of a thread: the simulator runs thousands of
    /// engines on one thread, and one shared list stays in cache where one per engine was cold
    /// at nearly every event. Taken out while in use, so a nested use only finds it empty.
    static PHASE_SCRATCH: std::cell::Cell<PhaseScratch> = std::cell::Cell::default();
}

/// The progress engine of one rank.
///
/// State that most jobs never use (gossip, passive AD-PSGD, rejoining, heartbeats, a failure)
/// is boxed: the simulator keeps thousands of engines and reads one per event, and unboxed
/// that state made each engine half again as large (1,312 bytes against 856 when measured).
pub struct Engine {
    rank: Rank,
    ranks: usize,
    cfg: EngineConfig,
    running: Vec<Running>,
    unexpected: FxHashMap<(Tag, Rank), VecDeque<Envelope>>,
    stream: Option<Stream>,
    opened_streams: u64,
    activations_sent: stream::SentActivations,
    early_activations: Vec<(u64, u64)>,
    passive: Option<Box<Passive>>,
    gossip: Option<Box<gossip::Gossip>>,
    early_pairs: Vec<Envelope>,
    outstanding: BTreeMap<ReqId, Op>,
    /// Peers that said goodbye (a rejoin takes its rank out again).
    departed: RankSet,
    /// The schedules of this rank's recent rounds, sized for the open stream's grouping.
    round_schedules: schedule_cache::ScheduleCache,
    /// Peers declared dead (elastic mode).
    dead: RankSet,
    /// Dead peers that announced a restart.
    joining: RankSet,
    welcome: Option<Box<Welcome>>,
    /// This rank announced a rejoin and waits for its welcome.
    rejoining: bool,
    /// Requests for a transport that folds received parts as they arrive, not yet taken
    /// (`None`: not asked for).
    fold_requests: Option<Vec<FoldRequest>>,
    welcome_waiter: Option<Box<join::WelcomeWaiter>>,
    failed: Option<Box<Error>>,
    stats: EngineStats,
    liveness: Option<Box<liveness::Liveness>>,
    /// The largest number of local steps this rank's requests said they embody.
    iteration: u64,
    tracer: Tracer,
}

impl Engine {
    /// The engine of `rank` among `ranks`.
    pub fn new(rank: Rank, ranks: usize, cfg: EngineConfig) -> Engine {
        Engine {
            rank,
            ranks,
            cfg,
            running: Vec::new(),
            unexpected: FxHashMap::default(),
            stream: None,
            opened_streams: 0,
            activations_sent: stream::SentActivations::default(),
            early_activations: Vec::new(),
            passive: None,
            gossip: None,
            early_pairs: Vec::new(),
            outstanding: BTreeMap::new(),
            departed: RankSet::default(),
            round_schedules: Default::default(),
            dead: RankSet::default(),
            joining: RankSet::default(),
            welcome: None,
            rejoining: false,
            fold_requests: None,
            welcome_waiter: None,
            failed: None,
            stats: EngineStats::default(),
            liveness: cfg
                .heartbeat
                .map(|i| Box::new(liveness::Liveness::new(rank, ranks, i))),
            iteration: 0,
            tracer: Tracer::new(rank, cfg.trace),
        }
    }

    /// Ask, through [`Engine::drain_fold_requests`], that a received part be folded into
    /// this rank's own as it arrives, wherever a phase combines one large part (at least 256
    /// KiB) with its own alone and the part is not here yet: for a transport that can
    /// ([`Transport::folds`]). Off by default: sharing the own part for a fold that never
    /// happens would cost a transport that cannot (its sum would no longer be made in place).
    ///
    /// [`Transport::folds`]: crate::transport::Transport::folds
    pub fn fold_on_arrival(&mut self, on: bool) {
        self.fold_requests = on.then(Vec::new);
    }

    /// The fold requests made since the last call, in order; hand them to the transport
    /// before the actions of the same call (a request precedes the sends its answer follows).
    pub fn drain_fold_requests(&mut self) -> impl Iterator<Item = FoldRequest> + '_ {
        self.fold_requests.iter_mut().flat_map(|q| q.drain(..))
    }

    /// This engine's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The error that stopped this engine, if any.
    pub fn failure(&self) -> Option<&Error> {
        self.failed.as_deref()
    }

    /// Prefetch hints for an event about to reach this engine, one level of pointers at a
    /// time, so that an executor that knows its next events can overlap their memory latency
    /// with the work at hand: 0 and 1, the engine itself; 2, its running schedules; 3 and 4,
    /// what each of those points to. Each level reads only what the levels before it brought
    /// in, and nothing observable changes.
    pub fn prefetch(&self, level: u8) {
        match level {
            // The engine itself, in two halves: one level's prefetches must not exceed what
            // the processor keeps in flight, or it drops them.
            0 => crate::prefetch::prefetch(self, 0..ENGINE_LINES.div_ceil(2)),
            1 => crate::prefetch::prefetch(self, ENGINE_LINES.div_ceil(2)..ENGINE_LINES),
            2 => {
                crate::prefetch::prefetch_slice(&self.running, 8);
                self.activations_sent.prefetch();
            }
            _ => {
                for r in self.running.iter().take(2) {
                    r.prefetch(level);
                }
            }
        }
    }

    /// Handles a request of the compute side.
    pub fn on_request(&mut self, now: Time, id: ReqId, req: Request, out: &mut Vec<Action>) {
        if let Some(err) = &self.failed {
            out.push(Action::Complete {
                id,
                result: Err(stopped(self.rank, err)),
            });
            return;
        }
        let result = match req {
            Request::OpenStream(cfg) => self.open_stream(now, *cfg, out).map(|()| Response::Done),
            Request::Arrive { round, data, steps } => {
                self.iteration = self.iteration.max(steps);
                if self.tracer.enabled() {
                    let args = serde_json::json!({ "round": round, "steps": steps });
                    self.tracer
                        .instant(ENGINE, "publish", "model published", now, args);
                }
                self.outstanding.insert(id, Op::Round(round));
                if let Err(e) = self.arrive(now, id, round, data, steps, out) {
                    self.outstanding.remove(&id);
                    Err(e)
                } else {
                    self.settle(now, out);
                    return;
                }
            }
            Request::Run(run) => match self.check_run(&run) {
                Err(e) => Err(e),
                Ok(op) => {
                    // Outstanding even while held back behind a gossip exchange, so that a
                    // failure meanwhile (the exchange's peer lost) answers it too.
                    self.outstanding.insert(id, op);
                    let run = match self.gossip.as_mut() {
                        Some(g) => g.hold(id, run),
                        None => Some(run),
                    };
                    if let Some(run) = run {
                        self.begin_run(now, id, run);
                    }
                    self.settle(now, out);
                    return;
                }
            },
            Request::OpenPassive { initial } => {
                self.become_passive(Passive::new(initial), out);
                Ok(Response::Done)
            }
            Request::PassivePublish { data } => {
                match self.passive.as_mut().and_then(|p| p.publish(data)) {
                    Some(delta) => Ok(Response::Delta(delta)),
                    None => Err(Error::Protocol {
                        rank: self.rank,
                        op: Op::Other("passive publish"),
                        detail: "the rank is not a passive AD-PSGD rank (open it first)".into(),
                    }),
                }
            }
            Request::OpenGossip { initial, exchanges } => {
                match crate::topology::Pairing::new(self.ranks) {
                    Ok(pairing) => {
                        if pairing.role(self.rank) == crate::topology::PairRole::Active {
                            self.gossip =
                                Some(Box::new(gossip::Gossip::new(initial, pairing, exchanges)));
                        } else {
                            self.become_passive(Passive::gossip(initial), out);
                        }
                        Ok(Response::Done)
                    }
                    Err(e) => Err(Error::Config(e)),
                }
            }
            Request::GossipMix { data, start } => {
                self.gossip_mix(now, data, start).map(Response::Mixed)
            }
            Request::Announce => {
                self.announce(out);
                Ok(Response::Done)
            }
            Request::Admit { ranks } => self.admit(now, &ranks).map(|()| Response::Done),
            Request::Welcome { to, data, info } => {
                self.welcome(to, data, &info, out).map(|()| Response::Done)
            }
            Request::AwaitWelcome { timeout } => {
                self.await_welcome(now, id, timeout, out);
                return;
            }
            Request::Stats => Ok(Response::Stats(Box::new(EngineStats {
                dead: self.dead(),
                joining: self.joining.iter().collect(),
                ..self.stats.clone()
            }))),
            Request::TakeTrace => Ok(Response::Trace(self.tracer.take())),
        };
        out.push(Action::Complete { id, result });
        // Opening the stream may start rounds activated before it was open.
        self.settle(now, out);
    }

    /// Handles a message from a peer.
    pub fn on_message(&mut self, now: Time, env: Envelope, out: &mut Vec<Action>) {
        self.receive(now, env, false, out);
    }

    /// Handles a message from a peer whose payload the transport already combined with this
    /// rank's own part, as a [`FoldRequest::Ask`] asked.
    pub fn on_folded_message(&mut self, now: Time, env: Envelope, out: &mut Vec<Action>) {
        self.receive(now, env, true, out);
    }

    #[inline]
    fn receive(&mut self, now: Time, env: Envelope, folded: bool, out: &mut Vec<Action>) {
        if self.failed.is_some() {
            return;
        }
        self.stats.messages_received += 1;
        self.stats.bytes_received += env.data.bytes() as u64;
        let from = env.from;
        if env.tag.kind != Kind::Control && self.dead.contains(from) && !self.joining.contains(from)
        {
            // What a dead peer's old incarnation still had in flight serves nothing (its
            // replacement announces itself, a control message, before sending anything else).
            self.stats.dropped_from_dead += 1;
            return;
        }
        self.stats.folded_on_arrival += u64::from(folded);
        let beat = (env.tag.kind == Kind::Control && env.tag.step == liveness::CONTROL_HEARTBEAT)
            .then_some(env.meta.aux);
        self.heard_from(now, env.from, beat);
        match env.tag.kind {
            Kind::Control => self.on_control(now, &env, out),
            Kind::Activation => {
                let running = self.running.len();
                self.on_activation(now, &env, out);
                // Most activations are forwarded and start nothing: then no schedule can have
                // progressed (two in five messages of a simulation are activations).
                if self.running.len() == running {
                    return;
                }
            }
            Kind::Pair if env.tag.step == 0 => {
                if self.passive.is_some() {
                    self.on_pair_request(env, out);
                } else if let Some(flooder) = self.keep_early_pair(env) {
                    let reason = format!(
                        "it sent more than {MAX_KEPT_PER_PEER} averaging requests before this \
                         rank became passive"
                    );
                    self.on_peer_lost(now, flooder, &reason, out);
                    return;
                }
            }
            _ => match self.deliver(env, folded) {
                Err(e) => {
                    self.fail(e, out);
                    return;
                }
                Ok(Some(flooder)) => {
                    let reason = format!(
                        "it sent more than {MAX_KEPT_PER_PEER} messages that no operation expects"
                    );
                    self.on_peer_lost(now, flooder, &reason, out);
                    return;
                }
                Ok(None) => {}
            },
        }
        self.settle(now, out);
    }

    /// Handles the loss of a peer (broken connection, declared dead).
    pub fn on_peer_lost(&mut self, now: Time, peer: Rank, reason: &str, out: &mut Vec<Action>) {
        if self.failed.is_some() {
            return;
        }
        // A peer that said goodbye may close its connections; only an operation that still
        // needs it fails (see `settle`).
        if self.departed.contains(peer) && !self.running.iter().any(|r| r.waits_on(peer)) {
            return;
        }
        if self.cfg.elastic {
            // A joiner that dies before it is admitted is not admitted.
            self.joining.remove(peer);
            self.declare_dead(now, peer, reason, out);
            return;
        }
        let (op, context) = self.blame(peer);
        let reason = format!("{reason}{context}");
        self.fail(
            Error::PeerLost {
                rank: self.rank,
                peer,
                op,
                reason,
            },
            out,
        );
    }

    /// The operation to blame for the loss of `peer`, and what is known about it: its last
    /// reported iteration and the group of the operation that waits for it.
    pub(super) fn blame(&self, peer: Rank) -> (Op, String) {
        let mut context = String::new();
        if let Some(i) = self.liveness.as_ref().and_then(|l| l.iteration_of(peer)) {
            context.push_str(&format!("; its last reported iteration was {i}"));
        }
        match self.running.iter().find(|r| r.waits_on(peer)) {
            Some(r) => {
                let what = if r.kind == Kind::Round {
                    "group"
                } else {
                    "peers"
                };
                context.push_str(&format!("; its {what}: {:?}", r.peers()));
                (r.op.clone(), context)
            }
            None => (self.current_op(), context),
        }
    }

    /// Messages telling every peer that this rank leaves: cleanly (`abort == false`, after its
    /// last collective) or because it failed. The engine stops.
    pub fn farewell(&mut self, abort: bool) -> Vec<(Rank, Envelope)> {
        let step = if abort { CONTROL_ABORT } else { CONTROL_BYE };
        // An abort names the rank the failure started from (plus one; zero: this rank), so
        // that every survivor's error blames the same rank.
        let culprit = self
            .failed
            .as_deref()
            .and_then(Error::peer)
            .map_or(0, |p| p as u64 + 1);
        // A peer declared dead hears nothing more (only a restarted one waiting to be
        // admitted needs to know that this rank left).
        let msgs = (0..self.ranks)
            .filter(|&p| p != self.rank && (!self.dead.contains(p) || self.joining.contains(p)))
            .map(|p| {
                let meta = Meta {
                    aux: if abort { culprit } else { 0 },
                    ..Meta::default()
                };
                (p, self.control(step, meta, Payload::Size(0)))
            })
            .collect();
        if self.failed.is_none() {
            self.failed = Some(Box::new(Error::Stopped {
                rank: self.rank,
                cause: None,
            }));
        }
        msgs
    }

    fn on_control(&mut self, now: Time, env: &Envelope, out: &mut Vec<Action>) {
        match env.tag.step {
            CONTROL_BYE if env.from < self.ranks => self.departed.insert(env.from),
            join::CONTROL_JOIN => self.on_join(env.from),
            join::CONTROL_WELCOME => self.on_welcome(now, env, out),
            CONTROL_ABORT if self.cfg.elastic => {
                self.declare_dead(now, env.from, "it failed and left the job", out);
            }
            CONTROL_ABORT => {
                let op = self.current_op();
                let culprit = usize::try_from(env.meta.aux)
                    .ok()
                    .and_then(|a| a.checked_sub(1))
                    .filter(|&c| c < self.ranks && c != self.rank)
                    .unwrap_or(env.from);
                let reason = if culprit == env.from {
                    format!("rank {} failed and left the job", env.from)
                } else {
                    format!("rank {} left the job after losing rank {culprit}", env.from)
                };
                self.fail(
                    Error::PeerLost {
                        rank: self.rank,
                        peer: culprit,
                        op,
                        reason,
                    },
                    out,
                );
            }
            _ => {}
        }
    }

    /// Elastic mode: continues without `peer` from now on.
    pub(super) fn declare_dead(
        &mut self,
        now: Time,
        peer: Rank,
        reason: &str,
        out: &mut Vec<Action>,
    ) {
        if peer >= self.ranks || peer == self.rank || self.dead.contains(peer) {
            return;
        }
        self.dead.insert(peer);
        // What it sent for operations not started here will never be used; a process that
        // rejoins in its place starts afresh.
        self.unexpected.retain(|(_, from), _| *from != peer);
        // Only one side of a partition may go on: the one with rank 0 and a strict majority.
        let alive: Vec<Rank> = (0..self.ranks)
            .filter(|&p| !self.dead.contains(p))
            .collect();
        if 2 * alive.len() <= self.ranks || self.dead.contains(0) {
            let err = Error::NoQuorum {
                rank: self.rank,
                lost: peer,
                alive,
                ranks: self.ranks,
            };
            self.fail(err, out);
            return;
        }
        tracing::warn!(
            rank = self.rank,
            peer,
            reason,
            "declared rank {peer} dead; continuing without it"
        );
        out.push(Action::Disconnect { peer });
        for r in &mut self.running {
            r.mark_absent(peer);
        }
        self.settle(now, out);
    }

    /// Peers declared dead (elastic mode).
    pub fn dead(&self) -> Vec<Rank> {
        self.dead.iter().collect()
    }

    /// Checks deadlines.
    pub fn on_tick(&mut self, now: Time, out: &mut Vec<Action>) {
        if self.failed.is_some() {
            return;
        }
        self.check_welcome(now, out);
        if self.liveness_tick(now, out) {
            return;
        }
        let timeout = self.cfg.timeout;
        if let Some(i) = self
            .running
            .iter()
            .position(|r| now.saturating_sub(r.timer_from) >= timeout)
        {
            let r = &self.running[i];
            let missing = r.missing();
            if self.cfg.elastic && !missing.is_empty() && r.single_phase() {
                // A peer that has delivered nothing for an operation in a whole timeout and
                // has been silent lately is as good as dead to it, even if its heartbeats
                // arrived until shortly before (a partition that began during the
                // operation): continue without it. A peer still heard from is alive but
                // behind, held up in an earlier operation by a peer its own timeouts will
                // settle: declaring it dead would split the survivors, so wait another
                // timeout for it, up to `LATE_PEER_TIMEOUTS` in all. (The elastic rounds and
                // collectives are single full exchanges; in a staged schedule the peer a later
                // phase waits for may itself be waiting.)
                let patient =
                    now.saturating_sub(r.started) < timeout.saturating_mul(LATE_PEER_TIMEOUTS);
                let (late, silent): (Vec<Rank>, Vec<Rank>) = missing.into_iter().partition(|&p| {
                    patient
                        && self
                            .liveness
                            .as_ref()
                            .is_some_and(|l| l.heard_lately(p, now))
                });
                let reason = format!(
                    "{} received nothing from it within {:.1} s",
                    r.op,
                    timeout.as_secs_f64()
                );
                if !late.is_empty() {
                    self.running[i].timer_from = now;
                }
                for p in silent {
                    self.declare_dead(now, p, &reason, out);
                }
                return;
            }
            let r = &self.running[i];
            let err = Error::Timeout {
                rank: self.rank,
                op: r.op.clone(),
                waited: now.saturating_sub(r.started),
                missing: r.missing(),
            };
            self.fail(err, out);
            return;
        }
        if let Some(err) = self
            .stream
            .as_ref()
            .and_then(|s| s.overdue(self.rank, now, timeout))
        {
            self.fail(err, out);
        }
    }

    /// The earliest time at which [`Engine::on_tick`] has something to check.
    pub fn next_deadline(&self) -> Option<Time> {
        self.next_deadline_until(Time::MAX)
    }

    /// [`Engine::next_deadline`] if it is at or before `horizon`. Operations time out
    /// `cfg.timeout` after they start, so with a timeout beyond the horizon (a simulation's,
    /// effectively off) they are not read: the executor asks after every event.
    pub fn next_deadline_until(&self, horizon: Time) -> Option<Time> {
        if self.failed.is_some() {
            return None;
        }
        let timeout = self.cfg.timeout;
        let operations = if timeout <= horizon {
            let runs = self.running.iter().map(|r| r.timer_from);
            let wait = self.stream.as_ref().and_then(|s| s.waiting_since());
            runs.chain(wait)
                .min()
                .map(|started| started.saturating_add(timeout))
        } else {
            None
        };
        let beat = self.liveness.as_ref().map(|l| l.next_deadline());
        operations
            .into_iter()
            .chain(beat)
            .chain(self.welcome_deadline())
            .min()
            .filter(|&d| d <= horizon)
    }

    /// The operation to blame in an error that is not tied to one schedule.
    fn current_op(&self) -> Op {
        self.running
            .first()
            .map(|r| r.op.clone())
            .or_else(|| self.outstanding.values().next().cloned())
            .unwrap_or(Op::Other("the local step (no collective in flight)"))
    }

    /// Describes what this engine is waiting for (for deadlock reports).
    pub fn describe_wait(&self) -> String {
        let mut parts: Vec<String> = self
            .running
            .iter()
            .map(|r| format!("{} waiting for {:?}", r.op, r.missing()))
            .collect();
        if let Some(s) = &self.stream
            && let Some(w) = s.describe_wait()
        {
            parts.push(w);
        }
        if parts.is_empty() {
            "idle".into()
        } else {
            parts.join(", ")
        }
    }

    /// Stops the engine with `err`: every outstanding and later request fails with it (a
    /// collective held back behind a gossip exchange is outstanding too).
    pub fn fail(&mut self, err: Error, out: &mut Vec<Action>) {
        if self.failed.is_some() {
            return;
        }
        tracing::warn!(rank = self.rank, error = %err, "engine stopped");
        for (id, _) in std::mem::take(&mut self.outstanding) {
            out.push(Action::Complete {
                id,
                result: Err(err.clone()),
            });
        }
        self.running.clear();
        if let Some(g) = self.gossip.as_mut() {
            g.drop_held();
        }
        self.failed = Some(Box::new(err));
    }

    fn send(&mut self, to: Rank, env: Envelope, out: &mut Vec<Action>) {
        if self.dead.contains(to) {
            return;
        }
        self.stats.messages_sent += 1;
        self.stats.bytes_sent += env.data.bytes() as u64;
        out.push(Action::Send { to, env });
    }

    fn complete(&mut self, id: ReqId, result: Result<Response, Error>, out: &mut Vec<Action>) {
        self.outstanding.remove(&id);
        out.push(Action::Complete { id, result });
    }

    /// Matches a message to a running schedule, or keeps it for later; the sender comes back
    /// when it has more messages waiting than any correct peer could have sent ahead.
    fn deliver(&mut self, env: Envelope, folded: bool) -> Result<Option<Rank>, Error> {
        let rank = self.rank;
        for r in &mut self.running {
            if r.kind == env.tag.kind && r.seq == env.tag.seq {
                let (from, tag) = (env.from, env.tag);
                return match r.accept(rank, env, folded)? {
                    None => {
                        // Its phase asked for a fold that came too late for it: left in
                        // place, it could catch a later message that reuses the tag.
                        if !folded
                            && r.fold_unused()
                            && let Some(q) = &mut self.fold_requests
                        {
                            q.push(FoldRequest::Withdraw { from, tag });
                        }
                        Ok(None)
                    }
                    Some(env) if folded => Err(unawaited_fold(rank, r.op.clone(), env.from)),
                    Some(env) => Ok(self.keep(env)),
                };
            }
        }
        if folded {
            return Err(unawaited_fold(rank, Op::Other("receiving"), env.from));
        }
        Ok(self.keep(env))
    }

    /// Keeps a message for an operation not started yet, unless its sender already has
    /// [`MAX_KEPT_PER_PEER`] waiting (then returns the sender): memory stays bounded whatever a
    /// peer sends.
    fn keep(&mut self, env: Envelope) -> Option<Rank> {
        let from = env.from;
        // Counting is needed only once that many keys exist at all.
        if self.unexpected.len() >= MAX_KEPT_PER_PEER {
            let kept: usize = self
                .unexpected
                .iter()
                .filter(|((_, f), _)| *f == from)
                .map(|(_, q)| q.len())
                .sum();
            if kept >= MAX_KEPT_PER_PEER {
                return Some(from);
            }
        }
        self.unexpected
            .entry((env.tag, from))
            .or_default()
            .push_back(env);
        None
    }

    /// Keeps an averaging request that arrived before this rank became passive, unless its
    /// sender already has [`MAX_KEPT_PER_PEER`] waiting (then returns the sender). A correct
    /// active peer waits for the answer to each request, so it has at most one.
    fn keep_early_pair(&mut self, env: Envelope) -> Option<Rank> {
        let from = env.from;
        if self.early_pairs.iter().filter(|e| e.from == from).count() >= MAX_KEPT_PER_PEER {
            return Some(from);
        }
        self.early_pairs.push(env);
        None
    }

    /// Checks a blocking collective of the compute side before it is started or held back:
    /// its schedule is the caller's, and a peer outside the job or a range past the buffer
    /// would only fail later, in an executor or in the middle of a reduction. Returns the
    /// operation it is.
    fn check_run(&self, run: &CollectiveRun) -> Result<Op, Error> {
        let op = run.op();
        let detail = if !matches!(run.kind, Kind::Collective | Kind::Exchange | Kind::Pair) {
            // Their messages never reach a schedule run for the caller (or belong to the
            // stream's rounds): it would wait for them until its timeout.
            format!(
                "{} messages are the engine's own: a schedule runs as a collective, an exchange \
                 or a pairwise averaging",
                run.kind.name()
            )
        } else if run.data.len() != run.schedule.len {
            format!(
                "buffer of {} elements for a schedule over {}",
                run.data.len(),
                run.schedule.len
            )
        } else if let Err(e) = run.schedule.check(self.rank, self.ranks) {
            e.to_string()
        } else {
            return Ok(op);
        };
        Err(Error::Protocol {
            rank: self.rank,
            op,
            detail,
        })
    }

    /// Starts a blocking collective of the compute side, checked by [`Engine::check_run`] and
    /// outstanding (without advancing it).
    fn begin_run(&mut self, now: Time, id: ReqId, run: CollectiveRun) {
        let op = run.op();
        let CollectiveRun {
            kind,
            seq,
            schedule,
            data,
            weight,
            steps,
        } = run;
        self.iteration = self.iteration.max(steps);
        let contributions = vec![Contribution {
            rank: self.rank,
            steps,
        }];
        // A collective's schedule is the caller's: its group is at most the job.
        self.start(
            now,
            run::Members::Job(self.ranks),
            Owner::Request(id),
            op,
            kind,
            seq,
            Arc::new(schedule),
            data,
            weight,
            contributions,
        );
    }

    /// Starts `schedule`, a reduction over `members` (the ranks a peer's contribution list may
    /// name).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        now: Time,
        members: run::Members,
        owner: Owner,
        op: Op,
        kind: Kind,
        seq: u64,
        schedule: Arc<Schedule>,
        data: Payload,
        weight: f64,
        contributions: Vec<Contribution>,
    ) {
        self.running.push(Running::new(
            members,
            owner,
            op,
            kind,
            seq,
            schedule,
            data,
            weight,
            contributions,
            now,
            self.cfg.elastic,
        ));
    }

    /// Advances every running schedule as far as it goes and finishes the completed ones;
    /// repeats while finishing one starts another.
    fn settle(&mut self, now: Time, out: &mut Vec<Action>) {
        loop {
            if self.failed.is_some() {
                return;
            }
            let mut progressed = false;
            let mut i = 0;
            let mut scratch = PHASE_SCRATCH.take();
            while i < self.running.len() {
                let step = {
                    let rank = self.rank;
                    let unexpected = &mut self.unexpected;
                    let dead = &self.dead;
                    let asks = self.fold_requests.as_mut();
                    let PhaseScratch { sends, reducing } = &mut scratch;
                    self.running[i].advance(rank, unexpected, sends, asks, dead, reducing)
                };
                for (to, env) in scratch.sends.drain(..) {
                    self.send(to, env, out);
                }
                match step {
                    Err(e) => {
                        PHASE_SCRATCH.set(scratch);
                        self.fail(e, out);
                        return;
                    }
                    Ok(false) => i += 1,
                    Ok(true) => {
                        let done = self.running.swap_remove(i);
                        self.finish(now, done, out);
                        progressed = true;
                    }
                }
            }
            PHASE_SCRATCH.set(scratch);
            if !progressed {
                break;
            }
        }
        // Until a peer says goodbye, nothing running can wait on a departed one.
        if self.departed.is_empty() {
            return;
        }
        let departed = &self.departed;
        if let Some((r, peer)) = self.running.iter().find_map(|r| {
            r.missing()
                .into_iter()
                .find(|&p| departed.contains(p))
                .map(|p| (r, p))
        }) {
            let err = Error::PeerLost {
                rank: self.rank,
                peer,
                op: r.op.clone(),
                reason: "the peer has already finished and left the job".into(),
            };
            self.fail(err, out);
        }
    }

    fn finish(&mut self, now: Time, done: Running, out: &mut Vec<Action>) {
        if self.tracer.enabled() {
            let cat = match done.kind {
                Kind::Round => "round",
                Kind::Sync => "sync",
                Kind::Exchange => "exchange",
                Kind::Pair => "pair",
                _ => "collective",
            };
            let args = serde_json::json!({ "peers": done.peers() });
            self.tracer
                .span(ENGINE, cat, done.op.to_string(), done.started, now, args);
        }
        let (owner, data, weight, contributions) = done.into_result();
        match owner {
            Owner::Request(id) => self.complete(
                id,
                Ok(Response::Data {
                    data,
                    weight,
                    contributions,
                }),
                out,
            ),
            Owner::Stream { epoch, round } => {
                self.on_round_done(now, epoch, round, data, contributions, out)
            }
            Owner::Gossip => self.on_gossip_done(now, data),
        }
    }
}

fn stopped(rank: Rank, err: &Error) -> Error {
    Error::Stopped {
        rank,
        cause: Some(Box::new(err.clone())),
    }
}

/// A transport folds a part only for the phase that asked for it, which waits for it: a folded
/// part that no phase takes was folded for the wrong message.
fn unawaited_fold(rank: Rank, op: Op, peer: Rank) -> Error {
    Error::Protocol {
        rank,
        op,
        detail: format!("a part from rank {peer} was folded on arrival but no phase waits for it"),
    }
}

#[cfg(test)]
mod tests;
