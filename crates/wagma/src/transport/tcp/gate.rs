//! The door of a listener: every caller is authenticated on a thread of its own within one
//! deadline, so a silent or trickling caller holds up nobody else; a failed `accept`
//! (descriptors exhausted, a caller that reset) is logged and retried, never fatal.
//!
//! Callers being authenticated are counted per source address: at most
//! [`MAX_PENDING_PER_SOURCE`] from one address and [`MAX_PENDING`] in all, and a caller over
//! either limit is closed at once (a real rank calls again). One source that floods the port
//! with silent connections thus fills only its own share, and callers from every other address
//! are still served; the share is generous because many ranks of one host call from the same
//! address (all of a test's ranks from 127.0.0.1). An IPv6 source is its /64 network, which one
//! host usually holds whole. The total stays well below a process's usual limit of 1,024 open
//! descriptors, since each pending caller holds one (and a thread) for up to its deadline.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::handshake::{self, Accepted, Deadlined, Session, Terms};
use crate::Rank;
use crate::error::TransportError;

/// Most callers from one address a listener authenticates at once.
pub(super) const MAX_PENDING_PER_SOURCE: usize = 32;
/// Most callers a listener authenticates at once, from all addresses together.
pub(super) const MAX_PENDING: usize = 256;
/// Longest a caller may take for its handshake and the message that follows it.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// An authenticated caller, handed to the gate's `admit`.
pub(super) struct Caller {
    /// The session of its handshake.
    pub session: Session,
    /// Its connection.
    pub stream: TcpStream,
    /// Where it called from.
    pub addr: SocketAddr,
    /// When what follows the handshake must be done.
    pub deadline: Instant,
}

/// Keeps a gate open; dropping it closes the gate within one poll.
pub(super) struct Gate {
    open: Option<Arc<AtomicBool>>,
}

impl Gate {
    /// Leaves the gate open for as long as its `keep_open` says.
    pub(super) fn detach(mut self) {
        self.open = None;
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if let Some(open) = &self.open {
            open.store(false, Ordering::Release);
        }
    }
}

/// Serves `listener` as rank `me` until the returned [`Gate`] is dropped or `keep_open` says
/// no: each caller that proves the job's credentials and agrees on the `terms` is passed to
/// `admit`, on its own thread. One that proves the credentials but disagrees is refused and
/// passed to `admit` as the error that names the difference (the owner decides whether that
/// ends its work); any other failed caller is only logged, so that strangers cannot end it.
/// A caller's deadline is [`HANDSHAKE_TIMEOUT`] from its arrival, and never later than `limit`.
pub(super) fn open(
    listener: &TcpListener,
    me: Rank,
    terms: Terms,
    poll: Duration,
    limit: Option<Instant>,
    keep_open: impl Fn() -> bool + Send + 'static,
    admit: impl Fn(Result<Caller, TransportError>) + Send + Sync + 'static,
) -> Result<Gate, TransportError> {
    let listener = listener
        .try_clone()
        .map_err(|e| TransportError::io("listener", &e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| TransportError::io("listener", &e))?;
    let open = Arc::new(AtomicBool::new(true));
    let gate = Gate {
        open: Some(Arc::clone(&open)),
    };
    let pending = Arc::new(Pending::default());
    let admit = Arc::new(admit);
    std::thread::Builder::new()
        .name(format!("wagma-tcp-{me}-gate"))
        .spawn(move || {
            while open.load(Ordering::Acquire) && keep_open() {
                match listener.accept() {
                    Ok((stream, addr)) => {
                        let Some(guard) = Pending::enter(&pending, addr.ip()) else {
                            tracing::warn!(rank = me, %addr, "too many callers at once: closed one");
                            continue;
                        };
                        let own = Instant::now() + HANDSHAKE_TIMEOUT;
                        let deadline = limit.map_or(own, |l| l.min(own));
                        let (terms, admit) = (terms.clone(), Arc::clone(&admit));
                        let spawned = std::thread::Builder::new()
                            .name(format!("wagma-tcp-{me}-caller"))
                            .spawn(move || {
                                let _guard = guard;
                                match authenticate(stream, me, &terms, deadline) {
                                    Ok((Accepted::Agreed(session), stream)) => admit(Ok(Caller {
                                        session,
                                        stream,
                                        addr,
                                        deadline,
                                    })),
                                    Ok((Accepted::Disagrees(d), _)) => {
                                        let e = TransportError::from(handshake::Disagreement {
                                            at: Some(addr),
                                            ..d
                                        });
                                        tracing::warn!(rank = me, %addr, error = %e, "refused a caller");
                                        admit(Err(e));
                                    }
                                    Err(e) => {
                                        tracing::warn!(rank = me, %addr, error = %e, "refused a caller");
                                    }
                                }
                            });
                        if let Err(e) = spawned {
                            tracing::warn!(rank = me, error = %e, "cannot start a handshake thread");
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(poll);
                    }
                    Err(e) => {
                        tracing::warn!(rank = me, error = %e, "accept failed; retrying");
                        std::thread::sleep(poll.max(Duration::from_millis(10)));
                    }
                }
            }
        })
        .map_err(|e| TransportError::io("starting a listener thread", &e))?;
    Ok(gate)
}

/// Callers being authenticated: in all, and per source address.
#[derive(Default)]
struct Pending {
    counts: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

impl Pending {
    /// Counts a caller from `source` until the returned guard drops, unless its address or
    /// the listener already has as many as it may.
    fn enter(pending: &Arc<Pending>, source: IpAddr) -> Option<Entered> {
        let source = source_of(source);
        let mut c = pending.lock();
        let mine = c.by_source.get(&source).copied().unwrap_or(0);
        if c.total >= MAX_PENDING || mine >= MAX_PENDING_PER_SOURCE {
            return None;
        }
        c.total += 1;
        c.by_source.insert(source, mine + 1);
        Some(Entered {
            pending: Arc::clone(pending),
            source,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        // The counts are updated in single steps that cannot panic halfway.
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The source a caller's address counts against: an IPv4 address (also when a dual-stack
/// listener sees it as `::ffff:a.b.c.d`), or the /64 network of an IPv6 one.
fn source_of(addr: IpAddr) -> IpAddr {
    match addr.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        v4 => v4,
    }
}

/// One caller being authenticated, counted for as long as it lives.
struct Entered {
    pending: Arc<Pending>,
    source: IpAddr,
}

impl Drop for Entered {
    fn drop(&mut self) {
        let mut c = self.pending.lock();
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.by_source.get_mut(&self.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                // Only addresses with callers in progress are kept: the map stays small.
                c.by_source.remove(&self.source);
            }
        }
    }
}

fn authenticate(
    stream: TcpStream,
    me: Rank,
    terms: &Terms,
    deadline: Instant,
) -> Result<(Accepted, TcpStream), TransportError> {
    let io = |e: std::io::Error| TransportError::io("configuring a socket", &e);
    stream.set_nonblocking(false).map_err(io)?;
    stream.set_nodelay(true).map_err(io)?;
    let accepted = handshake::accept(&mut Deadlined::new(&stream, deadline), me, terms)?;
    Ok((accepted, stream))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use socket2::{Domain, Socket, Type};

    use super::*;
    use crate::transport::tcp::Credentials;

    fn terms() -> Terms {
        Terms {
            credentials: Credentials {
                job_id: "gate".into(),
                secret: b"s3cret".to_vec(),
            },
            frame_integrity: false,
        }
    }

    #[test]
    fn each_source_has_its_own_share_of_the_pending_callers() {
        let pending = Arc::new(Pending::default());
        let a = IpAddr::from(Ipv4Addr::new(10, 0, 0, 1));
        let b = IpAddr::from(Ipv4Addr::new(10, 0, 0, 2));
        let mut from_a: Vec<Entered> = (0..MAX_PENDING_PER_SOURCE)
            .map(|_| Pending::enter(&pending, a).unwrap())
            .collect();
        assert!(Pending::enter(&pending, a).is_none());
        // The same address, as a dual-stack listener sees it, has no second share.
        let mapped = IpAddr::from(Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
        assert!(Pending::enter(&pending, mapped).is_none());
        // Another address is served meanwhile.
        let from_b = Pending::enter(&pending, b).unwrap();
        // IPv6 addresses of one /64 share one source.
        let net: Vec<IpAddr> = (1..=MAX_PENDING_PER_SOURCE as u16 + 1)
            .map(|i| std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 7, 0, 0, 0, i).into())
            .collect();
        let from_net: Vec<Entered> = net[..MAX_PENDING_PER_SOURCE]
            .iter()
            .map(|&a| Pending::enter(&pending, a).unwrap())
            .collect();
        assert!(Pending::enter(&pending, net[MAX_PENDING_PER_SOURCE]).is_none());
        drop(from_net);
        // A caller that is done makes room for the next one from its address.
        drop(from_a.pop());
        assert!(Pending::enter(&pending, a).is_some());
        drop((from_a, from_b));
        // Many addresses together reach the overall limit.
        let many: Vec<Entered> = (0..MAX_PENDING)
            .map(|i| {
                let [hi, lo] = u16::try_from(i).unwrap().to_be_bytes();
                Pending::enter(&pending, Ipv4Addr::new(10, 1, hi, lo).into()).unwrap()
            })
            .collect();
        assert!(Pending::enter(&pending, b).is_none());
        drop(many);
        let c = pending.lock();
        assert_eq!((c.total, c.by_source.len()), (0, 0));
    }

    /// What a gate of rank 0 on loopback hands its owner: a caller's rank and address, or why
    /// a proven caller could not be admitted.
    type Admitted = crossbeam_channel::Receiver<Result<(Rank, SocketAddr), TransportError>>;

    /// A gate of rank 0 on a loopback listener of its own, and its address.
    fn gate_on_loopback() -> (TcpListener, SocketAddr, Gate, Admitted) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = crossbeam_channel::unbounded();
        let gate = open(
            &listener,
            0,
            terms(),
            Duration::from_millis(2),
            None,
            || true,
            move |c: Result<Caller, TransportError>| {
                let _ = tx.send(c.map(|c| (c.session.peer, c.addr)));
            },
        )
        .unwrap();
        (listener, addr, gate, rx)
    }

    #[test]
    #[cfg(target_os = "linux")] // Binds 127.0.0.2: all of 127.0.0.0/8 is loopback on Linux.
    fn a_flood_from_one_address_does_not_shut_out_callers_from_another() {
        let (_listener, addr, _gate, rx) = gate_on_loopback();
        // As many silent callers from 127.0.0.2 as one address may have pending (all of
        // 127.0.0.0/8 is loopback). They are queued before the real caller below, and the
        // gate accepts in order: by the time it takes the real caller, these hold their whole
        // share (each for its full handshake timeout).
        let flood_from = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), 0));
        let silent: Vec<Socket> = (0..MAX_PENDING_PER_SOURCE)
            .map(|_| {
                let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
                s.bind(&flood_from.into()).unwrap();
                s.connect_timeout(&addr.into(), Duration::from_secs(30))
                    .unwrap();
                s
            })
            .collect();
        // One attempt, no calling again: a caller the gate closed fails here.
        let caller = TcpStream::connect_timeout(&addr, Duration::from_secs(30)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let session = handshake::connect(&mut Deadlined::new(&caller, deadline), 3, &terms())
            .expect("a caller from another address is served");
        assert_eq!(session.peer, 0);
        let (peer, from) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the gate admits the caller")
            .expect("the caller is proven");
        assert_eq!((peer, from.ip()), (3, IpAddr::from(Ipv4Addr::LOCALHOST)));
        drop(silent);
    }

    #[test]
    fn a_caller_that_disagrees_is_handed_to_the_owner_as_an_error_naming_it() {
        let (_listener, addr, _gate, rx) = gate_on_loopback();
        let caller = TcpStream::connect_timeout(&addr, Duration::from_secs(30)).unwrap();
        let from = caller.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let tagged = Terms {
            frame_integrity: true,
            ..terms()
        };
        let mine = handshake::connect(&mut Deadlined::new(&caller, deadline), 3, &tagged)
            .expect_err("the ends disagree")
            .to_string();
        assert!(
            mine.contains("rank 0 frames without integrity tags"),
            "{mine}"
        );
        let theirs = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the gate reports the caller")
            .expect_err("the caller disagrees")
            .to_string();
        assert!(
            theirs.contains(&format!("rank 3 at {from} frames with integrity tags")),
            "{theirs}"
        );
        assert!(
            theirs.contains(super::super::env::FRAME_INTEGRITY),
            "{theirs}"
        );
    }
}
