//! Mutual authentication of a connection on the job's id and shared secret, agreement on
//! whether its frames carry integrity tags, and the sealed messages that follow it.
//!
//! The caller proves first: it names its rank, whether its frames carry integrity tags
//! ([`super::TcpConfig::frame_integrity`]) and a fresh nonce; the acceptor answers with its rank
//! and nonce (and nothing derived from the secret or from its own settings), the caller sends
//! `HMAC(secret, "connector", job, both nonces, both ranks, its setting)`, and only if that
//! verifies does the acceptor answer with anything else. A wrong job id and a wrong secret get
//! the same one-word refusal, so a caller learns nothing before it has proven the secret, and
//! holds no tag to test guesses against offline. (The caller's proof does go to whoever answers
//! at the address it calls, which could test guesses against it: the secret must be long and
//! random, and a job beyond loopback warns about a short one.)
//!
//! A proven caller whose setting differs from the acceptor's gets a distinct answer, which names
//! the acceptor's setting and is tagged with the secret, and both ends fail with an error that
//! names the setting: one end would otherwise read the other's tags as frame headers. Because
//! the setting is part of what both proofs cover, a man in the middle who flips it only gets
//! the connection refused. Otherwise the acceptor proves itself the same way, and both sides
//! derive a per-connection key from the secret and both nonces; the messages of the start-up
//! (registrations, the address table, rejoin requests) are sealed with it, so they are bound
//! to the authenticated connection and cannot be replayed on another one. The secret never
//! crosses the wire.
//!
//! Every read and write of a handshake shares one deadline: a caller that trickles bytes
//! cannot hold a listener past it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use super::env;
use crate::Rank;
use crate::error::TransportError;

/// Version 03: the hello carries the caller's frame-integrity setting.
const MAGIC: &[u8; 8] = b"WAGMA/03";
const NONCE: usize = 32;
const TAG: usize = 32;
const MAX_MSG: usize = 4096;
/// The caller's hello: magic, rank, frame-integrity setting, nonce.
const HELLO: usize = MAGIC.len() + 4 + 1 + NONCE;
/// The first byte of a message that goes on with the handshake.
const GO_ON: u8 = 0;
/// The first byte of a refusal.
const REFUSAL: u8 = 1;
/// The first byte of the acceptor's answer to a proven caller that frames otherwise.
const DISAGREEMENT: u8 = 2;
/// The one answer to a failed proof: the same for a wrong job id and a wrong secret.
const REFUSED: &[u8] = b"refused";

/// Who the job is and what proves membership.
#[derive(Clone)]
pub struct Credentials {
    /// Job id: connections of another job are refused. It never travels in clear.
    pub job_id: String,
    /// Shared secret.
    pub secret: Vec<u8>,
}

impl Credentials {
    /// A fresh job id and a 256-bit secret from the operating system's random source, both as
    /// hex text (so that they can travel in environment variables).
    pub fn random() -> Result<Credentials, TransportError> {
        use rand::TryRngCore;
        let mut bytes = [0u8; 48];
        rand::rngs::OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| TransportError::Rendezvous(format!("the OS random source failed: {e}")))?;
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        Ok(Credentials {
            job_id: format!("job-{}", hex(&bytes[..16])),
            secret: hex(&bytes[16..]).into_bytes(),
        })
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("job_id", &self.job_id)
            .field("secret", &"<hidden>")
            .finish()
    }
}

/// What both ends of a connection must share: the job's credentials, and whether frames carry
/// integrity tags (which changes how every frame is read).
#[derive(Debug, Clone)]
pub(crate) struct Terms {
    /// Job id and secret.
    pub credentials: Credentials,
    /// Every frame carries an integrity tag ([`super::TcpConfig::frame_integrity`]).
    pub frame_integrity: bool,
}

/// A peer that proved the job's id and secret but disagrees with this rank on whether frames
/// carry integrity tags: neither could read the other's frames. Both ends learn of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Disagreement {
    /// This rank.
    pub me: Rank,
    /// The peer.
    pub peer: Rank,
    /// The peer's address, where known.
    pub at: Option<SocketAddr>,
    /// The peer tags its frames (and this rank does not), or the reverse.
    pub peer_tags: bool,
}

impl From<Disagreement> for TransportError {
    fn from(d: Disagreement) -> TransportError {
        let with = |tags: bool| if tags { "with" } else { "without" };
        let at = d.at.map(|a| format!(" at {a}")).unwrap_or_default();
        TransportError::Handshake(format!(
            "rank {}{at} frames {} integrity tags and rank {} {} them: set {} the same on every \
             rank",
            d.peer,
            with(d.peer_tags),
            d.me,
            with(!d.peer_tags),
            env::FRAME_INTEGRITY
        ))
    }
}

/// What an acceptor's handshake came to, short of a failure.
#[derive(Debug)]
pub(crate) enum Accepted {
    /// Both ends proved the job's credentials and agree: the connection is ready.
    Agreed(Session),
    /// The caller proved the job's credentials but disagrees; it has been told so.
    Disagrees(Disagreement),
}

/// The transcript both proofs and the session key cover.
struct Transcript<'a> {
    connector: Rank,
    acceptor: Rank,
    connector_nonce: &'a [u8],
    acceptor_nonce: &'a [u8],
    /// The caller's frame-integrity setting, as its hello says: covered by the proofs, so that
    /// flipping it on the way fails them.
    frame_integrity: bool,
}

fn keyed(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length, so this cannot fail; an empty key is a valid key.
    <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!())
}

fn transcript_mac(cred: &Credentials, label: &[u8], t: &Transcript<'_>) -> Hmac<Sha256> {
    let mut m = keyed(&cred.secret);
    m.update(label);
    m.update(&(cred.job_id.len() as u32).to_le_bytes());
    m.update(cred.job_id.as_bytes());
    m.update(t.connector_nonce);
    m.update(t.acceptor_nonce);
    m.update(&(t.connector as u64).to_le_bytes());
    m.update(&(t.acceptor as u64).to_le_bytes());
    m.update(&[u8::from(t.frame_integrity)]);
    m
}

/// The tag of an acceptor's disagreement, which names its own setting.
fn disagreement_mac(cred: &Credentials, t: &Transcript<'_>, acceptor_tags: bool) -> Hmac<Sha256> {
    let mut m = transcript_mac(cred, b"wagma disagreement", t);
    m.update(&[u8::from(acceptor_tags)]);
    m
}

fn proof(cred: &Credentials, label: &[u8], t: &Transcript<'_>) -> Vec<u8> {
    transcript_mac(cred, label, t)
        .finalize()
        .into_bytes()
        .to_vec()
}

fn verify(cred: &Credentials, label: &[u8], t: &Transcript<'_>, tag: &[u8]) -> bool {
    // Constant-time comparison.
    transcript_mac(cred, label, t).verify_slice(tag).is_ok()
}

/// A stream whose reads and writes all end by one deadline.
pub(crate) struct Deadlined<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl<'a> Deadlined<'a> {
    /// `stream`, with every operation limited by `deadline`.
    pub(crate) fn new(stream: &'a TcpStream, deadline: Instant) -> Deadlined<'a> {
        Deadlined { stream, deadline }
    }

    fn left(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(passed());
        }
        Ok(left)
    }
}

fn passed() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the handshake's deadline passed",
    )
}

/// A socket timeout is the deadline passing.
fn timed(r: std::io::Result<usize>) -> std::io::Result<usize> {
    match r {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Err(passed())
        }
        r => r,
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        timed((&mut &*self.stream).read(buf))
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        timed((&mut &*self.stream).write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        (&mut &*self.stream).flush()
    }
}

pub(crate) fn write_msg<W: Write>(w: &mut W, body: &[u8]) -> Result<(), TransportError> {
    let io = |e: std::io::Error| TransportError::io("handshake write", &e);
    let mut msg = Vec::with_capacity(4 + body.len());
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(body);
    w.write_all(&msg).map_err(io)?;
    w.flush().map_err(io)
}

pub(crate) fn read_msg<R: Read>(r: &mut R, max: usize) -> Result<Vec<u8>, TransportError> {
    let io = |e: std::io::Error| TransportError::io("handshake read", &e);
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(io)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(TransportError::Handshake(format!(
            "message of {len} bytes (max {max})"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(io)?;
    Ok(body)
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    rand::rng().fill_bytes(&mut n);
    n
}

fn rank_at(b: &[u8], at: usize) -> Rank {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as Rank
}

/// A setting as one byte on the wire: 0 or 1, anything else is another protocol.
fn flag(b: u8) -> Option<bool> {
    match b {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

/// Which end of a connection this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Connector,
    Acceptor,
}

/// An authenticated connection: the peer's rank and the key both ends derived for it.
pub(crate) struct Session {
    /// The peer's rank, as it proved it.
    pub peer: Rank,
    key: [u8; 32],
    side: Side,
    sent: u64,
    received: u64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("peer", &self.peer)
            .field("key", &"<hidden>")
            .finish()
    }
}

impl Session {
    fn new(cred: &Credentials, t: &Transcript<'_>, side: Side, peer: Rank) -> Session {
        let mut key = [0u8; 32];
        key.copy_from_slice(&proof(cred, b"wagma session key", t));
        Session {
            peer,
            key,
            side,
            sent: 0,
            received: 0,
        }
    }

    /// The key and direction label of the frames this end sends (`sending`) or receives.
    pub(crate) fn frame_key(&self, sending: bool) -> ([u8; 32], &'static [u8]) {
        let connector_sends = (self.side == Side::Connector) == sending;
        let label: &'static [u8] = if connector_sends {
            b"frames from connector"
        } else {
            b"frames from acceptor"
        };
        (self.key, label)
    }

    fn seal_mac(&self, from: Side, counter: u64, body: &[u8]) -> Hmac<Sha256> {
        let mut m = keyed(&self.key);
        m.update(match from {
            Side::Connector => b"from connector",
            Side::Acceptor => b"from acceptor.",
        });
        m.update(&counter.to_le_bytes());
        m.update(body);
        m
    }

    /// Sends `body` with a tag under the session key, numbered so that it cannot be replayed,
    /// reordered or reflected back.
    pub(crate) fn send<W: Write>(&mut self, w: &mut W, body: &[u8]) -> Result<(), TransportError> {
        let tag = self.seal_mac(self.side, self.sent, body).finalize();
        self.sent += 1;
        let mut msg = body.to_vec();
        msg.extend_from_slice(&tag.into_bytes());
        write_msg(w, &msg)
    }

    /// Receives a message sealed by the peer's [`Session::send`]; a forged, replayed or
    /// altered one is an error.
    pub(crate) fn recv<R: Read>(
        &mut self,
        r: &mut R,
        max: usize,
    ) -> Result<Vec<u8>, TransportError> {
        let mut msg = read_msg(r, max.saturating_add(TAG))?;
        if msg.len() < TAG {
            return Err(TransportError::Handshake("truncated sealed message".into()));
        }
        let tag = msg.split_off(msg.len() - TAG);
        let from = match self.side {
            Side::Connector => Side::Acceptor,
            Side::Acceptor => Side::Connector,
        };
        if self
            .seal_mac(from, self.received, &msg)
            .verify_slice(&tag)
            .is_err()
        {
            return Err(TransportError::Handshake(format!(
                "a message from rank {} does not carry this connection's seal",
                self.peer
            )));
        }
        self.received += 1;
        Ok(msg)
    }
}

/// The connecting side, as rank `me`. The acceptor's rank comes back in the session; an
/// acceptor that disagrees on the terms is an error naming the setting.
pub(crate) fn connect<S: Read + Write>(
    s: &mut S,
    me: Rank,
    terms: &Terms,
) -> Result<Session, TransportError> {
    let cred = &terms.credentials;
    let mine = nonce();
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(me as u32).to_le_bytes());
    hello.push(u8::from(terms.frame_integrity));
    hello.extend_from_slice(&mine);
    write_msg(s, &hello)?;
    let challenge = read_msg(s, MAX_MSG)?;
    if challenge.len() != 1 + 4 + NONCE || challenge[0] != GO_ON {
        return Err(refused_by_peer(&challenge));
    }
    let peer = rank_at(&challenge, 1);
    let t = Transcript {
        connector: me,
        acceptor: peer,
        connector_nonce: &mine,
        acceptor_nonce: &challenge[5..],
        frame_integrity: terms.frame_integrity,
    };
    let mut answer = vec![GO_ON];
    answer.extend_from_slice(&proof(cred, b"wagma connector", &t));
    write_msg(s, &answer)?;
    let result = read_msg(s, MAX_MSG)?;
    match result.split_first() {
        Some((&GO_ON, tag)) if tag.len() == TAG => {
            if !verify(cred, b"wagma acceptor", &t, tag) {
                return Err(TransportError::Handshake(format!(
                    "rank {peer} accepted without proving the job's id and secret"
                )));
            }
            Ok(Session::new(cred, &t, Side::Connector, peer))
        }
        Some((&DISAGREEMENT, body)) if body.len() == 1 + TAG => {
            // Believed only when tagged with the secret: a forged one would blame the setting
            // for what is really a broken or hostile connection.
            let proven = flag(body[0]).is_some_and(|tags| {
                tags != terms.frame_integrity
                    && disagreement_mac(cred, &t, tags)
                        .verify_slice(&body[1..])
                        .is_ok()
            });
            if !proven {
                return Err(TransportError::Handshake(format!(
                    "rank {peer} claimed to disagree on the frame format without proving the \
                     job's id and secret"
                )));
            }
            Err(Disagreement {
                me,
                peer,
                at: None,
                peer_tags: !terms.frame_integrity,
            }
            .into())
        }
        _ => Err(refused_by_peer(&result)),
    }
}

fn refused_by_peer(msg: &[u8]) -> TransportError {
    match msg.split_first() {
        Some((&REFUSAL, why)) => TransportError::Handshake(format!(
            "refused by the peer ({}): wrong job id or secret, or another protocol version",
            String::from_utf8_lossy(why)
        )),
        _ => TransportError::Handshake("malformed handshake message".into()),
    }
}

fn refuse<W: Write>(w: &mut W, reason: &str) -> TransportError {
    let mut body = vec![REFUSAL];
    body.extend_from_slice(REFUSED);
    let _ = write_msg(w, &body);
    TransportError::Handshake(reason.to_string())
}

/// The accepting side, as rank `me`: the session, or a caller that proved the job's
/// credentials but disagrees on the terms (and was told so).
pub(crate) fn accept<S: Read + Write>(
    s: &mut S,
    me: Rank,
    terms: &Terms,
) -> Result<Accepted, TransportError> {
    let cred = &terms.credentials;
    let hello = read_msg(s, MAX_MSG)?;
    let peer_tags = (hello.len() == HELLO && &hello[..MAGIC.len()] == MAGIC)
        .then(|| flag(hello[MAGIC.len() + 4]))
        .flatten();
    let Some(peer_tags) = peer_tags else {
        return Err(refuse(s, "not a wagma peer of this protocol version"));
    };
    let peer = rank_at(&hello, MAGIC.len());
    let theirs = &hello[MAGIC.len() + 5..];
    let mine = nonce();
    // Nothing about this rank's own setting yet: a caller learns it only once proven.
    let mut challenge = vec![GO_ON];
    challenge.extend_from_slice(&(me as u32).to_le_bytes());
    challenge.extend_from_slice(&mine);
    write_msg(s, &challenge)?;
    let t = Transcript {
        connector: peer,
        acceptor: me,
        connector_nonce: theirs,
        acceptor_nonce: &mine,
        frame_integrity: peer_tags,
    };
    let answer = read_msg(s, MAX_MSG)?;
    if answer.len() != 1 + TAG
        || answer[0] != GO_ON
        || !verify(cred, b"wagma connector", &t, &answer[1..])
    {
        return Err(refuse(
            s,
            &format!("a caller claiming rank {peer} did not prove the job's id and secret"),
        ));
    }
    if peer_tags != terms.frame_integrity {
        let mut result = vec![DISAGREEMENT, u8::from(terms.frame_integrity)];
        result.extend_from_slice(
            &disagreement_mac(cred, &t, terms.frame_integrity)
                .finalize()
                .into_bytes(),
        );
        // The caller proved itself, so the disagreement stands even if it cannot be told.
        let _ = write_msg(s, &result);
        return Ok(Accepted::Disagrees(Disagreement {
            me,
            peer,
            at: None,
            peer_tags,
        }));
    }
    let mut result = vec![GO_ON];
    result.extend_from_slice(&proof(cred, b"wagma acceptor", &t));
    write_msg(s, &result)?;
    Ok(Accepted::Agreed(Session::new(
        cred,
        &t,
        Side::Acceptor,
        peer,
    )))
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn terms(job: &str, secret: &str) -> Terms {
        tagged(job, secret, false)
    }

    fn tagged(job: &str, secret: &str, frame_integrity: bool) -> Terms {
        Terms {
            credentials: Credentials {
                job_id: job.into(),
                secret: secret.as_bytes().to_vec(),
            },
            frame_integrity,
        }
    }

    type Both = (
        Result<(Session, TcpStream), TransportError>,
        Result<(Accepted, TcpStream), TransportError>,
    );

    /// Rank 5 calls rank 0 over loopback, through a man in the middle who flips the caller's
    /// frame-integrity setting if `flip`.
    fn pair_through(a: Terms, b: Terms, flip: bool) -> Both {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, 0, &b).map(|x| (x, s))
        });
        let s = TcpStream::connect(addr).unwrap();
        let mut middle = FlipHello {
            s: &s,
            flip,
            written: 0,
        };
        let c = connect(&mut middle, 5, &a).map(|x| (x, s.try_clone().unwrap()));
        (c, t.join().unwrap())
    }

    fn pair(a: Terms, b: Terms) -> Both {
        pair_through(a, b, false)
    }

    /// The acceptor's session, where both ends agreed.
    fn agreed(a: Result<(Accepted, TcpStream), TransportError>) -> (Session, TcpStream) {
        match a.unwrap() {
            (Accepted::Agreed(session), s) => (session, s),
            (Accepted::Disagrees(d), _) => panic!("agreeing ends disagree: {d:?}"),
        }
    }

    /// A man in the middle that flips the frame-integrity byte of the caller's hello, or
    /// passes everything on unchanged.
    struct FlipHello<'a> {
        s: &'a TcpStream,
        flip: bool,
        written: usize,
    }

    impl Read for FlipHello<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            (&mut &*self.s).read(buf)
        }
    }

    impl Write for FlipHello<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            // After the hello's length prefix, magic and rank.
            let at = 4 + MAGIC.len() + 4;
            let mut b = buf.to_vec();
            let i = at.checked_sub(self.written).filter(|_| self.flip);
            if let Some(x) = i.and_then(|i| b.get_mut(i)) {
                *x ^= 1;
            }
            let n = (&mut &*self.s).write(&b)?;
            self.written += n;
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            (&mut &*self.s).flush()
        }
    }

    #[test]
    fn random_credentials_differ_and_are_text() {
        let (a, b) = (
            Credentials::random().unwrap(),
            Credentials::random().unwrap(),
        );
        assert_ne!(a.secret, b.secret);
        assert_ne!(a.job_id, b.job_id);
        assert_eq!(a.secret.len(), 64);
        assert!(a.secret.iter().all(u8::is_ascii_hexdigit));
    }

    #[test]
    fn matching_credentials_connect_and_seal() {
        let (c, a) = pair(terms("job", "s3cret"), terms("job", "s3cret"));
        let (mut c, mut cs) = c.unwrap();
        let (mut a, mut as_) = agreed(a);
        assert_eq!((c.peer, a.peer), (0, 5));
        c.send(&mut cs, b"registration").unwrap();
        c.send(&mut cs, b"second").unwrap();
        assert_eq!(a.recv(&mut as_, 64).unwrap(), b"registration");
        assert_eq!(a.recv(&mut as_, 64).unwrap(), b"second");
        a.send(&mut as_, b"table").unwrap();
        assert_eq!(c.recv(&mut cs, 64).unwrap(), b"table");
    }

    #[test]
    fn a_wrong_job_and_a_wrong_secret_get_the_same_answer() {
        let (c1, a1) = pair(terms("job", "guess"), terms("job", "s3cret"));
        let (c2, a2) = pair(terms("other", "s3cret"), terms("job", "s3cret"));
        for a in [&a1, &a2] {
            assert!(matches!(a, Err(TransportError::Handshake(_))));
        }
        let (e1, e2) = (c1.err().unwrap().to_string(), c2.err().unwrap().to_string());
        assert_eq!(e1, e2);
        assert!(e1.contains("refused"), "{e1}");
    }

    #[test]
    fn the_acceptor_reveals_nothing_before_the_caller_proves_the_secret() {
        // The challenge holds the acceptor's rank and a nonce, nothing keyed by the secret nor
        // its frame-integrity setting: acceptors of different secrets and settings send
        // challenges of the same form.
        for (secret, tags) in [("a", false), ("b", true)] {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let c = tagged("job", secret, tags);
            let t = std::thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                let _ = accept(&mut s, 3, &c);
            });
            let mut s = TcpStream::connect(addr).unwrap();
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&9u32.to_le_bytes());
            hello.push(0);
            hello.extend_from_slice(&[7u8; NONCE]);
            write_msg(&mut s, &hello).unwrap();
            let challenge = read_msg(&mut s, MAX_MSG).unwrap();
            assert_eq!(challenge.len(), 1 + 4 + NONCE);
            assert_eq!(rank_at(&challenge, 1), 3);
            drop(s);
            t.join().unwrap();
        }
    }

    #[test]
    fn a_sealed_message_is_bound_to_its_connection() {
        let (c, a) = pair(terms("job", "s3cret"), terms("job", "s3cret"));
        let (mut c, mut cs) = c.unwrap();
        let (mut a, mut as_) = agreed(a);
        // A message sealed on another connection of the same job is refused.
        let (c2, _a2) = pair(terms("job", "s3cret"), terms("job", "s3cret"));
        let (mut other, _) = c2.unwrap();
        let mut forged = Vec::new();
        other.send(&mut forged, b"registration").unwrap();
        cs.write_all(&forged).unwrap();
        let e = a.recv(&mut as_, 64).unwrap_err().to_string();
        assert!(e.contains("seal"), "{e}");
        // A message reflected back to its sender is refused too.
        let mut mine = Vec::new();
        c.send(&mut mine, b"hello").unwrap();
        as_.write_all(&mine).unwrap();
        assert!(c.recv(&mut cs, 64).is_err());
    }

    #[test]
    fn a_trickling_caller_is_cut_off_at_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut d = Deadlined::new(&s, Instant::now() + Duration::from_millis(300));
            accept(&mut d, 0, &terms("job", "s"))
        });
        let mut s = TcpStream::connect(addr).unwrap();
        // One byte every 100 ms: each read succeeds, the whole never completes in time.
        let mut hello = (HELLO as u32).to_le_bytes().to_vec();
        hello.extend_from_slice(MAGIC);
        for b in hello {
            if s.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let e = t.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("deadline"), "{e}");
    }

    #[test]
    fn ends_that_disagree_on_frame_integrity_both_name_the_setting() {
        for caller_tags in [true, false] {
            let (c, a) = pair(
                tagged("job", "s3cret", caller_tags),
                tagged("job", "s3cret", !caller_tags),
            );
            // Not the generic refusal: the caller proved itself and is told what differs.
            let e = c.err().unwrap();
            let with = |tags: bool| if tags { "with" } else { "without" };
            let want = format!(
                "rank 0 frames {} integrity tags and rank 5 {} them",
                with(!caller_tags),
                with(caller_tags)
            );
            let text = e.to_string();
            assert!(matches!(e, TransportError::Handshake(_)), "{text}");
            assert!(text.contains(&want), "{text}");
            assert!(text.contains(env::FRAME_INTEGRITY), "{text}");
            assert!(!text.contains("refused by the peer"), "{text}");
            let (Accepted::Disagrees(d), _) = a.unwrap() else {
                panic!("the acceptor agreed with a caller that frames otherwise");
            };
            let expected = Disagreement {
                me: 0,
                peer: 5,
                at: None,
                peer_tags: caller_tags,
            };
            assert_eq!(d, expected);
            let at: SocketAddr = "10.1.2.3:4567".parse().unwrap();
            let text = TransportError::from(Disagreement { at: Some(at), ..d }).to_string();
            let want = format!(
                "rank 5 at 10.1.2.3:4567 frames {} integrity tags and rank 0 {} them",
                with(caller_tags),
                with(!caller_tags)
            );
            assert!(text.contains(&want), "{text}");
            assert!(text.contains(env::FRAME_INTEGRITY), "{text}");
        }
    }

    #[test]
    fn ends_that_both_tag_frames_connect_and_share_frame_keys() {
        let (c, a) = pair(tagged("job", "s3cret", true), tagged("job", "s3cret", true));
        let (mut c, mut cs) = c.unwrap();
        let (mut a, mut as_) = agreed(a);
        assert_eq!((c.peer, a.peer), (0, 5));
        assert_eq!(c.frame_key(true), a.frame_key(false));
        assert_eq!(c.frame_key(false), a.frame_key(true));
        c.send(&mut cs, b"registration").unwrap();
        assert_eq!(a.recv(&mut as_, 64).unwrap(), b"registration");
        a.send(&mut as_, b"table").unwrap();
        assert_eq!(c.recv(&mut cs, 64).unwrap(), b"table");
    }

    #[test]
    fn an_unproven_caller_learns_nothing_of_a_disagreement() {
        // A wrong secret gets the same answer whether or not the settings differ.
        let (c1, a1) = pair(tagged("job", "guess", true), tagged("job", "s3cret", false));
        let (c2, _) = pair(
            tagged("job", "guess", false),
            tagged("job", "s3cret", false),
        );
        assert!(matches!(a1, Err(TransportError::Handshake(_))));
        assert_eq!(c1.err().unwrap().to_string(), c2.err().unwrap().to_string());
    }

    #[test]
    fn a_setting_flipped_on_the_way_fails_the_proof() {
        // The hello says "tags" while the caller proved "no tags": the acceptor, which tags,
        // must not take it for an agreement, nor for a disagreement.
        let (c, a) = pair_through(
            tagged("job", "s3cret", false),
            tagged("job", "s3cret", true),
            true,
        );
        let e = c.err().unwrap().to_string();
        assert!(e.contains("refused by the peer"), "{e}");
        let e = a.err().unwrap().to_string();
        assert!(e.contains("did not prove"), "{e}");
    }
}
