//! Adam and AdamW on flat buffers, following `torch.optim.Adam` and `torch.optim.AdamW`.

use super::{LocalOptimizer, OptimizerConfig, OptimizerKind, clip_scale};
use crate::error::ConfigError;

/// Adam (L2 weight decay added to the gradient) or AdamW (decoupled weight decay). The state
/// is the first moment followed by the second, `2 * len` values.
#[derive(Debug, Clone)]
pub struct Adam {
    cfg: OptimizerConfig,
    len: usize,
    moments: Vec<f32>,
}

impl Adam {
    /// An optimizer for `len` parameters; `cfg.kind` must be Adam or AdamW.
    pub fn new(cfg: OptimizerConfig, len: usize) -> Result<Adam, ConfigError> {
        cfg.validate()?;
        if cfg.kind == OptimizerKind::Sgd {
            return Err(ConfigError::Invalid {
                what: "optimizer",
                detail: "Adam built from an SGD configuration".into(),
            });
        }
        Ok(Adam {
            cfg,
            len,
            moments: vec![0.0; 2 * len],
        })
    }
}

impl LocalOptimizer for Adam {
    /// `g = clip(grad) (+ wd*W for Adam)`; AdamW first scales `W` by `1 - lr*wd`; then
    /// `m = b1*m + (1-b1)*g`, `v = b2*v + (1-b2)*g^2`, and
    /// `W -= lr * (m / (1 - b1^(t+1))) / (sqrt(v / (1 - b2^(t+1))) + eps)`.
    fn step(&mut self, t: u64, params: &mut [f32], grad: &[f32]) {
        let lr = self.cfg.lr.at(t);
        let clip = clip_scale(self.cfg.clip_norm, grad);
        let (b1, b2) = self.cfg.betas;
        let n = i32::try_from(t.saturating_add(1)).unwrap_or(i32::MAX);
        let c1 = 1.0 - b1.powi(n);
        let c2 = (1.0 - b2.powi(n)).sqrt();
        let wd = self.cfg.weight_decay;
        let (l2, decoupled) = match self.cfg.kind {
            OptimizerKind::AdamW => (0.0, 1.0 - lr * wd),
            _ => (wd, 1.0),
        };
        let (m, v) = self.moments.split_at_mut(self.len);
        for (((w, &g), m), v) in params.iter_mut().zip(grad).zip(m).zip(v) {
            let g = g * clip + l2 * *w;
            *w *= decoupled;
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
            *w -= lr * (*m / c1) / (v.sqrt() / c2 + self.cfg.eps);
        }
    }

    fn state(&self) -> &[f32] {
        &self.moments
    }

    fn state_mut(&mut self) -> &mut [f32] {
        &mut self.moments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_torch_adam_and_adamw() {
        // torch.optim.Adam([w], lr=0.1), w0 = [1, -2], grads g1 = [0.5, 0.5], g2 = [-1, 2].
        // Step 1: m = 0.1 g, v = 0.001 g^2, the bias-corrected step is lr * sign(g) (up to
        // eps): w = [0.9, -2.1].
        let mut adam = Adam::new(OptimizerConfig::adam(0.1), 2).unwrap();
        let mut w = vec![1.0f32, -2.0];
        adam.step(0, &mut w, &[0.5, 0.5]);
        assert!(
            (w[0] - 0.9).abs() < 1e-6 && (w[1] + 2.1).abs() < 1e-6,
            "{w:?}"
        );
        // Step 2 with g2 = [-1, 2]: m = [0.9*0.05 - 0.1, 0.9*0.05 + 0.2] = [-0.055, 0.245];
        // v = [0.999*0.00025 + 0.001, 0.999*0.00025 + 0.004] = [0.00124975, 0.00424975];
        // mhat = m / 0.19, vhat = v / 0.001999; w -= 0.1 * mhat / sqrt(vhat).
        adam.step(1, &mut w, &[-1.0, 2.0]);
        let upd = |m: f64, v: f64| 0.1 * (m / 0.19) / (v / 0.001999).sqrt();
        let want = [0.9 - upd(-0.055, 0.00124975), -2.1 - upd(0.245, 0.00424975)];
        for i in 0..2 {
            assert!(
                (f64::from(w[i]) - want[i]).abs() < 1e-5,
                "{w:?} vs {want:?}"
            );
        }
        // AdamW: decoupled decay shrinks W before the step, W = W*(1 - lr*wd) - lr*sign(g).
        let cfg = OptimizerConfig {
            kind: OptimizerKind::AdamW,
            weight_decay: 0.5,
            ..OptimizerConfig::adam(0.1)
        };
        let mut adamw = Adam::new(cfg, 2).unwrap();
        let mut w = vec![1.0f32, -2.0];
        adamw.step(0, &mut w, &[0.5, -0.5]);
        let want = [1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1];
        for i in 0..2 {
            assert!((w[i] - want[i]).abs() < 1e-6, "{w:?} vs {want:?}");
        }
        assert_eq!(adamw.state().len(), 4);
    }
}
