//! Recycles large buffers. A fresh 64 MiB allocation is mapped from the OS and touched page by
//! page (page faults cost more than the copy itself); collectives allocate and drop buffers of
//! the same sizes over and over, so keeping a few lets every round after the first reuse
//! memory that is already mapped.

use std::sync::Mutex;

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
    of_length(take_any(len), len)
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
