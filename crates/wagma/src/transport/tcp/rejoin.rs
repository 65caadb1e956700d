//! Rejoining a running job (elastic mode).
//!
//! With `accept_rejoins`, every rank keeps its peer listener after start-up, and rank 0 its
//! rendezvous listener, each served by a background thread that ends with the transport. A
//! restarted process (`rejoin`) registers with rank 0, receives the current address table,
//! and connects to every peer it can reach; each accepting rank authenticates the connection
//! as usual, starts its reader (so the joiner's messages reach the engine at once) and hands
//! the write half to the transport, which uses it from its next send on.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::gate::{self, Caller};
use super::handshake::Deadlined;
use super::handshake::{Session, Terms};
use super::rendezvous::{read_registration, send_refusal, send_table};
use super::writer::Writer;
use super::{Link, TcpConfig, connect_to};
use crate::Rank;
use crate::error::TransportError;

/// How long a background listener sleeps when nobody knocks.
const LISTEN_POLL: Duration = Duration::from_millis(50);
/// How long a joiner tries to reach each peer (a dead one never answers).
const PEER_CONNECT: Duration = Duration::from_secs(3);

/// Write halves of connections accepted from rejoined peers, waiting for the engine thread.
pub(super) struct Adopted {
    pending: AtomicBool,
    writers: Mutex<Vec<Option<Writer>>>,
}

impl Adopted {
    pub fn new(ranks: usize) -> Adopted {
        Adopted {
            pending: AtomicBool::new(false),
            writers: Mutex::new((0..ranks).map(|_| None).collect()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Option<Writer>>> {
        // A thread that panicked while holding the lock left whole `Option`s behind.
        self.writers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn put(&self, peer: Rank, w: Writer) {
        let mut slots = self.lock();
        if let Some(slot) = slots.get_mut(peer) {
            *slot = Some(w);
            self.pending.store(true, Ordering::Release);
        }
    }

    /// Replaces the connections of the peers that came back.
    pub fn take_into(&self, writers: &mut [Option<Writer>]) {
        // A plain load first: this runs on every send, and a peer rarely comes back.
        if !self.pending.load(Ordering::Relaxed) || !self.pending.swap(false, Ordering::Acquire) {
            return;
        }
        for (peer, slot) in self.lock().iter_mut().enumerate() {
            if let (Some(w), Some(dst)) = (slot.take(), writers.get_mut(peer)) {
                // The old connection is lost: nothing more is owed on it.
                if let Some(old) = dst.replace(w) {
                    old.abandon();
                }
            }
        }
    }
}

/// True for as long as the transport that owns `adopted` lives.
fn while_alive(adopted: &Arc<Adopted>) -> impl Fn() -> bool + Send + 'static {
    let weak = Arc::downgrade(adopted);
    move || weak.strong_count() > 0
}

/// Every rank: accepts restarted peers on `listener` for as long as the transport lives. Only
/// a rank whose connection this rank has lost may come back: a live rank cannot be replaced.
pub(super) fn serve_peers(
    listener: &TcpListener,
    terms: Terms,
    ranks: usize,
    link: Link,
    adopted: &Arc<Adopted>,
) -> Result<(), TransportError> {
    let me = link.me;
    let target = Arc::downgrade(adopted);
    let gate = gate::open(
        listener,
        me,
        terms,
        LISTEN_POLL,
        None,
        while_alive(adopted),
        move |c: Result<Caller, TransportError>| {
            // A joiner that disagrees on the terms was told so and logged by the gate; the
            // running job goes on without it.
            let Ok(c) = c else {
                return;
            };
            let peer = c.session.peer;
            if peer >= ranks || peer == me {
                tracing::warn!(
                    rank = me,
                    peer,
                    "refused a caller claiming an unexpected rank"
                );
                return;
            }
            let Some(adopted) = target.upgrade() else {
                return;
            };
            if !link.claim(peer) {
                tracing::warn!(
                    rank = me,
                    peer,
                    "refused a rejoin of rank {peer}, which is alive or being taken by another"
                );
                return;
            }
            // The write half is in place before anything the peer sends is read: an engine
            // that has heard from the new process answers it on the new connection.
            let opened = link.split(c.stream, &c.session).and_then(|(w, r)| {
                adopted.put(peer, w);
                link.read(peer, r)
            });
            match opened {
                Ok(()) => tracing::info!(rank = me, peer, "rank {peer} reconnected"),
                Err(e) => {
                    link.release(peer);
                    tracing::warn!(rank = me, peer, error = %e, "a reconnection failed");
                }
            }
        },
    )?;
    // The gate closes when the transport goes.
    gate.detach();
    Ok(())
}

/// Rank 0: answers restarted ranks' registrations with the current address table. A rank
/// may rejoin only once rank 0 has lost its connection, and only from the address it
/// registers (checked against where its connection comes from).
pub(super) fn serve_table(
    listener: &TcpListener,
    terms: Terms,
    table: Vec<SocketAddr>,
    link: Link,
    adopted: &Arc<Adopted>,
) -> Result<(), TransportError> {
    let table = Mutex::new(table);
    let gate = gate::open(
        listener,
        0,
        terms,
        LISTEN_POLL,
        None,
        while_alive(adopted),
        move |c: Result<Caller, TransportError>| {
            // As for peers: a joiner that disagrees was told so, and the job goes on.
            let Ok(mut c) = c else {
                return;
            };
            let peer = c.session.peer;
            let mut d = Deadlined::new(&c.stream, c.deadline);
            let reg = read_registration(&mut c.session, &mut d);
            let mut table = table.lock().unwrap_or_else(PoisonError::into_inner);
            let refusal = match &reg {
                Err(e) => Some(e.to_string()),
                Ok(reg) if !reg.rejoin => {
                    Some("the job is already running; start with rejoin".into())
                }
                Ok(reg) if reg.world != table.len() || peer == 0 || peer >= table.len() => {
                    Some(format!(
                        "rank {peer} of {} ranks does not fit this job of {}",
                        reg.world,
                        table.len()
                    ))
                }
                Ok(_) if link.is_connected(peer) => Some(format!(
                    "rank {peer} is alive: only a rank the job lost may rejoin"
                )),
                Ok(reg) if reg.addr.ip() != c.addr.ip() => Some(format!(
                    "rank {peer} registers {} but calls from {}",
                    reg.addr,
                    c.addr.ip()
                )),
                Ok(_) => None,
            };
            match (refusal, reg) {
                (None, Ok(reg)) => {
                    tracing::info!(peer, "rank {peer} asks to rejoin");
                    table[peer] = reg.addr;
                    if let Err(e) = send_table(&mut c.session, &mut d, &table) {
                        tracing::warn!(peer, error = %e, "could not answer a registration");
                    }
                }
                (why, _) => {
                    let why = why.unwrap_or_default();
                    tracing::warn!(peer, "refused a registration: {why}");
                    send_refusal(&mut c.session, &mut d, &why);
                }
            }
        },
    )?;
    gate.detach();
    Ok(())
}

/// Joiner: connects to every peer in `table` that answers; the others are left out (the
/// engine declares them dead when it learns who is alive).
pub(super) fn connect_to_all(
    cfg: &TcpConfig,
    table: &[SocketAddr],
    deadline: Instant,
) -> Result<Vec<Option<(TcpStream, Session)>>, TransportError> {
    let me = cfg.rank;
    let mut streams: Vec<Option<(TcpStream, Session)>> = (0..cfg.world).map(|_| None).collect();
    for (peer, addr) in table.iter().enumerate().filter(|(p, _)| *p != me) {
        let until = deadline.min(Instant::now() + PEER_CONNECT);
        match connect_to(*addr, peer, cfg, until) {
            Ok(st) => streams[peer] = Some(st),
            Err(e) => tracing::warn!(rank = me, peer, error = %e, "cannot reach a peer"),
        }
    }
    if streams[0].is_none() {
        return Err(TransportError::Rendezvous(format!(
            "rank {me} rejoining: rank 0 answered the rendezvous but not on its peer address"
        )));
    }
    Ok(streams)
}
