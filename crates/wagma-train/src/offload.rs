//! Real work of virtual-time ranks on every core.
//!
//! The virtual-time scheduler runs every rank on one thread, and a rank's local step costs no
//! virtual time: its duration comes from the compute model. So a rank hands its step to this
//! pool, lets its virtual compute time pass (other ranks run meanwhile and hand over theirs),
//! and only then waits for the result, in real time. The result is a pure function of the
//! rank's state, so the run stays bit-for-bit what it is on one thread; only the real cost
//! shrinks with the cores.

use std::sync::mpsc;

use crossbeam_channel::Sender;

use crate::error::TrainError;

/// A job of the pool.
type Job<'s> = Box<dyn FnOnce() + Send + 's>;

/// Threads that run jobs in the order they are handed over.
pub(crate) struct Pool<'s> {
    tx: Sender<Job<'s>>,
}

/// The result of a job, when it is done.
pub(crate) struct Pending<R>(mpsc::Receiver<R>);

impl<'s> Pool<'s> {
    /// A pool of `threads` threads in `scope` (they end with the pool).
    pub(crate) fn new<'e>(scope: &'s std::thread::Scope<'s, 'e>, threads: usize) -> Pool<'s> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job<'s>>();
        for _ in 0..threads.max(1) {
            let rx = rx.clone();
            let worker = move || {
                for job in rx {
                    // A panic ends the job (its result is then an error), not the thread.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            };
            scope.spawn(worker);
        }
        Pool { tx }
    }

    /// Runs `f` on a thread of the pool.
    pub(crate) fn submit<R: Send + 's>(&self, f: impl FnOnce() -> R + Send + 's) -> Pending<R> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job<'s> = Box::new(move || {
            // The receiver only goes away when its rank failed; nothing is left to do then.
            let _ = tx.send(f());
        });
        if let Err(e) = self.tx.send(job) {
            // No thread left (they only end with the pool): run it here.
            (e.into_inner())();
        }
        Pending(rx)
    }
}

impl<R> Pending<R> {
    /// Blocks until the job is done.
    pub(crate) fn wait(self) -> Result<R, TrainError> {
        self.0
            .recv()
            .map_err(|_| TrainError::Internal("a local step panicked on a worker thread".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_whatever_the_order_of_completion() {
        std::thread::scope(|scope| {
            let pool = Pool::new(scope, 2);
            let jobs: Vec<_> = (0..20u64)
                .map(|i| {
                    pool.submit(move || {
                        std::thread::sleep(std::time::Duration::from_millis(20 - i));
                        i * i
                    })
                })
                .collect();
            let got: Vec<u64> = jobs.into_iter().map(|j| j.wait().unwrap()).collect();
            assert_eq!(got, (0..20u64).map(|i| i * i).collect::<Vec<_>>());
        });
    }

    #[test]
    fn a_panicking_job_is_an_error_not_a_hang() {
        std::thread::scope(|scope| {
            let pool = Pool::new(scope, 1);
            let bad = pool.submit(|| -> u32 { panic!("boom") });
            assert!(bad.wait().is_err());
        });
    }
}
