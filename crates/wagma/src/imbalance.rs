//! Load-imbalance profiles: per-rank, per-step compute times drawn like the paper's workloads.
//!
//! Times are in the paper's units and multiplied by a time scale:
//! * `none`: 450 ms for everyone;
//! * `paper-resnet`: 450 ms for everyone, and each step two distinct random ranks get 320 ms
//!   more (ResNet-50 on ImageNet with injected stragglers);
//! * `lengths`: a log-normal with mean 475 ms and standard deviation 144 ms, clamped to
//!   179-3482 ms (Transformer batches of uneven sentence lengths, eager-SGD's measurement);
//! * `heavy-tail`: 1.7 s plus a log-normal with median 0.2 s and sigma 1.5, clamped to 43.5 s
//!   (DD-PPO experience collection: 1.7-43.5 s, median under 2 s).
//!
//! Draws are a pure function of (seed, step, rank), so every algorithm sees the same ones.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// A load-imbalance profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// Everybody takes the same time.
    #[default]
    None,
    /// Two random ranks per step are delayed by 320 ms on 450 ms.
    PaperResnet,
    /// Sentence-length-driven batch times.
    Lengths,
    /// DD-PPO-like experience collection.
    HeavyTail,
}

impl std::str::FromStr for Profile {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Profile::None),
            "paper-resnet" => Ok(Profile::PaperResnet),
            "lengths" => Ok(Profile::Lengths),
            "heavy-tail" => Ok(Profile::HeavyTail),
            _ => Err(ConfigError::Invalid {
                what: "imbalance profile",
                detail: format!("{s:?} (expected none, paper-resnet, lengths or heavy-tail)"),
            }),
        }
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Profile::None => "none",
            Profile::PaperResnet => "paper-resnet",
            Profile::Lengths => "lengths",
            Profile::HeavyTail => "heavy-tail",
        })
    }
}

/// Base compute time of `none` and `paper-resnet` (seconds).
pub const RESNET_BASE_S: f64 = 0.450;
/// Extra delay of the two stragglers of `paper-resnet` (seconds).
pub const RESNET_DELAY_S: f64 = 0.320;

/// A profile with its time scale and seed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Imbalance {
    /// The profile.
    pub profile: Profile,
    /// Multiplies every time.
    pub time_scale: f64,
    /// Seed of the draws.
    pub seed: u64,
}

/// The longest compute time of one step, in seconds, that a profile (scaled) or a recorded
/// trace may give: about 11.6 days, far beyond any real step, and small enough that the
/// clocks summing steps never overflow.
pub const MAX_STEP_S: f64 = 1e6;

/// The largest time scale: it keeps the longest step of every profile within [`MAX_STEP_S`].
pub const MAX_TIME_SCALE: f64 = 1e4;

impl Imbalance {
    /// Checks the time scale.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.time_scale.is_finite() && (0.0..=MAX_TIME_SCALE).contains(&self.time_scale)) {
            return Err(ConfigError::Invalid {
                what: "time scale",
                detail: format!(
                    "{} (must be finite, >= 0 and <= {MAX_TIME_SCALE})",
                    self.time_scale
                ),
            });
        }
        Ok(())
    }

    /// Compute times (seconds) of every rank at `step`.
    pub fn step_times(&self, step: u64, ranks: usize) -> Vec<f64> {
        let mut rng =
            ChaCha8Rng::seed_from_u64(self.seed ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03));
        let raw: Vec<f64> = match self.profile {
            Profile::None => vec![RESNET_BASE_S; ranks],
            Profile::PaperResnet => {
                let mut t = vec![RESNET_BASE_S; ranks];
                let a = rng.random_range(0..ranks.max(1));
                let b = if ranks > 1 {
                    (a + rng.random_range(1..ranks)) % ranks
                } else {
                    a
                };
                if let Some(x) = t.get_mut(a) {
                    *x += RESNET_DELAY_S;
                }
                if b != a {
                    t[b] += RESNET_DELAY_S;
                }
                t
            }
            Profile::Lengths => {
                // Log-normal with mean 0.475 s and sd 0.144 s.
                let sigma2 = (1.0 + (0.144f64 / 0.475).powi(2)).ln();
                let mu = 0.475f64.ln() - sigma2 / 2.0;
                let d =
                    LogNormal::new(mu, sigma2.sqrt()).unwrap_or_else(|_| unreachable_lognormal());
                (0..ranks)
                    .map(|_| d.sample(&mut rng).clamp(0.179, 3.482))
                    .collect()
            }
            Profile::HeavyTail => {
                let d =
                    LogNormal::new(0.2f64.ln(), 1.5).unwrap_or_else(|_| unreachable_lognormal());
                (0..ranks)
                    .map(|_| (1.7 + d.sample(&mut rng)).min(43.5))
                    .collect()
            }
        };
        raw.into_iter().map(|x| x * self.time_scale).collect()
    }

    /// Draws for `steps` steps: `[step][rank]` seconds.
    pub fn table(&self, steps: u64, ranks: usize) -> Vec<Vec<f64>> {
        (0..steps).map(|t| self.step_times(t, ranks)).collect()
    }
}

/// The parameters above are finite and sigma positive, so construction cannot fail.
fn unreachable_lognormal() -> LogNormal<f64> {
    LogNormal::new(0.0, 1.0).expect("standard log-normal")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(p: Profile) -> (f64, f64, f64, f64) {
        let im = Imbalance {
            profile: p,
            time_scale: 1.0,
            seed: 5,
        };
        let xs: Vec<f64> = im.table(4000, 8).into_iter().flatten().collect();
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        let mut s = xs.clone();
        s.sort_by(f64::total_cmp);
        (mean, sd, s[s.len() / 2], s[s.len() - 1])
    }

    #[test]
    fn profiles_match_the_paper() {
        let (mean, sd, _, max) = stats(Profile::Lengths);
        assert!(
            (mean - 0.475).abs() < 0.01 && (sd - 0.144).abs() < 0.01,
            "{mean} {sd}"
        );
        assert!(max <= 3.482);
        let (_, _, median, max) = stats(Profile::HeavyTail);
        assert!(
            median < 2.0 && median > 1.7 && max <= 43.5 && max > 5.0,
            "{median} {max}"
        );
        let im = Imbalance {
            profile: Profile::PaperResnet,
            time_scale: 0.1,
            seed: 1,
        };
        for t in 0..50 {
            let xs = im.step_times(t, 16);
            let slow = xs.iter().filter(|&&x| x > 0.046).count();
            assert_eq!(slow, 2);
        }
        assert_eq!(im.step_times(3, 16), im.step_times(3, 16));
        assert_ne!(im.step_times(3, 16), im.step_times(4, 16));
    }

    #[test]
    fn a_time_scale_beyond_the_longest_step_is_refused() {
        let scaled = |time_scale| Imbalance {
            profile: Profile::HeavyTail,
            time_scale,
            seed: 1,
        };
        assert!(scaled(MAX_TIME_SCALE).validate().is_ok());
        for bad in [-1.0, f64::NAN, f64::INFINITY, 1e20] {
            assert!(scaled(bad).validate().is_err(), "{bad}");
        }
        // The longest draw of every profile, scaled by the largest scale, is a step that may be.
        for profile in [Profile::Lengths, Profile::HeavyTail, Profile::PaperResnet] {
            let im = Imbalance {
                time_scale: MAX_TIME_SCALE,
                profile,
                seed: 3,
            };
            let longest = (0..2000)
                .flat_map(|t| im.step_times(t, 8))
                .fold(0.0, f64::max);
            assert!(longest <= MAX_STEP_S, "{profile:?}: {longest}");
        }
    }

    #[test]
    fn parse() {
        assert_eq!("heavy-tail".parse::<Profile>().unwrap(), Profile::HeavyTail);
        assert!("bursty".parse::<Profile>().is_err());
    }
}
