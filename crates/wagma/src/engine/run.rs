//! One schedule being executed by the engine.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::buffer::WorkBuf;
use super::contributions::OwnContributions;
use super::rank_set::RankSet;
use super::{FoldRequest, ReqId, Time};
use crate::Rank;
use crate::error::{Error, Op};
use crate::payload::{Payload, Reduce};
use crate::prefetch::{prefetch, prefetch_slice};
use crate::schedule::{Combine, Phase, Schedule, Transfer};
use crate::topology::subset_members;
use crate::transport::{Contribution, Contributions, Envelope, Fold, FoldInto, Kind, Meta, Tag};

/// The ranks a schedule reduces over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Members {
    /// Every rank of a job of this many (a collective, or a round or sync of every rank).
    Job(usize),
    /// Every `base | s` for the subsets `s` of `mask` (`base & mask == 0`): the butterfly's
    /// groups when P and S are powers of two. Membership is arithmetic, so that checking a
    /// contribution list reads no list of members (a cache miss per message at thousands of
    /// simulated ranks), and no engine keeps one.
    Masked {
        /// The bits every member shares.
        base: Rank,
        /// The bits in which members differ.
        mask: Rank,
    },
    /// Any other group, sorted.
    Group(Vec<Rank>),
}

impl Members {
    /// The members of a sorted `group` in a job of `ranks`: the job itself when the group holds
    /// every rank, so that no engine keeps a list of P.
    pub(super) fn among(ranks: usize, group: Vec<Rank>) -> Self {
        if group.len() == ranks {
            return Members::Job(ranks);
        }
        match group.first() {
            Some(&first) => {
                let mask = group.iter().fold(0, |m, &r| m | (r ^ first));
                let base = first & !mask;
                // `2^k` distinct ranks that agree outside `k` bits are all of their subsets.
                let masked = group.len().is_power_of_two()
                    && group.len().trailing_zeros() == mask.count_ones()
                    && group.windows(2).all(|w| w[0] < w[1])
                    && group.iter().all(|&r| r & !mask == base);
                if masked {
                    Members::masked(ranks, base, mask)
                } else {
                    Members::Group(group)
                }
            }
            None => Members::Group(group),
        }
    }

    /// Every `base | s` for the subsets `s` of `mask` (`base & mask == 0`), in a job of
    /// `ranks`: the job itself when that is every rank.
    pub(super) fn masked(ranks: usize, base: Rank, mask: Rank) -> Self {
        if mask.count_ones() == ranks.trailing_zeros() && ranks.is_power_of_two() {
            Members::Job(ranks)
        } else {
            Members::Masked { base, mask }
        }
    }

    /// The members in ascending order.
    pub(super) fn ranks(&self) -> std::borrow::Cow<'_, [Rank]> {
        match self {
            Members::Job(n) => (0..*n).collect::<Vec<_>>().into(),
            Members::Masked { base, mask } => subset_members(*base, *mask).into(),
            Members::Group(g) => g.as_slice().into(),
        }
    }

    /// How many members there are.
    pub(super) fn len(&self) -> usize {
        match self {
            Members::Job(n) => *n,
            Members::Masked { mask, .. } => 1 << mask.count_ones(),
            Members::Group(g) => g.len(),
        }
    }

    fn contains(&self, r: Rank) -> bool {
        match self {
            Members::Job(n) => r < *n,
            Members::Masked { base, mask } => r & !mask == *base,
            Members::Group(g) => g.binary_search(&r).is_ok(),
        }
    }

    /// The member at position `pos` in ascending order. Only positions below [`Members::len`]
    /// name members; the job maps every position to itself, since a caller's schedule over
    /// the job may name any rank.
    pub(super) fn rank_at(&self, pos: usize) -> Rank {
        match self {
            Members::Job(_) => pos,
            Members::Masked { base, mask } => base | deposit(pos, *mask),
            Members::Group(g) => g.get(pos).copied().unwrap_or(pos),
        }
    }

    /// The position of `rank` among the members in ascending order.
    pub(super) fn position(&self, rank: Rank) -> Option<usize> {
        match self {
            Members::Job(_) => self.contains(rank).then_some(rank),
            Members::Masked { mask, .. } => self.contains(rank).then(|| extract(rank, *mask)),
            Members::Group(g) => g.binary_search(&rank).ok(),
        }
    }
}

/// Where `mask`'s ones start when they are one run (none for no ones or several runs).
fn run_of_ones(mask: usize) -> Option<u32> {
    let shift = mask.trailing_zeros();
    let low = mask.checked_shr(shift).unwrap_or(0);
    (low != 0 && low & low.wrapping_add(1) == 0).then_some(shift)
}

/// The low bits of `bits` placed, in order, at the set bits of `mask` (x86's `pdep`).
fn deposit(mut bits: usize, mut mask: usize) -> usize {
    // A run of ones (most butterfly windows) is a shift: this is read for every message.
    if let Some(shift) = run_of_ones(mask) {
        return (bits << shift) & mask;
    }
    let mut out = 0;
    while mask != 0 {
        let lowest = mask & mask.wrapping_neg();
        if bits & 1 != 0 {
            out |= lowest;
        }
        bits >>= 1;
        mask &= mask - 1;
    }
    out
}

/// The bits of `x` at the set bits of `mask`, packed into the low bits in order (`pext`).
fn extract(x: usize, mut mask: usize) -> usize {
    if let Some(shift) = run_of_ones(mask) {
        return (x & mask) >> shift;
    }
    let (mut out, mut at) = (0, 0);
    while mask != 0 {
        let lowest = mask & mask.wrapping_neg();
        if x & lowest != 0 {
            out |= 1 << at;
        }
        at += 1;
        mask &= mask - 1;
    }
    out
}

impl std::fmt::Display for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Members::Job(n) => write!(f, "of the job's {n} ranks"),
            Members::Masked { .. } | Members::Group(_) => write!(f, "{:?}", self.ranks()),
        }
    }
}

/// Who gets the result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Owner {
    /// A request of the compute side.
    Request(ReqId),
    /// Round (group or sync) of the wait-avoiding stream of this epoch.
    Stream {
        /// The stream's epoch.
        epoch: u64,
        /// The round.
        round: u64,
    },
    /// An exchange of the AD-PSGD gossip loop.
    Gossip,
}

/// Fewest elements of a received part worth asking the transport to fold as it arrives
/// (256 KiB).
const FOLD_MIN_ELEMENTS: usize = 1 << 16;

/// Where the current phase stands with a fold of its one received part ([`Fold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FoldState {
    /// None asked for.
    Unasked,
    /// Asked for, the part not taken yet.
    Asked,
    /// The part came folded: it is the phase's result.
    Folded,
}

/// The received parts and weights of a phase being reduced: empty between phases, kept only
/// for their capacity (schedules reduce in many phases of equal shape).
#[derive(Default)]
pub(super) struct ReduceScratch {
    operands: Vec<(Rank, Payload)>,
    weights: Vec<(Rank, f64)>,
}

/// A schedule in progress.
pub(super) struct Running {
    pub owner: Owner,
    pub op: Op,
    pub kind: Kind,
    pub seq: u64,
    pub started: Time,
    /// Where the operation's timeout counts from: its start, or the last time it waited on
    /// (elastic mode) for peers that were late but still heard from.
    pub timer_from: Time,
    /// Its peers are positions among `members` (ranks, when the members are the job): every
    /// member at the same position of a group of the same size shares one program.
    schedule: Arc<Schedule>,
    phase: usize,
    posted: bool,
    /// Whether the current phase asked the transport to fold its one received part.
    fold: FoldState,
    buf: WorkBuf,
    weight: f64,
    /// Carried and merged only for group rounds, where passive members make them informative.
    contributions: OwnContributions,
    track: bool,
    /// The group the schedule sums over: the only ranks a contribution list may name.
    members: Members,
    got: Vec<Option<Envelope>>,
    /// Receive slots of the current phase whose peer is dead (elastic mode): satisfied empty.
    absent: Vec<bool>,
    /// Receives of the current phase still missing.
    waiting: usize,
    /// `(peer, step)` to receive slot, for phases with many receives.
    index: FxHashMap<(Rank, u16), usize>,
    /// Stall reports made so far.
    pub stall_reports: u32,
}

impl Running {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        members: Members,
        owner: Owner,
        op: Op,
        kind: Kind,
        seq: u64,
        schedule: Arc<Schedule>,
        buf: Payload,
        weight: f64,
        contributions: Vec<Contribution>,
        started: Time,
        track_all: bool,
    ) -> Running {
        let track = kind == Kind::Round || track_all;
        Running {
            owner,
            op,
            kind,
            seq,
            started,
            timer_from: started,
            schedule,
            phase: 0,
            posted: false,
            fold: FoldState::Unasked,
            buf: WorkBuf::new(buf),
            weight,
            contributions: OwnContributions::new(contributions),
            track,
            members,
            got: Vec::new(),
            absent: Vec::new(),
            waiting: 0,
            index: FxHashMap::default(),
            stall_reports: 0,
        }
    }

    /// Prefetch hints for a message about to arrive, one level of pointers at a time (see
    /// [`super::Engine::prefetch`]): 3, this run's own buffers; 4, its current phase and the
    /// next (the message often completes this one, and the next is posted at once), with
    /// their transfers when they are held in place. Transfers held apart are not prefetched:
    /// one more level of lookahead cost more than it saved.
    pub fn prefetch(&self, level: u8) {
        match level {
            3 => {
                prefetch(&*self.schedule, 0..1);
                prefetch_slice(&self.got, 2);
                prefetch_slice(&self.absent, 1);
                prefetch_slice(self.contributions.as_slice(), 2);
            }
            // Read only now that level 3 has asked for the schedule.
            4 => {
                let phases = self.schedule.phases.get(self.phase..).unwrap_or_default();
                prefetch_slice(&phases[..phases.len().min(2)], 3);
            }
            _ => {}
        }
    }

    /// True when the schedule has one phase, so that its start is when it began waiting on
    /// every peer it misses (a later phase's wait may be caused by a peer of an earlier one).
    pub fn single_phase(&self) -> bool {
        self.schedule.phases.len() <= 1
    }

    /// Every peer of the schedule.
    pub fn peers(&self) -> Vec<Rank> {
        // Positions map to ranks in ascending order: the list stays sorted.
        self.schedule
            .peers()
            .into_iter()
            .map(|p| self.members.rank_at(p))
            .collect()
    }

    /// The operation and its peers, for reports.
    pub fn describe(&self) -> String {
        format!("{} (with ranks {:?})", self.op, self.peers())
    }

    /// Stores a received message in slot `i`.
    fn fill(&mut self, i: usize, env: Envelope) {
        if self.got[i].is_none() && !self.absent[i] {
            self.waiting -= 1;
        }
        self.got[i] = Some(env);
    }

    /// Gives up on `peer` (declared dead): its missing receives of the current phase are
    /// satisfied with nothing.
    pub fn mark_absent(&mut self, peer: Rank) {
        if !self.posted {
            return;
        }
        let Some(phase) = self.schedule.phases.get(self.phase) else {
            return;
        };
        for (i, r) in phase.recvs.iter().enumerate() {
            if self.members.rank_at(r.peer) == peer && self.got[i].is_none() && !self.absent[i] {
                self.absent[i] = true;
                self.waiting -= 1;
            }
        }
    }

    /// Whether the current phase asked for a fold that its message, now taken, came without:
    /// the request must be withdrawn (once).
    pub fn fold_unused(&mut self) -> bool {
        let unused = self.fold == FoldState::Asked;
        if unused {
            self.fold = FoldState::Unasked;
        }
        unused
    }

    /// Takes `env` if the current phase waits for it; hands it back otherwise.
    pub fn accept(
        &mut self,
        rank: Rank,
        mut env: Envelope,
        folded: bool,
    ) -> Result<Option<Envelope>, Error> {
        if !self.posted {
            return Ok(Some(env));
        }
        let Some(phase) = self.schedule.phases.get(self.phase) else {
            return Ok(Some(env));
        };
        let slot = if self.index.is_empty() {
            phase.recvs.iter().enumerate().position(|(i, r)| {
                r.step == env.tag.step
                    && self.members.rank_at(r.peer) == env.from
                    && self.got[i].is_none()
            })
        } else {
            self.index
                .get(&(env.from, env.tag.step))
                .copied()
                .filter(|&i| self.got[i].is_none() && !self.absent[i])
        };
        match slot {
            None => Ok(Some(env)),
            Some(i) => {
                self.validate(rank, &mut env, phase.recvs[i].range.len())?;
                if folded {
                    self.took_folded(rank, env.from)?;
                }
                self.fill(i, env);
                Ok(None)
            }
        }
    }

    /// The current phase's part came folded: its result. Only a phase that asked for it can
    /// take one.
    #[cold]
    fn took_folded(&mut self, rank: Rank, from: Rank) -> Result<(), Error> {
        if self.fold != FoldState::Asked {
            return Err(Error::Protocol {
                rank,
                op: self.op.clone(),
                detail: format!(
                    "the part from rank {from} was folded on arrival, but this phase did not \
                     ask for it"
                ),
            });
        }
        self.fold = FoldState::Folded;
        Ok(())
    }

    /// The one part of `phase` that the transport may be asked about before it arrives: a
    /// large one, combined with this rank's real values ([`Self::ask_fold`]) or replacing a good
    /// share of the whole ([`Self::ask_place`]). (Fields apart: the phase borrows the schedule.)
    fn askable<'p>(buf: &WorkBuf, phase: &'p Phase) -> Option<&'p Transfer> {
        let [r] = &phase.recvs[..] else {
            return None;
        };
        let wanted = match phase.combine {
            Combine::Reduce(_) => !buf.is_virtual(),
            Combine::Copy => buf.layout(&r.range).is_some(),
        };
        (wanted && r.range.len() >= FOLD_MIN_ELEMENTS).then_some(r)
    }

    /// Asks the transport (through `asks`) to fold the part `recv` of the phase just posted
    /// into this rank's own as it arrives ([`Self::askable`]), laid out for the whole when
    /// `next` (the phase after) reads the rest of the whole beside it. Whether it asked.
    #[cold]
    fn ask_fold(
        buf: &mut WorkBuf,
        from: Rank,
        recv: &Transfer,
        tag: Tag,
        op: Reduce,
        next: Option<&Phase>,
        asks: &mut Vec<FoldRequest>,
    ) -> bool {
        // None for a virtual buffer.
        let Some(own) = buf.view(recv.range.clone()).downgrade() else {
            return false;
        };
        // A buffer for the whole only pays when the rest is read into it next: else it holds
        // twice the part's memory for nothing.
        let (len, range) = (buf.len(), &recv.range);
        let rest = match (range.start, range.end) {
            (0, end) => Some(end..len),
            (start, end) if end == len => Some(0..start),
            _ => None,
        };
        let rest_next = next.is_some_and(|next| {
            next.combine == Combine::Copy
                && matches!(&next.recvs[..], [r] if Some(&r.range) == rest.as_ref())
        });
        let layout = buf.layout(range).filter(|_| rest_next);
        asks.push(FoldRequest::Ask {
            from,
            fold: Fold {
                tag,
                into: FoldInto::Own { own, op, layout },
            },
        });
        true
    }

    /// Asks the transport (through `asks`) to read the part `recv` of the phase just posted,
    /// which replaces this rank's, into a buffer laid out for the whole ([`Self::askable`]).
    /// Not tracked: a placement that catches another message only lays its values out
    /// differently.
    #[cold]
    fn ask_place(
        buf: &WorkBuf,
        from: Rank,
        recv: &Transfer,
        tag: Tag,
        asks: &mut Vec<FoldRequest>,
    ) {
        if let Some(place) = buf.place(&recv.range) {
            asks.push(FoldRequest::Ask {
                from,
                fold: Fold {
                    tag,
                    into: FoldInto::Place(place),
                },
            });
        }
    }

    /// Checks `env` against this run. A contribution list equal to this rank's own is taken
    /// out of `env`: merging it would change nothing, and it need not be compared twice.
    fn validate(&self, rank: Rank, env: &mut Envelope, expect: usize) -> Result<(), Error> {
        if env.meta.total_len != self.buf.len() as u64 {
            return Err(Error::LengthMismatch {
                rank,
                op: self.op.clone(),
                peer: env.from,
                local: self.buf.len(),
                remote: usize::try_from(env.meta.total_len).unwrap_or(usize::MAX),
            });
        }
        // This rank's own list starts as itself and grows only by merging checked lists, so a
        // list equal to it (every message of an allgather's second half) is valid.
        if self.track {
            if self.contributions.equals(&env.meta.contributions) {
                env.meta.contributions = Contributions::default();
            } else if let Some(bad) = foreign_contribution(&self.members, &env.meta.contributions) {
                // A peer may only report members of this group, each once: otherwise it would
                // inflate the divisor of an average.
                return Err(Error::Protocol {
                    rank,
                    op: self.op.clone(),
                    detail: format!(
                        "peer {} reported contributions {:?}; {bad}",
                        env.from,
                        env.meta
                            .contributions
                            .iter()
                            .map(|c| c.rank)
                            .collect::<Vec<_>>(),
                    ),
                });
            }
        }
        if env.data.len() != expect {
            return Err(Error::Protocol {
                rank,
                op: self.op.clone(),
                detail: format!(
                    "peer {} sent {} elements for step {}, expected {expect}",
                    env.from,
                    env.data.len(),
                    env.tag.step
                ),
            });
        }
        Ok(())
    }

    /// Runs phases as far as the received messages allow; `Ok(true)` when finished.
    pub fn advance(
        &mut self,
        rank: Rank,
        unexpected: &mut FxHashMap<(Tag, Rank), VecDeque<Envelope>>,
        sends: &mut Vec<(Rank, Envelope)>,
        mut asks: Option<&mut Vec<FoldRequest>>,
        dead: &RankSet,
        scratch: &mut ReduceScratch,
    ) -> Result<bool, Error> {
        loop {
            let Some(phase) = self.schedule.phases.get(self.phase) else {
                return Ok(true);
            };
            if !self.posted {
                let (kind, seq) = (self.kind, self.seq);
                let tag = |step| Tag { kind, seq, step };
                for s in &phase.sends {
                    let env = Envelope {
                        from: rank,
                        tag: tag(s.step),
                        meta: Meta {
                            total_len: self.buf.len() as u64,
                            weight: self.weight,
                            aux: 0,
                            contributions: if self.track {
                                self.contributions.share()
                            } else {
                                Contributions::default()
                            },
                        },
                        data: self.buf.view(s.range.clone()),
                    };
                    sends.push((self.members.rank_at(s.peer), env));
                }
                // Refilled in place: a schedule runs many phases of equal shape.
                self.got.clear();
                self.got.resize_with(phase.recvs.len(), || None);
                self.absent.clear();
                let members = &self.members;
                self.absent.extend(
                    phase
                        .recvs
                        .iter()
                        .map(|r| dead.contains(members.rank_at(r.peer))),
                );
                self.waiting = self.absent.iter().filter(|&&a| !a).count();
                self.index.clear();
                if phase.recvs.len() > 8 {
                    self.index = phase
                        .recvs
                        .iter()
                        .enumerate()
                        .map(|(i, r)| ((members.rank_at(r.peer), r.step), i))
                        .collect();
                }
                self.posted = true;
                self.fold = FoldState::Unasked;
                // Nothing arrived early when the table is empty, and probing it would still
                // read its buffer, cold in the simulator.
                let early = if unexpected.is_empty() {
                    &[][..]
                } else {
                    &phase.recvs[..]
                };
                for (i, r) in early.iter().enumerate() {
                    let key = (tag(r.step), members.rank_at(r.peer));
                    if let Some(queue) = unexpected.get_mut(&key) {
                        let env = queue.pop_front();
                        if queue.is_empty() {
                            unexpected.remove(&key);
                        }
                        if let Some(mut env) = env {
                            self.validate(rank, &mut env, r.range.len())?;
                            // Field by field: `phase` borrows the schedule.
                            if self.got[i].is_none() && !self.absent[i] {
                                self.waiting -= 1;
                            }
                            self.got[i] = Some(env);
                        }
                    }
                }
                if let Some(asks) = asks.as_deref_mut() {
                    let next = self.schedule.phases.get(self.phase + 1);
                    // One peer's part, not here yet: the transport may combine it with this
                    // rank's as it arrives, or read it into place. (At most one per call: the
                    // phase then waits.)
                    if let Some(r) = Self::askable(&self.buf, phase)
                        && self.got[0].is_none()
                        && !self.absent[0]
                    {
                        let from = members.rank_at(r.peer);
                        match phase.combine {
                            Combine::Reduce(op) => {
                                let buf = &mut self.buf;
                                if Self::ask_fold(buf, from, r, tag(r.step), op, next, asks) {
                                    self.fold = FoldState::Asked;
                                }
                            }
                            Combine::Copy => {
                                Self::ask_place(&self.buf, from, r, tag(r.step), asks);
                            }
                        }
                    }
                    // The next phase's one part may come before that phase starts, from a
                    // peer a phase ahead: say now that it will be asked for.
                    if let Some(r) = next.and_then(|next| Self::askable(&self.buf, next))
                        && !dead.contains(members.rank_at(r.peer))
                    {
                        asks.push(FoldRequest::Expect {
                            from: members.rank_at(r.peer),
                            tag: tag(r.step),
                        });
                    }
                }
            }
            if self.waiting > 0 {
                return Ok(false);
            }
            let mut got = std::mem::take(&mut self.got);
            let single = got.iter().filter(|g| g.is_some()).count() == 1;
            // Absent slots (dead peers) contribute nothing.
            let received = phase
                .recvs
                .iter()
                .zip(got.drain(..))
                .filter_map(|(r, g)| g.map(|e| (r.range.clone(), e)));
            match phase.combine {
                Combine::Reduce(op) => Self::reduce(
                    &mut self.buf,
                    &mut self.weight,
                    self.track.then_some(&mut self.contributions),
                    rank,
                    received,
                    self.fold == FoldState::Folded,
                    scratch,
                    op,
                ),
                Combine::Copy => Self::copy(
                    &mut self.buf,
                    &mut self.weight,
                    self.track.then_some(&mut self.contributions),
                    single,
                    received,
                ),
            }
            self.got = got;
            self.phase += 1;
            self.posted = false;
        }
    }

    /// Folds the received ranges (all the same range) and the local one by `op` in ascending
    /// rank order; the weights are summed. `folded`: the one received part is already the
    /// result (the transport folded it on arrival).
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        buf: &mut WorkBuf,
        weight: &mut f64,
        mut contributions: Option<&mut OwnContributions>,
        rank: Rank,
        received: impl Iterator<Item = (Range<usize>, Envelope)>,
        folded: bool,
        scratch: &mut ReduceScratch,
        op: Reduce,
    ) {
        let ReduceScratch { operands, weights } = scratch;
        let mut range = None;
        for (r, env) in received {
            range.get_or_insert(r);
            if let Some(c) = contributions.as_deref_mut() {
                c.merge(&env.meta.contributions);
            }
            weights.push((env.from, env.meta.weight));
            operands.push((env.from, env.data));
        }
        let Some(range) = range else {
            return;
        };
        *weight = fold_weights(rank, *weight, weights);
        weights.clear();
        // Asked for only where a phase receives one part.
        debug_assert!(!folded || operands.len() == 1);
        if folded && let Some((_, result)) = operands.pop() {
            buf.replace(range, result);
        } else {
            buf.reduce(rank, range, operands, op);
        }
    }

    fn copy(
        buf: &mut WorkBuf,
        weight: &mut f64,
        mut contributions: Option<&mut OwnContributions>,
        single: bool,
        received: impl Iterator<Item = (Range<usize>, Envelope)>,
    ) {
        for (range, env) in received {
            if let Some(c) = contributions.as_deref_mut() {
                c.merge(&env.meta.contributions);
            }
            // A copy of the whole buffer carries the sender's weight too.
            if single && range.len() == buf.len() {
                *weight = env.meta.weight;
            }
            buf.replace(range, env.data);
        }
    }

    /// True when the current phase waits for a message from `peer`.
    pub fn waits_on(&self, peer: Rank) -> bool {
        self.missing().contains(&peer)
    }

    /// Peers whose messages the current phase still waits for.
    pub fn missing(&self) -> Vec<Rank> {
        let Some(phase) = self.schedule.phases.get(self.phase) else {
            return Vec::new();
        };
        if !self.posted {
            return Vec::new();
        }
        let mut v: Vec<Rank> = phase
            .recvs
            .iter()
            .zip(&self.got)
            .zip(&self.absent)
            .filter(|((_, g), a)| g.is_none() && !**a)
            .map(|(x, _)| x)
            .map(|(r, _)| self.members.rank_at(r.peer))
            .collect();
        v.dedup();
        v
    }

    /// The owner, buffer, weight and contributions of a finished schedule.
    pub fn into_result(self) -> (Owner, Payload, f64, Vec<Contribution>) {
        (
            self.owner,
            self.buf.finish(),
            self.weight,
            self.contributions.into_list(),
        )
    }
}

/// What is wrong with a peer's contribution list, if anything: a rank outside this
/// schedule's `members`, or ranks not strictly ascending (a rank counted twice).
fn foreign_contribution(members: &Members, list: &[Contribution]) -> Option<String> {
    let ascending = list.windows(2).all(|w| w[0].rank < w[1].rank);
    // The first rank in list order that is not a member. Every correct peer sends its list
    // sorted, and then the members need not be searched for each rank.
    let outside = match members {
        // Only the last rank of a sorted list can be beyond the job.
        Members::Job(n) if ascending => list.last().filter(|c| c.rank >= *n),
        Members::Group(g) if ascending => {
            // One walk over both sorted lists, from where the list's first rank sits among
            // the members (a binary search: a list from the upper half of a large group
            // starts far into it); the members passed are done with.
            let start = list
                .first()
                .map_or(0, |c| g.partition_point(|&m| m < c.rank));
            let mut ranks = g.get(start..).unwrap_or_default().iter();
            list.iter()
                .find(|c| ranks.find(|&&m| m >= c.rank) != Some(&c.rank))
        }
        // A mask's membership is arithmetic; a list out of order is searched rank by rank.
        _ => list.iter().find(|c| !members.contains(c.rank)),
    };
    if let Some(c) = outside {
        return Some(format!(
            "rank {} is not among the members {}",
            c.rank, members
        ));
    }
    (!ascending).then(|| "the ranks are not strictly ascending".to_string())
}

/// The sum of `own` (this rank's weight) and the others' weights, added in ascending rank order
/// (so that every member computes the same bits); sorts `others` by rank.
fn fold_weights(rank: Rank, own: f64, others: &mut [(Rank, f64)]) -> f64 {
    others.sort_by_key(|(r, _)| *r);
    let below = others.partition_point(|(r, _)| *r < rank);
    let (lo, hi) = others.split_at(below);
    let mut ws = lo
        .iter()
        .map(|o| o.1)
        .chain([own])
        .chain(hi.iter().map(|o| o.1));
    let first = ws.next().unwrap_or(own);
    ws.fold(first, |w, x| w + x)
}

#[cfg(test)]
mod tests {
    use super::super::contributions::tests::list;
    use super::*;

    #[test]
    fn a_group_of_every_rank_is_the_job() {
        assert_eq!(Members::among(4, vec![0, 1, 2, 3]), Members::Job(4));
        assert_eq!(Members::masked(4, 0, 3), Members::Job(4));
        assert_eq!(
            Members::masked(8, 4, 3),
            Members::Masked { base: 4, mask: 3 }
        );
        assert_eq!(
            Members::among(5, vec![0, 1, 2]),
            Members::Group(vec![0, 1, 2])
        );
        assert_eq!(&*Members::Job(3).ranks(), &[0, 1, 2]);
        assert_eq!(&*Members::Group(vec![1, 4]).ranks(), &[1, 4]);
    }

    #[test]
    fn butterfly_groups_are_held_as_a_mask() {
        // Bits 0 and 2 (a window that wraps around), and a single rank.
        assert_eq!(
            Members::among(8, vec![2, 3, 6, 7]),
            Members::Masked { base: 2, mask: 5 }
        );
        assert_eq!(
            Members::among(8, vec![5]),
            Members::Masked { base: 5, mask: 0 }
        );
        // Not every subset, a size that is no power of two, out of order, a rank twice.
        for group in [
            vec![0, 1, 2, 4],
            vec![0, 2, 4],
            vec![1, 0],
            vec![3, 3],
            vec![1, 2],
        ] {
            assert_eq!(Members::among(8, group.clone()), Members::Group(group));
        }
        // Every group of the butterfly, any window: the same members and membership.
        for (ranks, size) in [(16, 4), (32, 4), (64, 8), (128, 4), (2048, 64)] {
            let grouping = crate::topology::Grouping::new(ranks, size, Default::default());
            let Ok(grouping) = grouping else {
                panic!("a valid grouping of {ranks} ranks in groups of {size}");
            };
            for round in 0..6 {
                for group in grouping.partition(round) {
                    let members = Members::among(ranks, group.clone());
                    assert!(matches!(members, Members::Masked { .. }), "{group:?}");
                    // The grouping gives the same mask without a list.
                    for &r in &group {
                        let Some((base, mask)) = grouping.group_mask(r, round) else {
                            panic!("rank {r} of {ranks} has no mask in round {round}");
                        };
                        assert_eq!(Members::masked(ranks, base, mask), members);
                    }
                    assert_eq!(&*members.ranks(), group.as_slice());
                    for r in 0..ranks {
                        assert_eq!(members.contains(r), group.contains(&r));
                        assert_eq!(members.position(r), group.iter().position(|&m| m == r));
                    }
                    for (i, &r) in group.iter().enumerate() {
                        assert_eq!(members.rank_at(i), r);
                    }
                }
            }
        }
    }

    #[test]
    fn positions_map_to_members_in_ascending_order() {
        let masks = [
            (2, 0b101),
            (0, 0b1011),
            (16, 0b1100_0110),
            (5, 0),
            (8, 0b111),
        ];
        let groups = masks.map(|(base, mask)| Members::Masked { base, mask });
        let lists = [vec![3, 5, 6], vec![0, 2, 9, 11]].map(Members::Group);
        for members in groups.iter().chain(&lists).chain(&[Members::Job(6)]) {
            let ranks = members.ranks();
            for (i, &r) in ranks.iter().enumerate() {
                assert_eq!(members.rank_at(i), r, "{members:?}");
                assert_eq!(members.position(r), Some(i), "{members:?}");
            }
            for r in 0..300 {
                assert_eq!(
                    members.position(r).is_some(),
                    ranks.contains(&r),
                    "{members:?}"
                );
            }
        }
        // A caller's schedule over the job may name ranks beyond it.
        assert_eq!(Members::Job(4).rank_at(9), 9);
    }

    #[test]
    fn contribution_lists_name_only_members_in_ascending_order() {
        let group = Members::Group(vec![1, 3, 4, 8]);
        let check = |m: &Members, v: &[(Rank, u64)]| foreign_contribution(m, &list(v));
        assert_eq!(check(&group, &[]), None);
        assert_eq!(check(&group, &[(1, 1), (4, 2), (8, 1)]), None);
        let outside = |r: Rank| Some(format!("rank {r} is not among the members [1, 3, 4, 8]"));
        assert_eq!(check(&group, &[(0, 1)]), outside(0));
        assert_eq!(check(&group, &[(1, 1), (2, 1), (3, 1)]), outside(2));
        assert_eq!(check(&group, &[(3, 1), (9, 1)]), outside(9));
        // The first outsider in list order, also when the list is out of order after it or
        // before it.
        assert_eq!(check(&group, &[(3, 1), (5, 1), (4, 1)]), outside(5));
        assert_eq!(check(&group, &[(4, 1), (3, 1), (7, 1)]), outside(7));
        let unordered = Some("the ranks are not strictly ascending".to_string());
        assert_eq!(check(&group, &[(4, 1), (3, 1)]), unordered);
        assert_eq!(check(&group, &[(3, 1), (3, 2)]), unordered);
        let job = Members::Job(4);
        assert_eq!(check(&job, &[(0, 1), (3, 1)]), None);
        assert_eq!(
            check(&job, &[(2, 1), (4, 1)]),
            Some("rank 4 is not among the members of the job's 4 ranks".to_string())
        );
        assert_eq!(check(&job, &[(2, 1), (2, 1)]), unordered);
        let masked = Members::among(16, vec![1, 3, 9, 11]);
        assert_eq!(check(&masked, &[(1, 1), (9, 1), (11, 2)]), None);
        let outside = |r: Rank| Some(format!("rank {r} is not among the members [1, 3, 9, 11]"));
        assert_eq!(check(&masked, &[(1, 1), (5, 1), (11, 2)]), outside(5));
        assert_eq!(check(&masked, &[(9, 1), (3, 1), (0, 1)]), outside(0));
        assert_eq!(check(&masked, &[(9, 1), (3, 1)]), unordered);
    }
}
