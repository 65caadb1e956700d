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

/// A free loopback port for the rendezvous.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")
        .context("finding a free port")?
        .local_addr()?
        .port())
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
        let rendezvous = format!("127.0.0.1:{}", free_port()?);
        let (job_id, secret) = fresh_credentials();
        let mut children = Vec::with_capacity(ranks);
        for rank in 0..ranks {
            let mut cmd = Command::new(program);
            cmd.args(args)
                .env(env::RANK, rank.to_string())
                .env(env::WORLD_SIZE, ranks.to_string())
                .env(env::RENDEZVOUS, &rendezvous)
                .env(env::JOB_ID, &job_id)
                .env(env::SECRET, &secret)
                .stdin(Stdio::null());
            for (k, v) in extra {
                cmd.env(k, v);
            }
            if capture {
                cmd.stdout(Stdio::piped());
            }
            let child = cmd
                .spawn()
                .with_context(|| format!("starting rank {rank}: {}", program.display()))?;
            children.push(child);
        }
        Ok(LocalJob { children })
    }

    /// The child processes.
    pub fn children_mut(&mut self) -> &mut [Child] {
        &mut self.children
    }

    /// Waits for every process (killing all after `limit`); fails naming the first rank that
    /// exited unsuccessfully.
    pub fn wait(self, limit: Option<Duration>) -> anyhow::Result<Vec<ExitStatus>> {
        self.wait_or_stop(limit, &AtomicBool::new(false))
    }

    /// Like [`LocalJob::wait`]; when `stop` becomes true (a signal), the processes get SIGTERM
    /// and, if they are still alive 10 seconds later, SIGKILL.
    pub fn wait_or_stop(
        mut self,
        limit: Option<Duration>,
        stop: &AtomicBool,
    ) -> anyhow::Result<Vec<ExitStatus>> {
        let start = Instant::now();
        let mut stopping: Option<Instant> = None;
        let n = self.children.len();
        let mut status: Vec<Option<(ExitStatus, Duration)>> = vec![None; n];
        while status.iter().any(Option::is_none) {
            for (i, c) in self.children.iter_mut().enumerate() {
                if status[i].is_none()
                    && let Some(s) = c.try_wait()?
                {
                    status[i] = Some((s, start.elapsed()));
                }
            }
            if limit.is_some_and(|l| start.elapsed() > l) {
                for c in &mut self.children {
                    let _ = c.kill();
                }
                bail!(
                    "the job did not finish within {:?}",
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
        let done: Vec<(ExitStatus, Duration)> = status.into_iter().flatten().collect();
        if let Some((rank, (s, at))) = done
            .iter()
            .enumerate()
            .filter(|(_, (s, _))| !s.success())
            .min_by_key(|(_, (_, at))| *at)
        {
            bail!(
                "rank {rank} failed first ({s}, after {:.1} s)",
                at.as_secs_f64()
            );
        }
        Ok(done.into_iter().map(|(s, _)| s).collect())
    }
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
