//! Mutual authentication of a connection on the job's id and shared secret, and the sealed
//! messages that follow it.
//!
//! The caller proves first: it names its rank and a fresh nonce, the acceptor answers with its
//! rank and nonce (and nothing derived from the secret), the caller sends
//! `HMAC(secret, "connector", job, both nonces, both ranks)`, and only if that verifies does the
//! acceptor prove itself the same way. A wrong job id and a wrong secret get the same one-word
//! refusal, so a caller learns nothing before it has proven the secret, and holds no tag to
//! test guesses against offline. Both sides then derive a per-connection key from the secret
//! and both nonces; the messages of the start-up (registrations, the address table, rejoin
//! requests) are sealed with it, so they are bound to the authenticated connection and cannot
//! be replayed on another one. The secret never crosses the wire.
//!
//! Every read and write of a handshake shares one deadline: a caller that trickles bytes
//! cannot hold a listener past it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::Rank;
use crate::error::TransportError;

const MAGIC: &[u8; 8] = b"WAGMA/02";
const NONCE: usize = 32;
const TAG: usize = 32;
const MAX_MSG: usize = 4096;
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

/// The transcript both proofs and the session key cover.
struct Transcript<'a> {
    connector: Rank,
    acceptor: Rank,
    connector_nonce: &'a [u8],
    acceptor_nonce: &'a [u8],
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

/// The connecting side, as rank `me`. The acceptor's rank comes back in the session.
pub(crate) fn connect<S: Read + Write>(
    s: &mut S,
    me: Rank,
    cred: &Credentials,
) -> Result<Session, TransportError> {
    let mine = nonce();
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(me as u32).to_le_bytes());
    hello.extend_from_slice(&mine);
    write_msg(s, &hello)?;
    let challenge = read_msg(s, MAX_MSG)?;
    if challenge.len() != 1 + 4 + NONCE || challenge[0] != 0 {
        return Err(refused_by_peer(&challenge));
    }
    let peer = rank_at(&challenge, 1);
    let t = Transcript {
        connector: me,
        acceptor: peer,
        connector_nonce: &mine,
        acceptor_nonce: &challenge[5..],
    };
    let mut answer = vec![0u8];
    answer.extend_from_slice(&proof(cred, b"wagma connector", &t));
    write_msg(s, &answer)?;
    let result = read_msg(s, MAX_MSG)?;
    if result.len() != 1 + TAG || result[0] != 0 {
        return Err(refused_by_peer(&result));
    }
    if !verify(cred, b"wagma acceptor", &t, &result[1..]) {
        return Err(TransportError::Handshake(format!(
            "rank {peer} accepted without proving the job's id and secret"
        )));
    }
    Ok(Session::new(cred, &t, Side::Connector, peer))
}

fn refused_by_peer(msg: &[u8]) -> TransportError {
    match msg.first() {
        Some(1) => TransportError::Handshake(format!(
            "refused by the peer ({}): wrong job id or secret, or another protocol version",
            String::from_utf8_lossy(&msg[1..])
        )),
        _ => TransportError::Handshake("malformed handshake message".into()),
    }
}

fn refuse<W: Write>(w: &mut W, reason: &str) -> TransportError {
    let mut body = vec![1u8];
    body.extend_from_slice(REFUSED);
    let _ = write_msg(w, &body);
    TransportError::Handshake(reason.to_string())
}

/// The accepting side, as rank `me`. The connector's rank comes back in the session.
pub(crate) fn accept<S: Read + Write>(
    s: &mut S,
    me: Rank,
    cred: &Credentials,
) -> Result<Session, TransportError> {
    let hello = read_msg(s, MAX_MSG)?;
    if hello.len() != MAGIC.len() + 4 + NONCE || &hello[..MAGIC.len()] != MAGIC {
        return Err(refuse(s, "not a wagma peer of this protocol version"));
    }
    let peer = rank_at(&hello, MAGIC.len());
    let theirs = &hello[MAGIC.len() + 4..];
    let mine = nonce();
    let mut challenge = vec![0u8];
    challenge.extend_from_slice(&(me as u32).to_le_bytes());
    challenge.extend_from_slice(&mine);
    write_msg(s, &challenge)?;
    let t = Transcript {
        connector: peer,
        acceptor: me,
        connector_nonce: theirs,
        acceptor_nonce: &mine,
    };
    let answer = read_msg(s, MAX_MSG)?;
    if answer.len() != 1 + TAG
        || answer[0] != 0
        || !verify(cred, b"wagma connector", &t, &answer[1..])
    {
        return Err(refuse(
            s,
            &format!("a caller claiming rank {peer} did not prove the job's id and secret"),
        ));
    }
    let mut result = vec![0u8];
    result.extend_from_slice(&proof(cred, b"wagma acceptor", &t));
    write_msg(s, &result)?;
    Ok(Session::new(cred, &t, Side::Acceptor, peer))
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn cred(job: &str, secret: &str) -> Credentials {
        Credentials {
            job_id: job.into(),
            secret: secret.as_bytes().to_vec(),
        }
    }

    type Both = (
        Result<(Session, TcpStream), TransportError>,
        Result<(Session, TcpStream), TransportError>,
    );

    fn pair(a: Credentials, b: Credentials) -> Both {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, 0, &b).map(|x| (x, s))
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let c = connect(&mut s, 5, &a).map(|x| (x, s));
        (c, t.join().unwrap())
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
        let (c, a) = pair(cred("job", "s3cret"), cred("job", "s3cret"));
        let (mut c, mut cs) = c.unwrap();
        let (mut a, mut as_) = a.unwrap();
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
        let (c1, a1) = pair(cred("job", "guess"), cred("job", "s3cret"));
        let (c2, a2) = pair(cred("other", "s3cret"), cred("job", "s3cret"));
        for a in [&a1, &a2] {
            assert!(matches!(a, Err(TransportError::Handshake(_))));
        }
        let (e1, e2) = (c1.err().unwrap().to_string(), c2.err().unwrap().to_string());
        assert_eq!(e1, e2);
        assert!(e1.contains("refused"), "{e1}");
    }

    #[test]
    fn the_acceptor_reveals_nothing_before_the_caller_proves_the_secret() {
        // The challenge holds the acceptor's rank and a nonce, nothing keyed by the secret:
        // acceptors of different secrets send challenges of the same form.
        for secret in ["a", "b"] {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let c = cred("job", secret);
            let t = std::thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                let _ = accept(&mut s, 3, &c);
            });
            let mut s = TcpStream::connect(addr).unwrap();
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&9u32.to_le_bytes());
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
        let (c, a) = pair(cred("job", "s3cret"), cred("job", "s3cret"));
        let (mut c, mut cs) = c.unwrap();
        let (mut a, mut as_) = a.unwrap();
        // A message sealed on another connection of the same job is refused.
        let (c2, _a2) = pair(cred("job", "s3cret"), cred("job", "s3cret"));
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
            accept(&mut d, 0, &cred("job", "s"))
        });
        let mut s = TcpStream::connect(addr).unwrap();
        // One byte every 100 ms: each read succeeds, the whole never completes in time.
        let mut hello = vec![44u8, 0, 0, 0];
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
}
