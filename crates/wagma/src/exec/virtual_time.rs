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

/// When an event happens and how ties are broken; the event itself waits in the core's slab,
/// so that the heap moves only these few words.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Scheduled {
    /// The time in nanoseconds (a `Duration`'s own resolution) above the tie-breaking hash:
    /// one integer comparison orders by time, then by hash.
    key: u128,
    seq: u64,
    /// Index of the event in the slab (unique, like `seq`: never decides an order).
    slot: usize,
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
    fn new(at: Duration, tie: u64, seq: u64, slot: usize) -> Scheduled {
        let nanos = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX);
        Scheduled {
            key: u128::from(nanos) << 64 | u128::from(tie),
            seq,
            slot,
        }
    }

    fn nanos(&self) -> u64 {
        (self.key >> 64) as u64
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
    /// The earliest events, taken out of `events` ahead of time, in order: each precedes every
    /// event still in `events` (an event scheduled since that precedes one of them is inserted
    /// here, see [`Core::schedule`]), so the next event is always the front and the order is
    /// exactly the heap's. Usually `LOOKAHEAD` long, sometimes longer.
    ahead: VecDeque<Taken>,
    /// The events of `events`, by `Scheduled::slot`.
    slab: Vec<Option<Event>>,
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
        let tie = mix(identity ^ TIE);
        self.seq += 1;
        let slot = match self.free.pop() {
            Some(i) => {
                // A free entry holds nothing to drop. Forgetting it rather than dropping it
                // spares a read of the entry, a cache miss when a burst of sends reaches
                // entries freed long ago.
                let old = self.slab[i].replace(event);
                debug_assert!(old.is_none(), "a free slab entry held an event");
                std::mem::forget(old);
                i
            }
            None => {
                self.slab.push(Some(event));
                self.slab.len() - 1
            }
        };
        let s = Scheduled::new(at, tie, self.seq, slot);
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
        let s = self.ahead.pop_front()?.s;
        self.prefetch_ahead();
        // Relaxed (and no read-modify-write): the one thread that runs the tasks also moves
        // the clock.
        if s.nanos() > self.clock.load(Ordering::Relaxed) {
            self.clock.store(s.nanos(), Ordering::Relaxed);
        }
        self.free.push(s.slot);
        self.slab[s.slot].take()
    }

    /// Prefetches the events taken ahead: the last one's entry in the slab, and one level of
    /// pointers deeper for each event closer to the front (its message, then its engine's).
    fn prefetch_ahead(&mut self) {
        for (i, taken) in self.ahead.iter_mut().take(LOOKAHEAD).enumerate() {
            // Events handled before this one: the last event taken gets its slab entry only.
            let Some(level) = (LOOKAHEAD - 1 - i).checked_sub(1) else {
                if let Some(entry) = self.slab.get(taken.s.slot) {
                    crate::prefetch::prefetch(entry, 0..2);
                }
                continue;
            };
            // The entry was prefetched one event ago: read it once, for its rank.
            let rank = match taken.rank {
                Some(rank) => rank,
                None => {
                    let rank = match self.slab.get(taken.s.slot) {
                        Some(Some(Event::Deliver { to, env })) => {
                            crate::prefetch::prefetch_slice(&env.meta.contributions, 2);
                            *to
                        }
                        Some(Some(Event::Timer { rank, .. } | Event::Tick { rank })) => *rank,
                        _ => continue,
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
        Pending::new(slot)
    }

    fn now(&self) -> Duration {
        read_clock(&self.clock)
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
        Pending::new(slot)
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
        // The same events through the core and through the heap alone: the same order.
        let mut c = core(8);
        let mut heap = QuaternaryHeap::new();
        for (i, rank) in [5, 3, 7, 1, 0, 6, 2, 4, 5, 3].into_iter().enumerate() {
            let micros = 20 + (i as u64 % 3);
            tick(&mut c, micros, rank);
            let tie = hash(SEED, &[tick_key(rank), TIE]);
            heap.push(Reverse(Scheduled::new(
                Duration::from_micros(micros),
                tie,
                i as u64 + 1,
                i,
            )));
        }
        let order: Vec<usize> = std::iter::from_fn(|| heap.pop().map(|Reverse(s)| s.slot))
            .map(|slot| [5, 3, 7, 1, 0, 6, 2, 4, 5, 3][slot])
            .collect();
        let got: Vec<Rank> = drain(&mut c).into_iter().map(|(_, r)| r).collect();
        assert_eq!(got, order);
    }
}
