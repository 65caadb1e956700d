//! Bring your own burn model: a two-layer perceptron learns a synthetic two-class problem
//! with WAGMA-SGD on four in-process ranks. The loop is the whole integration: copy the
//! worker's parameters into the model, compute a gradient, hand it to the worker.
//!
//! `cargo run --release -p wagma-train --example own_model`

use burn::module::Module;
use burn::nn::loss::CrossEntropyLoss;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use wagma::algo::{AlgoConfig, Algorithm, OptimizerConfig, Worker};
use wagma::exec::threaded;
use wagma::{Comm, EngineConfig, Error, Payload};
use wagma_train::flat::{FlatModel, train_device};

#[derive(Module, Debug)]
struct Mlp {
    a: Linear,
    b: Linear,
    act: Relu,
}

impl Mlp {
    fn new(device: &Device) -> Mlp {
        Mlp {
            a: LinearConfig::new(2, 32).init(device),
            b: LinearConfig::new(32, 2).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.act.forward(self.a.forward(x)))
    }
}

/// Points inside (class 1) or outside (class 0) the unit circle, drawn from a simple LCG.
fn batch(seed: u64, n: usize) -> (Vec<f32>, Vec<i64>) {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 3.0 - 1.5
    };
    let mut x = Vec::with_capacity(2 * n);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let (a, b) = (next(), next());
        x.extend_from_slice(&[a, b]);
        y.push(i64::from(a * a + b * b < 1.0));
    }
    (x, y)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = train_device();
    device.seed(7);
    // Every rank starts from the same initial model.
    let init = FlatModel::new(Mlp::new(&device)).params();
    let algo = AlgoConfig::new(Algorithm::from_name("wagma")?);

    let accuracy = threaded::run(4, EngineConfig::default(), async |c: &mut Comm| {
        let rank = c.rank() as u64;
        let mut model = FlatModel::new(Mlp::new(&train_device()));
        let mut w = Worker::new(
            c,
            algo.clone(),
            OptimizerConfig::sgd(0.2),
            Payload::Data(init.clone()),
            Payload::default(),
        )
        .await?;
        for t in 0..400u64 {
            model.set_params(w.params());
            let (x, y) = batch(rank * 1_000_003 + t, 64);
            let dev = train_device();
            let x = Tensor::<2>::from_data(TensorData::new(x, [64, 2]), &dev);
            let y = Tensor::<1, Int>::from_data(TensorData::new(y, [64]), &dev);
            let loss = CrossEntropyLoss::new(None, &dev).forward(model.model().forward(x), y);
            let grad = model.backward(loss);
            w.step(&grad).await?;
        }
        // Evaluate the consensus (the global average of the replicas).
        let (params, _) = w.consensus().await?;
        model.set_params(params.as_slice());
        let (x, y) = batch(99_999, 1000);
        let x = Tensor::<2>::from_data(
            TensorData::new(x, [1000, 2]),
            &wagma_train::flat::eval_device(),
        );
        let pred: Vec<i64> = model
            .eval_model()
            .forward(x)
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .iter::<i64>()
            .collect();
        let correct = pred.iter().zip(&y).filter(|(a, b)| a == b).count();
        Ok::<_, Error>(correct as f64 / 1000.0)
    })?
    .into_all()?;
    println!(
        "accuracy of the consensus model on held-out points: {:.3}",
        accuracy[0]
    );
    Ok(())
}
