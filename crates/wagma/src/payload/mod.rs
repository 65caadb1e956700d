//! Model and message buffers: owned `f32` data, a shared read-only view of another buffer
//! (how a send avoids a copy), or only a length (for simulations where a 25.6M-parameter model
//! costs nothing to carry).

use std::ops::Range;

use crate::uncached;

pub mod pool;
mod shared;

pub use shared::{Place, SharedView, WeakView};

/// A buffer of `f32` values, a read-only view of a shared one, or in simulations just a length.
#[derive(Debug, Clone)]
pub enum Payload {
    /// Owned values.
    Data(Vec<f32>),
    /// A read-only range of a buffer shared with others; written to, it becomes owned.
    Shared(SharedView),
    /// A virtual buffer of this many elements: arithmetic on it is free and does nothing.
    Size(usize),
}

impl PartialEq for Payload {
    fn eq(&self, other: &Payload) -> bool {
        match (self, other) {
            (Payload::Size(a), Payload::Size(b)) => a == b,
            (Payload::Size(_), _) | (_, Payload::Size(_)) => false,
            (a, b) => a.as_slice() == b.as_slice(),
        }
    }
}

impl Default for Payload {
    fn default() -> Self {
        Payload::Data(Vec::new())
    }
}

impl From<Vec<f32>> for Payload {
    fn from(v: Vec<f32>) -> Self {
        Payload::Data(v)
    }
}

impl Payload {
    /// A buffer of `len` zeros, virtual if `like` is virtual.
    pub fn zeros_like(like: &Payload, len: usize) -> Payload {
        match like {
            Payload::Size(_) => Payload::Size(len),
            _ => {
                let mut v = pool::take(len);
                v.resize(len, 0.0);
                Payload::Data(v)
            }
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Payload::Data(v) => v.len(),
            Payload::Shared(v) => v.len(),
            Payload::Size(n) => *n,
        }
    }

    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True for a virtual buffer.
    pub fn is_virtual(&self) -> bool {
        matches!(self, Payload::Size(_))
    }

    /// The values (empty for a virtual buffer).
    pub fn as_slice(&self) -> &[f32] {
        match self {
            Payload::Data(v) => v,
            Payload::Shared(v) => v.as_slice(),
            Payload::Size(_) => &[],
        }
    }

    /// The values, mutably (empty for a virtual buffer); a shared view is copied first.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self.own();
        match self {
            Payload::Data(v) => v,
            _ => &mut [],
        }
    }

    /// Makes the values owned: a shared view becomes a copy (or the buffer itself when this
    /// was its last holder).
    pub fn own(&mut self) {
        if let Payload::Shared(_) = self
            && let Payload::Shared(v) = std::mem::replace(self, Payload::Size(0))
        {
            *self = Payload::Data(owned(v));
        }
    }

    /// A read-only view of `range` that shares this buffer's memory (no copy). An owned buffer
    /// becomes shared; writing to it later copies it unless it is the last holder.
    pub fn view(&mut self, range: Range<usize>) -> Payload {
        match self {
            Payload::Size(_) => Payload::Size(range.len()),
            Payload::Shared(v) => Payload::Shared(v.part(range)),
            Payload::Data(v) => {
                let whole = SharedView::whole(std::mem::take(v));
                let view = Payload::Shared(whole.part(range));
                *self = Payload::Shared(whole);
                view
            }
        }
    }

    /// Where these values start in the buffer behind them, and the room it has, when nothing
    /// else holds it (see [`Payload::into_placed`]).
    pub fn placed_room(&self) -> Option<(usize, usize)> {
        match self {
            Payload::Data(v) => Some((0, v.capacity())),
            Payload::Shared(v) if v.is_sole_holder() => Some((v.start(), v.capacity())),
            _ => None,
        }
    }

    /// Where the part `range` of a whole of `whole` elements may be read beside these values,
    /// which are its part at `at`: in the same buffer, when they were laid out there for that
    /// whole (see [`Place`]) and `range` is still free in it. `None` otherwise.
    pub fn place_beside(&self, at: usize, range: &Range<usize>, whole: usize) -> Option<Place> {
        match self {
            Payload::Shared(v) => v
                .room_for(at, range, whole)
                .map(|room| Place::within(range.clone(), whole, room)),
            _ => None,
        }
    }

    /// The buffer behind these values and where they start in it, when nothing else holds
    /// it: owned values start at 0, a view at its offset (the buffer holds other values, as
    /// a [`Place`] laid them out, before and after). The buffer ends where the values do.
    /// `Err(self)` for a buffer held elsewhere too, or a virtual one.
    pub fn into_placed(self) -> Result<(Vec<f32>, usize), Payload> {
        match self {
            Payload::Data(v) => Ok((v, 0)),
            Payload::Shared(view) => view.try_unwrap().map_err(Payload::Shared),
            Payload::Size(_) => Err(self),
        }
    }

    /// A view of this shared range that does not keep it alive; `None` unless shared.
    pub fn downgrade(&self) -> Option<WeakView> {
        match self {
            Payload::Shared(v) => Some(v.downgrade()),
            _ => None,
        }
    }

    /// Consumes the buffer, returning its values (empty for a virtual buffer).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Payload::Data(v) => v,
            Payload::Shared(v) => owned(v),
            Payload::Size(_) => Vec::new(),
        }
    }

    /// Size in bytes as carried on a wire.
    pub fn bytes(&self) -> usize {
        // Saturating: a virtual length may be anything a simulation asks for.
        self.len().saturating_mul(std::mem::size_of::<f32>())
    }

    /// A copy of `range` (in a recycled buffer).
    pub fn slice(&self, range: Range<usize>) -> Payload {
        match self {
            Payload::Size(_) => Payload::Size(range.len()),
            _ => Payload::Data(pool::copy_of(&self.as_slice()[range])),
        }
    }

    /// A copy of the whole buffer (in a recycled buffer).
    pub fn duplicate(&self) -> Payload {
        self.slice(0..self.len())
    }

    /// Hands the buffer's memory back for reuse (a shared buffer goes back when its last
    /// holder drops it, recycled or not).
    pub fn recycle(self) {
        if let Payload::Data(v) = self {
            pool::give(v);
        }
    }

    /// `a op b` elementwise into a new (recycled) buffer; virtual if either is.
    pub fn reduce_of(a: &Payload, b: &Payload, op: Reduce) -> Payload {
        if a.is_virtual() || b.is_virtual() {
            return Payload::Size(a.len());
        }
        let mut v = pool::take(a.len());
        op.extend_for(&mut v, a.as_slice(), b.as_slice(), a.len());
        Payload::Data(v)
    }

    /// `self[range] = self[range] op other` elementwise.
    pub fn reduce_at(&mut self, range: Range<usize>, other: &Payload, op: Reduce) {
        if self.is_virtual() || other.is_virtual() {
            return;
        }
        let pairs = self.as_mut_slice()[range].iter_mut().zip(other.as_slice());
        match op {
            Reduce::Sum => pairs.for_each(|(x, y)| *x += *y),
            Reduce::Max => pairs.for_each(|(x, &y)| *x = Reduce::max(*x, y)),
        }
    }

    /// `self = self op other` elementwise (lengths must match).
    pub fn reduce_with(&mut self, other: &Payload, op: Reduce) {
        let n = self.len();
        self.reduce_at(0..n, other, op);
    }

    /// `self[range] = other`.
    pub fn copy_at(&mut self, range: Range<usize>, other: &Payload) {
        if self.is_virtual() || other.is_virtual() {
            return;
        }
        self.as_mut_slice()[range].copy_from_slice(other.as_slice());
    }

    /// `self += src[range]` elementwise (`self` has `range.len()` elements).
    pub fn add_range_of(&mut self, src: &Payload, range: Range<usize>) {
        if self.is_virtual() || src.is_virtual() {
            return;
        }
        for (x, y) in self.as_mut_slice().iter_mut().zip(&src.as_slice()[range]) {
            *x += *y;
        }
    }

    /// `self += other` elementwise (lengths must match).
    pub fn add(&mut self, other: &Payload) {
        self.reduce_with(other, Reduce::Sum);
    }

    /// `self -= other` elementwise.
    pub fn sub(&mut self, other: &Payload) {
        if self.is_virtual() || other.is_virtual() {
            return;
        }
        for (x, y) in self.as_mut_slice().iter_mut().zip(other.as_slice()) {
            *x -= *y;
        }
    }

    /// `self *= k`.
    pub fn scale(&mut self, k: f32) {
        for x in self.as_mut_slice() {
            *x *= k;
        }
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self) {
        self.as_mut_slice().fill(0.0);
    }
}

/// How two buffers combine, element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// `x + y`.
    Sum,
    /// The larger of `x` and `y` in IEEE 754's total order (`-0 < +0`, a NaN with the sign
    /// bit clear above every number): one value whatever the order of the operands, so a
    /// maximum is the same bits on every schedule.
    Max,
}

impl Reduce {
    fn max(x: f32, y: f32) -> f32 {
        if y.total_cmp(&x).is_gt() { y } else { x }
    }

    /// Appends `a[i] op b[i]` to `out` for every `i` of the shorter of the two.
    pub fn extend(self, out: &mut Vec<f32>, a: &[f32], b: &[f32]) {
        self.extend_for(out, a, b, 0);
    }

    /// Overwrites `out[i]` with `a[i] op b[i]` for every `i` of `out` (the operands at least
    /// as long), part of a result of `whole` elements, as [`Reduce::extend_for`] writes it.
    pub(crate) fn zip_into(self, out: &mut [f32], a: &[f32], b: &[f32], whole: usize) {
        match self {
            Reduce::Sum => uncached::zip_into(out, a, b, whole, |x, y| x + y),
            Reduce::Max => uncached::zip_into(out, a, b, whole, Reduce::max),
        }
    }

    /// [`Reduce::extend`] for a result that will hold `whole` elements: a large one is
    /// written around the caches (see [`crate::uncached`]), the same values.
    pub(crate) fn extend_for(self, out: &mut Vec<f32>, a: &[f32], b: &[f32], whole: usize) {
        match self {
            Reduce::Sum => uncached::extend_zip(out, a, b, whole, |x, y| x + y),
            Reduce::Max => uncached::extend_zip(out, a, b, whole, Reduce::max),
        }
    }
}

/// The values of `view`: its buffer itself when this was its last holder and the view starts
/// it and covers most of it (a part laid out at the start of a whole, or the whole), else a
/// copy.
fn owned(view: SharedView) -> Vec<f32> {
    let view = if view.start() == 0 && 2 * view.len() >= view.buffer_len() {
        match view.try_unwrap() {
            Ok((v, _)) => return v,
            Err(view) => view,
        }
    } else {
        view
    };
    pool::copy_of(view.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_maximum_is_the_same_whatever_the_order_of_its_operands() {
        let xs = [0.0f32, -0.0, 1.5, f32::NAN, -f32::NAN, -3.0, f32::INFINITY];
        for &x in &xs {
            for &y in &xs {
                let (a, b) = (Payload::Data(vec![x]), Payload::Data(vec![y]));
                let xy = Payload::reduce_of(&a, &b, Reduce::Max).into_vec()[0];
                let yx = Payload::reduce_of(&b, &a, Reduce::Max).into_vec()[0];
                assert_eq!(xy.to_bits(), yx.to_bits(), "max({x}, {y})");
                let mut c = a.clone();
                c.reduce_with(&b, Reduce::Max);
                assert_eq!(c.into_vec()[0].to_bits(), xy.to_bits());
            }
        }
        let max = |x: f32, y: f32| Reduce::max(x, y).to_bits();
        assert_eq!(max(-0.0, 0.0), 0.0f32.to_bits());
        assert_eq!(max(-3.0, 1.5), 1.5f32.to_bits());
        assert_eq!(max(f32::INFINITY, 1.5), f32::INFINITY.to_bits());
    }

    #[test]
    fn the_last_view_dropped_hands_the_buffer_back() {
        // A capacity no other test allocates: finding it in the pool proves this one came back.
        let len = (3 << 20) + 11;
        let mut v = Vec::with_capacity(len);
        v.resize(len, 2.0);
        let mut p = Payload::Data(v);
        let view = p.view(1..3);
        drop(p);
        assert!(!pool::holds(len), "a view still holds the buffer");
        drop(view);
        assert!(pool::holds(len));
    }

    #[test]
    fn views_share_until_written() {
        let mut p = Payload::Data(vec![1.0, 2.0, 3.0, 4.0]);
        let v = p.view(1..3);
        assert_eq!(v.as_slice(), &[2.0, 3.0]);
        assert!(matches!(p, Payload::Shared(..)));
        p.reduce_at(0..2, &Payload::Data(vec![10.0, 10.0]), Reduce::Sum);
        assert_eq!(p.as_slice(), &[11.0, 12.0, 3.0, 4.0]);
        assert_eq!(v.as_slice(), &[2.0, 3.0], "the view keeps the old values");
        let mut last = Payload::Data(vec![5.0; 3]);
        let view = last.view(0..3);
        drop(view);
        last.own();
        assert_eq!(last, Payload::Data(vec![5.0; 3]));
        assert_eq!(
            Payload::reduce_of(&last, &last, Reduce::Sum).as_slice(),
            &[10.0; 3]
        );
    }

    #[test]
    fn virtual_buffers_do_nothing() {
        let mut p = Payload::Size(10);
        p.add(&Payload::Size(10));
        p.scale(2.0);
        assert_eq!(p.len(), 10);
        assert_eq!(p.view(2..5), Payload::Size(3));
        assert_eq!(Payload::zeros_like(&p, 4), Payload::Size(4));
    }
}
