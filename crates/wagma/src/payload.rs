//! Model and message buffers: owned `f32` data, a shared read-only view of another buffer
//! (how a send avoids a copy), or only a length (for simulations where a 25.6M-parameter model
//! costs nothing to carry).

use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::uncached;

/// Recycles large buffers. A fresh 64 MiB allocation is mapped from the OS and touched page by
/// page (page faults cost more than the copy itself); collectives allocate and drop buffers of
/// the same sizes over and over, so keeping a few lets every round after the first reuse
/// memory that is already mapped.
pub mod pool {
    use super::Mutex;

    /// Buffers smaller than this many elements are left to the allocator.
    const MIN_ELEMENTS: usize = 1 << 14;
    /// Largest number of buffers kept.
    const MAX_BUFFERS: usize = 64;
    /// Largest number of elements kept in all: 1 GiB of `f32`s.
    const MAX_ELEMENTS: usize = (1 << 30) / std::mem::size_of::<f32>();

    static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

    /// An empty vector with room for `len` elements.
    pub fn take(len: usize) -> Vec<f32> {
        let mut v = take_any(len);
        v.clear();
        v
    }

    /// A vector of `len` elements whose values are unspecified (what a recycled buffer held,
    /// zeros beyond), to receive into without clearing it first.
    pub fn take_scratch(len: usize) -> Vec<f32> {
        take_scratch_with_room(len, len)
    }

    /// Like [`take_scratch`], with room for `room` elements (at least `len`).
    pub fn take_scratch_with_room(len: usize, room: usize) -> Vec<f32> {
        of_length(take_any(room.max(len)), len)
    }

    /// Like [`take_scratch`], but only from a buffer the pool already holds: `None` when it
    /// holds none that fits, and nothing is allocated.
    pub fn take_recycled(len: usize) -> Option<Vec<f32>> {
        take_held(len).map(|v| of_length(v, len))
    }

    /// `v` cut or padded with zeros to `len` elements (what it held stays).
    fn of_length(mut v: Vec<f32>, len: usize) -> Vec<f32> {
        v.truncate(len);
        v.resize(len, 0.0);
        v
    }

    /// A recycled buffer with room for `len` elements, as it was handed back.
    fn take_any(len: usize) -> Vec<f32> {
        take_held(len).unwrap_or_else(|| Vec::with_capacity(len))
    }

    /// A buffer of the pool with room for `len` elements (and not much more), if it holds one.
    fn take_held(len: usize) -> Option<Vec<f32>> {
        if len < MIN_ELEMENTS {
            return None;
        }
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        // Prefer a buffer already as long as needed: nothing to fill.
        let fits = |v: &Vec<f32>| v.capacity() >= len && v.capacity() <= 2 * len;
        let pick = pool
            .iter()
            .position(|v| fits(v) && v.len() >= len)
            .or_else(|| pool.iter().position(fits));
        pick.map(|i| pool.swap_remove(i))
    }

    /// A copy of `src` in a recycled buffer.
    pub fn copy_of(src: &[f32]) -> Vec<f32> {
        let mut v = take(src.len());
        v.extend_from_slice(src);
        v
    }

    /// Whether a buffer of exactly `capacity` elements waits in the pool.
    #[cfg(test)]
    pub fn holds(capacity: usize) -> bool {
        let pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        pool.iter().any(|v| v.capacity() == capacity)
    }

    /// Hands a buffer back for reuse.
    pub fn give(v: Vec<f32>) {
        if v.capacity() < MIN_ELEMENTS {
            return;
        }
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = pool.iter().map(Vec::capacity).sum();
        if pool.len() < MAX_BUFFERS && held + v.capacity() <= MAX_ELEMENTS {
            pool.push(v);
        }
    }
}

/// Where a received part's values are laid out: at `range` of a buffer with room for `room`
/// elements, the whole the part belongs to. Joining the parts of a buffer then extends (or
/// fills in around) the part instead of copying it too. Only the layout differs; the values
/// are the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The part's range in the whole.
    pub range: Range<usize>,
    /// Elements of the whole.
    pub room: usize,
}

impl Place {
    /// A buffer of `range.end` elements with room for `room`, whose values are unspecified
    /// (what a recycled buffer held, zeros beyond): the part is written at `range`.
    pub(crate) fn buffer(&self) -> Vec<f32> {
        pool::take_scratch_with_room(self.range.end, self.room)
    }

    /// The part, once `v` (from [`Place::buffer`]) holds its values at `range`.
    pub(crate) fn payload(&self, mut v: Vec<f32>) -> Payload {
        v.truncate(self.range.end);
        if self.range.start == 0 {
            return Payload::Data(v);
        }
        Payload::Shared(Arc::new(SharedBuffer(v)), self.range.clone())
    }
}

/// The memory behind shared views ([`Payload::Shared`]), read-only. Its last holder hands it
/// back to the pool when it drops it, wherever that is (a connection's writer thread once the
/// frame is written, a receiver once it has summed it), so that a later round reuses it
/// instead of mapping and faulting in a fresh buffer.
#[derive(Debug)]
pub struct SharedBuffer(Vec<f32>);

impl SharedBuffer {
    /// The values, taken out (what is left for `drop` to hand back is empty).
    fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(&mut self.0)
    }
}

impl std::ops::Deref for SharedBuffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        pool::give(std::mem::take(&mut self.0));
    }
}

/// A read-only range of a shared buffer that does not keep the buffer alive: it can be
/// read only while some [`Payload::Shared`] still holds it.
#[derive(Debug, Clone)]
pub struct WeakView(std::sync::Weak<SharedBuffer>, Range<usize>);

impl WeakView {
    /// The view, if the buffer is still held.
    pub fn upgrade(&self) -> Option<Payload> {
        self.0.upgrade().map(|a| Payload::Shared(a, self.1.clone()))
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

/// A buffer of `f32` values, a read-only view of a shared one, or in simulations just a length.
#[derive(Debug, Clone)]
pub enum Payload {
    /// Owned values.
    Data(Vec<f32>),
    /// A read-only range of a buffer shared with others; written to, it becomes owned.
    Shared(Arc<SharedBuffer>, Range<usize>),
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
            Payload::Shared(_, r) => r.len(),
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
            Payload::Shared(a, r) => &a[r.clone()],
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
        if let Payload::Shared(_, _) = self
            && let Payload::Shared(a, r) = std::mem::replace(self, Payload::Size(0))
        {
            *self = Payload::Data(owned(a, r));
        }
    }

    /// A read-only view of `range` that shares this buffer's memory (no copy). An owned buffer
    /// becomes shared; writing to it later copies it unless it is the last holder.
    pub fn view(&mut self, range: Range<usize>) -> Payload {
        match self {
            Payload::Size(_) => Payload::Size(range.len()),
            Payload::Shared(a, r) => {
                Payload::Shared(Arc::clone(a), r.start + range.start..r.start + range.end)
            }
            Payload::Data(v) => {
                let arc = Arc::new(SharedBuffer(std::mem::take(v)));
                let len = arc.len();
                let view = Payload::Shared(Arc::clone(&arc), range);
                *self = Payload::Shared(arc, 0..len);
                view
            }
        }
    }

    /// Where these values start in the buffer behind them, and the room it has, when nothing
    /// else holds it (see [`Payload::into_placed`]).
    pub fn placed_room(&self) -> Option<(usize, usize)> {
        match self {
            Payload::Data(v) => Some((0, v.capacity())),
            Payload::Shared(a, r) if Arc::strong_count(a) == 1 => Some((r.start, a.0.capacity())),
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
            Payload::Shared(a, r) => match Arc::try_unwrap(a) {
                Ok(b) => {
                    let mut v = b.into_vec();
                    v.truncate(r.end);
                    Ok((v, r.start))
                }
                Err(a) => Err(Payload::Shared(a, r)),
            },
            Payload::Size(_) => Err(self),
        }
    }

    /// A view of this shared range that does not keep it alive; `None` unless shared.
    pub fn downgrade(&self) -> Option<WeakView> {
        match self {
            Payload::Shared(a, r) => Some(WeakView(Arc::downgrade(a), r.clone())),
            _ => None,
        }
    }

    /// Consumes the buffer, returning its values (empty for a virtual buffer).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Payload::Data(v) => v,
            Payload::Shared(a, r) => owned(a, r),
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

    /// [`Reduce::extend`] for a result that will hold `whole` elements: a large one is
    /// written around the caches (see [`crate::uncached`]), the same values.
    pub(crate) fn extend_for(self, out: &mut Vec<f32>, a: &[f32], b: &[f32], whole: usize) {
        match self {
            Reduce::Sum => uncached::extend_zip(out, a, b, whole, |x, y| x + y),
            Reduce::Max => uncached::extend_zip(out, a, b, whole, Reduce::max),
        }
    }
}

fn owned(a: Arc<SharedBuffer>, r: Range<usize>) -> Vec<f32> {
    if r.start == 0 && r.end == a.len() {
        match Arc::try_unwrap(a) {
            Ok(v) => v.into_vec(),
            Err(a) => pool::copy_of(&a[r]),
        }
    } else {
        pool::copy_of(&a[r])
    }
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
