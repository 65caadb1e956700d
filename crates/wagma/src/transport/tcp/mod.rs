//! The TCP transport: processes on one or many hosts.
//!
//! Start-up: rank 0 listens on the rendezvous address; every rank opens a listener for its
//! peers, registers its address with rank 0 and receives the table of all addresses. Each pair
//! of ranks then shares exactly one connection (the higher rank connects to the lower), reused
//! by every group, round and collective. Every connection, the rendezvous included, starts with
//! a mutual handshake on the job id and shared secret, in which both ends also agree on whether
//! frames carry integrity tags; a peer that fails it is refused and logged, and one that proves
//! the secret but disagrees fails both ends at once with an error naming the setting. Messages are length-prefixed frames with a checked maximum size ([`super::frame`]);
//! a reader thread per connection feeds the rank's inbox, and a writer thread per connection
//! writes what the engine thread queues for it (the `writer` module). Where the engine will sum
//! a peer's part with its own, it says so before the part arrives ([`Transport::fold`]), and
//! the reader sums it piece by piece as it copies it out of the socket.

mod expected;
mod gate;
mod handshake;
mod integrity;
mod rejoin;
mod rendezvous;
mod writer;

use std::io::BufReader;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use expected::Expected;
pub use handshake::Credentials;
use handshake::{Deadlined, Session, Terms};
use integrity::FrameMac;
use writer::Writer;

use super::frame::read_frame_folding;
use super::{Envelope, Fold, Incoming, Lost, MAX_QUEUED_PER_PEER, Transport};
use crate::Rank;
use crate::error::{ConfigError, TransportError};

/// Largest piece of a frame a connection hands the kernel in one write. A blocking write
/// returns only when all of it is taken, so in pieces a link that moves at all shows progress
/// often (a stalled peer is told from a slow one). And on loopback a 64 MiB frame in pieces of
/// 1-4 MiB arrived faster than in one write (1.04-1.20x in `wagma bench collectives
/// --transport tcp --ranks 2`), while pieces of 256 KiB or 16 MiB were slower; the benchmark's
/// raw loopback stream writes in the same pieces.
pub const WRITE_PIECE_BYTES: usize = 4 << 20;

/// Where and how a rank joins a TCP job.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// This rank.
    pub rank: Rank,
    /// Number of ranks P.
    pub world: usize,
    /// `host:port` of rank 0's rendezvous listener.
    pub rendezvous: String,
    /// Address on which this rank listens for its peers (`None`: the address it uses to reach
    /// the rendezvous, or loopback for rank 0).
    pub bind: Option<IpAddr>,
    /// Job id and secret.
    pub credentials: Credentials,
    /// Limit for the whole start-up (rendezvous and all connections).
    pub connect_timeout: Duration,
    /// How long a connection may take nothing before its peer is reported lost: the limit of
    /// one write on its writer thread and of a frame's wait for room in its queue. It also
    /// paces keepalive (a vanished host is found about this long after it went silent). The
    /// trainer sets it to `--timeout`.
    pub io_timeout: Duration,
    /// Largest frame body accepted or sent.
    pub max_frame_bytes: u64,
    /// This process replaces a rank of a running job that lost it (elastic mode): it asks rank
    /// 0 for the addresses and connects to every living peer.
    pub rejoin: bool,
    /// Keep listening after start-up for restarted peers that rejoin (elastic mode).
    pub accept_rejoins: bool,
    /// Rank 0 writes the address its rendezvous listener bound to this file, so that a
    /// rendezvous on port 0 (the OS picks a free one) can be handed to the other ranks.
    pub rendezvous_file: Option<std::path::PathBuf>,
    /// Rank 0 serves the rendezvous on this inherited listening socket instead of binding
    /// one (`wagma launch` binds it, so the port is never free for another process to take).
    pub rendezvous_fd: Option<i32>,
    /// Run with an empty secret although the job listens beyond loopback, where anyone who
    /// can reach a listener could join it (a warning is logged). Off by default: such a job
    /// refuses to start without a secret.
    pub allow_empty_secret: bool,
    /// Tag every frame with an HMAC under the connection's key, so that model data altered,
    /// dropped, replayed or reordered on the way is detected (the connection is then reported
    /// lost). Off by default: it costs CPU time per byte (the README gives the measured cost).
    /// It does not encrypt. Every rank of a job must set it alike: the handshake refuses a
    /// connection whose ends differ, with an error on both that names the setting.
    pub frame_integrity: bool,
}

/// Environment variables read by [`TcpConfig::from_env`].
pub mod env {
    /// This rank (0-based).
    pub const RANK: &str = "WAGMA_RANK";
    /// Number of ranks.
    pub const WORLD_SIZE: &str = "WAGMA_WORLD_SIZE";
    /// `host:port` of the rendezvous (rank 0 listens there).
    pub const RENDEZVOUS: &str = "WAGMA_RENDEZVOUS";
    /// Job id (default `wagma`).
    pub const JOB_ID: &str = "WAGMA_JOB_ID";
    /// Shared secret (default empty, which only a job on loopback accepts).
    pub const SECRET: &str = "WAGMA_SECRET";
    /// A file holding the shared secret, readable by its owner only (mode 0600), instead of
    /// [`SECRET`].
    pub const SECRET_FILE: &str = "WAGMA_SECRET_FILE";
    /// Seconds a connection may take nothing before its peer is reported lost (default 60);
    /// see [`super::TcpConfig::io_timeout`].
    pub const IO_TIMEOUT: &str = "WAGMA_IO_TIMEOUT_S";
    /// `1`: tag every frame for integrity (see [`super::TcpConfig::frame_integrity`]).
    pub const FRAME_INTEGRITY: &str = "WAGMA_FRAME_INTEGRITY";
    /// `1`: run with an empty secret beyond loopback (see
    /// [`super::TcpConfig::allow_empty_secret`]).
    pub const ALLOW_EMPTY_SECRET: &str = "WAGMA_ALLOW_EMPTY_SECRET";
    /// Address to listen on for peers (optional).
    pub const BIND: &str = "WAGMA_BIND";
    /// File where rank 0 writes the rendezvous address it bound (optional; see
    /// [`super::TcpConfig::rendezvous_file`]).
    pub const RENDEZVOUS_FILE: &str = "WAGMA_RENDEZVOUS_FILE";
    /// An inherited listening socket for rank 0's rendezvous (optional; see
    /// [`super::TcpConfig::rendezvous_fd`]).
    pub const RENDEZVOUS_FD: &str = "WAGMA_RENDEZVOUS_FD";
}

impl TcpConfig {
    /// A configuration with default limits.
    pub fn new(
        rank: Rank,
        world: usize,
        rendezvous: impl Into<String>,
        credentials: Credentials,
    ) -> TcpConfig {
        TcpConfig {
            rank,
            world,
            rendezvous: rendezvous.into(),
            bind: None,
            credentials,
            connect_timeout: Duration::from_secs(60),
            io_timeout: Duration::from_secs(60),
            max_frame_bytes: super::DEFAULT_MAX_FRAME,
            rejoin: false,
            accept_rejoins: false,
            rendezvous_file: None,
            rendezvous_fd: None,
            allow_empty_secret: false,
            frame_integrity: false,
        }
    }

    /// Reads the rank, world size and rendezvous from the launcher's environment (see
    /// [`super::discover`]: wagma, Open MPI, PMI, SLURM or torchrun variables), and
    /// `WAGMA_JOB_ID`, `WAGMA_SECRET` (or `WAGMA_SECRET_FILE`), `WAGMA_ALLOW_EMPTY_SECRET`,
    /// `WAGMA_IO_TIMEOUT_S` and `WAGMA_BIND`.
    pub fn from_env() -> Result<TcpConfig, ConfigError> {
        let get = |k: &str| std::env::var(k).ok();
        let d = super::discover::discover_env()?.ok_or(ConfigError::Invalid {
            what: "launcher environment",
            detail: "no rank found: start under `wagma launch`, mpirun, srun or torchrun, or set WAGMA_RANK and WAGMA_WORLD_SIZE".into(),
        })?;
        let rendezvous = d.rendezvous.ok_or(ConfigError::Invalid {
            what: env::RENDEZVOUS,
            detail: format!(
                "not set, and {} gives no address for rank 0 (set {} or MASTER_ADDR)",
                d.source,
                env::RENDEZVOUS
            ),
        })?;
        let credentials = Credentials {
            job_id: get(env::JOB_ID).unwrap_or_else(|| "wagma".into()),
            secret: secret_from_env()?,
        };
        let mut cfg = TcpConfig::new(d.rank, d.world, rendezvous, credentials);
        cfg.allow_empty_secret = get(env::ALLOW_EMPTY_SECRET).is_some_and(|v| v.trim() == "1");
        cfg.frame_integrity = get(env::FRAME_INTEGRITY).is_some_and(|v| v.trim() == "1");
        if let Some(b) = get(env::BIND) {
            cfg.bind = Some(b.parse().map_err(|_| ConfigError::Invalid {
                what: env::BIND,
                detail: format!("{b:?} is not an IP address"),
            })?);
        }
        if let Some(t) = get(env::IO_TIMEOUT) {
            cfg.io_timeout = t
                .trim()
                .parse::<f64>()
                .ok()
                .and_then(crate::util::timeout_from_secs)
                .ok_or_else(|| ConfigError::Invalid {
                    what: env::IO_TIMEOUT,
                    detail: format!(
                        "{t:?} is not a positive number of seconds up to {}",
                        crate::util::MAX_TIMEOUT.as_secs()
                    ),
                })?;
        }
        cfg.rendezvous_file = get(env::RENDEZVOUS_FILE).map(Into::into);
        if let Some(fd) = get(env::RENDEZVOUS_FD) {
            cfg.rendezvous_fd = Some(fd.trim().parse().map_err(|_| ConfigError::Invalid {
                what: env::RENDEZVOUS_FD,
                detail: format!("{fd:?} is not a file descriptor"),
            })?);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// What every connection of this rank must agree on with its peer.
    fn terms(&self) -> Terms {
        Terms {
            credentials: self.credentials.clone(),
            frame_integrity: self.frame_integrity,
        }
    }

    /// Checks rank, world size and timeouts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        super::discover::check_rank(self.rank, self.world)?;
        crate::util::check_timeout("connect timeout", self.connect_timeout)?;
        crate::util::check_timeout("I/O timeout", self.io_timeout)
    }
}

/// The secret from `WAGMA_SECRET` or from the file `WAGMA_SECRET_FILE` names (one of them;
/// the file readable by its owner only). Surrounding whitespace of the file is not part of it.
fn secret_from_env() -> Result<Vec<u8>, ConfigError> {
    match (
        std::env::var(env::SECRET).ok(),
        std::env::var_os(env::SECRET_FILE),
    ) {
        (Some(_), Some(_)) => Err(ConfigError::Invalid {
            what: env::SECRET_FILE,
            detail: format!(
                "set either {} or {}, not both",
                env::SECRET,
                env::SECRET_FILE
            ),
        }),
        (Some(s), None) => Ok(s.into_bytes()),
        (None, Some(path)) => read_secret_file(std::path::Path::new(&path)),
        (None, None) => Ok(Vec::new()),
    }
}

/// Reads a secret file, refusing one that others may read or write.
pub fn read_secret_file(path: &std::path::Path) -> Result<Vec<u8>, ConfigError> {
    let invalid = |detail: String| ConfigError::Invalid {
        what: env::SECRET_FILE,
        detail,
    };
    let meta = std::fs::metadata(path)
        .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(invalid(format!(
                "{} has mode {mode:o}: others may read it; make it 600 (chmod 600)",
                path.display()
            )));
        }
    }
    #[cfg(not(unix))]
    let _ = meta;
    let text =
        std::fs::read(path).map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
    Ok(text.trim_ascii().to_vec())
}

/// Secrets shorter than this many bytes are worth a warning beyond loopback.
const SHORT_SECRET: usize = 16;

/// An empty secret lets anyone who can reach a listener join the job: accepted on loopback,
/// elsewhere only when the user opted out of it.
fn check_secret(cfg: &TcpConfig, addrs: &[IpAddr]) -> Result<(), TransportError> {
    let Some(exposed) = addrs.iter().find(|a| !a.is_loopback()) else {
        return Ok(());
    };
    let secret = &cfg.credentials.secret;
    if !secret.is_empty() {
        if secret.len() < SHORT_SECRET {
            // A caller's proof reaches whoever answers at the address it calls, who can test
            // guesses against it offline.
            tracing::warn!(
                rank = cfg.rank,
                %exposed,
                "the secret has only {} bytes: use a long random one (openssl rand -hex 32)",
                secret.len()
            );
        }
        return Ok(());
    }
    if cfg.allow_empty_secret {
        tracing::warn!(
            rank = cfg.rank,
            %exposed,
            "no secret: anyone who can reach {exposed} can join this job"
        );
        return Ok(());
    }
    Err(TransportError::Rendezvous(format!(
        "rank {}: no secret is set and the job listens on {exposed}, beyond loopback, where \
         anyone who can reach it could join; set {} (or {} to a file of mode 0600) on every \
         rank, or set {}=1 to run without one",
        cfg.rank,
        env::SECRET,
        env::SECRET_FILE,
        env::ALLOW_EMPTY_SECRET
    )))
}

/// The read half of a connection.
struct Reader {
    stream: TcpStream,
    mac: Option<FrameMac>,
}

/// One rank's connections to every peer.
pub struct TcpTransport {
    rank: Rank,
    writers: Vec<Option<Writer>>,
    /// Connections of rejoined peers accepted since the last send, waiting to be used.
    adopted: Arc<rejoin::Adopted>,
    /// Per peer: messages its readers put in the inbox that the engine has not taken yet.
    queued: Arc<[AtomicUsize]>,
    /// Per peer: payloads its reader combines with this rank's part as they arrive.
    expected: Arc<Expected>,
}

/// How long a farewell may block on a peer's full connection.
const FAREWELL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

impl Transport for TcpTransport {
    fn leaving(&mut self) {
        self.adopted.take_into(&mut self.writers);
        for w in self.writers.iter_mut().flatten() {
            w.shorten(FAREWELL_WRITE_TIMEOUT);
        }
    }

    fn disconnect(&mut self, peer: Rank) {
        // Closing the socket ends its reader too, which marks the peer as no longer connected:
        // a rejoin for the rank is then accepted.
        if let Some(w) = self.writers.get_mut(peer).and_then(Option::take) {
            w.abandon();
        }
    }

    fn taken(&self, from: Rank) {
        if let Some(q) = self.queued.get(from) {
            // Saturating: a message counted by an earlier reader of a rejoined peer is still
            // taken once.
            let _ = q.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
    }

    /// The peer's reader combines the payload piece by piece as it copies it out of the
    /// socket: the received values never make a round trip through memory of their own, and
    /// the sum overlaps the transfer (a group allreduce by recursive doubling of 64 MiB over
    /// two ranks on loopback ran 1.15-1.19x faster than receiving whole and summing after).
    fn fold(&mut self, from: Rank, fold: Fold) {
        let queued = &self.queued;
        self.expected.ask(from, fold, || {
            queued.get(from).map_or(0, |q| q.load(Ordering::Acquire))
        });
    }

    fn folds(&self) -> bool {
        true
    }

    fn expect_fold(&mut self, from: Rank, tag: super::Tag) {
        self.expected.expect(from, tag);
    }

    fn unfold(&mut self, from: Rank, tag: super::Tag) {
        self.expected.withdraw(from, &tag);
    }

    fn send(&mut self, to: Rank, env: Envelope) -> Result<(), TransportError> {
        if env.data.is_virtual() && !env.data.is_empty() {
            return Err(TransportError::Malformed(
                "a virtual payload exists only in simulations; TCP carries values".into(),
            ));
        }
        self.writer(to)?.send(env)
    }
}

impl Drop for TcpTransport {
    /// Every connection writes what is queued at once, within one linger time for all.
    fn drop(&mut self) {
        self.adopted.take_into(&mut self.writers);
        writer::close_all(self.writers.iter_mut().flatten());
    }
}

impl TcpTransport {
    /// The connection to `to`, with the latest rejoined peers' connections in place.
    fn writer(&mut self, to: Rank) -> Result<&Writer, TransportError> {
        self.adopted.take_into(&mut self.writers);
        self.writers
            .get(to)
            .and_then(Option::as_ref)
            .ok_or_else(|| TransportError::Peer {
                peer: to,
                message: format!("rank {} has no connection to it", self.rank),
            })
    }

    /// Writes raw bytes on the connection to `peer`, bypassing the framing: fault injection
    /// (a corrupted stream must end in a named error at the peer, never in a hang or a panic).
    pub fn inject_raw(&mut self, peer: Rank, bytes: &[u8]) -> Result<(), TransportError> {
        self.writer(peer)?.send_raw(bytes.to_vec())
    }
}

/// `ranks` for an error message: "rank 3", "ranks 1, 4 and 7", or the first few of many
/// and how many there are.
fn ranks_text(ranks: impl Iterator<Item = Rank>) -> String {
    const SHOWN: usize = 8;
    let all: Vec<Rank> = ranks.collect();
    let listed = |xs: &[Rank]| {
        xs.iter()
            .map(Rank::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match all.as_slice() {
        [] => "no rank".into(),
        [one] => format!("rank {one}"),
        [first @ .., last] if all.len() <= SHOWN => format!("ranks {} and {last}", listed(first)),
        _ => format!(
            "ranks {}, ... ({} in all)",
            listed(&all[..SHOWN]),
            all.len()
        ),
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, TransportError> {
    addr.to_socket_addrs()
        .map_err(|e| TransportError::Rendezvous(format!("cannot resolve {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| TransportError::Rendezvous(format!("{addr:?} resolves to nothing")))
}

fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Connects to `addr`, retrying until `deadline` (the listener may not be up yet). The error
/// says why the last try failed; the caller names whom it tried to reach.
fn connect_retry(addr: SocketAddr, deadline: Instant) -> Result<TcpStream, TransportError> {
    loop {
        match TcpStream::connect_timeout(&addr, left(deadline).min(Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(TransportError::io("no connection before the deadline", &e));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn prepare(s: &TcpStream) -> Result<(), TransportError> {
    s.set_nodelay(true)
        .map_err(|e| TransportError::io("configuring a socket", &e))
}

/// Keepalive of established connections: after half the I/O timeout of silence, a probe
/// every sixth of it, and the connection is dead after this many unanswered probes; so a
/// vanished host is found about one I/O timeout (the job's `--timeout`) after it went silent.
#[cfg(any(target_os = "linux", target_os = "macos", target_os = "freebsd"))]
const KEEPALIVE_RETRIES: u32 = 3;

/// How often a listener looks for callers during start-up.
const START_POLL: Duration = Duration::from_millis(2);
/// How long a caller waits before calling again a listener that dropped it.
const RECALL: Duration = Duration::from_millis(50);

/// Connects to `addr` and authenticates as rank `me` on `terms`, calling again until `deadline`
/// while the connection fails (the listener may not be up yet, or be busy with other callers);
/// a refusal or a disagreement is final.
fn call(
    addr: SocketAddr,
    me: Rank,
    terms: &Terms,
    deadline: Instant,
) -> Result<(Session, TcpStream), TransportError> {
    loop {
        let st = connect_retry(addr, deadline)?;
        prepare(&st)?;
        match handshake::connect(&mut Deadlined::new(&st, deadline), me, terms) {
            Ok(session) => return Ok((session, st)),
            Err(TransportError::Io { .. }) if Instant::now() + RECALL < deadline => {
                std::thread::sleep(RECALL);
            }
            Err(e) => return Err(e),
        }
    }
}

/// The listening socket a launcher handed this process as descriptor `fd` (taken once).
#[cfg(unix)]
fn inherited_listener(fd: i32) -> Result<TcpListener, TransportError> {
    use std::os::fd::FromRawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    if fd < 0 || TAKEN.swap(true, Ordering::SeqCst) {
        return Err(TransportError::Rendezvous(format!(
            "the inherited rendezvous socket (descriptor {fd}) is invalid or already in use"
        )));
    }
    // SAFETY: the launcher passed this descriptor for exactly this use; the flag above makes
    // this the only owner in the process, so it is closed once.
    let l = unsafe { TcpListener::from_raw_fd(fd) };
    l.local_addr().map_err(|e| {
        TransportError::io(format!("descriptor {fd} is not a listening socket"), &e)
    })?;
    Ok(l)
}

#[cfg(not(unix))]
fn inherited_listener(fd: i32) -> Result<TcpListener, TransportError> {
    Err(TransportError::Rendezvous(format!(
        "inherited rendezvous sockets (descriptor {fd}) need a Unix system"
    )))
}

/// Writes `addr` to `path` atomically (a complete file or none).
fn publish_rendezvous(path: &std::path::Path, addr: SocketAddr) -> std::io::Result<()> {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, addr.to_string())?;
    std::fs::rename(&tmp, path)
}

/// The rendezvous address rank 0 wrote to `path` ([`TcpConfig::rendezvous_file`]), once it
/// has: `None` before.
pub fn read_rendezvous(path: &std::path::Path) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    s.trim().parse::<SocketAddr>().ok().map(|a| a.to_string())
}

/// Joins the job described by `cfg`: rendezvous, one authenticated connection per peer, a
/// reader thread per connection delivering into `inbox`.
pub fn connect(cfg: &TcpConfig, inbox: Sender<Incoming>) -> Result<TcpTransport, TransportError> {
    cfg.validate()
        .map_err(|e| TransportError::Rendezvous(e.to_string()))?;
    let deadline = Instant::now() + cfg.connect_timeout;
    let me = cfg.rank;
    let p = cfg.world;
    let rdv = resolve(&cfg.rendezvous)?;
    let rdv_listener = if me == 0 {
        let l = match cfg.rendezvous_fd {
            Some(fd) => inherited_listener(fd)?,
            None => TcpListener::bind(rdv)
                .map_err(|e| TransportError::io(format!("binding the rendezvous {rdv}"), &e))?,
        };
        if let Some(path) = &cfg.rendezvous_file {
            let bound = l
                .local_addr()
                .map_err(|e| TransportError::io("rendezvous address", &e))?;
            publish_rendezvous(path, bound)
                .map_err(|e| TransportError::io(format!("writing {}", path.display()), &e))?;
        }
        Some(l)
    } else {
        None
    };
    let bind_ip = match cfg.bind {
        Some(ip) => ip,
        None if me == 0 => rdv.ip(),
        None => {
            // The address this host routes to rank 0 from is one rank 0 can reach us on; a
            // connected UDP socket reveals it without sending anything.
            let unspecified: SocketAddr = if rdv.is_ipv4() {
                (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
            } else {
                (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
            };
            let probe = std::net::UdpSocket::bind(unspecified)
                .and_then(|u| u.connect(rdv).map(|()| u))
                .and_then(|u| u.local_addr())
                .map_err(|e| TransportError::io("finding the local address", &e))?;
            probe.ip()
        }
    };
    check_secret(cfg, &[rdv.ip(), bind_ip])?;
    let listener = TcpListener::bind((bind_ip, 0))
        .map_err(|e| TransportError::io(format!("binding {bind_ip}"), &e))?;
    let my_addr = listener
        .local_addr()
        .map_err(|e| TransportError::io("listener address", &e))?;

    let table = match (&rdv_listener, cfg.rejoin) {
        (Some(_), true) => {
            return Err(TransportError::Rendezvous(
                "rank 0 serves the rendezvous and cannot rejoin a running job".into(),
            ));
        }
        (Some(l), false) => rendezvous::serve(l, cfg, my_addr, deadline)?,
        (None, rejoin) => rendezvous::register(rdv, cfg, my_addr, deadline, rejoin)?,
    };
    let streams = if cfg.rejoin {
        rejoin::connect_to_all(cfg, &table, deadline)?
    } else {
        connect_pairs(&listener, cfg, &table, deadline)?
    };
    let adopted = Arc::new(rejoin::Adopted::new(p));
    let link = Link {
        me,
        inbox,
        io_timeout: cfg.io_timeout,
        max_frame: cfg.max_frame_bytes,
        connected: (0..p).map(|_| AtomicBool::new(false)).collect(),
        queued: (0..p).map(|_| AtomicUsize::new(0)).collect(),
        integrity: cfg.frame_integrity,
        expected: Arc::new(Expected::new(p)),
    };
    let queued = Arc::clone(&link.queued);
    let expected = Arc::clone(&link.expected);
    let mut writers = Vec::with_capacity(p);
    for (peer, st) in streams.into_iter().enumerate() {
        writers.push(match st {
            Some((st, session)) => {
                let (w, r) = link.split(st, &session)?;
                link.read(peer, r)?;
                Some(w)
            }
            None => None,
        });
    }
    if cfg.accept_rejoins {
        if let Some(l) = rdv_listener {
            rejoin::serve_table(&l, cfg.terms(), table, link.clone(), &adopted)?;
        }
        rejoin::serve_peers(&listener, cfg.terms(), p, link, &adopted)?;
    }
    Ok(TcpTransport {
        rank: me,
        writers,
        adopted,
        queued,
        expected,
    })
}

/// Start-up: one connection per pair of ranks (the higher connects to the lower), each
/// authenticated.
fn connect_pairs(
    listener: &TcpListener,
    cfg: &TcpConfig,
    table: &[SocketAddr],
    deadline: Instant,
) -> Result<Vec<Option<(TcpStream, Session)>>, TransportError> {
    let (me, p) = (cfg.rank, cfg.world);
    // Higher ranks are accepted in the background while this rank calls the lower ones; a
    // member of the job that disagrees on the terms ends the start-up at once.
    let (tx, rx) = crossbeam_channel::unbounded();
    let _gate = gate::open(
        listener,
        me,
        cfg.terms(),
        START_POLL,
        Some(deadline),
        || true,
        move |c: Result<gate::Caller, TransportError>| {
            let _ = tx.send(c.map(|c| (c.session.peer, (c.stream, c.session))));
        },
    )?;
    let mut streams: Vec<Option<(TcpStream, Session)>> = (0..p).map(|_| None).collect();
    for (peer, addr) in table.iter().enumerate().take(me) {
        streams[peer] = Some(connect_to(*addr, peer, cfg, deadline)?);
    }
    let higher = p - 1 - me;
    let mut accepted = 0;
    while accepted < higher {
        let (peer, st) = rx.recv_deadline(deadline).map_err(|_| {
            let missing = (me + 1..p).filter(|&r| streams[r].is_none());
            TransportError::Rendezvous(format!(
                "rank {me}: only {accepted} of {higher} higher ranks connected in time; {} did \
                 not",
                ranks_text(missing)
            ))
        })??;
        if peer <= me || peer >= p {
            tracing::warn!(
                rank = me,
                peer,
                "refused a connection claiming an unexpected rank"
            );
            continue;
        }
        if streams[peer].is_some() {
            return Err(TransportError::Handshake(format!(
                "rank {peer} connected twice"
            )));
        }
        streams[peer] = Some(st);
        accepted += 1;
    }
    Ok(streams)
}

/// Connects to rank `peer` at `addr` and authenticates both ends. A failure names this rank,
/// the peer and its address.
fn connect_to(
    addr: SocketAddr,
    peer: Rank,
    cfg: &TcpConfig,
    deadline: Instant,
) -> Result<(TcpStream, Session), TransportError> {
    let me = cfg.rank;
    let context = |why: String| format!("rank {me}, connecting to rank {peer} at {addr}: {why}");
    let (session, st) = call(addr, me, &cfg.terms(), deadline).map_err(|e| match e {
        // A refused handshake is a matter of credentials or settings, not of the peer's
        // health: it stays a handshake error (and blames no peer).
        TransportError::Handshake(why) => TransportError::Handshake(context(why)),
        other => TransportError::Peer {
            peer,
            message: context(other.to_string()),
        },
    })?;
    if session.peer != peer {
        return Err(TransportError::Handshake(context(format!(
            "rank {} answered there instead",
            session.peer
        ))));
    }
    Ok((st, session))
}

/// What every connection of a rank shares: where its reader delivers, its limits.
#[derive(Clone)]
struct Link {
    me: Rank,
    inbox: Sender<Incoming>,
    io_timeout: Duration,
    max_frame: u64,
    /// Per peer: whether a reader delivers from it now.
    connected: Arc<[AtomicBool]>,
    /// Per peer: messages in the inbox not taken by the engine yet (see
    /// [`MAX_QUEUED_PER_PEER`]).
    queued: Arc<[AtomicUsize]>,
    /// Frames carry integrity tags.
    integrity: bool,
    /// Per peer: folds the engine asked for (see [`Transport::fold`]).
    expected: Arc<Expected>,
}

impl Link {
    /// Splits an authenticated connection into its write half and its read half.
    fn split(&self, st: TcpStream, session: &Session) -> Result<(Writer, Reader), TransportError> {
        let io = |e: std::io::Error| TransportError::io("configuring a connection", &e);
        // Reads block for as long as a peer has nothing to say, so a peer whose host vanished
        // (no FIN, no RST) is found by keepalive probes instead, after which the read fails
        // and the peer is reported lost.
        let second = Duration::from_secs(1);
        let keepalive = socket2::TcpKeepalive::new()
            .with_time((self.io_timeout / 2).max(second))
            .with_interval((self.io_timeout / 6).max(second));
        #[cfg(any(target_os = "linux", target_os = "macos", target_os = "freebsd"))]
        let keepalive = keepalive.with_retries(KEEPALIVE_RETRIES);
        socket2::SockRef::from(&st)
            .set_tcp_keepalive(&keepalive)
            .map_err(io)?;
        st.set_read_timeout(None).map_err(io)?;
        st.set_write_timeout(Some(self.io_timeout)).map_err(io)?;
        let stream = st.try_clone().map_err(io)?;
        let mac = |f: fn(&Session) -> FrameMac| self.integrity.then(|| f(session));
        let writer = Writer::spawn(
            self.me,
            session.peer,
            st,
            mac(FrameMac::sending),
            self.io_timeout,
            self.max_frame,
        )?;
        Ok((
            writer,
            Reader {
                stream,
                mac: mac(FrameMac::receiving),
            },
        ))
    }

    /// True while a reader delivers what `peer` sends: the connection to it is not lost.
    fn is_connected(&self, peer: Rank) -> bool {
        self.connected
            .get(peer)
            .is_some_and(|c| c.load(Ordering::Acquire))
    }

    /// Claims `peer`'s slot for a new connection: true for exactly one caller while no reader
    /// delivers from it (two processes rejoining as one rank at once cannot both be taken).
    /// A claim whose connection then fails to open is given back with [`Link::release`].
    fn claim(&self, peer: Rank) -> bool {
        self.connected.get(peer).is_some_and(|c| {
            c.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })
    }

    /// Gives back a claim whose connection did not open.
    fn release(&self, peer: Rank) {
        if let Some(c) = self.connected.get(peer) {
            c.store(false, Ordering::Release);
        }
    }

    /// Starts the thread that delivers what `peer` sends on `reader` into the inbox, until
    /// the connection is lost.
    fn read(&self, peer: Rank, reader: Reader) -> Result<(), TransportError> {
        let (me, max, inbox) = (self.me, self.max_frame, self.inbox.clone());
        let connected = Arc::clone(&self.connected);
        let queued = Arc::clone(&self.queued);
        let expected = Arc::clone(&self.expected);
        // A fold asked for while no connection delivered from the peer belongs to none.
        expected.forget(peer);
        if let Some(c) = connected.get(peer) {
            c.store(true, Ordering::Release);
        }
        std::thread::Builder::new()
            .name(format!("wagma-tcp-{me}<-{peer}"))
            .spawn(move || {
                let Reader { stream, mut mac } = reader;
                let mut r = BufReader::with_capacity(256 * 1024, stream);
                let mut scratch = Vec::new();
                let reason = loop {
                    let fold = |from, tag: &_| {
                        if from == peer {
                            expected.reading(peer, tag)
                        } else {
                            None
                        }
                    };
                    let frame = match &mut mac {
                        None => read_frame_folding(&mut r, max, &mut scratch, fold),
                        Some(mac) => {
                            let mut check = integrity::Check::new(&mut r, mac);
                            match read_frame_folding(&mut check, max, &mut scratch, fold) {
                                Ok(Some(d)) => match check.verify() {
                                    Ok(true) => Ok(Some(d)),
                                    Ok(false) => break "a frame failed its integrity check".into(),
                                    Err(e) => Err(TransportError::io("reading a frame's tag", &e)),
                                },
                                other => other,
                            }
                        }
                    };
                    match frame {
                        // Lengths without values would turn this job's sums into no-ops:
                        // only a control message's empty one is real.
                        Ok(Some(d)) if d.env.data.is_virtual() && !d.env.data.is_empty() => {
                            break "a frame with a virtual payload".to_string();
                        }
                        Ok(Some(d)) if d.env.from == peer => {
                            let waiting = queued
                                .get(peer)
                                .map_or(0, |q| q.fetch_add(1, Ordering::AcqRel));
                            if waiting >= MAX_QUEUED_PER_PEER {
                                break format!(
                                    "it sent more than {MAX_QUEUED_PER_PEER} messages that this \
                                     rank's engine has not taken in"
                                );
                            }
                            // Counted in the queue above, so no longer "being read": by the
                            // time the engine takes it, a fold may be asked for again.
                            expected.delivered(peer);
                            if inbox.send(Ok(d)).is_err() {
                                return;
                            }
                        }
                        Ok(Some(d)) => {
                            break format!("frame claims to come from rank {}", d.env.from);
                        }
                        Ok(None) => break "connection closed".to_string(),
                        Err(e) => break e.to_string(),
                    }
                };
                expected.forget(peer);
                // Marked lost before the engine hears of it: a rejoin it then expects is
                // accepted.
                if let Some(c) = connected.get(peer) {
                    c.store(false, Ordering::Release);
                }
                let _ = inbox.send(Err(Lost { peer, reason }));
            })
            .map(|_| ())
            .map_err(|e| TransportError::io("starting a reader thread", &e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_in_an_error_are_listed_and_many_are_cut_short() {
        assert_eq!(ranks_text([].into_iter()), "no rank");
        assert_eq!(ranks_text([3].into_iter()), "rank 3");
        assert_eq!(ranks_text([1, 4, 7].into_iter()), "ranks 1, 4 and 7");
        assert_eq!(
            ranks_text(1..100),
            "ranks 1, 2, 3, 4, 5, 6, 7, 8, ... (99 in all)"
        );
    }

    #[test]
    fn a_rank_slot_is_claimed_by_one_connection_at_a_time() {
        let (inbox, _rx) = crossbeam_channel::unbounded();
        let link = Link {
            me: 0,
            inbox,
            io_timeout: Duration::from_secs(1),
            max_frame: 1 << 20,
            connected: (0..3).map(|_| AtomicBool::new(false)).collect(),
            queued: (0..3).map(|_| AtomicUsize::new(0)).collect(),
            integrity: false,
            expected: Arc::new(Expected::new(3)),
        };
        // Two processes rejoining as rank 1 at once: only the first is taken.
        assert!(link.claim(1));
        assert!(!link.claim(1));
        assert!(link.is_connected(1));
        // Its connection failed to open: the slot is free again.
        link.release(1);
        assert!(!link.is_connected(1));
        assert!(link.claim(1));
        assert!(!link.claim(3), "no such rank");
    }

    #[test]
    fn timeouts_no_clock_can_add_are_refused() {
        let cred = Credentials {
            job_id: "job".into(),
            secret: b"s3cret".to_vec(),
        };
        let mut cfg = TcpConfig::new(1, 2, "127.0.0.1:1", cred);
        assert!(cfg.validate().is_ok());
        cfg.io_timeout = Duration::MAX;
        assert!(
            cfg.validate()
                .is_err_and(|e| e.to_string().contains("I/O timeout"))
        );
        cfg.io_timeout = Duration::from_secs(5);
        cfg.connect_timeout = Duration::ZERO;
        assert!(
            cfg.validate()
                .is_err_and(|e| e.to_string().contains("connect timeout"))
        );
    }

    #[test]
    fn a_failed_connection_to_a_peer_names_both_ranks_and_the_address() {
        // A listener that never accepts: the kernel completes each connection, the handshake
        // gets no answer, and the call gives up at its deadline.
        let mute = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = mute.local_addr().unwrap();
        let cred = Credentials {
            job_id: "job".into(),
            secret: b"s3cret".to_vec(),
        };
        let cfg = TcpConfig::new(2, 3, "127.0.0.1:1", cred);
        let deadline = Instant::now() + Duration::from_millis(300);
        let e = connect_to(addr, 1, &cfg, deadline).unwrap_err();
        let TransportError::Peer { peer, message } = &e else {
            panic!("not a peer's error: {e}");
        };
        assert_eq!(*peer, 1);
        assert!(
            message.contains("rank 2") && message.contains(&addr.to_string()),
            "{e}"
        );
        assert!(message.contains("deadline"), "{e}");
    }
}
