//! IDX files (MNIST, Fashion-MNIST), plain or gzip-compressed.

use std::io::Read;
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;

use super::ImageSet;
use crate::error::TrainError;

/// Where Debian's `dataset-fashion-mnist` package puts the files.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Largest file accepted (the 60k MNIST images are 47 MB uncompressed).
const MAX_BYTES: u64 = 512 << 20;

fn read_all(path: &Path) -> Result<Vec<u8>, TrainError> {
    let f = std::fs::File::open(path).map_err(|e| TrainError::io(path, e))?;
    let mut buf = Vec::new();
    let gz = path.extension().is_some_and(|e| e == "gz");
    let r: Box<dyn Read> = if gz {
        Box::new(GzDecoder::new(f))
    } else {
        Box::new(f)
    };
    r.take(MAX_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| TrainError::io(path, e))?;
    if buf.len() as u64 > MAX_BYTES {
        return Err(TrainError::data(
            path,
            "file is larger than any IDX dataset",
        ));
    }
    Ok(buf)
}

/// Parses an IDX file: element type 0x08 (u8), returns dimensions and bytes.
pub fn parse(bytes: &[u8], path: &Path) -> Result<(Vec<usize>, Vec<u8>), TrainError> {
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(TrainError::data(path, "not an IDX file (bad magic)"));
    }
    if bytes[2] != 0x08 {
        return Err(TrainError::data(
            path,
            format!("element type {:#x} is not unsigned bytes", bytes[2]),
        ));
    }
    let ndim = bytes[3] as usize;
    let header = 4 + 4 * ndim;
    if ndim == 0 || bytes.len() < header {
        return Err(TrainError::data(path, "truncated IDX header"));
    }
    let dims: Vec<usize> = (0..ndim)
        .map(|i| {
            u32::from_be_bytes([
                bytes[4 + 4 * i],
                bytes[5 + 4 * i],
                bytes[6 + 4 * i],
                bytes[7 + 4 * i],
            ]) as usize
        })
        .collect();
    let count = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    match count {
        Some(n) if bytes.len() - header == n => Ok((dims, bytes[header..].to_vec())),
        _ => Err(TrainError::data(
            path,
            format!(
                "dimensions {dims:?} do not match the {} data bytes",
                bytes.len() - header
            ),
        )),
    }
}

/// Finds `stem` or `stem.gz` in `dir`.
fn locate(dir: &Path, stem: &str) -> Option<PathBuf> {
    [dir.join(stem), dir.join(format!("{stem}.gz"))]
        .into_iter()
        .find(|p| p.is_file())
}

/// Loads the training and test splits from the MNIST-format files in `dir`.
pub fn load_dir(dir: &Path) -> Result<(ImageSet, ImageSet), TrainError> {
    if !dir.is_dir() {
        return Err(TrainError::data(dir, "is not a directory"));
    }
    let split = |prefix: &str| -> Result<ImageSet, TrainError> {
        let img = locate(dir, &format!("{prefix}-images-idx3-ubyte")).ok_or_else(|| {
            TrainError::data(dir, format!("has no {prefix}-images-idx3-ubyte[.gz]"))
        })?;
        let lab = locate(dir, &format!("{prefix}-labels-idx1-ubyte")).ok_or_else(|| {
            TrainError::data(dir, format!("has no {prefix}-labels-idx1-ubyte[.gz]"))
        })?;
        let (idims, pixels) = parse(&read_all(&img)?, &img)?;
        let (ldims, labels) = parse(&read_all(&lab)?, &lab)?;
        if idims.len() != 3 || ldims.len() != 1 || idims[0] != ldims[0] {
            return Err(TrainError::data(
                &img,
                format!("images {idims:?} and labels {ldims:?} do not match"),
            ));
        }
        if let Some(&bad) = labels.iter().find(|&&l| l > 9) {
            return Err(TrainError::data(&lab, format!("label {bad} outside 0..10")));
        }
        Ok(ImageSet {
            pixels: pixels.iter().map(|&p| f32::from(p) / 255.0).collect(),
            labels,
            channels: 1,
            height: idims[1],
            width: idims[2],
        }
        .standardized())
    };
    Ok((split("train")?, split("t10k")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut v = vec![0, 0, 8, dims.len() as u8];
        for d in dims {
            v.extend_from_slice(&d.to_be_bytes());
        }
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn parses_and_rejects() {
        let p = Path::new("x");
        let (d, b) = parse(&idx(&[2, 2, 2], &[1, 2, 3, 4, 5, 6, 7, 8]), p).unwrap();
        assert_eq!((d, b.len()), (vec![2, 2, 2], 8));
        assert!(parse(&idx(&[2, 2, 2], &[1, 2, 3]), p).is_err());
        assert!(parse(b"hello world", p).is_err());
        assert!(parse(&[0, 0, 0x0d, 1, 0, 0, 0, 1, 0, 0, 0, 0], p).is_err());
        assert!(parse(&[], p).is_err());
    }

    #[test]
    fn loads_a_directory() {
        let dir = std::env::temp_dir().join(format!("wagma-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let px: Vec<u8> = (0..4 * 9).map(|i| i as u8).collect();
        for split in ["train", "t10k"] {
            std::fs::write(
                dir.join(format!("{split}-images-idx3-ubyte")),
                idx(&[4, 3, 3], &px),
            )
            .unwrap();
            std::fs::write(
                dir.join(format!("{split}-labels-idx1-ubyte")),
                idx(&[4], &[0, 1, 2, 9]),
            )
            .unwrap();
        }
        let (train, test) = load_dir(&dir).unwrap();
        assert_eq!(
            (train.len(), test.len(), train.height, train.width),
            (4, 4, 3, 3)
        );
        std::fs::write(
            dir.join("t10k-labels-idx1-ubyte"),
            idx(&[4], &[0, 1, 2, 12]),
        )
        .unwrap();
        assert!(load_dir(&dir).unwrap_err().to_string().contains("label 12"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(load_dir(&dir).is_err());
    }
}
