//! The files of a run, written by rank 0 into its output directory: `metrics.jsonl` (renamed
//! into place at the end), `progress.jsonl` (live), `summary.json` and the final model.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use wagma::Payload;

use crate::checkpoint::{self, RankState};
use crate::error::TrainError;
use crate::evaluation::EvalRecord;
use crate::trainer::Summary;

/// The consensus model at the end of a run, in the output directory.
pub const FINAL_MODEL: &str = "final-model.bin";

/// Files of the run, written by rank 0.
pub(crate) struct Outputs {
    dir: PathBuf,
    metrics: Mutex<Option<std::fs::File>>,
    progress: Mutex<Option<std::fs::File>>,
}

/// A line of `progress.jsonl`, written by rank 0 as it passes each evaluation iteration (the
/// metrics themselves are computed after training, from snapshots).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ProgressLine {
    /// Iterations rank 0 has done.
    pub iteration: u64,
    /// Rank 0's training clock, seconds.
    pub clock_s: f64,
    /// Rank 0's mean training loss since its previous line.
    pub train_loss: Option<f64>,
    /// Ranks rank 0 knows to be training.
    pub ranks_alive: usize,
}

/// Rank 0's progress during training, in the output directory.
pub const PROGRESS: &str = "progress.jsonl";

impl Outputs {
    fn metrics_partial(dir: &Path) -> PathBuf {
        dir.join("metrics.jsonl.partial")
    }

    pub(crate) fn create(dir: &Path) -> Result<Outputs, TrainError> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
        let p = Self::metrics_partial(dir);
        let f = std::fs::File::create(&p).map_err(|e| TrainError::io(&p, e))?;
        let q = dir.join(PROGRESS);
        let g = std::fs::File::create(&q).map_err(|e| TrainError::io(&q, e))?;
        Ok(Outputs {
            dir: dir.to_path_buf(),
            metrics: Mutex::new(Some(f)),
            progress: Mutex::new(Some(g)),
        })
    }

    pub(crate) fn progress(&self, line: &ProgressLine) -> Result<(), TrainError> {
        self.append(&self.progress, line)
    }

    pub(crate) fn record(&self, r: &EvalRecord) -> Result<(), TrainError> {
        self.append(&self.metrics, r)
    }

    /// Appends `value` as one JSON line to `file`, flushed (readers follow the file live).
    fn append(
        &self,
        file: &Mutex<Option<std::fs::File>>,
        value: &impl Serialize,
    ) -> Result<(), TrainError> {
        let mut g = file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = g.as_mut() {
            let text =
                serde_json::to_string(value).map_err(|e| TrainError::Internal(e.to_string()))?;
            writeln!(f, "{text}").map_err(|e| TrainError::io(&self.dir, e))?;
            f.flush().map_err(|e| TrainError::io(&self.dir, e))?;
        }
        Ok(())
    }

    /// Writes the consensus model as `final-model.bin` (a checkpoint file of rank 0).
    pub(crate) fn save_model(
        &self,
        iteration: u64,
        (params, buffers): (Payload, Payload),
    ) -> Result<(), TrainError> {
        let state = RankState {
            rank: 0,
            iteration,
            params: params.into_vec(),
            buffers: buffers.into_vec(),
            momentum: Vec::new(),
            weight: None,
            local: serde_json::Value::Null,
        };
        checkpoint::write_model(&self.dir.join(FINAL_MODEL), &state)
    }

    /// Renames the metrics into place and writes the summary (both atomically).
    pub(crate) fn finish(&self, summary: &Summary) -> Result<(), TrainError> {
        self.metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let dst = self.dir.join("metrics.jsonl");
        std::fs::rename(Self::metrics_partial(&self.dir), &dst)
            .map_err(|e| TrainError::io(&dst, e))?;
        let s = self.dir.join("summary.json");
        let tmp = self.dir.join("summary.json.partial");
        let json =
            serde_json::to_vec_pretty(summary).map_err(|e| TrainError::Internal(e.to_string()))?;
        std::fs::write(&tmp, json).map_err(|e| TrainError::io(&tmp, e))?;
        std::fs::rename(&tmp, &s).map_err(|e| TrainError::io(&s, e))
    }
}

/// Checks that `dir` can be written, without touching earlier outputs in it.
pub fn check_writable(dir: &Path) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    let probe = dir.join(format!(".wagma-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| TrainError::io(dir, e))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}
