//! Failures of real processes over TCP: a rank killed mid-run ends the job within the timeout
//! with errors that name it; with elastic continuation the survivors finish and still learn.
//!
//! `WAGMA_STRESS=N` repeats the kill test and the rejoin test N times (for example 50) with
//! varying victims and kill times, and prints the counts.

mod common;
use common::{stress_reps, tmp, wagma};

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One job at a time: four jobs of 3-8 training ranks each at once on a 2-core machine could
/// starve a healthy rank past the seconds-long timeouts these tests use, and it would be
/// reported lost.
static ONE_JOB_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Starts `n` ranks of `wagma ARGS` over TCP; each rank's stderr goes to `dir/rank-R.log`.
/// Rank 0 binds its rendezvous on port 0 and writes the address it got to a file; the others
/// start once it is there.
fn spawn_job(n: usize, args: &[String], dir: &Path) -> (Vec<Child>, String) {
    let file = dir.join("rendezvous");
    let log = |rank: usize| dir.join(format!("rank-{rank}.log"));
    let mut children = vec![spawn_rank(0, n, "127.0.0.1:0", Some(&file), args, &log(0))];
    let waited = Instant::now();
    let rdv = loop {
        if let Some(a) = wagma::transport::tcp::read_rendezvous(&file) {
            break a;
        }
        assert!(
            children[0].try_wait().unwrap().is_none(),
            "rank 0 exited before opening its rendezvous"
        );
        // Generous: rank 0 binds within milliseconds unless the machine is stalled.
        assert!(waited.elapsed() < Duration::from_secs(120), "no rendezvous");
        std::thread::sleep(Duration::from_millis(5));
    };
    children.extend((1..n).map(|rank| spawn_rank(rank, n, &rdv, None, args, &log(rank))));
    (children, rdv)
}

/// Starts rank `rank` of `n` of `wagma ARGS` with the rendezvous `rdv` (and, for rank 0, the
/// file to write the bound address to), its stderr in `log`.
fn spawn_rank(
    rank: usize,
    n: usize,
    rdv: &str,
    rdv_file: Option<&Path>,
    args: &[String],
    log: &Path,
) -> Child {
    let mut cmd = wagma();
    cmd.args(args)
        .env("WAGMA_RANK", rank.to_string())
        .env("WAGMA_WORLD_SIZE", n.to_string())
        .env("WAGMA_RENDEZVOUS", rdv)
        .env("WAGMA_JOB_ID", "failures")
        .env("WAGMA_SECRET", "test-secret")
        .env("WAGMA_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(log).unwrap());
    if let Some(f) = rdv_file {
        cmd.env("WAGMA_RENDEZVOUS_FILE", f);
    }
    // A failed assertion must not leave ranks training for hours: they die with the test's
    // thread.
    // SAFETY: prctl(2) between fork and exec touches no memory of this process.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().unwrap()
}

fn train_args(out: &Path, steps: u64, eval_every: u64, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "--transport",
        "tcp",
        "--dataset",
        "builtin",
        "--quiet",
        "true",
        "--steps",
        &steps.to_string(),
        "--eval-every",
        &eval_every.to_string(),
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(out.display().to_string());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// The last iteration rank 0 has evaluated so far.
fn evaluated(out: &Path) -> u64 {
    std::fs::read_to_string(out.join("progress.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["iteration"].as_u64())
        .max()
        .unwrap_or(0)
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Waits for every child; `None` for one still running after `limit` (then killed).
fn wait_all(children: &mut [Child], limit: Duration) -> Vec<Option<std::process::ExitStatus>> {
    let t0 = Instant::now();
    let mut status = vec![None; children.len()];
    while status.iter().any(Option::is_none) && t0.elapsed() < limit {
        for (i, c) in children.iter_mut().enumerate() {
            if status[i].is_none() {
                status[i] = c.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    status
}

/// How one kill went: whether every survivor stopped in time and named the victim.
#[derive(Debug, Default)]
struct KillOutcome {
    survivors_stopped: usize,
    named_the_victim: usize,
    hung: usize,
    succeeded_wrongly: usize,
}

fn kill_one(rep: u64, ranks: usize, timeout_s: u64) -> KillOutcome {
    let dir = tmp(&format!("kill-{rep}"));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out");
    let victim = 1 + (rep as usize * 5) % (ranks - 1);
    let args = train_args(
        &out,
        100_000,
        5,
        &["--timeout", &timeout_s.to_string(), "--group-size", "2"],
    );
    let (mut children, _) = spawn_job(ranks, &args, &dir);
    // Let training start (rank 0 has evaluated once), then kill at a varying moment.
    let started = wait_until(Duration::from_secs(60), || evaluated(&out) >= 5);
    assert!(started, "the job did not start training");
    std::thread::sleep(Duration::from_millis((rep * 37) % 300));
    children[victim].kill().unwrap();
    let killed_at = Instant::now();
    let status = wait_all(&mut children, Duration::from_secs(timeout_s + 30));
    let elapsed = killed_at.elapsed();
    let mut o = KillOutcome::default();
    for (rank, s) in status.iter().enumerate() {
        if rank == victim {
            continue;
        }
        match s {
            None => o.hung += 1,
            Some(s) if s.success() => o.succeeded_wrongly += 1,
            Some(_) => {
                o.survivors_stopped += 1;
                let log = std::fs::read_to_string(dir.join(format!("rank-{rank}.log"))).unwrap();
                if log.contains(&format!("lost rank {victim}")) {
                    o.named_the_victim += 1;
                } else {
                    eprintln!("rank {rank} did not name rank {victim}:\n{log}");
                }
            }
        }
    }
    eprintln!(
        "rep {rep}: killed rank {victim}; survivors stopped within {:.1} s: {o:?}",
        elapsed.as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    o
}

#[test]
fn killing_a_tcp_rank_stops_every_survivor_with_an_error_naming_it() {
    let _one = ONE_JOB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let reps = stress_reps(2);
    let ranks = 4;
    let mut total = KillOutcome::default();
    for rep in 0..reps {
        let o = kill_one(rep, ranks, 5);
        total.survivors_stopped += o.survivors_stopped;
        total.named_the_victim += o.named_the_victim;
        total.hung += o.hung;
        total.succeeded_wrongly += o.succeeded_wrongly;
    }
    eprintln!("{reps} kills of one of {ranks} TCP ranks: {total:?}");
    let survivors = reps as usize * (ranks - 1);
    assert_eq!(total.hung, 0, "{total:?}");
    assert_eq!(total.succeeded_wrongly, 0, "{total:?}");
    assert_eq!(total.survivors_stopped, survivors, "{total:?}");
    assert_eq!(total.named_the_victim, survivors, "{total:?}");
}

#[test]
fn a_stopped_tcp_rank_is_declared_lost_within_the_timeout() {
    let _one = ONE_JOB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // SIGSTOP freezes the whole process, its engine thread too: its heartbeats stop and the
    // others give up on it after the timeout.
    let dir = tmp("stop");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out");
    let timeout_s = 4;
    let args = train_args(&out, 100_000, 5, &["--timeout", &timeout_s.to_string()]);
    let (mut children, _) = spawn_job(3, &args, &dir);
    assert!(wait_until(Duration::from_secs(60), || evaluated(&out) >= 5));
    let victim = 2;
    let pid = i32::try_from(children[victim].id()).unwrap();
    // SAFETY: kill(2) on a child of this test has no memory effects here.
    unsafe {
        libc::kill(pid, libc::SIGSTOP);
    }
    let stopped_at = Instant::now();
    let mut survivors = children.split_off(0);
    let mut victim_child = survivors.remove(victim);
    let status = wait_all(&mut survivors, Duration::from_secs(timeout_s + 30));
    let took = stopped_at.elapsed();
    let _ = victim_child.kill();
    let _ = victim_child.wait();
    for (rank, s) in status.iter().enumerate() {
        let log = std::fs::read_to_string(dir.join(format!("rank-{rank}.log"))).unwrap();
        assert!(s.is_some_and(|s| !s.success()), "rank {rank}: {s:?}\n{log}");
        assert!(
            log.contains("lost rank 2") || log.contains("waiting for peer 2"),
            "rank {rank}:\n{log}"
        );
    }
    eprintln!(
        "survivors of a stopped rank ended after {:.1} s (timeout {timeout_s} s)",
        took.as_secs_f64()
    );
    assert!(took < Duration::from_secs(timeout_s + 20), "{took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Final accuracy and the number of ranks alive at the end.
fn outcome(out: &Path) -> (f64, u64) {
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let acc = s["final_metrics"]["accuracy"]
        .as_f64()
        .unwrap_or_else(|| panic!("no accuracy in {s}"));
    (acc, s["ranks_alive"].as_u64().unwrap())
}

#[test]
fn elastic_wagma_survives_losing_one_of_eight_ranks_half_way() {
    let _one = ONE_JOB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (ranks, steps) = (8, 600);
    // Checkpoints every 100 iterations: those after the loss hold the living ranks.
    let extra = ["--elastic", "--timeout", "20", "--checkpoint-every", "100"];
    // Undisturbed.
    let dir = tmp("elastic-base");
    std::fs::create_dir_all(&dir).unwrap();
    let base_out = dir.join("out");
    let (mut children, _) = spawn_job(ranks, &train_args(&base_out, steps, 100, &extra), &dir);
    let status = wait_all(&mut children, Duration::from_secs(600));
    assert!(
        status.iter().all(|s| s.is_some_and(|s| s.success())),
        "{status:?}"
    );
    let (base, alive) = outcome(&base_out);
    assert_eq!(alive, 8);
    // Rank 5 killed half-way.
    let dir2 = tmp("elastic-kill");
    std::fs::create_dir_all(&dir2).unwrap();
    let out = dir2.join("out");
    let (mut children, _) = spawn_job(ranks, &train_args(&out, steps, 100, &extra), &dir2);
    assert!(wait_until(Duration::from_secs(300), || evaluated(&out) >= steps / 2));
    children[5].kill().unwrap();
    let status = wait_all(&mut children, Duration::from_secs(600));
    for (rank, s) in status.iter().enumerate() {
        if rank != 5 {
            let log = std::fs::read_to_string(dir2.join(format!("rank-{rank}.log"))).unwrap();
            assert!(s.is_some_and(|s| s.success()), "rank {rank}: {s:?}\n{log}");
        }
    }
    let (acc, alive) = outcome(&out);
    assert_eq!(alive, 7);
    // The lost rank reports no snapshots: the evaluated points are those of the run, none
    // before its first.
    let points: Vec<u64> = alive_at_evaluations(&out).iter().map(|&(i, _)| i).collect();
    assert_eq!(
        points,
        [100, 200, 300, 400, 500, 600],
        "evaluated iterations"
    );
    // The two checkpoints after the loss hold the 7 living ranks, and say so.
    let ckpt = out.join("checkpoints");
    let held = |name: &str| -> (u64, Vec<u64>) {
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ckpt.join(name).join("meta.json")).unwrap())
                .unwrap();
        assert_eq!(meta["ranks"], 8);
        let files = meta["files"].as_array().unwrap().iter();
        let ranks = files.map(|f| f["rank"].as_u64().unwrap()).collect();
        (meta["iteration"].as_u64().unwrap(), ranks)
    };
    let survivors: Vec<u64> = (0..8).filter(|&r| r != 5).collect();
    assert_eq!(held("ckpt-0000000500"), (500, survivors.clone()));
    assert_eq!(held("ckpt-0000000400"), (400, survivors));
    let latest = std::fs::read_to_string(ckpt.join("LATEST")).unwrap();
    assert!(latest.starts_with("ckpt-0000000500 "), "{latest}");
    // All 8 resume from it; rank 5 starts from rank 0's replica.
    let dir3 = tmp("elastic-resume");
    std::fs::create_dir_all(&dir3).unwrap();
    let out3 = dir3.join("out");
    let mut resume_args = train_args(&out3, steps, 100, &extra);
    resume_args.extend(["--resume".to_string(), ckpt.display().to_string()]);
    let (mut children, _) = spawn_job(ranks, &resume_args, &dir3);
    let status = wait_all(&mut children, Duration::from_secs(600));
    let log5 = std::fs::read_to_string(dir3.join("rank-5.log")).unwrap();
    assert!(
        status.iter().all(|s| s.is_some_and(|s| s.success())),
        "{status:?}\n{log5}"
    );
    assert!(log5.contains("holds no state of this rank"), "{log5}");
    let (resumed, alive) = outcome(&out3);
    assert_eq!(alive, 8);
    assert!(
        (resumed - base).abs() <= 0.01,
        "resumed accuracy {resumed:.4} vs undisturbed {base:.4}"
    );
    let _ = std::fs::remove_dir_all(&dir3);
    eprintln!("undisturbed accuracy {base:.4}; rank 5 killed half-way: {acc:.4}");
    assert!(
        (acc - base).abs() <= 0.01,
        "accuracy {acc:.4} vs undisturbed {base:.4}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

/// The number of ranks alive at each evaluation rank 0 recorded.
fn alive_at_evaluations(out: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["iteration"].as_u64()?, v["ranks_alive"].as_u64()?)))
        .collect()
}

#[test]
fn a_restarted_rank_rejoins_an_elastic_job_at_a_global_average() {
    let _one = ONE_JOB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let reps = stress_reps(1);
    for rep in 0..reps {
        rejoin_once(rep, Down::Killed);
    }
    eprintln!("{reps} kills and rejoins: all ranks finished every time");
    // A hung process keeps its connections open (its kernel still answers keepalive): the
    // survivors must drop them once they declare it dead, or its rank stays taken.
    rejoin_once(0, Down::Hung);
}

/// How a rank goes down before a process restarted in its place rejoins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Down {
    /// SIGKILL: its connections close at once.
    Killed,
    /// SIGSTOP: its connections stay open, its heartbeats stop.
    Hung,
}

/// Takes down one of 4 elastic TCP ranks (varying with `rep`), restarts it with `--rejoin`,
/// and checks that it rejoined at a global average and that the job finished with all 4.
fn rejoin_once(rep: u64, down: Down) {
    let (ranks, steps) = (4, 400);
    let victim = 1 + rep as usize % (ranks - 1);
    let dir = tmp(&format!("rejoin-{rep}-{down:?}"));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out");
    let timeout_s = match down {
        Down::Killed => "20",
        // Found by its missing heartbeats only: a shorter wait keeps the test short.
        Down::Hung => "8",
    };
    let args = train_args(&out, steps, 20, &["--elastic", "--timeout", timeout_s]);
    let (mut children, rdv) = spawn_job(ranks, &args, &dir);
    let kill_after = 100 + (rep * 20) % 100;
    assert!(wait_until(Duration::from_secs(300), || evaluated(&out) >= kill_after));
    match down {
        Down::Killed => {
            children[victim].kill().unwrap();
            let _ = children[victim].wait();
        }
        Down::Hung => {
            let pid = i32::try_from(children[victim].id()).unwrap();
            // SAFETY: kill(2) on a child of this test has no memory effects here.
            unsafe {
                libc::kill(pid, libc::SIGSTOP);
            }
        }
    }
    let killed_after = evaluated(&out);
    // Rank 0 records the loss at an evaluation before the replacement starts.
    assert!(wait_until(Duration::from_secs(120), || {
        std::fs::read_to_string(out.join("progress.jsonl"))
            .unwrap_or_default()
            .contains("\"ranks_alive\":3")
    }));
    let mut rejoin_args = args.clone();
    rejoin_args.push("--rejoin".into());
    let log = dir.join(format!("rank-{victim}-rejoined.log"));
    // The process it replaces: reaped already if killed, still stopped if hung.
    let mut replaced = std::mem::replace(
        &mut children[victim],
        spawn_rank(victim, ranks, &rdv, None, &rejoin_args, &log),
    );
    let status = wait_all(&mut children, Duration::from_secs(600));
    let _ = replaced.kill();
    let _ = replaced.wait();
    for (rank, s) in status.iter().enumerate() {
        let name = if rank == victim {
            format!("rank-{victim}-rejoined.log")
        } else {
            format!("rank-{rank}.log")
        };
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(s.is_some_and(|s| s.success()), "rank {rank}: {s:?}\n{text}");
    }
    let joiner = std::fs::read_to_string(&log).unwrap();
    let rejoined_at: u64 = joiner
        .lines()
        .find(|l| l.contains("rejoined the job"))
        .and_then(|l| l.split("iteration=").nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("the joiner did not say where it rejoined:\n{joiner}"));
    // WAGMA's default tau is 10: the join point is a global average after the kill.
    assert!(rejoined_at > killed_after && rejoined_at.is_multiple_of(10) && rejoined_at < steps);
    let alive = alive_at_evaluations(&out);
    let after: Vec<u64> = alive
        .iter()
        .filter(|(i, _)| *i > rejoined_at)
        .map(|(_, a)| *a)
        .collect();
    assert!(alive.iter().any(|&(_, a)| a == 3), "{alive:?}");
    assert!(
        !after.is_empty() && after.iter().all(|&a| a == 4),
        "{alive:?}"
    );
    let (acc, alive_at_end) = outcome(&out);
    assert_eq!(alive_at_end, 4);
    eprintln!(
        "rep {rep}: rank {victim} {down:?} after iteration {killed_after}, rejoined at {rejoined_at}; final accuracy {acc:.4}"
    );
    assert!(acc > 0.8, "final accuracy {acc:.4}");
    let _ = std::fs::remove_dir_all(&dir);
}
