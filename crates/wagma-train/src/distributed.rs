//! Any algorithm of wagma as a drop-in for a burn training loop: [`DistributedOptimizer`] wraps
//! the user's own burn optimizer (SGD, Adam, AdamW, ...; anything that becomes a
//! [`ModuleOptimizer`]) the way PyTorch's `PostLocalSGDOptimizer` or Horovod's
//! `DistributedOptimizer` wrap theirs.
//!
//! * Model-averaging algorithms (WAGMA-SGD, local SGD, D-PSGD, AD-PSGD, SGP): the inner
//!   optimizer steps with this rank's gradients, then the model it produced is averaged
//!   (Algorithm 2's order; `order = average-then-step` averages first and adds the step after).
//! * Gradient-averaging algorithms (allreduce-SGD, eager-SGD): the gradients are averaged, then
//!   the inner optimizer consumes them.
//! * Buffers (BatchNorm running statistics) are averaged as the scope says; the inner
//!   optimizer's state (Adam's moments) stays local.
//!
//! Each step copies the parameters once out of the model and, when they were averaged, once
//! back in (gradients too, for gradient-averaging algorithms); nothing else.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use wagma::algo::{AlgoConfig, Resume, StepReport, Worker};
use wagma::{Comm, Error, Payload, block_on};

use crate::flat::{Path, layout, read_into, write_values};

/// A burn optimizer whose every step also runs a wagma algorithm over `comm`.
///
/// ```no_run
/// # use burn::nn::{Linear, LinearConfig};
/// # use burn::optim::{AdamConfig, GradientsParams};
/// # use burn::prelude::*;
/// # use wagma::algo::{AlgoConfig, Algorithm};
/// # use wagma::exec::launch::{Launch, launch};
/// # use wagma_train::distributed::DistributedOptimizer;
/// # fn data(_: usize) -> (Tensor<2>, Tensor<2>) { unimplemented!() }
/// let how = Launch::from_env(4)?; // 4 threads here; one rank per process under a launcher
/// launch(how, Default::default(), async |comm| {
///     let device = Device::flex().autodiff();
///     let model: Linear = LinearConfig::new(8, 1).init(&device);
///     let algo = AlgoConfig::new(Algorithm::from_name("wagma")?);
///     // Every rank starts from rank 0's model.
///     let (mut opt, mut model) =
///         DistributedOptimizer::new(comm, algo, AdamConfig::new().init(), model).await?;
///     for step in 0..100 {
///         let (x, y) = data(step);
///         let loss = (model.forward(x) - y).powi_scalar(2).mean();
///         let grads = GradientsParams::from_grads(loss.backward(), &model);
///         model = opt.step(1e-3, model, grads).await?;
///     }
///     Ok(())
/// })?
/// .into_all()?; // a rank's error, if any rank failed
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DistributedOptimizer<'c> {
    inner: ModuleOptimizer,
    worker: Worker<'c>,
    has_buffers: bool,
}

impl<'c> DistributedOptimizer<'c> {
    /// Wraps `inner` for `model`: every rank checks that it holds the same layout as the
    /// others and starts from rank 0's parameters and buffers, returned as the model to train.
    pub async fn new<M: Module>(
        comm: &'c mut Comm,
        algo: AlgoConfig,
        inner: impl Into<ModuleOptimizer>,
        model: M,
    ) -> Result<(DistributedOptimizer<'c>, M), Error> {
        let (model, params, buffers) = share_initial_model(comm, model).await?;
        let has_buffers = !buffers.is_empty();
        let worker = Worker::external(
            comm,
            algo,
            Payload::Data(params),
            Payload::Data(buffers),
            Resume::default(),
        )
        .await?;
        let opt = DistributedOptimizer {
            inner: inner.into(),
            worker,
            has_buffers,
        };
        Ok((opt, model))
    }

    /// One training step with this rank's `grads` of `model` at learning rate `lr`: the inner
    /// optimizer's step and the algorithm's communication. Returns the model to continue with.
    pub async fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<M, Error> {
        self.step_reporting(lr, model, grads).await.map(|(m, _)| m)
    }

    /// [`DistributedOptimizer::step`], blocking this thread: for a plain loop over a
    /// multi-threaded executor (one rank per thread or process), not for virtual time.
    pub fn step_blocking<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<M, Error> {
        block_on(self.step(lr, model, grads))
    }

    /// [`DistributedOptimizer::step`], with what the step did (waiting, freshness, syncs).
    pub async fn step_reporting<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<(M, StepReport), Error> {
        if self.has_buffers {
            // Statistics the forward pass just updated are what this rank contributes.
            read_into(&model, true, self.worker.buffers_mut());
        }
        let cfg = self.worker.config();
        let averages_models = cfg.algorithm.averages_models();
        let average_buffers = cfg.scope.average_buffers;
        // Model-averaging algorithms leave the gradient to the inner optimizer untouched.
        let flat_grad = if averages_models {
            Vec::new()
        } else {
            flat_gradients(&model, &grads)
        };
        let mut model = Some(model);
        let mut grads = Some(grads);
        let inner = &mut self.inner;
        let mut update = |params: &mut [f32], averaged: &[f32]| {
            let (Some(m), Some(g)) = (model.take(), grads.take()) else {
                return;
            };
            let g = if averages_models {
                g
            } else {
                set_gradients(&m, g, averaged)
            };
            let m = inner.step(lr, m, g);
            read_into(&m, false, params);
            model = Some(m);
        };
        let report = self.worker.step_external(&flat_grad, &mut update).await?;
        let rank = self.worker.comm().rank();
        let mut m = model.take().ok_or_else(|| Error::Protocol {
            rank,
            op: wagma::error::Op::Other("step"),
            detail: "the optimizer step did not run".into(),
        })?;
        if averages_models {
            m = write_values(m, false, self.worker.params());
        }
        if self.has_buffers && average_buffers {
            m = write_values(m, true, self.worker.buffers());
        }
        Ok((m, report))
    }

    /// The consensus model (the global average of every rank's replica) written into
    /// `model`, without changing the replicas: every rank calls it at the same iteration.
    pub async fn consensus<M: Module>(&mut self, model: M) -> Result<M, Error> {
        let (params, buffers) = self.worker.consensus().await?;
        // Pending statistics would overwrite the consensus buffers at their next sync.
        let _ = model.valid();
        let m = write_values(model, false, params.as_slice());
        Ok(if self.has_buffers {
            write_values(m, true, buffers.as_slice())
        } else {
            m
        })
    }

    /// The wagma worker (iteration, communicator, statistics).
    pub fn worker(&mut self) -> &mut Worker<'c> {
        &mut self.worker
    }

    /// The inner burn optimizer (to save or load its record).
    pub fn inner(&mut self) -> &mut ModuleOptimizer {
        &mut self.inner
    }
}

/// Checks that every rank holds a model of the same layout (a typed error naming both ranks
/// and both layouts otherwise) and gives every rank rank 0's parameters and buffers; returns
/// the model and its flat values.
pub async fn share_initial_model<M: Module>(
    comm: &mut Comm,
    model: M,
) -> Result<(M, Vec<f32>, Vec<f32>), Error> {
    let l = layout(&model);
    let mut params = vec![0f32; l.params()];
    let mut buffers = vec![0f32; l.buffers()];
    read_into(&model, false, &mut params);
    if !buffers.is_empty() {
        read_into(&model, true, &mut buffers);
    }
    comm.share_model(&l.fingerprint(), &mut params, &mut buffers)
        .await?;
    let mut model = write_values(model, false, &params);
    if !buffers.is_empty() {
        model = write_values(model, true, &buffers);
    }
    Ok((model, params, buffers))
}

/// The gradients of `model`'s trainable parameters in layout order (zeros where none).
fn flat_gradients<M: Module>(model: &M, grads: &GradientsParams) -> Vec<f32> {
    struct Reader<'a> {
        grads: &'a GradientsParams,
        out: Vec<f32>,
        path: Path,
    }
    impl ModuleVisitor for Reader<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.path.is_buffer() {
                return;
            }
            let n = param.shape().num_elements();
            match self.grads.get::<D>(param.id) {
                Some(g) => {
                    let data = g.into_data();
                    match data.as_slice::<f32>() {
                        Ok(v) => self.out.extend_from_slice(v),
                        Err(_) => self.out.extend(data.iter::<f32>()),
                    }
                }
                None => self.out.extend(std::iter::repeat_n(0.0, n)),
            }
        }
    }
    let mut r = Reader {
        grads,
        out: Vec::new(),
        path: Path::default(),
    };
    model.visit(&mut r);
    r.out
}

/// `grads` with each trainable parameter's gradient replaced by its slice of `values`.
fn set_gradients<M: Module>(model: &M, grads: GradientsParams, values: &[f32]) -> GradientsParams {
    struct Writer<'a> {
        grads: GradientsParams,
        values: &'a [f32],
        at: usize,
        path: Path,
    }
    impl ModuleVisitor for Writer<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.path.is_buffer() {
                return;
            }
            let shape = param.shape();
            let n = shape.num_elements();
            let Some(v) = self.values.get(self.at..self.at + n) else {
                return;
            };
            self.at += n;
            // A parameter without a gradient here keeps none: the inner optimizer skips it.
            if let Some(old) = self.grads.remove::<D>(param.id) {
                let t = Tensor::<D>::from_data(TensorData::new(v.to_vec(), shape), &old.device());
                self.grads.register::<D>(param.id, t);
            }
        }
    }
    let mut w = Writer {
        grads,
        values,
        at: 0,
        path: Path::default(),
    };
    model.visit(&mut w);
    w.grads
}
