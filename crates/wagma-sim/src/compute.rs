//! Where simulated compute times come from: an imbalance profile, or a per-rank trace recorded
//! by `wagma train --trace-compute FILE` (one JSON object per line: `rank`, `step`, `seconds`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use wagma::imbalance::Imbalance;

use crate::SimError;

/// One recorded local step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TraceLine {
    /// The rank.
    pub rank: usize,
    /// The iteration.
    pub step: u64,
    /// Seconds of local compute.
    pub seconds: f64,
}

/// Per-rank compute times of a recorded run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    /// `times[rank][k]`: the k-th recorded step of that rank.
    pub times: Vec<Vec<f64>>,
}

impl Trace {
    /// Reads a trace file.
    pub fn load(path: &Path) -> Result<Trace, SimError> {
        let err = |m: String| SimError::File {
            path: path.display().to_string(),
            message: m,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let mut lines: Vec<TraceLine> = Vec::new();
        for (i, l) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            lines.push(serde_json::from_str(l).map_err(|e| err(format!("line {}: {e}", i + 1)))?);
        }
        if lines.is_empty() {
            return Err(err("holds no steps".into()));
        }
        lines.sort_by_key(|l| (l.rank, l.step));
        let ranks = lines.iter().map(|l| l.rank).max().unwrap_or(0) + 1;
        let mut times = vec![Vec::new(); ranks];
        for l in lines {
            if !(l.seconds.is_finite() && l.seconds >= 0.0) {
                return Err(err(format!(
                    "rank {} step {}: bad time {}",
                    l.rank, l.step, l.seconds
                )));
            }
            times[l.rank].push(l.seconds);
        }
        if times.iter().any(Vec::is_empty) {
            return Err(err("some ranks have no steps".into()));
        }
        Ok(Trace { times })
    }
}

/// The compute model of a simulation.
#[derive(Debug, Clone)]
pub enum Compute {
    /// Times drawn from a profile.
    Profile(Imbalance),
    /// Recorded times; simulated rank r replays recorded rank `r mod R`, cycling over its steps.
    Trace(Trace),
}

impl Compute {
    /// Compute seconds of every rank at `step`.
    pub fn step_times(&self, step: u64, ranks: usize) -> Vec<f64> {
        match self {
            Compute::Profile(im) => im.step_times(step, ranks),
            Compute::Trace(t) => (0..ranks)
                .map(|r| {
                    let row = &t.times[r % t.times.len()];
                    row[step as usize % row.len()]
                })
                .collect(),
        }
    }

    /// The table `[step][rank]` of compute seconds.
    pub fn table(&self, steps: u64, ranks: usize) -> Vec<Vec<f64>> {
        match self {
            Compute::Profile(im) => im.table(steps, ranks),
            Compute::Trace(_) => (0..steps).map(|s| self.step_times(s, ranks)).collect(),
        }
    }
}
