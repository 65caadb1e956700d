//! Typed errors of the library.
//!
//! Two classes, following Gloo's taxonomy: [`ConfigError`] for settings that can never work
//! (caught before anything runs), and [`Error`] for what happens while running: timeouts, lost
//! peers, mismatched buffers and transport faults. Every runtime error names the rank that
//! reports it, the operation (round, sync, collective) and, where one is known, the peer.

use std::fmt;
use std::time::Duration;

use crate::Rank;
pub use crate::exec::launch::ModelLayout;

/// A setting that can never work, reported before anything runs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The job has no ranks.
    #[error("the number of ranks P must be at least 1")]
    ZeroRanks,
    /// A group of size zero was requested.
    #[error("the group size S must be at least 1")]
    ZeroGroupSize,
    /// The group size exceeds the number of ranks.
    #[error("the group size S = {group_size} exceeds the number of ranks P = {ranks}")]
    GroupSizeTooLarge {
        /// Requested group size.
        group_size: usize,
        /// Number of ranks.
        ranks: usize,
    },
    /// The synchronization period is zero.
    #[error("the global synchronization period tau must be at least 1")]
    ZeroTau,
    /// The local-SGD period is zero.
    #[error("the local-SGD period H must be at least 1")]
    ZeroPeriod,
    /// eager-SGD's period of blocking rounds is zero.
    #[error("eager-SGD's sync period must be at least 1 (or never)")]
    ZeroSyncPeriod,
    /// Too many peers for the exponential graph.
    #[error(
        "sgp with {peers} peers is impossible with P = {ranks}: at most {max} distinct \
         exponential-graph peers exist (1 <= n < P and n <= ceil(log2 P))"
    )]
    TooManyPeers {
        /// Requested number of peers.
        peers: usize,
        /// Number of ranks.
        ranks: usize,
        /// Largest valid number of peers.
        max: usize,
    },
    /// A rank id outside `0..P`.
    #[error("rank {rank} is outside 0..{ranks}")]
    RankOutOfRange {
        /// The offending rank id.
        rank: Rank,
        /// Number of ranks.
        ranks: usize,
    },
    /// A value that does not parse or is out of range.
    #[error("invalid value for {what}: {detail}")]
    Invalid {
        /// The setting.
        what: &'static str,
        /// Why it is rejected.
        detail: String,
    },
}

/// Describes the operation an error happened in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A wait-avoiding group round (iteration number).
    Round(u64),
    /// A blocking global synchronization round (iteration number).
    Sync(u64),
    /// A blocking collective of the given kind and sequence number.
    Collective {
        /// What kind of collective.
        kind: &'static str,
        /// Its sequence number (usually the iteration).
        seq: u64,
    },
    /// Connecting to the job (rendezvous, handshakes).
    Connect,
    /// Anything else.
    Other(&'static str),
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Round(t) => write!(f, "group round {t}"),
            Op::Sync(t) => write!(f, "global sync {t}"),
            Op::Collective { kind, seq } => write!(f, "{kind} #{seq}"),
            Op::Connect => write!(f, "connection setup"),
            Op::Other(s) => write!(f, "{s}"),
        }
    }
}

/// A runtime failure, naming the reporting rank, the operation and the peer involved.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A setting that can never work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An operation did not complete within its end-to-end timeout.
    #[error(
        "rank {rank}: {op} timed out after {waited:.1?}; still waiting for {}",
        fmt_peers(missing)
    )]
    Timeout {
        /// Reporting rank.
        rank: Rank,
        /// The operation.
        op: Op,
        /// How long it waited.
        waited: Duration,
        /// Peers whose messages had not arrived.
        missing: Vec<Rank>,
    },
    /// A peer's connection broke or the peer was declared dead.
    #[error("rank {rank}: lost rank {peer} during {op} ({reason})")]
    PeerLost {
        /// Reporting rank.
        rank: Rank,
        /// The lost peer.
        peer: Rank,
        /// The operation that could not complete.
        op: Op,
        /// What the transport reported.
        reason: String,
    },
    /// Elastic mode: the ranks this rank has not lost are no strict majority of the job, or
    /// do not include rank 0, so it stops rather than train on beside another part of the job
    /// (a partition, or rank 0's loss).
    #[error(
        "rank {rank}: lost rank {lost}; the {} ranks it has not lost ({alive:?}) are {}, so \
         it stops (elastic runs continue only on the side with rank 0 and a strict majority of \
         the {ranks} ranks)",
        alive.len(),
        if alive.contains(&0) { "no strict majority" } else { "without rank 0, which writes the outputs" }
    )]
    NoQuorum {
        /// Reporting rank.
        rank: Rank,
        /// The rank whose loss broke the quorum.
        lost: Rank,
        /// The ranks not lost so far, this one included.
        alive: Vec<Rank>,
        /// The job's original size.
        ranks: usize,
    },
    /// Two ranks passed buffers of different lengths to one collective.
    #[error(
        "rank {rank}: {op}: buffer length mismatch: this rank has {local} elements, \
         peer {peer} has {remote}"
    )]
    LengthMismatch {
        /// Reporting rank.
        rank: Rank,
        /// The operation.
        op: Op,
        /// Peer whose buffer differs.
        peer: Rank,
        /// Local length in elements.
        local: usize,
        /// The peer's length in elements.
        remote: usize,
    },
    /// The transport failed.
    #[error("rank {rank}: transport error: {source}")]
    Transport {
        /// Reporting rank.
        rank: Rank,
        /// The underlying failure.
        source: TransportError,
    },
    /// A rule of the protocol was broken (a bug in the caller or a peer).
    #[error("rank {rank}: {op}: {detail}")]
    Protocol {
        /// Reporting rank.
        rank: Rank,
        /// The operation.
        op: Op,
        /// What went wrong.
        detail: String,
    },
    /// The engine of this rank has stopped (after an earlier error or shutdown).
    #[error("rank {rank}: the progress engine has stopped{}", cause.as_ref().map(|c| format!(": {c}")).unwrap_or_default())]
    Stopped {
        /// Reporting rank.
        rank: Rank,
        /// The error that stopped it, if any.
        cause: Option<Box<Error>>,
    },
    /// In deterministic mode: no rank can make progress.
    #[error("deadlock: no event can fire; blocked ranks: {}", blocked.join("; "))]
    Deadlock {
        /// A description per blocked rank.
        blocked: Vec<String>,
    },
    /// Two ranks hold models of different layouts (a different model, or another version).
    #[error(
        "rank {rank}: the model's layout differs from rank {peer}'s: rank {rank} has {layout}, \
         rank {peer} has {peer_layout}"
    )]
    LayoutMismatch {
        /// Reporting rank.
        rank: Rank,
        /// This rank's layout.
        layout: ModelLayout,
        /// The rank it was compared with.
        peer: Rank,
        /// That rank's layout.
        peer_layout: ModelLayout,
    },
    /// A user-supplied task failed.
    #[error("rank {rank}: {message}")]
    Task {
        /// The rank whose task failed.
        rank: Rank,
        /// The task's error.
        message: String,
    },
}

fn fmt_peers(peers: &[Rank]) -> String {
    match peers {
        [] => "no peer (waiting for the local caller)".to_string(),
        [p] => format!("peer {p}"),
        ps => format!(
            "peers {}",
            ps.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

impl Error {
    /// The peer this error blames, if it names one.
    pub fn peer(&self) -> Option<Rank> {
        match self {
            Error::Timeout { missing, .. } => missing.first().copied(),
            Error::PeerLost { peer, .. }
            | Error::LengthMismatch { peer, .. }
            | Error::LayoutMismatch { peer, .. } => Some(*peer),
            Error::NoQuorum { lost, .. } => Some(*lost),
            Error::Stopped { cause: Some(c), .. } => c.peer(),
            Error::Transport {
                source: TransportError::Peer { peer, .. },
                ..
            } => Some(*peer),
            _ => None,
        }
    }
}

/// A failure of a transport (connection, framing, handshake).
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    /// An I/O failure; the context says what was being done (a failure on the connection to a
    /// known peer is [`TransportError::Peer`]).
    #[error("{context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error text.
        message: String,
    },
    /// A failure on the connection to a specific peer.
    #[error("peer {peer}: {message}")]
    Peer {
        /// The peer.
        peer: Rank,
        /// What happened.
        message: String,
    },
    /// A frame larger than the configured maximum.
    #[error("frame of {size} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Announced or attempted size.
        size: u64,
        /// The configured maximum.
        max: u64,
    },
    /// Bytes that are not a valid frame.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// The handshake failed (wrong job, wrong secret, wrong protocol).
    #[error("handshake refused: {0}")]
    Handshake(String),
    /// The rendezvous did not complete.
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
}

impl TransportError {
    /// An I/O error with context.
    pub fn io(context: impl Into<String>, err: &std::io::Error) -> Self {
        TransportError::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }
}

/// Result type of the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;
