//! Image classification with a ResNet-style CNN: residual blocks of 3x3 convolutions with
//! BatchNorm, two downsampling stages, global average pooling. 1-D signals (the built-in
//! dataset) are images of height 1 with 1x3 kernels.

use std::path::Path;
use std::sync::Arc;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLoss;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use super::{Workload, argmax_rows};
use crate::data::{ImageSet, Sampler, idx, mnist1d};
use crate::error::TrainError;

/// Which images.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dataset {
    /// Fashion-MNIST if Debian's package is installed, the built-in signals otherwise.
    Auto,
    /// The built-in procedural dataset.
    Builtin,
    /// MNIST-format IDX files in a directory.
    Idx(std::path::PathBuf),
}

/// Loads `(train, test, name)`.
pub fn load(dataset: &Dataset, seed: u64) -> Result<(ImageSet, ImageSet, String), TrainError> {
    match dataset {
        Dataset::Auto if Path::new(idx::FASHION_MNIST_DIR).is_dir() => {
            let (a, b) = idx::load_dir(Path::new(idx::FASHION_MNIST_DIR))?;
            Ok((a, b, "fashion-mnist".into()))
        }
        Dataset::Auto | Dataset::Builtin => Ok((
            mnist1d::generate(8000, seed ^ 0x11),
            mnist1d::generate(10_000, seed ^ 0x22),
            "builtin (procedural 1-D signals)".into(),
        )),
        Dataset::Idx(dir) => {
            let (a, b) = idx::load_dir(dir)?;
            Ok((a, b, format!("idx files in {}", dir.display())))
        }
    }
}

/// Conv + BatchNorm.
#[derive(Module, Debug)]
pub struct ConvBn {
    conv: Conv2d,
    bn: BatchNorm,
}

impl ConvBn {
    fn new(
        c_in: usize,
        c_out: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        device: &Device,
    ) -> ConvBn {
        let pad = [kernel[0] / 2, kernel[1] / 2];
        ConvBn {
            conv: Conv2dConfig::new([c_in, c_out], kernel)
                .with_stride(stride)
                .with_padding(PaddingConfig2d::Explicit(pad[0], pad[1], pad[0], pad[1]))
                .with_bias(false)
                .init(device),
            bn: BatchNormConfig::new(c_out).init(device),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.bn.forward(self.conv.forward(x))
    }
}

/// A residual block: two conv-BN layers and a projection when the shape changes.
#[derive(Module, Debug)]
pub struct Residual {
    a: ConvBn,
    b: ConvBn,
    skip: Option<ConvBn>,
    act: Relu,
}

impl Residual {
    fn new(
        c_in: usize,
        c_out: usize,
        k: [usize; 2],
        stride: [usize; 2],
        device: &Device,
    ) -> Residual {
        let skip = (c_in != c_out || stride != [1, 1]).then(|| {
            let one = [1, 1];
            ConvBn::new(c_in, c_out, one, stride, device)
        });
        Residual {
            a: ConvBn::new(c_in, c_out, k, stride, device),
            b: ConvBn::new(c_out, c_out, k, [1, 1], device),
            skip,
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let y = self.b.forward(self.act.forward(self.a.forward(x.clone())));
        let s = match &self.skip {
            Some(p) => p.forward(x),
            None => x,
        };
        self.act.forward(y + s)
    }
}

/// The ResNet-style classifier.
#[derive(Module, Debug)]
pub struct ResNet {
    stem: ConvBn,
    blocks: Vec<Residual>,
    pool: AdaptiveAvgPool2d,
    head: Linear,
    act: Relu,
}

impl ResNet {
    /// A network for `channels` x `height` x `width` inputs with base width `c` and 10 classes.
    pub fn new(channels: usize, height: usize, c: usize, device: &Device) -> ResNet {
        let flat = height == 1;
        let k = if flat { [1, 3] } else { [3, 3] };
        let down = if flat { [1, 2] } else { [2, 2] };
        ResNet {
            stem: ConvBn::new(channels, c, k, [1, 1], device),
            blocks: vec![
                Residual::new(c, c, k, [1, 1], device),
                Residual::new(c, 2 * c, k, down, device),
                Residual::new(2 * c, 4 * c, k, down, device),
            ],
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(4 * c, 10).init(device),
            act: Relu::new(),
        }
    }

    /// Logits `[batch, 10]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let mut x = self.act.forward(self.stem.forward(x));
        for b in &self.blocks {
            x = b.forward(x);
        }
        self.head.forward(self.pool.forward(x).flatten::<2>(1, 3))
    }
}

/// Image classification on a training and a held-out set.
pub struct ImageWorkload {
    train: Arc<ImageSet>,
    test: Arc<ImageSet>,
    batch: usize,
    width: usize,
    non_iid: bool,
}

/// One rank's sampler over its shard.
pub struct ImageLocal {
    sampler: Sampler,
}

impl ImageWorkload {
    /// A workload over `train`/`test`, `batch` samples per local step, base width `width`.
    pub fn new(train: ImageSet, test: ImageSet, batch: usize, width: usize) -> ImageWorkload {
        ImageWorkload {
            train: Arc::new(train),
            test: Arc::new(test),
            batch,
            width,
            non_iid: false,
        }
    }

    /// Label-skewed shards instead of uniform ones (see [`crate::data::label_skewed_shard`]).
    pub fn with_label_skew(mut self, on: bool) -> ImageWorkload {
        self.non_iid = on;
        self
    }

    fn tensors(set: &ImageSet, idx: &[usize], device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
        let (x, y) = set.batch(idx);
        let x = Tensor::<4>::from_data(
            TensorData::new(x, [idx.len(), set.channels, set.height, set.width]),
            device,
        );
        let y: Vec<i64> = y.into_iter().map(i64::from).collect();
        let y = Tensor::<1, Int>::from_data(TensorData::new(y, [idx.len()]), device);
        (x, y)
    }

    /// Training samples.
    pub fn train_len(&self) -> usize {
        self.train.len()
    }
}

impl Workload for ImageWorkload {
    type Model = ResNet;
    type Local = ImageLocal;

    fn name(&self) -> &'static str {
        "image"
    }

    fn build(&self, device: &Device) -> ResNet {
        ResNet::new(self.train.channels, self.train.height, self.width, device)
    }

    fn train_samples(&self) -> Option<usize> {
        Some(self.train_len())
    }

    fn local(&self, rank: usize, ranks: usize, seed: u64) -> ImageLocal {
        let sampler = if self.non_iid {
            let shard = crate::data::label_skewed_shard(&self.train.labels, rank, ranks, seed);
            Sampler::over(shard, rank, seed)
        } else {
            Sampler::new(self.train.len(), rank, ranks, seed)
        };
        ImageLocal { sampler }
    }

    fn loss(&self, model: &ResNet, local: &mut ImageLocal, _step: u64) -> (Tensor<1>, usize) {
        let idx = local.sampler.next_batch(self.batch);
        let device = crate::flat::train_device();
        let (x, y) = Self::tensors(&self.train, &idx, &device);
        let loss = CrossEntropyLoss::new(None, &device).forward(model.forward(x), y);
        (loss, idx.len())
    }

    fn evaluate(&self, model: &ResNet, rank: usize, ranks: usize) -> Vec<f64> {
        let device = crate::flat::eval_device();
        let mine: Vec<usize> = (rank..self.test.len()).step_by(ranks.max(1)).collect();
        let mut correct = 0usize;
        let mut loss_sum = 0.0f64;
        for chunk in mine.chunks(256) {
            let (x, y) = Self::tensors(&self.test, chunk, &device);
            let logits = model.forward(x);
            let labels: Vec<i64> = chunk
                .iter()
                .map(|&i| i64::from(self.test.labels[i]))
                .collect();
            let loss = CrossEntropyLoss::new(None, &device).forward(logits.clone(), y);
            loss_sum += f64::from(loss.into_scalar::<f32>()) * chunk.len() as f64;
            correct += argmax_rows(logits)
                .iter()
                .zip(&labels)
                .filter(|(a, b)| a == b)
                .count();
        }
        vec![correct as f64, mine.len() as f64, loss_sum]
    }

    fn metrics(&self, s: &[f64]) -> Vec<(&'static str, f64)> {
        let n = s.get(1).copied().unwrap_or(0.0).max(1.0);
        vec![("accuracy", s[0] / n), ("loss", s[2] / n)]
    }

    fn primary(&self) -> &'static str {
        "accuracy"
    }

    fn save_local(&self, local: &ImageLocal) -> serde_json::Value {
        let (epoch, at) = local.sampler.position();
        serde_json::json!({ "epoch": epoch, "at": at })
    }

    fn load_local(
        &self,
        local: &mut ImageLocal,
        saved: &serde_json::Value,
        _iteration: u64,
    ) -> Result<(), String> {
        let epoch = saved["epoch"].as_u64().ok_or("no sampler epoch")?;
        let at = saved["at"].as_u64().ok_or("no sampler position")? as usize;
        local.sampler.seek(epoch, at);
        Ok(())
    }
}
