//! The write half of a connection, served by a thread of its own: a peer whose connection is
//! congested delays only what goes to it, never the engine thread's heartbeats and messages
//! to the others.

use std::io::{BufWriter, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::integrity::{self, FrameMac};
use crate::Rank;
use crate::error::TransportError;
use crate::transport::Envelope;
use crate::transport::frame::write_frame;

/// What a connection's thread writes.
enum Job {
    Frame(Envelope),
    /// Bytes outside the framing (fault injection).
    Raw(Vec<u8>),
}

/// The write half of a connection to one peer. Queueing never blocks: frames are shared views
/// of the engine's buffers (no copy), and what a correct job sends one peer ahead of its
/// answers is bounded by its protocol. A connection whose current write has made no progress
/// for the I/O timeout is stalled, and sends to it fail.
pub(in crate::transport::tcp) struct Writer {
    peer: Rank,
    jobs: Option<Sender<Job>>,
    /// The same socket, for its timeouts and its shutdown.
    socket: TcpStream,
    /// Why the thread stopped, once it has.
    failed: Arc<Mutex<Option<String>>>,
    /// When the write in progress began (nanoseconds since `origin`, plus one); 0 when idle.
    busy_since: Arc<AtomicU64>,
    origin: Instant,
    /// Closed by the thread when it ends.
    ended: Receiver<()>,
    /// How long a stalled write may take before sends fail.
    io_timeout: Duration,
    /// How long dropping the writer waits for the queued frames to be written.
    linger: Duration,
    max_frame: u64,
}

impl Writer {
    /// Starts the thread that writes to `peer` on `st` (whose write timeout is set).
    pub fn spawn(
        me: Rank,
        peer: Rank,
        st: TcpStream,
        mut mac: Option<FrameMac>,
        io_timeout: Duration,
        max_frame: u64,
    ) -> Result<Writer, TransportError> {
        let socket = st
            .try_clone()
            .map_err(|e| TransportError::io("configuring a connection", &e))?;
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let (end_tx, ended) = crossbeam_channel::bounded::<()>(0);
        let failed = Arc::new(Mutex::new(None));
        let why = Arc::clone(&failed);
        let origin = Instant::now();
        let busy_since = Arc::new(AtomicU64::new(0));
        let busy = Arc::clone(&busy_since);
        std::thread::Builder::new()
            .name(format!("wagma-tcp-{me}->{peer}"))
            .spawn(move || {
                let _end = end_tx;
                let mut out = BufWriter::with_capacity(64 * 1024, st);
                for job in rx {
                    let since = u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    busy.store(since.saturating_add(1), Ordering::Release);
                    let written = match job {
                        Job::Frame(env) => write_one(&mut out, &mut mac, &env, max_frame),
                        Job::Raw(bytes) => out
                            .write_all(&bytes)
                            .and_then(|()| out.flush())
                            .map_err(|e| TransportError::io("injecting bytes", &e)),
                    };
                    busy.store(0, Ordering::Release);
                    if let Err(e) = written {
                        // Dropping the queue's receiver makes every later send fail with this;
                        // the half-written frame is not flushed again, and the peer's reader
                        // sees the connection end instead of waiting for the rest.
                        *why.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.to_string());
                        let (st, _) = out.into_parts();
                        let _ = st.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                }
            })
            .map_err(|e| TransportError::io("starting a writer thread", &e))?;
        Ok(Writer {
            peer,
            jobs: Some(tx),
            socket,
            failed,
            busy_since,
            origin,
            ended,
            io_timeout,
            linger: io_timeout,
            max_frame,
        })
    }

    /// Queues `env` for the peer; fails when the connection failed or has taken nothing for a
    /// whole write timeout.
    pub fn send(&self, env: Envelope) -> Result<(), TransportError> {
        // A frame too large is the caller's error, found before it is queued.
        crate::transport::frame::check_size(&env, self.max_frame)?;
        self.queue(Job::Frame(env))
    }

    /// Queues raw bytes, bypassing the framing.
    pub fn send_raw(&self, bytes: Vec<u8>) -> Result<(), TransportError> {
        self.queue(Job::Raw(bytes))
    }

    fn queue(&self, job: Job) -> Result<(), TransportError> {
        let Some(jobs) = &self.jobs else {
            return Err(self.lost("the connection is closing".into()));
        };
        let since = self.busy_since.load(Ordering::Acquire);
        if since > 0 {
            let now = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let stalled = Duration::from_nanos(now.saturating_sub(since - 1));
            if stalled >= self.io_timeout {
                return Err(self.lost(format!(
                    "the connection took no frame for {:.1} s",
                    stalled.as_secs_f64()
                )));
            }
        }
        jobs.send(job).map_err(|_| {
            let why = self
                .failed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            self.lost(why.unwrap_or_else(|| "the writer thread stopped".into()))
        })
    }

    fn lost(&self, message: String) -> TransportError {
        TransportError::Peer {
            peer: self.peer,
            message,
        }
    }

    /// Bounds each later write, and the wait for the queue to drain when the writer is
    /// dropped, by `limit` (the farewell: a write already blocked ends by closing the socket).
    pub fn shorten(&mut self, limit: Duration) {
        let _ = self.socket.set_write_timeout(Some(limit));
        self.linger = self.linger.min(limit);
    }

    /// Closes a connection that is lost without writing what is queued on it: the thread's
    /// next write fails and it ends.
    pub fn abandon(mut self) {
        self.linger = Duration::ZERO;
    }
}

impl Drop for Writer {
    /// Writes what is queued, waiting at most the linger time, then closes the socket (which
    /// also ends a write still blocked).
    fn drop(&mut self) {
        drop(self.jobs.take());
        let _ = self.ended.recv_timeout(self.linger);
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

fn write_one(
    out: &mut BufWriter<TcpStream>,
    mac: &mut Option<FrameMac>,
    env: &Envelope,
    max_frame: u64,
) -> Result<(), TransportError> {
    match mac {
        None => write_frame(out, env, max_frame),
        Some(mac) => {
            let mut tee = integrity::Tee::new(out, mac);
            write_frame(&mut tee, env, max_frame).and_then(|()| {
                tee.finish()
                    .map_err(|e| TransportError::io("writing a frame's tag", &e))
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;

    use super::*;
    use crate::payload::{Payload, pool};
    use crate::transport::message::{Kind, Meta, Tag};

    #[test]
    fn a_sent_buffer_that_only_the_writer_still_holds_goes_back_to_the_pool() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let socket = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        let drain = std::thread::spawn(move || {
            let mut bytes = Vec::new();
            peer.read_to_end(&mut bytes).map(|_| bytes.len())
        });
        // A capacity no other test allocates: finding it in the pool proves this one came back.
        let len = (3 << 20) + 7;
        let mut own = Payload::Data(Vec::with_capacity(len));
        if let Payload::Data(v) = &mut own {
            v.resize(len, 1.5);
        }
        let env = Envelope {
            from: 0,
            tag: Tag {
                kind: Kind::Round,
                seq: 1,
                step: 0,
            },
            meta: Meta {
                total_len: len as u64,
                ..Meta::default()
            },
            data: own.view(0..len),
        };
        let frame = env.wire_bytes();
        drop(own);
        let writer = Writer::spawn(0, 1, socket, None, Duration::from_secs(60), u64::MAX).unwrap();
        writer.send(env).unwrap();
        // Waits for the queued frame to be written, then closes the connection.
        drop(writer);
        let received = drain.join().unwrap().unwrap();
        assert!(
            received >= frame,
            "{received} bytes received of a {frame}-byte frame"
        );
        assert!(pool::holds(len), "the sent buffer was not recycled");
    }
}
