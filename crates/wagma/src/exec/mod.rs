//! Executors of the engines and the compute side's handle, [`Comm`].
//!
//! A rank's training loop talks to its engine through a [`Comm`]. Its operations are `async`:
//! under the threaded executor (one compute thread and one engine thread per rank, over the
//! in-process, TCP or MPI transport) they block their thread; under the virtual-time executor
//! (every rank a task of one seeded, deterministic scheduler) they suspend the task until the
//! simulated network delivers. The same training code runs under both.

mod comm;
pub mod launch;
pub mod threaded;
pub mod virtual_time;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::Rank;
use crate::engine::{Request, Response};
use crate::error::Error;

pub use comm::{Comm, CommStats, Exchanged, Gathering};

/// Where a request's answer lands: the executor completes it, the compute side awaits it.
pub(crate) struct Slot {
    state: Mutex<SlotState>,
}

enum SlotState {
    Waiting(Option<Waker>),
    Done(Result<Response, Error>),
    Taken,
}

impl Slot {
    pub fn new() -> Arc<Slot> {
        Arc::new(Slot {
            state: Mutex::new(SlotState::Waiting(None)),
        })
    }

    pub fn ready(result: Result<Response, Error>) -> Arc<Slot> {
        Arc::new(Slot {
            state: Mutex::new(SlotState::Done(result)),
        })
    }

    /// Stores the answer and wakes the waiting task; a slot already answered keeps its first
    /// answer.
    pub fn complete(&self, result: Result<Response, Error>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let SlotState::Waiting(waker) = &mut *state {
            let waker = waker.take();
            *state = SlotState::Done(result);
            drop(state);
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

/// A request in flight of `rank`; resolves to the engine's answer.
pub(crate) struct Pending {
    rank: Rank,
    slot: Arc<Slot>,
}

impl Pending {
    pub fn new(rank: Rank, slot: Arc<Slot>) -> Pending {
        Pending { rank, slot }
    }
}

impl Future for Pending {
    type Output = Result<Response, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut *state, SlotState::Taken) {
            SlotState::Done(r) => Poll::Ready(r),
            SlotState::Waiting(_) => {
                *state = SlotState::Waiting(Some(cx.waker().clone()));
                Poll::Pending
            }
            SlotState::Taken => Poll::Ready(Err(Error::Protocol {
                rank: self.rank,
                op: crate::error::Op::Other("await"),
                detail: "a completed request was awaited twice".into(),
            })),
        }
    }
}

/// The executor side of a [`Comm`].
pub(crate) trait Port: Send + Sync {
    /// Hands a request to the engine.
    fn submit(&self, req: Request) -> Pending;
    /// Time since the job started (wall-clock or virtual).
    fn now(&self) -> Duration;
    /// Whether every rank reads one clock that only the executor advances (virtual time):
    /// only then do two ranks' [`Port::now`] compare.
    fn virtual_clock(&self) -> bool;
    /// Lets `d` of (emulated) compute time pass.
    fn sleep(&self, d: Duration) -> Pending;
    /// Leaves the job: `abort` tells the peers this rank failed.
    fn leave(&self, abort: bool);
}

/// Blocks the current thread on a future (for the threaded executor and plain `main`s).
pub fn block_on<F: Future>(f: F) -> F::Output {
    pollster::block_on(f)
}

/// The outcome of every rank of a job.
#[derive(Debug)]
pub struct JobResult<R> {
    /// Per rank: the task's value, or its error.
    pub ranks: Vec<Result<R, Error>>,
    /// The rank whose failure came first (the likely root cause), if any failed.
    pub first_failure: Option<usize>,
}

impl<R> JobResult<R> {
    /// Every rank's value, or the first failure.
    pub fn into_all(self) -> Result<Vec<R>, Error> {
        if let Some(i) = self.first_failure {
            let mut ranks = self.ranks;
            return Err(match ranks.swap_remove(i) {
                Err(e) => e,
                Ok(_) => Error::Task {
                    rank: i,
                    message: "failed".into(),
                },
            });
        }
        self.ranks.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_awaited_twice_names_its_rank() {
        let mut pending = Pending::new(3, Slot::ready(Ok(Response::Done)));
        assert!(matches!(block_on(&mut pending), Ok(Response::Done)));
        match block_on(&mut pending) {
            Err(Error::Protocol { rank, .. }) => assert_eq!(rank, 3),
            other => panic!("unexpected {other:?}"),
        }
    }
}
