//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use wagma::engine::{ContributionMode, ReadMode, RoundKind, Trigger};
use wagma::exec::{JobResult, threaded, virtual_time};
use wagma::topology::{Grouping, GroupingKind};
use wagma::{Comm, EngineConfig, Error, Payload, RoundResult, StreamConfig};

/// The value a rank publishes after `steps` local steps, element `i`: distinct per rank and
/// step so that a sum reveals exactly which contributions went into it.
pub fn value(rank: usize, steps: u64, i: usize) -> f32 {
    let x = (rank as f64 * 1.618 + steps as f64 * 0.577 + i as f64 * 0.1).sin();
    (x * 4.0 + rank as f64 * 0.25) as f32
}

pub fn model(rank: usize, steps: u64, len: usize) -> Vec<f32> {
    (0..len).map(|i| value(rank, steps, i)).collect()
}

/// Relative distance of `got` to the f64 reference `want`.
pub fn close(got: &[f32], want: &[f64]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(&g, &w)| (g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()))
}

/// Checks a round result against its reported members: the group of the round (or everyone
/// at a sync), staleness within `tau`, and the sum equal to the members' contributions.
pub fn check_round(
    rank: usize,
    r: &RoundResult,
    grouping: &Grouping,
    tau: Option<u64>,
    len: usize,
) {
    assert!(
        r.round >= r.requested,
        "rank {rank}: result of round {} for {}",
        r.round,
        r.requested
    );
    let members: Vec<usize> = r.members.iter().map(|c| c.rank).collect();
    let want_members = match r.kind {
        RoundKind::Group => grouping.group_of(rank, r.round),
        RoundKind::Sync => (0..grouping.ranks()).collect(),
    };
    assert_eq!(members, want_members, "rank {rank} round {}", r.round);
    let mut want = vec![0f64; len];
    for c in &r.members {
        assert!(c.steps <= r.round + 1);
        if let Some(tau) = tau {
            assert!(
                c.staleness(r.round) <= tau,
                "staleness {} > tau {tau}",
                c.staleness(r.round)
            );
        }
        // After a sync at round s every rank's published model is the consensus (embodying
        // s + 1 steps); that is what a passive member contributes until it publishes again.
        let consensus = c.steps > 0 && tau.is_some_and(|tau| c.steps % tau == 0);
        let p = grouping.ranks();
        for (i, w) in want.iter_mut().enumerate() {
            *w += if consensus {
                (0..p).map(|r| value(r, c.steps, i) as f64).sum::<f64>() / p as f64
            } else {
                value(c.rank, c.steps, i) as f64
            };
        }
    }
    assert!(
        close(r.sum.as_slice(), &want),
        "rank {rank} round {}: sum differs from its members",
        r.round
    );
    assert_eq!(r.fresh, r.own.steps == r.requested + 1);
    if r.kind == RoundKind::Sync {
        assert!(
            r.members.iter().all(|c| c.steps == r.round + 1),
            "a sync must wait for everyone"
        );
    }
}

pub fn stream(
    group_size: usize,
    grouping: GroupingKind,
    trigger: Trigger,
    mode: ContributionMode,
    read: ReadMode,
    tau: Option<u64>,
    initial: Vec<f32>,
) -> StreamConfig {
    StreamConfig {
        group_size,
        grouping,
        trigger,
        mode,
        read,
        sync_period: tau,
        initial: Payload::Data(initial),
        initial_steps: 0,
    }
}

/// How a test job runs.
#[derive(Debug, Clone, Copy)]
pub enum Exec {
    Virtual(u64),
    Threads,
}

pub fn run<R: Send, F>(exec: Exec, ranks: usize, cfg: EngineConfig, task: F) -> JobResult<R>
where
    F: AsyncFn(&mut Comm) -> Result<R, Error> + Sync,
{
    match exec {
        Exec::Virtual(seed) => {
            virtual_time::run(ranks, cfg, virtual_time::VirtualConfig::seeded(seed), task)
        }
        Exec::Threads => threaded::run(ranks, cfg, task),
    }
    .expect("at least one rank")
}

pub fn ms(x: u64) -> Duration {
    Duration::from_millis(x)
}
