//! # wagma-sim
//!
//! Runs wagma's own engines, schedules and algorithm policies in virtual time at thousands of
//! ranks: the executor is `wagma::exec::virtual_time`, payloads are sizes only (a 25.6M-parameter
//! model costs nothing to carry), the network is LogGP ([`loggp`]) and compute times come from
//! the imbalance profiles or from traces recorded by `wagma train --trace-compute`
//! ([`compute`]). [`calibrate`] fits the network parameters to a real transport.

pub mod calibrate;
pub mod compute;
pub mod loggp;
pub mod study;

pub use loggp::{LogGp, LogGpNetwork};
pub use study::{SimResult, SimSpec, simulate, simulate_on};

/// A failure of a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A setting that cannot work.
    #[error("invalid setting: {0}")]
    Config(String),
    /// The simulated job failed.
    #[error(transparent)]
    Engine(#[from] wagma::Error),
    /// A bad algorithm or topology setting.
    #[error(transparent)]
    EngineConfig(#[from] wagma::ConfigError),
    /// Reading a trace or calibration file failed.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
}

/// Engine settings in virtual time, with the timeout off.
pub(crate) fn virtual_engine() -> wagma::EngineConfig {
    wagma::EngineConfig {
        timeout: wagma::exec::virtual_time::TIMEOUT_OFF,
        ..wagma::EngineConfig::default()
    }
}
