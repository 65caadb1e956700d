//! SGD with momentum (PyTorch semantics: no dampening, optional Nesterov) and weight decay.

use super::{LocalOptimizer, OptimizerConfig, clip_scale};
use crate::error::ConfigError;

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
        let clip = clip_scale(self.cfg.clip_norm, grad);
        Update {
            lr: self.cfg.lr.at(t),
            momentum: self.cfg.momentum,
            weight_decay: self.cfg.weight_decay,
            nesterov: self.cfg.nesterov,
            clip,
        }
    }

    /// Applies step `t` to `params` in place.
    pub fn apply(&mut self, t: u64, params: &mut [f32], grad: &[f32]) {
        let u = self.coefficients(t, grad);
        for (i, (w, &g)) in params.iter_mut().zip(grad).enumerate() {
            *w += u.delta(g, *w, self.momentum.get_mut(i));
        }
    }
}

impl LocalOptimizer for Sgd {
    fn step(&mut self, t: u64, params: &mut [f32], grad: &[f32]) {
        self.apply(t, params, grad);
    }

    fn state(&self) -> &[f32] {
        &self.momentum
    }

    fn state_mut(&mut self) -> &mut [f32] {
        &mut self.momentum
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
    use crate::algo::optim::LrSchedule;

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
        opt.apply(0, &mut w, &[0.5, 0.5]);
        assert!(
            (w[0] - 0.949).abs() < 1e-6 && (w[1] + 2.048).abs() < 1e-6,
            "{w:?}"
        );
        opt.apply(1, &mut w, &[-1.0, 2.0]);
        assert!(
            (w[0] - 1.002151).abs() < 1e-5 && (w[1] + 2.289152).abs() < 1e-5,
            "{w:?}"
        );
    }
}
