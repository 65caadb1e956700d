//! The write half of a connection, served by a thread of its own: a peer whose connection is
//! congested delays only what goes to it, never the engine thread's heartbeats and messages
//! to the others.

use std::io::{BufWriter, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{SendTimeoutError, Sender};

use super::integrity::{self, FrameMac};
use crate::Rank;
use crate::error::TransportError;
use crate::transport::Envelope;
use crate::transport::frame::write_frame;

/// Frames that may wait for a connection's thread. Their payloads are shared views of the
/// engine's buffers, so waiting costs no copy; a connection that lets this many pile up for
/// a whole write timeout is stalled.
const QUEUE: usize = 64;

/// What a connection's thread writes.
enum Job {
    Frame(Envelope),
    /// Bytes outside the framing (fault injection).
    Raw(Vec<u8>),
}

/// The write half of a connection to one peer.
pub(in crate::transport::tcp) struct Writer {
    peer: Rank,
    jobs: Option<Sender<Job>>,
    /// The same socket, for its timeouts and its shutdown.
    socket: TcpStream,
    /// Why the thread stopped, once it has.
    failed: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
    /// How long a frame may wait for room in the queue.
    io_timeout: Duration,
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
        let (tx, rx) = crossbeam_channel::bounded::<Job>(QUEUE);
        let failed = Arc::new(Mutex::new(None));
        let why = Arc::clone(&failed);
        let thread = std::thread::Builder::new()
            .name(format!("wagma-tcp-{me}->{peer}"))
            .spawn(move || {
                let mut out = BufWriter::with_capacity(64 * 1024, st);
                for job in rx {
                    let written = match job {
                        Job::Frame(env) => write_one(&mut out, &mut mac, &env, max_frame),
                        Job::Raw(bytes) => out
                            .write_all(&bytes)
                            .and_then(|()| out.flush())
                            .map_err(|e| TransportError::io("injecting bytes", &e)),
                    };
                    if let Err(e) = written {
                        // Dropping the queue's receiver makes every later send fail with this.
                        *why.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.to_string());
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
            thread: Some(thread),
            io_timeout,
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
        match jobs.send_timeout(job, self.io_timeout) {
            Ok(()) => Ok(()),
            Err(SendTimeoutError::Timeout(_)) => Err(self.lost(format!(
                "the connection took no frame for {:.1} s",
                self.io_timeout.as_secs_f64()
            ))),
            Err(SendTimeoutError::Disconnected(_)) => {
                let why = self
                    .failed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                Err(self.lost(why.unwrap_or_else(|| "the writer thread stopped".into())))
            }
        }
    }

    fn lost(&self, message: String) -> TransportError {
        TransportError::Peer {
            peer: self.peer,
            message,
        }
    }

    /// Bounds each remaining write (the farewell) by `limit`.
    pub fn shorten(&self, limit: Duration) {
        let _ = self.socket.set_write_timeout(Some(limit));
    }

    /// Closes a connection that is lost without writing what is queued on it (which may
    /// block until the write timeout): the thread's next write fails and it ends.
    pub fn abandon(mut self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
        drop(self.thread.take());
    }
}

impl Drop for Writer {
    /// Writes what is queued (each write bounded by the socket's timeout), then closes.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
