//! `wagma bench wrapper`: the cost of training through [`DistributedOptimizer`] against the
//! same model and burn optimizer in a plain burn loop, at P = 1 (no peer to wait for: what is
//! measured is the wrapper's own work, the copies between tensors and flat buffers and the
//! engine's round trips). Both loops alternate in blocks on the same thread, so the machine's
//! noise hits both alike; the report gives the median milliseconds per step and their ratio.

use std::time::Instant;

use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use clap::Args as ClapArgs;
use serde::Serialize;
use wagma::algo::{AlgoConfig, Algorithm};
use wagma::exec::threaded;
use wagma::{Comm, EngineConfig, Error};
use wagma_train::DistributedOptimizer;
use wagma_train::flat::train_device;
use wagma_train::workloads::Workload;
use wagma_train::workloads::image::{self, Dataset, ImageWorkload};

/// Options of `wagma bench wrapper`.
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Steps per block.
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Timed blocks per loop (alternating plain and wrapped), after one more that warms up.
    #[arg(long, default_value_t = 5)]
    pub blocks: usize,
    /// Algorithm behind the wrapper.
    #[arg(long, default_value = "wagma")]
    pub algo: String,
    /// Image data: auto (Fashion-MNIST if installed, else built-in) or builtin.
    #[arg(long, default_value = "auto")]
    pub dataset: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report {
    model: String,
    params: usize,
    algorithm: String,
    steps_per_block: u64,
    blocks: usize,
    plain_ms_per_step: f64,
    wrapped_ms_per_step: f64,
    overhead: f64,
}

fn adam() -> ModuleOptimizer {
    AdamConfig::new().init()
}

/// Runs the benchmark.
pub fn run(a: Args) -> anyhow::Result<()> {
    let dataset = match a.dataset.as_str() {
        "auto" => Dataset::Auto,
        "builtin" => Dataset::Builtin,
        x => anyhow::bail!("invalid dataset {x:?} (auto or builtin)"),
    };
    let (train, test, data) = image::load(&dataset, 1)?;
    let w = ImageWorkload::new(train, test, 32, 16);
    let algo = AlgoConfig::new(Algorithm::from_name(&a.algo)?);
    if a.steps == 0 || a.blocks == 0 {
        anyhow::bail!("--steps and --blocks must be at least 1");
    }
    let (steps, blocks) = (a.steps, a.blocks);
    let job = threaded::run(1, EngineConfig::default(), async |c: &mut Comm| {
        let device = train_device();
        let mut local = w.local(0, 1, 1);
        let mut plain = w.build(&device);
        let mut plain_opt = adam();
        let (mut opt, mut wrapped) =
            DistributedOptimizer::new(c, algo.clone(), adam(), w.build(&device)).await?;
        let (mut t_plain, mut t_wrapped) = (Vec::new(), Vec::new());
        let mut t = 0;
        // One warm-up block each, not timed.
        for block in 0..=blocks {
            let s = Instant::now();
            for _ in 0..steps {
                let (loss, _) = w.loss(&plain, &mut local, t);
                let g = GradientsParams::from_grads(loss.backward(), &plain);
                plain = plain_opt.step(1e-3, plain, g);
                t += 1;
            }
            let plain_s = s.elapsed().as_secs_f64();
            let s = Instant::now();
            for _ in 0..steps {
                let (loss, _) = w.loss(&wrapped, &mut local, t);
                let g = GradientsParams::from_grads(loss.backward(), &wrapped);
                wrapped = opt.step(1e-3, wrapped, g).await?;
                t += 1;
            }
            let wrapped_s = s.elapsed().as_secs_f64();
            if block > 0 {
                t_plain.push(1e3 * plain_s / steps as f64);
                t_wrapped.push(1e3 * wrapped_s / steps as f64);
            }
        }
        Ok::<_, Error>((super::median(&mut t_plain), super::median(&mut t_wrapped)))
    })?;
    let (p, wr) = job
        .into_all()?
        .into_iter()
        .next()
        .unwrap_or((f64::NAN, f64::NAN));
    let params = wagma_train::flat::layout(&w.build(&train_device())).params();
    let r = Report {
        model: format!("image CNN (residual blocks with BatchNorm), batch 32, on {data}"),
        params,
        algorithm: algo.label(),
        steps_per_block: steps,
        blocks,
        plain_ms_per_step: p,
        wrapped_ms_per_step: wr,
        overhead: wr / p - 1.0,
    };
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{} ({} parameters), burn's Adam, P = 1, median of {} blocks of {} steps:\n  plain burn loop      {:8.2} ms/step\n  DistributedOptimizer {:8.2} ms/step ({})\n  overhead             {:+.1}%",
            r.model,
            r.params,
            r.blocks,
            r.steps_per_block,
            r.plain_ms_per_step,
            r.wrapped_ms_per_step,
            r.algorithm,
            100.0 * r.overhead
        );
    }
    Ok(())
}
