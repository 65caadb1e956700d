//! The wait-avoiding stream: externally triggered group rounds with periodic global syncs.
//!
//! Rules (see the crate documentation for the full semantics):
//! * A round is activated by the first rank whose compute side arrives at it; the activation
//!   spreads along the binomial tree rooted at that rank. Every activation message received is
//!   forwarded along its own tree, except on the edges this rank already sent the round on for
//!   another activator: those receivers already carry it on, so several simultaneous activators
//!   still reach every rank, and no rank sends a round's activation twice on one edge.
//! * Rounds execute in order at every rank, each at most once. An activated engine runs the
//!   allreduce of its group at once with the published contribution; a rank whose compute side
//!   has not arrived is a passive participant.
//! * Each contribution carries the number of local steps it embodies, so every result says who
//!   was fresh and how stale the others were.
//! * Results are kept until the compute side has read them (`ReadMode`).
//! * Rounds `t` with `(t + 1) mod tau == 0` are blocking global syncs: they run only when the
//!   compute side arrives, and finish only when every rank has contributed.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::round_map::RoundMap;
use super::run::Members;
use super::{Action, Engine, Owner, ReqId, Response, Time};
use crate::Rank;
use crate::error::{ConfigError, Error, Op};
use crate::payload::Payload;
use crate::schedule::Schedule;
use crate::topology::{Grouping, GroupingKind, activation_edges};
use crate::transport::{Contribution, Envelope, Kind, Meta, Tag};

/// The dimensions on which this rank sent each recent round's activation, for the
/// [`activation_edges`] it may skip.
#[derive(Debug, Default)]
pub(super) struct SentActivations {
    /// `(seq, mask of dimensions)`, sorted by seq. New rounds come last, so a search from the
    /// back usually stops at once, in one or two cache lines (a tree map chased a node per level
    /// of every engine, cold in a simulation of thousands).
    masks: VecDeque<(u64, u64)>,
}

impl SentActivations {
    /// Masks kept: older rounds' are forgotten once this many newer ones exist (forgetting one
    /// can only cause a duplicate, never a missed activation).
    const KEPT: usize = 256;

    /// Adds `dims` to round `seq`'s mask; returns the mask before.
    fn mark(&mut self, seq: u64, dims: u64) -> u64 {
        let after = self
            .masks
            .iter()
            .rposition(|&(s, _)| s <= seq)
            .map_or(0, |i| i + 1);
        if let Some((s, mask)) = after.checked_sub(1).and_then(|i| self.masks.get_mut(i))
            && *s == seq
        {
            return std::mem::replace(mask, *mask | dims);
        }
        self.masks.insert(after, (seq, dims));
        // Forgets the oldest, even the round just marked if it is the oldest.
        if self.masks.len() > Self::KEPT {
            self.masks.pop_front();
        }
        0
    }

    /// Prefetch hints for the newest mask, the one a round in progress reads.
    pub(super) fn prefetch(&self) {
        if let Some(newest) = self.masks.back() {
            crate::prefetch::prefetch(newest, 0..1);
        }
    }
}

/// Who may start a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Trigger {
    /// The first rank to arrive (WAGMA, eager-SGD solo).
    Solo,
    /// Only the round's initiator, drawn from a seed shared by all ranks (eager-SGD majority).
    Majority {
        /// Shared seed.
        seed: u64,
    },
    /// Nobody: each member runs the round when it arrives (a plain blocking group allreduce).
    Lockstep,
}

/// What a rank contributes and what happens to its contribution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ContributionMode {
    /// The last published model; it stays published until replaced (WAGMA).
    Model,
    /// The sum of the gradients published since the last round that consumed them (eager-SGD):
    /// a late gradient is contributed to a later round, never dropped.
    Accumulate,
    /// The gradient published for the round being read, if a round consumed it before the read;
    /// otherwise it is dropped when the compute side reads its result (the eager-SGD authors'
    /// code, which zeroes its send buffer after every round it waits for).
    DropLate,
}

/// Which result a compute side gets when it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReadMode {
    /// The most recent completed round at or after the requested one (WAGMA).
    Latest,
    /// Exactly the requested round: every rank applies every round once (eager-SGD), so the
    /// replicas never diverge.
    Exact,
}

/// Configuration of the wait-avoiding stream; identical on every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamConfig {
    /// Largest group size S (P for a global partial allreduce).
    pub group_size: usize,
    /// How groups are formed each round.
    pub grouping: GroupingKind,
    /// Who may start a round.
    pub trigger: Trigger,
    /// What a rank contributes.
    pub mode: ContributionMode,
    /// Which result an arriving rank gets.
    pub read: ReadMode,
    /// tau: rounds with `(t + 1) mod tau == 0` are global syncs; `None` for never.
    pub sync_period: Option<u64>,
    /// The initial published model (model mode) or a zero buffer of the model's length
    /// (accumulate mode).
    #[serde(skip)]
    pub initial: Payload,
    /// Local steps embodied in `initial`; the stream's first round is this number too (0 for a
    /// fresh run, the iteration of the checkpoint when resuming at a sync point).
    pub initial_steps: u64,
}

/// Whether a round was a group round or a global sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RoundKind {
    /// Wait-avoiding group allreduce.
    Group,
    /// Blocking global allreduce.
    Sync,
}

/// A completed round.
#[derive(Debug)]
struct Outcome {
    kind: RoundKind,
    sum: Arc<Payload>,
    members: RoundMembers,
}

/// The members of a completed round and the steps each contribution embodied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoundMembers {
    /// Every rank of a job of `ranks`, each contribution embodying `steps` local steps (a
    /// global sync outside elastic mode): kept as two numbers, since a list would cost every
    /// rank memory and time proportional to the job at every sync.
    All {
        /// Ranks of the job.
        ranks: usize,
        /// Local steps every contribution embodied.
        steps: u64,
    },
    /// These contributions, sorted by rank.
    Listed(Vec<Contribution>),
}

impl RoundMembers {
    /// Number of members.
    pub fn len(&self) -> usize {
        match self {
            RoundMembers::All { ranks, .. } => *ranks,
            RoundMembers::Listed(v) => v.len(),
        }
    }

    /// True when no member is known (an elastic sync whose members were not reported).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The contributions, in rank order.
    pub fn iter(&self) -> impl Iterator<Item = Contribution> + '_ {
        let (all, listed) = match self {
            RoundMembers::All { ranks, steps } => (Some((*ranks, *steps)), &[][..]),
            RoundMembers::Listed(v) => (None, v.as_slice()),
        };
        all.into_iter()
            .flat_map(|(ranks, steps)| (0..ranks).map(move |rank| Contribution { rank, steps }))
            .chain(listed.iter().copied())
    }

    /// The contribution of `rank`, if it is a member.
    pub fn get(&self, rank: Rank) -> Option<Contribution> {
        match self {
            RoundMembers::All { ranks, steps } => (rank < *ranks).then_some(Contribution {
                rank,
                steps: *steps,
            }),
            RoundMembers::Listed(v) => v.binary_search_by_key(&rank, |c| c.rank).ok().map(|i| v[i]),
        }
    }
}

/// What the compute side gets when it arrives at a round.
#[derive(Debug, Clone)]
pub struct RoundResult {
    /// The round the compute side arrived at.
    pub requested: u64,
    /// The round whose result this is (`>= requested`; later when the rank was far behind).
    pub round: u64,
    /// Group round or global sync.
    pub kind: RoundKind,
    /// Sum of the members' contributions.
    pub sum: Arc<Payload>,
    /// The members and the steps each contribution embodied.
    pub members: RoundMembers,
    /// This rank's contribution.
    pub own: Contribution,
    /// True when this rank's contribution was the one it arrived with.
    pub fresh: bool,
}

impl RoundResult {
    /// Hands the sum's memory back for reuse once nobody else holds it (the engine may keep a
    /// result for a rank that reads it again).
    pub fn recycle(self) {
        if let Ok(p) = Arc::try_unwrap(self.sum) {
            p.recycle();
        }
    }

    /// Staleness of each member's contribution relative to `round`.
    pub fn staleness(&self) -> impl Iterator<Item = u64> + '_ {
        self.members.iter().map(|c| c.staleness(self.round))
    }

    /// Counts the staleness of each member's contribution into `into` (in constant time for a
    /// global sync, whatever the job's size).
    pub fn record_staleness(&self, into: &mut crate::util::Histogram) {
        match &self.members {
            RoundMembers::All { ranks, steps } => {
                let s = Contribution {
                    rank: 0,
                    steps: *steps,
                }
                .staleness(self.round);
                into.record_n(s, *ranks as u64);
            }
            RoundMembers::Listed(_) => into.record_all(self.staleness()),
        }
    }
}

struct Waiter {
    id: ReqId,
    round: u64,
    since: Time,
}

pub(super) struct Stream {
    grouping: Grouping,
    trigger: Trigger,
    mode: ContributionMode,
    read: ReadMode,
    sync_period: Option<u64>,
    published: Payload,
    published_steps: u64,
    /// DropLate: `published` holds a gradient that no round has consumed yet.
    unconsumed: bool,
    next_round: u64,
    activated: RoundMap<()>,
    executing: Option<u64>,
    results: RoundMap<Outcome>,
    waiter: Option<Waiter>,
}

impl Stream {
    fn is_sync(&self, round: u64) -> bool {
        self.sync_period
            .is_some_and(|tau| (round + 1).is_multiple_of(tau))
    }

    fn publish(&mut self, data: Payload, steps: u64) {
        match self.mode {
            ContributionMode::Model => std::mem::replace(&mut self.published, data).recycle(),
            ContributionMode::Accumulate => self.published.add(&data),
            ContributionMode::DropLate => {
                std::mem::replace(&mut self.published, data).recycle();
                self.unconsumed = true;
            }
        }
        self.published_steps = steps;
    }

    /// DropLate: the round the published gradient was for has run without it; drop it.
    fn drop_unconsumed(&mut self) {
        if self.unconsumed {
            self.published.fill_zero();
            self.unconsumed = false;
        }
    }

    pub fn waiting_since(&self) -> Option<Time> {
        // Only a compute side waiting for someone else's activation can wait forever without
        // a running schedule to time out.
        match (&self.waiter, self.executing) {
            (Some(w), None) if w.round >= self.next_round => Some(w.since),
            _ => None,
        }
    }

    pub fn overdue(&self, rank: Rank, now: Time, timeout: Duration) -> Option<Error> {
        let since = self.waiting_since()?;
        let w = self.waiter.as_ref()?;
        (now.saturating_sub(since) >= timeout).then(|| Error::Timeout {
            rank,
            op: Op::Round(w.round),
            waited: now.saturating_sub(since),
            missing: self.initiator(w.round).into_iter().collect(),
        })
    }

    fn initiator(&self, round: u64) -> Option<Rank> {
        match self.trigger {
            Trigger::Majority { seed } => Some(initiator(seed, round, self.grouping.ranks())),
            _ => None,
        }
    }

    /// The lowest round not yet run at this rank.
    #[cfg(test)]
    pub fn next_round(&self) -> u64 {
        self.next_round
    }

    /// Whether `round` is activated here and waits to run.
    #[cfg(test)]
    pub fn is_activated(&self, round: u64) -> bool {
        self.activated.contains(round)
    }

    pub fn describe_wait(&self) -> Option<String> {
        self.waiter.as_ref().map(|w| {
            format!(
                "compute side waits for round {} (next to run: {}, activated: {:?})",
                w.round,
                self.next_round,
                self.activated.rounds().collect::<Vec<_>>()
            )
        })
    }
}

/// Bits of a stream message's sequence number that hold the round; the bits above hold the
/// stream's epoch, so that messages of a closed stream never match the next one.
const ROUND_BITS: u32 = 48;

pub(super) fn stream_seq(epoch: u64, round: u64) -> u64 {
    (epoch << ROUND_BITS) | (round & ((1 << ROUND_BITS) - 1))
}

fn split_seq(seq: u64) -> (u64, u64) {
    (seq >> ROUND_BITS, seq & ((1 << ROUND_BITS) - 1))
}

/// The initiator of `round` under majority triggering: a hash of the shared seed and the round.
pub fn initiator(seed: u64, round: u64, ranks: usize) -> Rank {
    // SplitMix64 finalizer: cheap, well mixed, identical on every rank.
    let mut z = seed ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % ranks as u64) as Rank
}

impl Engine {
    pub(super) fn open_stream(
        &mut self,
        now: Time,
        cfg: StreamConfig,
        out: &mut Vec<Action>,
    ) -> Result<(), Error> {
        if let Some(old) = &self.stream
            && (old.waiter.is_some() || old.executing.is_some())
        {
            return Err(Error::Protocol {
                rank: self.rank,
                op: Op::Other("open stream"),
                detail: "the previous stream still has a round in progress".into(),
            });
        }
        if cfg.sync_period == Some(0) {
            return Err(ConfigError::ZeroTau.into());
        }
        let grouping = Grouping::new(self.ranks, cfg.group_size, cfg.grouping)?;
        self.round_schedules = super::schedule_cache::ScheduleCache::for_grouping(&grouping);
        let initial_len = cfg.initial.len();
        let published = match cfg.mode {
            ContributionMode::Model => cfg.initial,
            ContributionMode::Accumulate | ContributionMode::DropLate => {
                Payload::zeros_like(&cfg.initial, initial_len)
            }
        };
        self.stream = Some(Stream {
            grouping,
            trigger: cfg.trigger,
            mode: cfg.mode,
            read: cfg.read,
            sync_period: cfg.sync_period,
            published,
            published_steps: cfg.initial_steps,
            unconsumed: false,
            next_round: cfg.initial_steps,
            activated: RoundMap::default(),
            executing: None,
            results: RoundMap::default(),
            waiter: None,
        });
        self.opened_streams += 1;
        let epoch = self.opened_streams - 1;
        // Messages of earlier streams can no longer be used.
        self.unexpected.retain(|(tag, _), _| {
            !matches!(tag.kind, Kind::Round | Kind::Sync) || split_seq(tag.seq).0 >= epoch
        });
        for (e, round) in std::mem::take(&mut self.early_activations) {
            self.activate(now, e, round, out);
        }
        Ok(())
    }

    /// Epoch of the open stream.
    fn epoch(&self) -> u64 {
        self.opened_streams.saturating_sub(1)
    }

    pub(super) fn arrive(
        &mut self,
        now: Time,
        id: ReqId,
        round: u64,
        data: Payload,
        steps: u64,
        out: &mut Vec<Action>,
    ) -> Result<(), Error> {
        let rank = self.rank;
        let ranks = self.ranks;
        let Some(s) = self.stream.as_mut() else {
            return Err(Error::Protocol {
                rank,
                op: Op::Round(round),
                detail: "the stream is not open".into(),
            });
        };
        if s.waiter.is_some() {
            return Err(Error::Protocol {
                rank,
                op: Op::Round(round),
                detail: "a previous arrival is still waiting".into(),
            });
        }
        if data.len() != s.published.len() {
            return Err(Error::Protocol {
                rank,
                op: Op::Round(round),
                detail: format!(
                    "contribution of {} elements, the stream carries {}",
                    data.len(),
                    s.published.len()
                ),
            });
        }
        let done_or_running = round < s.next_round || s.executing == Some(round);
        if !done_or_running && round > s.next_round {
            return Err(Error::Protocol {
                rank,
                op: Op::Round(round),
                detail: format!("arrived at round {round} before round {} ran", s.next_round),
            });
        }
        s.publish(data, steps);
        s.waiter = Some(Waiter {
            id,
            round,
            since: now,
        });
        if !done_or_running {
            if s.is_sync(round) {
                self.start_round(now, round);
            } else {
                let own = match s.trigger {
                    Trigger::Solo => true,
                    Trigger::Majority { seed } => initiator(seed, round, ranks) == rank,
                    Trigger::Lockstep => false,
                };
                let lockstep = s.trigger == Trigger::Lockstep;
                if own {
                    let seq = stream_seq(self.epoch(), round);
                    self.forward_activation(now, seq, rank, None, out);
                }
                if (own || lockstep)
                    && let Some(s) = self.stream.as_mut()
                {
                    s.activated.insert(round, ());
                }
                self.try_start(now);
            }
        }
        self.try_deliver(out);
        Ok(())
    }

    /// Sends this rank's edges of the activation tree above the dimension it received on
    /// ([`activation_edges`]: an edge depends on its sender and dimension only, whatever the
    /// root). Each edge is sent at most once per round however many activators' trees pass
    /// through this rank, so a round costs at most `ceil(log2 P)` messages per rank (fflib's
    /// consumable sends, extended to every P; the topology module proves that skipping an
    /// edge already sent loses no rank).
    fn forward_activation(
        &mut self,
        now: Time,
        seq: u64,
        root: Rank,
        received_on: Option<u32>,
        out: &mut Vec<Action>,
    ) {
        let edges = activation_edges(self.rank, self.ranks, received_on);
        let dims = edges.clone().fold(0, |m, e| m | 1 << e.dim);
        let sent_before = self.activations_sent.mark(seq, dims);
        for e in edges.filter(|e| sent_before & (1 << e.dim) == 0) {
            self.send_activation(now, seq, root, e.rank, e.dim, out);
        }
    }

    /// Sends the activation on the edge to `to` (reached on `dim`); when `to` was declared
    /// dead (elastic mode), sends what it would have forwarded in its place, so that the ranks
    /// below it in the tree are still activated and take part passively.
    fn send_activation(
        &mut self,
        now: Time,
        seq: u64,
        root: Rank,
        to: Rank,
        dim: u32,
        out: &mut Vec<Action>,
    ) {
        if self.dead.contains(to) {
            // Its edges lie on higher dimensions only, so this ends within log2(P) levels.
            for e in activation_edges(to, self.ranks, Some(dim)) {
                if e.rank == self.rank {
                    // This rank is below the dead one: it forwards from that dimension on.
                    self.forward_activation(now, seq, root, Some(e.dim), out);
                } else {
                    self.send_activation(now, seq, root, e.rank, e.dim, out);
                }
            }
            return;
        }
        self.stats.activations_sent += 1;
        if self.tracer.enabled() {
            let (_, round) = split_seq(seq);
            let args = serde_json::json!({ "round": round, "to": to, "root": root });
            self.tracer.instant(
                crate::trace::ENGINE,
                "activation",
                "activation sent",
                now,
                args,
            );
        }
        let env = Envelope {
            from: self.rank,
            tag: Tag {
                kind: Kind::Activation,
                seq,
                step: dim as u16,
            },
            meta: Meta {
                aux: root as u64,
                ..Meta::default()
            },
            data: Payload::Size(0),
        };
        self.send(to, env, out);
    }

    pub(super) fn on_activation(&mut self, now: Time, env: &Envelope, out: &mut Vec<Action>) {
        let root = env.meta.aux as Rank;
        let (epoch, round) = split_seq(env.tag.seq);
        if self.tracer.enabled() {
            let args = serde_json::json!({ "round": round, "from": env.from, "root": root });
            self.tracer.instant(
                crate::trace::ENGINE,
                "activation",
                "activation received",
                now,
                args,
            );
        }
        if root >= self.ranks {
            let err = Error::Protocol {
                rank: self.rank,
                op: Op::Round(round),
                detail: format!("activation from peer {} names root {root}", env.from),
            };
            self.fail(err, out);
            return;
        }
        let early = self.stream.is_none() || epoch > self.epoch();
        if early
            && self.early_activations.len() >= super::MAX_KEPT_PER_PEER
            && !self.early_activations.contains(&(epoch, round))
        {
            // A correct job activates at most a few rounds of a stream this rank has not
            // opened yet; nor is the flood forwarded.
            let reason = format!(
                "it activated more than {} rounds of streams this rank has not opened",
                super::MAX_KEPT_PER_PEER
            );
            self.on_peer_lost(now, env.from, &reason, out);
            return;
        }
        self.forward_activation(now, env.tag.seq, root, Some(u32::from(env.tag.step)), out);
        self.activate(now, epoch, round, out);
    }

    fn activate(&mut self, now: Time, epoch: u64, round: u64, out: &mut Vec<Action>) {
        if self.stream.is_none() || epoch > self.epoch() {
            // Several forwarders may activate the same round: keep it once.
            if !self.early_activations.contains(&(epoch, round)) {
                self.early_activations.push((epoch, round));
            }
            return;
        }
        if epoch < self.epoch() {
            return;
        }
        let Some(s) = self.stream.as_mut() else {
            return;
        };
        if round < s.next_round || s.executing == Some(round) || s.is_sync(round) {
            return;
        }
        s.activated.insert(round, ());
        self.try_start(now);
        self.try_deliver(out);
    }

    /// Starts the next round if it is activated and nothing runs.
    fn try_start(&mut self, now: Time) {
        let Some(s) = self.stream.as_ref() else {
            return;
        };
        if s.executing.is_none() && s.activated.contains(s.next_round) && !s.is_sync(s.next_round) {
            let r = s.next_round;
            self.start_round(now, r);
        }
    }

    fn start_round(&mut self, now: Time, round: u64) {
        let rank = self.rank;
        let ranks = self.ranks;
        let algorithm = self.cfg.algorithm;
        let Some(s) = self.stream.as_mut() else {
            return;
        };
        s.activated.remove(round);
        s.executing = Some(round);
        let sync = s.is_sync(round);
        // A sync's members are the job, and a butterfly group's a mask: no list is made for
        // either.
        let members = if sync {
            Members::Job(ranks)
        } else if let Some((base, mask)) = s.grouping.group_mask(rank, round) {
            Members::masked(ranks, base, mask)
        } else {
            Members::among(ranks, s.grouping.group_of(rank, round))
        };
        let len = s.published.len();
        let data = match s.mode {
            ContributionMode::Model => s.published.view(0..len),
            ContributionMode::Accumulate | ContributionMode::DropLate => {
                s.unconsumed = false;
                let zeros = Payload::zeros_like(&s.published, len);
                std::mem::replace(&mut s.published, zeros)
            }
        };
        let arrived = s.waiter.as_ref().is_some_and(|w| w.round == round);
        // Room for every member of a group, and one more for the moment a merge appends a
        // whole list before removing the rank named twice, so that merging never grows it. A
        // sync tracks contributions only in elastic mode, where its list grows as it goes
        // rather than each of thousands of ranks holding room for all of them.
        let mut contributions = Vec::with_capacity(if sync { 1 } else { members.len() + 1 });
        contributions.push(Contribution {
            rank,
            steps: s.published_steps,
        });
        let (kind, op) = if sync {
            (Kind::Sync, Op::Sync(round))
        } else {
            (Kind::Round, Op::Round(round))
        };
        if !sync {
            self.stats.rounds += 1;
            if !arrived {
                self.stats.passive_rounds += 1;
            }
        } else {
            self.stats.syncs += 1;
        }
        self.watch(now, &members);
        // Built over positions in the group: the running schedule maps them to ranks.
        let schedule = match members.position(rank) {
            None => Arc::new(Schedule::default()),
            Some(position) if self.cfg.elastic => {
                let living =
                    (0..members.len()).filter(|&p| !self.dead.contains(members.rank_at(p)));
                Arc::new(crate::schedule::exchange_among(position, living, len))
            }
            Some(position) => {
                self.round_schedules
                    .allreduce(members.len(), position, len, &algorithm)
            }
        };
        let epoch = self.epoch();
        self.start(
            now,
            members,
            Owner::Stream { epoch, round },
            op,
            kind,
            stream_seq(epoch, round),
            schedule,
            data,
            0.0,
            contributions,
        );
    }

    pub(super) fn on_round_done(
        &mut self,
        now: Time,
        epoch: u64,
        round: u64,
        sum: Payload,
        members: Vec<Contribution>,
        out: &mut Vec<Action>,
    ) {
        if epoch != self.epoch() {
            sum.recycle();
            return;
        }
        let ranks = self.ranks;
        let elastic = self.cfg.elastic;
        // In elastic mode only the living contributed to a sync.
        let contributors = if elastic { members.len().max(1) } else { ranks };
        let Some(s) = self.stream.as_mut() else {
            return;
        };
        s.executing = None;
        s.next_round = round + 1;
        let kind = if s.is_sync(round) {
            if s.mode == ContributionMode::Model {
                // A passive contribution to the next rounds should be the consensus, not the
                // model every rank has just averaged away.
                let mut avg = sum.duplicate();
                avg.scale(1.0 / contributors as f32);
                std::mem::replace(&mut s.published, avg).recycle();
                s.published_steps = round + 1;
            }
            RoundKind::Sync
        } else {
            RoundKind::Group
        };
        // A sync only runs once every rank has arrived: every member is fresh, and its
        // messages carry no member lists (except in elastic mode, where who is left counts).
        let members = if kind == RoundKind::Sync && !elastic {
            RoundMembers::All {
                ranks,
                steps: round + 1,
            }
        } else {
            RoundMembers::Listed(members)
        };
        s.results.insert(
            round,
            Outcome {
                kind,
                sum: Arc::new(sum),
                members,
            },
        );
        if s.waiter.as_ref().is_some_and(|w| w.round <= round) {
            // Before the next round can start and take it.
            s.drop_unconsumed();
        }
        self.try_start(now);
        self.try_deliver(out);
    }

    /// Answers the waiting compute side if its result is there.
    fn try_deliver(&mut self, out: &mut Vec<Action>) {
        let rank = self.rank;
        let Some(s) = self.stream.as_mut() else {
            return;
        };
        let Some(w) = s.waiter.as_ref() else {
            return;
        };
        let chosen = match s.read {
            ReadMode::Latest => s.results.latest_from(w.round),
            ReadMode::Exact => s.results.contains(w.round).then_some(w.round),
        };
        let Some(r) = chosen else {
            return;
        };
        let outcome = match s.read {
            ReadMode::Latest => {
                // Keep the chosen result: a rank far behind may read it again next iteration.
                for old in s.results.drain_before(r) {
                    if let Ok(p) = Arc::try_unwrap(old.sum) {
                        p.recycle();
                    }
                }
                let Some(o) = s.results.get(r) else {
                    return;
                };
                Outcome {
                    kind: o.kind,
                    sum: Arc::clone(&o.sum),
                    members: o.members.clone(),
                }
            }
            ReadMode::Exact => match s.results.remove(r) {
                Some(o) => o,
                None => return,
            },
        };
        let Some(w) = s.waiter.take() else {
            return;
        };
        s.drop_unconsumed();
        let own = outcome
            .members
            .get(rank)
            .unwrap_or(Contribution { rank, steps: 0 });
        let result = RoundResult {
            requested: w.round,
            round: r,
            kind: outcome.kind,
            sum: outcome.sum,
            fresh: own.steps == w.round + 1,
            own,
            members: outcome.members,
        };
        self.complete(w.id, Ok(Response::Round(result)), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use crate::util::Histogram;

    #[test]
    fn all_members_read_like_the_list_they_stand_for() {
        let all = RoundMembers::All { ranks: 4, steps: 7 };
        let list =
            RoundMembers::Listed((0..4).map(|rank| Contribution { rank, steps: 7 }).collect());
        for m in [&all, &list] {
            assert_eq!(m.len(), 4);
            assert!(!m.is_empty());
            assert_eq!(m.iter().map(|c| c.rank).collect::<Vec<_>>(), [0, 1, 2, 3]);
            assert_eq!(m.get(2), Some(Contribution { rank: 2, steps: 7 }));
            assert_eq!(m.get(4), None);
        }
        let result = |members| RoundResult {
            requested: 7,
            round: 8,
            kind: RoundKind::Sync,
            sum: Arc::new(Payload::Size(0)),
            members,
            own: Contribution { rank: 0, steps: 7 },
            fresh: false,
        };
        let (mut a, mut b) = (Histogram::default(), Histogram::default());
        result(all).record_staleness(&mut a);
        result(list).record_staleness(&mut b);
        assert_eq!(a, b);
        assert_eq!(a.count(2), 4);
    }

    proptest::proptest! {
        /// The sorted deque keeps exactly what a tree map trimmed to its newest
        /// `SentActivations::KEPT` keys keeps, in any order of rounds (mostly new ones, some old
        /// and repeated, as activations arrive).
        #[test]
        fn sent_activations_match_a_trimmed_tree_map(
            marks in proptest::collection::vec((0u64..600, 0u32..12, proptest::bool::ANY), 0..2_000)
        ) {
            let mut deque = SentActivations::default();
            let mut model = BTreeMap::<u64, u64>::new();
            for (i, (back, dim, recent)) in marks.into_iter().enumerate() {
                // Most rounds are at or near the newest; others go far back.
                let newest = i as u64 / 3;
                let seq = if recent { newest.saturating_sub(back % 4) } else { newest.saturating_sub(back) };
                let dims = 1u64 << dim | 1 << (dim + 1);
                let mask = model.entry(seq).or_insert(0);
                let expected = *mask;
                *mask |= dims;
                while model.len() > SentActivations::KEPT {
                    model.pop_first();
                }
                proptest::prop_assert_eq!(deque.mark(seq, dims), expected);
                let kept: Vec<(u64, u64)> = model.iter().map(|(&s, &m)| (s, m)).collect();
                proptest::prop_assert_eq!(deque.masks.iter().copied().collect::<Vec<_>>(), kept);
            }
        }
    }
}
