//! Checkpoints: every replica with its optimizer, algorithm and data state, written so that a
//! failure never damages the previous checkpoint.
//!
//! Layout of a checkpoint directory `DIR`:
//! * `DIR/ckpt-<iteration>/meta.json`: format version, workload, model layout, algorithm,
//!   ranks, iteration, seed;
//! * `DIR/ckpt-<iteration>/rank-<r>.bin`: magic, format version, a JSON header, then the
//!   parameters, buffers and momentum as little-endian f32, and a CRC-32 of everything before;
//! * `DIR/LATEST`: the name of the newest complete checkpoint.
//!
//! Writing: every rank writes its file (temporary name, then rename) into `.ckpt-<iteration>.tmp`;
//! when all succeeded and every one of the job's ranks has its file there, rank 0 adds
//! `meta.json`, renames the directory to a name no other checkpoint has and then replaces
//! `LATEST` (temporary file, then rename), syncing files and directory entries. Until that last
//! rename the previous checkpoint is the one `LATEST` names, untouched; only then are older
//! ones pruned.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::flat::Layout;

/// Version of the format; a checkpoint of another version is refused.
pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"WAGMACKP";
const LATEST: &str = "LATEST";

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
    let tmp = path.with_extension("partial");
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))?;
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
    let n = header.params + header.buffers + header.momentum;
    if floats.len() != 4 * n {
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
    write_atomic(
        &tmp.join(format!("rank-{}.bin", state.rank)),
        &encode(state),
    )
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

/// Step 2, on rank 0 once every rank succeeded: completes the checkpoint and makes it the
/// latest; older checkpoints beyond the newest `keep` are removed.
pub fn commit(dir: &Path, meta: &Meta, keep: usize) -> Result<PathBuf, TrainError> {
    let tmp = tmp_dir(dir, meta.iteration);
    // Resuming needs every rank's part: one the job lost (elastic runs) makes the checkpoint
    // incomplete, and committing it would make `LATEST` name what cannot be resumed.
    if let Some(r) = (0..meta.ranks).find(|r| !tmp.join(format!("rank-{r}.bin")).is_file()) {
        abandon(dir, meta.iteration);
        return Err(TrainError::checkpoint(
            dir,
            format!(
                "rank {r} wrote no part at iteration {} (it may have been lost); a checkpoint \
                 must hold all {} ranks, so the previous one stays the latest",
                meta.iteration, meta.ranks
            ),
        ));
    }
    let json =
        serde_json::to_vec_pretty(meta).map_err(|e| TrainError::checkpoint(dir, e.to_string()))?;
    write_atomic(&tmp.join("meta.json"), &json)?;
    let done = final_dir(dir, meta.iteration);
    std::fs::rename(&tmp, &done).map_err(|e| io(&done, e))?;
    sync_dir(dir)?;
    let name = done
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    write_atomic(&dir.join(LATEST), name.as_bytes())?;
    prune(dir, keep);
    Ok(done)
}

/// Abandons a checkpoint whose write failed somewhere (the previous one stays the latest).
pub fn abandon(dir: &Path, iteration: u64) {
    let _ = std::fs::remove_dir_all(tmp_dir(dir, iteration));
}

fn prune(dir: &Path, keep: usize) {
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
    all.sort();
    let n = all.len();
    for old in all.into_iter().take(n.saturating_sub(keep)) {
        let _ = std::fs::remove_dir_all(old);
    }
}

/// The checkpoint a `--resume` path names: a checkpoint directory itself, or a directory with
/// a `LATEST` pointer.
pub fn locate(path: &Path) -> Result<PathBuf, TrainError> {
    if path.join("meta.json").is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    let name = std::fs::read_to_string(&latest).map_err(|_| {
        TrainError::checkpoint(path, "holds no checkpoint (no meta.json, no LATEST)")
    })?;
    let dir = path.join(name.trim());
    if !dir.join("meta.json").is_file() {
        return Err(TrainError::checkpoint(
            &dir,
            "LATEST names a checkpoint that does not exist",
        ));
    }
    Ok(dir)
}

/// Reads the shared part of a checkpoint.
pub fn read_meta(ckpt: &Path) -> Result<Meta, TrainError> {
    let p = ckpt.join("meta.json");
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
    Ok(meta)
}

/// Reads one rank's state.
pub fn read_rank(ckpt: &Path, rank: usize) -> Result<RankState, TrainError> {
    let p = ckpt.join(format!("rank-{rank}.bin"));
    let bytes = std::fs::read(&p).map_err(|e| io(&p, e))?;
    let s = decode(&bytes, &p)?;
    if s.rank != rank {
        return Err(TrainError::checkpoint(
            &p,
            format!("holds rank {}, not {rank}", s.rank),
        ));
    }
    Ok(s)
}

/// Checks that a checkpoint fits this run: same workload, model and ranks.
pub fn check_compatible(
    meta: &Meta,
    workload: &str,
    layout: &Layout,
    ranks: usize,
    ckpt: &Path,
) -> Result<(), TrainError> {
    if meta.workload != workload {
        return Err(TrainError::checkpoint(
            ckpt,
            format!(
                "is of the {} workload, this run trains {workload}",
                meta.workload
            ),
        ));
    }
    if &meta.layout != layout {
        let (a, b) = (meta.layout.params(), layout.params());
        return Err(TrainError::checkpoint(
            ckpt,
            format!(
                "holds another model ({a} parameters in {} tensors; this model has {b} in {})",
                meta.layout.tensors.len(),
                layout.tensors.len()
            ),
        ));
    }
    if meta.ranks != ranks {
        return Err(TrainError::checkpoint(
            ckpt,
            format!("was taken with {} ranks, this run has {ranks}", meta.ranks),
        ));
    }
    Ok(())
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
            algorithm: "wagma".into(),
            ranks: 2,
            iteration: it,
            seed: 1,
            samples: 10,
            train_s: 1.0,
        }
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wagma-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn round_trip_and_latest() {
        let d = tempdir("rt");
        for it in [10, 20] {
            for r in 0..2 {
                write_rank(&d, &state(r, it)).unwrap();
            }
            commit(&d, &meta(it), 2).unwrap();
        }
        let c = locate(&d).unwrap();
        assert!(c.ends_with("ckpt-0000000020"));
        assert_eq!(read_meta(&c).unwrap().iteration, 20);
        assert_eq!(read_rank(&c, 1).unwrap(), state(1, 20));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_the_previous_checkpoint() {
        let d = tempdir("fail");
        for r in 0..2 {
            write_rank(&d, &state(r, 10)).unwrap();
        }
        commit(&d, &meta(10), 2).unwrap();
        // The next checkpoint breaks half-way: one rank wrote, the other did not.
        write_rank(&d, &state(0, 20)).unwrap();
        abandon(&d, 20);
        let c = locate(&d).unwrap();
        assert_eq!(read_meta(&c).unwrap().iteration, 10);
        assert_eq!(read_rank(&c, 0).unwrap(), state(0, 10));
        // A commit that lacks a rank's part (a rank an elastic job lost) is refused, and
        // neither `LATEST` nor the previous checkpoint change.
        write_rank(&d, &state(0, 30)).unwrap();
        let e = commit(&d, &meta(30), 1).unwrap_err().to_string();
        assert!(e.contains("rank 1 wrote no part"), "{e}");
        assert_eq!(locate(&d).unwrap(), c);
        assert!(c.join("rank-1.bin").is_file());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_checkpoint_made_again_never_replaces_the_one_latest_names() {
        let d = tempdir("again");
        let mut made = Vec::new();
        for _ in 0..2 {
            for r in 0..2 {
                write_rank(&d, &state(r, 10)).unwrap();
            }
            made.push(commit(&d, &meta(10), 2).unwrap());
        }
        assert_ne!(made[0], made[1]);
        assert!(made[0].join("meta.json").is_file());
        assert_eq!(locate(&d).unwrap(), made[1]);
        // The newer sorts after the older, so pruning keeps the newest.
        for r in 0..2 {
            write_rank(&d, &state(r, 20)).unwrap();
        }
        commit(&d, &meta(20), 2).unwrap();
        assert!(!made[0].exists() && made[1].exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corruption_and_mismatches_are_refused() {
        let d = tempdir("bad");
        for r in 0..2 {
            write_rank(&d, &state(r, 5)).unwrap();
        }
        let c = commit(&d, &meta(5), 2).unwrap();
        std::fs::remove_file(c.join("rank-1.bin")).unwrap();
        let f = c.join("rank-0.bin");
        let mut bytes = std::fs::read(&f).unwrap();
        let k = bytes.len() - 6;
        bytes[k] ^= 0xff;
        std::fs::write(&f, &bytes).unwrap();
        assert!(
            read_rank(&c, 0)
                .unwrap_err()
                .to_string()
                .contains("corrupt")
        );
        assert!(read_rank(&c, 1).is_err());
        let m = read_meta(&c).unwrap();
        let other = Layout { tensors: vec![] };
        assert!(
            check_compatible(&m, "image", &other, 2, &c)
                .unwrap_err()
                .to_string()
                .contains("another model")
        );
        assert!(check_compatible(&m, "translate", &m.layout, 2, &c).is_err());
        assert!(check_compatible(&m, "image", &m.layout, 4, &c).is_err());
        assert!(locate(&d.join("nothing")).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
