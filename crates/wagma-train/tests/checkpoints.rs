//! A process killed between any two steps of a checkpoint leaves a complete, valid checkpoint
//! for the next run: the previous one or the new one, never a mixture or nothing.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use wagma_train::checkpoint::{self, CommitStep, Meta, RankState};
use wagma_train::flat::{Layout, TensorInfo};

const ROLE: &str = "WAGMA_TEST_CHECKPOINT_CRASH";
const RANKS: usize = 3;
/// The signal `std::process::abort` raises (SIGABRT on Linux).
const SIGABRT: i32 = 6;

fn state(rank: usize, iteration: u64) -> RankState {
    RankState {
        rank,
        iteration,
        // Values that say whose and when: a mixed-up file is caught by the comparison.
        params: vec![rank as f32, iteration as f32, 0.5],
        buffers: vec![],
        momentum: vec![-(iteration as f32)],
        weight: None,
        local: serde_json::json!({ "rank": rank }),
    }
}

fn meta(iteration: u64) -> Meta {
    Meta {
        format: checkpoint::FORMAT_VERSION,
        workload: "image".into(),
        layout: Layout {
            tensors: vec![TensorInfo {
                path: "w".into(),
                dims: vec![3],
                buffer: false,
            }],
        },
        algorithm: "wagma".into(),
        config: None,
        ranks: RANKS,
        iteration,
        seed: 1,
        samples: iteration * 10,
        train_s: iteration as f64,
        files: Vec::new(),
    }
}

/// Where the child dies: after rank 0's part of the second checkpoint, or after a commit step.
const CRASH_POINTS: [&str; 7] = [
    "first-part",
    "PartsChecked",
    "MetaWritten",
    "Renamed",
    "LatestStaged",
    "LatestReplaced",
    "Pruned",
];

/// Writes and commits the checkpoint of `iteration`, dying at `crash` if it is reached.
fn checkpoint_at(dir: &Path, iteration: u64, crash: &str) {
    for r in 0..RANKS {
        checkpoint::write_rank(dir, &state(r, iteration)).unwrap();
        if crash == "first-part" {
            std::process::abort();
        }
    }
    checkpoint::commit_observed(dir, meta(iteration), &[0, 1, 2], 2, &mut |s: CommitStep| {
        if format!("{s:?}") == crash {
            std::process::abort();
        }
    })
    .unwrap();
}

/// The child: checkpoints 10 and 20 survive, checkpoint 30 is killed at the point named in
/// the environment (does nothing when run by the test harness itself).
#[test]
fn crashing_writer() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let (dir, crash) = role.split_once('|').unwrap();
    let dir = Path::new(dir);
    checkpoint_at(dir, 10, "");
    checkpoint_at(dir, 20, "");
    checkpoint_at(dir, 30, crash);
}

/// Reads the checkpoint `LATEST` names in full; returns its iteration.
fn resume_point(dir: &Path) -> u64 {
    let ckpt = checkpoint::locate(dir).unwrap();
    let m = checkpoint::read_meta(&ckpt).unwrap();
    assert_eq!(m.files.len(), RANKS);
    for r in 0..RANKS {
        assert_eq!(
            checkpoint::read_rank(&ckpt, &m, r).unwrap(),
            state(r, m.iteration)
        );
    }
    m.iteration
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wagma-crash-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_process_killed_at_any_step_of_a_commit_leaves_a_valid_checkpoint() {
    for crash in CRASH_POINTS {
        let dir = tmp(crash);
        let status = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "crashing_writer",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, format!("{}|{crash}", dir.display()))
            .output()
            .unwrap()
            .status;
        assert_eq!(status.signal(), Some(SIGABRT), "{crash}: {status:?}");
        // Once LATEST is replaced the new checkpoint is the one to resume; before, the old.
        let new = matches!(crash, "LatestReplaced" | "Pruned");
        assert_eq!(resume_point(&dir), if new { 30 } else { 20 }, "{crash}");
        // The next run checkpoints again, which clears what the crash left; the checkpoint
        // it resumed from survives until the new one is the latest.
        checkpoint_at(&dir, 40, "");
        assert_eq!(resume_point(&dir), 40, "{crash}");
        let kept: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("LATEST"))
            .collect();
        assert_eq!(kept.len(), 2, "{crash}: {kept:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
