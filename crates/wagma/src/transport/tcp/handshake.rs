//! Mutual authentication of a connection: both sides prove they know the job's shared secret
//! (HMAC-SHA256 over a fresh nonce of the other side, the job id and their rank), so the secret
//! never crosses the wire and a replayed answer is useless.

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::Rank;
use crate::error::TransportError;

const MAGIC: &[u8; 8] = b"WAGMA/01";
const NONCE: usize = 32;
const MAX_MSG: usize = 4096;

/// Who the job is and what proves membership.
#[derive(Clone)]
pub struct Credentials {
    /// Job id: connections of another job are refused.
    pub job_id: String,
    /// Shared secret.
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("job_id", &self.job_id)
            .field("secret", &"<hidden>")
            .finish()
    }
}

fn mac(cred: &Credentials, label: &[u8], nonce: &[u8], rank: Rank) -> Vec<u8> {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(&cred.secret).expect("HMAC takes any key length");
    m.update(label);
    m.update(&(cred.job_id.len() as u32).to_le_bytes());
    m.update(cred.job_id.as_bytes());
    m.update(nonce);
    m.update(&(rank as u64).to_le_bytes());
    m.finalize().into_bytes().to_vec()
}

fn verify(cred: &Credentials, label: &[u8], nonce: &[u8], rank: Rank, tag: &[u8]) -> bool {
    let Ok(mut m) = <Hmac<Sha256> as Mac>::new_from_slice(&cred.secret) else {
        return false;
    };
    m.update(label);
    m.update(&(cred.job_id.len() as u32).to_le_bytes());
    m.update(cred.job_id.as_bytes());
    m.update(nonce);
    m.update(&(rank as u64).to_le_bytes());
    m.verify_slice(tag).is_ok()
}

pub(crate) fn write_msg<W: Write>(w: &mut W, body: &[u8]) -> Result<(), TransportError> {
    let io = |e: std::io::Error| TransportError::io("handshake write", &e);
    w.write_all(&(body.len() as u32).to_le_bytes())
        .map_err(io)?;
    w.write_all(body).map_err(io)?;
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

fn refuse<W: Write>(w: &mut W, reason: &str) -> TransportError {
    let mut body = vec![1u8];
    body.extend_from_slice(reason.as_bytes());
    let _ = write_msg(w, &body);
    TransportError::Handshake(reason.to_string())
}

/// The connecting side. Returns the acceptor's rank.
pub fn connect<S: Read + Write>(
    s: &mut S,
    me: Rank,
    cred: &Credentials,
) -> Result<Rank, TransportError> {
    let mine = nonce();
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(me as u32).to_le_bytes());
    hello.extend_from_slice(&mine);
    hello.extend_from_slice(&(cred.job_id.len() as u16).to_le_bytes());
    hello.extend_from_slice(cred.job_id.as_bytes());
    write_msg(s, &hello)?;
    let challenge = read_msg(s, MAX_MSG)?;
    match challenge.first() {
        Some(0) if challenge.len() == 1 + 4 + NONCE + 32 => {}
        Some(1) => {
            return Err(TransportError::Handshake(format!(
                "refused by the peer: {}",
                String::from_utf8_lossy(&challenge[1..])
            )));
        }
        _ => return Err(TransportError::Handshake("malformed challenge".into())),
    }
    let peer = u32::from_le_bytes([challenge[1], challenge[2], challenge[3], challenge[4]]) as Rank;
    let theirs = &challenge[5..5 + NONCE];
    let tag = &challenge[5 + NONCE..];
    if !verify(cred, b"acceptor", &mine, peer, tag) {
        return Err(refuse(s, "the acceptor does not know the job's secret"));
    }
    let mut answer = vec![0u8];
    answer.extend_from_slice(&mac(cred, b"connector", theirs, me));
    write_msg(s, &answer)?;
    let result = read_msg(s, MAX_MSG)?;
    match result.first() {
        Some(0) => Ok(peer),
        _ => Err(TransportError::Handshake(format!(
            "refused by the peer: {}",
            String::from_utf8_lossy(result.get(1..).unwrap_or_default())
        ))),
    }
}

/// The accepting side. Returns the connector's rank.
pub fn accept<S: Read + Write>(
    s: &mut S,
    me: Rank,
    cred: &Credentials,
) -> Result<Rank, TransportError> {
    let hello = read_msg(s, MAX_MSG)?;
    let fixed = MAGIC.len() + 4 + NONCE + 2;
    if hello.len() < fixed || &hello[..MAGIC.len()] != MAGIC {
        return Err(refuse(s, "not a wagma peer (bad magic)"));
    }
    let at = MAGIC.len();
    let peer = u32::from_le_bytes([hello[at], hello[at + 1], hello[at + 2], hello[at + 3]]) as Rank;
    let theirs = hello[at + 4..at + 4 + NONCE].to_vec();
    let job_len = u16::from_le_bytes([hello[fixed - 2], hello[fixed - 1]]) as usize;
    let job = hello.get(fixed..fixed + job_len).unwrap_or_default();
    if job != cred.job_id.as_bytes() {
        return Err(refuse(
            s,
            &format!(
                "job id {:?} is not this job's",
                String::from_utf8_lossy(job)
            ),
        ));
    }
    let mine = nonce();
    let mut challenge = vec![0u8];
    challenge.extend_from_slice(&(me as u32).to_le_bytes());
    challenge.extend_from_slice(&mine);
    challenge.extend_from_slice(&mac(cred, b"acceptor", &theirs, me));
    write_msg(s, &challenge)?;
    let answer = read_msg(s, MAX_MSG)?;
    if answer.first() != Some(&0)
        || answer.len() != 33
        || !verify(cred, b"connector", &mine, peer, &answer[1..])
    {
        return Err(refuse(s, "wrong secret"));
    }
    write_msg(s, &[0u8])?;
    Ok(peer)
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

    fn pair(
        a: Credentials,
        b: Credentials,
    ) -> (Result<Rank, TransportError>, Result<Rank, TransportError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, 0, &b)
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let c = connect(&mut s, 5, &a);
        (c, t.join().unwrap())
    }

    #[test]
    fn matching_credentials_connect() {
        let (c, a) = pair(cred("job", "s3cret"), cred("job", "s3cret"));
        assert_eq!(c.unwrap(), 0);
        assert_eq!(a.unwrap(), 5);
    }

    #[test]
    fn wrong_secret_is_refused() {
        let (c, a) = pair(cred("job", "guess"), cred("job", "s3cret"));
        assert!(matches!(a, Err(TransportError::Handshake(_))), "{a:?}");
        assert!(c.is_err());
    }

    #[test]
    fn wrong_job_is_refused() {
        let (c, a) = pair(cred("other", "s3cret"), cred("job", "s3cret"));
        assert!(a.unwrap_err().to_string().contains("not this job"));
        assert!(c.unwrap_err().to_string().contains("refused"));
    }
}
