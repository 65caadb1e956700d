//! Operating a training run: checkpoint writes that fail, timelines, stall reports.

mod common;
use common::{launch_tcp_train, tmp, wagma};

use std::path::Path;
use std::process::{Command, Output};

fn text(out: &Output) -> String {
    format!(
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A deterministic 4-rank WAGMA run of `steps` iterations on the built-in dataset.
fn train4(steps: u32) -> Command {
    let steps = steps.to_string();
    let mut cmd = wagma();
    cmd.args(["train", "--virtual-time", "true", "--ranks", "4"])
        .args(["--steps", &steps, "--eval-every", &steps])
        .args(["--dataset", "builtin", "--quiet", "true"]);
    cmd
}

/// A run of 40 iterations that checkpoints every 10.
fn train_with_checkpoints(out: &Path, extra: &[&str]) -> Output {
    train4(40)
        .args(["--checkpoint-every", "10", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

/// The checkpoint `LATEST` names (its first word; the second is a checksum).
fn latest(out: &Path) -> String {
    let text = std::fs::read_to_string(out.join("checkpoints/LATEST")).unwrap();
    text.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_failing_checkpoint_write_leaves_the_previous_checkpoint_readable() {
    // The second checkpoint (iteration 20) cannot be written: in one run its directory's
    // place is taken by a file (an unwritable directory), in the other rank 2's file goes to
    // /dev/full (a full disk).
    let blocked = tmp("ckpt-blocked");
    let full = tmp("ckpt-full");
    let tmp_dir = |out: &Path| out.join("checkpoints/.ckpt-0000000020.tmp");
    std::fs::create_dir_all(blocked.join("checkpoints")).unwrap();
    std::fs::write(tmp_dir(&blocked), b"in the way").unwrap();
    std::fs::create_dir_all(tmp_dir(&full)).unwrap();
    std::os::unix::fs::symlink("/dev/full", tmp_dir(&full).join("rank-2.partial")).unwrap();
    for (out, needle) in [(&blocked, ".ckpt-0000000020.tmp"), (&full, "No space left")] {
        let run = train_with_checkpoints(out, &[]);
        assert!(!run.status.success(), "{}", text(&run));
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(err.contains(needle), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        // The checkpoint of iteration 10 is intact, named by LATEST, and a run resumes from it.
        assert_eq!(latest(out), "ckpt-0000000010");
        let resumed = out.join("resumed");
        let run = train4(20)
            .arg("--resume")
            .arg(out.join("checkpoints"))
            .arg("--out")
            .arg(&resumed)
            .output()
            .unwrap();
        assert!(run.status.success(), "{}", text(&run));
        let s: serde_json::Value =
            serde_json::from_slice(&std::fs::read(resumed.join("summary.json")).unwrap()).unwrap();
        assert_eq!(s["steps"], 20);
    }
    let _ = std::fs::remove_dir_all(&blocked);
    let _ = std::fs::remove_dir_all(&full);
}

#[test]
fn trace_writes_a_perfetto_timeline_per_rank() {
    let out = tmp("trace");
    let trace = out.join("timeline.json");
    let run = train_with_checkpoints(&out, &["--trace", trace.to_str().unwrap()]);
    assert!(run.status.success(), "{}", text(&run));
    for rank in 0..4 {
        let file = out.join(format!("timeline.rank-{rank}.json"));
        let v: serde_json::Value = serde_json::from_slice(
            &std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())),
        )
        .unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        let cats: std::collections::BTreeSet<&str> =
            events.iter().filter_map(|e| e["cat"].as_str()).collect();
        for want in ["compute", "wait", "publish", "round", "sync", "checkpoint"] {
            assert!(
                cats.contains(want),
                "rank {rank} has no {want} events: {cats:?}"
            );
        }
        for e in events {
            if e["ph"] == "X" {
                assert!(e["dur"].as_f64().unwrap() >= 0.0, "{e}");
                assert_eq!(e["pid"], rank, "{e}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_stalled_rank_is_reported_while_the_others_wait() {
    // allreduce-sgd on 3 processes, two of which are 3.2 s late in every step (the paper's
    // profile, ten times slower): the third waits in every allreduce, long enough for stall
    // reports (every 2 s with an 8 s timeout) to name the late ranks.
    let out = tmp("stall");
    let run = launch_tcp_train(3)
        .args([
            "--algo",
            "allreduce-sgd",
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--imbalance",
            "paper-resnet",
            "--time-scale",
            "10",
            "--timeout",
            "8",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", text(&run));
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("has waited") && err.contains("on rank"),
        "no stall report: {err}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
