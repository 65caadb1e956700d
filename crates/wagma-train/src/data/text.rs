//! Text for the translation workload: tokenization, vocabularies, the held-out split and
//! batches bucketed by length (so that per-step compute varies with sentence length, as with
//! WMT in the paper).

use std::collections::HashMap;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Padding id.
pub const PAD: u32 = 0;
/// Beginning of a target sentence.
pub const BOS: u32 = 1;
/// End of a sentence.
pub const EOS: u32 = 2;
/// Out-of-vocabulary token.
pub const UNK: u32 = 3;
const SPECIALS: [&str; 4] = ["<pad>", "<bos>", "<eos>", "<unk>"];

/// Lower-cased words, numbers and format specifiers, with each other symbol a token of its
/// own. Menu accelerators (`_File`, `&File`) and line breaks are removed first.
pub fn tokenize(s: &str) -> Vec<String> {
    let cleaned: String = s
        .chars()
        .filter(|&c| c != '&' && c != '_')
        .map(|c| if c.is_whitespace() { ' ' } else { c })
        .collect();
    let mut out = Vec::new();
    let mut word = String::new();
    for c in cleaned.chars() {
        if c.is_alphanumeric() || (c == '%' && word.is_empty()) || (c == '\'' && !word.is_empty()) {
            word.extend(c.to_lowercase());
        } else {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

/// Token ids for one language.
#[derive(Debug, Clone, PartialEq)]
pub struct Vocab {
    words: Vec<String>,
    ids: HashMap<String, u32>,
}

impl Vocab {
    /// The `max` most frequent tokens seen at least `min_count` times (ties by token).
    pub fn build<'a>(
        sentences: impl Iterator<Item = &'a [String]>,
        max: usize,
        min_count: usize,
    ) -> Vocab {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for s in sentences {
            for t in s {
                *counts.entry(t.as_str()).or_default() += 1;
            }
        }
        let mut ranked: Vec<(&str, usize)> = counts
            .into_iter()
            .filter(|&(_, c)| c >= min_count)
            .collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let words: Vec<String> = SPECIALS
            .iter()
            .map(|s| s.to_string())
            .chain(
                ranked
                    .into_iter()
                    .take(max.saturating_sub(SPECIALS.len()))
                    .map(|(w, _)| w.to_string()),
            )
            .collect();
        Vocab::from_words(words)
    }

    /// A vocabulary from its word list (ids are positions).
    pub fn from_words(words: Vec<String>) -> Vocab {
        let ids = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.clone(), i as u32))
            .collect();
        Vocab { words, ids }
    }

    /// The word list.
    pub fn words(&self) -> &[String] {
        &self.words
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// True when only the special tokens exist.
    pub fn is_empty(&self) -> bool {
        self.words.len() <= SPECIALS.len()
    }

    /// Ids of `tokens` (unknown ones become [`UNK`]).
    pub fn encode(&self, tokens: &[String]) -> Vec<u32> {
        tokens
            .iter()
            .map(|t| self.ids.get(t).copied().unwrap_or(UNK))
            .collect()
    }

    /// Tokens of `ids`, stopping at [`EOS`] and skipping padding and [`BOS`].
    pub fn decode(&self, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .take_while(|&&i| i != EOS)
            .filter(|&&i| i != PAD && i != BOS)
            .map(|&i| {
                self.words
                    .get(i as usize)
                    .cloned()
                    .unwrap_or_else(|| "<unk>".into())
            })
            .collect()
    }
}

/// A tokenized parallel corpus with its vocabularies and held-out split.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Source vocabulary (English).
    pub src_vocab: Vocab,
    /// Target vocabulary (German).
    pub tgt_vocab: Vocab,
    /// Training pairs: source ids and target ids (without BOS/EOS).
    pub train: Vec<(Vec<u32>, Vec<u32>)>,
    /// Held-out pairs, with the target tokens for BLEU.
    pub test: Vec<(Vec<u32>, Vec<String>)>,
}

impl Corpus {
    /// Tokenizes `pairs`, keeps sentences of 1..=`max_len` tokens, holds out `test` pairs
    /// (seeded) and builds vocabularies of at most `vocab` tokens from the training part.
    pub fn build(
        pairs: &[(String, String)],
        max_len: usize,
        test: usize,
        vocab: usize,
        seed: u64,
    ) -> Corpus {
        let mut tok: Vec<(Vec<String>, Vec<String>)> = pairs
            .iter()
            .map(|(a, b)| (tokenize(a), tokenize(b)))
            .filter(|(a, b)| {
                !a.is_empty() && !b.is_empty() && a.len() <= max_len && b.len() <= max_len
            })
            .collect();
        tok.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let test_n = test.min(tok.len() / 5);
        let held = tok.split_off(tok.len() - test_n);
        let src_vocab = Vocab::build(tok.iter().map(|p| p.0.as_slice()), vocab, 2);
        let tgt_vocab = Vocab::build(tok.iter().map(|p| p.1.as_slice()), vocab, 2);
        let train = tok
            .iter()
            .map(|(a, b)| (src_vocab.encode(a), tgt_vocab.encode(b)))
            .collect();
        let test = held
            .into_iter()
            .map(|(a, b)| (src_vocab.encode(&a), b))
            .collect();
        Corpus {
            src_vocab,
            tgt_vocab,
            train,
            test,
        }
    }
}

/// Batches of `batch` pairs from one random length bucket at a time.
#[derive(Debug, Clone)]
pub struct BucketSampler {
    buckets: Vec<Vec<usize>>,
    cursor: Vec<usize>,
    rng: ChaCha8Rng,
}

/// Upper bounds (in source tokens) of the buckets.
pub const BUCKETS: [usize; 6] = [2, 4, 6, 9, 14, 64];

impl BucketSampler {
    /// Buckets over this rank's shard of `pairs` (see [`super::shard`]).
    pub fn new(
        pairs: &[(Vec<u32>, Vec<u32>)],
        rank: usize,
        ranks: usize,
        seed: u64,
    ) -> BucketSampler {
        let mut buckets = vec![Vec::new(); BUCKETS.len()];
        for i in super::shard(pairs.len(), rank, ranks, seed) {
            let len = pairs[i].0.len();
            let b = BUCKETS
                .iter()
                .position(|&m| len <= m)
                .unwrap_or(BUCKETS.len() - 1);
            buckets[b].push(i);
        }
        buckets.retain(|b| !b.is_empty());
        let mut rng =
            ChaCha8Rng::seed_from_u64(seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for b in &mut buckets {
            b.shuffle(&mut rng);
        }
        BucketSampler {
            cursor: vec![0; buckets.len()],
            buckets,
            rng,
        }
    }

    /// Indices of the next batch; empty if the shard is empty.
    pub fn next_batch(&mut self, batch: usize) -> Vec<usize> {
        let total: usize = self.buckets.iter().map(Vec::len).sum();
        if total == 0 {
            return Vec::new();
        }
        // Pick a bucket with probability proportional to its size.
        let mut x = self.rng.random_range(0..total);
        let b = self
            .buckets
            .iter()
            .position(|v| {
                if x < v.len() {
                    true
                } else {
                    x -= v.len();
                    false
                }
            })
            .unwrap_or(0);
        let bucket = &self.buckets[b];
        (0..batch)
            .map(|_| {
                let i = bucket[self.cursor[b] % bucket.len()];
                self.cursor[b] += 1;
                i
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizes_menu_strings() {
        assert_eq!(
            tokenize("_Open %s file..."),
            vec!["open", "%s", "file", ".", ".", "."]
        );
        assert_eq!(tokenize("Don't  save\nnow"), vec!["don't", "save", "now"]);
        assert_eq!(tokenize("Datei &öffnen"), vec!["datei", "öffnen"]);
    }

    #[test]
    fn vocab_round_trip() {
        let s: Vec<Vec<String>> = vec![tokenize("a b a c"), tokenize("a b")];
        let v = Vocab::build(s.iter().map(Vec::as_slice), 10, 2);
        assert_eq!(v.words(), &["<pad>", "<bos>", "<eos>", "<unk>", "a", "b"]);
        let ids = v.encode(&tokenize("a c b"));
        assert_eq!(ids, vec![4, UNK, 5]);
        assert_eq!(v.decode(&[4, 5, EOS, 4]), vec!["a", "b"]);
    }

    #[test]
    fn buckets_group_lengths() {
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = (0..200)
            .map(|i| (vec![5; 1 + i % 20], vec![6; 3]))
            .collect();
        let mut s = BucketSampler::new(&pairs, 0, 2, 1);
        let mine = super::super::shard(pairs.len(), 0, 2, 1);
        for _ in 0..20 {
            let b = s.next_batch(8);
            let lens: Vec<usize> = b.iter().map(|&i| pairs[i].0.len()).collect();
            let bucket = |l: usize| BUCKETS.iter().position(|&m| l <= m);
            assert!(
                lens.iter().all(|&l| bucket(l) == bucket(lens[0])),
                "{lens:?}"
            );
            assert!(b.iter().all(|i| mine.contains(i)));
        }
    }
}
