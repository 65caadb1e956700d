//! Small shared helpers: serde of durations, timeouts, histograms.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// The longest timeout accepted, about 31.7 years ("never" for any job): deadlines are clocks
/// plus timeouts (and some multiples of them), which must not overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// `secs` seconds as a timeout, if positive, finite and at most [`MAX_TIMEOUT`].
pub fn timeout_from_secs(secs: f64) -> Option<Duration> {
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|&d| is_timeout(d))
}

/// Whether `d` may be a timeout: positive and at most [`MAX_TIMEOUT`].
fn is_timeout(d: Duration) -> bool {
    !d.is_zero() && d <= MAX_TIMEOUT
}

/// Checks that the timeout `what` is positive and at most [`MAX_TIMEOUT`].
pub fn check_timeout(what: &'static str, d: Duration) -> Result<(), ConfigError> {
    if !is_timeout(d) {
        return Err(ConfigError::Invalid {
            what,
            detail: format!(
                "{d:?} (must be positive and at most {} s)",
                MAX_TIMEOUT.as_secs()
            ),
        });
    }
    Ok(())
}

/// Serializes a `Duration` as fractional seconds.
pub mod serde_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes seconds as `f64`.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    /// Reads seconds from `f64`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}

/// Serializes an `Option<Duration>` as fractional seconds or null.
pub mod serde_opt_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes seconds as `f64`, or null.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }

    /// Reads seconds from `f64`, or null.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<f64>::deserialize(d)?
            .map(|x| Duration::try_from_secs_f64(x).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// A histogram of small non-negative integers (staleness in rounds).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Histogram {
    counts: BTreeMap<u64, u64>,
}

impl Histogram {
    /// Counts one observation of `value`.
    pub fn record(&mut self, value: u64) {
        self.record_n(value, 1);
    }

    /// Counts `n` observations of `value`.
    pub fn record_n(&mut self, value: u64, n: u64) {
        if n > 0 {
            *self.counts.entry(value).or_default() += n;
        }
    }

    /// Counts every value of `values` (runs of equal values cost one update).
    pub fn record_all(&mut self, values: impl IntoIterator<Item = u64>) {
        let mut run: Option<(u64, u64)> = None;
        for v in values {
            match &mut run {
                Some((last, n)) if *last == v => *n += 1,
                _ => {
                    if let Some((last, n)) = run {
                        self.record_n(last, n);
                    }
                    run = Some((v, 1));
                }
            }
        }
        if let Some((last, n)) = run {
            self.record_n(last, n);
        }
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (&v, &c) in &other.counts {
            *self.counts.entry(v).or_default() += c;
        }
    }

    /// Number of observations of `value`.
    pub fn count(&self, value: u64) -> u64 {
        self.counts.get(&value).copied().unwrap_or(0)
    }

    /// Total number of observations.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Largest value observed.
    pub fn max(&self) -> Option<u64> {
        self.counts.keys().next_back().copied()
    }

    /// Mean of the observations.
    pub fn mean(&self) -> f64 {
        let n = self.total();
        if n == 0 {
            return 0.0;
        }
        self.counts
            .iter()
            .map(|(&v, &c)| v as f64 * c as f64)
            .sum::<f64>()
            / n as f64
    }

    /// `(value, count)` pairs in increasing order of value.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.counts.iter().map(|(&v, &c)| (v, c))
    }
}

impl std::fmt::Display for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.iter().map(|(v, c)| format!("{v}:{c}")).collect();
        write!(f, "{{{}}}", parts.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::{Duration, Histogram, MAX_TIMEOUT, timeout_from_secs};

    #[test]
    fn a_timeout_is_positive_finite_and_bounded() {
        assert_eq!(timeout_from_secs(1.5), Some(Duration::from_millis(1500)));
        assert_eq!(timeout_from_secs(1e9), Some(MAX_TIMEOUT));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 2e18] {
            assert_eq!(timeout_from_secs(bad), None, "{bad}");
        }
    }

    #[test]
    fn record_all_counts_like_record() {
        let values = [0, 0, 3, 0, 1, 1, 1, 7, 0];
        let mut one_by_one = Histogram::default();
        values.iter().for_each(|&v| one_by_one.record(v));
        let mut all = Histogram::default();
        all.record_all(values);
        all.record_all([]);
        assert_eq!(all, one_by_one);
        assert_eq!(all.count(0), 4);
        assert_eq!(all.count(1), 3);
        assert_eq!(all.total(), 9);
    }
}
