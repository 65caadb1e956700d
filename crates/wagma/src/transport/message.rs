//! What travels between ranks: a tagged envelope with a small header and a payload.

use serde::{Deserialize, Serialize};

use crate::Rank;
use crate::payload::Payload;

/// The namespace of a message; each kind has its own sequence numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Kind {
    /// Activation of a wait-avoiding round (seq = round, step = tree dimension, aux = root).
    Activation = 1,
    /// Data of a wait-avoiding group round (seq = round).
    Round = 2,
    /// Data of a blocking global sync round of the stream (seq = round).
    Sync = 3,
    /// Data of a blocking collective (seq chosen by the caller).
    Collective = 4,
    /// Neighbour exchange or push-sum (seq = iteration).
    Exchange = 5,
    /// AD-PSGD pairwise averaging (step 0 = request, step 1 = reply).
    Pair = 6,
    /// Liveness and control messages.
    Control = 7,
}

impl Kind {
    /// The kind with this wire code.
    pub fn from_code(code: u8) -> Option<Kind> {
        Some(match code {
            1 => Kind::Activation,
            2 => Kind::Round,
            3 => Kind::Sync,
            4 => Kind::Collective,
            5 => Kind::Exchange,
            6 => Kind::Pair,
            7 => Kind::Control,
            _ => return None,
        })
    }

    /// A short name for errors and traces.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Activation => "activation",
            Kind::Round => "group round",
            Kind::Sync => "global sync",
            Kind::Collective => "collective",
            Kind::Exchange => "exchange",
            Kind::Pair => "pairwise averaging",
            Kind::Control => "control",
        }
    }
}

/// Identifies a message: its kind, the operation's sequence number and the step inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    /// Namespace.
    pub kind: Kind,
    /// Operation (round, iteration, collective counter).
    pub seq: u64,
    /// Step inside the operation's schedule.
    pub step: u16,
}

/// The model a rank contributed to a reduction: how many local steps it embodies.
///
/// A rank's model after local step t (0-based) embodies `t + 1` steps; the initial model 0.
/// The contribution to round t is fresh when it embodies `t + 1` steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Contribution {
    /// The contributing rank.
    pub rank: Rank,
    /// Local steps embodied in its contribution.
    pub steps: u64,
}

impl Contribution {
    /// Rounds behind round `round`: `round + 1 - steps` (0 when fresh).
    pub fn staleness(&self, round: u64) -> u64 {
        (round + 1).saturating_sub(self.steps)
    }
}

/// Header of a message.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Meta {
    /// Length (elements) of the sender's whole working buffer, to detect mismatched sizes.
    pub total_len: u64,
    /// Push-sum weight carried with the data.
    pub weight: f64,
    /// A small extra value (the root of an activation).
    pub aux: u64,
    /// The contributions folded into this data so far.
    pub contributions: Vec<Contribution>,
}

/// A message between ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// Sender.
    pub from: Rank,
    /// Tag.
    pub tag: Tag,
    /// Header.
    pub meta: Meta,
    /// Payload.
    pub data: Payload,
}

impl Envelope {
    /// Bytes this message occupies on a wire (payload plus header), for accounting.
    pub fn wire_bytes(&self) -> usize {
        crate::transport::frame::HEADER_BYTES
            + 12 * self.meta.contributions.len()
            + self.data.bytes()
    }
}
