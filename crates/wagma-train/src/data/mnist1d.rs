//! A built-in procedural dataset in the spirit of MNIST-1D (Greydanus, 2020): ten classes of
//! one-dimensional signals, each a template transformed by a random shift, stretch, shear,
//! white noise and correlated noise. Small, generated in milliseconds, and hard enough that a
//! linear model stays far below a small convolutional network.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::ImageSet;

/// Length of a signal.
pub const LEN: usize = 40;

/// Templates: per class, bumps `(centre in [0,1], width, height)`.
const TEMPLATES: [&[(f32, f32, f32)]; 10] = [
    &[(0.3, 0.08, 1.0), (0.7, 0.08, 1.0)],
    &[(0.5, 0.05, 1.5)],
    &[(0.2, 0.06, 1.0), (0.5, 0.06, -1.0), (0.8, 0.06, 1.0)],
    &[(0.25, 0.12, -1.0), (0.75, 0.05, 1.2)],
    &[(0.3, 0.04, 1.2), (0.45, 0.04, 1.2), (0.7, 0.1, -0.8)],
    &[(0.5, 0.2, 1.0)],
    &[(0.2, 0.05, -1.2), (0.6, 0.15, 0.9)],
    &[(0.35, 0.1, 1.0), (0.65, 0.1, -1.0)],
    &[
        (0.15, 0.04, 1.0),
        (0.4, 0.04, 1.0),
        (0.65, 0.04, 1.0),
        (0.9, 0.04, 1.0),
    ],
    &[(0.5, 0.05, -1.5), (0.8, 0.08, 0.7)],
];

/// `n` samples drawn with `seed` (balanced classes).
pub fn generate(n: usize, seed: u64) -> ImageSet {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let white = Normal::new(0.0f32, 0.25).unwrap_or_else(|_| unreachable!("valid normal"));
    let mut pixels = Vec::with_capacity(n * LEN);
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let class = i % 10;
        let shift: f32 = rng.random_range(-0.15..0.15);
        let stretch: f32 = rng.random_range(0.8..1.25);
        let shear: f32 = rng.random_range(-0.6..0.6);
        let scale: f32 = rng.random_range(0.7..1.3);
        let mut corr = 0.0f32;
        for k in 0..LEN {
            let x = k as f32 / (LEN - 1) as f32;
            let u = (x - 0.5 - shift) / stretch + 0.5;
            let v: f32 = TEMPLATES[class]
                .iter()
                .map(|&(c, w, h)| h * (-((u - c) / w).powi(2) / 2.0).exp())
                .sum();
            corr = 0.8 * corr + 0.2 * rng.random_range(-1.0f32..1.0);
            pixels.push(scale * v + shear * (x - 0.5) + white.sample(&mut rng) + 0.6 * corr);
        }
        labels.push(class as u8);
    }
    ImageSet {
        pixels,
        labels,
        channels: 1,
        height: 1,
        width: LEN,
    }
    .standardized()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_balanced() {
        let a = generate(100, 3);
        let b = generate(100, 3);
        assert_eq!(a.pixels, b.pixels);
        assert_eq!(a.labels.iter().filter(|&&l| l == 4).count(), 10);
        assert_ne!(generate(100, 4).pixels, a.pixels);
        assert_eq!(a.sample_len(), LEN);
    }

    /// A nearest-class-mean classifier beats chance but is far from perfect: the dataset is
    /// neither trivial nor noise.
    #[test]
    fn neither_trivial_nor_noise() {
        let train = generate(4000, 1);
        let test = generate(1000, 2);
        let mut means = vec![vec![0f32; LEN]; 10];
        for (x, &y) in train.pixels.chunks(LEN).zip(&train.labels) {
            for (m, v) in means[y as usize].iter_mut().zip(x) {
                *m += v / 400.0;
            }
        }
        let correct = test
            .pixels
            .chunks(LEN)
            .zip(&test.labels)
            .filter(|(x, y)| {
                let best = (0..10)
                    .min_by(|&a, &b| {
                        let d = |c: usize| {
                            means[c]
                                .iter()
                                .zip(*x)
                                .map(|(m, v)| (m - v).powi(2))
                                .sum::<f32>()
                        };
                        d(a).total_cmp(&d(b))
                    })
                    .unwrap_or(0);
                best == **y as usize
            })
            .count();
        let acc = correct as f32 / 1000.0;
        assert!(acc > 0.3 && acc < 0.9, "nearest-mean accuracy {acc}");
    }
}
