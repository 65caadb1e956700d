//! Folds the engine asked for, per peer, until the frame they are for arrives.
//!
//! A fold is held only if nothing from its peer is on the way to the engine when it is asked
//! for: no frame being read, none in the inbox. Then the next frame from that peer with its tag
//! is the one the asking phase waits for, even when a later operation reuses the tag (a frame
//! read before the ask, and one with the same tag behind it, would otherwise take a fold meant
//! for the first).
//!
//! A peer a phase ahead sends the next phase's part before the engine asks for its fold. A
//! frame whose fold the engine said it would ask for ([`Expected::expect`]) therefore waits
//! after its header, for a while ([`WAIT_FOR_FOLD`]), for the fold: the one exception to "no
//! frame being read", and a sound one, since the frame being read is then the next from that
//! peer with its tag.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::Rank;
use crate::transport::{Fold, Tag};

/// Most folds held for one peer; a further one pushes out the oldest. (A fold whose frame came
/// without it is withdrawn by the engine; this only bounds the list.) The same for the tags
/// of folds to come.
const MAX_PER_PEER: usize = 8;

/// Longest a frame whose fold is to come waits for it before it is read whole. A phase of a
/// large buffer on loopback takes some tens of milliseconds; the connection, and anything
/// behind the frame on it, waits as long.
const WAIT_FOR_FOLD: Duration = Duration::from_millis(50);

#[derive(Default)]
struct Held {
    /// Asked for and not used yet, oldest first.
    folds: Vec<Fold>,
    /// Tags whose fold the engine will ask for, oldest first.
    to_come: Vec<Tag>,
    /// The reader has read a frame's header and not yet put the frame in the inbox.
    reading: bool,
    /// The frame being read waits for the fold of this tag.
    waiting: Option<Tag>,
}

/// Bounded push: the oldest goes first.
fn push_bounded<T>(list: &mut Vec<T>, item: T) {
    if list.len() >= MAX_PER_PEER {
        list.remove(0);
    }
    list.push(item);
}

/// Per peer: the folds asked for and not used yet, and whether a frame is being read (and
/// waits for its fold: then the condition variable wakes it).
pub(super) struct Expected {
    peers: Box<[(Mutex<Held>, Condvar)]>,
    /// Longest a frame waits for a fold to come ([`WAIT_FOR_FOLD`]).
    wait: Duration,
}

impl Expected {
    pub fn new(ranks: usize) -> Expected {
        Expected::waiting(ranks, WAIT_FOR_FOLD)
    }

    fn waiting(ranks: usize, wait: Duration) -> Expected {
        Expected {
            peers: (0..ranks).map(|_| Default::default()).collect(),
            wait,
        }
    }

    fn held(&self, peer: Rank) -> Option<(MutexGuard<'_, Held>, &Condvar)> {
        self.peers
            .get(peer)
            .map(|(h, c)| (h.lock().unwrap_or_else(|e| e.into_inner()), c))
    }

    /// Holds `fold` for the next frame from `peer` with its tag, unless a frame from `peer` is
    /// being read (other than one waiting for this fold) or `in_inbox` of them wait for the
    /// engine (then the fold is dropped: the frame it is for may be among them, and is then
    /// summed after it arrives).
    pub fn ask(&self, peer: Rank, fold: Fold, in_inbox: impl FnOnce() -> usize) {
        let Some((mut held, wake)) = self.held(peer) else {
            return;
        };
        let waited_for = held.waiting == Some(fold.tag);
        // Read under the lock: a reader marks a frame delivered only once it counts it.
        if (held.reading && !waited_for) || in_inbox() > 0 {
            if waited_for {
                // Declined: the waiting frame is read whole at once.
                held.waiting = None;
                wake.notify_all();
            }
            return;
        }
        // Asked for: it need not be said to come any more.
        held.to_come.retain(|t| *t != fold.tag);
        push_bounded(&mut held.folds, fold);
        if waited_for {
            wake.notify_all();
        }
    }

    /// The engine will ask for a fold of the frame from `peer` tagged `tag`.
    pub fn expect(&self, peer: Rank, tag: Tag) {
        if let Some((mut held, _)) = self.held(peer) {
            push_bounded(&mut held.to_come, tag);
        }
    }

    /// A frame from `peer` tagged `tag` is being read: the fold asked for it, taken out. One
    /// whose fold is to come waits for it, up to [`WAIT_FOR_FOLD`] (unless the fold is
    /// declined or the connection forgotten first).
    pub fn reading(&self, peer: Rank, tag: &Tag) -> Option<Fold> {
        let (mut held, wake) = self.held(peer)?;
        held.reading = true;
        let asked = |held: &Held| held.folds.iter().position(|f| f.tag == *tag);
        // Said to come, this frame is the one: the word is used up either way.
        let to_come = held.to_come.iter().position(|t| t == tag);
        if let Some(i) = to_come {
            held.to_come.remove(i);
        }
        if asked(&held).is_none() && to_come.is_some() {
            held.waiting = Some(*tag);
            let waits = |h: &mut Held| h.waiting == Some(*tag) && asked(h).is_none();
            held = match wake.wait_timeout_while(held, self.wait, waits) {
                Ok((held, _)) => held,
                Err(e) => e.into_inner().0,
            };
            held.waiting = None;
        }
        let i = asked(&held)?;
        Some(held.folds.remove(i))
    }

    /// The frame being read from `peer` is counted among those waiting in the inbox (before
    /// it is put there, so that the engine, once it took the frame, may ask again).
    pub fn delivered(&self, peer: Rank) {
        if let Some((mut held, _)) = self.held(peer) {
            held.reading = false;
        }
    }

    /// The engine took the frame tagged `tag` without its fold: drops the fold.
    pub fn withdraw(&self, peer: Rank, tag: &Tag) {
        if let Some((mut held, _)) = self.held(peer) {
            held.folds.retain(|f| f.tag != *tag);
            held.to_come.retain(|t| t != tag);
        }
    }

    /// Drops everything held for `peer`: its connection ended, or a new one starts.
    pub fn forget(&self, peer: Rank) {
        if let Some((mut held, wake)) = self.held(peer) {
            *held = Held::default();
            wake.notify_all();
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
                layout: None,
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

    /// `e.reading(1, tag(seq))` on a thread of its own, once it waits for its fold.
    fn waiting_reader(
        e: &std::sync::Arc<Expected>,
        seq: u64,
    ) -> std::thread::JoinHandle<Option<Fold>> {
        e.expect(1, tag(seq));
        let reader = {
            let e = std::sync::Arc::clone(e);
            std::thread::spawn(move || read(&e, 1, seq))
        };
        while e.held(1).is_some_and(|(h, _)| h.waiting != Some(tag(seq))) {
            std::thread::yield_now();
        }
        reader
    }

    #[test]
    fn a_frame_whose_fold_is_to_come_waits_for_it() {
        // Long enough for any loaded machine: nothing here waits it out.
        let e = std::sync::Arc::new(Expected::waiting(2, Duration::from_secs(600)));
        let mut held = Vec::new();
        // Asked for while the frame waits: the frame takes it.
        let reader = waiting_reader(&e, 5);
        e.ask(1, fold(5, &mut held), || 0);
        let got = reader.join().expect("the reader");
        assert_eq!(got.and_then(own), Some(Payload::Data(vec![5.0])));
        // Declined (a frame from the peer waits in the inbox): read whole at once.
        let reader = waiting_reader(&e, 6);
        e.ask(1, fold(6, &mut held), || 1);
        assert!(reader.join().expect("the reader").is_none());
        // The connection is forgotten: the same.
        let reader = waiting_reader(&e, 7);
        e.forget(1);
        assert!(reader.join().expect("the reader").is_none());
        // A frame with another tag does not wait.
        e.expect(1, tag(8));
        assert!(read(&e, 1, 9).is_none());
        // Withdrawn before its frame: the frame does not wait.
        e.expect(1, tag(10));
        e.withdraw(1, &tag(10));
        assert!(read(&e, 1, 10).is_none());
        // Asked for before its frame came: nothing is left said to come, which a later frame
        // with the tag would wait for in vain.
        e.expect(1, tag(12));
        e.ask(1, fold(12, &mut held), || 0);
        assert!(
            e.held(1)
                .is_some_and(|(h, _)| !h.to_come.contains(&tag(12)))
        );
        assert!(read(&e, 1, 12).is_some());
        // No fold comes: the frame is read whole once the wait is over.
        let e = Expected::waiting(2, Duration::from_millis(1));
        e.expect(1, tag(11));
        assert!(read(&e, 1, 11).is_none());
    }
}
