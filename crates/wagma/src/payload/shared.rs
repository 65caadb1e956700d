//! Memory read through shared views ([`Payload::Shared`]), and the parts of a whole that are
//! laid out in one buffer as they arrive ([`Place`]), so that joining them copies nothing.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use smallvec::SmallVec;

use super::{Payload, pool};

/// The memory behind shared views. Its last holder hands it back to the pool when it drops
/// it, wherever that is (a connection's writer thread once the frame is written, a receiver
/// once it has summed it), so that a later round reuses it instead of mapping and faulting in
/// a fresh buffer.
///
/// Views only read it. A buffer laid out for a whole ([`Place`]) also has ranges that no view
/// covers yet, the rest of the whole: a writer may claim such a range (one writer per range),
/// fill it and make it a view in turn ([`Target::Claimed`]), while others read the ranges
/// already viewed.
pub struct SharedBuffer {
    /// A `Vec<f32>`'s parts: `len` initialized values at `ptr`, room for `cap`. Held as a
    /// pointer, not a vector: a view's `&[f32]` covers its range alone, never the whole, so a
    /// claim may write elsewhere in the buffer meanwhile.
    ptr: NonNull<f32>,
    len: usize,
    cap: usize,
    /// Ranges that no view covers and no claim holds.
    free: Mutex<SmallVec<[Range<usize>; 2]>>,
}

// SAFETY: the buffer owns its values as a `Vec<f32>` does. Shared between threads, they are
// read only through `SharedBuffer::slice` over the ranges of views and written only through a
// `Target::Claimed`, over a range taken out of `free` under its lock: no view covers such a
// range, and none is made over it before the claim is over (see `SharedView`).
unsafe impl Send for SharedBuffer {}
// SAFETY: as for `Send`.
unsafe impl Sync for SharedBuffer {}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

impl SharedBuffer {
    /// `v`, with `free` the ranges of it that no view covers (disjoint, within `v`).
    fn new(v: Vec<f32>, free: SmallVec<[Range<usize>; 2]>) -> SharedBuffer {
        assert!(free.iter().all(|f| f.start < f.end && f.end <= v.len()));
        assert!((free.iter().enumerate()).all(|(i, f)| {
            free[..i]
                .iter()
                .all(|g| f.end <= g.start || g.end <= f.start)
        }));
        let mut v = std::mem::ManuallyDrop::new(v);
        SharedBuffer {
            // A vector's pointer is never null (dangling when it has no room).
            ptr: NonNull::new(v.as_mut_ptr()).unwrap_or(NonNull::dangling()),
            len: v.len(),
            cap: v.capacity(),
            free: Mutex::new(free),
        }
    }

    /// Number of values.
    fn len(&self) -> usize {
        self.len
    }

    /// Room for this many values.
    pub(super) fn capacity(&self) -> usize {
        self.cap
    }

    /// The values of `range`, which a view covers.
    fn slice(&self, range: Range<usize>) -> &[f32] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: `range` is within the initialized values; a view covers it, so no claim
        // writes it while the slice lives (see `Send`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(range.start), range.len()) }
    }

    /// The values taken out (what is left for `drop` to hand back is empty).
    fn take_vec(&mut self) -> Vec<f32> {
        let (len, cap) = (std::mem::take(&mut self.len), std::mem::take(&mut self.cap));
        if cap == 0 {
            return Vec::new();
        }
        // SAFETY: the parts of the vector `new` took apart, taken once (the capacity is now 0).
        unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), len, cap) }
    }

    /// The values, taken out.
    pub(super) fn into_vec(mut self) -> Vec<f32> {
        self.take_vec()
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        pool::give(self.take_vec());
    }
}

/// A range of a shared buffer that a view covers: its values stay as they are while any view
/// of them lives. Made only over a whole new buffer, a part of another view, the range of a
/// view that a [`WeakView`] still finds held, a part laid out by a [`Place`] (once written), or
/// views that tile a range: never over a range a writer may claim, since a range once viewed
/// never becomes free again.
#[derive(Debug, Clone)]
pub struct SharedView {
    buf: Arc<SharedBuffer>,
    range: Range<usize>,
}

impl SharedView {
    /// A view of all of `v`.
    pub(super) fn whole(v: Vec<f32>) -> SharedView {
        let range = 0..v.len();
        SharedView {
            buf: Arc::new(SharedBuffer::new(v, SmallVec::new())),
            range,
        }
    }

    /// Number of values.
    pub(super) fn len(&self) -> usize {
        self.range.len()
    }

    /// The values.
    pub(super) fn as_slice(&self) -> &[f32] {
        self.buf.slice(self.range.clone())
    }

    /// Values of the buffer behind the view.
    pub(super) fn buffer_len(&self) -> usize {
        self.buf.len()
    }

    /// Where the values start in the buffer behind them.
    pub(super) fn start(&self) -> usize {
        self.range.start
    }

    /// Whether nothing else holds the buffer behind the view (weak handles aside).
    pub(super) fn is_sole_holder(&self) -> bool {
        Arc::strong_count(&self.buf) == 1
    }

    /// Room of the buffer behind the view.
    pub(super) fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// A view of `range` of this one.
    pub(super) fn part(&self, range: Range<usize>) -> SharedView {
        assert!(range.start <= range.end && range.end <= self.range.len());
        SharedView {
            buf: Arc::clone(&self.buf),
            range: self.range.start + range.start..self.range.start + range.end,
        }
    }

    /// The buffer's values up to the view's end (what lies before the view too) and where
    /// the view starts in them, when this was its last holder; else the view back.
    pub(super) fn try_unwrap(self) -> Result<(Vec<f32>, usize), SharedView> {
        let SharedView { buf, range } = self;
        match Arc::try_unwrap(buf) {
            Ok(b) => {
                let mut v = b.into_vec();
                v.truncate(range.end);
                Ok((v, range.start))
            }
            Err(buf) => Err(SharedView { buf, range }),
        }
    }

    /// A view that does not keep the buffer alive.
    pub(super) fn downgrade(&self) -> WeakView {
        WeakView(Arc::downgrade(&self.buf), self.range.clone())
    }

    /// The room a [`Place`] of `range` may fill beside this view, where this view lies at
    /// `at` of a whole of `whole` values: when the buffer is laid out for that whole (the view
    /// at its offset in it, as long as the whole) and no view covers `range` nor a claim holds
    /// it.
    pub(super) fn room_for(&self, at: usize, range: &Range<usize>, whole: usize) -> Option<Room> {
        if self.range.start != at || self.buf.len() != whole {
            return None;
        }
        let free = self.buf.free.lock().unwrap_or_else(|e| e.into_inner());
        free.iter()
            .any(|f| within(range, f))
            .then(|| Room(Arc::downgrade(&self.buf)))
    }

    /// One view of `0..len` when `parts` (ranges tiling `0..len` in order, each with its
    /// payload) are all views of one buffer at their own offsets: the whole already lies in
    /// place there, and nothing need be copied.
    pub(crate) fn joined(parts: &[(Range<usize>, Payload)], len: usize) -> Option<Payload> {
        let Some((_, Payload::Shared(first))) = parts.first() else {
            return None;
        };
        let mut end = 0;
        for (r, p) in parts {
            let Payload::Shared(v) = p else {
                return None;
            };
            if r.start != end || v.range != *r || !Arc::ptr_eq(&v.buf, &first.buf) {
                return None;
            }
            end = r.end;
        }
        (end == len).then(|| {
            Payload::Shared(SharedView {
                buf: Arc::clone(&first.buf),
                range: 0..len,
            })
        })
    }
}

/// A read-only range of a shared buffer that does not keep the buffer alive: it can be
/// read only while some [`Payload::Shared`] still holds it.
#[derive(Debug, Clone)]
pub struct WeakView(Weak<SharedBuffer>, Range<usize>);

impl WeakView {
    /// The view, if the buffer is still held.
    pub fn upgrade(&self) -> Option<Payload> {
        let buf = self.0.upgrade()?;
        Some(Payload::Shared(SharedView {
            buf,
            range: self.1.clone(),
        }))
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.1.len()
    }

    /// True for an empty range.
    pub fn is_empty(&self) -> bool {
        self.1.is_empty()
    }
}

/// A range of a buffer laid out for a whole, which no view covers, that a [`Place`] may fill.
/// Held weakly: a request whose message never comes keeps no buffer alive.
#[derive(Debug, Clone)]
pub(super) struct Room(Weak<SharedBuffer>);

/// What is left of `outer` around `range` (which lies within it): the ranges before and after,
/// those not empty.
fn around(range: &Range<usize>, outer: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    [outer.start..range.start, range.end..outer.end]
        .into_iter()
        .filter(|r| !r.is_empty())
}

/// Whether `range` is a range (not reversed) that lies within `free`.
fn within(range: &Range<usize>, free: &Range<usize>) -> bool {
    free.start <= range.start && range.start <= range.end && range.end <= free.end
}

/// Where a received part's values are laid out: at its range of a buffer for the whole the part
/// belongs to, so that joining the parts of the whole copies fewer of them, or none when the
/// others already lie in the same buffer. Only the layout differs; the values are the same.
#[derive(Debug, Clone)]
pub struct Place {
    /// The part's range in the whole: never reversed, and within `room`.
    range: Range<usize>,
    /// Elements of the whole.
    room: usize,
    /// The buffer to fill, laid out for the whole by an earlier part, if any.
    into: Option<Room>,
}

impl Place {
    /// The part `range` of a whole of `room` elements (at least `range.end`), in a buffer of
    /// its own. A reversed range stands for the empty one at its start.
    pub fn new(range: Range<usize>, room: usize) -> Place {
        let range = range.start..range.end.max(range.start);
        Place {
            room: room.max(range.end),
            range,
            into: None,
        }
    }

    /// The part `range` of a whole of `room` elements, in the buffer `into` when it is still
    /// held and the range still free there.
    pub(super) fn within(range: Range<usize>, room: usize, into: Room) -> Place {
        Place {
            into: Some(into),
            ..Place::new(range, room)
        }
    }

    /// The part's range in the whole.
    pub fn range(&self) -> &Range<usize> {
        &self.range
    }

    /// Elements of the whole.
    pub fn room(&self) -> usize {
        self.room
    }

    /// Where to write the part: the room given, when its buffer is still held and the range
    /// is still free there, else a buffer of its own ([`Place::fresh`]).
    pub(crate) fn target(&self) -> Target {
        let claimed = self.into.as_ref().and_then(|Room(weak)| {
            let buf = weak.upgrade()?;
            let mut free = buf.free.lock().unwrap_or_else(|e| e.into_inner());
            let range = &self.range;
            let i = free.iter().position(|f| within(range, f))?;
            let f = free.swap_remove(i);
            free.extend(around(range, f));
            drop(free);
            Some(Target::Claimed(buf, range.clone()))
        });
        claimed.unwrap_or_else(|| self.fresh())
    }

    /// A buffer of its own laid out for the whole, the part to be written at its range (the
    /// other values unspecified: what a recycled buffer held, zeros beyond).
    pub(crate) fn fresh(&self) -> Target {
        let v = pool::take_scratch(self.room);
        Target::Fresh(v, self.range.clone())
    }
}

/// Where a [`Place`] writes its part.
pub(crate) enum Target {
    /// A buffer of its own (the part at the range).
    Fresh(Vec<f32>, Range<usize>),
    /// A range claimed in a buffer laid out for the whole: taken out of its free ranges, to
    /// be written by this writer alone before any view covers it.
    Claimed(Arc<SharedBuffer>, Range<usize>),
}

impl Target {
    /// Whether the part is written in a range claimed beside another.
    #[cfg(test)]
    pub fn is_claimed(&self) -> bool {
        matches!(self, Target::Claimed(..))
    }

    /// The part's values, to be overwritten in full.
    pub fn values(&mut self) -> &mut [f32] {
        match self {
            Target::Fresh(v, r) => &mut v[r.clone()],
            // SAFETY: the range is within the buffer's initialized values (free ranges are)
            // and was taken out of its free ranges: no view covers it, no other claim holds it,
            // and the only way to it is this `&mut` borrow of the claim.
            Target::Claimed(buf, r) => unsafe {
                std::slice::from_raw_parts_mut(buf.ptr.as_ptr().add(r.start), r.len())
            },
        }
    }

    /// The part, once written, as a view laid out where the whole has it: its buffer's other
    /// ranges are left free for the whole's other parts.
    pub fn into_payload(self) -> Payload {
        let (buf, range) = match self {
            Target::Fresh(v, range) => {
                let free = around(&range, 0..v.len()).collect();
                (Arc::new(SharedBuffer::new(v, free)), range)
            }
            Target::Claimed(buf, range) => (buf, range),
        };
        Payload::Shared(SharedView { buf, range })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A part laid out by a place, and the rest of its whole claimed beside it.
    fn halves(len: usize, first: Range<usize>) -> (Payload, Place) {
        let mut t = Place::new(first.clone(), len).fresh();
        t.values().fill(1.0);
        let part = t.into_payload();
        let Payload::Shared(view) = &part else {
            unreachable!("a placed part is a view")
        };
        let rest = if first.start == 0 {
            first.end..len
        } else {
            0..first.start
        };
        let room = view
            .room_for(first.start, &rest, len)
            .expect("the rest is free");
        (part, Place::within(rest, len, room))
    }

    #[test]
    fn the_rest_of_a_whole_is_written_beside_its_first_part_and_joined_without_a_copy() {
        let len = 10;
        for first in [0..4, 4..10] {
            let (part, place) = halves(len, first.clone());
            let reader = part.clone();
            let mut t = place.target();
            assert!(t.is_claimed());
            t.values().fill(2.0);
            let rest = t.into_payload();
            assert_eq!(reader.as_slice(), &vec![1.0; first.len()][..]);
            let mut parts = vec![(first.clone(), part), (place.range.clone(), rest)];
            parts.sort_by_key(|(r, _)| r.start);
            let whole = SharedView::joined(&parts, len).expect("one buffer, in place");
            let want: Vec<f32> = (0..len)
                .map(|i| if first.contains(&i) { 1.0 } else { 2.0 })
                .collect();
            assert_eq!(whole.as_slice(), &want[..]);
            // The same range cannot be claimed twice: the second writer gets a buffer of its own.
            assert!(matches!(place.target(), Target::Fresh(..)));
            assert!(SharedView::joined(&parts[..1], len).is_none());
        }
    }

    #[test]
    fn a_reversed_or_outlying_range_claims_nothing_and_writes_within_its_buffer() {
        // Built field by field: reversed on purpose.
        let reversed = |start, end| Range { start, end };
        let place = Place::new(reversed(9, 3), 5);
        assert_eq!((place.range().clone(), place.room()), (9..9, 9));
        let mut t = place.fresh();
        assert!(t.values().is_empty());
        let part = t.into_payload();
        assert!(part.is_empty());
        // Only what lies within a free range, in order, may be claimed.
        let (part, _) = halves(8, 0..4);
        for range in [reversed(5, 3), 3..6, 6..9] {
            assert!(part.place_beside(0, &range, 8).is_none(), "{range:?}");
        }
        let place = part.place_beside(0, &(6..8), 8).expect("free");
        assert!(place.target().is_claimed());
        let place = part.place_beside(0, &(4..6), 8).expect("still free");
        let mut t = place.target();
        assert!(t.is_claimed());
        assert_eq!(t.values().len(), 2);
    }

    #[test]
    fn a_room_whose_buffer_is_gone_or_viewed_is_not_claimed() {
        let (part, place) = halves(8, 0..4);
        drop(part);
        assert!(matches!(place.target(), Target::Fresh(..)));
        // A buffer made whole is fully viewed: nothing is free in it.
        let v = SharedView::whole(vec![0.0; 8]);
        assert!(v.room_for(0, &(4..8), 8).is_none());
        // A view not at its offset in the whole, or of a buffer of another length.
        let (part, _) = halves(8, 0..4);
        let Payload::Shared(view) = &part else {
            unreachable!()
        };
        assert!(view.room_for(1, &(4..8), 8).is_none());
        assert!(view.room_for(0, &(4..8), 9).is_none());
        assert!(view.room_for(0, &(3..8), 8).is_none(), "overlaps the view");
    }
}
