//! Model and message buffers: real `f32` data, or only a length (for simulations where a
//! 25.6M-parameter model costs nothing to carry).

use std::ops::Range;

/// A buffer of `f32` values or, in simulations, just its length.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// Real values.
    Data(Vec<f32>),
    /// A virtual buffer of this many elements: arithmetic on it is free and does nothing.
    Size(usize),
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
            Payload::Data(_) => Payload::Data(vec![0.0; len]),
            Payload::Size(_) => Payload::Size(len),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Payload::Data(v) => v.len(),
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
            Payload::Size(_) => &[],
        }
    }

    /// The values, mutably (empty for a virtual buffer).
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        match self {
            Payload::Data(v) => v,
            Payload::Size(_) => &mut [],
        }
    }

    /// Consumes the buffer, returning its values (empty for a virtual buffer).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Payload::Data(v) => v,
            Payload::Size(_) => Vec::new(),
        }
    }

    /// Size in bytes as carried on a wire.
    pub fn bytes(&self) -> usize {
        self.len() * std::mem::size_of::<f32>()
    }

    /// A copy of `range`.
    pub fn slice(&self, range: Range<usize>) -> Payload {
        match self {
            Payload::Data(v) => Payload::Data(v[range].to_vec()),
            Payload::Size(_) => Payload::Size(range.len()),
        }
    }

    /// `self[range] += other` elementwise.
    pub fn add_at(&mut self, range: Range<usize>, other: &Payload) {
        if let (Payload::Data(a), Payload::Data(b)) = (self, other) {
            for (x, y) in a[range].iter_mut().zip(b) {
                *x += *y;
            }
        }
    }

    /// `self[range] = other`.
    pub fn copy_at(&mut self, range: Range<usize>, other: &Payload) {
        if let (Payload::Data(a), Payload::Data(b)) = (self, other) {
            a[range].copy_from_slice(b);
        }
    }

    /// `self += other` elementwise (lengths must match).
    pub fn add(&mut self, other: &Payload) {
        let n = self.len();
        self.add_at(0..n, other);
    }

    /// `self -= other` elementwise.
    pub fn sub(&mut self, other: &Payload) {
        if let (Payload::Data(a), Payload::Data(b)) = (self, other) {
            for (x, y) in a.iter_mut().zip(b) {
                *x -= *y;
            }
        }
    }

    /// `self *= k`.
    pub fn scale(&mut self, k: f32) {
        if let Payload::Data(a) = self {
            for x in a {
                *x *= k;
            }
        }
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self) {
        if let Payload::Data(a) = self {
            a.fill(0.0);
        }
    }
}

impl Payload {
    /// `self += src[range]` elementwise (`self` has `range.len()` elements).
    pub fn add_range_of(&mut self, src: &Payload, range: Range<usize>) {
        if let (Payload::Data(a), Payload::Data(b)) = (self, src) {
            for (x, y) in a.iter_mut().zip(&b[range]) {
                *x += *y;
            }
        }
    }
}
