//! The local optimizer on flat buffers: SGD with momentum (PyTorch semantics: no dampening,
//! optional Nesterov), Adam and AdamW, weight decay, learning-rate schedules and gradient-norm
//! clipping. Any other update rule plugs in through [`LocalOptimizer`], or is applied outside
//! wagma altogether ([`crate::algo::Worker::step_external`]).

mod adam;
mod sgd;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

pub use adam::Adam;
pub use sgd::Sgd;

/// Learning rate as a function of the step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum LrSchedule {
    /// The same rate every step.
    Constant {
        /// Learning rate.
        lr: f32,
    },
    /// Linear warm-up from `lr / warmup` to `lr` over `warmup` steps, then multiplied by
    /// `gamma` at each milestone (the ResNet recipe: warm-up, then step decay).
    WarmupStep {
        /// Peak learning rate.
        lr: f32,
        /// Warm-up steps.
        warmup: u64,
        /// Steps at which the rate is multiplied by `gamma`.
        milestones: Vec<u64>,
        /// Decay factor.
        gamma: f32,
    },
    /// Linear warm-up, then cosine decay from `lr` to `min_lr` at step `total`.
    Cosine {
        /// Peak learning rate.
        lr: f32,
        /// Warm-up steps.
        warmup: u64,
        /// Step at which the rate reaches `min_lr`.
        total: u64,
        /// Final rate.
        min_lr: f32,
    },
}

impl LrSchedule {
    /// The learning rate at step `t` (0-based).
    pub fn at(&self, t: u64) -> f32 {
        let warm = |lr: f32, warmup: u64| -> Option<f32> {
            (t < warmup).then(|| lr * (t + 1) as f32 / warmup as f32)
        };
        match self {
            LrSchedule::Constant { lr } => *lr,
            LrSchedule::WarmupStep {
                lr,
                warmup,
                milestones,
                gamma,
            } => warm(*lr, *warmup).unwrap_or_else(|| {
                let passed = milestones.iter().filter(|&&m| t >= m).count();
                lr * gamma.powi(passed as i32)
            }),
            LrSchedule::Cosine {
                lr,
                warmup,
                total,
                min_lr,
            } => warm(*lr, *warmup).unwrap_or_else(|| {
                let span = total.saturating_sub(*warmup).max(1) as f32;
                let x = ((t - warmup) as f32 / span).min(1.0);
                min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f32::consts::PI * x).cos())
            }),
        }
    }

    /// Checks ranges: a positive, finite peak rate.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let (lr, ok) = match self {
            LrSchedule::Constant { lr } => (*lr, true),
            LrSchedule::WarmupStep { lr, gamma, .. } => (*lr, gamma.is_finite() && *gamma >= 0.0),
            LrSchedule::Cosine { lr, min_lr, .. } => (*lr, min_lr.is_finite() && *min_lr >= 0.0),
        };
        if !(lr.is_finite() && lr > 0.0 && ok) {
            return Err(ConfigError::Invalid {
                what: "learning-rate schedule (the rate must be positive and finite)",
                detail: format!("{self:?}"),
            });
        }
        Ok(())
    }
}

/// Which update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    /// SGD with momentum (`torch.optim.SGD`).
    #[default]
    Sgd,
    /// Adam with L2 weight decay added to the gradient (`torch.optim.Adam`).
    Adam,
    /// Adam with decoupled weight decay (`torch.optim.AdamW`).
    #[serde(rename = "adamw")]
    AdamW,
}

impl OptimizerKind {
    /// Every name, for listings.
    pub const NAMES: [&'static str; 3] = ["sgd", "adam", "adamw"];
}

impl std::str::FromStr for OptimizerKind {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sgd" => Ok(OptimizerKind::Sgd),
            "adam" => Ok(OptimizerKind::Adam),
            "adamw" => Ok(OptimizerKind::AdamW),
            _ => Err(ConfigError::Invalid {
                what: "optimizer",
                detail: format!(
                    "{s:?} (expected one of {})",
                    OptimizerKind::NAMES.join(", ")
                ),
            }),
        }
    }
}

impl std::fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
        })
    }
}

fn default_betas() -> (f32, f32) {
    (0.9, 0.999)
}

fn default_eps() -> f32 {
    1e-8
}

/// Settings of the local optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// The update rule.
    #[serde(default)]
    pub kind: OptimizerKind,
    /// Learning-rate schedule.
    pub lr: LrSchedule,
    /// Momentum (SGD; 0 for plain SGD).
    pub momentum: f32,
    /// Nesterov momentum (SGD).
    pub nesterov: bool,
    /// Weight decay: L2 added to the gradient (SGD, Adam), or decoupled (AdamW).
    pub weight_decay: f32,
    /// Clip the gradient to this global L2 norm.
    pub clip_norm: Option<f32>,
    /// Adam's decay rates of the first and second moments.
    #[serde(default = "default_betas")]
    pub betas: (f32, f32),
    /// Adam's term added to the denominator.
    #[serde(default = "default_eps")]
    pub eps: f32,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Sgd,
            lr: LrSchedule::Constant { lr: 0.1 },
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
            clip_norm: None,
            betas: default_betas(),
            eps: default_eps(),
        }
    }
}

impl OptimizerConfig {
    /// Plain SGD with a constant rate.
    pub fn sgd(lr: f32) -> OptimizerConfig {
        OptimizerConfig {
            lr: LrSchedule::Constant { lr },
            momentum: 0.0,
            ..OptimizerConfig::default()
        }
    }

    /// Adam with PyTorch's defaults (betas 0.9, 0.999; eps 1e-8) and a constant rate.
    pub fn adam(lr: f32) -> OptimizerConfig {
        OptimizerConfig {
            kind: OptimizerKind::Adam,
            lr: LrSchedule::Constant { lr },
            momentum: 0.0,
            ..OptimizerConfig::default()
        }
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.lr.validate()?;
        let bad = |what: &'static str, v: f32| ConfigError::Invalid {
            what,
            detail: format!("{v}"),
        };
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(bad("momentum (0 <= m < 1)", self.momentum));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(bad("weight decay", self.weight_decay));
        }
        if let Some(c) = self.clip_norm
            && !(c.is_finite() && c > 0.0)
        {
            return Err(bad("clip norm", c));
        }
        if self.nesterov && self.momentum == 0.0 {
            return Err(ConfigError::Invalid {
                what: "nesterov",
                detail: "Nesterov momentum needs a momentum above 0".into(),
            });
        }
        if self.kind != OptimizerKind::Sgd {
            let (b1, b2) = self.betas;
            for (what, b) in [("beta1 (0 < b < 1)", b1), ("beta2 (0 < b < 1)", b2)] {
                if !(b > 0.0 && b < 1.0) {
                    return Err(bad(what, b));
                }
            }
            if !(self.eps.is_finite() && self.eps > 0.0) {
                return Err(bad("eps (positive)", self.eps));
            }
            if self.momentum != 0.0 || self.nesterov {
                return Err(ConfigError::Invalid {
                    what: "momentum",
                    detail: format!(
                        "{} takes betas, not momentum (set momentum to 0)",
                        self.kind
                    ),
                });
            }
        }
        Ok(())
    }

    /// The optimizer for `len` parameters.
    pub fn build(&self, len: usize) -> Result<Box<dyn LocalOptimizer>, ConfigError> {
        Ok(match self.kind {
            OptimizerKind::Sgd => Box::new(Sgd::new(self.clone(), len)?),
            OptimizerKind::Adam | OptimizerKind::AdamW => Box::new(Adam::new(self.clone(), len)?),
        })
    }
}

/// A local update rule on a flat parameter buffer, with its state as one flat vector (what a
/// checkpoint stores and what [`crate::algo::Scope::average_optimizer_state`] averages).
pub trait LocalOptimizer: Send {
    /// Applies step `t` (0-based) with gradient `grad` to `params` in place.
    fn step(&mut self, t: u64, params: &mut [f32], grad: &[f32]);
    /// The state (SGD's momentum, Adam's two moments); empty when stateless.
    fn state(&self) -> &[f32];
    /// The state, mutably (to average or restore it).
    fn state_mut(&mut self) -> &mut [f32];
}

/// The gradient's scale that clips its global L2 norm to `clip` (1 when below).
pub(crate) fn clip_scale(clip: Option<f32>, grad: &[f32]) -> f32 {
    clip.map_or(1.0, |c| {
        let norm = grad
            .iter()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt() as f32;
        if norm > c { c / (norm + 1e-6) } else { 1.0 }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules() {
        let s = LrSchedule::WarmupStep {
            lr: 1.0,
            warmup: 4,
            milestones: vec![10, 20],
            gamma: 0.1,
        };
        assert_eq!(s.at(0), 0.25);
        assert_eq!(s.at(3), 1.0);
        assert_eq!(s.at(9), 1.0);
        assert!((s.at(10) - 0.1).abs() < 1e-7);
        assert!((s.at(25) - 0.01).abs() < 1e-8);
        let c = LrSchedule::Cosine {
            lr: 1.0,
            warmup: 0,
            total: 100,
            min_lr: 0.0,
        };
        assert_eq!(c.at(0), 1.0);
        assert!((c.at(50) - 0.5).abs() < 1e-6);
        assert!(c.at(100).abs() < 1e-6);
        assert!(c.at(1000).abs() < 1e-6);
    }

    #[test]
    fn bad_settings() {
        let bad = [
            OptimizerConfig {
                momentum: 1.5,
                ..OptimizerConfig::default()
            },
            OptimizerConfig {
                lr: LrSchedule::Constant { lr: f32::NAN },
                ..OptimizerConfig::default()
            },
            OptimizerConfig {
                lr: LrSchedule::Constant { lr: 0.0 },
                ..OptimizerConfig::default()
            },
            OptimizerConfig {
                lr: LrSchedule::Constant { lr: -0.1 },
                ..OptimizerConfig::adam(0.1)
            },
            OptimizerConfig {
                nesterov: true,
                momentum: 0.0,
                ..OptimizerConfig::default()
            },
            OptimizerConfig {
                betas: (0.0, 0.999),
                ..OptimizerConfig::adam(1e-3)
            },
            OptimizerConfig {
                betas: (0.9, -0.5),
                ..OptimizerConfig::adam(1e-3)
            },
            OptimizerConfig {
                betas: (0.9, 1.0),
                ..OptimizerConfig::adam(1e-3)
            },
            OptimizerConfig {
                eps: 0.0,
                ..OptimizerConfig::adam(1e-3)
            },
            OptimizerConfig {
                eps: -1e-8,
                ..OptimizerConfig::adam(1e-3)
            },
            OptimizerConfig {
                momentum: 0.9,
                ..OptimizerConfig::adam(1e-3)
            },
        ];
        for c in bad {
            assert!(
                matches!(c.validate(), Err(ConfigError::Invalid { .. })),
                "{c:?}"
            );
            assert!(c.build(3).is_err());
        }
        assert!(matches!(
            "adamax".parse::<OptimizerKind>(),
            Err(ConfigError::Invalid {
                what: "optimizer",
                ..
            })
        ));
        for n in OptimizerKind::NAMES {
            assert_eq!(n.parse::<OptimizerKind>().unwrap().to_string(), n);
        }
    }

    #[test]
    fn old_configurations_without_a_kind_are_sgd() {
        let c: OptimizerConfig = serde_json::from_str(
            r#"{"lr":{"kind":"constant","lr":0.1},"momentum":0.9,"nesterov":false,"weight_decay":0.0,"clip_norm":null}"#,
        )
        .unwrap();
        assert_eq!(c, OptimizerConfig::default());
    }
}
