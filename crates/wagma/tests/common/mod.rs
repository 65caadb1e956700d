//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
    for c in r.members.iter() {
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

/// A fresh, empty directory under the system's temporary directory, removed with its contents
/// when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates it; `tag` only makes the name readable.
    pub fn new(tag: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        loop {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let name = format!(
                "wagma-{tag}-{}-{}-{nanos}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let path = std::env::temp_dir().join(name);
            match std::fs::create_dir(&path) {
                Ok(()) => return TempDir(path),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => panic!("creating {}: {e}", path.display()),
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The rendezvous address rank 0 bound on port 0, once it has written it to `file`
/// ([`wagma::transport::tcp::read_rendezvous`]), polled every 5 ms. `rank0_ended` returns why
/// rank 0 stopped (`None` while it runs): the wait then fails at once with that reason. The
/// 120 s limit only catches a rank 0 that hangs before binding; a correct one writes the file
/// within milliseconds of starting, even on a loaded machine far less than this.
pub fn await_rendezvous(file: &Path, mut rank0_ended: impl FnMut() -> Option<String>) -> String {
    let limit = Duration::from_secs(120);
    let start = Instant::now();
    loop {
        if let Some(addr) = wagma::transport::tcp::read_rendezvous(file) {
            return addr;
        }
        if let Some(why) = rank0_ended() {
            // Rank 0 cannot finish before the others join: whatever it wrote, it failed.
            panic!(
                "rank 0 ended before writing its rendezvous address to {}: {why}",
                file.display()
            );
        }
        assert!(
            start.elapsed() < limit,
            "rank 0 wrote no rendezvous address to {} within {limit:?}",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
