//! Helpers shared by the integration tests of the `wagma` binary.
#![allow(dead_code)] // each test file uses a different subset

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh, absent directory under the system's temporary directory; unique per call because
/// the tests of one file run concurrently and several files run at once.
pub fn tmp(name: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("wagma-test-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The `wagma` binary under test.
pub fn wagma() -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_wagma"));
    // Jobs of tests that run at once would all put their rank 0 on the same CPU.
    cmd.env("WAGMA_CPU_BIND", "none");
    cmd
}

/// `wagma launch -n N -- wagma train` over TCP on the built-in dataset, without a progress bar;
/// the caller adds the run's own options.
pub fn launch_tcp_train(ranks: usize) -> std::process::Command {
    let mut cmd = wagma();
    cmd.args(["launch", "-n", &ranks.to_string(), "--timeout", "120", "--"])
        .args(["wagma", "train", "--transport", "tcp"])
        .args(["--dataset", "builtin", "--quiet", "true"]);
    cmd
}

/// Repetitions of a failure-injection test: `WAGMA_STRESS=N` for a stress run, else `default`.
pub fn stress_reps(default: u64) -> u64 {
    std::env::var("WAGMA_STRESS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `cmd` (a `wagma`, or an `mpirun ... wagma`) with a small `bench collectives --json` over
/// `transport` on `ranks` ranks, checks that it succeeded, and returns the report's rows.
pub fn bench_collectives_rows(
    mut cmd: std::process::Command,
    transport: &str,
    ranks: usize,
) -> Vec<serde_json::Value> {
    let out = cmd
        .args(["bench", "collectives", "--transport", transport])
        .args(["--ranks", &ranks.to_string(), "--elements", "1000"])
        .args(["--reps", "2", "--warmup", "1", "--json"])
        .output()
        .unwrap();
    let v = ok_json(&out);
    let rows = v["rows"].as_array().unwrap().clone();
    assert!(
        rows.iter().all(|r| r["median_s"].as_f64().unwrap() > 0.0),
        "{v}"
    );
    rows
}

/// Asserts that a row of `wagma bench collectives` reports the CPU its ranks spent.
pub fn assert_cpu_measured(row: &serde_json::Value) {
    for k in ["cores", "ns_per_byte"] {
        let x = row["cpu"][k].as_f64().unwrap_or(f64::NAN);
        assert!(x.is_finite() && x > 0.0, "{k}: {row}");
    }
}

/// `wagma` under `mpirun -n N` with the Open MPI settings of a container: as root,
/// oversubscribed, on loopback.
pub fn mpirun(n: usize) -> std::process::Command {
    let mut cmd =
        std::process::Command::new(std::env::var("MPIRUN").unwrap_or_else(|_| "mpirun".into()));
    cmd.args(["-n", &n.to_string(), env!("CARGO_BIN_EXE_wagma")])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_btl_tcp_if_include", "lo")
        .env("OMPI_MCA_oob_tcp_if_include", "lo")
        // A hung job fails its test instead of holding the machine.
        .env("MPIEXEC_TIMEOUT", "600");
    cmd
}

/// Asserts that a command succeeded and returns the JSON document it printed.
pub fn ok_json(out: &std::process::Output) -> serde_json::Value {
    ok(out);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Asserts that a command succeeded, showing its output otherwise.
pub fn ok(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
