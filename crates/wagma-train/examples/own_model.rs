//! Bring your own burn model and optimizer: a two-layer perceptron learns a synthetic
//! two-class problem with WAGMA-SGD and burn's Adam. The integration is three lines: one
//! start-up call for every launcher, the wrapper around the optimizer (it also gives every rank
//! rank 0's initial model), and `opt.step` where burn's `optim.step` was.
//!
//! The same binary runs
//! * on 4 threads: `cargo run --release -p wagma-train --example own_model`;
//! * one rank per process over TCP: `wagma launch -n 4 -- target/release/examples/own_model`;
//! * under MPI (build with `--features mpi`): `mpirun -n 4 target/release/examples/own_model`.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLoss;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use wagma::algo::{AlgoConfig, Algorithm};
use wagma::exec::launch::{Launch, launch};
use wagma::{Comm, EngineConfig, Error};
use wagma_train::DistributedOptimizer;
use wagma_train::flat::{eval_device, train_device};

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

fn accuracy(model: &Mlp) -> f64 {
    let (x, y) = batch(99_999, 1000);
    let x = Tensor::<2>::from_data(TensorData::new(x, [1000, 2]), &eval_device());
    let pred: Vec<i64> = model
        .valid()
        .forward(x)
        .argmax(1)
        .into_data()
        .convert::<i64>()
        .iter::<i64>()
        .collect();
    pred.iter().zip(&y).filter(|(a, b)| a == b).count() as f64 / 1000.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 4 in-process ranks, unless a launcher started this process as one rank of its job.
    let how = Launch::from_env(4)?;
    let algo = AlgoConfig::new(Algorithm::from_name("wagma")?);
    let job = launch(how, EngineConfig::default(), async |comm: &mut Comm| {
        let rank = comm.rank() as u64;
        let device = train_device();
        let model = Mlp::new(&device);
        let (mut opt, mut model) =
            DistributedOptimizer::new(comm, algo.clone(), AdamConfig::new().init(), model).await?;
        for t in 0..300u64 {
            let (x, y) = batch(rank * 1_000_003 + t, 64);
            let x = Tensor::<2>::from_data(TensorData::new(x, [64, 2]), &device);
            let y = Tensor::<1, Int>::from_data(TensorData::new(y, [64]), &device);
            let loss = CrossEntropyLoss::new(None, &device).forward(model.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = opt.step(5e-3, model, grads).await?;
        }
        // Evaluate the consensus (the global average of the replicas).
        let consensus = opt.consensus(model).await?;
        Ok::<_, Error>((opt.worker().comm().rank(), accuracy(&consensus)))
    })?;
    for (rank, acc) in job.into_all()? {
        if rank == 0 {
            println!("accuracy of the consensus model on held-out points: {acc:.3}");
        }
    }
    Ok(())
}
