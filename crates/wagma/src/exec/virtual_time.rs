//! The virtual-time executor: every rank is a task of one single-threaded scheduler, engines
//! exchange messages through a network model, and time only advances from event to event.
//!
//! With a seed it is deterministic, bit for bit: network jitter, ties between simultaneous
//! events and the order in which woken tasks run are hashes of the seed and of the identity of
//! the message, event or rank (never of a history-dependent random stream), so different seeds
//! explore different arrival orders, the same seed replays one exactly, and a run resumed from
//! a checkpoint taken at a barrier replays the rest of the uninterrupted run. Compute time exists only where a task
//! says so ([`Comm::compute`]); the real time a task spends between awaits is not counted. The
//! simulator runs the same engines over a LogGP network model at thousands of ranks.

use std::cmp::Reverse;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use dary_heap::QuaternaryHeap;
use rustc_hash::FxHashMap;

use super::threaded::collect;
use super::{Comm, JobResult, Pending, Port, Slot};
use crate::Rank;
use crate::engine::{Action, Engine, EngineConfig, ReqId, Request, Response};
use crate::error::{ConfigError, Error};
use crate::transport::Envelope;

/// An engine timeout for virtual time: a hang shows as a deadlock (no event left) long before
/// any timeout could, so one far beyond any run keeps timeouts out of the way.
pub const TIMEOUT_OFF: Duration = Duration::from_secs(1 << 40);

/// When a message sent at `now` arrives.
pub trait NetworkModel: Send {
    /// Arrival time of `bytes` sent from `from` to `to` at `now`. Called in send order, so a
    /// model may keep per-link or per-node state (injection limits). `noise` is a seeded hash of
    /// the message's identity, uniform in `[0, 1)`, for models with random variation.
    fn arrival(
        &mut self,
        now: Duration,
        from: Rank,
        to: Rank,
        bytes: usize,
        noise: f64,
    ) -> Duration;
}

/// SplitMix64: a well-mixed hash of one word.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A hash of the seed and a few words.
fn hash(seed: u64, words: &[u64]) -> u64 {
    words.iter().fold(mix(seed), |h, &w| mix(h ^ w))
}

/// The last word hashed into an event's tie-break, after its identity.
const TIE: u64 = 0x7469_6521;

/// A hash as a uniform number in `[0, 1)`.
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// Latency plus size over bandwidth, stretched by a seeded random factor in `[1, 1 + jitter)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JitterNetwork {
    /// Time of an empty message.
    pub latency: Duration,
    /// Bytes per second of one link.
    pub bandwidth: f64,
    /// Relative random spread of each transfer.
    pub jitter: f64,
}

impl Default for JitterNetwork {
    fn default() -> Self {
        JitterNetwork {
            latency: Duration::from_micros(5),
            bandwidth: 5e9,
            jitter: 0.5,
        }
    }
}

impl NetworkModel for JitterNetwork {
    fn arrival(
        &mut self,
        now: Duration,
        _from: Rank,
        _to: Rank,
        bytes: usize,
        noise: f64,
    ) -> Duration {
        let base = self.latency.as_secs_f64() + bytes as f64 / self.bandwidth;
        let factor = 1.0 + self.jitter * noise;
        now + Duration::from_secs_f64(base * factor)
    }
}

/// Settings of a deterministic run.
pub struct VirtualConfig {
    /// Seed of every scheduling decision and of the network's randomness.
    pub seed: u64,
    /// The network model.
    pub network: Box<dyn NetworkModel>,
}

impl VirtualConfig {
    /// A seeded run over the default jitter network.
    pub fn seeded(seed: u64) -> VirtualConfig {
        VirtualConfig {
            seed,
            network: Box::new(JitterNetwork::default()),
        }
    }
}

enum Event {
    Deliver { to: Rank, env: Envelope },
    Timer { slot: Arc<Slot>, rank: Rank },
    Tick { rank: Rank },
}

/// The identity of a message, without anything that depends on history (sequence numbers,
/// times): sender, receiver, kind, step and the activation root.
fn message_key(to: Rank, env: &Envelope) -> u64 {
    mix(env.from as u64)
        ^ mix((to as u64) << 20 ^ 0x5a5a)
        ^ mix((env.tag.kind as u64) << 40 ^ (env.tag.step as u64) << 20 ^ env.meta.aux)
}

/// The identity of a rank's compute timer.
fn timer_key(rank: Rank) -> u64 {
    1 ^ (rank as u64) << 8
}

/// The identity of a rank's engine tick.
fn tick_key(rank: Rank) -> u64 {
    2 ^ (rank as u64) << 8
}

/// Where an event stands in the heap: 16 bytes, so that the heap takes half the memory it did
/// with 32 and the four siblings of a level span two cache lines instead of three (0.96x the
/// time at 4,096 simulated ranks; aligning them to one line measured 1.03x). Events happen in
/// the order of their time, then of their whole tie-breaking hash, then of when they were
/// scheduled (`seq`); the key holds the time, the hash's upper half and the event's slab
/// index, and events equal in the first two are put in that order by
/// [`Core::order_front_ties`], from the rest kept in the slab.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Scheduled {
    /// The time in nanoseconds (a `Duration`'s own resolution), the hash's upper 32 bits and
    /// the slab index, from the most significant bits down.
    key: u128,
}

/// An event in the slab, with the part of its order its heap key leaves out.
struct Entry {
    event: Event,
    /// The whole tie-breaking hash.
    tie: u64,
    /// When it was scheduled, counted from the start of the run.
    seq: u64,
}

/// The latest virtual time an event can have: 2^64 - 1 ns, 584 years. A deadline beyond it
/// never fires (a job that has nothing else to do then ends as a deadlock).
const HORIZON: Duration = Duration::from_nanos(u64::MAX);

/// How many of the earliest events wait out of the heap, taken ahead of time, while the core
/// handles the one before them: each event's memory is prefetched one level of pointers per
/// event handled before it, first its slab entry, then its engine's levels 0 to
/// `LOOKAHEAD - 2` (see [`Engine::prefetch`]). Each message reaches a different one of thousands
/// of engines, and without this each level was a cache miss (1.1-1.2x faster at 1,024 and
/// 4,096 simulated ranks). One event more cost more instructions than its misses saved, one
/// fewer left misses.
const LOOKAHEAD: usize = 6;

/// An event taken out of the heap ahead of time, and the rank it reaches once its slab entry
/// has been read.
struct Taken {
    s: Scheduled,
    rank: Option<Rank>,
}

impl Scheduled {
    /// `slot` fits 32 bits: 2^32 events at once would take more than 400 GB of slab.
    fn new(at: Duration, tie: u64, slot: usize) -> Scheduled {
        debug_assert!(
            u32::try_from(slot).is_ok(),
            "slab index {slot} beyond 32 bits"
        );
        let nanos = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX);
        Scheduled {
            key: u128::from(nanos) << 64 | u128::from(tie >> 32) << 32 | (slot as u32 as u128),
        }
    }

    fn nanos(&self) -> u64 {
        (self.key >> 64) as u64
    }

    fn slot(&self) -> usize {
        self.key as u32 as usize
    }

    /// The time and the hash's upper half: the part of the order the key decides alone.
    fn prefix(&self) -> u128 {
        self.key >> 32
    }
}

/// The time a core's clock holds.
fn read_clock(clock: &AtomicU64) -> Duration {
    Duration::from_nanos(clock.load(Ordering::Relaxed))
}

struct Core {
    /// The time of the last event, in nanoseconds; shared with the ranks' ports, which read
    /// it without the core's lock.
    clock: Arc<AtomicU64>,
    engines: Vec<Engine>,
    events: QuaternaryHeap<Reverse<Scheduled>>,
    /// The earliest events, taken out of `events` ahead of time, in the heap's order: each
    /// precedes every event still in `events` (an event scheduled since that precedes one of
    /// them is inserted here, see [`Core::enqueue`]), so the next event is the front once
    /// [`Core::order_front_ties`] has settled the events that share its heap key's time and
    /// hash. Usually `LOOKAHEAD` long, sometimes longer.
    ahead: VecDeque<Taken>,
    /// The events of `events`, by `Scheduled::slot`.
    slab: Vec<Option<Entry>>,
    /// Free entries of `slab`.
    free: Vec<usize>,
    seq: u64,
    /// `mix(seed)`: where every hash of the seed and an identity starts (see [`hash`]).
    seed_hash: u64,
    network: Box<dyn NetworkModel>,
    /// Every rank's requests in flight, by id (unique across ranks): one table stays in cache
    /// where one per rank was cold at nearly every request.
    slots: FxHashMap<ReqId, Arc<Slot>>,
    next_req: ReqId,
    submitted: VecDeque<(Rank, ReqId, Request)>,
    tick_at: Vec<Option<Duration>>,
    /// The engines' actions, reused from event to event (it grows to the largest burst once).
    out: Vec<Action>,
}

impl Core {
    /// The engines of `ranks` ranks at time zero, with nothing scheduled.
    fn new(ranks: usize, cfg: EngineConfig, vcfg: VirtualConfig) -> Core {
        Core {
            clock: Arc::new(AtomicU64::new(0)),
            engines: (0..ranks).map(|r| Engine::new(r, ranks, cfg)).collect(),
            events: QuaternaryHeap::new(),
            ahead: VecDeque::with_capacity(LOOKAHEAD + 1),
            slab: Vec::new(),
            free: Vec::new(),
            seq: 0,
            seed_hash: mix(vcfg.seed),
            network: vcfg.network,
            slots: FxHashMap::default(),
            next_req: 0,
            submitted: VecDeque::new(),
            tick_at: vec![None; ranks],
            out: Vec::new(),
        }
    }

    /// The time of the last event.
    fn now(&self) -> Duration {
        read_clock(&self.clock)
    }

    /// `hash(seed, &[key])` for the identity `key` ([`message_key`], [`timer_key`] or
    /// [`tick_key`]) of an event.
    fn identity(&self, key: u64) -> u64 {
        mix(self.seed_hash ^ key)
    }

    /// Schedules `event`, whose identity hashed with the seed ([`Core::identity`]) is
    /// `identity`, at `at`. Its tie-break is `hash(seed, &[key, TIE])`.
    fn schedule(&mut self, at: Duration, identity: u64, event: Event) {
        self.enqueue(at, mix(identity ^ TIE), event);
    }

    /// Schedules `event` at `at` with the tie-breaking hash `tie`.
    fn enqueue(&mut self, at: Duration, tie: u64, event: Event) {
        self.seq += 1;
        let entry = Entry {
            event,
            tie,
            seq: self.seq,
        };
        let slot = match self.free.pop() {
            Some(i) => {
                // A free entry holds nothing to drop. Forgetting it rather than dropping it
                // spares a read of the entry, a cache miss when a burst of sends reaches
                // entries freed long ago.
                let old = self.slab[i].replace(entry);
                debug_assert!(old.is_none(), "a free slab entry held an event");
                std::mem::forget(old);
                i
            }
            None => {
                self.slab.push(Some(entry));
                self.slab.len() - 1
            }
        };
        let s = Scheduled::new(at, tie, slot);
        // An event before one already taken ahead goes among those, in order, so that every
        // event taken ahead precedes every event in the heap.
        if self.ahead.back().is_some_and(|last| s < last.s) {
            let at = self.ahead.partition_point(|a| a.s < s);
            self.ahead.insert(at, Taken { s, rank: None });
        } else {
            self.events.push(Reverse(s));
        }
    }

    /// The earliest event, with the clock moved to it.
    fn next_event(&mut self) -> Option<Event> {
        // The heap's earliest event follows every event taken ahead. One more than
        // `LOOKAHEAD`, so that the `LOOKAHEAD` left after the front is taken each get a level.
        while self.ahead.len() <= LOOKAHEAD {
            let Some(Reverse(s)) = self.events.pop() else {
                break;
            };
            self.ahead.push_back(Taken { s, rank: None });
        }
        self.order_front_ties();
        let s = self.ahead.pop_front()?.s;
        self.prefetch_ahead();
        // Relaxed (and no read-modify-write): the one thread that runs the tasks also moves
        // the clock.
        if s.nanos() > self.clock.load(Ordering::Relaxed) {
            self.clock.store(s.nanos(), Ordering::Relaxed);
        }
        self.free.push(s.slot());
        self.slab[s.slot()].take().map(|e| e.event)
    }

    /// Puts the next event in the order at the front of `ahead` when events there share its
    /// time and the upper half of its tie-breaking hash (the heap orders those by slab index,
    /// which depends on history): among every such event, the least by the whole hash and
    /// then by `seq`. Nearly always the front's neighbour differs already.
    fn order_front_ties(&mut self) {
        let Some(prefix) = self.ahead.front().map(|t| t.s.prefix()) else {
            return;
        };
        if self.ahead.get(1).is_none_or(|t| t.s.prefix() != prefix) {
            return;
        }
        // The events sharing the prefix are at the front of `ahead`, and at the top of the
        // heap once every event taken ahead shares it.
        while self.ahead.back().is_some_and(|t| t.s.prefix() == prefix)
            && self
                .events
                .peek()
                .is_some_and(|Reverse(s)| s.prefix() == prefix)
        {
            if let Some(Reverse(s)) = self.events.pop() {
                self.ahead.push_back(Taken { s, rank: None });
            }
        }
        let run = self
            .ahead
            .iter()
            .take_while(|t| t.s.prefix() == prefix)
            .count();
        let order = |t: &Taken| {
            self.slab
                .get(t.s.slot())
                .and_then(Option::as_ref)
                .map(|e| (e.tie, e.seq))
        };
        let first = (0..run).min_by_key(|&i| self.ahead.get(i).and_then(order));
        if let Some(i) = first.filter(|&i| i > 0) {
            self.ahead.swap(0, i);
        }
    }

    /// Prefetches the events taken ahead: the last one's entry in the slab, and one level of
    /// pointers deeper for each event closer to the front (its message, then its engine's).
    fn prefetch_ahead(&mut self) {
        for (i, taken) in self.ahead.iter_mut().take(LOOKAHEAD).enumerate() {
            // Events handled before this one: the last event taken gets its slab entry only.
            let Some(level) = (LOOKAHEAD - 1 - i).checked_sub(1) else {
                if let Some(entry) = self.slab.get(taken.s.slot()) {
                    crate::prefetch::prefetch(entry, 0..2);
                }
                continue;
            };
            // The entry was prefetched one event ago: read it once, for its rank.
            let rank = match taken.rank {
                Some(rank) => rank,
                None => {
                    let rank = match self.slab.get(taken.s.slot()).and_then(Option::as_ref) {
                        Some(Entry {
                            event: Event::Deliver { to, env },
                            ..
                        }) => {
                            crate::prefetch::prefetch_slice(&env.meta.contributions, 2);
                            *to
                        }
                        Some(Entry {
                            event: Event::Timer { rank, .. } | Event::Tick { rank },
                            ..
                        }) => *rank,
                        None => continue,
                    };
                    taken.rank = Some(rank);
                    rank
                }
            };
            if let Some(engine) = self.engines.get(rank) {
                engine.prefetch(level as u8);
            }
        }
    }

    fn apply(&mut self, rank: Rank, out: &mut Vec<Action>) {
        for a in out.drain(..) {
            match a {
                Action::Send { to, env } => {
                    let bytes = env.wire_bytes();
                    let key = message_key(to, &env);
                    let identity = self.identity(key);
                    let noise = unit(identity);
                    // Messages may overtake each other (the engine matches them by tag): no
                    // ordering state outlives the messages, so a run resumed at a barrier
                    // replays the uninterrupted one.
                    let at = self.network.arrival(self.now(), rank, to, bytes, noise);
                    self.schedule(at, identity, Event::Deliver { to, env });
                }
                Action::Complete { id, result } => {
                    if let Some(slot) = self.slots.remove(&id) {
                        slot.complete(result);
                    }
                }
                // Virtual ranks have no connections to drop.
                Action::Disconnect { .. } => {}
            }
        }
        // One pending tick per rank, at its earliest deadline: a later deadline waits for
        // that tick, which reschedules (see `handle`).
        let deadline = self.engines[rank].next_deadline_until(HORIZON);
        if let Some(d) = deadline
            && self.tick_at[rank].is_none_or(|t| d < t)
        {
            self.tick_at[rank] = Some(d);
            let identity = self.identity(tick_key(rank));
            self.schedule(d.max(self.now()), identity, Event::Tick { rank });
        }
    }

    fn process_submissions(&mut self) {
        let mut out = std::mem::take(&mut self.out);
        while let Some((rank, id, req)) = self.submitted.pop_front() {
            let now = self.now();
            self.engines[rank].on_request(now, id, req, &mut out);
            self.apply(rank, &mut out);
        }
        self.out = out;
    }

    fn handle(&mut self, event: Event) {
        let mut out = std::mem::take(&mut self.out);
        let now = self.now();
        match event {
            Event::Deliver { to, env } => {
                self.engines[to].on_message(now, env, &mut out);
                self.apply(to, &mut out);
            }
            Event::Timer { slot, .. } => slot.complete(Ok(Response::Done)),
            Event::Tick { rank } => {
                if self.tick_at[rank] == Some(now) {
                    self.tick_at[rank] = None;
                }
                self.engines[rank].on_tick(now, &mut out);
                self.apply(rank, &mut out);
            }
        }
        self.out = out;
    }

    fn abort(&mut self, rank: Rank) {
        let msgs = self.engines[rank].farewell(true);
        let mut out: Vec<Action> = msgs
            .into_iter()
            .map(|(to, env)| Action::Send { to, env })
            .collect();
        self.apply(rank, &mut out);
    }
}

struct VirtualPort {
    rank: Rank,
    core: Arc<Mutex<Core>>,
    clock: Arc<AtomicU64>,
}

fn lock(core: &Mutex<Core>) -> MutexGuard<'_, Core> {
    core.lock().unwrap_or_else(|e| e.into_inner())
}

impl Port for VirtualPort {
    fn submit(&self, req: Request) -> Pending {
        let mut core = lock(&self.core);
        let id = core.next_req;
        core.next_req += 1;
        let slot = Slot::new();
        core.slots.insert(id, Arc::clone(&slot));
        core.submitted.push_back((self.rank, id, req));
        Pending::new(self.rank, slot)
    }

    fn now(&self) -> Duration {
        read_clock(&self.clock)
    }

    fn virtual_clock(&self) -> bool {
        true
    }

    fn sleep(&self, d: Duration) -> Pending {
        let mut core = lock(&self.core);
        let slot = Slot::new();
        let at = core.now() + d;
        let identity = core.identity(timer_key(self.rank));
        core.schedule(
            at,
            identity,
            Event::Timer {
                slot: Arc::clone(&slot),
                rank: self.rank,
            },
        );
        Pending::new(self.rank, slot)
    }

    fn leave(&self, abort: bool) {
        // A rank that finishes keeps its engine: peers may still need it as a passive member.
        if abort {
            lock(&self.core).abort(self.rank);
        }
    }
}

/// The tasks woken since the scheduler last looked.
struct Runnable {
    ids: Mutex<Vec<usize>>,
    /// Set with every wake: most events wake no task, and the scheduler then goes on to the
    /// next event without taking the lock.
    any: AtomicBool,
}

struct TaskWaker {
    id: usize,
    runnable: Arc<Runnable>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.runnable
            .ids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.id);
        self.runnable.any.store(true, Ordering::Release);
    }
}

type Task<'a, R> = Pin<Box<dyn Future<Output = Result<R, Error>> + 'a>>;

/// Runs `task` on `ranks` ranks in virtual time, deterministically for a given seed.
pub fn run<R, F>(
    ranks: usize,
    cfg: EngineConfig,
    vcfg: VirtualConfig,
    task: F,
) -> Result<JobResult<R>, ConfigError>
where
    F: AsyncFn(&mut Comm) -> Result<R, Error>,
{
    if ranks == 0 {
        return Err(ConfigError::ZeroRanks);
    }
    let vcfg_seed = vcfg.seed;
    let core = Core::new(ranks, cfg, vcfg);
    let clock = Arc::clone(&core.clock);
    let core = Arc::new(Mutex::new(core));
    let mut comms: Vec<Comm> = (0..ranks)
        .map(|rank| {
            let port = VirtualPort {
                rank,
                core: Arc::clone(&core),
                clock: Arc::clone(&clock),
            };
            Comm::new(rank, ranks, cfg, Arc::new(port))
        })
        .collect();
    let runnable = Arc::new(Runnable {
        ids: Mutex::new((0..ranks).collect()),
        any: AtomicBool::new(true),
    });
    let wakers: Vec<Waker> = (0..ranks)
        .map(|id| {
            Waker::from(Arc::new(TaskWaker {
                id,
                runnable: Arc::clone(&runnable),
            }))
        })
        .collect();
    let mut outcomes: Vec<Option<(Result<R, Error>, Duration)>> =
        (0..ranks).map(|_| None).collect();
    {
        let task = &task;
        let mut tasks: Vec<Option<Task<'_, R>>> = comms
            .iter_mut()
            .map(|c| Some(Box::pin(task(c)) as Task<'_, R>))
            .collect();
        let mut live = ranks;
        // Swapped with the wakers' list, so that neither allocates once grown.
        let mut batch: Vec<usize> = Vec::new();
        'run: while live > 0 {
            // The tasks woken by the last event (and by those polled meanwhile) run before the
            // next event.
            while runnable.any.swap(false, Ordering::Acquire) {
                batch.clear();
                std::mem::swap(
                    &mut batch,
                    &mut *runnable.ids.lock().unwrap_or_else(|e| e.into_inner()),
                );
                batch.sort_unstable();
                batch.dedup();
                let seed = vcfg_seed;
                batch.sort_by_key(|&id| hash(seed, &[id as u64, 0x7461_736b]));
                for &id in &batch {
                    let Some(fut) = tasks[id].as_mut() else {
                        continue;
                    };
                    let poll = fut.as_mut().poll(&mut Context::from_waker(&wakers[id]));
                    if let Poll::Ready(r) = poll {
                        let mut c = lock(&core);
                        if r.is_err() {
                            c.abort(id);
                        }
                        outcomes[id] = Some((r, c.now()));
                        tasks[id] = None;
                        live -= 1;
                    }
                    lock(&core).process_submissions();
                }
            }
            if live == 0 {
                break;
            }
            // One lock for the events up to the next that wakes a task.
            let mut c = lock(&core);
            loop {
                match c.next_event() {
                    Some(event) => c.handle(event),
                    None => {
                        let blocked: Vec<String> = (0..ranks)
                            .filter(|&r| tasks[r].is_some())
                            .map(|r| format!("rank {r}: {}", c.engines[r].describe_wait()))
                            .collect();
                        for (r, t) in tasks.iter_mut().enumerate() {
                            if t.take().is_some() {
                                outcomes[r] = Some((
                                    Err(Error::Deadlock {
                                        blocked: blocked.clone(),
                                    }),
                                    c.now(),
                                ));
                            }
                        }
                        break 'run;
                    }
                }
                if runnable.any.load(Ordering::Acquire) {
                    break;
                }
            }
        }
    }
    for c in &mut comms {
        c.mark_left();
    }
    Ok(collect(
        outcomes
            .into_iter()
            .enumerate()
            .map(|(rank, o)| {
                o.unwrap_or((Err(Error::Stopped { rank, cause: None }), Duration::ZERO))
            })
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const SEED: u64 = 7;

    fn core(ranks: usize) -> Core {
        Core::new(ranks, EngineConfig::default(), VirtualConfig::seeded(SEED))
    }

    fn tick(core: &mut Core, micros: u64, rank: Rank) {
        let at = Duration::from_micros(micros);
        let identity = core.identity(tick_key(rank));
        core.schedule(at, identity, Event::Tick { rank });
    }

    /// The rank of the next event, a tick.
    fn next_tick(core: &mut Core) -> Option<Rank> {
        match core.next_event() {
            Some(Event::Tick { rank }) => Some(rank),
            _ => None,
        }
    }

    /// Pops every event, returning (time in microseconds, as the ranks' ports read it, rank).
    fn drain(core: &mut Core) -> Vec<(u128, Rank)> {
        std::iter::from_fn(|| {
            core.next_event().map(|e| match e {
                Event::Tick { rank } => (core.now().as_micros(), rank),
                _ => (u128::MAX, usize::MAX),
            })
        })
        .collect()
    }

    #[test]
    fn events_scheduled_after_the_lookahead_was_filled_still_come_in_time_order() {
        let mut c = core(4);
        for t in 0..2 * LOOKAHEAD as u64 {
            tick(&mut c, 10 + 2 * t, t as usize % 4);
        }
        // Fills the lookahead with the earliest events, then schedules some before, between
        // and after them.
        let first = c.next_event().map(|_| c.now().as_micros());
        assert_eq!(first, Some(10));
        assert_eq!(c.ahead.len(), LOOKAHEAD);
        tick(&mut c, 11, 3);
        tick(&mut c, 13, 2);
        tick(&mut c, 10, 1);
        tick(&mut c, 1_000, 0);
        let times: Vec<u128> = drain(&mut c).into_iter().map(|(t, _)| t).collect();
        let mut expected: Vec<u128> = (1..2 * LOOKAHEAD as u128).map(|t| 10 + 2 * t).collect();
        expected.extend([10, 11, 13, 1_000]);
        expected.sort_unstable();
        assert_eq!(times, expected);
        assert!(c.ahead.is_empty() && c.events.is_empty());
    }

    #[test]
    fn ties_are_broken_as_without_the_lookahead() {
        // The same events through the core and sorted by (time, whole hash, schedule order).
        let ranks = [5, 3, 7, 1, 0, 6, 2, 4, 5, 3];
        let mut c = core(8);
        let mut expected = Vec::new();
        for (i, rank) in ranks.into_iter().enumerate() {
            let micros = 20 + (i as u64 % 3);
            tick(&mut c, micros, rank);
            expected.push((micros, hash(SEED, &[tick_key(rank), TIE]), i, rank));
        }
        expected.sort_unstable();
        let order: Vec<Rank> = expected.into_iter().map(|e| e.3).collect();
        let got: Vec<Rank> = drain(&mut c).into_iter().map(|(_, r)| r).collect();
        assert_eq!(got, order);
    }

    /// Schedule an event `(time from now in microseconds, hash's upper half, lower half)`, or
    /// handle the next one.
    #[derive(Debug, Clone)]
    enum Step {
        Schedule(u64, u64, u64),
        Handle,
    }

    proptest! {
        /// Events come in the order of (time, whole hash, schedule order), whatever the
        /// collisions of time and hash and however scheduling and handling interleave.
        #[test]
        fn events_come_in_time_then_hash_then_schedule_order(
            steps in prop::collection::vec(
                prop_oneof![
                    3 => (0u64..3, 0u64..3, 0u64..4).prop_map(|(t, hi, lo)| Step::Schedule(t, hi, lo)),
                    2 => Just(Step::Handle),
                ],
                0..120,
            )
        ) {
            let mut c = core(1);
            let mut model = std::collections::BTreeSet::new();
            let mut id = 0usize;
            for step in steps.into_iter().chain(std::iter::repeat_n(Step::Handle, 120)) {
                match step {
                    Step::Schedule(t, hi, lo) => {
                        let at = c.now() + Duration::from_micros(t);
                        let tie = hi << 32 | lo;
                        c.enqueue(at, tie, Event::Tick { rank: id });
                        model.insert((at, tie, id));
                        id += 1;
                    }
                    Step::Handle => {
                        let got = next_tick(&mut c);
                        let want = model.pop_first().map(|(_, _, id)| id);
                        prop_assert_eq!(got, want);
                    }
                }
            }
        }
    }

    #[test]
    fn hashes_equal_in_their_upper_half_are_ordered_by_the_rest_then_by_schedule_order() {
        // Twice as many ties as the lookahead holds, scheduled so that slab order differs
        // from the order they must come in; the rank records the scheduling order.
        let mut c = core(64);
        let lows = [9u64, 3, 7, 3, 1, 8, 3, 0, 5, 2, 6, 4, 1, 7];
        let mut expected = Vec::new();
        for (i, low) in lows.into_iter().enumerate() {
            let tie = 0xabcd << 32 | low;
            c.enqueue(Duration::from_micros(50), tie, Event::Tick { rank: i });
            expected.push((50, tie, i));
        }
        // Other times and other upper halves around them.
        for (i, (micros, tie)) in [(50, 0xabce << 32), (50, 0xabcc << 32 | 9), (49, 0), (51, 0)]
            .into_iter()
            .enumerate()
        {
            let rank = lows.len() + i;
            c.enqueue(Duration::from_micros(micros), tie, Event::Tick { rank });
            expected.push((micros, tie, rank));
        }
        expected.sort_unstable();
        let ranks = |events: &[(u64, u64, Rank)]| events.iter().map(|e| e.2).collect::<Vec<_>>();
        // Some handled, then more ties scheduled while the rest wait ahead and in the heap:
        // those come in order among the rest.
        let handled: Vec<Rank> = (0..4).filter_map(|_| next_tick(&mut c)).collect();
        assert_eq!(handled, ranks(&expected[..4]));
        let mut rest = expected.split_off(4);
        for (i, low) in [3u64, 0, 8].into_iter().enumerate() {
            let rank = 40 + i;
            let tie = 0xabcd << 32 | low;
            c.enqueue(Duration::from_micros(50), tie, Event::Tick { rank });
            rest.push((50, tie, rank));
        }
        rest.sort_unstable();
        let got: Vec<Rank> = drain(&mut c).into_iter().map(|(_, r)| r).collect();
        assert_eq!(got, ranks(&rest));
    }
}
