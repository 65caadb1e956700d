//! Local multi-process jobs over TCP on loopback: start P copies of a command with the
//! rendezvous environment, wait for them, name the first rank that failed.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use wagma::transport::tcp::env;

/// The processes of a local job.
pub struct LocalJob {
    children: Vec<Child>,
}

/// How long rank 0 may take to bind its rendezvous and say where.
const RENDEZVOUS_WAIT: Duration = Duration::from_secs(60);

/// A fresh private directory under the system's temporary directory.
fn tempdir() -> anyhow::Result<std::path::PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("wagma-launch-{}-{nanos:x}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// A random job id and secret for a job started by this process.
pub fn fresh_credentials() -> (String, String) {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let pid = std::process::id();
    (
        format!("local-{pid}-{seed:x}"),
        format!(
            "{:x}{:x}",
            seed.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            u128::from(pid) << 64 ^ seed
        ),
    )
}

impl LocalJob {
    /// Starts `ranks` processes of `program args`, each with the TCP rendezvous environment
    /// and `extra` variables; stdout is piped when `capture` is set, stderr is inherited.
    pub fn spawn(
        ranks: usize,
        program: &std::path::Path,
        args: &[String],
        extra: &[(&str, String)],
        capture: bool,
    ) -> anyhow::Result<LocalJob> {
        let (job_id, secret) = fresh_credentials();
        // Rank 0 binds port 0 itself and writes the port it got; the others start once it has
        // (no port is chosen here and bound again later, which another process could take).
        let dir = tempdir()?;
        let file = dir.join("rendezvous");
        let start = |rank: usize, rendezvous: &str, file: Option<&std::path::Path>| {
            let mut cmd = Command::new(program);
            cmd.args(args)
                .env(env::RANK, rank.to_string())
                .env(env::WORLD_SIZE, ranks.to_string())
                .env(env::RENDEZVOUS, rendezvous)
                .env(env::JOB_ID, &job_id)
                .env(env::SECRET, &secret)
                .stdin(Stdio::null());
            if let Some(f) = file {
                cmd.env(env::RENDEZVOUS_FILE, f);
            }
            for (k, v) in extra {
                cmd.env(k, v);
            }
            if capture {
                cmd.stdout(Stdio::piped());
            }
            cmd.spawn()
                .with_context(|| format!("starting rank {rank}: {}", program.display()))
        };
        let mut children = Vec::with_capacity(ranks);
        children.push(start(0, "127.0.0.1:0", Some(&file))?);
        let waited = Instant::now();
        let rendezvous = loop {
            if let Some(a) = wagma::transport::tcp::read_rendezvous(&file) {
                break a;
            }
            if let Some(s) = children[0].try_wait()? {
                let _ = std::fs::remove_dir_all(&dir);
                bail!("rank 0 exited ({s}) before opening its rendezvous");
            }
            if waited.elapsed() > RENDEZVOUS_WAIT {
                let _ = children[0].kill();
                let _ = std::fs::remove_dir_all(&dir);
                bail!("rank 0 did not open its rendezvous within {RENDEZVOUS_WAIT:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let _ = std::fs::remove_dir_all(&dir);
        for rank in 1..ranks {
            match start(rank, &rendezvous, None) {
                Ok(c) => children.push(c),
                Err(e) => {
                    for c in &mut children {
                        let _ = c.kill();
                    }
                    return Err(e);
                }
            }
        }
        Ok(LocalJob { children })
    }

    /// The child processes.
    pub fn children_mut(&mut self) -> &mut [Child] {
        &mut self.children
    }

    /// Waits for every process (killing all after `limit`); fails naming the first rank that
    /// exited unsuccessfully.
    pub fn wait(self, limit: Option<Duration>) -> anyhow::Result<Vec<RankExit>> {
        let exits = self.wait_or_stop(limit, &AtomicBool::new(false))?;
        if let Some(f) = first_failure(&exits) {
            bail!("{}\n{}", f.headline(), summary(&exits));
        }
        Ok(exits)
    }

    /// Waits for every process (killing all after `limit`) and reports how each ended; when
    /// `stop` becomes true (a signal), the processes get SIGTERM and, if they are still alive
    /// 10 seconds later, SIGKILL.
    pub fn wait_or_stop(
        mut self,
        limit: Option<Duration>,
        stop: &AtomicBool,
    ) -> anyhow::Result<Vec<RankExit>> {
        let start = Instant::now();
        let mut stopping: Option<Instant> = None;
        let n = self.children.len();
        let mut status: Vec<Option<RankExit>> = vec![None; n];
        while status.iter().any(Option::is_none) {
            for (rank, c) in self.children.iter_mut().enumerate() {
                if status[rank].is_none()
                    && let Some(s) = c.try_wait()?
                {
                    status[rank] = Some(RankExit {
                        rank,
                        status: s,
                        after: start.elapsed(),
                    });
                }
            }
            if limit.is_some_and(|l| start.elapsed() > l) {
                for c in &mut self.children {
                    let _ = c.kill();
                }
                let alive: Vec<usize> = (0..n).filter(|&r| status[r].is_none()).collect();
                bail!(
                    "the job did not finish within {:?}; ranks {alive:?} were still running",
                    limit.unwrap_or_default()
                );
            }
            if stop.load(Ordering::Relaxed) && stopping.is_none() {
                stopping = Some(Instant::now());
                for (i, c) in self.children.iter().enumerate() {
                    if status[i].is_none() {
                        terminate(c);
                    }
                }
            }
            if stopping.is_some_and(|t| t.elapsed() > Duration::from_secs(10)) {
                for c in &mut self.children {
                    let _ = c.kill();
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(status.into_iter().flatten().collect())
    }
}

/// How one rank's process ended.
#[derive(Debug, Clone, Copy)]
pub struct RankExit {
    /// The rank.
    pub rank: usize,
    /// Its exit status.
    pub status: ExitStatus,
    /// When, from the start of the job.
    pub after: Duration,
}

impl RankExit {
    /// One line naming the rank and how it ended.
    pub fn headline(&self) -> String {
        format!(
            "rank {} failed first ({}, after {:.1} s)",
            self.rank,
            self.status,
            self.after.as_secs_f64()
        )
    }
}

/// The rank that failed first, if any.
pub fn first_failure(exits: &[RankExit]) -> Option<&RankExit> {
    exits
        .iter()
        .filter(|e| !e.status.success())
        .min_by_key(|e| e.after)
}

/// A one-screen account of how the ranks ended: failures in the order they happened, and the
/// successful ranks as a count.
pub fn summary(exits: &[RankExit]) -> String {
    let mut failed: Vec<&RankExit> = exits.iter().filter(|e| !e.status.success()).collect();
    failed.sort_by_key(|e| e.after);
    let ok = exits.len() - failed.len();
    let mut out = format!("{} of {} ranks failed", failed.len(), exits.len());
    for e in failed.iter().take(12) {
        out.push_str(&format!(
            "\n  rank {:>4}: {} after {:.1} s",
            e.rank,
            e.status,
            e.after.as_secs_f64()
        ));
    }
    if failed.len() > 12 {
        out.push_str(&format!("\n  ... and {} more", failed.len() - 12));
    }
    if ok > 0 {
        out.push_str(&format!("\n  {ok} ranks exited successfully"));
    }
    out
}

/// Sends SIGTERM to a child (a clean stop: it may still write its outputs).
fn terminate(c: &Child) {
    if let Ok(pid) = libc::pid_t::try_from(c.id()) {
        // SAFETY: kill(2) with a pid we spawned and a valid signal number has no memory effects.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
}
