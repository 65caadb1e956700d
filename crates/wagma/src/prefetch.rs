//! Cache prefetch hints: the virtual-time executor knows which engines its next events reach
//! and asks the processor to start loading their memory while it handles the current event.

/// Asks the processor to start loading the cache lines `lines` of `value` (those that exist)
/// without waiting for them. A hint only: it reads nothing, so it cannot change a result.
#[inline]
pub(crate) fn prefetch<T>(value: &T, lines: std::ops::Range<usize>) {
    let start = (value as *const T).cast::<u8>();
    let end = lines.end.min(std::mem::size_of::<T>().div_ceil(64));
    for i in lines.start..end {
        prefetch_line(start.wrapping_add(i * 64));
    }
}

/// Asks the processor to start loading the first `max_lines` cache lines of `items`.
#[inline]
pub(crate) fn prefetch_slice<T>(items: &[T], max_lines: usize) {
    let start = items.as_ptr().cast::<u8>();
    let lines = std::mem::size_of_val(items).div_ceil(64).min(max_lines);
    for i in 0..lines {
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
