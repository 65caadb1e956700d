//! Errors of the training crate.

use std::path::{Path, PathBuf};

/// A failure of a training run, with the file or setting involved.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Reading or writing a file failed.
    #[error("{}: {message}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        message: String,
    },
    /// A data file or directory does not hold what it should.
    #[error("{}: {message}", path.display())]
    Data {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A checkpoint cannot be used.
    #[error("checkpoint {}: {message}", path.display())]
    Checkpoint {
        /// The checkpoint directory.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// A setting that cannot work.
    #[error("invalid setting: {0}")]
    Config(String),
    /// A peer sent what the protocol does not allow (a malformed welcome of a rejoin).
    #[error("a peer broke the protocol: {0}")]
    Peer(String),
    /// A failure inside this process that no setting explains (a worker thread that panicked).
    #[error("internal failure: {0}")]
    Internal(String),
    /// The distributed engine failed.
    #[error(transparent)]
    Engine(#[from] wagma::Error),
    /// A setting of the engine or algorithm that cannot work.
    #[error(transparent)]
    EngineConfig(#[from] wagma::ConfigError),
}

impl TrainError {
    /// An I/O failure on `path`.
    pub fn io(path: &Path, e: std::io::Error) -> TrainError {
        TrainError::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }

    /// Bad data at `path`.
    pub fn data(path: &Path, message: impl Into<String>) -> TrainError {
        TrainError::Data {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    /// A checkpoint problem at `path`.
    pub fn checkpoint(path: &Path, message: impl Into<String>) -> TrainError {
        TrainError::Checkpoint {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}
