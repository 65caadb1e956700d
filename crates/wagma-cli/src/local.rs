//! Local multi-process jobs over TCP on loopback: start P copies of a command with the
//! rendezvous environment (each bound to CPUs of its own where there are enough), wait for
//! them, name the first rank that failed.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use wagma::transport::tcp::env;

/// The processes of a local job.
pub struct LocalJob {
    children: Vec<Child>,
}

/// The descriptor under which rank 0 finds the rendezvous socket.
const RENDEZVOUS_FD_NUMBER: i32 = 3;

/// Makes `socket` descriptor `fd` of the child that `cmd` starts (and only of that child).
fn inherit_as(cmd: &mut Command, socket: &std::net::TcpListener, fd: i32) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let src = socket.as_raw_fd();
    // SAFETY: between fork and exec the closure only calls dup2(2) or fcntl(2)
    // (async-signal-safe) on
    // descriptors that exist in the child; dup2 leaves the new descriptor open across exec.
    unsafe {
        cmd.pre_exec(move || {
            let ok = if src == fd {
                // dup2 onto itself keeps close-on-exec: clear it instead.
                libc::fcntl(fd, libc::F_SETFD, 0) >= 0
            } else {
                libc::dup2(src, fd) >= 0
            };
            if ok {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// The variable that sets the [`Binding`] of local jobs (`auto`, `core` or `none`).
pub const BIND_ENV: &str = "WAGMA_CPU_BIND";

/// Where the processes of a local job may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Binding {
    /// Each rank on physical cores of its own (with their hyperthreads), an equal share of
    /// those this process may use, when there are at least as many as ranks (two ranks on two
    /// cores: one each, as `mpirun` binds two ranks); unbound otherwise, as `mpirun` leaves an
    /// oversubscribed job.
    Auto,
    /// Rank r on one CPU: the first thread of each core in turn, then the second, round robin
    /// when there are more ranks than CPUs.
    Core,
    /// No binding: the OS places every thread of every rank.
    None,
}

impl Binding {
    /// The binding [`BIND_ENV`] names, `Auto` when it is not set.
    pub fn from_env() -> anyhow::Result<Binding> {
        match std::env::var(BIND_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Binding::Auto),
            Ok(v) => Binding::parse(&v),
            Err(e) => Err(anyhow::Error::new(e).context(format!("reading {BIND_ENV}"))),
        }
    }

    /// The binding a value of [`BIND_ENV`] names.
    fn parse(v: &str) -> anyhow::Result<Binding> {
        use clap::ValueEnum;
        Binding::from_str(v.trim(), true)
            .map_err(|_| anyhow::anyhow!("{BIND_ENV}={v:?} is not one of auto, core, none"))
    }

    /// The CPUs of each of `ranks` ranks (`None`: unbound). `usable`: the CPUs this process
    /// may run on, grouped by physical core (`None`: unknown); `busy`: how many CPUs it may
    /// keep busy at once (fewer under a CPU quota).
    fn plan(
        self,
        ranks: usize,
        usable: Option<&[Vec<usize>]>,
        busy: usize,
    ) -> anyhow::Result<Vec<Option<Vec<usize>>>> {
        let unbound = || vec![None; ranks];
        let cores = usable.unwrap_or_default();
        Ok(match self {
            Binding::None => unbound(),
            Binding::Core => {
                // The first thread of every core, then the second of every core, and so on:
                // the first ranks get physical cores of their own.
                let deepest = cores.iter().map(Vec::len).max().unwrap_or(0);
                let order: Vec<usize> = (0..deepest)
                    .flat_map(|t| cores.iter().filter_map(move |c| c.get(t).copied()))
                    .collect();
                if order.is_empty() {
                    bail!(
                        "--cpu-bind core: the CPUs this process may use cannot be read; use \
                         --cpu-bind none"
                    );
                }
                (0..ranks)
                    .map(|r| Some(vec![order[r % order.len()]]))
                    .collect()
            }
            Binding::Auto if ranks > 0 && ranks <= cores.len().min(busy) => {
                // Whole cores: threads of one core would make two ranks share it.
                let share = cores.len() / ranks;
                cores
                    .chunks(share)
                    .take(ranks)
                    .map(|c| Some(c.concat()))
                    .collect()
            }
            Binding::Auto => unbound(),
        })
    }
}

/// The CPUs in a Linux CPU list (`0-3,8,10-11`); `None` if it is not one.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// `cpus` grouped by physical core (hyperthreads of one core together), cores in the order of
/// their first CPU; `siblings(c)` lists the CPUs that share c's core (each CPU is a core of
/// its own where that is unknown).
fn by_core(cpus: &[usize], siblings: impl Fn(usize) -> Option<Vec<usize>>) -> Vec<Vec<usize>> {
    let mut cores: Vec<(usize, Vec<usize>)> = Vec::new();
    for &c in cpus {
        let core = siblings(c).and_then(|s| s.into_iter().min()).unwrap_or(c);
        match cores.iter_mut().find(|(id, _)| *id == core) {
            Some((_, threads)) => threads.push(c),
            None => cores.push((core, vec![c])),
        }
    }
    cores.into_iter().map(|(_, threads)| threads).collect()
}

/// The CPUs this process may run on, grouped by physical core (from sysfs).
fn usable_cores() -> Option<Vec<Vec<usize>>> {
    let cpus = usable_cpus()?;
    Some(by_core(&cpus, |c| {
        let path = format!("/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list");
        parse_cpu_list(&std::fs::read_to_string(path).ok()?)
    }))
}

/// The CPUs this process may run on (its affinity mask), in ascending order; `None` when the
/// mask cannot be read (as on a machine of more than 1,024 CPUs).
fn usable_cpus() -> Option<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set; sched_getaffinity writes at most
    // the size it is given, and CPU_ISSET reads within the set for indices below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some(
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect(),
        )
    }
}

/// Binds the process that `cmd` starts, all its threads included, to `cpus` (from
/// [`usable_cores`]). A failure fails the start when `strict`, and leaves the process unbound
/// otherwise (a CPU may have gone offline since it was read).
fn bind_to(cmd: &mut Command, cpus: &[usize], strict: bool) {
    use std::os::unix::process::CommandExt;
    // SAFETY: an all-zero cpu_set_t is a valid empty set, and every CPU is below CPU_SETSIZE
    // (`usable_cpus`, which `usable_cores` groups, reads no higher).
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        set
    };
    // SAFETY: between fork and exec the closure only calls sched_setaffinity(2), a system
    // call, on the child itself; the set was built before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let failed =
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0;
            if failed && strict {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        });
    }
}

impl LocalJob {
    /// Starts `ranks` processes of `program args`, each with the TCP rendezvous environment
    /// and `extra` variables, placed on cores as `binding` says; stdout is piped when
    /// `capture` is set, stderr is inherited.
    pub fn spawn(
        ranks: usize,
        program: &std::path::Path,
        args: &[String],
        extra: &[(&str, String)],
        capture: bool,
        binding: Binding,
    ) -> anyhow::Result<LocalJob> {
        // A fresh job id and secret from the OS's random source for every job; they reach the
        // ranks through their environment only, never a command line.
        let cred = wagma::transport::tcp::Credentials::random()?;
        let secret = String::from_utf8_lossy(&cred.secret).into_owned();
        let job_id = cred.job_id;
        // The rendezvous port stays bound from here on: this process binds it and hands the
        // listening socket to rank 0 (no port is chosen, closed and bound again later, which
        // another process could take in between).
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .context("binding the rendezvous on loopback")?;
        let rendezvous = listener.local_addr()?.to_string();
        let busy = std::thread::available_parallelism().map_or(1, |n| n.get());
        let plan = binding.plan(ranks, usable_cores().as_deref(), busy)?;
        let mut children = Vec::with_capacity(ranks);
        for (rank, cpus) in plan.into_iter().enumerate() {
            let mut cmd = Command::new(program);
            cmd.args(args)
                .env(env::RANK, rank.to_string())
                .env(env::WORLD_SIZE, ranks.to_string())
                .env(env::RENDEZVOUS, &rendezvous)
                .env(env::JOB_ID, &job_id)
                .env(env::SECRET, &secret)
                .env_remove(env::SECRET_FILE)
                .env_remove(env::RENDEZVOUS_FD)
                .stdin(Stdio::null());
            if rank == 0 {
                inherit_as(&mut cmd, &listener, RENDEZVOUS_FD_NUMBER);
                cmd.env(env::RENDEZVOUS_FD, RENDEZVOUS_FD_NUMBER.to_string());
            }
            for (k, v) in extra {
                cmd.env(k, v);
            }
            if let Some(cpus) = &cpus {
                bind_to(&mut cmd, cpus, binding == Binding::Core);
            }
            if capture {
                cmd.stdout(Stdio::piped());
            }
            match cmd.spawn() {
                Ok(c) => children.push(c),
                Err(e) => {
                    for c in &mut children {
                        let _ = c.kill();
                    }
                    let on = cpus.map_or(String::new(), |c| format!(" on CPUs {c:?}"));
                    return Err(anyhow::Error::new(e)
                        .context(format!("starting rank {rank}{on}: {}", program.display())));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every CPU a core of its own.
    fn single(cpus: &[usize]) -> Vec<Vec<usize>> {
        cpus.iter().map(|&c| vec![c]).collect()
    }

    fn plan(
        b: Binding,
        ranks: usize,
        cores: &[Vec<usize>],
        busy: usize,
    ) -> Vec<Option<Vec<usize>>> {
        b.plan(ranks, Some(cores), busy).unwrap()
    }

    #[test]
    fn auto_gives_each_rank_an_equal_share_only_when_every_rank_has_a_core() {
        let one = |c: usize| Some(vec![c]);
        assert_eq!(
            plan(Binding::Auto, 2, &single(&[0, 1]), 2),
            [one(0), one(1)]
        );
        // The CPUs this process may use, not the machine's first ones; a share each.
        assert_eq!(
            plan(Binding::Auto, 2, &single(&[3, 5, 6, 7, 9]), 5),
            [Some(vec![3, 5]), Some(vec![6, 7])]
        );
        assert_eq!(
            plan(Binding::Auto, 3, &single(&[0, 1]), 2),
            [None, None, None]
        );
        // A quota of two CPUs' time over eight CPUs: four ranks would share two.
        let eight = single(&[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(plan(Binding::Auto, 4, &eight, 2), vec![None; 4]);
        assert_eq!(Binding::Auto.plan(2, None, 8).unwrap(), [None, None]);
        assert_eq!(plan(Binding::Auto, 0, &single(&[0, 1]), 2), []);
    }

    #[test]
    fn auto_shares_whole_cores_and_counts_cores_not_threads() {
        // Two cores of two threads, numbered as on x86 (siblings 0 and 2, 1 and 3).
        let cores = vec![vec![0, 2], vec![1, 3]];
        assert_eq!(
            plan(Binding::Auto, 2, &cores, 4),
            [Some(vec![0, 2]), Some(vec![1, 3])]
        );
        // Four ranks on two cores are oversubscribed, hyperthreads or not.
        assert_eq!(plan(Binding::Auto, 4, &cores, 4), vec![None; 4]);
    }

    #[test]
    fn core_binds_one_cpu_round_robin_and_none_never_binds() {
        let one = |c: usize| Some(vec![c]);
        assert_eq!(
            plan(Binding::Core, 5, &single(&[0, 1]), 2),
            [one(0), one(1), one(0), one(1), one(0)]
        );
        // Distinct cores first, then their second threads.
        let cores = vec![vec![0, 2], vec![1, 3]];
        assert_eq!(
            plan(Binding::Core, 4, &cores, 4),
            [one(0), one(1), one(2), one(3)]
        );
        let e = Binding::Core.plan(2, None, 2).unwrap_err().to_string();
        assert!(e.contains("cannot be read"), "{e}");
        assert!(Binding::Core.plan(2, Some(&[]), 2).is_err());
        assert_eq!(
            plan(Binding::None, 2, &single(&[0, 1, 2, 3]), 4),
            [None, None]
        );
    }

    #[test]
    fn cpus_are_grouped_by_the_core_they_share() {
        assert_eq!(
            parse_cpu_list("0-2,8,10-11\n"),
            Some(vec![0, 1, 2, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("x"), None);
        let siblings = |c: usize| {
            Some(if c % 4 < 2 {
                vec![c % 4, c % 4 + 2]
            } else {
                vec![c % 4 - 2, c % 4]
            })
        };
        assert_eq!(by_core(&[0, 1, 2, 3], siblings), [vec![0, 2], vec![1, 3]]);
        // A CPU outside the mask is left out; an unknown topology makes each CPU a core.
        assert_eq!(by_core(&[0, 1, 3], siblings), [vec![0], vec![1, 3]]);
        assert_eq!(by_core(&[4, 5], |_| None), [vec![4], vec![5]]);
    }

    #[test]
    fn the_binding_variable_is_checked() {
        assert_eq!(Binding::parse("none").unwrap(), Binding::None);
        assert_eq!(Binding::parse(" Core ").unwrap(), Binding::Core);
        let e = Binding::parse("socket").unwrap_err().to_string();
        assert!(
            e.contains("WAGMA_CPU_BIND=\"socket\" is not one of auto, core, none"),
            "{e}"
        );
    }

    #[test]
    fn this_process_may_use_some_core() {
        let cores = usable_cores().unwrap();
        assert!(!cores.is_empty());
        let mut cpus: Vec<usize> = cores.concat();
        let n = cpus.len();
        cpus.sort_unstable();
        cpus.dedup();
        assert_eq!(cpus.len(), n, "a CPU in two cores: {cores:?}");
        assert_eq!(Some(cpus), usable_cpus());
    }
}
