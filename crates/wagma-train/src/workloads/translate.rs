//! English to German translation with a Transformer encoder-decoder, trained on the gettext
//! catalogs of the machine. Batches hold sentences of one length bucket, so the time of a local
//! step varies with the sentences drawn, as with WMT in the paper. Metrics: corpus BLEU of
//! greedy translations and teacher-forced token accuracy on the held-out pairs.

use std::path::Path;
use std::sync::Arc;

use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerDecoder, TransformerDecoderConfig, TransformerDecoderInput, TransformerEncoder,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    Embedding, EmbeddingConfig, Linear, LinearConfig, PositionalEncoding, PositionalEncodingConfig,
};
use burn::prelude::*;

use super::{Workload, argmax_rows};
use crate::data::gettext;
use crate::data::text::{BOS, BucketSampler, Corpus, EOS, PAD};
use crate::error::TrainError;
use crate::metrics::BleuStats;

/// Longest sentence kept, in tokens.
pub const MAX_LEN: usize = 24;

/// Sizes of the Transformer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// Model width.
    pub d_model: usize,
    /// Feed-forward width.
    pub d_ff: usize,
    /// Attention heads.
    pub heads: usize,
    /// Encoder and decoder layers.
    pub layers: usize,
}

impl Default for Dims {
    fn default() -> Self {
        Dims {
            d_model: 64,
            d_ff: 128,
            heads: 4,
            layers: 2,
        }
    }
}

/// Encoder-decoder Transformer with sinusoidal positions and tied sizes.
#[derive(Module, Debug)]
pub struct Seq2Seq {
    src_embed: Embedding,
    tgt_embed: Embedding,
    pos: PositionalEncoding,
    encoder: TransformerEncoder,
    decoder: TransformerDecoder,
    out: Linear,
    scale: f64,
}

impl Seq2Seq {
    /// A model for the given vocabulary sizes.
    pub fn new(src_vocab: usize, tgt_vocab: usize, d: Dims, device: &Device) -> Seq2Seq {
        Seq2Seq {
            src_embed: EmbeddingConfig::new(src_vocab, d.d_model).init(device),
            tgt_embed: EmbeddingConfig::new(tgt_vocab, d.d_model).init(device),
            pos: PositionalEncodingConfig::new(d.d_model)
                .with_max_sequence_size(MAX_LEN + 4)
                .init(device),
            encoder: TransformerEncoderConfig::new(d.d_model, d.d_ff, d.heads, d.layers)
                .with_dropout(0.0)
                .with_norm_first(true)
                .init(device),
            decoder: TransformerDecoderConfig::new(d.d_model, d.d_ff, d.heads, d.layers)
                .with_dropout(0.0)
                .with_norm_first(true)
                .init(device),
            out: LinearConfig::new(d.d_model, tgt_vocab).init(device),
            scale: (d.d_model as f64).sqrt(),
        }
    }

    fn encode(&self, src: Tensor<2, Int>) -> (Tensor<3>, Tensor<2, Bool>) {
        let pad = src.clone().equal_elem(PAD as i64);
        let x = self.pos.forward(self.src_embed.forward(src) * self.scale);
        let memory = self
            .encoder
            .forward(TransformerEncoderInput::new(x).mask_pad(pad.clone()));
        (memory, pad)
    }

    fn decode(
        &self,
        memory: Tensor<3>,
        src_pad: Tensor<2, Bool>,
        tgt_in: Tensor<2, Int>,
    ) -> Tensor<3> {
        let [b, t] = tgt_in.dims();
        let device = tgt_in.device();
        let pad = tgt_in.clone().equal_elem(PAD as i64);
        let y = self
            .pos
            .forward(self.tgt_embed.forward(tgt_in) * self.scale);
        let causal = generate_autoregressive_mask(b, t, &device);
        let h = self.decoder.forward(
            TransformerDecoderInput::new(y, memory)
                .target_mask_attn(causal)
                .target_mask_pad(pad)
                .memory_mask_pad(src_pad),
        );
        self.out.forward(h)
    }

    /// Logits `[batch, target length, vocab]` under teacher forcing.
    pub fn forward(&self, src: Tensor<2, Int>, tgt_in: Tensor<2, Int>) -> Tensor<3> {
        let (memory, pad) = self.encode(src);
        self.decode(memory, pad, tgt_in)
    }

    /// Greedy translations of a batch (token ids, without BOS, up to EOS).
    pub fn greedy(&self, src: Tensor<2, Int>, max_len: usize) -> Vec<Vec<u32>> {
        let [b, _] = src.dims();
        let device = src.device();
        let (memory, pad) = self.encode(src);
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); b];
        let mut done = vec![false; b];
        let mut prefix: Vec<Vec<i64>> = vec![vec![i64::from(BOS)]; b];
        for _ in 0..max_len {
            let t = prefix[0].len();
            let flat: Vec<i64> = prefix.iter().flatten().copied().collect();
            let tgt = Tensor::<2, Int>::from_data(TensorData::new(flat, [b, t]), &device);
            let logits = self.decode(memory.clone(), pad.clone(), tgt);
            let [_, _, v] = logits.dims();
            let last: Tensor<2> = logits.slice([0..b, t - 1..t, 0..v]).reshape([b, v]);
            let next = argmax_rows(last);
            for i in 0..b {
                let tok = next[i] as u32;
                if !done[i] {
                    if tok == EOS {
                        done[i] = true;
                    } else {
                        out[i].push(tok);
                    }
                }
                prefix[i].push(if done[i] { i64::from(PAD) } else { next[i] });
            }
            if done.iter().all(|&d| d) {
                break;
            }
        }
        out
    }
}

/// The translation workload.
pub struct TranslateWorkload {
    corpus: Arc<Corpus>,
    batch: usize,
    dims: Dims,
    /// Held-out pairs evaluated (BLEU is costly: greedy decoding).
    eval_pairs: usize,
}

/// One rank's bucketed sampler.
pub struct TranslateLocal {
    sampler: BucketSampler,
    drawn: u64,
    seed: u64,
    rank: usize,
    ranks: usize,
}

impl TranslateWorkload {
    /// Reads the catalogs in `dir` (or the German ones of this machine) and builds the corpus.
    pub fn from_catalogs(
        dir: Option<&Path>,
        batch: usize,
        seed: u64,
    ) -> Result<TranslateWorkload, TrainError> {
        let dir = dir.unwrap_or(Path::new(gettext::GERMAN_DIR));
        let pairs = gettext::load_pairs(dir)?;
        if pairs.len() < 200 {
            return Err(TrainError::data(
                dir,
                format!("only {} translated messages: too few to train", pairs.len()),
            ));
        }
        let corpus = Corpus::build(&pairs, MAX_LEN, 1000, 4000, seed);
        Ok(TranslateWorkload::new(corpus, batch, Dims::default(), 400))
    }

    /// A workload over an existing corpus.
    pub fn new(corpus: Corpus, batch: usize, dims: Dims, eval_pairs: usize) -> TranslateWorkload {
        TranslateWorkload {
            corpus: Arc::new(corpus),
            batch,
            dims,
            eval_pairs,
        }
    }

    /// Training pairs.
    pub fn train_len(&self) -> usize {
        self.corpus.train.len()
    }

    /// A description of the data.
    pub fn describe(&self) -> String {
        format!(
            "{} training and {} held-out sentence pairs, vocabularies {} / {}",
            self.corpus.train.len(),
            self.corpus.test.len(),
            self.corpus.src_vocab.len(),
            self.corpus.tgt_vocab.len()
        )
    }

    /// Pads sentences into a `[batch, len]` tensor.
    fn pad(rows: &[Vec<u32>], device: &Device) -> Tensor<2, Int> {
        let len = rows.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut flat = Vec::with_capacity(rows.len() * len);
        for r in rows {
            flat.extend(r.iter().map(|&x| i64::from(x)));
            flat.extend(std::iter::repeat_n(i64::from(PAD), len - r.len()));
        }
        Tensor::<2, Int>::from_data(TensorData::new(flat, [rows.len(), len]), device)
    }

    /// Teacher forcing inputs `[BOS, y]` and targets `[y, EOS]`.
    fn teacher(tgts: &[&Vec<u32>]) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
        let inp = tgts
            .iter()
            .map(|y| std::iter::once(BOS).chain(y.iter().copied()).collect())
            .collect();
        let out = tgts
            .iter()
            .map(|y| y.iter().copied().chain(std::iter::once(EOS)).collect())
            .collect();
        (inp, out)
    }
}

impl Workload for TranslateWorkload {
    type Model = Seq2Seq;
    type Local = TranslateLocal;

    fn name(&self) -> &'static str {
        "translate"
    }

    fn build(&self, device: &Device) -> Seq2Seq {
        Seq2Seq::new(
            self.corpus.src_vocab.len(),
            self.corpus.tgt_vocab.len(),
            self.dims,
            device,
        )
    }

    fn train_samples(&self) -> Option<usize> {
        Some(self.train_len())
    }

    fn local(&self, rank: usize, ranks: usize, seed: u64) -> TranslateLocal {
        TranslateLocal {
            sampler: BucketSampler::new(&self.corpus.train, rank, ranks, seed),
            drawn: 0,
            seed,
            rank,
            ranks,
        }
    }

    fn loss(&self, model: &Seq2Seq, local: &mut TranslateLocal, _step: u64) -> (Tensor<1>, usize) {
        let device = crate::flat::train_device();
        let idx = local.sampler.next_batch(self.batch);
        local.drawn += 1;
        let src: Vec<Vec<u32>> = idx
            .iter()
            .map(|&i| self.corpus.train[i].0.clone())
            .collect();
        let tgts: Vec<&Vec<u32>> = idx.iter().map(|&i| &self.corpus.train[i].1).collect();
        let (tin, tout) = Self::teacher(&tgts);
        let logits = model.forward(Self::pad(&src, &device), Self::pad(&tin, &device));
        let [b, t, v] = logits.dims();
        let target = Self::pad(&tout, &device);
        let loss = CrossEntropyLossConfig::new()
            .with_pad_tokens(Some(vec![PAD as usize]))
            .init(&device)
            .forward(logits.reshape([b * t, v]), target.reshape([b * t]));
        (loss, idx.len())
    }

    fn evaluate(&self, model: &Seq2Seq, rank: usize, ranks: usize) -> Vec<f64> {
        let device = crate::flat::eval_device();
        let n = self.eval_pairs.min(self.corpus.test.len());
        let mine: Vec<usize> = (rank..n).step_by(ranks.max(1)).collect();
        // BLEU statistics, then correct and counted tokens under teacher forcing.
        let mut bleu = BleuStats::default();
        let (mut correct, mut counted) = (0f64, 0f64);
        for chunk in mine.chunks(64) {
            let src: Vec<Vec<u32>> = chunk
                .iter()
                .map(|&i| self.corpus.test[i].0.clone())
                .collect();
            let refs: Vec<&Vec<String>> = chunk.iter().map(|&i| &self.corpus.test[i].1).collect();
            let hyp = model.greedy(Self::pad(&src, &device), MAX_LEN + 4);
            for (h, r) in hyp.iter().zip(&refs) {
                bleu.add(&self.corpus.tgt_vocab.decode(h), r);
            }
            let tgt_ids: Vec<Vec<u32>> = refs
                .iter()
                .map(|r| self.corpus.tgt_vocab.encode(r))
                .collect();
            let tgts: Vec<&Vec<u32>> = tgt_ids.iter().collect();
            let (tin, tout) = Self::teacher(&tgts);
            let logits = model.forward(Self::pad(&src, &device), Self::pad(&tin, &device));
            let [b, t, v] = logits.dims();
            let pred = argmax_rows(logits.reshape([b * t, v]));
            for (row, y) in tout.iter().enumerate() {
                for (j, &tok) in y.iter().enumerate() {
                    correct += f64::from(u8::from(pred[row * t + j] == i64::from(tok)));
                    counted += 1.0;
                }
            }
        }
        let mut s = bleu.to_vec();
        s.extend_from_slice(&[correct, counted]);
        s
    }

    fn metrics(&self, s: &[f64]) -> Vec<(&'static str, f64)> {
        let k = BleuStats::LEN;
        let acc = s.get(k).copied().unwrap_or(0.0) / s.get(k + 1).copied().unwrap_or(0.0).max(1.0);
        vec![
            ("bleu", BleuStats::from_slice(s).score()),
            ("token_accuracy", acc),
        ]
    }

    fn primary(&self) -> &'static str {
        "bleu"
    }

    fn save_local(&self, local: &TranslateLocal) -> serde_json::Value {
        serde_json::json!({ "drawn": local.drawn })
    }

    fn load_local(
        &self,
        local: &mut TranslateLocal,
        saved: &serde_json::Value,
        iteration: u64,
    ) -> Result<(), String> {
        let drawn = saved["drawn"].as_u64().ok_or("no sampler position")?;
        // One batch per local step: more than the iterations is not a state a run writes (and
        // replaying it would take as long).
        if drawn > iteration {
            return Err(format!(
                "{drawn} batches drawn by iteration {iteration} (one per step)"
            ));
        }
        // Replay the sampler to the same position (deterministic from its seed).
        *local = self.local(local.rank, local.ranks, local.seed);
        for _ in 0..drawn {
            local.sampler.next_batch(self.batch);
        }
        local.drawn = drawn;
        Ok(())
    }
}
