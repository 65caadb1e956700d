//! Where simulated compute times come from: an imbalance profile, or a per-rank trace recorded
//! by `wagma train --trace-compute FILE` (one JSON object per line: `rank`, `step`, `seconds`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use wagma::imbalance::{Imbalance, MAX_STEP_S};

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

/// Whether `s` seconds is a time a step may take: finite, not negative, at most
/// [`MAX_STEP_S`].
fn is_step_time(s: f64) -> bool {
    s.is_finite() && (0.0..=MAX_STEP_S).contains(&s)
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
        // Grouped by the ranks that occur, so that a huge rank number costs no memory.
        let mut times: Vec<Vec<f64>> = Vec::new();
        let mut last: Option<(usize, u64)> = None;
        for l in lines {
            if !is_step_time(l.seconds) {
                return Err(err(format!(
                    "rank {} step {}: bad time {} (must be finite, >= 0 and <= {MAX_STEP_S} s)",
                    l.rank, l.step, l.seconds
                )));
            }
            if last == Some((l.rank, l.step)) {
                // Two runs appended to one file: replaying either would shift the other.
                return Err(err(format!(
                    "rank {} step {} is recorded twice (a file appended by more than one run?)",
                    l.rank, l.step
                )));
            }
            if last.is_none_or(|(r, _)| r != l.rank) {
                if l.rank != times.len() {
                    return Err(err(format!(
                        "rank {} has no steps (the ranks must be 0 to R-1)",
                        times.len()
                    )));
                }
                times.push(Vec::new());
            }
            if let Some(row) = times.last_mut() {
                row.push(l.seconds);
            }
            last = Some((l.rank, l.step));
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
    /// Checks the profile's time scale, or that every recorded time is one a step may take.
    pub fn validate(&self) -> Result<(), SimError> {
        match self {
            Compute::Profile(im) => Ok(im.validate()?),
            Compute::Trace(t) => match t.times.iter().flatten().find(|&&s| !is_step_time(s)) {
                Some(s) => Err(SimError::Config(format!(
                    "a recorded step time of {s} s (must be finite, >= 0 and <= {MAX_STEP_S} s)"
                ))),
                None if t.times.is_empty() || t.times.iter().any(Vec::is_empty) => Err(
                    SimError::Config("a trace needs at least one step of every rank".into()),
                ),
                None => Ok(()),
            },
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Trace, SimError> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "wagma-trace-{}-{}.jsonl",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::write(&path, text).unwrap();
        let t = Trace::load(&path);
        std::fs::remove_file(&path).unwrap();
        t
    }

    #[test]
    fn a_compute_model_built_in_code_is_checked_too() {
        let scaled = |time_scale| {
            Compute::Profile(Imbalance {
                profile: wagma::imbalance::Profile::HeavyTail,
                time_scale,
                seed: 1,
            })
        };
        assert!(scaled(1.0).validate().is_ok());
        assert!(scaled(1e20).validate().is_err());
        let trace = |times: Vec<Vec<f64>>| Compute::Trace(Trace { times });
        assert!(trace(vec![vec![0.1], vec![0.2, 0.3]]).validate().is_ok());
        assert!(trace(vec![vec![0.1, 1e20]]).validate().is_err());
        assert!(trace(vec![vec![0.1], vec![]]).validate().is_err());
        assert!(trace(Vec::new()).validate().is_err());
    }

    fn line(rank: u64, step: u64, seconds: f64) -> String {
        format!("{{\"rank\":{rank},\"step\":{step},\"seconds\":{seconds}}}\n")
    }

    #[test]
    fn steps_are_replayed_per_rank_in_step_order() {
        let t = load(&(line(1, 1, 0.4) + &line(0, 0, 0.1) + &line(1, 0, 0.3) + &line(0, 1, 0.2)))
            .unwrap();
        assert_eq!(t.times, vec![vec![0.1, 0.2], vec![0.3, 0.4]]);
    }

    #[test]
    fn a_trace_with_a_missing_rank_a_huge_rank_an_endless_step_or_a_repeated_step_is_refused() {
        let gap = line(0, 0, 0.1) + &line(2, 0, 0.1);
        assert!(
            matches!(load(&gap), Err(SimError::File { message, .. }) if message.contains("rank 1 has no steps"))
        );
        let huge = line(0, 0, 0.1) + &line(u64::MAX, 0, 0.1);
        assert!(
            matches!(load(&huge), Err(SimError::File { message, .. }) if message.contains("rank 1 has no steps"))
        );
        let eternal = line(0, 0, 0.1) + &line(0, 1, 1e20);
        assert!(
            matches!(load(&eternal), Err(SimError::File { message, .. }) if message.contains("rank 0 step 1: bad time"))
        );
        let twice = line(0, 0, 0.1) + &line(0, 1, 0.2) + &line(0, 0, 0.1);
        assert!(
            matches!(load(&twice), Err(SimError::File { message, .. }) if message.contains("recorded twice"))
        );
    }
}
