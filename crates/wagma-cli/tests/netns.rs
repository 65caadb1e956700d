//! Multi-host runs on emulated networks: `scripts/netns-sweep.sh` with four network namespaces,
//! on tiny settings. Needs root and iproute2; elsewhere the tests say so and return.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

/// Each sweep runs four hosts' processes on this machine's two cores: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/netns-sweep.sh")
}

/// The namespaces of the sweep whose script ran as process `pid` (the script names them
/// `wg<pid>n<i>`) that still exist. Only its own: another job on the machine may hold others.
fn left_behind(pid: u32) -> Vec<String> {
    let prefix = format!("wg{pid}n");
    let out = Command::new("ip").args(["netns", "list"]).output();
    out.map(|o| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|name| name.starts_with(&prefix))
            .map(str::to_string)
            .collect()
    })
    .unwrap_or_default()
}

/// True when this process may create network namespaces.
fn can_make_namespaces() -> bool {
    let probe = format!("wgprobe{}", std::process::id());
    let ok = Command::new("ip")
        .args(["netns", "add", &probe])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        let _ = Command::new("ip").args(["netns", "del", &probe]).output();
    } else {
        eprintln!("skipped: creating network namespaces needs root and iproute2");
    }
    ok
}

/// Runs the sweep, checks that it succeeded and returns its output lines as JSON documents,
/// and the script's process id.
fn sweep_lines(wagma: &str, extra: &[(&str, &str)]) -> (Vec<serde_json::Value>, u32) {
    let (out, pid) = sweep(wagma, extra);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (lines, pid)
}

/// Runs the sweep; returns its output and the script's process id.
fn sweep(wagma: &str, extra: &[(&str, &str)]) -> (Output, u32) {
    let mut cmd = Command::new("bash");
    cmd.arg(script())
        .env("WAGMA", wagma)
        .env("HOSTS", "4")
        .env("RATES", "1gbit")
        .env("DELAYS", "0.1ms")
        .env("STEPS", "4")
        .env("TIME_SCALE", "0.01");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    // As `Command::output` would, with the child's id kept.
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    (child.wait_with_output().unwrap(), pid)
}

#[test]
fn training_runs_across_four_namespaces_and_they_are_removed() {
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !can_make_namespaces() {
        return;
    }
    let (rows, pid) = sweep_lines(
        env!("CARGO_BIN_EXE_wagma"),
        &[("ALGOS", "wagma allreduce-sgd")],
    );
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert!(r["samples_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["final_metrics"]["accuracy"].as_f64().is_some(), "{r}");
        assert_eq!(r["rate"], "1gbit");
    }
    assert_eq!(
        left_behind(pid),
        Vec::<String>::new(),
        "namespaces left behind"
    );
}

#[test]
fn a_failing_run_still_removes_its_namespaces() {
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !can_make_namespaces() {
        return;
    }
    let (out, pid) = sweep("/bin/false", &[("ALGOS", "wagma")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("a rank failed"));
    assert_eq!(
        left_behind(pid),
        Vec::<String>::new(),
        "namespaces left behind"
    );
}

#[test]
fn the_benchmark_runs_one_job_across_four_namespaces() {
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !can_make_namespaces() {
        return;
    }
    let (lines, _) = sweep_lines(
        env!("CARGO_BIN_EXE_wagma"),
        &[
            ("MODE", "bench"),
            ("MODEL", "1000"),
            ("ALGOS", "wagma allreduce-sgd"),
        ],
    );
    // One line for the one rate and delay, with one named row per algorithm.
    assert_eq!(lines.len(), 1, "{lines:?}");
    let rows = lines[0]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{lines:?}");
    assert_eq!(rows[0]["algo"], "wagma tau=10", "{lines:?}");
    assert_eq!(rows[1]["vs_allreduce"], 1.0, "{lines:?}");
}

#[test]
fn a_partition_of_an_elastic_job_stops_the_minority_and_the_majority_finishes() {
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !can_make_namespaces() {
        return;
    }
    // Five hosts, rank 0 reports iteration 40; then hosts 3 and 4 are cut off from 0-2 (they
    // still reach each other).
    let timeout = 10.0;
    let (lines, pid) = sweep_lines(
        env!("CARGO_BIN_EXE_wagma"),
        &[
            ("MODE", "partition"),
            ("HOSTS", "5"),
            ("STEPS", "400"),
            ("AT", "40"),
            ("TIMEOUT", "10"),
            ("ALGOS", "wagma"),
        ],
    );
    assert_eq!(lines.len(), 6, "{lines:?}");
    for r in &lines[..3] {
        assert_eq!(
            r["exit"], 0,
            "the side with rank 0 and 3 of 5 finishes: {r}"
        );
    }
    for r in &lines[3..5] {
        assert_ne!(r["exit"], 0, "{r}");
        // Which rule a minority rank trips first is a race: it may declare rank 0 dead first
        // ("without rank 0"), or see its partner stop before rank 0's silence runs out ("no
        // strict majority"); either way the error states the quorum rule.
        let err = r["error"].as_str().unwrap();
        assert!(
            (err.contains("without rank 0") || err.contains("are no strict majority"))
                && err.contains("strict majority of the 5 ranks"),
            "the minority names the partition: {err}"
        );
        // Each side learns of the split within its timeout (silence, or nothing delivered
        // for an operation); the bound leaves room for a loaded machine.
        let after = r["after_split_s"].as_f64().unwrap();
        assert!(after < 6.0 * timeout, "{r}");
    }
    let summary = &lines[5]["summary"];
    assert_eq!(summary["ranks_alive"], 3, "{summary}");
    assert_eq!(summary["steps"], 400, "{summary}");
    assert!(
        summary["final_metrics"]["accuracy"].as_f64().unwrap() > 0.5,
        "{summary}"
    );
    assert_eq!(
        left_behind(pid),
        Vec::<String>::new(),
        "namespaces left behind"
    );
}
