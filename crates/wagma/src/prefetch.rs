//! Cache prefetch hints: the virtual-time executor knows which engines its next events reach
//! and asks the processor to start loading their memory while it handles the current event.

use std::ops::Range;

/// Asks the processor to start loading the cache lines `lines` of `value` (those that exist)
/// without waiting for them. A hint only: it reads nothing, so it cannot change a result.
#[inline]
pub(crate) fn prefetch<T>(value: &T, lines: Range<usize>) {
    prefetch_bytes((value as *const T).cast(), size_of::<T>(), lines);
}

/// Asks the processor to start loading the first `max_lines` cache lines of `items`.
#[inline]
pub(crate) fn prefetch_slice<T>(items: &[T], max_lines: usize) {
    prefetch_bytes(items.as_ptr().cast(), size_of_val(items), 0..max_lines);
}

/// The cache lines `lines` of the `len` bytes at `start`, those that exist.
#[inline]
fn prefetch_bytes(start: *const u8, len: usize, lines: Range<usize>) {
    for i in lines.start..lines.end.min(len.div_ceil(64)) {
        prefetch_line(start.wrapping_add(i * 64));
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_line(p: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    // SAFETY: SSE is part of every x86_64 processor, and a prefetch never dereferences its
    // address (it is a hint that cannot fault), so any pointer value is sound.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>()) }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn prefetch_line(_p: *const u8) {}
