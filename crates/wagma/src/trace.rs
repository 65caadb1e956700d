//! Timelines in the Chrome trace event format (readable by Perfetto and `chrome://tracing`):
//! per rank, the compute side (compute, waiting, checkpoints) on one track and the engine
//! (activations sent and received, group reductions, global syncs) on another.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

/// Track of the compute side.
pub const COMPUTE: u32 = 0;
/// Track of the progress engine.
pub const ENGINE: u32 = 1;

/// One event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceEvent {
    /// What happened.
    pub name: String,
    /// Category: compute, wait, round, sync, collective, activation, checkpoint.
    pub cat: &'static str,
    /// `X` (a span) or `i` (an instant).
    pub ph: &'static str,
    /// Start, microseconds since the start of the job.
    pub ts: f64,
    /// Duration of a span, microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// The rank.
    pub pid: usize,
    /// The track.
    pub tid: u32,
    /// Details.
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    pub args: serde_json::Value,
}

/// Collects events when enabled.
#[derive(Debug, Clone, Default)]
pub struct Tracer {
    enabled: bool,
    rank: usize,
    events: Vec<TraceEvent>,
}

fn us(t: Duration) -> f64 {
    t.as_secs_f64() * 1e6
}

impl Tracer {
    /// A tracer for `rank`; records nothing unless `enabled`.
    pub fn new(rank: usize, enabled: bool) -> Tracer {
        Tracer {
            enabled,
            rank,
            events: Vec::new(),
        }
    }

    /// True when recording.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records a span from `start` to `end`.
    pub fn span(
        &mut self,
        tid: u32,
        cat: &'static str,
        name: impl Into<String>,
        start: Duration,
        end: Duration,
        args: serde_json::Value,
    ) {
        if self.enabled {
            self.events.push(TraceEvent {
                name: name.into(),
                cat,
                ph: "X",
                ts: us(start),
                dur: Some(us(end.saturating_sub(start))),
                pid: self.rank,
                tid,
                args,
            });
        }
    }

    /// Records an instant.
    pub fn instant(
        &mut self,
        tid: u32,
        cat: &'static str,
        name: impl Into<String>,
        at: Duration,
        args: serde_json::Value,
    ) {
        if self.enabled {
            self.events.push(TraceEvent {
                name: name.into(),
                cat,
                ph: "i",
                ts: us(at),
                dur: None,
                pid: self.rank,
                tid,
                args,
            });
        }
    }

    /// Takes the recorded events.
    pub fn take(&mut self) -> Vec<TraceEvent> {
        std::mem::take(&mut self.events)
    }
}

/// The file of `rank` for a trace named `path`: `trace.json` gives `trace.rank-3.json`.
pub fn rank_path(path: &Path, rank: usize) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".into());
    let ext = path
        .extension()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "json".into());
    path.with_file_name(format!("{stem}.rank-{rank}.{ext}"))
}

/// Writes `events` as a Chrome trace file, with track names.
pub fn write(path: &Path, rank: usize, mut events: Vec<TraceEvent>) -> std::io::Result<()> {
    events.sort_by(|a, b| a.ts.total_cmp(&b.ts));
    let meta = |tid: u32, name: &str| serde_json::json!({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}});
    let mut all = vec![
        serde_json::json!({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": format!("rank {rank}")}}),
        meta(COMPUTE, "compute"),
        meta(ENGINE, "engine"),
    ];
    all.extend(
        events
            .into_iter()
            .filter_map(|e| serde_json::to_value(e).ok()),
    );
    let doc = serde_json::json!({ "traceEvents": all, "displayTimeUnit": "ms" });
    std::fs::write(
        path,
        serde_json::to_vec(&doc).map_err(std::io::Error::other)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_when_enabled_and_writes_chrome_json() {
        let mut off = Tracer::new(0, false);
        off.instant(
            ENGINE,
            "activation",
            "x",
            Duration::ZERO,
            serde_json::Value::Null,
        );
        assert!(off.take().is_empty());
        let mut t = Tracer::new(3, true);
        t.span(
            COMPUTE,
            "compute",
            "step 0",
            Duration::from_millis(1),
            Duration::from_millis(3),
            serde_json::Value::Null,
        );
        t.instant(
            ENGINE,
            "activation",
            "activation sent",
            Duration::from_millis(2),
            serde_json::json!({"round": 0}),
        );
        let ev = t.take();
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0].dur, Some(2000.0));
        let p = std::env::temp_dir().join(format!("wagma-trace-{}.json", std::process::id()));
        let rp = rank_path(&p, 3);
        assert!(rp.to_string_lossy().ends_with(".rank-3.json"));
        write(&rp, 3, ev).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&rp).unwrap()).unwrap();
        assert_eq!(v["traceEvents"].as_array().unwrap().len(), 5);
        std::fs::remove_file(rp).unwrap();
    }
}
