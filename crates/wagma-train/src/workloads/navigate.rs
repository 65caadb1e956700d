//! Point-goal navigation trained with PPO (clipped objective, GAE, value loss, entropy bonus).
//! A rollout collects a fixed number of whole episodes, so its duration varies with how long
//! the episodes last (the experience-collection imbalance of DD-PPO); each rollout feeds a few
//! PPO updates, each one local step. Metrics on held-out maps: success rate and SPL.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::activation::log_softmax;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{Workload, argmax_rows};
use crate::metrics::spl;
use crate::nav::{ACTIONS, Episode, NavConfig};

/// PPO's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PpoConfig {
    /// Environments stepped together.
    pub envs: usize,
    /// Episodes completed per rollout.
    pub episodes: usize,
    /// Updates (local steps) per rollout: epochs times minibatches.
    pub updates: usize,
    /// Discount.
    pub gamma: f32,
    /// GAE's lambda.
    pub lambda: f32,
    /// Clip range of the probability ratio.
    pub clip: f32,
    /// Weight of the value loss.
    pub value_coef: f32,
    /// Weight of the entropy bonus.
    pub entropy_coef: f32,
    /// Held-out maps evaluated.
    pub eval_maps: usize,
}

impl Default for PpoConfig {
    fn default() -> Self {
        PpoConfig {
            envs: 8,
            episodes: 8,
            updates: 4,
            gamma: 0.99,
            lambda: 0.95,
            clip: 0.2,
            value_coef: 0.5,
            entropy_coef: 0.01,
            eval_maps: 200,
        }
    }
}

/// Actor-critic MLP with a shared trunk.
#[derive(Module, Debug)]
pub struct ActorCritic {
    l1: Linear,
    l2: Linear,
    pi: Linear,
    v: Linear,
    act: Relu,
}

impl ActorCritic {
    /// A network for observations of `obs` values.
    pub fn new(obs: usize, hidden: usize, device: &Device) -> ActorCritic {
        ActorCritic {
            l1: LinearConfig::new(obs, hidden).init(device),
            l2: LinearConfig::new(hidden, hidden).init(device),
            pi: LinearConfig::new(hidden, ACTIONS).init(device),
            v: LinearConfig::new(hidden, 1).init(device),
            act: Relu::new(),
        }
    }

    /// Action logits `[b, ACTIONS]` and values `[b, 1]`.
    pub fn forward(&self, obs: Tensor<2>) -> (Tensor<2>, Tensor<2>) {
        let h = self
            .act
            .forward(self.l2.forward(self.act.forward(self.l1.forward(obs))));
        (self.pi.forward(h.clone()), self.v.forward(h))
    }
}

/// A rollout ready for updates.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Rollout {
    obs: Vec<f32>,
    actions: Vec<i64>,
    logp: Vec<f32>,
    advantages: Vec<f32>,
    returns: Vec<f32>,
}

impl Rollout {
    fn len(&self) -> usize {
        self.actions.len()
    }
}

/// One rank's environments, random state and current rollout.
#[derive(Serialize, Deserialize)]
pub struct NavLocal {
    envs: Vec<Episode>,
    next_map: u64,
    rng_seed: u64,
    rollout: Rollout,
    updates_left: usize,
    #[serde(skip, default = "default_rng")]
    rng: ChaCha8Rng,
}

fn default_rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(0)
}

/// Seeds of held-out maps start here; training maps stay below.
const EVAL_MAPS: u64 = 1 << 40;

impl NavLocal {
    fn new_episode(&mut self, cfg: NavConfig) -> Episode {
        let e = Episode::generate(cfg, self.next_map);
        self.next_map += 1;
        e
    }
}

/// The navigation workload.
pub struct NavigateWorkload {
    env: NavConfig,
    ppo: PpoConfig,
    hidden: usize,
}

impl NavigateWorkload {
    /// A workload with `episodes` episodes per rollout.
    pub fn new(env: NavConfig, ppo: PpoConfig, hidden: usize) -> NavigateWorkload {
        NavigateWorkload { env, ppo, hidden }
    }

    /// A description of the task.
    pub fn describe(&self) -> String {
        format!(
            "{0}x{0} maps, {1:.0}% obstacles, {2} episodes per rollout, {3} updates per rollout",
            self.env.size,
            100.0 * self.env.density,
            self.ppo.episodes,
            self.ppo.updates
        )
    }

    /// Whether a rank's state read back from a checkpoint fits this workload: as many
    /// environments as configured, each on a map of the configured size, and a rollout whose
    /// parts agree in length (a checksum guards against accidents, not against edits).
    fn check(&self, l: &NavLocal) -> Result<(), String> {
        if l.envs.len() != self.ppo.envs {
            return Err(format!(
                "{} environments saved, {} configured",
                l.envs.len(),
                self.ppo.envs
            ));
        }
        if !l.envs.iter().all(|e| e.fits(self.env)) {
            return Err("an environment does not fit the configured maps".into());
        }
        if l.updates_left > self.ppo.updates {
            return Err(format!(
                "{} updates left of a rollout that allows {}",
                l.updates_left, self.ppo.updates
            ));
        }
        let r = &l.rollout;
        let n = r.len();
        let agree = r.obs.len() == n * self.env.obs_len()
            && [r.logp.len(), r.advantages.len(), r.returns.len()]
                .iter()
                .all(|&m| m == n)
            && r.actions
                .iter()
                .all(|&a| usize::try_from(a).is_ok_and(|a| a < ACTIONS));
        if !agree {
            return Err("the saved rollout's parts do not agree".into());
        }
        Ok(())
    }

    /// Collects whole episodes with the current policy and computes advantages (GAE).
    fn collect(&self, model: &ActorCritic, local: &mut NavLocal) -> Rollout {
        let device = crate::flat::eval_device();
        let net = model.valid();
        let k = self.env.obs_len();
        struct Traj {
            obs: Vec<f32>,
            actions: Vec<i64>,
            logp: Vec<f32>,
            values: Vec<f32>,
            rewards: Vec<f32>,
        }
        let new_traj = || Traj {
            obs: Vec::new(),
            actions: Vec::new(),
            logp: Vec::new(),
            values: Vec::new(),
            rewards: Vec::new(),
        };
        let mut trajs: Vec<Traj> = (0..local.envs.len()).map(|_| new_traj()).collect();
        let mut finished: Vec<(Traj, f32)> = Vec::new();
        let mut completed = 0;
        while completed < self.ppo.episodes {
            let mut obs = Vec::with_capacity(local.envs.len() * k);
            for e in &local.envs {
                e.observe(&mut obs);
            }
            let b = local.envs.len();
            let x = Tensor::<2>::from_data(TensorData::new(obs.clone(), [b, k]), &device);
            let (logits, values) = net.forward(x);
            let logp: Vec<f32> = log_softmax(logits, 1).into_data().iter::<f32>().collect();
            let values: Vec<f32> = values.into_data().iter::<f32>().collect();
            for i in 0..b {
                let lp = &logp[i * ACTIONS..(i + 1) * ACTIONS];
                let u: f32 = local.rng.random();
                let mut acc = 0.0;
                let mut a = ACTIONS - 1;
                for (j, &l) in lp.iter().enumerate() {
                    acc += l.exp();
                    if u < acc {
                        a = j;
                        break;
                    }
                }
                let out = local.envs[i].step(a);
                let t = &mut trajs[i];
                t.obs.extend_from_slice(&obs[i * k..(i + 1) * k]);
                t.actions.push(a as i64);
                t.logp.push(lp[a]);
                t.values.push(values[i]);
                t.rewards.push(out.reward);
                if out.done {
                    completed += 1;
                    finished.push((std::mem::replace(t, new_traj()), 0.0));
                    local.envs[i] = local.new_episode(self.env);
                }
            }
        }
        // Episodes still running are cut and bootstrapped with the value of their next state.
        let mut tail_obs = Vec::new();
        for e in &local.envs {
            e.observe(&mut tail_obs);
        }
        let b = local.envs.len();
        let (_, v) = net.forward(Tensor::<2>::from_data(
            TensorData::new(tail_obs, [b, k]),
            &device,
        ));
        let boot: Vec<f32> = v.into_data().iter::<f32>().collect();
        for (i, t) in trajs.into_iter().enumerate() {
            if !t.actions.is_empty() {
                finished.push((t, boot[i]));
            }
        }
        let mut r = Rollout::default();
        for (t, last) in finished {
            let n = t.rewards.len();
            let mut adv = vec![0f32; n];
            let mut gae = 0.0;
            for j in (0..n).rev() {
                let next = if j + 1 < n { t.values[j + 1] } else { last };
                let delta = t.rewards[j] + self.ppo.gamma * next - t.values[j];
                gae = delta + self.ppo.gamma * self.ppo.lambda * gae;
                adv[j] = gae;
            }
            r.returns
                .extend(adv.iter().zip(&t.values).map(|(a, v)| a + v));
            r.advantages.extend(adv);
            r.obs.extend(t.obs);
            r.actions.extend(t.actions);
            r.logp.extend(t.logp);
        }
        let n = r.advantages.len().max(1) as f32;
        let mean = r.advantages.iter().sum::<f32>() / n;
        let sd = (r.advantages.iter().map(|a| (a - mean).powi(2)).sum::<f32>() / n)
            .sqrt()
            .max(1e-6);
        for a in &mut r.advantages {
            *a = (*a - mean) / sd;
        }
        r
    }
}

impl Workload for NavigateWorkload {
    type Model = ActorCritic;
    type Local = NavLocal;

    fn name(&self) -> &'static str {
        "navigate"
    }

    fn build(&self, device: &Device) -> ActorCritic {
        ActorCritic::new(self.env.obs_len(), self.hidden, device)
    }

    fn train_samples(&self) -> Option<usize> {
        None
    }

    fn local(&self, rank: usize, _ranks: usize, seed: u64) -> NavLocal {
        let rng_seed = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut l = NavLocal {
            envs: Vec::new(),
            // Each rank draws its training maps from its own range of seeds.
            next_map: (rank as u64) << 32 | (seed & 0xffff) << 16,
            rng_seed,
            rollout: Rollout::default(),
            updates_left: 0,
            rng: ChaCha8Rng::seed_from_u64(rng_seed),
        };
        for _ in 0..self.ppo.envs {
            let e = l.new_episode(self.env);
            l.envs.push(e);
        }
        l
    }

    fn loss(&self, model: &ActorCritic, local: &mut NavLocal, _step: u64) -> (Tensor<1>, usize) {
        if local.updates_left == 0 || local.rollout.len() == 0 {
            local.rollout = self.collect(model, local);
            local.updates_left = self.ppo.updates;
        }
        // Minibatches: the rollout cut into two halves, visited alternately.
        let u = self.ppo.updates - local.updates_left;
        local.updates_left -= 1;
        let parts = if self.ppo.updates >= 2 { 2 } else { 1 };
        let part = u % parts;
        let r = &local.rollout;
        let n = r.len();
        let lo = part * n / parts;
        let hi = (part + 1) * n / parts;
        let m = hi - lo;
        let k = self.env.obs_len();
        let device = crate::flat::train_device();
        let obs = Tensor::<2>::from_data(
            TensorData::new(r.obs[lo * k..hi * k].to_vec(), [m, k]),
            &device,
        );
        let actions = Tensor::<2, Int>::from_data(
            TensorData::new(r.actions[lo..hi].to_vec(), [m, 1]),
            &device,
        );
        let old = Tensor::<2>::from_data(TensorData::new(r.logp[lo..hi].to_vec(), [m, 1]), &device);
        let adv = Tensor::<2>::from_data(
            TensorData::new(r.advantages[lo..hi].to_vec(), [m, 1]),
            &device,
        );
        let ret =
            Tensor::<2>::from_data(TensorData::new(r.returns[lo..hi].to_vec(), [m, 1]), &device);
        let (logits, value) = model.forward(obs);
        let logp_all = log_softmax(logits, 1);
        let logp = logp_all.clone().gather(1, actions);
        let ratio = (logp - old).exp();
        let s1 = ratio.clone() * adv.clone();
        let s2 = ratio.clamp(1.0 - self.ppo.clip, 1.0 + self.ppo.clip) * adv;
        // min(s1, s2) = (s1 + s2 - |s1 - s2|) / 2
        let surrogate = (s1.clone() + s2.clone() - (s1 - s2).abs()) * 0.5;
        let policy = surrogate.mean().neg();
        let value_loss = (value - ret).powf_scalar(2.0).mean() * (0.5 * self.ppo.value_coef);
        let entropy = (logp_all.clone().exp() * logp_all).sum_dim(1).mean().neg();
        let loss = policy + value_loss - entropy * self.ppo.entropy_coef;
        (loss, m)
    }

    fn evaluate(&self, model: &ActorCritic, rank: usize, ranks: usize) -> Vec<f64> {
        let device = crate::flat::eval_device();
        let k = self.env.obs_len();
        let mut episodes = Vec::new();
        for i in (rank..self.ppo.eval_maps).step_by(ranks.max(1)) {
            let mut e = Episode::generate(self.env, EVAL_MAPS + i as u64);
            let shortest = e.shortest;
            let success = loop {
                let mut obs = Vec::with_capacity(k);
                e.observe(&mut obs);
                let (logits, _) = model.forward(Tensor::<2>::from_data(
                    TensorData::new(obs, [1, k]),
                    &device,
                ));
                let a = argmax_rows(logits)[0] as usize;
                let o = e.step(a);
                if o.done {
                    break o.success;
                }
            };
            episodes.push((success, shortest, e.steps));
        }
        let n = episodes.len() as f64;
        vec![
            episodes.iter().filter(|e| e.0).count() as f64,
            spl(&episodes) * n,
            n,
        ]
    }

    fn metrics(&self, s: &[f64]) -> Vec<(&'static str, f64)> {
        let n = s.get(2).copied().unwrap_or(0.0).max(1.0);
        vec![("success", s[0] / n), ("spl", s[1] / n)]
    }

    fn primary(&self) -> &'static str {
        "spl"
    }

    fn save_local(&self, local: &NavLocal) -> serde_json::Value {
        let mut l = serde_json::to_value(local).unwrap_or_default();
        l["rng_pos"] = serde_json::Value::String(local.rng.get_word_pos().to_string());
        l
    }

    fn load_local(
        &self,
        local: &mut NavLocal,
        saved: &serde_json::Value,
        _iteration: u64,
    ) -> Result<(), String> {
        let pos: u128 = saved["rng_pos"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .ok_or("no random state")?;
        let mut l: NavLocal = serde_json::from_value(saved.clone()).map_err(|e| e.to_string())?;
        self.check(&l)?;
        l.rng = ChaCha8Rng::seed_from_u64(l.rng_seed);
        l.rng.set_word_pos(pos);
        *local = l;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_state_that_does_not_fit_the_workload_is_refused() {
        let w = NavigateWorkload::new(NavConfig::default(), PpoConfig::default(), 8);
        let saved = w.save_local(&w.local(0, 2, 7));
        let mut local = w.local(0, 2, 7);
        assert!(w.load_local(&mut local, &saved, 10).is_ok());
        let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut s = saved.clone();
            edit(&mut s);
            w.load_local(&mut w.local(0, 2, 7), &s, 10)
        };
        let no_envs = edited(&|s| s["envs"] = serde_json::json!([]));
        assert!(no_envs.is_err_and(|e| e.contains("environments saved")));
        let off_map = edited(&|s| s["envs"][0]["pos"] = serde_json::json!([99, 0]));
        assert!(off_map.is_err_and(|e| e.contains("does not fit")));
        let endless = edited(&|s| s["envs"][0]["limit"] = serde_json::json!(u32::MAX));
        assert!(endless.is_err_and(|e| e.contains("does not fit")));
        let too_many = edited(&|s| s["updates_left"] = serde_json::json!(1_000_000));
        assert!(too_many.is_err_and(|e| e.contains("updates left")));
        let torn = edited(&|s| {
            s["updates_left"] = serde_json::json!(1);
            s["rollout"]["actions"] = serde_json::json!([0, 0]);
        });
        assert!(torn.is_err_and(|e| e.contains("do not agree")));
    }
}
