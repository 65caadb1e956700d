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
    /// When the frame in progress began or last had bytes taken by the socket, whichever is
    /// later (nanoseconds since `origin`, plus one); 0 when idle.
    progress: Arc<AtomicU64>,
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
        let progress = Arc::new(AtomicU64::new(0));
        let busy = Arc::clone(&progress);
        std::thread::Builder::new()
            .name(format!("wagma-tcp-{me}->{peer}"))
            .spawn(move || {
                let _end = end_tx;
                let socket = StampedSocket {
                    st,
                    last: Arc::clone(&busy),
                    origin,
                };
                let mut out = BufWriter::with_capacity(64 * 1024, socket);
                for job in rx {
                    // A frame's clock starts when it does, not when the last one ended.
                    out.get_ref().mark();
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
                        let (socket, _) = out.into_parts();
                        let _ = socket.st.shutdown(std::net::Shutdown::Both);
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
            progress,
            origin,
            ended,
            io_timeout,
            linger: io_timeout,
            max_frame,
        })
    }

    /// Queues `env` for the peer; fails when the connection failed or its current frame has
    /// made no progress for a whole I/O timeout.
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
        let last = self.progress.load(Ordering::Acquire);
        if last > 0 {
            let stalled = Duration::from_nanos(stamp(self.origin).saturating_sub(last));
            if stalled >= self.io_timeout {
                return Err(self.lost(format!(
                    "the connection made no progress for {:.1} s",
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

/// Lets every writer write what is queued, all at once, waiting at most the longest linger time
/// from now (not one linger after another: a rank with many congested peers still exits in one
/// linger time); their drops then only close the sockets.
pub(in crate::transport::tcp) fn close_all<'a>(writers: impl IntoIterator<Item = &'a mut Writer>) {
    let mut writers: Vec<&mut Writer> = writers.into_iter().collect();
    for w in &mut writers {
        drop(w.jobs.take());
    }
    let longest = writers.iter().map(|w| w.linger).max().unwrap_or_default();
    let started = Instant::now();
    for w in writers {
        let _ = w
            .ended
            .recv_timeout(longest.saturating_sub(started.elapsed()));
        w.linger = Duration::ZERO;
    }
}

impl Drop for Writer {
    /// Writes what is queued, waiting at most the linger time, then closes the socket (which
    /// also ends a write still blocked).
    fn drop(&mut self) {
        close_all(std::iter::once(&mut *self));
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

/// Nanoseconds since `origin`, plus one (so that 0 can mean "idle").
fn stamp(origin: Instant) -> u64 {
    u64::try_from(origin.elapsed().as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}

/// The socket under a writer's buffer: notes the time of every write that takes bytes.
struct StampedSocket {
    st: TcpStream,
    last: Arc<AtomicU64>,
    origin: Instant,
}

impl StampedSocket {
    fn mark(&self) {
        self.last.store(stamp(self.origin), Ordering::Release);
    }
}

impl Write for StampedSocket {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self
            .st
            .write(&buf[..buf.len().min(super::WRITE_PIECE_BYTES)])?;
        if n > 0 {
            self.mark();
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.st.flush()
    }
}

fn write_one(
    out: &mut BufWriter<StampedSocket>,
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

    fn envelope(seq: u64, data: Payload) -> Envelope {
        Envelope {
            from: 0,
            tag: Tag {
                kind: Kind::Round,
                seq,
                step: 0,
            },
            meta: Meta {
                total_len: data.len() as u64,
                ..Meta::default()
            },
            data,
        }
    }

    #[test]
    fn a_large_frame_on_a_slow_link_is_progress_not_a_stall() {
        let io_timeout = Duration::from_secs(2);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        // Small socket buffers (the accepted socket inherits the listener's): the kernel holds
        // a tiny part of the frame, so writing it takes as long as the peer takes to read it.
        let buffers = 128 * 1024;
        socket2::SockRef::from(&listener)
            .set_recv_buffer_size(buffers)
            .unwrap();
        let to = listener.local_addr().unwrap();
        let socket = TcpStream::connect_timeout(&to, Duration::from_secs(30)).unwrap();
        socket2::SockRef::from(&socket)
            .set_send_buffer_size(buffers)
            .unwrap();
        socket.set_write_timeout(Some(io_timeout)).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let received = Arc::new(AtomicU64::new(0));
        let hurry = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (received, hurry) = (Arc::clone(&received), Arc::clone(&hurry));
            std::thread::spawn(move || -> std::io::Result<()> {
                // 64 KiB every 5 ms (about 13 MB/s), steadily, until told to hurry: a piece
                // of the frame (at most 4 MiB) goes out every third of a second.
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = peer.read(&mut buf)?;
                    if n == 0 {
                        return Ok(());
                    }
                    received.fetch_add(n as u64, Ordering::AcqRel);
                    if !hurry.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            })
        };
        let writer = Writer::spawn(0, 1, socket, None, io_timeout, u64::MAX).unwrap();
        // 128 MiB: about ten seconds at the reader's pace, so it is still being written when
        // the second frame is queued (the reader cannot have taken more than about 60 MiB).
        let first = envelope(1, Payload::Data(vec![0.25; 32 << 20]));
        let (second, third) = (
            envelope(2, Payload::Data(vec![1.0; 4])),
            envelope(3, Payload::Data(vec![2.0; 4])),
        );
        // Each frame on the wire: its length field and its body.
        let total = [&first, &second, &third]
            .iter()
            .map(|e| 4 + e.wire_bytes() as u64)
            .sum::<u64>();
        writer.send(first).unwrap();
        // Well past the I/O timeout since the first frame began, while it still progresses.
        std::thread::sleep(2 * io_timeout + Duration::from_millis(500));
        writer
            .send(second)
            .expect("a frame that still progresses is no stall");
        hurry.store(true, Ordering::Release);
        writer.send(third).unwrap();
        // Everything arrives; the deadline only guards against a hang.
        let deadline = Instant::now() + Duration::from_secs(60);
        while received.load(Ordering::Acquire) < total && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(writer);
        reader.join().unwrap().unwrap();
        assert_eq!(received.load(Ordering::Acquire), total);
    }

    #[test]
    fn writers_closed_together_wait_one_linger_time_not_one_each() {
        // Four peers that read slowly but steadily, so every writer still has most of a frame
        // to write when the rank leaves.
        let linger = Duration::from_secs(2);
        let mut writers = Vec::new();
        let mut readers = Vec::new();
        for peer_rank in 1..=4 {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            socket2::SockRef::from(&listener)
                .set_recv_buffer_size(128 * 1024)
                .unwrap();
            let to = listener.local_addr().unwrap();
            let socket = TcpStream::connect_timeout(&to, Duration::from_secs(30)).unwrap();
            socket2::SockRef::from(&socket)
                .set_send_buffer_size(128 * 1024)
                .unwrap();
            socket.set_write_timeout(Some(linger)).unwrap();
            let (mut peer, _) = listener.accept().unwrap();
            readers.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                while matches!(peer.read(&mut buf), Ok(n) if n > 0) {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }));
            let w = Writer::spawn(0, peer_rank, socket, None, linger, u64::MAX).unwrap();
            // 32 MiB: about 25 s at the reader's pace.
            w.send(envelope(1, Payload::Data(vec![0.5; 8 << 20])))
                .unwrap();
            writers.push(w);
        }
        let t0 = Instant::now();
        close_all(writers.iter_mut());
        drop(writers);
        let took = t0.elapsed();
        // One linger after another would take four.
        assert!(
            took < 3 * linger,
            "closing four writers took {:.1} s with a linger of {:.1} s",
            took.as_secs_f64(),
            linger.as_secs_f64()
        );
        for r in readers {
            r.join().unwrap();
        }
    }

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
