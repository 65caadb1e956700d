//! Evaluation metrics: corpus BLEU, token accuracy, top-1 accuracy, SPL.

use std::collections::HashMap;

/// Additive statistics of corpus BLEU: clipped n-gram matches and n-gram counts for
/// n = 1..4, candidate and reference lengths. Summing them over sentences (or ranks) and then
/// scoring gives corpus BLEU.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BleuStats {
    /// Clipped matches per order.
    pub matched: [f64; 4],
    /// Candidate n-grams per order.
    pub total: [f64; 4],
    /// Candidate tokens.
    pub cand_len: f64,
    /// Reference tokens.
    pub ref_len: f64,
}

impl BleuStats {
    /// Number of values in [`BleuStats::to_vec`].
    pub const LEN: usize = 10;

    /// Adds one candidate and its reference.
    pub fn add(&mut self, cand: &[String], refr: &[String]) {
        for n in 1..=4 {
            let mut refs: HashMap<&[String], usize> = HashMap::new();
            for g in refr.windows(n) {
                *refs.entry(g).or_default() += 1;
            }
            for g in cand.windows(n) {
                self.total[n - 1] += 1.0;
                if let Some(k) = refs.get_mut(g)
                    && *k > 0
                {
                    *k -= 1;
                    self.matched[n - 1] += 1.0;
                }
            }
        }
        self.cand_len += cand.len() as f64;
        self.ref_len += refr.len() as f64;
    }

    /// BLEU (Papineni et al.): geometric mean of the modified 1- to 4-gram precisions times the
    /// brevity penalty `exp(1 - r/c)` when the candidates are shorter; 0 when some order has
    /// no match. Scaled to 0..100.
    pub fn score(&self) -> f64 {
        if self.cand_len == 0.0 || self.matched.contains(&0.0) {
            return 0.0;
        }
        let log_p: f64 = (0..4)
            .map(|i| (self.matched[i] / self.total[i]).ln())
            .sum::<f64>()
            / 4.0;
        let bp = if self.cand_len < self.ref_len {
            (1.0 - self.ref_len / self.cand_len).exp()
        } else {
            1.0
        };
        100.0 * bp * log_p.exp()
    }

    /// The values, to be summed across ranks.
    pub fn to_vec(&self) -> Vec<f64> {
        let mut v = Vec::with_capacity(Self::LEN);
        v.extend_from_slice(&self.matched);
        v.extend_from_slice(&self.total);
        v.extend_from_slice(&[self.cand_len, self.ref_len]);
        v
    }

    /// Statistics from [`BleuStats::to_vec`] values (missing ones are zero).
    pub fn from_slice(v: &[f64]) -> BleuStats {
        let g = |i: usize| v.get(i).copied().unwrap_or(0.0);
        BleuStats {
            matched: [g(0), g(1), g(2), g(3)],
            total: [g(4), g(5), g(6), g(7)],
            cand_len: g(8),
            ref_len: g(9),
        }
    }
}

/// Corpus BLEU of `candidates` against `references` (one reference each), 0..100.
pub fn corpus_bleu(candidates: &[Vec<String>], references: &[Vec<String>]) -> f64 {
    let mut s = BleuStats::default();
    for (c, r) in candidates.iter().zip(references) {
        s.add(c, r);
    }
    s.score()
}

/// Success weighted by (normalized inverse) Path Length (Anderson et al., 2018):
/// the mean over episodes of `success * shortest / max(shortest, taken)`.
pub fn spl(episodes: &[(bool, usize, usize)]) -> f64 {
    if episodes.is_empty() {
        return 0.0;
    }
    episodes
        .iter()
        .map(|&(ok, shortest, taken)| {
            if ok {
                shortest as f64 / shortest.max(taken).max(1) as f64
            } else {
                0.0
            }
        })
        .sum::<f64>()
        / episodes.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn bleu_known_values() {
        let r = vec![w("the cat is on the mat")];
        assert!((corpus_bleu(&r, &r) - 100.0).abs() < 1e-9);
        assert_eq!(corpus_bleu(&[w("dog")], &r), 0.0);
        // Papineni's example of clipped counts: "the the the the the the the" has unigram
        // precision 2/7 and no bigram match.
        assert_eq!(corpus_bleu(&[w("the the the the the the the")], &r), 0.0);
        // A prefix: precisions 1, brevity penalty exp(1 - 6/4).
        let bp = (1.0f64 - 6.0 / 4.0).exp();
        assert!((corpus_bleu(&[w("the cat is on")], &r) - 100.0 * bp).abs() < 1e-9);
    }

    #[test]
    fn spl_values() {
        assert_eq!(spl(&[(true, 5, 5)]), 1.0);
        assert_eq!(spl(&[(true, 5, 10), (false, 3, 3)]), 0.25);
        assert_eq!(spl(&[]), 0.0);
    }
}
