//! The training device is configuration: `flex` (burn's CPU backend) by default; CUDA and wgpu
//! when built with the `cuda` or `wgpu` feature. Models train on the device; wagma moves flat
//! `f32` buffers staged in host memory (each step copies the parameters to the host and back).

use std::str::FromStr;
use std::sync::OnceLock;

use burn::prelude::Device;
use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// A burn device, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceChoice {
    /// burn's CPU backend (always available).
    #[default]
    Flex,
    /// A CUDA GPU by index (feature `cuda`).
    Cuda(usize),
    /// The best wgpu adapter (feature `wgpu`: Vulkan, Metal or DirectX).
    Wgpu,
}

impl FromStr for DeviceChoice {
    type Err = TrainError;
    fn from_str(s: &str) -> Result<Self, TrainError> {
        match s {
            "flex" | "cpu" => Ok(DeviceChoice::Flex),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            "wgpu" => Ok(DeviceChoice::Wgpu),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(i)) => Ok(DeviceChoice::Cuda(i)),
                _ => Err(TrainError::Config(format!(
                    "unknown device {s:?} (expected flex, cuda, cuda:N or wgpu)"
                ))),
            },
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Flex => f.write_str("flex"),
            DeviceChoice::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceChoice::Wgpu => f.write_str("wgpu"),
        }
    }
}

impl DeviceChoice {
    /// The device, or an error naming the cargo feature this build lacks.
    pub fn device(&self) -> Result<Device, TrainError> {
        let missing = |feature: &str| {
            TrainError::Config(format!(
                "device {self} needs a build with the `{feature}` feature (cargo build --release --features {feature})"
            ))
        };
        match *self {
            DeviceChoice::Flex => Ok(Device::flex()),
            #[cfg(feature = "cuda")]
            DeviceChoice::Cuda(i) => Ok(Device::cuda(i)),
            #[cfg(not(feature = "cuda"))]
            DeviceChoice::Cuda(_) => Err(missing("cuda")),
            #[cfg(feature = "wgpu")]
            DeviceChoice::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(not(feature = "wgpu"))]
            DeviceChoice::Wgpu => Err(missing("wgpu")),
        }
    }
}

static SELECTED: OnceLock<DeviceChoice> = OnceLock::new();

/// Selects the device of this process's training (once; a second, different choice is an
/// error, since every rank of a process shares the workloads' device).
pub fn select(choice: DeviceChoice) -> Result<(), TrainError> {
    choice.device()?;
    let got = *SELECTED.get_or_init(|| choice);
    if got != choice {
        return Err(TrainError::Config(format!(
            "this process already trains on {got}; it cannot switch to {choice}"
        )));
    }
    Ok(())
}

/// The selected device (flex when none was selected).
pub fn selected() -> Device {
    match SELECTED.get().copied().unwrap_or_default().device() {
        Ok(d) => d,
        // `select` checked it; only flex can be selected without a check.
        Err(_) => Device::flex(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_gpus_need_their_feature() {
        assert_eq!("flex".parse::<DeviceChoice>().unwrap(), DeviceChoice::Flex);
        assert_eq!(
            "cuda:1".parse::<DeviceChoice>().unwrap(),
            DeviceChoice::Cuda(1)
        );
        assert!("tpu".parse::<DeviceChoice>().is_err());
        assert!("cuda:x".parse::<DeviceChoice>().is_err());
        if !cfg!(feature = "cuda") {
            let e = DeviceChoice::Cuda(0).device().unwrap_err().to_string();
            assert!(e.contains("--features cuda"), "{e}");
            assert!(select(DeviceChoice::Cuda(0)).is_err());
        }
        if !cfg!(feature = "wgpu") {
            assert!(DeviceChoice::Wgpu.device().is_err());
        }
        assert!(DeviceChoice::Flex.device().is_ok());
    }
}
