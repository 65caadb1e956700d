//! Checkpoints: every replica with its optimizer, algorithm and data state, written so that a
//! failure never damages the previous checkpoint.
//!
//! Layout of a checkpoint directory `DIR`:
//! * `DIR/ckpt-<iteration>/meta.json`: format version, workload, model layout, algorithm,
//!   ranks, iteration, seed, and the ranks whose state it holds with each file's length and
//!   CRC-32;
//! * `DIR/ckpt-<iteration>/rank-<r>.bin`: magic, format version, a JSON header, then the
//!   parameters, buffers and momentum as little-endian f32, and a CRC-32 of everything before;
//! * `DIR/LATEST`: the name of the newest complete checkpoint and the CRC-32 of its
//!   `meta.json`.
//!
//! Writing: every rank writes its file (temporary name, then rename) into `.ckpt-<iteration>.tmp`;
//! when all succeeded and every rank the checkpoint must hold has its file there, rank 0 adds
//! `meta.json`, renames the directory to a name no other checkpoint has and then replaces
//! `LATEST` (temporary file, then rename), syncing each file before its rename and each
//! directory after it. Until that last rename the previous checkpoint is the one `LATEST`
//! names, untouched; only then are older ones pruned. A crash between any two steps therefore
//! leaves `LATEST` naming a complete checkpoint: the new one or the previous one.
//!
//! A checkpoint of an elastic job that has lost ranks holds the ranks that were alive; on
//! resume a rank it lacks starts from the lowest held rank's replica with a fresh data shard,
//! as a rank that rejoins a running job does.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use wagma::algo::AlgoConfig;

use crate::error::TrainError;
use crate::flat::Layout;

/// Version of the format; a checkpoint of another version is refused.
pub const FORMAT_VERSION: u32 = 2;
const MAGIC: &[u8; 8] = b"WAGMACKP";
const LATEST: &str = "LATEST";
const META: &str = "meta.json";

/// What every rank's checkpoint shares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Format version.
    pub format: u32,
    /// Workload name.
    pub workload: String,
    /// Model layout: a checkpoint of another model is refused.
    pub layout: Layout,
    /// Algorithm label.
    pub algorithm: String,
    /// The algorithm's whole configuration (options, averaging scope, order), which the label
    /// does not all show. Checkpoints written before it was kept have only the label.
    #[serde(default)]
    pub config: Option<AlgoConfig>,
    /// Ranks.
    pub ranks: usize,
    /// Iterations done.
    pub iteration: u64,
    /// Seed of the run.
    pub seed: u64,
    /// Samples processed so far (all ranks).
    pub samples: u64,
    /// Training seconds so far.
    pub train_s: f64,
    /// The ranks whose state the checkpoint holds, in rank order (filled in by [`commit`]).
    #[serde(default)]
    pub files: Vec<RankFile>,
}

impl Meta {
    /// The record of `rank`'s file, if the checkpoint holds that rank.
    pub fn file(&self, rank: usize) -> Option<&RankFile> {
        self.files.iter().find(|f| f.rank == rank)
    }
}

/// One rank's file in a checkpoint, as [`commit`] found it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankFile {
    /// The rank.
    pub rank: usize,
    /// Length of the file in bytes.
    pub bytes: u64,
    /// The file's own trailing CRC-32 (of everything before it).
    pub crc32: u32,
}

/// The steps of [`commit_observed`], each reported once it is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitStep {
    /// Every part the checkpoint must hold was found; nothing is written yet.
    PartsChecked,
    /// `meta.json` is in the temporary directory.
    MetaWritten,
    /// The temporary directory has its final name.
    Renamed,
    /// The new `LATEST` is written under a temporary name.
    LatestStaged,
    /// `LATEST` names the new checkpoint.
    LatestReplaced,
    /// Checkpoints beyond the newest kept ones, and unfinished ones before this, are removed.
    Pruned,
}

/// One rank's state.
#[derive(Debug, Clone, PartialEq)]
pub struct RankState {
    /// The rank.
    pub rank: usize,
    /// Iterations done.
    pub iteration: u64,
    /// Trainable parameters.
    pub params: Vec<f32>,
    /// Non-trainable buffers.
    pub buffers: Vec<f32>,
    /// The optimizer's state (SGD's momentum, Adam's moments).
    pub momentum: Vec<f32>,
    /// SGP's push-sum weight.
    pub weight: Option<f64>,
    /// The workload's per-rank state (sampler positions, environment seeds).
    pub local: serde_json::Value,
}

#[derive(Serialize, Deserialize)]
struct Header {
    rank: usize,
    iteration: u64,
    params: usize,
    buffers: usize,
    momentum: usize,
    weight: Option<f64>,
    local: serde_json::Value,
}

fn io(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::checkpoint(path, e.to_string())
}

fn tmp_dir(dir: &Path, iteration: u64) -> PathBuf {
    dir.join(format!(".ckpt-{iteration:010}.tmp"))
}

/// A name for the checkpoint of `iteration` that no existing directory has: a checkpoint
/// of the same iteration made again (after a resume) never replaces the one `LATEST` may
/// still name. Names sort in the order they were made.
fn final_dir(dir: &Path, iteration: u64) -> PathBuf {
    let first = dir.join(format!("ckpt-{iteration:010}"));
    if !first.exists() {
        return first;
    }
    (1u32..)
        .map(|n| dir.join(format!("ckpt-{iteration:010}.{n:04}")))
        .find(|p| !p.exists())
        .unwrap_or(first)
}

/// Makes the entries of directory `dir` (creations, renames) durable.
fn sync_dir(dir: &Path) -> Result<(), TrainError> {
    #[cfg(unix)]
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, e))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file and a rename, syncing the data and the
/// directory entry.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let staged = stage(path, bytes)?;
    publish(&staged, path)
}

/// First half of [`write_atomic`]: the bytes, durable, under a temporary name beside `path`.
fn stage(path: &Path, bytes: &[u8]) -> Result<PathBuf, TrainError> {
    let tmp = path.with_extension("partial");
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    Ok(tmp)
}

/// Second half of [`write_atomic`]: the staged file takes its name, durably.
fn publish(staged: &Path, path: &Path) -> Result<(), TrainError> {
    std::fs::rename(staged, path).map_err(|e| io(path, e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

fn encode(state: &RankState) -> Vec<u8> {
    let header = Header {
        rank: state.rank,
        iteration: state.iteration,
        params: state.params.len(),
        buffers: state.buffers.len(),
        momentum: state.momentum.len(),
        weight: state.weight,
        local: state.local.clone(),
    };
    let h = serde_json::to_vec(&header).unwrap_or_default();
    let mut out = Vec::with_capacity(
        32 + h.len() + 4 * (state.params.len() + state.buffers.len() + state.momentum.len()),
    );
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    for v in [&state.params, &state.buffers, &state.momentum] {
        for x in v.iter() {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn decode(bytes: &[u8], path: &Path) -> Result<RankState, TrainError> {
    let bad = |m: &str| TrainError::checkpoint(path, m.to_string());
    if bytes.len() < 20 || &bytes[..8] != MAGIC {
        return Err(bad("not a wagma checkpoint file"));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(bad("checksum mismatch: the file is corrupt or truncated"));
    }
    let version = u32::from_le_bytes([body[8], body[9], body[10], body[11]]);
    if version != FORMAT_VERSION {
        return Err(bad(&format!(
            "format version {version}, this program reads {FORMAT_VERSION}"
        )));
    }
    let hlen = u32::from_le_bytes([body[12], body[13], body[14], body[15]]) as usize;
    let h = body
        .get(16..16 + hlen)
        .ok_or_else(|| bad("truncated header"))?;
    let header: Header = serde_json::from_slice(h).map_err(|e| bad(&format!("bad header: {e}")))?;
    let floats = &body[16 + hlen..];
    // The header is untrusted: lengths that overflow cannot match the data either.
    let n = header
        .params
        .checked_add(header.buffers)
        .and_then(|n| n.checked_add(header.momentum))
        .and_then(|n| n.checked_mul(4));
    if n != Some(floats.len()) {
        return Err(bad("data length does not match the header"));
    }
    let mut vals = floats
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    let mut take = |k: usize| -> Vec<f32> { vals.by_ref().take(k).collect() };
    Ok(RankState {
        rank: header.rank,
        iteration: header.iteration,
        params: take(header.params),
        buffers: take(header.buffers),
        momentum: take(header.momentum),
        weight: header.weight,
        local: header.local,
    })
}

/// Step 1 of a checkpoint, on every rank: writes this rank's file into the temporary directory.
pub fn write_rank(dir: &Path, state: &RankState) -> Result<(), TrainError> {
    let tmp = tmp_dir(dir, state.iteration);
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    write_atomic(&tmp.join(rank_file(state.rank)), &encode(state))
}

/// Writes one state as a single file (the exported final model), atomically.
pub fn write_model(path: &Path, state: &RankState) -> Result<(), TrainError> {
    write_atomic(path, &encode(state))
}

/// Reads a file written by [`write_model`] (or one rank's checkpoint file).
pub fn read_model(path: &Path) -> Result<RankState, TrainError> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    decode(&bytes, path)
}

/// Step 2, on rank 0 once every rank succeeded: completes the checkpoint of `meta.iteration`
/// holding the parts of `ranks` (every rank of the job, or the living ones in an elastic job)
/// and makes it the latest; older checkpoints beyond the newest `keep` are removed.
pub fn commit(dir: &Path, meta: Meta, ranks: &[usize], keep: usize) -> Result<PathBuf, TrainError> {
    commit_observed(dir, meta, ranks, keep, &mut |_| {})
}

/// [`commit`], calling `on_step` after each of its steps (for progress reports and for tests
/// that inject a crash between steps).
pub fn commit_observed(
    dir: &Path,
    mut meta: Meta,
    ranks: &[usize],
    keep: usize,
    on_step: &mut dyn FnMut(CommitStep),
) -> Result<PathBuf, TrainError> {
    let iteration = meta.iteration;
    let tmp = tmp_dir(dir, iteration);
    let refuse = |m: String| {
        abandon(dir, iteration);
        Err(TrainError::checkpoint(dir, m))
    };
    let mut held: Vec<usize> = ranks.to_vec();
    held.sort_unstable();
    held.dedup();
    if held.first() != Some(&0) || held.iter().any(|&r| r >= meta.ranks) {
        return refuse(format!(
            "a checkpoint holds rank 0 and ranks below {}, not {held:?}",
            meta.ranks
        ));
    }
    let mut files = Vec::with_capacity(held.len());
    for &r in &held {
        // Resuming needs every held rank's part: committing without one would make `LATEST`
        // name what cannot be resumed.
        match part_record(&tmp.join(rank_file(r)), r) {
            Ok(f) => files.push(f),
            Err(e) => {
                return refuse(format!(
                    "rank {r} has no complete part at iteration {iteration} ({e}); the \
                     previous checkpoint stays the latest"
                ));
            }
        }
    }
    meta.files = files;
    on_step(CommitStep::PartsChecked);
    let json =
        serde_json::to_vec_pretty(&meta).map_err(|e| TrainError::checkpoint(dir, e.to_string()))?;
    write_atomic(&tmp.join(META), &json)?;
    on_step(CommitStep::MetaWritten);
    let done = final_dir(dir, iteration);
    std::fs::rename(&tmp, &done).map_err(|e| io(&done, e))?;
    sync_dir(dir)?;
    on_step(CommitStep::Renamed);
    let name = done
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let latest = format!("{name} {:08x}\n", crc32fast::hash(&json));
    let staged = stage(&dir.join(LATEST), latest.as_bytes())?;
    on_step(CommitStep::LatestStaged);
    publish(&staged, &dir.join(LATEST))?;
    on_step(CommitStep::LatestReplaced);
    prune(dir, keep, &done);
    clear_unfinished(dir, iteration);
    on_step(CommitStep::Pruned);
    Ok(done)
}

/// The name of rank `r`'s file in a checkpoint.
fn rank_file(r: usize) -> String {
    format!("rank-{r}.bin")
}

/// Length and trailing CRC-32 of a rank's part (the file is checked in full when read).
fn part_record(path: &Path, rank: usize) -> Result<RankFile, std::io::Error> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let bytes = f.metadata()?.len();
    if bytes < 24 {
        return Err(std::io::Error::other("too short"));
    }
    f.seek(SeekFrom::End(-4))?;
    let mut crc = [0u8; 4];
    f.read_exact(&mut crc)?;
    Ok(RankFile {
        rank,
        bytes,
        crc32: u32::from_le_bytes(crc),
    })
}

/// Removes the temporary directories of checkpoints before `iteration` that a crash or a
/// failed write left behind (a later one may still be written by this job).
fn clear_unfinished(dir: &Path, iteration: u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.filter_map(Result::ok) {
        let n = e.file_name().to_string_lossy().into_owned();
        let it = n
            .strip_prefix(".ckpt-")
            .and_then(|n| n.strip_suffix(".tmp"))
            .and_then(|n| n.parse::<u64>().ok());
        if it.is_some_and(|it| it < iteration) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Abandons a checkpoint whose write failed somewhere (the previous one stays the latest).
pub fn abandon(dir: &Path, iteration: u64) {
    let _ = std::fs::remove_dir_all(tmp_dir(dir, iteration));
}

/// Removes checkpoints beyond the newest `keep` by name, never `latest` (the one `LATEST` now
/// names: after a resume from an older checkpoint it may sort before others).
fn prune(dir: &Path, keep: usize, latest: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut all: Vec<PathBuf> = rd
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("ckpt-"))
        })
        .collect();
    all.retain(|p| p != latest);
    all.sort();
    let n = all.len();
    for old in all
        .into_iter()
        .take(n.saturating_sub(keep.saturating_sub(1)))
    {
        let _ = std::fs::remove_dir_all(old);
    }
}

/// The checkpoint a `--resume` path names: a checkpoint directory itself, or a directory with
/// a `LATEST` pointer (whose checksum of `meta.json` is then verified).
pub fn locate(path: &Path) -> Result<PathBuf, TrainError> {
    if path.join(META).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    let text = std::fs::read_to_string(&latest).map_err(|_| {
        TrainError::checkpoint(path, "holds no checkpoint (no meta.json, no LATEST)")
    })?;
    let mut words = text.split_whitespace();
    let (Some(name), Some(crc), None) = (words.next(), words.next(), words.next()) else {
        return Err(TrainError::checkpoint(
            &latest,
            "is not a checkpoint pointer (a name and a checksum)",
        ));
    };
    let dir = path.join(name);
    let meta = std::fs::read(dir.join(META)).map_err(|_| {
        TrainError::checkpoint(&dir, "LATEST names a checkpoint that does not exist")
    })?;
    if format!("{:08x}", crc32fast::hash(&meta)) != crc {
        return Err(TrainError::checkpoint(
            &dir,
            "meta.json does not match the checksum LATEST holds: it is corrupt or was replaced",
        ));
    }
    Ok(dir)
}

/// Reads the shared part of a checkpoint.
pub fn read_meta(ckpt: &Path) -> Result<Meta, TrainError> {
    let p = ckpt.join(META);
    let bytes = std::fs::read(&p).map_err(|e| io(&p, e))?;
    let meta: Meta = serde_json::from_slice(&bytes)
        .map_err(|e| TrainError::checkpoint(&p, format!("unreadable: {e}")))?;
    if meta.format != FORMAT_VERSION {
        return Err(TrainError::checkpoint(
            ckpt,
            format!(
                "format version {}, this program reads {FORMAT_VERSION}",
                meta.format
            ),
        ));
    }
    if meta.file(0).is_none() || meta.files.iter().any(|f| f.rank >= meta.ranks) {
        return Err(TrainError::checkpoint(
            &p,
            format!(
                "must hold rank 0 and ranks below {}, it lists {:?}",
                meta.ranks,
                meta.files.iter().map(|f| f.rank).collect::<Vec<_>>()
            ),
        ));
    }
    Ok(meta)
}

/// Reads one rank's state from the checkpoint `meta` describes, checking the file against the
/// length and checksum recorded there.
pub fn read_rank(ckpt: &Path, meta: &Meta, rank: usize) -> Result<RankState, TrainError> {
    let p = ckpt.join(rank_file(rank));
    let Some(rec) = meta.file(rank) else {
        return Err(TrainError::checkpoint(
            ckpt,
            format!("holds no state of rank {rank} (the job had lost it)"),
        ));
    };
    let bytes = std::fs::read(&p).map_err(|e| io(&p, e))?;
    let trailer = bytes
        .len()
        .checked_sub(4)
        .and_then(|k| bytes.get(k..))
        .map(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]));
    if bytes.len() as u64 != rec.bytes || trailer != Some(rec.crc32) {
        return Err(TrainError::checkpoint(
            &p,
            "is corrupt: its length and checksum differ from those meta.json records (truncated or replaced)",
        ));
    }
    let s = decode(&bytes, &p)?;
    if s.rank != rank || s.iteration != meta.iteration {
        return Err(TrainError::checkpoint(
            &p,
            format!(
                "holds rank {} at iteration {}, not rank {rank} at {}",
                s.rank, s.iteration, meta.iteration
            ),
        ));
    }
    Ok(s)
}

/// What a checkpoint must match to be resumed by a run.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    /// Workload name.
    pub workload: &'a str,
    /// Model layout.
    pub layout: &'a Layout,
    /// The algorithm with all its settings (its label names it in messages).
    pub config: &'a AlgoConfig,
    /// Ranks.
    pub ranks: usize,
    /// Seed: the data shards and samplers are drawn from it, so another seed would continue
    /// with other data than the run it resumes.
    pub seed: u64,
}

/// Checks that a checkpoint fits this run: same workload, model, algorithm, ranks and seed.
pub fn check_compatible(meta: &Meta, run: &Identity<'_>, ckpt: &Path) -> Result<(), TrainError> {
    let refuse = |why: String| Err(TrainError::checkpoint(ckpt, why));
    if meta.workload != run.workload {
        return refuse(format!(
            "is of the {} workload, this run trains {}",
            meta.workload, run.workload
        ));
    }
    if &meta.layout != run.layout {
        let (a, b) = (meta.layout.params(), run.layout.params());
        return refuse(format!(
            "holds another model ({a} parameters in {} tensors; this model has {b} in {})",
            meta.layout.tensors.len(),
            run.layout.tensors.len()
        ));
    }
    let label = run.config.label();
    if meta.algorithm != label {
        return refuse(format!(
            "was taken by {}, this run trains with {label}",
            meta.algorithm
        ));
    }
    if let Some(saved) = &meta.config
        && saved != run.config
    {
        // The same label, other settings: name the first that differs.
        let (a, b) = (
            serde_json::to_value(saved),
            serde_json::to_value(run.config),
        );
        let setting = match (&a, &b) {
            (Ok(a), Ok(b)) => first_difference("", a, b),
            _ => None,
        };
        return refuse(match setting {
            Some((path, a, b)) => format!(
                "was taken by {} with {path} = {a}, this run has {b}",
                meta.algorithm
            ),
            None => format!("was taken by {} with other settings", meta.algorithm),
        });
    }
    if meta.ranks != run.ranks {
        return refuse(format!(
            "was taken with {} ranks, this run has {}",
            meta.ranks, run.ranks
        ));
    }
    if meta.seed != run.seed {
        return refuse(format!(
            "was taken with seed {}, this run has seed {}",
            meta.seed, run.seed
        ));
    }
    Ok(())
}

/// The first place (a dotted path under `at`) where `a` and `b` differ, with both values.
fn first_difference(
    at: &str,
    a: &serde_json::Value,
    b: &serde_json::Value,
) -> Option<(String, String, String)> {
    use serde_json::Value;
    let under = |k: &str| {
        if at.is_empty() {
            k.to_string()
        } else {
            format!("{at}.{k}")
        }
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let none = Value::Null;
                first_difference(
                    &under(k),
                    x.get(k).unwrap_or(&none),
                    y.get(k).unwrap_or(&none),
                )
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(&under(&i.to_string()), p, q)),
        _ if a == b => None,
        _ => Some((at.to_string(), a.to_string(), b.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat::TensorInfo;

    fn state(rank: usize, it: u64) -> RankState {
        RankState {
            rank,
            iteration: it,
            params: vec![1.0, -2.5, 3.25],
            buffers: vec![0.5],
            momentum: vec![],
            weight: Some(0.75),
            local: serde_json::json!({"epoch": 2}),
        }
    }

    fn meta(it: u64) -> Meta {
        Meta {
            format: FORMAT_VERSION,
            workload: "image".into(),
            layout: Layout {
                tensors: vec![TensorInfo {
                    path: "w".into(),
                    dims: vec![3],
                    buffer: false,
                }],
            },
            algorithm: "allreduce-sgd".into(),
            config: Some(AlgoConfig::new(wagma::algo::Algorithm::AllreduceSgd)),
            ranks: 2,
            iteration: it,
            seed: 1,
            samples: 10,
            train_s: 1.0,
            files: Vec::new(),
        }
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wagma-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn write_all(d: &Path, ranks: &[usize], it: u64) {
        for &r in ranks {
            write_rank(d, &state(r, it)).unwrap();
        }
    }

    #[test]
    fn round_trip_and_latest() {
        let d = tempdir("rt");
        for it in [10, 20] {
            write_all(&d, &[0, 1], it);
            commit(&d, meta(it), &[0, 1], 2).unwrap();
        }
        let c = locate(&d).unwrap();
        assert!(c.ends_with("ckpt-0000000020"));
        let m = read_meta(&c).unwrap();
        assert_eq!(m.iteration, 20);
        assert_eq!(m.files.iter().map(|f| f.rank).collect::<Vec<_>>(), [0, 1]);
        let len = std::fs::metadata(c.join("rank-1.bin")).unwrap().len();
        assert_eq!(m.file(1).unwrap().bytes, len);
        assert_eq!(read_rank(&c, &m, 1).unwrap(), state(1, 20));
        // LATEST: the name, then the CRC-32 of meta.json.
        let latest = std::fs::read_to_string(d.join(LATEST)).unwrap();
        let crc = crc32fast::hash(&std::fs::read(c.join(META)).unwrap());
        assert_eq!(latest, format!("ckpt-0000000020 {crc:08x}\n"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_the_previous_checkpoint() {
        let d = tempdir("fail");
        write_all(&d, &[0, 1], 10);
        commit(&d, meta(10), &[0, 1], 2).unwrap();
        // The next checkpoint breaks half-way: one rank wrote, the other did not.
        write_rank(&d, &state(0, 20)).unwrap();
        abandon(&d, 20);
        let c = locate(&d).unwrap();
        let m = read_meta(&c).unwrap();
        assert_eq!(m.iteration, 10);
        assert_eq!(read_rank(&c, &m, 0).unwrap(), state(0, 10));
        // A commit that lacks a part it must hold is refused, and neither `LATEST` nor the
        // previous checkpoint change.
        write_rank(&d, &state(0, 30)).unwrap();
        let e = commit(&d, meta(30), &[0, 1], 1).unwrap_err().to_string();
        assert!(e.contains("rank 1 has no complete part"), "{e}");
        assert_eq!(locate(&d).unwrap(), c);
        assert!(c.join("rank-1.bin").is_file());
        // So is one without rank 0 or with a rank beyond the job.
        write_all(&d, &[0, 1], 40);
        assert!(commit(&d, meta(40), &[1], 1).is_err());
        write_all(&d, &[0, 1], 40);
        assert!(commit(&d, meta(40), &[0, 2], 1).is_err());
        assert_eq!(locate(&d).unwrap(), c);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_elastic_checkpoint_holds_exactly_the_ranks_it_was_given() {
        let d = tempdir("elastic");
        let mut m3 = meta(10);
        m3.ranks = 3;
        // Rank 1 was lost; a stale part of it from before must not be listed.
        write_all(&d, &[0, 1, 2], 10);
        let c = commit(&d, m3, &[2, 0], 2).unwrap();
        let m = read_meta(&c).unwrap();
        assert_eq!(m.files.iter().map(|f| f.rank).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(read_rank(&c, &m, 2).unwrap(), state(2, 10));
        let e = read_rank(&c, &m, 1).unwrap_err().to_string();
        assert!(e.contains("holds no state of rank 1"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn pruning_never_removes_the_checkpoint_latest_names() {
        // A run resumed from iteration 10 commits 15 while 20 and 30 exist (they sort after).
        let d = tempdir("prune");
        for it in [10, 20, 30, 15] {
            write_all(&d, &[0, 1], it);
            commit(&d, meta(it), &[0, 1], 2).unwrap();
        }
        let c = locate(&d).unwrap();
        assert!(c.ends_with("ckpt-0000000015"));
        let m = read_meta(&c).unwrap();
        assert_eq!(read_rank(&c, &m, 1).unwrap(), state(1, 15));
        // Two kept: the latest and the newest other one.
        assert!(d.join("ckpt-0000000030").exists());
        assert!(!d.join("ckpt-0000000020").exists() && !d.join("ckpt-0000000010").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_commit_clears_earlier_unfinished_checkpoints_only() {
        let d = tempdir("clear");
        write_rank(&d, &state(0, 5)).unwrap();
        write_rank(&d, &state(0, 20)).unwrap();
        write_all(&d, &[0, 1], 10);
        commit(&d, meta(10), &[0, 1], 2).unwrap();
        assert!(!tmp_dir(&d, 5).exists());
        assert!(tmp_dir(&d, 20).exists());
        assert!(locate(&d).is_ok());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn every_commit_step_is_reported_in_order() {
        let d = tempdir("steps");
        write_all(&d, &[0, 1], 10);
        let mut seen = Vec::new();
        commit_observed(&d, meta(10), &[0, 1], 2, &mut |s| seen.push(s)).unwrap();
        use CommitStep::*;
        assert_eq!(
            seen,
            [
                PartsChecked,
                MetaWritten,
                Renamed,
                LatestStaged,
                LatestReplaced,
                Pruned
            ]
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_checkpoint_made_again_never_replaces_the_one_latest_names() {
        let d = tempdir("again");
        let mut made = Vec::new();
        for _ in 0..2 {
            write_all(&d, &[0, 1], 10);
            made.push(commit(&d, meta(10), &[0, 1], 2).unwrap());
        }
        assert_ne!(made[0], made[1]);
        assert!(made[0].join(META).is_file());
        assert_eq!(locate(&d).unwrap(), made[1]);
        // The newer sorts after the older, so pruning keeps the newest.
        write_all(&d, &[0, 1], 20);
        commit(&d, meta(20), &[0, 1], 2).unwrap();
        assert!(!made[0].exists() && made[1].exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corruption_and_mismatches_are_refused() {
        let d = tempdir("bad");
        write_all(&d, &[0, 1], 5);
        let c = commit(&d, meta(5), &[0, 1], 2).unwrap();
        let m = read_meta(&c).unwrap();
        // A flipped bit: the file's own checksum no longer matches.
        let f = c.join("rank-0.bin");
        let good = std::fs::read(&f).unwrap();
        let mut bytes = good.clone();
        let k = bytes.len() - 6;
        bytes[k] ^= 0xff;
        std::fs::write(&f, &bytes).unwrap();
        assert!(
            read_rank(&c, &m, 0)
                .unwrap_err()
                .to_string()
                .contains("corrupt")
        );
        // A valid file of another rank or checkpoint in its place: meta.json's record differs.
        let mut other = state(0, 5);
        other.params[0] = 9.0;
        write_model(&f, &other).unwrap();
        let e = read_rank(&c, &m, 0).unwrap_err().to_string();
        assert!(e.contains("replaced"), "{e}");
        std::fs::write(&f, &good).unwrap();
        assert!(read_rank(&c, &m, 0).is_ok());
        std::fs::remove_file(c.join("rank-1.bin")).unwrap();
        assert!(read_rank(&c, &m, 1).is_err());
        // meta.json edited after the commit: LATEST's checksum catches it.
        let mut edited = m.clone();
        edited.seed = 2;
        std::fs::write(c.join(META), serde_json::to_vec_pretty(&edited).unwrap()).unwrap();
        let e = locate(&d).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
        std::fs::write(d.join(LATEST), "ckpt-0000000005\n").unwrap();
        assert!(locate(&d).is_err());
        let other = Layout { tensors: vec![] };
        let config = m.config.clone().unwrap();
        let sgp = AlgoConfig::new(wagma::algo::Algorithm::from_name("sgp").unwrap());
        let same = Identity {
            workload: "image",
            layout: &m.layout,
            config: &config,
            ranks: 2,
            seed: m.seed,
        };
        assert!(check_compatible(&m, &same, &c).is_ok());
        // Checkpoints from before the whole configuration was kept: the label decides.
        let unlabelled = Meta {
            config: None,
            ..m.clone()
        };
        let mut other_scope = config.clone();
        other_scope.scope.average_buffers = !other_scope.scope.average_buffers;
        let other_seed = AlgoConfig {
            seed: 9,
            ..config.clone()
        };
        assert!(
            check_compatible(
                &unlabelled,
                &Identity {
                    config: &other_scope,
                    ..same
                },
                &c
            )
            .is_ok()
        );
        for (run, why) in [
            (
                Identity {
                    layout: &other,
                    ..same
                },
                "another model",
            ),
            (
                Identity {
                    workload: "translate",
                    ..same
                },
                "workload",
            ),
            (
                Identity {
                    config: &sgp,
                    ..same
                },
                "trains with sgp",
            ),
            (Identity { ranks: 4, ..same }, "4"),
            // The same label, another setting the label does not show.
            (
                Identity {
                    config: &other_scope,
                    ..same
                },
                "with scope.average_buffers = true, this run has false",
            ),
            (
                Identity {
                    config: &other_seed,
                    ..same
                },
                "with seed = 0, this run has 9",
            ),
            (
                Identity {
                    seed: m.seed + 1,
                    ..same
                },
                "seed",
            ),
        ] {
            let e = check_compatible(&m, &run, &c).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        assert!(locate(&d.join("nothing")).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn header_lengths_that_overflow_are_refused() {
        // A file with a valid checksum whose header claims more data than fits in memory.
        let mut st = state(0, 1);
        st.params.clear();
        st.buffers.clear();
        let good = encode(&st);
        let hlen = u32::from_le_bytes([good[12], good[13], good[14], good[15]]) as usize;
        let text = String::from_utf8(good[16..16 + hlen].to_vec()).unwrap();
        let huge = text.replace("\"params\":0", &format!("\"params\":{}", usize::MAX));
        let mut out = good[..12].to_vec();
        out.extend_from_slice(&(huge.len() as u32).to_le_bytes());
        out.extend_from_slice(huge.as_bytes());
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        let e = decode(&out, Path::new("x")).unwrap_err().to_string();
        assert!(e.contains("does not match the header"), "{e}");
    }
}
