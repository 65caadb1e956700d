//! Under `mpirun` (built with `--features mpi`; needs Open MPI): the collectives benchmark next
//! to `MPI_Allreduce`, and a rank killed mid-run ending the job with a message naming it.
//! `WAGMA_STRESS=N` repeats the kill N times.
#![cfg(feature = "mpi")]

mod common;
use common::{bench_collectives_rows, mpirun, stress_reps, tmp, wagma};

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

#[test]
fn bench_collectives_runs_next_to_mpi_allreduce() {
    // Started by the user's mpirun (rank 0 reports), and by wagma itself (it runs mpirun and
    // collects rank 0's result).
    let mut own = wagma();
    // The mpirun that wagma starts inherits the limit.
    own.env("MPIEXEC_TIMEOUT", "600");
    for cmd in [mpirun(4), own] {
        let rows = bench_collectives_rows(cmd, "mpi", 4);
        // Our seven collectives, then MPI_Allreduce on the world and on a group communicator.
        assert_eq!(rows.len(), 9, "{rows:?}");
        assert_eq!(rows[7]["collective"], "MPI_Allreduce");
        assert_eq!(rows[8]["members"], 2);
        // Each rank is a process: the CPU our collectives kept busy is measured (not that of
        // MPI_Allreduce, timed by MPI's own loop).
        rows[..7].iter().for_each(common::assert_cpu_measured);
        assert!(rows[7..].iter().all(|r| r["cpu"].is_null()), "{rows:?}");
    }
}

/// The process of MPI rank `rank` whose command line mentions `marker`.
fn find_rank(marker: &Path, rank: usize) -> Option<i32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(&*marker.to_string_lossy()) {
            continue;
        }
        let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
        if env.split(|&b| b == 0).any(|kv| kv == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// An `mpirun` job that a failed assertion does not leave training: dropping it asks mpirun to
/// stop its ranks (SIGTERM, which it forwards), then kills it.
struct Job(Option<Child>);

impl Job {
    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("the job is running")
    }

    fn wait_with_output(mut self) -> std::process::Output {
        self.0
            .take()
            .expect("the job is running")
            .wait_with_output()
            .unwrap()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let Some(c) = &mut self.0 else { return };
        if let Ok(pid) = i32::try_from(c.id()) {
            // SAFETY: kill(2) on this test's own child has no memory effects here.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if c.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn kill_one(rep: u64) -> (bool, bool, Duration) {
    let out = tmp(&format!("kill-{rep}"));
    let victim = 1 + (rep as usize % 3);
    let child: Child = mpirun(4)
        .args([
            "train",
            "--transport",
            "mpi",
            "--steps",
            "100000",
            "--eval-every",
            "5",
            "--timeout",
            "5",
            "--dataset",
            "builtin",
            "--quiet",
            "true",
            "--out",
        ])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut job = Job(Some(child));
    let t0 = Instant::now();
    let started = loop {
        let evaluated =
            std::fs::read_to_string(out.join("progress.jsonl")).is_ok_and(|m| !m.is_empty());
        if evaluated || t0.elapsed() > Duration::from_secs(120) {
            break evaluated;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(started, "the job did not start training");
    std::thread::sleep(Duration::from_millis((rep * 53) % 400));
    let pid = find_rank(&out, victim).expect("the victim's process");
    // SAFETY: kill(2) on a process of this test's job has no memory effects here.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let killed = Instant::now();
    let mut stopped = false;
    while killed.elapsed() < Duration::from_secs(5 + 30) {
        if job.child().try_wait().unwrap().is_some() {
            stopped = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = killed.elapsed();
    if !stopped {
        let _ = job.child().kill();
    }
    let o = job.wait_with_output();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let named = all.contains(&format!("rank {victim}"));
    if !named {
        eprintln!("rep {rep}: the output does not name rank {victim}:\n{all}");
    }
    let _ = std::fs::remove_dir_all(&out);
    (stopped && !o.status.success(), named, took)
}

#[test]
fn killing_an_mpi_rank_ends_the_job_naming_it() {
    let reps = stress_reps(1);
    let (mut ended, mut named) = (0, 0);
    for rep in 0..reps {
        let (e, n, took) = kill_one(rep);
        eprintln!(
            "rep {rep}: ended {e}, named {n}, after {:.1} s",
            took.as_secs_f64()
        );
        ended += usize::from(e);
        named += usize::from(n);
    }
    eprintln!(
        "{reps} kills of one of 4 MPI ranks: {ended} ended with an error, {named} named the rank"
    );
    assert_eq!(ended, reps as usize);
    assert_eq!(named, reps as usize);
}
