//! Length-prefixed frames for byte-stream transports.
//!
//! Layout (little-endian): `u32 body_len`, then the body: `u8 kind`, `u8 flags` (bit 0: virtual
//! payload), `u16 step`, `u32 from`, `u64 seq`, `u64 total_len`, `f64 weight`, `u64 aux`,
//! `u32 n`, `n` contributions of `u32 rank, u64 steps`, then the payload: `f32` values, or for a
//! virtual payload a `u64` length. A body larger than the configured maximum is refused before
//! anything is allocated. A payload is received into a buffer the pool already holds, or else
//! filled chunk by chunk as its bytes arrive (a payload of up to 256 MiB reserves its address
//! space up front, which costs nothing until written), so a frame that announces much and sends
//! little makes the reader touch no more new memory than the bytes actually sent. (A payload
//! that the receiver asked to be laid out in a buffer for a larger whole, see [`Place`], is the
//! exception: that buffer, as large as the receiver's own, is taken whole before the payload
//! is read; its size is the receiver's, not the sender's to choose.) A virtual
//! length is bounded like a payload (at most the maximum body in bytes), so it cannot overflow;
//! the transports decide whether they carry virtual payloads at all (TCP does not, beyond the
//! empty one of control messages). A reader may also fold a payload into the receiver's own
//! part as it arrives ([`read_frame_folding`]): each piece is read into a small scratch buffer
//! that stays in cache and combined from there, so the received values are never written to
//! memory on their own and read back for the sum.

use std::io::{Read, Write};

use super::{Contribution, Delivery, Envelope, Fold, FoldInto, Kind, Meta, Tag};
use crate::Rank;
use crate::error::TransportError;
use crate::payload::{Payload, Place, Reduce, pool};

/// Bytes of the fixed part of a body.
pub const HEADER_BYTES: usize = 1 + 1 + 2 + 4 + 8 + 8 + 8 + 8 + 4;
const CONTRIBUTION_BYTES: usize = 12;
const FLAG_VIRTUAL: u8 = 1;
/// Largest chunk read at once into a payload.
const CHUNK: usize = 1 << 22;
/// Payloads up to this many bytes get their whole buffer reserved (not touched) before
/// reading, so that it never moves as it fills; larger ones grow as they arrive.
const RESERVE_LIMIT: usize = 1 << 28;

#[cfg(target_endian = "big")]
compile_error!(
    "the wire format writes f32 payloads in native order and assumes little-endian hosts"
);

/// The length of `env`'s frame body, or why it cannot be sent: larger than `max` (or than a
/// frame's length field holds), or a virtual length beyond what a frame may declare.
pub fn check_size(env: &Envelope, max: u64) -> Result<u64, TransportError> {
    let n = env.meta.contributions.len();
    let payload_bytes = match &env.data {
        Payload::Size(len) => {
            check_virtual(*len, max)?;
            8
        }
        data => data.len() * 4,
    };
    let body = (HEADER_BYTES + n * CONTRIBUTION_BYTES + payload_bytes) as u64;
    if body > max || body > u64::from(u32::MAX) {
        return Err(TransportError::FrameTooLarge {
            size: body,
            max: max.min(u64::from(u32::MAX)),
        });
    }
    Ok(body)
}

/// Writes `env` as one frame; fails with `FrameTooLarge` above `max` body bytes.
pub fn write_frame<W: Write>(w: &mut W, env: &Envelope, max: u64) -> Result<(), TransportError> {
    let n = env.meta.contributions.len();
    let body = check_size(env, max)?;
    let mut head = Vec::with_capacity(4 + HEADER_BYTES + n * CONTRIBUTION_BYTES);
    head.extend_from_slice(&(body as u32).to_le_bytes());
    head.push(env.tag.kind as u8);
    head.push(if env.data.is_virtual() {
        FLAG_VIRTUAL
    } else {
        0
    });
    head.extend_from_slice(&env.tag.step.to_le_bytes());
    head.extend_from_slice(&(env.from as u32).to_le_bytes());
    head.extend_from_slice(&env.tag.seq.to_le_bytes());
    head.extend_from_slice(&env.meta.total_len.to_le_bytes());
    head.extend_from_slice(&env.meta.weight.to_le_bytes());
    head.extend_from_slice(&env.meta.aux.to_le_bytes());
    head.extend_from_slice(&(n as u32).to_le_bytes());
    for c in env.meta.contributions.iter() {
        head.extend_from_slice(&(c.rank as u32).to_le_bytes());
        head.extend_from_slice(&c.steps.to_le_bytes());
    }
    let io = |e: std::io::Error| TransportError::io("writing a frame", &e);
    match &env.data {
        Payload::Size(len) => {
            head.extend_from_slice(&(*len as u64).to_le_bytes());
            w.write_all(&head).map_err(io)?;
        }
        data => {
            w.write_all(&head).map_err(io)?;
            w.write_all(bytemuck::cast_slice(data.as_slice()))
                .map_err(io)?;
        }
    }
    w.flush().map_err(io)
}

/// Reads one frame. `Ok(None)` on a clean end of stream before a frame starts.
pub fn read_frame<R: Read>(r: &mut R, max: u64) -> Result<Option<Envelope>, TransportError> {
    read_frame_folding(r, max, &mut Vec::new(), |_, _| None).map(|d| d.map(|d| d.env))
}

/// Like [`read_frame`], but once the header is read `fold` is called with the sender and the
/// tag; if it returns a [`Fold`] whose own part is still held and as long as the payload, the
/// payload is combined with that part piece by piece as it arrives (each piece is read into
/// `scratch`, small enough to stay in cache, and combined from there into the result, so the
/// received values never travel through memory on their own) and the delivery has
/// [`Delivery::folded`] set. A [`FoldInto::Place`] as long as the payload has it read into
/// place. Otherwise the payload is read whole.
pub fn read_frame_folding<R: Read>(
    r: &mut R,
    max: u64,
    scratch: &mut Vec<f32>,
    fold: impl FnOnce(Rank, &Tag) -> Option<Fold>,
) -> Result<Option<Delivery>, TransportError> {
    let mut len = [0u8; 4];
    match read_full(r, &mut len)? {
        0 => return Ok(None),
        4 => {}
        _ => {
            return Err(TransportError::Malformed(
                "stream ended inside a frame length".into(),
            ));
        }
    }
    let body = u64::from(u32::from_le_bytes(len));
    if body > max {
        return Err(TransportError::FrameTooLarge { size: body, max });
    }
    let body = body as usize;
    if body < HEADER_BYTES {
        return Err(TransportError::Malformed(format!(
            "frame of {body} bytes is shorter than its header"
        )));
    }
    let mut h = [0u8; HEADER_BYTES];
    exact(r, &mut h)?;
    let mut c = Cursor(&h);
    let code = c.u8();
    let kind = Kind::from_code(code)
        .ok_or_else(|| TransportError::Malformed(format!("unknown kind {code}")))?;
    let flags = c.u8();
    if flags & !FLAG_VIRTUAL != 0 {
        return Err(TransportError::Malformed(format!(
            "unknown flags {flags:#x}"
        )));
    }
    let step = c.u16();
    let from = c.u32() as usize;
    let seq = c.u64();
    let total_len = c.u64();
    let weight = c.f64();
    let aux = c.u64();
    let n = c.u32() as usize;
    let rest = body - HEADER_BYTES;
    let contrib_bytes = n
        .checked_mul(CONTRIBUTION_BYTES)
        .filter(|&b| b <= rest)
        .ok_or_else(|| {
            TransportError::Malformed(format!("{n} contributions do not fit the frame"))
        })?;
    let mut contributions = Vec::with_capacity(n.min(1024));
    let mut cb = [0u8; CONTRIBUTION_BYTES];
    for _ in 0..n {
        exact(r, &mut cb)?;
        let mut c = Cursor(&cb);
        contributions.push(Contribution {
            rank: c.u32() as usize,
            steps: c.u64(),
        });
    }
    let payload_bytes = rest - contrib_bytes;
    let tag = Tag { kind, seq, step };
    let mut folded = false;
    let data = if flags & FLAG_VIRTUAL != 0 {
        if payload_bytes != 8 {
            return Err(TransportError::Malformed(
                "virtual payload without its length".into(),
            ));
        }
        let mut b = [0u8; 8];
        exact(r, &mut b)?;
        let len = usize::try_from(u64::from_le_bytes(b))
            .map_err(|_| TransportError::Malformed("virtual length overflows".into()))?;
        check_virtual(len, max)?;
        Payload::Size(len)
    } else {
        if !payload_bytes.is_multiple_of(4) {
            return Err(TransportError::Malformed(format!(
                "payload of {payload_bytes} bytes is not whole f32s"
            )));
        }
        let count = payload_bytes / 4;
        match fold(from, &tag).map(|f| f.into) {
            Some(FoldInto::Own { own, op, layout }) if own.len() == count => match own.upgrade() {
                Some(own) => {
                    folded = true;
                    let layout = layout.filter(|l| l.range().len() == count);
                    read_folded(r, own.as_slice(), op, scratch, layout)?
                }
                None => Payload::Data(read_values(r, count)?),
            },
            Some(FoldInto::Place(place)) if place.range().len() == count => {
                let mut target = place.target();
                exact(r, bytemuck::cast_slice_mut(target.values()))?;
                target.into_payload()
            }
            _ => Payload::Data(read_values(r, count)?),
        }
    };
    let env = Envelope {
        from,
        tag,
        meta: Meta {
            total_len,
            weight,
            aux,
            contributions: contributions.into(),
        },
        data,
    };
    Ok(Some(Delivery { env, folded }))
}

/// Elements of a piece that a folded payload is read in (1 MiB: within a core's L2 cache).
const FOLD_PIECE: usize = 1 << 18;

/// `own op payload`, the payload read piece by piece into `scratch`; laid out as `layout`
/// says, if given.
fn read_folded<R: Read>(
    r: &mut R,
    own: &[f32],
    op: Reduce,
    scratch: &mut Vec<f32>,
    layout: Option<Place>,
) -> Result<Payload, TransportError> {
    let whole = own.len();
    let Some(layout) = layout else {
        // Reserved, not touched: a peer that announces much and sends little makes this
        // reader write no more than it sent.
        let mut out = pool::take(whole);
        read_pieces(r, own, scratch, |_, mine, theirs| {
            op.extend_for(&mut out, mine, theirs, whole);
        })?;
        return Ok(Payload::Data(out));
    };
    let mut target = layout.fresh();
    let out = target.values();
    read_pieces(r, own, scratch, |at, mine, theirs| {
        op.zip_into(&mut out[at..at + mine.len()], mine, theirs, whole);
    })?;
    Ok(target.into_payload())
}

/// Reads the payload piece by piece into `scratch` and hands each piece to `combine` with
/// its offset and the part of `own` it goes with.
fn read_pieces<R: Read>(
    r: &mut R,
    own: &[f32],
    scratch: &mut Vec<f32>,
    mut combine: impl FnMut(usize, &[f32], &[f32]),
) -> Result<(), TransportError> {
    scratch.resize(FOLD_PIECE.min(own.len()), 0.0);
    for (i, mine) in own.chunks(FOLD_PIECE).enumerate() {
        let piece = &mut scratch[..mine.len()];
        exact(r, bytemuck::cast_slice_mut(piece))?;
        combine(i * FOLD_PIECE, mine, piece);
    }
    Ok(())
}

/// `count` values read whole.
fn read_values<R: Read>(r: &mut R, count: usize) -> Result<Vec<f32>, TransportError> {
    // The common case: a buffer of this size came back to the pool after an earlier round,
    // and is received into whole; its values are overwritten in full (or it is dropped on
    // error), so it need not be cleared. Otherwise memory is touched only as bytes arrive.
    let mut v: Vec<f32> = if count * 4 > RESERVE_LIMIT {
        Vec::with_capacity(CHUNK / 4)
    } else if let Some(mut v) = pool::take_recycled(count) {
        exact(r, bytemuck::cast_slice_mut(&mut v))?;
        v
    } else {
        Vec::with_capacity(count)
    };
    while v.len() < count {
        let at = v.len();
        let take = (count - at).min(CHUNK / 4);
        v.resize(at + take, 0.0);
        exact(r, bytemuck::cast_slice_mut(&mut v[at..]))?;
    }
    Ok(v)
}

/// A virtual payload of `len` values may stand for no more bytes than a frame may hold.
fn check_virtual(len: usize, max: u64) -> Result<(), TransportError> {
    let size = (len as u64).saturating_mul(4);
    if size > max {
        return Err(TransportError::FrameTooLarge { size, max });
    }
    Ok(())
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, TransportError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TransportError::io("reading a frame", &e)),
        }
    }
    Ok(got)
}

fn exact<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<(), TransportError> {
    if read_full(r, buf)? == buf.len() {
        Ok(())
    } else {
        Err(TransportError::Malformed(
            "stream ended inside a frame".into(),
        ))
    }
}

/// Reads fixed-size little-endian fields from a buffer whose size was checked by the caller.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.0[..N]);
        self.0 = &self.0[N..];
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
    fn f64(&mut self) -> f64 {
        f64::from_le_bytes(self.take())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample(data: Payload) -> Envelope {
        Envelope {
            from: 3,
            tag: Tag {
                kind: Kind::Round,
                seq: 77,
                step: 2,
            },
            meta: Meta {
                total_len: 9,
                weight: 0.25,
                aux: 5,
                contributions: vec![
                    Contribution { rank: 1, steps: 4 },
                    Contribution { rank: 3, steps: 8 },
                ]
                .into(),
            },
            data,
        }
    }

    #[test]
    fn a_result_written_around_the_caches_has_the_same_bits() {
        let n = crate::uncached::FROM + 5;
        let theirs: Vec<f32> = (0..n).map(|i| (i % 1013) as f32 * -0.25).collect();
        let mut mine = Payload::Data((0..n).map(|i| (i % 7) as f32 * 1e-3).collect());
        let own = mine.view(0..n);
        let mut bytes = Vec::new();
        write_frame(&mut bytes, &sample(Payload::Data(theirs.clone())), u64::MAX).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Laid out in a buffer of its own, or at the end of a buffer for a larger whole.
        for layout in [None, Some(Place::new(7..7 + n, n + 7))] {
            for op in [Reduce::Sum, Reduce::Max] {
                let weak = own.downgrade();
                let (offset, room) = layout
                    .as_ref()
                    .map_or((0, n), |l| (l.range().start, l.room()));
                let layout = layout.clone();
                let got = read_frame_folding(&mut &bytes[..], u64::MAX, &mut Vec::new(), |_, t| {
                    Some(Fold {
                        tag: *t,
                        into: FoldInto::Own {
                            own: weak?,
                            op,
                            layout,
                        },
                    })
                })
                .unwrap()
                .unwrap();
                assert!(got.folded);
                let mut want = Vec::new();
                op.extend(&mut want, own.as_slice(), &theirs);
                assert!(bits(got.env.data.as_slice()) == bits(&want), "{op:?}");
                let at = got.env.data.placed_room().map(|(at, r)| (at, r >= room));
                assert_eq!(at, Some((offset, true)), "{op:?}");
            }
        }
    }

    #[test]
    fn a_payload_is_folded_piece_by_piece_only_when_its_part_is_still_held() {
        // More than one piece, and a last piece shorter than the others.
        let n = FOLD_PIECE * 2 + 3;
        let theirs: Vec<f32> = (0..n).map(|i| (i % 977) as f32 * 0.5).collect();
        let mut bytes = Vec::new();
        write_frame(&mut bytes, &sample(Payload::Data(theirs.clone())), u64::MAX).unwrap();
        let mut mine = Payload::Data((0..n).map(|i| (i % 13) as f32 - 6.0).collect());
        let own = mine.view(0..n);
        let tag = sample(Payload::Size(0)).tag;
        let ask = |op, other: Option<Tag>| {
            let own = own.downgrade();
            move |from: Rank, t: &Tag| {
                assert_eq!((from, *t), (3, tag));
                Some(Fold {
                    tag: other.unwrap_or(*t),
                    into: FoldInto::Own {
                        own: own?,
                        op,
                        layout: None,
                    },
                })
            }
        };
        let mut scratch = Vec::new();
        for op in [Reduce::Sum, Reduce::Max] {
            let got = read_frame_folding(&mut &bytes[..], u64::MAX, &mut scratch, ask(op, None))
                .unwrap()
                .unwrap();
            assert!(got.folded);
            let mut want = Vec::new();
            op.extend(&mut want, own.as_slice(), &theirs);
            assert_eq!(got.env.data.as_slice(), &want[..], "{op:?}");
            assert_eq!(got.env.meta.weight, 0.25);
        }
        // A part of another length is not used: the payload arrives as it was sent.
        let short = mine.view(0..n - 1).downgrade();
        let got = read_frame_folding(&mut &bytes[..], u64::MAX, &mut scratch, |_, t: &Tag| {
            Some(Fold {
                tag: *t,
                into: FoldInto::Own {
                    own: short?,
                    op: Reduce::Sum,
                    layout: None,
                },
            })
        })
        .unwrap()
        .unwrap();
        assert!(!got.folded);
        assert_eq!(got.env.data.as_slice(), &theirs[..]);
        // A stream that ends inside a piece is an error, not a partial sum.
        let cut = &bytes[..bytes.len() - 4 * (FOLD_PIECE + 1)];
        let err = read_frame_folding(
            &mut &cut[..],
            u64::MAX,
            &mut scratch,
            ask(Reduce::Sum, None),
        );
        assert!(matches!(err, Err(TransportError::Malformed(_))), "{err:?}");
        // Once nothing holds the part, the payload arrives whole.
        let weak = ask(Reduce::Sum, None);
        drop(own);
        drop(mine);
        let got = read_frame_folding(&mut &bytes[..], u64::MAX, &mut scratch, weak)
            .unwrap()
            .unwrap();
        assert!(!got.folded);
        assert_eq!(got.env.data.as_slice(), &theirs[..]);
    }

    #[test]
    fn round_trip() {
        for data in [
            Payload::Data(vec![1.5, -2.0, 3.25]),
            Payload::Size(1 << 18),
            Payload::Data(vec![]),
        ] {
            let env = sample(data);
            let mut buf = Vec::new();
            write_frame(&mut buf, &env, 1 << 20).unwrap();
            let back = read_frame(&mut buf.as_slice(), 1 << 20).unwrap().unwrap();
            assert_eq!(back, env);
        }
        assert!(read_frame(&mut [].as_slice(), 10).unwrap().is_none());
    }

    #[test]
    fn virtual_lengths_are_bounded_like_payloads() {
        let huge = sample(Payload::Size(usize::MAX));
        assert!(matches!(
            write_frame(&mut Vec::new(), &huge, 1 << 20),
            Err(TransportError::FrameTooLarge { .. })
        ));
        // A peer that declares a virtual length beyond the maximum is refused.
        let mut buf = Vec::new();
        write_frame(&mut buf, &sample(Payload::Size(4)), 1 << 20).unwrap();
        let at = buf.len() - 8;
        buf[at..].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            read_frame(&mut buf.as_slice(), 1 << 20),
            Err(TransportError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn a_payload_is_received_whole_with_or_without_a_recycled_buffer() {
        // Lengths no other test uses, above the pool's minimum and more than one chunk long.
        for len in [(CHUNK / 4) * 2 + 13, (CHUNK / 4) * 2 + 17] {
            let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let env = sample(Payload::Data(values));
            let mut buf = Vec::new();
            write_frame(&mut buf, &env, u64::MAX).unwrap();
            // Without a buffer of this size in the pool, then with one that holds garbage.
            assert!(!crate::payload::pool::holds(len));
            let back = read_frame(&mut buf.as_slice(), u64::MAX).unwrap().unwrap();
            assert_eq!(back, env);
            crate::payload::pool::give(vec![f32::NAN; len]);
            let again = read_frame(&mut buf.as_slice(), u64::MAX).unwrap().unwrap();
            assert_eq!(again, env);
            // A frame cut short is an error, whichever way it was being received.
            crate::payload::pool::give(vec![f32::NAN; len]);
            let cut = &buf[..buf.len() - 5];
            assert!(read_frame(&mut &cut[..], u64::MAX).is_err());
            assert!(read_frame(&mut &cut[..], u64::MAX).is_err());
        }
    }

    #[test]
    fn oversized_frames_are_refused() {
        let env = sample(Payload::Data(vec![0.0; 100]));
        assert!(matches!(
            write_frame(&mut Vec::new(), &env, 100),
            Err(TransportError::FrameTooLarge { .. })
        ));
        let mut buf = Vec::new();
        write_frame(&mut buf, &env, 1 << 20).unwrap();
        assert!(matches!(
            read_frame(&mut buf.as_slice(), 100),
            Err(TransportError::FrameTooLarge { size, max: 100 }) if size > 100
        ));
    }

    proptest! {
        /// Arbitrary bytes never panic the decoder; they give frames or typed errors.
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut r = bytes.as_slice();
            for _ in 0..8 {
                match read_frame(&mut r, 1 << 16) {
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                }
            }
        }

        /// Valid frames with corrupted bytes never panic either.
        #[test]
        fn corrupted_frames_never_panic(pos in 0usize..200, val in any::<u8>(), len in 0usize..20) {
            let mut buf = Vec::new();
            write_frame(&mut buf, &sample(Payload::Data(vec![1.0; len])), 1 << 20).unwrap();
            let i = pos % buf.len();
            buf[i] = val;
            let _ = read_frame(&mut buf.as_slice(), 1 << 20);
        }
    }
}
