//! The door of a listener: every caller is authenticated on a thread of its own within one
//! deadline, at most [`MAX_PENDING`] at a time, so a silent, trickling or flooding caller holds
//! up nobody else; a failed `accept` (descriptors exhausted, a caller that reset) is logged and
//! retried, never fatal.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::handshake::{self, Credentials, Deadlined, Session};
use crate::Rank;
use crate::error::TransportError;

/// Most callers a listener authenticates at once; more are closed at once (and retry).
pub(super) const MAX_PENDING: usize = 32;
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
/// no: each caller that proves the job's credentials is passed to `admit`, on its own thread.
/// A caller's deadline is [`HANDSHAKE_TIMEOUT`] from its arrival, and never later than `limit`.
pub(super) fn open(
    listener: &TcpListener,
    me: Rank,
    cred: Credentials,
    poll: Duration,
    limit: Option<Instant>,
    keep_open: impl Fn() -> bool + Send + 'static,
    admit: impl Fn(Caller) + Send + Sync + 'static,
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
    let pending = Arc::new(AtomicUsize::new(0));
    let admit = Arc::new(admit);
    std::thread::Builder::new()
        .name(format!("wagma-tcp-{me}-gate"))
        .spawn(move || {
            while open.load(Ordering::Acquire) && keep_open() {
                match listener.accept() {
                    Ok((stream, addr)) => {
                        if pending.load(Ordering::Acquire) >= MAX_PENDING {
                            tracing::warn!(rank = me, %addr, "too many callers at once: closed one");
                            continue;
                        }
                        let own = Instant::now() + HANDSHAKE_TIMEOUT;
                        let deadline = limit.map_or(own, |l| l.min(own));
                        pending.fetch_add(1, Ordering::AcqRel);
                        let guard = Pending(Arc::clone(&pending));
                        let (cred, admit) = (cred.clone(), Arc::clone(&admit));
                        let spawned = std::thread::Builder::new()
                            .name(format!("wagma-tcp-{me}-caller"))
                            .spawn(move || {
                                let _guard = guard;
                                match authenticate(stream, me, &cred, deadline) {
                                    Ok((session, stream)) => admit(Caller {
                                        session,
                                        stream,
                                        addr,
                                        deadline,
                                    }),
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

/// Counts a caller being authenticated for as long as it lives.
struct Pending(Arc<AtomicUsize>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn authenticate(
    stream: TcpStream,
    me: Rank,
    cred: &Credentials,
    deadline: Instant,
) -> Result<(Session, TcpStream), TransportError> {
    let io = |e: std::io::Error| TransportError::io("configuring a socket", &e);
    stream.set_nonblocking(false).map_err(io)?;
    stream.set_nodelay(true).map_err(io)?;
    let session = handshake::accept(&mut Deadlined::new(&stream, deadline), me, cred)?;
    Ok((session, stream))
}
