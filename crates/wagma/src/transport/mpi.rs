//! The MPI transport (feature `mpi`): nonblocking point-to-point over rsmpi, driven by the
//! engine thread (Debian's Open MPI makes no progress on its own, so the engine polls).
//!
//! A message is two MPI messages with the same tag: a small header (the frame of
//! [`super::frame`] with the payload's length) and, unless the payload is virtual, the `f32`
//! payload itself, sent from and received into the engine's buffers without a copy. MPI's
//! non-overtaking rule keeps the two in order. Groups are peer lists over the world
//! communicator: no communicator is ever created per group.

use std::collections::HashMap;

use crossbeam_channel::Sender;
use mpi::Threading;
use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source, Status};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::frame::{read_frame, write_frame};
use super::{Envelope, Incoming, Transport};
use crate::Rank;
use crate::error::TransportError;
use crate::payload::{Payload, pool};

/// The tag of every wagma message (the real tag travels in the header).
const TAG: mpi::Tag = 0x3a;
const FOLLOWS: u8 = 1;
/// Longest wait for the values announced by a header (they are sent right after it).
const PAYLOAD_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// A header whose values have not been received yet.
struct Announced {
    env: Envelope,
    deadline: std::time::Instant,
}

/// A send in flight with the buffer it reads from.
enum InFlight {
    Header(Request<'static, [u8]>, Vec<u8>),
    Data(Request<'static, [f32]>, Payload),
}

/// One rank's MPI endpoint; lives and dies on the engine thread.
pub struct MpiTransport {
    world: SimpleCommunicator,
    rank: Rank,
    size: usize,
    inbox: Sender<Incoming>,
    in_flight: Vec<InFlight>,
    /// By peer, the header whose values are the next message from it (MPI keeps the order).
    announced: HashMap<Rank, Announced>,
    max_frame: u64,
    // Dropped last: finalizes MPI once every request has completed.
    _universe: Universe,
}

/// Extends a borrow to `'static` for a request whose buffer is kept alive next to it.
///
/// # Safety
/// The referenced memory must outlive the request: the caller stores the owner (a `Vec` or a
/// `Payload`, whose heap data does not move when the owner moves) in the same [`InFlight`]
/// entry and drops it only after the request completed.
unsafe fn forever<T: ?Sized>(r: &T) -> &'static T {
    // SAFETY: guaranteed by the caller, see above.
    unsafe { &*(r as *const T) }
}

impl MpiTransport {
    /// Initializes MPI (thread level multiple, so that other threads may call MPI too) and
    /// joins the world. Must run on the engine thread, which then owns MPI.
    pub fn init(inbox: Sender<Incoming>, max_frame: u64) -> Result<MpiTransport, TransportError> {
        let (universe, level) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| {
                TransportError::Rendezvous("MPI is already initialized in this process".into())
            })?;
        if level < Threading::Funneled {
            return Err(TransportError::Rendezvous(format!(
                "MPI gives thread level {level:?}; wagma needs at least funneled"
            )));
        }
        let world = universe.world();
        let rank = usize::try_from(world.rank())
            .map_err(|_| TransportError::Rendezvous("negative MPI rank".into()))?;
        let size = usize::try_from(world.size())
            .map_err(|_| TransportError::Rendezvous("negative MPI size".into()))?;
        Ok(MpiTransport {
            world,
            rank,
            size,
            inbox,
            in_flight: Vec::new(),
            announced: HashMap::new(),
            max_frame,
            _universe: universe,
        })
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    fn complete_sends(&mut self) {
        let pending = std::mem::take(&mut self.in_flight);
        for f in pending {
            match f {
                InFlight::Header(r, b) => match r.test() {
                    Ok(_) => drop(b),
                    Err(r) => self.in_flight.push(InFlight::Header(r, b)),
                },
                InFlight::Data(r, p) => match r.test() {
                    Ok(_) => p.recycle(),
                    Err(r) => self.in_flight.push(InFlight::Data(r, p)),
                },
            }
        }
    }

    /// A header from `from`: its envelope, and whether its values follow as the next message.
    fn header(&self, from: Rank, bytes: &[u8]) -> Result<(Envelope, bool), TransportError> {
        let (flag, frame) = bytes
            .split_first()
            .ok_or_else(|| TransportError::Malformed("empty MPI header".into()))?;
        let env = read_frame(&mut &frame[..], self.max_frame)?
            .ok_or_else(|| TransportError::Malformed("empty MPI header".into()))?;
        if env.from != from {
            return Err(TransportError::Peer {
                peer: from,
                message: format!("header claims to come from rank {}", env.from),
            });
        }
        if *flag != FOLLOWS && !env.data.is_empty() {
            // Lengths without values would turn this job's sums into no-ops.
            return Err(TransportError::Peer {
                peer: from,
                message: "sent a virtual payload, which only simulations use".into(),
            });
        }
        if *flag == FOLLOWS {
            let n = env.data.len();
            if (n as u64).saturating_mul(4) > self.max_frame {
                return Err(TransportError::FrameTooLarge {
                    size: n as u64 * 4,
                    max: self.max_frame,
                });
            }
        }
        Ok((env, *flag == FOLLOWS))
    }

    /// Receives the message a probe matched from `from`: a header, or the values of the
    /// header that came before it. A message ready for the engine is returned.
    fn receive(
        &mut self,
        from: Rank,
        msg: mpi::point_to_point::Message,
        status: Status,
    ) -> Result<Option<Envelope>, TransportError> {
        let Some(Announced { mut env, .. }) = self.announced.remove(&from) else {
            let (bytes, _) = (msg, status).matched_receive_vec::<u8>();
            let (env, follows) = self.header(from, &bytes)?;
            if !follows {
                return Ok(Some(env));
            }
            let deadline = std::time::Instant::now() + PAYLOAD_WAIT;
            self.announced.insert(from, Announced { env, deadline });
            return Ok(None);
        };
        let n = env.data.len();
        if status.count(f32::equivalent_datatype()) as usize != n {
            return Err(TransportError::Malformed(format!(
                "payload of rank {from} does not match its header"
            )));
        }
        let mut v = pool::take_scratch(n);
        msg.matched_receive_into(&mut v[..]);
        env.data = Payload::Data(v);
        Ok(Some(env))
    }

    /// A header whose values are overdue, as an error naming its sender.
    fn overdue(&self) -> Result<(), TransportError> {
        let now = std::time::Instant::now();
        match self.announced.iter().find(|(_, a)| now >= a.deadline) {
            Some((&peer, a)) => Err(TransportError::Peer {
                peer,
                message: format!(
                    "sent the header of {} #{} (step {}) but not its {} values within {} s",
                    a.env.tag.kind.name(),
                    a.env.tag.seq,
                    a.env.tag.step,
                    a.env.data.len(),
                    PAYLOAD_WAIT.as_secs()
                ),
            }),
            None => Ok(()),
        }
    }
}

impl Transport for MpiTransport {
    fn send(&mut self, to: Rank, env: Envelope) -> Result<(), TransportError> {
        if to >= self.size {
            return Err(TransportError::Peer {
                peer: to,
                message: format!("no such rank (job has {})", self.size),
            });
        }
        let dest = self.world.process_at_rank(to as i32);
        let real = !env.data.is_virtual();
        let Envelope {
            from,
            tag,
            meta,
            data,
        } = env;
        let header_env = Envelope {
            from,
            tag,
            meta,
            data: Payload::Size(data.len()),
        };
        let mut header = vec![u8::from(real)];
        write_frame(&mut header, &header_env, self.max_frame)?;
        // SAFETY: `header` is stored with its request and dropped after completion.
        let hreq = dest.immediate_send_with_tag(StaticScope, unsafe { forever(&header[..]) }, TAG);
        self.in_flight.push(InFlight::Header(hreq, header));
        if real {
            // SAFETY: `data` (which owns or shares the values) is stored with its request and
            // released after completion.
            let dreq =
                dest.immediate_send_with_tag(StaticScope, unsafe { forever(data.as_slice()) }, TAG);
            self.in_flight.push(InFlight::Data(dreq, data));
        }
        // Completed sends are released by `poll`, which the engine calls on every turn.
        Ok(())
    }

    fn poll(&mut self) -> Result<(), TransportError> {
        while let Some((msg, status)) = self
            .world
            .any_process()
            .immediate_matched_probe_with_tag(TAG)
        {
            let from = usize::try_from(status.source_rank()).unwrap_or(usize::MAX);
            if let Some(env) = self.receive(from, msg, status)?
                && self.inbox.send(Ok(env.into())).is_err()
            {
                break;
            }
        }
        self.complete_sends();
        self.overdue()
    }

    fn poll_interval(&self) -> Option<std::time::Duration> {
        Some(std::time::Duration::from_micros(50))
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        // Requests must complete before their buffers go; a peer that died never completes
        // them, so after a grace period they are leaked rather than waited for forever.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !self.in_flight.is_empty() && std::time::Instant::now() < deadline {
            self.complete_sends();
            std::thread::yield_now();
        }
        for f in self.in_flight.drain(..) {
            std::mem::forget(f);
        }
    }
}
