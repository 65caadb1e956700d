//! Optional per-frame integrity ([`super::TcpConfig::frame_integrity`]): every frame after the
//! handshake carries an HMAC-SHA256 tag under the connection's session key, over the frame's
//! bytes and its number in that direction, so a frame altered, dropped, replayed or reordered
//! on the way is detected and the connection reported lost. Nothing is encrypted.

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::handshake::Session;

/// Bytes of a frame's tag.
pub(super) const TAG_BYTES: usize = 32;

/// The key and direction of one end of a connection, and how many frames it has tagged.
pub(super) struct FrameMac {
    key: [u8; 32],
    label: &'static [u8],
    count: u64,
}

impl FrameMac {
    /// The tags this end writes on `session`'s connection.
    pub(super) fn sending(session: &Session) -> FrameMac {
        let (key, label) = session.frame_key(true);
        FrameMac {
            key,
            label,
            count: 0,
        }
    }

    /// The tags this end checks on `session`'s connection.
    pub(super) fn receiving(session: &Session) -> FrameMac {
        let (key, label) = session.frame_key(false);
        FrameMac {
            key,
            label,
            count: 0,
        }
    }

    fn next(&mut self) -> Hmac<Sha256> {
        // HMAC takes keys of any length.
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.key).unwrap_or_else(|_| unreachable!());
        m.update(self.label);
        m.update(&self.count.to_le_bytes());
        self.count += 1;
        m
    }
}

/// A writer that feeds what passes through it into a MAC; its `flush` waits for the tag.
pub(super) struct Tee<'a, W: Write> {
    inner: &'a mut W,
    mac: Hmac<Sha256>,
}

impl<'a, W: Write> Tee<'a, W> {
    /// Starts the next frame's tag.
    pub(super) fn new(inner: &'a mut W, mac: &mut FrameMac) -> Tee<'a, W> {
        Tee {
            inner,
            mac: mac.next(),
        }
    }

    /// Writes the tag after the frame and flushes.
    pub(super) fn finish(self) -> std::io::Result<()> {
        let tag = self.mac.finalize().into_bytes();
        self.inner.write_all(&tag)?;
        self.inner.flush()
    }
}

impl<W: Write> Write for Tee<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.mac.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        // The frame is not complete before its tag.
        Ok(())
    }
}

/// A reader that feeds what it reads into a MAC.
pub(super) struct Check<'a, R: Read> {
    inner: &'a mut R,
    mac: Hmac<Sha256>,
}

impl<'a, R: Read> Check<'a, R> {
    /// Starts checking the next frame.
    pub(super) fn new(inner: &'a mut R, mac: &mut FrameMac) -> Check<'a, R> {
        Check {
            inner,
            mac: mac.next(),
        }
    }

    /// Reads the tag that follows the frame; true when it matches what was read.
    pub(super) fn verify(self) -> std::io::Result<bool> {
        let mut tag = [0u8; TAG_BYTES];
        self.inner.read_exact(&mut tag)?;
        Ok(self.mac.verify_slice(&tag).is_ok())
    }
}

impl<R: Read> Read for Check<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.mac.update(&buf[..n]);
        Ok(n)
    }
}
