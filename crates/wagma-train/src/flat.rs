//! A burn model seen as wagma's flat buffers: trainable parameters, non-trainable buffers
//! (BatchNorm running statistics) and gradients, each one `Vec<f32>` in the module's
//! declaration order, identical in every process.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::Gradients;
use serde::{Deserialize, Serialize};

/// Whether the innermost field name marks a running statistic (BatchNorm's RunningState).
fn is_buffer(path: &[String]) -> bool {
    matches!(
        path.last().map(String::as_str),
        Some("running_mean" | "running_var")
    )
}

/// One tensor of the model: where it is and its shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// Field path, e.g. `blocks.0.conv1.weight`.
    pub path: String,
    /// Dimensions.
    pub dims: Vec<usize>,
    /// True for a non-trainable buffer.
    pub buffer: bool,
}

/// The shape of a model: what a checkpoint must match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Every tensor, in visit order.
    pub tensors: Vec<TensorInfo>,
}

impl Layout {
    /// Number of trainable values.
    pub fn params(&self) -> usize {
        self.count(false)
    }

    /// Number of buffer values.
    pub fn buffers(&self) -> usize {
        self.count(true)
    }

    /// What ranks compare to agree that they hold the same model: counts and a hash of every
    /// tensor's path and shape.
    pub fn fingerprint(&self) -> wagma::exec::launch::ModelLayout {
        wagma::exec::launch::ModelLayout::of(
            self.tensors
                .iter()
                .map(|t| (t.path.as_str(), t.dims.as_slice(), t.buffer)),
        )
    }

    fn count(&self, buffer: bool) -> usize {
        self.tensors
            .iter()
            .filter(|t| t.buffer == buffer)
            .map(|t| t.dims.iter().product::<usize>())
            .sum()
    }
}

/// Where a visitor is in the module tree.
#[derive(Default)]
pub(crate) struct Path(Vec<String>);

impl Path {
    pub(crate) fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    pub(crate) fn exit(&mut self) {
        self.0.pop();
    }
    /// True inside a buffer (a BatchNorm running statistic).
    pub(crate) fn is_buffer(&self) -> bool {
        is_buffer(&self.0)
    }
}

struct Reader {
    path: Path,
    buffers: bool,
    out: Vec<f32>,
    layout: Vec<TensorInfo>,
}

impl ModuleVisitor for Reader {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let buffer = is_buffer(&self.path.0);
        self.layout.push(TensorInfo {
            path: self.path.0.join("."),
            dims: param.shape().as_slice().to_vec(),
            buffer,
        });
        if buffer == self.buffers {
            let data = param.val().into_data();
            match data.as_slice::<f32>() {
                Ok(v) => self.out.extend_from_slice(v),
                Err(_) => self.out.extend(data.iter::<f32>()),
            }
        }
    }
}

/// Copies the parameters (or buffers) into a slice, in visit order.
struct SliceReader<'a> {
    path: Path,
    buffers: bool,
    out: &'a mut [f32],
    at: usize,
}

impl ModuleVisitor for SliceReader<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if is_buffer(&self.path.0) != self.buffers {
            return;
        }
        let data = param.val().into_data();
        let n = param.shape().num_elements();
        let Some(dst) = self.out.get_mut(self.at..self.at + n) else {
            return;
        };
        match data.as_slice::<f32>() {
            Ok(v) if v.len() == n => dst.copy_from_slice(v),
            _ => dst
                .iter_mut()
                .zip(data.iter::<f32>())
                .for_each(|(d, x)| *d = x),
        }
        self.at += n;
    }
}

/// Copies `m`'s trainable parameters (`buffers`: its buffers) into `out`, in the layout's
/// order; `out` must hold exactly that many values.
pub fn read_into<M: Module>(m: &M, buffers: bool, out: &mut [f32]) {
    if buffers {
        // Pending per-thread BatchNorm statistics become visible after a sync.
        let _ = m.valid();
    }
    m.visit(&mut SliceReader {
        path: Path::default(),
        buffers,
        out,
        at: 0,
    });
}

/// `m` with its trainable parameters (`buffers`: its buffers) replaced by `values`. Buffers
/// with per-thread statistics pending since the last [`read_into`] would overwrite the new
/// values at their next synchronisation: read (or flush with `valid`) first.
pub fn write_values<M: Module>(m: M, buffers: bool, values: &[f32]) -> M {
    m.map(&mut Writer {
        path: Path::default(),
        buffers,
        data: values,
        at: 0,
    })
}

struct Writer<'a> {
    path: Path,
    buffers: bool,
    data: &'a [f32],
    at: usize,
}

impl ModuleMapper for Writer<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if is_buffer(&self.path.0) != self.buffers {
            return param;
        }
        let shape = param.shape();
        let n = shape.num_elements();
        let Some(values) = self.data.get(self.at..self.at + n) else {
            return param;
        };
        let values = values.to_vec();
        self.at += n;
        let device = param.device();
        let grad = param.is_require_grad();
        param.map(move |_| {
            let t = Tensor::<D>::from_data(TensorData::new(values, shape), &device);
            if grad { t.require_grad() } else { t }
        })
    }
}

struct GradReader<'a> {
    path: Path,
    grads: &'a Gradients,
    out: Vec<f32>,
}

impl ModuleVisitor for GradReader<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if is_buffer(&self.path.0) {
            return;
        }
        match param.grad(self.grads) {
            Some(g) => {
                let data = g.into_data();
                match data.as_slice::<f32>() {
                    Ok(v) => self.out.extend_from_slice(v),
                    Err(_) => self.out.extend(data.iter::<f32>()),
                }
            }
            // A parameter the loss does not depend on has a zero gradient.
            None => self
                .out
                .extend(std::iter::repeat_n(0.0, param.shape().num_elements())),
        }
    }
}

fn read<M: Module>(m: &M, buffers: bool) -> (Vec<f32>, Vec<TensorInfo>) {
    let mut r = Reader {
        path: Path::default(),
        buffers,
        out: Vec::new(),
        layout: Vec::new(),
    };
    m.visit(&mut r);
    (r.out, r.layout)
}

/// The layout of `m`.
pub fn layout<M: Module>(m: &M) -> Layout {
    Layout {
        tensors: read(m, false).1,
    }
}

/// A burn model with flat access to its parameters, buffers and gradients.
#[derive(Debug)]
pub struct FlatModel<M: Module> {
    model: M,
    layout: Layout,
}

impl<M: Module> FlatModel<M> {
    /// Wraps `model` (built on the autodiff device for training).
    pub fn new(model: M) -> FlatModel<M> {
        // BatchNorm statistics become visible only after a sync, which `valid` performs.
        let _ = model.valid();
        let layout = layout(&model);
        FlatModel { model, layout }
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// A copy for evaluation (no autodiff, BatchNorm on running statistics).
    pub fn eval_model(&self) -> M {
        self.model.valid()
    }

    /// The shape of the model.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The trainable parameters.
    pub fn params(&self) -> Vec<f32> {
        read(&self.model, false).0
    }

    /// The non-trainable buffers (up to date with the last forward pass).
    pub fn buffers(&self) -> Vec<f32> {
        let _ = self.model.valid();
        read(&self.model, true).0
    }

    /// Replaces the trainable parameters.
    pub fn set_params(&mut self, values: &[f32]) {
        self.write(values, false);
    }

    /// Replaces the buffers.
    pub fn set_buffers(&mut self, values: &[f32]) {
        // Flush pending per-thread statistics first, or they would overwrite the new values.
        let _ = self.model.valid();
        self.write(values, true);
    }

    fn write(&mut self, values: &[f32], buffers: bool) {
        self.model = write_values(self.model.clone(), buffers, values);
    }

    /// Backpropagates `loss` and returns the flat gradient of the trainable parameters.
    pub fn backward(&self, loss: Tensor<1>) -> Vec<f32> {
        let grads = loss.backward();
        let mut r = GradReader {
            path: Path::default(),
            grads: &grads,
            out: Vec::with_capacity(self.layout.params()),
        };
        self.model.visit(&mut r);
        r.out
    }
}

/// The training device: the selected one ([`crate::device::select`], flex by default) with
/// autodiff.
pub fn train_device() -> Device {
    crate::device::selected().autodiff()
}

/// The evaluation device: the selected one, without autodiff.
pub fn eval_device() -> Device {
    crate::device::selected()
}
