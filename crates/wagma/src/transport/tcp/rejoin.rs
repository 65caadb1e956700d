//! Rejoining a running job (elastic mode).
//!
//! With `accept_rejoins`, every rank keeps its peer listener after start-up, and rank 0 its
//! rendezvous listener, each served by a background thread that ends with the transport. A
//! restarted process (`rejoin`) registers with rank 0, receives the current address table,
//! and connects to every peer it can reach; each accepting rank authenticates the connection
//! as usual, starts its reader (so the joiner's messages reach the engine at once) and hands
//! the write half to the transport, which uses it from its next send on.

use std::io::BufWriter;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{
    Credentials, Link, TcpConfig, accept_one, connect_to, encode_table, handshake,
    read_registration,
};
use crate::Rank;
use crate::error::TransportError;

/// How long a background listener sleeps when nobody knocks.
const LISTEN_POLL: Duration = Duration::from_millis(50);
/// How long a joiner tries to reach each peer (a dead one never answers).
const PEER_CONNECT: Duration = Duration::from_secs(3);

type Writer = BufWriter<TcpStream>;

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
        self.writers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
                *dst = Some(w);
            }
        }
    }
}

/// Runs `serve` on a background thread for as long as `alive` has other owners (the
/// transport); `serve` answers whether it handled a connection (then it is called again at
/// once) or found none waiting.
fn background(
    name: String,
    listener: TcpListener,
    alive: &Arc<Adopted>,
    mut serve: impl FnMut(&TcpListener, &Adopted) -> Result<bool, TransportError> + Send + 'static,
) -> Result<(), TransportError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| TransportError::io("listener", &e))?;
    let weak = Arc::downgrade(alive);
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            while let Some(adopted) = weak.upgrade() {
                let served = serve(&listener, &adopted);
                drop(adopted);
                match served {
                    Ok(true) => continue,
                    Ok(false) => {}
                    // One failed connection attempt must not close the door to the next.
                    Err(e) => tracing::warn!(error = %e, "a connection attempt failed"),
                }
                std::thread::sleep(LISTEN_POLL);
            }
        })
        .map(|_| ())
        .map_err(|e| TransportError::io("starting a listener thread", &e))
}

/// Every rank: accepts restarted peers on `listener` for as long as the transport lives.
pub(super) fn serve_peers(
    listener: TcpListener,
    cred: Credentials,
    ranks: usize,
    link: Link,
    adopted: &Arc<Adopted>,
) -> Result<(), TransportError> {
    let me = link.me;
    background(
        format!("wagma-tcp-{me}-rejoins"),
        listener,
        adopted,
        move |l, adopted| {
            let far = Instant::now() + Duration::from_secs(10);
            let Some((peer, st)) = accept_one(l, me, &cred, far)? else {
                return Ok(false);
            };
            if peer >= ranks || peer == me {
                tracing::warn!(
                    rank = me,
                    peer,
                    "refused a connection claiming an unexpected rank"
                );
                return Ok(true);
            }
            // The write half is in place before anything the peer sends is read: an engine
            // that has heard from the new process answers it on the new connection.
            let opened = link.split(st).and_then(|(w, r)| {
                adopted.put(peer, w);
                link.read(peer, r)
            });
            match opened {
                Ok(()) => tracing::info!(rank = me, peer, "rank {peer} reconnected"),
                Err(e) => tracing::warn!(rank = me, peer, error = %e, "a reconnection failed"),
            }
            Ok(true)
        },
    )
}

/// Rank 0: answers restarted ranks' registrations with the current address table.
pub(super) fn serve_table(
    listener: TcpListener,
    cred: Credentials,
    mut table: Vec<SocketAddr>,
    adopted: &Arc<Adopted>,
) -> Result<(), TransportError> {
    background(
        "wagma-tcp-0-rendezvous".into(),
        listener,
        adopted,
        move |l, _| {
            let far = Instant::now() + Duration::from_secs(10);
            let Some((peer, mut st)) = accept_one(l, 0, &cred, far)? else {
                return Ok(false);
            };
            let answer = match read_registration(&mut st, peer) {
                Ok(reg) if !reg.rejoin => {
                    Err("the job is already running; start with rejoin".into())
                }
                Ok(reg) if reg.world != table.len() || peer == 0 || peer >= table.len() => {
                    Err(format!(
                        "rank {peer} of {} ranks does not fit this job of {}",
                        reg.world,
                        table.len()
                    ))
                }
                Ok(reg) => {
                    table[peer] = reg.addr;
                    Ok(encode_table(&table))
                }
                Err(e) => Err(e.to_string()),
            };
            let body = match answer {
                Ok(body) => {
                    tracing::info!(peer, "rank {peer} asks to rejoin");
                    body
                }
                Err(why) => {
                    tracing::warn!(peer, "refused a registration: {why}");
                    format!("!{why}").into_bytes()
                }
            };
            if let Err(e) = handshake::write_msg(&mut st, &body) {
                tracing::warn!(peer, error = %e, "could not answer a registration");
            }
            Ok(true)
        },
    )
}

/// Joiner: connects to every peer in `table` that answers; the others are left out (the
/// engine declares them dead when it learns who is alive).
pub(super) fn connect_to_all(
    cfg: &TcpConfig,
    table: &[SocketAddr],
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>, TransportError> {
    let me = cfg.rank;
    let mut streams: Vec<Option<TcpStream>> = (0..cfg.world).map(|_| None).collect();
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
