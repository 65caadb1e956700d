//! The threaded executor: each rank has a compute thread (the training loop) and an engine
//! thread that runs the engine over a transport, answering peers while the compute thread works.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select, unbounded};

use super::{Comm, JobResult, Pending, Port, Slot, block_on};
use crate::Rank;
use crate::engine::{Action, Engine, EngineConfig, FoldRequest, ReqId, Request, Response};
use crate::error::{ConfigError, Error, Op, TransportError};
use crate::transport::{Delivery, Incoming, Transport, mem};

/// How long an idle engine thread sleeps between checks when nothing has a deadline.
const IDLE: Duration = Duration::from_millis(200);

/// How long a failed send waits for the transport's own report on the peer before the peer is
/// declared lost. A failing peer sends its reason and then closes its connections; a write that
/// races with the close fails first, and blaming the peer at once would hide the reason (the
/// rank the failure started from) still on its way through the inbox.
const SEND_FAILURE_GRACE: Duration = Duration::from_millis(500);

/// Peers a send has failed to and that the engine has not been told about yet: sends to them
/// are skipped until the transport reports them lost or their grace period ends, whichever
/// comes first; then the engine decides (it fails, or in elastic mode sends to them no more).
#[derive(Default)]
struct Unreachable {
    /// Peer -> (when to declare it lost, what the failed send saw).
    peers: HashMap<Rank, (Duration, String)>,
}

impl Unreachable {
    fn contains(&self, peer: Rank) -> bool {
        self.peers.contains_key(&peer)
    }

    fn send_failed(&mut self, peer: Rank, now: Duration, reason: String) {
        self.peers
            .entry(peer)
            .or_insert((now + SEND_FAILURE_GRACE, reason));
    }

    /// The transport reported `peer` lost: the engine is told now.
    fn reported(&mut self, peer: Rank) {
        self.peers.remove(&peer);
    }

    fn next_deadline(&self) -> Option<Duration> {
        self.peers.values().map(|(at, _)| *at).min()
    }

    /// Peers whose grace period has ended, with what their failed send saw.
    fn expired(&mut self, now: Duration) -> Vec<(Rank, String)> {
        let mut due: Vec<(Rank, String)> = self
            .peers
            .extract_if(|_, (at, _)| *at <= now)
            .map(|(p, (_, reason))| (p, reason))
            .collect();
        due.sort_unstable_by_key(|(p, _)| *p);
        due
    }
}

enum Cmd {
    Request(Request, Reply),
    Leave { abort: bool },
}

/// Where the engine thread answers a request. One that is dropped unanswered, however that
/// happens (the thread leaves, or panics and its queue is discarded), answers `Stopped`, so
/// that no compute thread waits forever.
struct Reply {
    slot: Arc<Slot>,
    rank: Rank,
}

impl Reply {
    fn send(self, result: Result<Response, Error>) {
        self.slot.complete(result);
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        let rank = self.rank;
        let cause = std::thread::panicking().then(|| {
            Box::new(Error::Protocol {
                rank,
                op: Op::Other("engine"),
                detail: "the engine thread panicked".into(),
            })
        });
        // Does nothing where `send` answered first.
        self.slot.complete(Err(Error::Stopped { rank, cause }));
    }
}

struct ThreadedPort {
    tx: Sender<Cmd>,
    start: Instant,
    rank: Rank,
}

impl Port for ThreadedPort {
    fn submit(&self, req: Request) -> Pending {
        let slot = Slot::new();
        let reply = Reply {
            slot: Arc::clone(&slot),
            rank: self.rank,
        };
        // A request the engine thread can no longer take is answered as the reply drops.
        let _ = self.tx.send(Cmd::Request(req, reply));
        Pending::new(self.rank, slot)
    }

    fn now(&self) -> Duration {
        self.start.elapsed()
    }

    fn virtual_clock(&self) -> bool {
        // Each process starts its own clock (a rank that rejoins, hours later).
        false
    }

    fn sleep(&self, d: Duration) -> Pending {
        std::thread::sleep(d);
        Pending::new(self.rank, Slot::ready(Ok(Response::Done)))
    }

    fn leave(&self, abort: bool) {
        let _ = self.tx.send(Cmd::Leave { abort });
    }
}

/// Starts the engine thread of `rank` over `transport`; returns the rank's [`Comm`] and the
/// thread's handle (it ends when the `Comm` finishes, aborts or is dropped).
pub fn spawn(
    rank: Rank,
    ranks: usize,
    cfg: EngineConfig,
    transport: Box<dyn Transport + Send>,
    inbox: Receiver<Incoming>,
    start: Instant,
) -> Result<(Comm, JoinHandle<()>), Error> {
    // Where the transport sums a part as it arrives, the engine asks it to, and a pair's one
    // exchange beats two half-exchanges.
    let folds = transport.folds();
    let mut cfg = cfg;
    cfg.algorithm.fold_on_arrival = folds;
    let (tx, rx) = unbounded();
    let mut engine = Engine::new(rank, ranks, cfg);
    engine.fold_on_arrival(folds);
    let handle = std::thread::Builder::new()
        .name(format!("wagma-engine-{rank}"))
        .spawn(move || engine_loop(engine, transport as Box<dyn Transport>, rx, inbox, start))
        .map_err(|e| Error::Transport {
            rank,
            source: TransportError::io("starting the engine thread", &e),
        })?;
    let port = ThreadedPort { tx, start, rank };
    Ok((Comm::new(rank, ranks, cfg, Arc::new(port)), handle))
}

fn engine_loop(
    mut engine: Engine,
    mut transport: Box<dyn Transport>,
    cmds: Receiver<Cmd>,
    inbox: Receiver<Incoming>,
    start: Instant,
) {
    let mut slots: HashMap<ReqId, Reply> = HashMap::new();
    let mut next_id: ReqId = 0;
    let mut out = Vec::new();
    let never = crossbeam_channel::never();
    let mut inbox_open = true;
    let mut unreachable = Unreachable::default();
    loop {
        let now = start.elapsed();
        let mut wait = engine
            .next_deadline()
            .into_iter()
            .chain(unreachable.next_deadline())
            .min()
            .map_or(IDLE, |d| d.saturating_sub(now));
        if let Some(p) = transport.poll_interval() {
            wait = wait.min(p);
        }
        let inbox_ref = if inbox_open { &inbox } else { &never };
        select! {
            recv(cmds) -> cmd => match cmd {
                Ok(Cmd::Request(req, reply)) => {
                    let id = next_id;
                    next_id += 1;
                    slots.insert(id, reply);
                    engine.on_request(start.elapsed(), id, req, &mut out);
                }
                Ok(Cmd::Leave { abort }) => {
                    leave(&mut engine, transport.as_mut(), abort, &mut slots);
                    return;
                }
                Err(_) => {
                    leave(&mut engine, transport.as_mut(), true, &mut slots);
                    return;
                }
            },
            recv(inbox_ref) -> msg => match msg {
                Ok(Ok(Delivery { env, folded })) => {
                    transport.taken(env.from);
                    if folded {
                        engine.on_folded_message(start.elapsed(), env, &mut out);
                    } else {
                        engine.on_message(start.elapsed(), env, &mut out);
                    }
                }
                Ok(Err(lost)) => {
                    unreachable.reported(lost.peer);
                    engine.on_peer_lost(start.elapsed(), lost.peer, &lost.reason, &mut out);
                }
                Err(_) => inbox_open = false,
            },
            default(wait) => {}
        }
        if let Err(e) = transport.poll() {
            let err = Error::Transport {
                rank: engine.rank(),
                source: e,
            };
            engine.fail(err, &mut out);
        }
        for (peer, reason) in unreachable.expired(start.elapsed()) {
            engine.on_peer_lost(start.elapsed(), peer, &reason, &mut out);
        }
        engine.on_tick(start.elapsed(), &mut out);
        // Before the sends of the same events, which the folded messages answer.
        for request in engine.drain_fold_requests() {
            match request {
                FoldRequest::Ask { from, fold } => {
                    if !unreachable.contains(from) {
                        transport.fold(from, fold);
                    }
                }
                FoldRequest::Expect { from, tag } => {
                    if !unreachable.contains(from) {
                        transport.expect_fold(from, tag);
                    }
                }
                FoldRequest::Withdraw { from, tag } => transport.unfold(from, tag),
            }
        }
        perform(
            transport.as_mut(),
            &mut slots,
            &mut out,
            &mut unreachable,
            start,
        );
    }
}

fn perform(
    transport: &mut dyn Transport,
    slots: &mut HashMap<ReqId, Reply>,
    out: &mut Vec<Action>,
    unreachable: &mut Unreachable,
    start: Instant,
) {
    while !out.is_empty() {
        let actions: Vec<Action> = std::mem::take(out);
        for a in actions {
            match a {
                Action::Send { to, env } => {
                    if unreachable.contains(to) {
                        continue;
                    }
                    if let Err(e) = transport.send(to, env) {
                        unreachable.send_failed(to, start.elapsed(), e.to_string());
                    }
                }
                Action::Complete { id, result } => {
                    if let Some(reply) = slots.remove(&id) {
                        reply.send(result);
                    }
                }
                Action::Disconnect { peer } => transport.disconnect(peer),
            }
        }
    }
}

fn leave(
    engine: &mut Engine,
    transport: &mut dyn Transport,
    abort: bool,
    slots: &mut HashMap<ReqId, Reply>,
) {
    transport.leaving();
    for (to, env) in engine.farewell(abort) {
        let _ = transport.send(to, env);
    }
    // Each answers `Stopped` as it drops.
    slots.clear();
}

/// Runs `task` on `ranks` in-process ranks (a compute thread and an engine thread each, over
/// the in-process transport). After a task succeeds its rank waits at a barrier so that no
/// peer still needs its engine; a failing task tells its peers, which then fail too.
pub fn run<R, F>(ranks: usize, cfg: EngineConfig, task: F) -> Result<JobResult<R>, ConfigError>
where
    F: AsyncFn(&mut Comm) -> Result<R, Error> + Sync,
    R: Send,
{
    let net = mem::network(ranks)
        .into_iter()
        .map(|(t, rx)| (Box::new(t) as Box<dyn Transport + Send>, rx))
        .collect();
    // A sent buffer is shared, not copied: one sum can serve a whole pair.
    let mut cfg = cfg;
    cfg.algorithm.shared_memory = true;
    run_on(net, cfg, task)
}

/// Like [`run`], over the given transports (one per rank, with its inbox): for example the
/// in-process network wrapped in [`crate::transport::faulty::FaultyTransport`].
pub fn run_on<R, F>(
    net: Vec<(Box<dyn Transport + Send>, Receiver<Incoming>)>,
    cfg: EngineConfig,
    task: F,
) -> Result<JobResult<R>, ConfigError>
where
    F: AsyncFn(&mut Comm) -> Result<R, Error> + Sync,
    R: Send,
{
    let ranks = net.len();
    if ranks == 0 {
        return Err(ConfigError::ZeroRanks);
    }
    let start = Instant::now();
    let task = &task;
    let outcomes: Vec<(Result<R, Error>, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = net
            .into_iter()
            .enumerate()
            .map(|(rank, (transport, inbox))| {
                std::thread::Builder::new()
                    .name(format!("wagma-rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let (mut comm, engine) =
                            match spawn(rank, ranks, cfg, transport, inbox, start) {
                                Ok(x) => x,
                                Err(e) => return (Err(e), start.elapsed()),
                            };
                        let result = block_on(task(&mut comm));
                        let at = start.elapsed();
                        match &result {
                            Ok(_) => {
                                let _ = block_on(comm.finish());
                            }
                            Err(_) => comm.abort(),
                        }
                        let _ = engine.join();
                        (result, at)
                    })
                    // The rank fails; its transport, dropped with the closure, tells the
                    // peers it is gone.
                    .map_err(|e| {
                        let err = Error::Transport {
                            rank,
                            source: TransportError::io("starting the rank's compute thread", &e),
                        };
                        (Err(err), start.elapsed())
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    (
                        Err(Error::Task {
                            rank,
                            message: "the task panicked".into(),
                        }),
                        start.elapsed(),
                    )
                }),
                Err(failed) => failed,
            })
            .collect()
    });
    Ok(collect(outcomes))
}

/// Orders outcomes and finds the earliest failure.
pub(crate) fn collect<R>(outcomes: Vec<(Result<R, Error>, Duration)>) -> JobResult<R> {
    let first_failure = outcomes
        .iter()
        .enumerate()
        .filter(|(_, (r, _))| r.is_err())
        .min_by_key(|(i, (_, at))| (*at, root_cause_rank(&outcomes[*i].0)))
        .map(|(i, _)| i);
    JobResult {
        ranks: outcomes.into_iter().map(|(r, _)| r).collect(),
        first_failure,
    }
}

/// Errors caused by another rank's failure sort after original ones.
fn root_cause_rank<R>(r: &Result<R, Error>) -> u8 {
    match r {
        Err(Error::PeerLost { .. }) | Err(Error::Stopped { .. }) => 1,
        _ => 0,
    }
}

/// Joins a TCP job as described by `tcp` and starts this rank's engine thread.
pub fn connect_tcp(
    tcp: &crate::transport::tcp::TcpConfig,
    cfg: EngineConfig,
) -> Result<(Comm, JoinHandle<()>), Error> {
    let start = Instant::now();
    let (tx, rx) = unbounded();
    let transport = crate::transport::tcp::connect(tcp, tx).map_err(|source| Error::Transport {
        rank: tcp.rank,
        source,
    })?;
    spawn(tcp.rank, tcp.world, cfg, Box::new(transport), rx, start)
}

/// Joins the MPI job this process was started in (`mpirun`, `srun`) and starts this rank's
/// engine thread, which initializes MPI and owns it until the `Comm` finishes.
#[cfg(feature = "mpi")]
pub fn connect_mpi(cfg: EngineConfig, max_frame: u64) -> Result<(Comm, JoinHandle<()>), Error> {
    let start = Instant::now();
    // Until MPI is initialized, this process's rank is what the launcher says it is.
    let launched_as = crate::transport::discover::discover_env()
        .ok()
        .flatten()
        .map_or(0, |d| d.rank);
    let (tx, rx) = unbounded();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("wagma-engine-mpi".into())
        .spawn(move || {
            let (inbox_tx, inbox_rx) = unbounded();
            match crate::transport::mpi::MpiTransport::init(inbox_tx, max_frame) {
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
                Ok(t) => {
                    let (rank, size) = (t.rank(), t.size());
                    let _ = ready_tx.send(Ok((rank, size)));
                    engine_loop(
                        Engine::new(rank, size, cfg),
                        Box::new(t),
                        rx,
                        inbox_rx,
                        start,
                    );
                }
            }
        })
        .map_err(|e| Error::Transport {
            rank: launched_as,
            source: TransportError::io("starting the engine thread", &e),
        })?;
    let (rank, size) = ready_rx
        .recv()
        .map_err(|_| Error::Transport {
            rank: launched_as,
            source: TransportError::Rendezvous("the MPI engine thread died during start-up".into()),
        })?
        .map_err(|source| Error::Transport {
            rank: launched_as,
            source,
        })?;
    let port = ThreadedPort { tx, start, rank };
    Ok((Comm::new(rank, size, cfg, Arc::new(port)), handle))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::Payload;
    use crate::transport::Envelope;

    /// Every send fails, as writes to peers that have closed their connections do; the first
    /// failure delivers what rank 0 sent before it closed (an abort naming the rank it lost).
    struct Closed {
        inbox: Sender<Incoming>,
        pending: Vec<Envelope>,
    }

    impl Transport for Closed {
        fn send(&mut self, to: Rank, _env: Envelope) -> Result<(), TransportError> {
            for env in self.pending.drain(..) {
                let _ = self.inbox.send(Ok(env.into()));
            }
            Err(TransportError::Peer {
                peer: to,
                message: "writing a frame: Broken pipe".into(),
            })
        }
    }

    fn abort_of_rank_0_after_losing_rank_1(cfg: EngineConfig) -> Envelope {
        let mut zero = Engine::new(0, 3, cfg);
        let lost = Error::PeerLost {
            rank: 0,
            peer: 1,
            op: Op::Other("test"),
            reason: "killed".into(),
        };
        zero.fail(lost, &mut Vec::new());
        zero.farewell(true)
            .into_iter()
            .find_map(|(to, env)| (to == 2).then_some(env))
            .unwrap_or_else(|| panic!("rank 0 says nothing to rank 2"))
    }

    #[test]
    fn a_failed_send_blames_the_rank_the_failure_started_from() {
        let cfg = EngineConfig {
            timeout: Duration::from_secs(30),
            ..EngineConfig::default()
        };
        let (tx, rx) = unbounded();
        let closed = Closed {
            inbox: tx,
            pending: vec![abort_of_rank_0_after_losing_rank_1(cfg)],
        };
        let (mut comm, engine) =
            spawn(2, 3, cfg, Box::new(closed), rx, Instant::now()).expect("engine starts");
        let err = block_on(comm.allreduce(Payload::from(vec![1.0; 8])))
            .expect_err("the allreduce cannot complete");
        assert_eq!(err.peer(), Some(1), "{err}");
        assert!(err.to_string().contains("after losing rank 1"), "{err}");
        comm.abort();
        engine.join().expect("engine thread ends");
    }

    #[test]
    fn a_reply_answers_once_and_an_unanswered_one_answers_stopped_as_it_drops() {
        let answered = Slot::new();
        Reply {
            slot: Arc::clone(&answered),
            rank: 3,
        }
        .send(Ok(Response::Done));
        assert!(matches!(
            block_on(Pending::new(3, answered)),
            Ok(Response::Done)
        ));
        let dropped = Slot::new();
        drop(Reply {
            slot: Arc::clone(&dropped),
            rank: 3,
        });
        let err = block_on(Pending::new(3, dropped)).expect_err("answered as it dropped");
        assert!(
            matches!(
                err,
                Error::Stopped {
                    rank: 3,
                    cause: None
                }
            ),
            "{err}"
        );
    }

    /// A transport with a defect: its first send panics.
    struct Panicking;

    impl Transport for Panicking {
        fn send(&mut self, _to: Rank, _env: Envelope) -> Result<(), TransportError> {
            panic!("a defect in the transport");
        }
    }

    #[test]
    fn a_panic_on_the_engine_thread_fails_the_waiting_request_instead_of_hanging_it() {
        let (_tx, rx) = unbounded();
        let (mut comm, engine) = spawn(
            0,
            2,
            EngineConfig::default(),
            Box::new(Panicking),
            rx,
            Instant::now(),
        )
        .expect("engine starts");
        let err = block_on(comm.allreduce(Payload::from(vec![1.0; 8])))
            .expect_err("the engine thread is gone");
        assert!(
            matches!(
                err,
                Error::Stopped {
                    rank: 0,
                    cause: Some(_)
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains("the engine thread panicked"),
            "{err}"
        );
        // Requests after it are refused at once.
        let again = block_on(comm.barrier()).expect_err("the engine thread is gone");
        assert!(matches!(again, Error::Stopped { rank: 0, .. }), "{again}");
        assert!(engine.join().is_err(), "the engine thread panicked");
        comm.abort();
    }

    #[test]
    fn ranks_whose_clocks_started_apart_align_without_waiting_out_the_difference() {
        // Rank 0's clock started long before rank 1's, as a job's first process does against
        // a rank that rejoins later: the clocks do not compare, and aligning must not make
        // rank 1 wait for rank 0's.
        // Short enough that, without the fix, the test fails within a minute instead of
        // sleeping the difference out for long.
        let (early, skew) = [60, 20]
            .into_iter()
            .map(Duration::from_secs)
            .find_map(|d| Instant::now().checked_sub(d).map(|t| (t, d)))
            .expect("the machine has been up for 20 s");
        let starts = [early, Instant::now()];
        let cfg = EngineConfig {
            timeout: Duration::from_secs(30),
            ..EngineConfig::default()
        };
        let took: Vec<Duration> = std::thread::scope(|s| {
            let ranks: Vec<_> = crate::transport::mem::network(2)
                .into_iter()
                .zip(starts)
                .enumerate()
                .map(|(rank, ((transport, inbox), start))| {
                    s.spawn(move || {
                        let (mut comm, engine) =
                            spawn(rank, 2, cfg, Box::new(transport), inbox, start)
                                .expect("engine starts");
                        let t = Instant::now();
                        block_on(comm.align()).expect("the ranks align");
                        let took = t.elapsed();
                        block_on(comm.finish()).expect("the rank finishes");
                        engine.join().expect("engine thread ends");
                        took
                    })
                })
                .collect();
            ranks
                .into_iter()
                .map(|r| r.join().expect("rank thread"))
                .collect()
        });
        for (rank, took) in took.iter().enumerate() {
            // A barrier between two threads: far below half the clocks' difference even on a
            // loaded machine.
            assert!(took < &(skew / 2), "rank {rank} waited {took:?}");
        }
    }

    #[test]
    fn an_unreachable_peer_is_declared_once_after_its_grace_or_its_report() {
        let mut u = Unreachable::default();
        let t0 = Duration::from_secs(1);
        u.send_failed(3, t0, "broken pipe".into());
        u.send_failed(3, t0 + SEND_FAILURE_GRACE, "again".into());
        u.send_failed(5, t0, "reset".into());
        assert!(u.contains(3) && u.contains(5) && !u.contains(4));
        assert_eq!(u.next_deadline(), Some(t0 + SEND_FAILURE_GRACE));
        assert!(u.expired(t0).is_empty());
        u.reported(5);
        assert!(!u.contains(5));
        assert_eq!(
            u.expired(t0 + SEND_FAILURE_GRACE),
            vec![(3, "broken pipe".to_string())]
        );
        assert!(!u.contains(3), "the engine decides from now on");
        assert!(u.expired(t0 * 10).is_empty());
        assert_eq!(u.next_deadline(), None);
    }
}
