//! Moving tagged messages between ranks.
//!
//! A [`Transport`] sends [`Envelope`]s to peers; what arrives is pushed by the transport (its
//! reader threads, or its `poll` for transports that need the engine thread to make progress)
//! into the rank's inbox as [`Incoming`] items. Implementations: [`mem`] (threads of one
//! process, messages moved without copying) and [`tcp`] (processes on one or many hosts).

pub mod discover;
pub mod faulty;
pub mod frame;
pub mod mem;
mod message;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod tcp;

use std::time::Duration;

use crate::Rank;
use crate::error::TransportError;

pub use message::{
    Contribution, Contributions, Delivery, Envelope, Fold, FoldInto, Kind, Meta, Tag,
};

/// The default largest frame a transport accepts (2 GiB: a 512 Mi-parameter model).
pub const DEFAULT_MAX_FRAME: u64 = 1 << 31;

/// Most messages of one peer that a transport's threads hold in the inbox before the engine
/// takes them. The engine takes messages as fast as they come unless a write blocks it (at
/// most the write timeout), when a correct peer sends little more than heartbeats; a peer
/// beyond this is reported lost.
pub const MAX_QUEUED_PER_PEER: usize = 4096;

/// A broken connection or a peer that went away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// The peer.
    pub peer: Rank,
    /// What the transport observed.
    pub reason: String,
}

/// What a transport delivers to a rank's inbox.
pub type Incoming = Result<Delivery, Lost>;

/// Sends tagged messages to the other ranks of a job. A transport lives on its rank's engine
/// thread (the MPI one cannot leave it).
pub trait Transport {
    /// Sends `env` to rank `to`. An error means the peer is unreachable.
    fn send(&mut self, to: Rank, env: Envelope) -> Result<(), TransportError>;

    /// Makes progress for transports without their own threads (MPI); the default does nothing.
    fn poll(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    /// How often [`Transport::poll`] must be called while idle; `None` when never.
    fn poll_interval(&self) -> Option<Duration> {
        None
    }

    /// The rank is about to send its farewells and stop: a transport whose writes can block
    /// shortens how long, so that a peer that cannot be reached (a partition) does not hold
    /// the rank's exit for a whole write timeout each. The default does nothing.
    fn leaving(&mut self) {}

    /// The engine declared `peer` dead (elastic mode): a transport with connections drops the
    /// one to it, so that a process restarted in its place can take the rank even when the
    /// dead one's connection still stands (a hung process whose kernel answers keepalive).
    /// The default does nothing.
    fn disconnect(&mut self, peer: Rank) {
        let _ = peer;
    }

    /// The engine took a message of `from` out of the inbox. Transports whose threads fill
    /// the inbox count here what each peer has waiting, to bound it; the default does nothing.
    fn taken(&self, from: Rank) {
        let _ = from;
    }

    /// Whether this transport folds received parts as they arrive ([`Transport::fold`]); the
    /// engine asks only one that does.
    fn folds(&self) -> bool {
        false
    }

    /// The engine expects a message from `from` that it will combine with its own part as
    /// `fold` says. A transport that copies payloads out of a byte stream may combine each
    /// piece as it arrives, while it is still in cache, and deliver the result with
    /// [`Delivery::folded`] set; the default does nothing (the engine combines the message when it
    /// has it whole). A transport may also decline (TCP does while anything from `from` is on
    /// its way to the engine); a request whose message comes without it is withdrawn
    /// ([`Transport::unfold`]).
    fn fold(&mut self, from: Rank, fold: Fold) {
        let _ = (from, fold);
    }

    /// The engine will ask to fold (or place) the message from `from` tagged `tag` once the
    /// phase that takes it starts, which may be after the message arrives: its peer may be a
    /// phase ahead. A transport that reads payloads out of a byte stream may then hold the
    /// message briefly after its header, for the request to come, instead of receiving it
    /// whole; the default does nothing.
    fn expect_fold(&mut self, from: Rank, tag: Tag) {
        let _ = (from, tag);
    }

    /// The engine took the message from `from` tagged `tag` without a fold it asked for (the
    /// message came first): drop the request, so that it cannot catch a later message.
    fn unfold(&mut self, from: Rank, tag: Tag) {
        let _ = (from, tag);
    }
}
