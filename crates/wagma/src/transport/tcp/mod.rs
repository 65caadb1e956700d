//! The TCP transport: processes on one or many hosts.
//!
//! Start-up: rank 0 listens on the rendezvous address; every rank opens a listener for its
//! peers, registers its address with rank 0 and receives the table of all addresses. Each pair
//! of ranks then shares exactly one connection (the higher rank connects to the lower), reused
//! by every group, round and collective. Every connection, the rendezvous included, starts with
//! a mutual handshake on the job id and shared secret; a peer that fails it is refused and
//! logged. Messages are length-prefixed frames with a checked maximum size ([`super::frame`]);
//! a reader thread per connection feeds the rank's inbox, the engine thread writes.

mod handshake;
mod rejoin;

use std::io::{BufReader, BufWriter, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

pub use handshake::Credentials;

use super::frame::{read_frame, write_frame};
use super::{Envelope, Incoming, Lost, Transport};
use crate::Rank;
use crate::error::{ConfigError, TransportError};

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
    /// Limit for one blocking write to a peer.
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
    /// Shared secret (default empty).
    pub const SECRET: &str = "WAGMA_SECRET";
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
        }
    }

    /// Reads the rank, world size and rendezvous from the launcher's environment (see
    /// [`super::discover`]: wagma, Open MPI, PMI, SLURM or torchrun variables), and
    /// `WAGMA_JOB_ID`, `WAGMA_SECRET` and `WAGMA_BIND`.
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
            secret: get(env::SECRET).unwrap_or_default().into_bytes(),
        };
        let mut cfg = TcpConfig::new(d.rank, d.world, rendezvous, credentials);
        if let Some(b) = get(env::BIND) {
            cfg.bind = Some(b.parse().map_err(|_| ConfigError::Invalid {
                what: env::BIND,
                detail: format!("{b:?} is not an IP address"),
            })?);
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

    /// Checks rank and world size.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.world == 0 {
            return Err(ConfigError::ZeroRanks);
        }
        if self.rank >= self.world {
            return Err(ConfigError::RankOutOfRange {
                rank: self.rank,
                ranks: self.world,
            });
        }
        Ok(())
    }
}

/// One rank's connections to every peer.
pub struct TcpTransport {
    rank: Rank,
    writers: Vec<Option<BufWriter<TcpStream>>>,
    /// Connections of rejoined peers accepted since the last send, waiting to be used.
    adopted: Arc<rejoin::Adopted>,
    max_frame: u64,
}

impl Transport for TcpTransport {
    fn send(&mut self, to: Rank, env: Envelope) -> Result<(), TransportError> {
        self.adopted.take_into(&mut self.writers);
        let w = self
            .writers
            .get_mut(to)
            .and_then(Option::as_mut)
            .ok_or_else(|| TransportError::Peer {
                peer: to,
                message: format!("rank {} has no connection to it", self.rank),
            })?;
        write_frame(w, &env, self.max_frame).map_err(|e| match e {
            TransportError::FrameTooLarge { .. } => e,
            other => TransportError::Peer {
                peer: to,
                message: other.to_string(),
            },
        })
    }
}

impl TcpTransport {
    /// Writes raw bytes on the connection to `peer`, bypassing the framing: fault injection
    /// (a corrupted stream must end in a named error at the peer, never in a hang or a panic).
    pub fn inject_raw(&mut self, peer: Rank, bytes: &[u8]) -> Result<(), TransportError> {
        let w = self
            .writers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| TransportError::Peer {
                peer,
                message: "no connection".into(),
            })?;
        w.write_all(bytes)
            .and_then(|()| w.flush())
            .map_err(|e| TransportError::io("injecting bytes", &e))
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for w in self.writers.iter_mut().flatten() {
            let _ = w.flush();
            let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
        }
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

/// Connects to `addr`, retrying until `deadline` (the listener may not be up yet).
fn connect_retry(addr: SocketAddr, deadline: Instant) -> Result<TcpStream, TransportError> {
    loop {
        match TcpStream::connect_timeout(&addr, left(deadline).min(Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(TransportError::Rendezvous(format!(
                    "cannot connect to {addr}: {e}"
                )));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn prepare(s: &TcpStream, deadline: Instant) -> Result<(), TransportError> {
    let io = |e: std::io::Error| TransportError::io("configuring a socket", &e);
    s.set_nodelay(true).map_err(io)?;
    s.set_read_timeout(Some(left(deadline))).map_err(io)?;
    s.set_write_timeout(Some(left(deadline))).map_err(io)
}

/// Accepts one waiting connection (the listener is non-blocking) and runs the handshake;
/// `None` when nobody waits or the connection failed the handshake (refused and logged).
fn accept_one(
    listener: &TcpListener,
    me: Rank,
    cred: &Credentials,
    deadline: Instant,
) -> Result<Option<(Rank, TcpStream)>, TransportError> {
    match listener.accept() {
        Ok((mut s, addr)) => {
            let _ = s.set_nonblocking(false);
            prepare(&s, deadline.min(Instant::now() + Duration::from_secs(10)))?;
            match handshake::accept(&mut s, me, cred) {
                Ok(peer) => Ok(Some((peer, s))),
                Err(e) => {
                    tracing::warn!(rank = me, %addr, error = %e, "refused a connection");
                    Ok(None)
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(TransportError::io("accepting", &e)),
    }
}

/// Accepts connections until `want` peers passed the handshake or `deadline`. Connections that
/// fail the handshake are refused, logged and do not count.
fn accept_peers(
    listener: &TcpListener,
    me: Rank,
    cred: &Credentials,
    deadline: Instant,
    mut want: impl FnMut(Rank) -> bool,
    count: usize,
) -> Result<Vec<(Rank, TcpStream)>, TransportError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| TransportError::io("listener", &e))?;
    let mut got = Vec::with_capacity(count);
    while got.len() < count {
        if Instant::now() >= deadline {
            return Err(TransportError::Rendezvous(format!(
                "rank {me}: only {} of {count} peers connected in time",
                got.len()
            )));
        }
        match accept_one(listener, me, cred, deadline)? {
            Some((peer, s)) if want(peer) => got.push((peer, s)),
            Some((peer, _)) => {
                tracing::warn!(
                    rank = me,
                    peer,
                    "refused a connection claiming an unexpected rank"
                );
            }
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    Ok(got)
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
        (Some(l), false) => serve_rendezvous(l, cfg, my_addr, deadline)?,
        (None, rejoin) => register(rdv, cfg, my_addr, deadline, rejoin)?,
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
    };
    let mut writers = Vec::with_capacity(p);
    for (peer, st) in streams.into_iter().enumerate() {
        writers.push(match st {
            Some(st) => {
                let (w, r) = link.split(st)?;
                link.read(peer, r)?;
                Some(w)
            }
            None => None,
        });
    }
    if cfg.accept_rejoins {
        rejoin::serve_peers(listener, cfg.credentials.clone(), p, link, &adopted)?;
        if let Some(l) = rdv_listener {
            rejoin::serve_table(l, cfg.credentials.clone(), table, &adopted)?;
        }
    }
    Ok(TcpTransport {
        rank: me,
        writers,
        adopted,
        max_frame: cfg.max_frame_bytes,
    })
}

/// Start-up: one connection per pair of ranks (the higher connects to the lower), each
/// authenticated.
fn connect_pairs(
    listener: &TcpListener,
    cfg: &TcpConfig,
    table: &[SocketAddr],
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>, TransportError> {
    let (me, p) = (cfg.rank, cfg.world);
    // Accept from higher ranks on a helper thread while connecting to lower ones.
    let (tx, rx) = mpsc::channel();
    let cred = cfg.credentials.clone();
    std::thread::scope(|s| {
        s.spawn(move || {
            let r = accept_peers(
                listener,
                me,
                &cred,
                deadline,
                |peer| peer > me && peer < p,
                p - 1 - me,
            );
            let _ = tx.send(r);
        });
        let mut streams: Vec<Option<TcpStream>> = (0..p).map(|_| None).collect();
        for (peer, addr) in table.iter().enumerate().take(me) {
            streams[peer] = Some(connect_to(*addr, peer, cfg, deadline)?);
        }
        let accepted = rx
            .recv()
            .map_err(|_| TransportError::Rendezvous("the accepting thread died".into()))??;
        for (peer, st) in accepted {
            if streams[peer].is_some() {
                return Err(TransportError::Handshake(format!(
                    "rank {peer} connected twice"
                )));
            }
            streams[peer] = Some(st);
        }
        Ok(streams)
    })
}

/// Connects to rank `peer` at `addr` and authenticates both ends.
fn connect_to(
    addr: SocketAddr,
    peer: Rank,
    cfg: &TcpConfig,
    deadline: Instant,
) -> Result<TcpStream, TransportError> {
    let mut st = connect_retry(addr, deadline)?;
    prepare(&st, deadline)?;
    let got = handshake::connect(&mut st, cfg.rank, &cfg.credentials)?;
    if got != peer {
        return Err(TransportError::Handshake(format!(
            "expected rank {peer} at {addr}, found rank {got}"
        )));
    }
    Ok(st)
}

/// What every connection of a rank shares: where its reader delivers, its limits.
#[derive(Clone)]
struct Link {
    me: Rank,
    inbox: Sender<Incoming>,
    io_timeout: Duration,
    max_frame: u64,
}

impl Link {
    /// Splits an authenticated connection into its write half and its read half.
    fn split(&self, st: TcpStream) -> Result<(BufWriter<TcpStream>, TcpStream), TransportError> {
        let io = |e: std::io::Error| TransportError::io("configuring a connection", &e);
        st.set_read_timeout(None).map_err(io)?;
        st.set_write_timeout(Some(self.io_timeout)).map_err(io)?;
        let reader = st.try_clone().map_err(io)?;
        Ok((BufWriter::with_capacity(64 * 1024, st), reader))
    }

    /// Starts the thread that delivers what `peer` sends on `reader` into the inbox.
    fn read(&self, peer: Rank, reader: TcpStream) -> Result<(), TransportError> {
        spawn_reader(self.me, peer, reader, self.inbox.clone(), self.max_frame)
    }
}

fn spawn_reader(
    me: Rank,
    peer: Rank,
    stream: TcpStream,
    inbox: Sender<Incoming>,
    max: u64,
) -> Result<(), TransportError> {
    std::thread::Builder::new()
        .name(format!("wagma-tcp-{me}<-{peer}"))
        .spawn(move || {
            let mut r = BufReader::with_capacity(256 * 1024, stream);
            loop {
                let reason = match read_frame(&mut r, max) {
                    Ok(Some(env)) if env.from == peer => {
                        if inbox.send(Ok(env)).is_err() {
                            return;
                        }
                        continue;
                    }
                    Ok(Some(env)) => format!("frame claims to come from rank {}", env.from),
                    Ok(None) => "connection closed".to_string(),
                    Err(e) => e.to_string(),
                };
                let _ = inbox.send(Err(Lost { peer, reason }));
                return;
            }
        })
        .map(|_| ())
        .map_err(|e| TransportError::io("starting a reader thread", &e))
}

fn encode_addr(a: &SocketAddr) -> Vec<u8> {
    a.to_string().into_bytes()
}

fn decode_addr(b: &[u8]) -> Result<SocketAddr, TransportError> {
    std::str::from_utf8(b)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| TransportError::Rendezvous("malformed address in the rendezvous".into()))
}

/// Set in a registration's world size by a process that rejoins a running job.
const REJOIN_FLAG: u32 = 1 << 31;

/// A registration with rank 0: the world size the registering rank believes in, whether it
/// rejoins a running job, and the address it listens on.
struct Registration {
    world: usize,
    rejoin: bool,
    addr: SocketAddr,
}

fn registration(world: usize, rejoin: bool, addr: &SocketAddr) -> Vec<u8> {
    let flag = if rejoin { REJOIN_FLAG } else { 0 };
    let mut msg = (world as u32 | flag).to_le_bytes().to_vec();
    msg.extend_from_slice(&encode_addr(addr));
    msg
}

fn read_registration(s: &mut TcpStream, peer: Rank) -> Result<Registration, TransportError> {
    let msg = handshake::read_msg(s, 1024)?;
    let (Some(word), Some(addr)) = (msg.get(..4), msg.get(4..)) else {
        return Err(TransportError::Rendezvous(format!(
            "rank {peer} sent a malformed registration"
        )));
    };
    let word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
    Ok(Registration {
        world: (word & !REJOIN_FLAG) as usize,
        rejoin: word & REJOIN_FLAG != 0,
        addr: decode_addr(addr)?,
    })
}

fn encode_table(table: &[SocketAddr]) -> Vec<u8> {
    let mut body = Vec::new();
    for a in table {
        let e = encode_addr(a);
        body.push(e.len() as u8);
        body.extend_from_slice(&e);
    }
    body
}

/// Rank 0: collects every rank's address and sends the table back.
fn serve_rendezvous(
    l: &TcpListener,
    cfg: &TcpConfig,
    mine: SocketAddr,
    deadline: Instant,
) -> Result<Vec<SocketAddr>, TransportError> {
    let p = cfg.world;
    let mut table: Vec<Option<SocketAddr>> = vec![None; p];
    table[0] = Some(mine);
    let mut conns = Vec::new();
    while conns.len() < p - 1 {
        let mut batch = accept_peers(l, 0, &cfg.credentials, deadline, |r| r > 0 && r < p, 1)?;
        let Some((peer, mut s)) = batch.pop() else {
            continue;
        };
        let reg = read_registration(&mut s, peer)?;
        if reg.rejoin {
            tracing::warn!(peer, "refused a rejoin while the job is still starting");
            let _ = handshake::write_msg(&mut s, b"!the job is still starting");
            continue;
        }
        if reg.world != p {
            let err = format!(
                "rank {peer} believes the job has {} ranks, rank 0 believes {p}",
                reg.world
            );
            let _ = handshake::write_msg(&mut s, format!("!{err}").as_bytes());
            return Err(TransportError::Rendezvous(err));
        }
        if table[peer].is_some() {
            let _ = handshake::write_msg(&mut s, b"!duplicate rank");
            return Err(TransportError::Rendezvous(format!(
                "two processes claim rank {peer}"
            )));
        }
        table[peer] = Some(reg.addr);
        conns.push(s);
    }
    let table: Vec<SocketAddr> = table.into_iter().flatten().collect();
    let body = encode_table(&table);
    for mut s in conns {
        handshake::write_msg(&mut s, &body)?;
    }
    Ok(table)
}

/// Ranks above 0: register with rank 0 and receive the table.
fn register(
    rdv: SocketAddr,
    cfg: &TcpConfig,
    mine: SocketAddr,
    deadline: Instant,
    rejoin: bool,
) -> Result<Vec<SocketAddr>, TransportError> {
    let mut s = connect_retry(rdv, deadline)?;
    prepare(&s, deadline)?;
    let peer = handshake::connect(&mut s, cfg.rank, &cfg.credentials)?;
    if peer != 0 {
        return Err(TransportError::Rendezvous(format!(
            "the rendezvous answered as rank {peer}"
        )));
    }
    handshake::write_msg(&mut s, &registration(cfg.world, rejoin, &mine))?;
    let body = handshake::read_msg(&mut s, 64 * cfg.world + 64)?;
    if body.first() == Some(&b'!') {
        return Err(TransportError::Rendezvous(
            String::from_utf8_lossy(&body[1..]).into_owned(),
        ));
    }
    let mut table = Vec::with_capacity(cfg.world);
    let mut at = 0;
    while at < body.len() {
        let n = body[at] as usize;
        let a = body
            .get(at + 1..at + 1 + n)
            .ok_or_else(|| TransportError::Rendezvous("truncated address table".into()))?;
        table.push(decode_addr(a)?);
        at += 1 + n;
    }
    if table.len() != cfg.world {
        return Err(TransportError::Rendezvous(format!(
            "table has {} addresses for {} ranks",
            table.len(),
            cfg.world
        )));
    }
    Ok(table)
}
