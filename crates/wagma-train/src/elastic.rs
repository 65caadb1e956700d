//! Elastic runs: a restarted rank asks to rejoin and waits for its welcome; the living ranks
//! admit it at a global average and hand it the consensus state.

use std::time::Duration;

use wagma::algo::{Resume, Worker};
use wagma::{Comm, Payload};

use crate::error::TrainError;
use crate::trainer::Initial;

/// Where a rejoining rank starts.
pub(crate) struct Rejoined {
    pub(crate) params: Vec<f32>,
    pub(crate) buffers: Vec<f32>,
    pub(crate) resume: Resume,
    pub(crate) samples: u64,
    pub(crate) train_s: f64,
    pub(crate) alive: usize,
}

/// A restarted rank: announces itself and waits (at most ten collective timeouts) to be
/// admitted at the job's next global average, receiving the consensus state.
pub(crate) async fn rejoin(
    comm: &mut Comm,
    init: &Initial,
    timeout: Duration,
) -> Result<Rejoined, TrainError> {
    comm.announce_rejoin().await?;
    tracing::info!(
        rank = comm.rank(),
        "asked to rejoin; waiting for the next global average"
    );
    let (state, info) = comm.await_welcome(timeout.saturating_mul(10)).await?;
    let (np, nb) = (init.params.len(), init.buffers.len());
    let state = state.into_vec();
    let &[iteration, samples, train_s, alive] = info.as_slice() else {
        return Err(TrainError::Peer(format!(
            "the welcome carries {} values instead of 4",
            info.len()
        )));
    };
    if state.len() < np + nb {
        return Err(TrainError::Peer(format!(
            "the welcome carries {} values for a model of {}",
            state.len(),
            np + nb
        )));
    }
    tracing::info!(rank = comm.rank(), iteration, "rejoined the job");
    Ok(Rejoined {
        params: state[..np].to_vec(),
        buffers: state[np..np + nb].to_vec(),
        resume: Resume {
            iteration,
            optimizer_state: state[np + nb..].to_vec(),
            weight: None,
        },
        samples,
        train_s: f64::from_bits(train_s),
        alive: usize::try_from(alive).unwrap_or(usize::MAX),
    })
}

/// Living ranks at a global average (elastic mode): agree on the restarted ranks to admit,
/// admit them, and have the lowest living rank send each its starting state; returns the
/// number of ranks training from now on when some were admitted.
pub(crate) async fn admit_joiners(
    worker: &mut Worker<'_>,
    done: u64,
    samples: u64,
    train_s: f64,
) -> Result<Option<usize>, TrainError> {
    let comm = worker.comm();
    let p = comm.size();
    let mut asked = vec![0.0f32; p];
    for r in comm.joining_ranks().await? {
        asked[r] = 1.0;
    }
    // Every living rank must admit the same ranks: those that any of them heard from.
    let asked = comm.allreduce(Payload::Data(asked)).await?;
    let joiners: Vec<usize> = (0..p).filter(|&r| asked.as_slice()[r] > 0.0).collect();
    if joiners.is_empty() {
        return Ok(None);
    }
    let living = comm.living_ranks().await?;
    let leader = living.first().copied();
    let alive = living.len() + joiners.len();
    comm.admit(&joiners).await?;
    if leader == Some(comm.rank()) {
        let mut state = worker.params().to_vec();
        state.extend_from_slice(worker.buffers());
        state.extend_from_slice(worker.optimizer_state());
        let info = [done, samples, train_s.to_bits(), alive as u64];
        for &r in &joiners {
            let data = Payload::Data(state.clone());
            worker.comm().welcome(r, data, &info).await?;
        }
    }
    // A barrier, not `quiesce`: a joiner's clock started later than the others', so aligning
    // clocks would stall it (and WAGMA has nothing in flight at a global average).
    worker.comm().barrier().await?;
    tracing::info!(
        rank = worker.comm().rank(),
        ?joiners,
        iteration = done,
        "admitted"
    );
    Ok(Some(alive))
}
