//! Parallel sentences from the gettext catalogs installed on the machine
//! (`/usr/share/locale/<lang>/LC_MESSAGES/*.mo`): each message's English `msgid` and its
//! translation. They are read at run time and never copied.

use std::path::{Path, PathBuf};

use crate::error::TrainError;

/// Where the German catalogs live on Debian.
pub const GERMAN_DIR: &str = "/usr/share/locale/de/LC_MESSAGES";

const MAGIC_LE: u32 = 0x9504_12de;
const MAGIC_BE: u32 = 0xde12_0495;

/// `(english, translation)` pairs of one `.mo` file. Context prefixes are removed, plural
/// forms keep their singular, and the header entry is skipped.
pub fn parse_mo(bytes: &[u8], path: &Path) -> Result<Vec<(String, String)>, TrainError> {
    let bad = |m: &str| TrainError::data(path, m.to_string());
    if bytes.len() < 28 {
        return Err(bad("too short for a .mo file"));
    }
    let raw = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let le = match raw {
        MAGIC_LE => true,
        MAGIC_BE => false,
        _ => return Err(bad("not a .mo file (bad magic)")),
    };
    let word = |at: usize| -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
        Some(if le {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        } as usize)
    };
    let (Some(n), Some(orig), Some(trans)) = (word(8), word(12), word(16)) else {
        return Err(bad("truncated header"));
    };
    let string = |table: usize, i: usize| -> Option<&[u8]> {
        let len = word(table + 8 * i)?;
        let off = word(table + 8 * i + 4)?;
        bytes.get(off..off.checked_add(len)?)
    };
    let mut out = Vec::new();
    for i in 0..n {
        let (Some(id), Some(tr)) = (string(orig, i), string(trans, i)) else {
            return Err(bad("string table points outside the file"));
        };
        let id = first(strip_context(id));
        let tr = first(tr);
        if id.is_empty() || tr.is_empty() {
            continue;
        }
        if let (Ok(a), Ok(b)) = (std::str::from_utf8(id), std::str::from_utf8(tr)) {
            out.push((a.to_string(), b.to_string()));
        }
    }
    Ok(out)
}

/// The part after a `msgctxt\x04` prefix.
fn strip_context(s: &[u8]) -> &[u8] {
    match s.iter().position(|&b| b == 4) {
        Some(i) => &s[i + 1..],
        None => s,
    }
}

/// The first of NUL-separated plural forms.
fn first(s: &[u8]) -> &[u8] {
    match s.iter().position(|&b| b == 0) {
        Some(i) => &s[..i],
        None => s,
    }
}

/// Every `.mo` file in `dir`, sorted by name.
pub fn catalogs(dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    let rd = std::fs::read_dir(dir).map_err(|e| TrainError::io(dir, e))?;
    let mut v: Vec<PathBuf> = rd
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "mo"))
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(TrainError::data(dir, "holds no .mo catalogs"));
    }
    Ok(v)
}

/// All pairs of every catalog in `dir`, deduplicated by source sentence.
pub fn load_pairs(dir: &Path) -> Result<Vec<(String, String)>, TrainError> {
    let mut pairs = Vec::new();
    for path in catalogs(dir)? {
        let bytes = std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
        // A damaged catalog is skipped, not fatal: the others still make a corpus.
        match parse_mo(&bytes, &path) {
            Ok(p) => pairs.extend(p),
            Err(e) => tracing::warn!(error = %e, "skipping a catalog"),
        }
    }
    pairs.sort();
    pairs.dedup_by(|a, b| a.0 == b.0);
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a little-endian `.mo` file.
    pub fn build(entries: &[(&str, &str)]) -> Vec<u8> {
        let n = entries.len();
        let orig = 28;
        let trans = orig + 8 * n;
        let mut data_at = trans + 8 * n;
        let mut head = Vec::new();
        for v in [MAGIC_LE, 0, n as u32, orig as u32, trans as u32, 0, 0] {
            head.extend_from_slice(&v.to_le_bytes());
        }
        let mut tables = [Vec::new(), Vec::new()];
        let mut data = Vec::new();
        for (t, pick) in [0usize, 1].into_iter().enumerate() {
            for e in entries {
                let s = if pick == 0 { e.0 } else { e.1 };
                tables[t].extend_from_slice(&(s.len() as u32).to_le_bytes());
                tables[t].extend_from_slice(&(data_at as u32).to_le_bytes());
                data.extend_from_slice(s.as_bytes());
                data.push(0);
                data_at += s.len() + 1;
            }
        }
        [head, tables.concat(), data].concat()
    }

    #[test]
    fn parses_catalogs() {
        let mo = build(&[
            ("", "header"),
            ("Open file", "Datei öffnen"),
            ("menu\u{4}Quit", "Beenden"),
            ("%d file\0%d files", "%d Datei\0%d Dateien"),
        ]);
        let p = parse_mo(&mo, Path::new("t.mo")).unwrap();
        assert_eq!(
            p,
            vec![
                ("Open file".to_string(), "Datei öffnen".to_string()),
                ("Quit".to_string(), "Beenden".to_string()),
                ("%d file".to_string(), "%d Datei".to_string()),
            ]
        );
        assert!(parse_mo(b"garbage that is long enough to be read", Path::new("x")).is_err());
        let mut broken = mo.clone();
        broken.truncate(60);
        assert!(parse_mo(&broken, Path::new("x")).is_err());
    }
}
