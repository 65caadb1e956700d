//! The working buffer of a running schedule, kept as segments so that sends are views (no
//! copy), received ranges are moved in (no copy) and a reduction writes a fresh segment while
//! peers may still be reading the old one.

use std::ops::Range;

use crate::Rank;
use crate::payload::{Payload, Place, Reduce, SharedView, pool};
use crate::uncached;

/// Segments that tile `0..len` in order.
pub(super) struct WorkBuf {
    len: usize,
    segs: Vec<(Range<usize>, Payload)>,
    /// Started from a virtual payload: whatever is reduced or moved in, the result is a size
    /// (as if the segments were kept and joined), so nothing is kept.
    virtual_: bool,
}

impl WorkBuf {
    pub fn new(p: Payload) -> WorkBuf {
        let len = p.len();
        WorkBuf {
            len,
            virtual_: p.is_virtual(),
            segs: vec![(0..len, p)],
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer stands for values it does not hold (see [`WorkBuf::new`]).
    pub fn is_virtual(&self) -> bool {
        self.virtual_
    }

    /// A read-only view of `range` for a send.
    pub fn view(&mut self, range: Range<usize>) -> Payload {
        if self.virtual_ {
            return Payload::Size(range.len());
        }
        if let Some((r, p)) = self
            .segs
            .iter_mut()
            .find(|(r, _)| r.start <= range.start && range.end <= r.end)
        {
            let at = r.start;
            return p.view(range.start - at..range.end - at);
        }
        self.materialize();
        self.segs[0].1.view(range)
    }

    /// Joins the segments into one buffer: a view of the one buffer all of them already lie
    /// in at their places, if they do, else an owned buffer.
    fn materialize(&mut self) {
        if self.segs.len() == 1 {
            return;
        }
        let virtual_ = self.segs.iter().any(|(_, p)| p.is_virtual());
        let joined = if let Some(whole) = SharedView::joined(&self.segs, self.len) {
            // Every part already lies in place in one buffer.
            self.segs.clear();
            whole
        } else if virtual_ {
            self.segs.drain(..).for_each(|(_, p)| p.recycle());
            Payload::Size(self.len)
        } else {
            let len = self.len;
            // A part whose values already lie at their place in a buffer with room for the
            // whole (one of this rank's own at the start, or one folded or read into place,
            // see `WorkBuf::layout`) is filled in around: only the others are copied. The
            // largest such part, if another holder does not keep it shared.
            let fits = |(r, p): &(Range<usize>, Payload)| {
                p.placed_room()
                    .is_some_and(|(at, room)| at == r.start && room >= len)
            };
            let base = (self.segs.iter().enumerate())
                .filter(|(_, s)| fits(s))
                .max_by_key(|(_, (r, _))| r.len())
                .map(|(i, _)| i);
            let mut kept = None;
            if let Some(i) = base {
                let (r, p) = self.segs.remove(i);
                match p.into_placed() {
                    Ok((v, at)) => {
                        debug_assert_eq!(at, r.start);
                        kept = Some((r, v));
                    }
                    Err(p) => self.segs.insert(i, (r, p)),
                }
            }
            let (placed, mut v) = kept.unwrap_or_else(|| (0..0, pool::take(len)));
            for (r, p) in self.segs.drain(..) {
                if r.start < placed.start {
                    uncached::copy_into(&mut v[r], p.as_slice(), len);
                } else {
                    uncached::extend_copy(&mut v, p.as_slice(), len);
                }
                p.recycle();
            }
            debug_assert_eq!(v.len(), len);
            Payload::Data(v)
        };
        self.segs.push((0..self.len, joined));
    }

    /// How a large part of this buffer may be laid out (see [`Place`]): in a buffer with room
    /// for the whole, when the part is at least half of it (rounded down: either half of an
    /// odd length), so that joining the parts copies only the rest. `None` for a smaller
    /// part, which would hold a whole buffer's memory to spare less than its size.
    pub fn layout(&self, range: &Range<usize>) -> Option<Place> {
        let part = range.len();
        (!self.virtual_ && part < self.len && part >= self.len / 2)
            .then(|| Place::new(range.clone(), self.len))
    }

    /// Where a received part that replaces `range` may be read into (see
    /// [`crate::transport::FoldInto::Place`]): laid out as [`WorkBuf::layout`] says, beside
    /// another part when a segment lies in a buffer laid out for the whole with `range` still
    /// free in it (the other half of a whole whose first half was folded there): then joining
    /// the two copies nothing.
    pub fn place(&self, range: &Range<usize>) -> Option<Place> {
        let place = self.layout(range)?;
        let beside = (self.segs.iter()).find_map(|(r, p)| p.place_beside(r.start, range, self.len));
        Some(beside.unwrap_or(place))
    }

    /// This rank's part of `range`: the segment itself when it is exactly `range` (and
    /// whether it may be written in place), a view otherwise.
    fn part(&mut self, range: &Range<usize>) -> (Payload, bool) {
        if let Some(i) = self.segs.iter().position(|(r, _)| r == range) {
            let (_, p) = self.segs.remove(i);
            let exclusive = matches!(p, Payload::Data(_));
            return (p, exclusive);
        }
        (self.view(range.clone()), false)
    }

    /// Sets `range` to this rank's values and `others` combined by `op`, folded left in
    /// ascending rank order: `((x_a + x_b) + x_c) + ...` for a sum. Leaves `others` empty (its
    /// capacity is the caller's to reuse).
    pub fn reduce(
        &mut self,
        rank: Rank,
        range: Range<usize>,
        others: &mut Vec<(Rank, Payload)>,
        op: Reduce,
    ) {
        if others.is_empty() {
            return;
        }
        if self.virtual_ {
            others.drain(..).for_each(|(_, p)| p.recycle());
            return;
        }
        let (mine, exclusive) = self.part(&range);
        let items = others;
        items.push((rank, mine));
        items.sort_by_key(|(r, _)| *r);
        let own = items.iter().position(|(r, _)| *r == rank).unwrap_or(0);
        // (a + b) == (b + a) bit for bit (a maximum too), so the first two may be folded into
        // either: into one that may be written in place (this rank's part when it is its own
        // alone, else a received buffer), which spares a fresh buffer and a third stream of
        // memory traffic.
        let writable = |i: usize, p: &Payload| {
            if i == own {
                exclusive
            } else {
                matches!(p, Payload::Data(_))
            }
        };
        let into = (0..items.len().min(2)).find(|&i| writable(i, &items[i].1));
        let result = if let Some(i) = into {
            let (_, mut acc) = items.remove(i);
            for (_, p) in items.drain(..) {
                acc.reduce_with(&p, op);
                p.recycle();
            }
            acc
        } else {
            let mut it = items.drain(..);
            let first = it.next().map(|(_, p)| p).unwrap_or_default();
            match it.next() {
                None => first,
                Some((_, second)) => {
                    let mut acc = Payload::reduce_of(&first, &second, op);
                    first.recycle();
                    second.recycle();
                    for (_, p) in it {
                        acc.reduce_with(&p, op);
                        p.recycle();
                    }
                    acc
                }
            }
        };
        self.replace(range, result);
    }

    /// Sets `range` to `p` (moved in, no copy).
    pub fn replace(&mut self, range: Range<usize>, p: Payload) {
        if range.is_empty() {
            return;
        }
        if self.virtual_ {
            p.recycle();
            return;
        }
        let mut out = Vec::with_capacity(self.segs.len() + 2);
        for (r, mut seg) in self.segs.drain(..) {
            if r.end <= range.start || r.start >= range.end {
                out.push((r, seg));
                continue;
            }
            if r.start < range.start {
                out.push((r.start..range.start, seg.view(0..range.start - r.start)));
            }
            if r.end > range.end {
                out.push((
                    range.end..r.end,
                    seg.view(range.end - r.start..r.end - r.start),
                ));
            }
            seg.recycle();
        }
        out.push((range, p));
        out.sort_by_key(|(r, _)| r.start);
        self.segs = out;
    }

    /// The whole buffer.
    pub fn finish(mut self) -> Payload {
        self.materialize();
        self.segs
            .pop()
            .map(|(_, p)| p)
            .unwrap_or_else(|| Payload::Data(Vec::new()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_in_rank_order_and_tiles() {
        let mut b = WorkBuf::new(Payload::Data(vec![1.0, 2.0, 3.0, 4.0]));
        let sent = b.view(2..4);
        let mut others = vec![
            (0, Payload::Data(vec![10.0, 20.0])),
            (2, Payload::Data(vec![100.0, 200.0])),
        ];
        b.reduce(1, 0..2, &mut others, Reduce::Sum);
        assert!(others.is_empty());
        b.replace(2..4, Payload::Data(vec![7.0, 8.0]));
        assert_eq!(sent.as_slice(), &[3.0, 4.0]);
        assert_eq!(b.finish().as_slice(), &[111.0, 222.0, 7.0, 8.0]);
        let mut b = WorkBuf::new(Payload::Size(6));
        let mut others = vec![(1, Payload::Size(6))];
        b.reduce(0, 0..6, &mut others, Reduce::Sum);
        assert!(others.is_empty());
        assert_eq!(b.finish(), Payload::Size(6));
    }

    #[test]
    fn a_large_buffer_gathered_in_pieces_joins_to_the_same_values() {
        // Joined around the caches (see `uncached`), from pieces that leave the copy at
        // every alignment.
        let len = uncached::FROM + 7;
        let all: Vec<f32> = (0..len).map(|i| (i % 4099) as f32 - 0.5).collect();
        let mut b = WorkBuf::new(Payload::Data(vec![0.0; len]));
        let cuts = [0, 1, 6, len / 2 + 3, len];
        for w in cuts.windows(2) {
            b.replace(w[0]..w[1], Payload::Data(all[w[0]..w[1]].to_vec()));
        }
        assert!(b.finish().as_slice() == &all[..]);
    }

    #[test]
    fn a_part_read_into_place_is_filled_in_around_instead_of_copied() {
        for len in [1000, uncached::FROM + 7] {
            let all: Vec<f32> = (0..len).map(|i| (i % 4099) as f32 - 0.5).collect();
            // The part at the start, inside, at the end; held by the buffer alone or also
            // elsewhere (then copied like the others).
            for (start, end) in [(0, len / 2 + 1), (3, len / 2 + 5), (len / 2 - 1, len)] {
                for shared in [false, true] {
                    let mut b = WorkBuf::new(Payload::Data(vec![0.0; len]));
                    let range = start..end;
                    let place = b.place(&range).expect("at least half of the whole");
                    assert!(b.place(&(0..start.max(1))).is_none(), "{start}");
                    let mut t = place.target();
                    t.values().copy_from_slice(&all[range.clone()]);
                    let mut part = t.into_payload();
                    let base = part.as_slice().as_ptr().wrapping_sub(start);
                    let elsewhere = shared.then(|| part.view(0..end - start));
                    b.replace(0..start, Payload::Data(all[..start].to_vec()));
                    b.replace(range, part);
                    b.replace(end..len, Payload::Data(all[end..].to_vec()));
                    let got = b.finish();
                    assert!(got.as_slice() == &all[..], "{len} {start} {shared}");
                    let filled_in = std::ptr::eq(got.as_slice().as_ptr(), base);
                    assert_eq!(filled_in, !shared, "{len} {start}");
                    drop(elsewhere);
                }
            }
        }
    }

    #[test]
    fn a_whole_laid_out_half_by_half_in_one_buffer_is_joined_without_a_copy() {
        for len in [1000, uncached::FROM + 7] {
            let all: Vec<f32> = (0..len).map(|i| (i % 4099) as f32 - 0.5).collect();
            for first in [0..len / 2, len / 2..len] {
                // A send of the first half may still hold it when the rest arrives.
                for sent in [false, true] {
                    let mut b = WorkBuf::new(Payload::Data(vec![0.0; len]));
                    // The first half as a fold lays it out, in a buffer for the whole.
                    let mut t = b.layout(&first).expect("half of the whole").fresh();
                    t.values().copy_from_slice(&all[first.clone()]);
                    let part = t.into_payload();
                    let base = part.as_slice().as_ptr().wrapping_sub(first.start);
                    b.replace(first.clone(), part);
                    let held = sent.then(|| b.view(first.clone()));
                    let rest = if first.start == 0 {
                        first.end..len
                    } else {
                        0..first.start
                    };
                    let mut t = b.place(&rest).expect("half of the whole").target();
                    assert!(t.is_claimed(), "{len} {first:?}");
                    t.values().copy_from_slice(&all[rest.clone()]);
                    b.replace(rest.clone(), t.into_payload());
                    // Taken, the rest is no longer free there.
                    let again = b.place(&rest).expect("half of the whole").target();
                    assert!(!again.is_claimed());
                    let got = b.finish();
                    assert!(got.as_slice() == &all[..], "{len} {first:?} {sent}");
                    assert!(
                        std::ptr::eq(got.as_slice().as_ptr(), base),
                        "{len} {first:?}"
                    );
                    if let Some(held) = held {
                        assert!(held.as_slice() == &all[first.clone()]);
                    }
                }
            }
        }
    }

    #[test]
    fn a_maximum_is_the_same_bits_for_every_member() {
        let xs = [0.5f32, -0.0, 0.0, 3.0];
        for me in 0..4 {
            // The own part is a view (its range lies inside a larger segment): a new buffer.
            let mut b = WorkBuf::new(Payload::Data(vec![xs[me], 1.0]));
            let mut others = (0..4)
                .filter(|&r| r != me)
                .map(|r| (r, Payload::Data(vec![xs[r]])))
                .collect();
            b.reduce(me, 0..1, &mut others, Reduce::Max);
            let got = b.finish().into_vec();
            assert_eq!(got[0].to_bits(), 3.0f32.to_bits(), "rank {me}");
            assert_eq!(got[1], 1.0);
        }
        // The own part is a whole segment: folded in place, whichever zero it holds.
        let xs = [-0.0f32, 0.0];
        for me in 0..2 {
            let mut b = WorkBuf::new(Payload::Data(vec![xs[me]]));
            let mut others = vec![(1 - me, Payload::Data(vec![xs[1 - me]]))];
            b.reduce(me, 0..1, &mut others, Reduce::Max);
            assert_eq!(b.finish().into_vec()[0].to_bits(), 0.0f32.to_bits());
        }
        let mut b = WorkBuf::new(Payload::Size(3));
        let mut others = vec![(1, Payload::Size(3))];
        b.reduce(0, 0..3, &mut others, Reduce::Max);
        assert!(others.is_empty());
        assert_eq!(b.finish(), Payload::Size(3));
    }

    #[test]
    fn a_sent_part_is_folded_into_the_received_buffer() {
        for me in 0..2 {
            let mut b = WorkBuf::new(Payload::Data(vec![0.25, 1e8, 3.0]));
            // Sent: the own buffer is shared with the send and may not be written.
            let _sent = b.view(0..3);
            let received = vec![1e-8, -1e8, 0.5];
            let at = received.as_ptr();
            let mut others = vec![(1 - me, Payload::Data(received))];
            b.reduce(me, 0..3, &mut others, Reduce::Sum);
            let got = b.finish();
            assert_eq!(
                got.as_slice().as_ptr(),
                at,
                "rank {me}: a fresh buffer was used"
            );
            let want = [0.25f32 + 1e-8, 1e8 + -1e8, 3.0 + 0.5];
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got.as_slice()), bits(&want), "rank {me}");
        }
    }

    #[test]
    fn joining_extends_a_first_segment_that_has_room() {
        let mut first = Vec::with_capacity(4);
        first.extend([1.0, 2.0]);
        let at = first.as_ptr();
        let mut b = WorkBuf::new(Payload::Data(vec![0.0; 4]));
        b.replace(0..2, Payload::Data(first));
        b.replace(2..4, Payload::Data(vec![3.0, 4.0]));
        let got = b.finish();
        assert_eq!(got.as_slice(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(got.as_slice().as_ptr(), at);
        // Without room, the segments are copied into one buffer.
        let mut b = WorkBuf::new(Payload::Data(vec![0.0; 4]));
        b.replace(0..2, Payload::Data(vec![1.0, 2.0]));
        b.replace(2..4, Payload::Data(vec![3.0, 4.0]));
        assert_eq!(b.finish().as_slice(), &[1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn left_fold_matches_sequential_order() {
        let xs = [0.1f32, 1e8, -1e8, 0.3];
        let want = ((xs[0] + xs[1]) + xs[2]) + xs[3];
        for me in 0..4 {
            let mut b = WorkBuf::new(Payload::Data(vec![xs[me]]));
            let mut others = (0..4)
                .filter(|&r| r != me)
                .map(|r| (r, Payload::Data(vec![xs[r]])))
                .collect();
            b.reduce(me, 0..1, &mut others, Reduce::Sum);
            assert_eq!(
                b.finish().as_slice()[0].to_bits(),
                want.to_bits(),
                "rank {me}"
            );
        }
    }
}
