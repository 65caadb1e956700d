//! Datasets: IDX image files, the built-in procedural signals, gettext catalogs.

pub mod gettext;
pub mod idx;
pub mod mnist1d;
pub mod text;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Labelled images (or 1-D signals with `height == 1`), standardized, channel-major.
#[derive(Debug, Clone)]
pub struct ImageSet {
    /// `len * channels * height * width` values.
    pub pixels: Vec<f32>,
    /// One label in `0..10` per sample.
    pub labels: Vec<u8>,
    /// Channels.
    pub channels: usize,
    /// Height (1 for signals).
    pub height: usize,
    /// Width.
    pub width: usize,
}

impl ImageSet {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True without samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values per sample.
    pub fn sample_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    /// Zero mean and unit variance over the whole set.
    pub fn standardized(mut self) -> ImageSet {
        let n = self.pixels.len().max(1) as f64;
        let mean = self.pixels.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = self
            .pixels
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        let sd = var.sqrt().max(1e-6);
        for x in &mut self.pixels {
            *x = ((f64::from(*x) - mean) / sd) as f32;
        }
        self
    }

    /// The samples at `idx`, gathered into one batch: `(values, labels)`.
    pub fn batch(&self, idx: &[usize]) -> (Vec<f32>, Vec<u8>) {
        let k = self.sample_len();
        let mut x = Vec::with_capacity(idx.len() * k);
        let mut y = Vec::with_capacity(idx.len());
        for &i in idx {
            x.extend_from_slice(&self.pixels[i * k..(i + 1) * k]);
            y.push(self.labels[i]);
        }
        (x, y)
    }
}

/// The sample indices of `rank`'s shard among `ranks`: every rank takes every P-th sample of
/// one seeded permutation shared by all ranks, so the shards partition the data and each is
/// a uniform sample of it whatever the order of the files (a class-ordered file would
/// otherwise give ranks disjoint classes).
pub fn shard(n: usize, rank: usize, ranks: usize, seed: u64) -> Vec<usize> {
    let mut all: Vec<usize> = (0..n).collect();
    all.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_5a4d));
    all.into_iter().skip(rank).step_by(ranks.max(1)).collect()
}

/// A label-skewed shard (the non-IID ablation): the samples sorted by label (seeded order
/// within a label) and cut into `ranks` contiguous parts of equal size, so each rank sees about
/// `classes / ranks` classes (one or two when there are more ranks than classes).
pub fn label_skewed_shard(labels: &[u8], rank: usize, ranks: usize, seed: u64) -> Vec<usize> {
    let mut all: Vec<usize> = (0..labels.len()).collect();
    all.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_5a4d));
    all.sort_by_key(|&i| labels[i]);
    let ranks = ranks.max(1);
    let (lo, hi) = (
        rank * all.len() / ranks,
        (rank + 1).min(ranks) * all.len() / ranks,
    );
    all.get(lo..hi).map(<[usize]>::to_vec).unwrap_or_default()
}

/// Endless shuffled minibatches of one rank's shard (see [`shard`]); each epoch visits the
/// shard in a new seeded order.
#[derive(Debug, Clone)]
pub struct Sampler {
    shard: Vec<usize>,
    order: Vec<usize>,
    at: usize,
    epoch: u64,
    seed: u64,
}

impl Sampler {
    /// The shard of `rank` among `ranks` over `n` samples.
    pub fn new(n: usize, rank: usize, ranks: usize, seed: u64) -> Sampler {
        Sampler::over(shard(n, rank, ranks, seed), rank, seed)
    }

    /// Minibatches of `rank` over the given shard.
    pub fn over(shard: Vec<usize>, rank: usize, seed: u64) -> Sampler {
        let mut s = Sampler {
            order: Vec::new(),
            shard,
            at: 0,
            epoch: 0,
            seed: seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        };
        s.reshuffle();
        s
    }

    fn reshuffle(&mut self) {
        self.order = self.shard.clone();
        let mut rng =
            ChaCha8Rng::seed_from_u64(self.seed ^ self.epoch.wrapping_mul(0xBF58_476D_1CE4_E5B9));
        self.order.shuffle(&mut rng);
        self.at = 0;
    }

    /// The next `b` sample indices (wrapping into a new epoch as needed).
    pub fn next_batch(&mut self, b: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(b);
        if self.order.is_empty() {
            return out;
        }
        while out.len() < b {
            if self.at == self.order.len() {
                self.epoch += 1;
                self.reshuffle();
            }
            out.push(self.order[self.at]);
            self.at += 1;
        }
        out
    }

    /// Samples in this rank's shard.
    pub fn shard_len(&self) -> usize {
        self.shard.len()
    }

    /// Position (epoch, index in epoch), to checkpoint and resume.
    pub fn position(&self) -> (u64, usize) {
        (self.epoch, self.at)
    }

    /// Restores a position from [`Sampler::position`].
    pub fn seek(&mut self, epoch: u64, at: usize) {
        self.epoch = epoch;
        self.reshuffle();
        self.at = at.min(self.order.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_partition_and_resume() {
        let mut seen = vec![0; 100];
        for r in 0..3 {
            let mut s = Sampler::new(100, r, 3, 7);
            for i in s.next_batch(s.shard_len()) {
                seen[i] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
        // Class-ordered data (label i % 10) still gives every rank every class.
        for r in 0..8 {
            let mut classes: Vec<usize> = shard(1000, r, 8, 3).iter().map(|i| i % 10).collect();
            classes.sort_unstable();
            classes.dedup();
            assert_eq!(classes.len(), 10, "rank {r}");
        }
        // Label-skewed shards also partition the data, each holding few classes.
        let labels: Vec<u8> = (0..1000).map(|i| (i % 10) as u8).collect();
        let mut seen = vec![0; 1000];
        for r in 0..5 {
            let part = label_skewed_shard(&labels, r, 5, 3);
            let mut classes: Vec<u8> = part.iter().map(|&i| labels[i]).collect();
            classes.sort_unstable();
            classes.dedup();
            assert_eq!(classes, vec![2 * r as u8, 2 * r as u8 + 1], "rank {r}");
            for i in part {
                seen[i] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
        let mut a = Sampler::new(100, 1, 3, 7);
        a.next_batch(50);
        let (e, at) = a.position();
        let mut b = Sampler::new(100, 1, 3, 7);
        b.seek(e, at);
        assert_eq!(a.next_batch(20), b.next_batch(20));
    }
}
