//! What travels between ranks: a tagged envelope with a small header and a payload.

use std::cell::RefCell;
use std::sync::Arc;

use rustc_hash::FxHashSet;
use serde::{Deserialize, Serialize};

use crate::Rank;
use crate::payload::{Payload, Place, Reduce, WeakView};

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

/// A contribution list as messages carry it: immutable and shared.
///
/// After a group's reduce-scatter every member holds the same list, and each message of the
/// allgather that follows carries it. Lists interned by [`Contributions::interned`] on one
/// thread share one copy, so those messages hold a reference instead of a copy each, and a
/// receiver that holds the same copy knows the lists are equal without reading them (at
/// thousands of simulated ranks, reading them was a cache miss per message). Equality is
/// always by content; sharing only makes it cheaper.
#[derive(Clone, Default)]
pub struct Contributions(Option<Arc<[Contribution]>>);

/// How many lists an interning table holds before it first drops those no one else holds.
const INTERN_PURGE_MIN: usize = 1024;

/// The lists interned on this thread, and the size at which the next purge happens.
#[derive(Default)]
struct Interned {
    lists: FxHashSet<Arc<[Contribution]>>,
    purge_at: usize,
}

thread_local! {
    static INTERNED: RefCell<Interned> = RefCell::new(Interned::default());
}

impl Contributions {
    /// The contributions, in the order sent.
    pub fn as_slice(&self) -> &[Contribution] {
        self.0.as_deref().unwrap_or_default()
    }

    /// True when both are the very same copy: then their lists are equal (the converse does
    /// not hold).
    pub fn same_copy(&self, other: &Contributions) -> bool {
        match (&self.0, &other.0) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }

    /// A list equal to `list` that shares its copy with every list equal to it interned on
    /// this thread while one of them is still held.
    pub fn interned(list: &[Contribution]) -> Contributions {
        if list.is_empty() {
            return Contributions(None);
        }
        let shared = INTERNED.with_borrow_mut(|t| {
            if let Some(found) = t.lists.get(list) {
                return Arc::clone(found);
            }
            // Lists only the table holds are dropped once it has doubled since the last purge,
            // so that it stays proportional to the lists in use.
            if t.lists.len() >= t.purge_at {
                t.lists.retain(|l| Arc::strong_count(l) > 1);
                t.purge_at = (2 * t.lists.len()).max(INTERN_PURGE_MIN);
            }
            let new: Arc<[Contribution]> = Arc::from(list);
            t.lists.insert(Arc::clone(&new));
            new
        });
        Contributions(Some(shared))
    }
}

impl std::ops::Deref for Contributions {
    type Target = [Contribution];
    fn deref(&self) -> &[Contribution] {
        self.as_slice()
    }
}

impl From<Vec<Contribution>> for Contributions {
    fn from(list: Vec<Contribution>) -> Self {
        if list.is_empty() {
            Contributions(None)
        } else {
            Contributions(Some(list.into()))
        }
    }
}

impl FromIterator<Contribution> for Contributions {
    fn from_iter<I: IntoIterator<Item = Contribution>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<_>>().into()
    }
}

impl PartialEq for Contributions {
    fn eq(&self, other: &Self) -> bool {
        self.same_copy(other) || self.as_slice() == other.as_slice()
    }
}

impl Eq for Contributions {}

impl std::fmt::Debug for Contributions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
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
    pub contributions: Contributions,
}

/// A receiver's request about the payload of one expected message, made before it arrives
/// (see [`super::Transport::fold`]): combine it with the receiver's own part piece by piece
/// as it arrives, instead of receiving it whole and combining after, or read it into place
/// in a buffer laid out for the whole it is a part of.
#[derive(Debug, Clone)]
pub struct Fold {
    /// The expected message's tag.
    pub tag: Tag,
    /// What becomes of the payload.
    pub into: FoldInto,
}

/// What a [`Fold`] makes of the payload it is for.
#[derive(Debug, Clone)]
pub enum FoldInto {
    /// Combined with the receiver's own part as it arrives. A transport that does so
    /// delivers the message with [`Delivery::folded`] set and the combined values as its
    /// payload.
    Own {
        /// The receiver's own part, as long as the expected payload. Held weakly: a request
        /// whose message came before it (or never comes) keeps no buffer alive once the
        /// engine is done with the part.
        own: WeakView,
        /// How the two combine: a sum or a maximum, the same bits in either order (NaN
        /// payloads aside, which IEEE 754 leaves to the hardware).
        op: Reduce,
        /// Where the combined values are laid out, when they are a large part of a larger
        /// buffer: a buffer for the whole, in which a later part may be read beside them (a
        /// [`FoldInto::Place`] given that room) so that joining the two copies nothing.
        layout: Option<Place>,
    },
    /// The payload takes the place of the receiver's part of a larger buffer: read into a
    /// buffer laid out as [`Place`] says (beside another part when the place gives the room
    /// of one), so that joining the parts copies only the others, or none.
    /// Delivered with [`Delivery::folded`] unset (the values are the payload's), and harmless
    /// if it catches another message: only where the values lie differs.
    Place(Place),
}

/// A message as a transport delivers it to the rank's inbox.
#[derive(Debug)]
pub struct Delivery {
    /// The message.
    pub env: Envelope,
    /// The transport already combined the payload with this rank's own part, as a [`Fold`]
    /// asked: the payload is the result of the phase that receives it.
    pub folded: bool,
}

impl From<Envelope> for Delivery {
    fn from(env: Envelope) -> Delivery {
        Delivery { env, folded: false }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn list(rank: Rank, steps: u64) -> Vec<Contribution> {
        vec![Contribution { rank, steps }]
    }

    #[test]
    fn interning_shares_equal_lists_and_forgets_those_no_one_holds() {
        let held = Contributions::interned(&list(0, 7));
        assert!(Contributions::interned(&list(0, 7)).same_copy(&held));
        assert!(Contributions::interned(&[]).same_copy(&Contributions::default()));
        // Far more lists than a table keeps before purging, each dropped at once: the table
        // stays bounded, and the list still held keeps its copy.
        for steps in 0..10_000 {
            drop(Contributions::interned(&list(1, steps)));
        }
        let kept = INTERNED.with_borrow(|t| t.lists.len());
        assert!(kept <= 2 * INTERN_PURGE_MIN, "{kept} lists interned");
        assert!(Contributions::interned(&list(0, 7)).same_copy(&held));
    }
}
