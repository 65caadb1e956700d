//! Writing a large result around the caches. A sum of two buffers read from memory into a
//! third would otherwise read every line of the third before writing it (the processor must
//! own a line it writes part of), a third more memory traffic for a result too large to stay
//! in cache until it is read anyway. Non-temporal stores write whole lines without reading
//! them first.

use std::mem::MaybeUninit;

/// Elements of a result from which it is written around the caches: 32 MiB, as large as a
/// server processor's last-level cache (this machine's is 32 MiB), so that its operands, streamed
/// through the caches while it is made, leave no room to read it back from them. Smaller
/// results are written the usual way: at 16 MiB, sums over threads were up to a tenth slower
/// written around the caches, as the next reader found less of them in cache.
pub(crate) const FROM: usize = 1 << 23;

/// Appends `f(a[i], b[i])` to `out` for every `i` of the shorter of the two, for a result
/// that will hold `whole` elements: from [`FROM`] on, with stores that bypass the caches where
/// the processor has them ([`streamed`]); the usual way below. The values are the same either
/// way.
pub(crate) fn extend_zip(
    out: &mut Vec<f32>,
    a: &[f32],
    b: &[f32],
    whole: usize,
    f: impl Fn(f32, f32) -> f32,
) {
    if whole < FROM {
        out.extend(a.iter().zip(b).map(|(&x, &y)| f(x, y)));
        return;
    }
    let n = a.len().min(b.len());
    out.reserve(n);
    let at = out.len();
    streamed(&mut out.spare_capacity_mut()[..n], a, b, f);
    // SAFETY: `streamed` wrote all `n` values past the old length, within the capacity
    // reserved above.
    unsafe { out.set_len(at + n) }
}

/// Appends `src` to `out`, a result that will hold `whole` elements, as [`extend_zip`] does.
pub(crate) fn extend_copy(out: &mut Vec<f32>, src: &[f32], whole: usize) {
    if whole < FROM {
        out.extend_from_slice(src);
    } else {
        // The second operand is the first again: read from the line just loaded, and unused.
        extend_zip(out, src, src, whole, |x, _| x);
    }
}

/// Overwrites `dst` with `src` (as long as `dst`), part of a result of `whole` elements, as
/// [`extend_zip`] does.
pub(crate) fn copy_into(dst: &mut [f32], src: &[f32], whole: usize) {
    if whole < FROM {
        dst.copy_from_slice(&src[..dst.len()]);
    } else {
        zip_into(dst, src, src, whole, |x, _| x);
    }
}

/// Overwrites every `dst[i]` with `f(a[i], b[i])` (`a` and `b` at least as long as `dst`),
/// part of a result of `whole` elements, as [`extend_zip`] does.
pub(crate) fn zip_into(
    dst: &mut [f32],
    a: &[f32],
    b: &[f32],
    whole: usize,
    f: impl Fn(f32, f32) -> f32,
) {
    let (a, b) = (&a[..dst.len()], &b[..dst.len()]);
    if whole < FROM {
        for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
            *d = f(x, y);
        }
        return;
    }
    // SAFETY: `f32` and `MaybeUninit<f32>` have the same layout, and only initialized
    // values are written through the cast (every element of `dst`, by `streamed`).
    let dst = unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
    streamed(dst, a, b, f);
}

/// Elements written per group of streaming stores: 64 bytes, a cache line's worth.
#[cfg(target_arch = "x86_64")]
const LINE: usize = 16;

/// Writes `f(a[i], b[i])` to every `dst[i]` (`a` and `b` at least as long as `dst`), with
/// stores that bypass the caches. The values are those of a plain loop, bit for bit (NaN
/// payloads aside, as for any sum): only how they reach memory differs. `f` must not panic.
/// Once it returns, the stores are ordered before any later store of this thread, so a
/// buffer handed on after it is seen whole.
#[cfg(target_arch = "x86_64")]
fn streamed(dst: &mut [MaybeUninit<f32>], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    use std::arch::x86_64::{_mm_loadu_ps, _mm_sfence, _mm_stream_ps};

    let n = dst.len();
    let (a, b) = (&a[..n], &b[..n]);
    // A streaming store needs a 16-byte aligned address: the first few values go the usual
    // way (an `f32` slice is 4-byte aligned, so at most three of them).
    let head = ((16 - dst.as_ptr() as usize % 16) % 16 / 4).min(n);
    let lines = (n - head) / LINE * LINE;
    let tail = head + lines;
    for i in (0..head).chain(tail..n) {
        dst[i].write(f(a[i], b[i]));
    }
    let body = dst[head..tail].chunks_exact_mut(LINE);
    for ((out, x), y) in body
        .zip(a[head..tail].chunks_exact(LINE))
        .zip(b[head..tail].chunks_exact(LINE))
    {
        let mut line = [0.0f32; LINE];
        for ((v, &x), &y) in line.iter_mut().zip(x).zip(y) {
            *v = f(x, y);
        }
        // SAFETY: `out` is `LINE` elements of `dst`, 16-byte aligned (the head above, then
        // whole lines), as `_mm_stream_ps` requires; `line` is read unaligned. SSE is part of
        // every x86_64 processor.
        unsafe {
            let p = out.as_mut_ptr().cast::<f32>();
            debug_assert!((p as usize).is_multiple_of(16));
            for q in 0..LINE / 4 {
                _mm_stream_ps(p.add(4 * q), _mm_loadu_ps(line.as_ptr().add(4 * q)));
            }
        }
    }
    // SAFETY: SSE is part of every x86_64 processor. Streaming stores are weakly ordered:
    // without the fence another thread could be handed the buffer before all of them land.
    unsafe { _mm_sfence() }
}

/// Writes `f(a[i], b[i])` to every `dst[i]` (no streaming stores on this architecture).
#[cfg(not(target_arch = "x86_64"))]
fn streamed(dst: &mut [MaybeUninit<f32>], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
        d.write(f(x, y));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::Reduce;

    /// Values with the special ones (NaNs, both zeros, infinities) among them, unrelated from
    /// one `salt` to another.
    fn values(n: usize, salt: u32) -> Vec<f32> {
        let special = [
            f32::NAN,
            -0.0,
            0.0,
            f32::INFINITY,
            -f32::NAN,
            f32::MIN_POSITIVE,
        ];
        (0..n)
            .map(|i| {
                let k = (i as u32 ^ salt.wrapping_mul(0x9e37_79b9)).wrapping_mul(2_654_435_761);
                if k.is_multiple_of(5) {
                    special[(k / 5) as usize % special.len()]
                } else {
                    f32::from_bits(k % 0x7f00_0000) - 1e-3 * i as f32
                }
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `start` extended by `a op b` the usual way, and around the caches.
    fn plain_and_streamed(op: Reduce, start: &[f32], a: &[f32], b: &[f32]) -> [Vec<f32>; 2] {
        let mut plain = start.to_vec();
        op.extend(&mut plain, a, b);
        let mut streamed = start.to_vec();
        op.extend_for(&mut streamed, a, b, FROM);
        [plain, streamed]
    }

    #[test]
    fn the_values_are_those_of_a_plain_extend_at_every_alignment_and_length() {
        for len in [0, 1, 3, 4, 15, 16, 17, 31, 64, 1000, 4099] {
            let (a, b) = (values(len + 3, 1), values(len, 2));
            for already in 0..5 {
                let start = values(already, 3);
                // A maximum picks one operand's bits, NaNs included; a sum of two NaNs may
                // carry either payload, so the sum is compared on the other pairs only.
                let [plain, streamed] = plain_and_streamed(Reduce::Max, &start, &a, &b);
                assert_eq!(
                    bits(&streamed),
                    bits(&plain),
                    "max of {len}, {already} before"
                );
                let a: Vec<f32> = a
                    .iter()
                    .map(|x| if x.is_nan() { 1.5 } else { *x })
                    .collect();
                let [plain, streamed] = plain_and_streamed(Reduce::Sum, &start, &a, &b);
                assert_eq!(
                    bits(&streamed),
                    bits(&plain),
                    "sum of {len}, {already} before"
                );
                let mut copied = start.clone();
                extend_copy(&mut copied, &b, FROM);
                let mut want = start.clone();
                want.extend_from_slice(&b);
                assert_eq!(
                    bits(&copied),
                    bits(&want),
                    "copy of {len}, {already} before"
                );
                // Overwritten in place, from the same offsets.
                let mut over = values(already + len + 2, 4);
                copy_into(&mut over[already..already + len], &b, FROM);
                let mut want = values(already + len + 2, 4);
                want[already..already + len].copy_from_slice(&b);
                assert_eq!(bits(&over), bits(&want), "overwrite of {len} at {already}");
            }
        }
    }

    #[test]
    fn every_pair_of_special_values_combines_as_it_does_plainly() {
        let special = [
            f32::NAN,
            -f32::NAN,
            -0.0,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            -1.0,
        ];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for &x in &special {
            for &y in &special {
                a.push(x);
                b.push(y);
            }
        }
        let [plain, streamed] = plain_and_streamed(Reduce::Max, &[], &a, &b);
        assert_eq!(bits(&streamed), bits(&plain));
        let [plain, streamed] = plain_and_streamed(Reduce::Sum, &[], &a, &b);
        for (i, (s, p)) in streamed.iter().zip(&plain).enumerate() {
            let both_nan = a[i].is_nan() && b[i].is_nan();
            assert!(
                s.to_bits() == p.to_bits() || (both_nan && s.is_nan()),
                "{i}"
            );
        }
    }
}
