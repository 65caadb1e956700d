//! Folds the engine asked for, per peer, until the frame they are for arrives.
//!
//! A fold is held only if nothing from its peer is on the way to the engine when it is asked
//! for: no frame being read, none in the inbox. Then the next frame from that peer with its tag
//! is the one the asking phase waits for, even when a later operation reuses the tag (a frame
//! read before the ask, and one with the same tag behind it, would otherwise take a fold meant
//! for the first).

use std::sync::Mutex;

use crate::Rank;
use crate::transport::{Fold, Tag};

/// Most folds held for one peer; a further one pushes out the oldest. (A fold whose frame came
/// without it is withdrawn by the engine; this only bounds the list.)
const MAX_PER_PEER: usize = 8;

#[derive(Default)]
struct Held {
    /// Asked for and not used yet, oldest first.
    folds: Vec<Fold>,
    /// The reader has read a frame's header and not yet put the frame in the inbox.
    reading: bool,
}

/// Per peer: the folds asked for and not used yet, and whether a frame is being read.
pub(super) struct Expected(Box<[Mutex<Held>]>);

impl Expected {
    pub fn new(ranks: usize) -> Expected {
        Expected((0..ranks).map(|_| Mutex::default()).collect())
    }

    fn held(&self, peer: Rank) -> Option<std::sync::MutexGuard<'_, Held>> {
        self.0
            .get(peer)
            .map(|h| h.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Holds `fold` for the next frame from `peer` with its tag, unless a frame from `peer` is
    /// being read or `in_inbox` of them wait for the engine (then the fold is dropped: the
    /// frame it is for may be among them, and is then summed after it arrives).
    pub fn ask(&self, peer: Rank, fold: Fold, in_inbox: impl FnOnce() -> usize) {
        let Some(mut held) = self.held(peer) else {
            return;
        };
        // Read under the lock: a reader marks a frame delivered only once it counts it.
        if held.reading || in_inbox() > 0 {
            return;
        }
        if held.folds.len() >= MAX_PER_PEER {
            held.folds.remove(0);
        }
        held.folds.push(fold);
    }

    /// A frame from `peer` tagged `tag` is being read: the fold asked for it, taken out.
    pub fn reading(&self, peer: Rank, tag: &Tag) -> Option<Fold> {
        let mut held = self.held(peer)?;
        held.reading = true;
        let i = held.folds.iter().position(|f| f.tag == *tag)?;
        Some(held.folds.remove(i))
    }

    /// The frame being read from `peer` is counted among those waiting in the inbox (before
    /// it is put there, so that the engine, once it took the frame, may ask again).
    pub fn delivered(&self, peer: Rank) {
        if let Some(mut held) = self.held(peer) {
            held.reading = false;
        }
    }

    /// The engine took the frame tagged `tag` without its fold: drops the fold.
    pub fn withdraw(&self, peer: Rank, tag: &Tag) {
        if let Some(mut held) = self.held(peer) {
            held.folds.retain(|f| f.tag != *tag);
        }
    }

    /// Drops everything held for `peer`: its connection ended, or a new one starts.
    pub fn forget(&self, peer: Rank) {
        if let Some(mut held) = self.held(peer) {
            *held = Held::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::{Payload, Reduce};
    use crate::transport::{FoldInto, Kind};

    fn tag(seq: u64) -> Tag {
        Tag {
            kind: Kind::Collective,
            seq,
            step: 0,
        }
    }

    /// A whole frame from `peer` tagged `seq` read, as its reader does: the fold it takes.
    fn read(e: &Expected, peer: Rank, seq: u64) -> Option<Fold> {
        let fold = e.reading(peer, &tag(seq));
        e.delivered(peer);
        fold
    }

    fn fold(seq: u64, held: &mut Vec<Payload>) -> Fold {
        let mut p = Payload::Data(vec![seq as f32]);
        let own = p.view(0..1).downgrade().expect("a view is shared");
        held.push(p);
        Fold {
            tag: tag(seq),
            into: FoldInto::Own {
                own,
                op: Reduce::Sum,
            },
        }
    }

    /// The part a fold combines with, if it is one and the part is still held.
    fn own(f: Fold) -> Option<Payload> {
        match f.into {
            FoldInto::Own { own, .. } => own.upgrade(),
            FoldInto::Place(_) => None,
        }
    }

    #[test]
    fn a_fold_is_taken_once_by_its_tag_and_the_oldest_go_first() {
        let e = Expected::new(2);
        let mut held = Vec::new();
        for seq in 0..MAX_PER_PEER as u64 + 2 {
            e.ask(1, fold(seq, &mut held), || 0);
        }
        // The two oldest were pushed out.
        assert!(read(&e, 1, 0).is_none());
        assert!(read(&e, 1, 1).is_none());
        let got = read(&e, 1, 5).and_then(own);
        assert_eq!(got, Some(Payload::Data(vec![5.0])));
        assert!(read(&e, 1, 5).is_none());
        // Withdrawn, or another peer's, or a peer out of range: none.
        e.withdraw(1, &tag(6));
        assert!(read(&e, 1, 6).is_none());
        assert!(read(&e, 0, 7).is_none());
        assert!(e.reading(7, &tag(7)).is_none());
        e.ask(7, fold(7, &mut held), || 0);
        e.forget(1);
        assert!(read(&e, 1, 7).is_none());
        // A fold keeps no buffer alive: once its holder is gone, it reads nothing.
        e.ask(0, fold(20, &mut held), || 0);
        held.clear();
        assert!(e.reading(0, &tag(20)).is_some_and(|f| own(f).is_none()));
    }

    #[test]
    fn no_fold_is_held_while_a_frame_from_its_peer_is_on_the_way() {
        let e = Expected::new(2);
        let mut held = Vec::new();
        // A frame's header was read (without a fold) and the frame is not delivered yet: a
        // later frame with the same tag must not take a fold asked for now.
        assert!(e.reading(1, &tag(3)).is_none());
        e.ask(1, fold(3, &mut held), || 0);
        e.delivered(1);
        assert!(read(&e, 1, 3).is_none());
        // Delivered but not taken by the engine yet: the same.
        e.ask(1, fold(3, &mut held), || 1);
        assert!(read(&e, 1, 3).is_none());
        // Nothing on the way: held, and taken by the next frame with the tag.
        e.ask(1, fold(3, &mut held), || 0);
        assert!(read(&e, 1, 3).is_some());
        // A connection that ends forgets a frame it was reading.
        assert!(e.reading(1, &tag(4)).is_none());
        e.forget(1);
        e.ask(1, fold(4, &mut held), || 0);
        assert!(e.reading(1, &tag(4)).is_some());
    }
}
