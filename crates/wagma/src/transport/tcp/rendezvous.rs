//! The rendezvous with rank 0: every rank registers the address it listens on and receives
//! the table of all addresses (a restarted rank does the same to rejoin). Registrations,
//! tables and refusals are sealed with the session key of the connection they travel on.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::Instant;

use super::gate::{self, Caller, HANDSHAKE_TIMEOUT};
use super::handshake::{Deadlined, Session};
use super::{START_POLL, TcpConfig, call};
use crate::error::TransportError;

/// Set in a registration's world size by a process that rejoins a running job.
const REJOIN_FLAG: u32 = 1 << 31;
/// Largest registration: a world size and an address.
const MAX_REGISTRATION: usize = 128;
/// The first byte of rank 0's answer.
const TABLE: u8 = 0;
const REFUSAL: u8 = 1;

/// A registration with rank 0: the world size the registering rank believes in, whether it
/// rejoins a running job, and the address it listens on.
pub(super) struct Registration {
    pub world: usize,
    pub rejoin: bool,
    pub addr: SocketAddr,
}

fn decode_addr(b: &[u8]) -> Result<SocketAddr, TransportError> {
    std::str::from_utf8(b)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| TransportError::Rendezvous("malformed address in the rendezvous".into()))
}

fn send_registration<W: Write>(
    session: &mut Session,
    w: &mut W,
    reg: &Registration,
) -> Result<(), TransportError> {
    let flag = if reg.rejoin { REJOIN_FLAG } else { 0 };
    let world = u32::try_from(reg.world)
        .ok()
        .filter(|w| w & REJOIN_FLAG == 0)
        .ok_or_else(|| TransportError::Rendezvous(format!("{} ranks is too many", reg.world)))?;
    let mut msg = (world | flag).to_le_bytes().to_vec();
    msg.extend_from_slice(reg.addr.to_string().as_bytes());
    session.send(w, &msg)
}

/// Reads the registration the caller of `session` sends next.
pub(super) fn read_registration<R: Read>(
    session: &mut Session,
    r: &mut R,
) -> Result<Registration, TransportError> {
    let msg = session.recv(r, MAX_REGISTRATION)?;
    let (Some(word), Some(addr)) = (msg.get(..4), msg.get(4..)) else {
        return Err(TransportError::Rendezvous(format!(
            "rank {} sent a malformed registration",
            session.peer
        )));
    };
    let word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
    Ok(Registration {
        world: (word & !REJOIN_FLAG) as usize,
        rejoin: word & REJOIN_FLAG != 0,
        addr: decode_addr(addr)?,
    })
}

/// Answers a registration with the table of every rank's address.
pub(super) fn send_table<W: Write>(
    session: &mut Session,
    w: &mut W,
    table: &[SocketAddr],
) -> Result<(), TransportError> {
    let mut body = vec![TABLE];
    for a in table {
        let e = a.to_string();
        body.push(e.len() as u8);
        body.extend_from_slice(e.as_bytes());
    }
    session.send(w, &body)
}

/// Answers a registration with a refusal, saying why.
pub(super) fn send_refusal<W: Write>(session: &mut Session, w: &mut W, why: &str) {
    let mut body = vec![REFUSAL];
    body.extend_from_slice(why.as_bytes());
    if let Err(e) = session.send(w, &body) {
        tracing::warn!(peer = session.peer, error = %e, "could not send a refusal");
    }
}

fn read_table<R: Read>(
    session: &mut Session,
    r: &mut R,
    world: usize,
) -> Result<Vec<SocketAddr>, TransportError> {
    let body = session.recv(r, 64 * world + 64)?;
    match body.first() {
        Some(&TABLE) => {}
        Some(&REFUSAL) => {
            return Err(TransportError::Rendezvous(format!(
                "rank 0 refused: {}",
                String::from_utf8_lossy(&body[1..])
            )));
        }
        _ => return Err(TransportError::Rendezvous("malformed answer".into())),
    }
    let mut table = Vec::with_capacity(world);
    let mut at = 1;
    while at < body.len() {
        let n = body[at] as usize;
        let a = body
            .get(at + 1..at + 1 + n)
            .ok_or_else(|| TransportError::Rendezvous("truncated address table".into()))?;
        table.push(decode_addr(a)?);
        at += 1 + n;
    }
    if table.len() != world {
        return Err(TransportError::Rendezvous(format!(
            "table has {} addresses for {world} ranks",
            table.len()
        )));
    }
    Ok(table)
}

/// Rank 0 at start-up: collects every rank's registration on `l` and sends the table back.
pub(super) fn serve(
    l: &TcpListener,
    cfg: &TcpConfig,
    mine: SocketAddr,
    deadline: Instant,
) -> Result<Vec<SocketAddr>, TransportError> {
    let p = cfg.world;
    let (tx, rx) = crossbeam_channel::unbounded();
    let _gate = gate::open(
        l,
        0,
        cfg.terms(),
        START_POLL,
        Some(deadline),
        || true,
        move |c: Result<Caller, TransportError>| {
            // A rank that disagrees on the terms can never join: the start-up ends at once.
            let mut c = match c {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let reg = read_registration(&mut c.session, &mut Deadlined::new(&c.stream, c.deadline));
            match reg {
                Ok(reg) => {
                    let _ = tx.send(Ok((c, reg)));
                }
                Err(e) => {
                    tracing::warn!(peer = c.session.peer, error = %e, "a registration failed")
                }
            }
        },
    )?;
    let mut table: Vec<Option<SocketAddr>> = vec![None; p];
    table[0] = Some(mine);
    let mut conns = Vec::new();
    if let Err(e) = collect(&rx, deadline, &mut table, &mut conns) {
        // The ranks that registered would otherwise learn only that rank 0 went away.
        let why = format!("the job's start-up failed: {e}");
        for mut c in conns {
            let mut w = Deadlined::new(&c.stream, Instant::now() + HANDSHAKE_TIMEOUT);
            send_refusal(&mut c.session, &mut w, &why);
        }
        return Err(e);
    }
    let table: Vec<SocketAddr> = table.into_iter().flatten().collect();
    for mut c in conns {
        let mut w = Deadlined::new(&c.stream, Instant::now() + HANDSHAKE_TIMEOUT);
        send_table(&mut c.session, &mut w, &table)?;
    }
    Ok(table)
}

/// Collects registrations from `rx` until every rank of `table` has one, refusing those that
/// cannot take part; a registration that makes the start-up impossible ends it with an error.
fn collect(
    rx: &crossbeam_channel::Receiver<Result<(Caller, Registration), TransportError>>,
    deadline: Instant,
    table: &mut [Option<SocketAddr>],
    conns: &mut Vec<Caller>,
) -> Result<(), TransportError> {
    let p = table.len();
    while conns.len() < p - 1 {
        let (mut c, reg): (Caller, Registration) = rx.recv_deadline(deadline).map_err(|_| {
            let missing = (1..p).filter(|&r| table[r].is_none());
            TransportError::Rendezvous(format!(
                "rank 0: only {} of {} ranks registered in time; {} did not",
                conns.len(),
                p - 1,
                super::ranks_text(missing)
            ))
        })??;
        let peer = c.session.peer;
        let mut w = Deadlined::new(&c.stream, Instant::now() + HANDSHAKE_TIMEOUT);
        let refusal = if peer == 0 || peer >= p {
            Some(format!("rank {peer} does not exist in a job of {p} ranks"))
        } else if reg.rejoin {
            Some("the job is still starting".to_string())
        } else {
            None
        };
        if let Some(why) = refusal {
            tracing::warn!(peer, "refused a registration: {why}");
            send_refusal(&mut c.session, &mut w, &why);
            continue;
        }
        if reg.world != p {
            let err = format!(
                "rank {peer} believes the job has {} ranks, rank 0 believes {p}",
                reg.world
            );
            send_refusal(&mut c.session, &mut w, &err);
            return Err(TransportError::Rendezvous(err));
        }
        if table[peer].is_some() {
            send_refusal(&mut c.session, &mut w, "duplicate rank");
            return Err(TransportError::Rendezvous(format!(
                "two processes claim rank {peer}"
            )));
        }
        table[peer] = Some(reg.addr);
        conns.push(c);
    }
    Ok(())
}

/// Ranks above 0 (and a process that rejoins): register `mine` with rank 0 at `rdv` and
/// receive the table.
pub(super) fn register(
    rdv: SocketAddr,
    cfg: &TcpConfig,
    mine: SocketAddr,
    deadline: Instant,
    rejoin: bool,
) -> Result<Vec<SocketAddr>, TransportError> {
    // A refusal stays a handshake error; rank 0 never answering is the rendezvous failing.
    let (mut session, st) = call(rdv, cfg.rank, &cfg.terms(), deadline).map_err(|e| match e {
        TransportError::Io { .. } => {
            TransportError::Rendezvous(format!("rank {}, reaching rank 0 at {rdv}: {e}", cfg.rank))
        }
        e => e,
    })?;
    if session.peer != 0 {
        return Err(TransportError::Rendezvous(format!(
            "the rendezvous answered as rank {}",
            session.peer
        )));
    }
    let mut d = Deadlined::new(&st, deadline);
    let reg = Registration {
        world: cfg.world,
        rejoin,
        addr: mine,
    };
    send_registration(&mut session, &mut d, &reg)?;
    // Rank 0 answers once every rank has registered: a deadline passing here is a rank
    // that did not, or rank 0 that stopped.
    read_table(&mut session, &mut d, cfg.world).map_err(|e| match e {
        TransportError::Io { .. } => TransportError::Rendezvous(format!(
            "rank {}, waiting for rank 0's address table at {rdv} (sent once every rank \
             registered): {e}",
            cfg.rank
        )),
        e => e,
    })
}
