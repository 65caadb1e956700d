//! The local optimizer on flat buffers: SGD with momentum (PyTorch semantics: no dampening,
//! optional Nesterov), weight decay, learning-rate schedules and gradient-norm clipping.

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

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

    fn validate(&self) -> Result<(), ConfigError> {
        let (lr, ok) = match self {
            LrSchedule::Constant { lr } => (*lr, true),
            LrSchedule::WarmupStep { lr, gamma, .. } => (*lr, gamma.is_finite() && *gamma >= 0.0),
            LrSchedule::Cosine { lr, min_lr, .. } => (*lr, min_lr.is_finite() && *min_lr >= 0.0),
        };
        if !(lr.is_finite() && lr >= 0.0 && ok) {
            return Err(ConfigError::Invalid {
                what: "learning-rate schedule",
                detail: format!("{self:?}"),
            });
        }
        Ok(())
    }
}

/// Settings of the local optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// Learning-rate schedule.
    pub lr: LrSchedule,
    /// Momentum (0 for plain SGD).
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f32,
    /// Clip the gradient to this global L2 norm.
    pub clip_norm: Option<f32>,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            lr: LrSchedule::Constant { lr: 0.1 },
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
            clip_norm: None,
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
        Ok(())
    }
}

/// SGD with momentum on a flat parameter buffer.
#[derive(Debug, Clone)]
pub struct Sgd {
    cfg: OptimizerConfig,
    momentum: Vec<f32>,
}

impl Sgd {
    /// An optimizer for `len` parameters.
    pub fn new(cfg: OptimizerConfig, len: usize) -> Result<Sgd, ConfigError> {
        cfg.validate()?;
        let momentum = if cfg.momentum > 0.0 {
            vec![0.0; len]
        } else {
            Vec::new()
        };
        Ok(Sgd { cfg, momentum })
    }

    /// The settings.
    pub fn config(&self) -> &OptimizerConfig {
        &self.cfg
    }

    /// The momentum buffer (empty without momentum).
    pub fn momentum(&self) -> &[f32] {
        &self.momentum
    }

    /// The momentum buffer, mutably (to average or restore it).
    pub fn momentum_mut(&mut self) -> &mut [f32] {
        &mut self.momentum
    }

    /// Rate and gradient scale of step `t`.
    fn coefficients(&self, t: u64, grad: &[f32]) -> Update {
        let clip = self.cfg.clip_norm.map_or(1.0, |c| {
            let norm = grad
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum::<f64>()
                .sqrt() as f32;
            if norm > c { c / (norm + 1e-6) } else { 1.0 }
        });
        Update {
            lr: self.cfg.lr.at(t),
            momentum: self.cfg.momentum,
            weight_decay: self.cfg.weight_decay,
            nesterov: self.cfg.nesterov,
            clip,
        }
    }

    /// The update `dW` of step `t` for gradient `grad` at `params`, written to `out`, following
    /// `torch.optim.SGD`: `g = clip(grad) + wd*W; buf = m*buf + g; d = nesterov ? g + m*buf : buf;
    /// dW = -lr * d`. The momentum buffer advances.
    pub fn delta(&mut self, t: u64, params: &[f32], grad: &[f32], out: &mut [f32]) {
        let u = self.coefficients(t, grad);
        let n = out.len().min(params.len()).min(grad.len());
        for i in 0..n {
            out[i] = u.delta(grad[i], params[i], self.momentum.get_mut(i));
        }
    }

    /// Applies step `t` to `params` in place.
    pub fn step(&mut self, t: u64, params: &mut [f32], grad: &[f32]) {
        let u = self.coefficients(t, grad);
        for (i, (w, &g)) in params.iter_mut().zip(grad).enumerate() {
            *w += u.delta(g, *w, self.momentum.get_mut(i));
        }
    }
}

/// The scalars of one step.
struct Update {
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
    clip: f32,
}

impl Update {
    #[inline]
    fn delta(&self, g: f32, w: f32, buf: Option<&mut f32>) -> f32 {
        let g = g * self.clip + self.weight_decay * w;
        match buf {
            Some(b) if self.momentum > 0.0 => {
                *b = self.momentum * *b + g;
                let d = if self.nesterov {
                    g + self.momentum * *b
                } else {
                    *b
                };
                -self.lr * d
            }
            _ => -self.lr * g,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_torch_sgd_with_momentum_and_weight_decay() {
        // torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=0.01), w0 = [1, -2],
        // grads g1 = [0.5, 0.5], g2 = [-1, 2]:
        //   step 1: buf = g + wd*w = [0.51, 0.48];         w = [0.949, -2.048]
        //   step 2: g' = [-1+0.00949, 2-0.02048] = [-0.99051, 1.97952]
        //           buf = 0.9*buf + g' = [-0.53151, 2.41152]; w = [1.002151, -2.289152]
        let cfg = OptimizerConfig {
            lr: LrSchedule::Constant { lr: 0.1 },
            momentum: 0.9,
            weight_decay: 0.01,
            ..OptimizerConfig::default()
        };
        let mut opt = Sgd::new(cfg, 2).unwrap();
        let mut w = vec![1.0f32, -2.0];
        opt.step(0, &mut w, &[0.5, 0.5]);
        assert!(
            (w[0] - 0.949).abs() < 1e-6 && (w[1] + 2.048).abs() < 1e-6,
            "{w:?}"
        );
        opt.step(1, &mut w, &[-1.0, 2.0]);
        assert!(
            (w[0] - 1.002151).abs() < 1e-5 && (w[1] + 2.289152).abs() < 1e-5,
            "{w:?}"
        );
    }

    #[test]
    fn delta_equals_step() {
        let cfg = OptimizerConfig {
            nesterov: true,
            weight_decay: 1e-3,
            clip_norm: Some(0.5),
            ..OptimizerConfig::default()
        };
        let (mut a, mut b) = (Sgd::new(cfg.clone(), 3).unwrap(), Sgd::new(cfg, 3).unwrap());
        let mut w = vec![0.3f32, -0.2, 0.9];
        let w0 = w.clone();
        let mut d = vec![0.0; 3];
        for t in 0..5 {
            let g = [0.4 * t as f32, -1.0, 2.0];
            let before = w.clone();
            a.step(t, &mut w, &g);
            b.delta(t, &before, &g, &mut d);
            for i in 0..3 {
                assert!((before[i] + d[i] - w[i]).abs() < 1e-7);
            }
        }
        assert_ne!(w, w0);
    }

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
        let c = OptimizerConfig {
            momentum: 1.5,
            ..OptimizerConfig::default()
        };
        assert!(c.validate().is_err());
        let c = OptimizerConfig {
            lr: LrSchedule::Constant { lr: f32::NAN },
            ..OptimizerConfig::default()
        };
        assert!(c.validate().is_err());
        let c = OptimizerConfig {
            nesterov: true,
            momentum: 0.0,
            ..OptimizerConfig::default()
        };
        assert!(c.validate().is_err());
    }
}
