//! Python submissions: a module with the task's contract as `docs/task.md` states it in Python,
//! judged like any other submission.
//!
//! ```python
//! def build_layer(weights, kv_cache, cfg, max_seq_len) -> handle   # untimed
//! def layer_step(handle, x, pos) -> x_out                          # timed
//! def teardown(handle)                                             # optional
//! ```
//!
//! A stack of `L` layers (`build_stack`) is the same contract carrying every layer: `build_layer`
//! gets `weights = {"layers": [...]}` with `L` dicts, `kv_cache` with `L` pairs and `cfg["layers"] =
//! L`, and for `L > 1` each step is `layer_step(handle, x, pos, hidden)`, where `hidden`, `(L - 1,
//! batch, d)` bf16, is filled in place (row `l` the output of layer `l`, the input of layer `l + 1`)
//! and `x_out` is the last layer's output. One layer is called exactly as the contract states it,
//! without `hidden`, so modules written for one layer keep working.
//!
//! `build_layer` declines a config it does not implement by raising `NotImplementedError` with the
//! limit in its text (`raise NotImplementedError(f"hd = {cfg['hd']} is over this kernel's 128")`):
//! the run ends `unsupported`, quoting that text. Any other exception, and `NotImplementedError`
//! from `layer_step`, ends it `crashed`.
//!
//! The runner stays the Rust `grader runner`: it embeds the interpreter the judge chose and probed
//! ([`probe`]), by opening its shared libpython at run time ([`ffi`]), and runs the module through a
//! small Python shim ([`shim`]). The submission's tensors alias the runner's device buffers through
//! DLPack ([`dlpack`]), so everything the runner measures (the CUPTI record, the DRAM audit, the
//! sandbox, the judge's clock) measures a Python submission exactly as a native one.
//!
//! A step's window ends when all its work is done: after the Python call returns, the device is
//! synchronised (work left on a side stream included), and the runner copies `x_out` into the
//! judge's output buffer itself, under the runner's tag in the launch record (so the copy is never
//! counted as the submission's). A bf16 `x_out` is copied on the device; an fp32 one is rounded to
//! bf16 on the way through the host, because the judge's output buffer is also the next call's
//! `x` in the back-to-back phase, which the contract makes bf16 (the comparison is then in fp32,
//! against the reference's bf16 output, as for every submission).

mod dlpack;
mod ffi;
pub mod probe;
mod shim;

use std::path::Path;

use cuda::cudarc::driver::{CudaSlice, result as driver};
use cuda::{Context, Device};
use half::bf16;
use spec::{Config, Tensor};

pub use probe::{PythonInfo, interpreter, is_python_module, probe};
pub use shim::{BuildError, DeviceTensor, Dtype, Output, Shim};

use crate::{Layer, Submission, SubmissionError, device_address};

/// Runs the runner's own work inside a step (the copy of `x_out`) so that the launch record
/// attributes it to the runner, not to the submission (the grader passes its CUPTI tagging).
pub type RunnerScope = fn(&mut dyn FnMut() -> Result<(), SubmissionError>) -> Result<(), SubmissionError>;

/// A Python module speaking the contract, in the embedded interpreter.
pub struct PythonSubmission {
    name: String,
    shim: Shim,
    runner_scope: RunnerScope,
    /// What was built: `(layers, batch, d)`.
    built: Option<(usize, usize, usize)>,
    /// Host staging of an fp32 `x_out` and its bf16 rounding, `batch * d` each: sized in
    /// `build_layer`, so a timed step allocates nothing.
    staging: (Vec<f32>, Vec<bf16>),
}

/// Loads the module `info` was probed for, on CUDA device `ordinal`: torch and the module are
/// imported now (run this where `build_layer` may run: imports may start processes).
pub fn load(
    info: &PythonInfo,
    ordinal: usize,
    runner_scope: RunnerScope,
) -> Result<Box<dyn Submission>, SubmissionError> {
    let shim = Shim::load(info, ordinal).map_err(SubmissionError::Python)?;
    let name = display_name(&info.module);
    Ok(Box::new(PythonSubmission { name, shim, runner_scope, built: None, staging: (Vec::new(), Vec::new()) }))
}

impl PythonSubmission {
    /// Copies the checked output at `from` into `out` (bf16), converting an fp32 one through
    /// `staging` (sized for `out`).
    fn copy_out(
        dev: &Device,
        from: Output,
        out: &mut CudaSlice<bf16>,
        staging: &mut (Vec<f32>, Vec<bf16>),
    ) -> Result<(), SubmissionError> {
        let stream = dev.stream();
        match from.dtype {
            Dtype::Bf16 => {
                let to = device_address(dev, out);
                // SAFETY: `from` holds `out.len()` bf16 (the shim checked its shape, dtype, device
                // and contiguity, and keeps the tensor alive until the next step); `out` is the
                // judge's buffer of that size; both are device memory of this context.
                unsafe {
                    driver::memcpy_dtod_async(to, from.address, out.len() * size_of::<bf16>(), stream.cu_stream())
                }
                .context("copying x_out into the judge's output buffer")?;
            }
            Dtype::F32 => {
                let (host, rounded) = staging;
                if host.len() != out.len() {
                    return Err(SubmissionError::Refused("layer_step's output is not the size build_layer had".into()));
                }
                // SAFETY: `from` holds `out.len()` f32, checked and kept alive by the shim; `host`
                // has room for exactly that many.
                unsafe { driver::memcpy_dtoh_sync(host, from.address) }.context("reading an fp32 x_out")?;
                rounded.iter_mut().zip(host.iter()).for_each(|(r, &v)| *r = bf16::from_f32(v));
                stream.memcpy_htod(rounded, out).context("writing x_out into the judge's output buffer")?;
            }
        }
        // No synchronisation here: the caller synchronises the device after every step, as for
        // every submission, and the copy's source stays alive until the next step.
        Ok(())
    }

    /// One step through the `layers` built: `hidden` is `None` for one layer, else the stack's hidden
    /// states, which the module fills.
    fn step(
        &mut self,
        dev: &Device,
        layers: usize,
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let refused = SubmissionError::Refused;
        let (built, batch, d) = self.built.ok_or_else(|| refused("layer_step before build_layer".into()))?;
        if layers != built {
            return Err(refused(format!("a step through {layers} layers; build_layer was given {built}")));
        }
        // The module writes `hidden` in full through a tensor of this shape, so its size is checked.
        let hidden = crate::checked_hidden(layers, batch * d, hidden)?.map(|h| (device_address(dev, h), layers - 1));
        let output = self.shim.step(device_address(dev, x), pos, batch, d, hidden).map_err(SubmissionError::Python)?;
        // All of the step's work, on whatever stream, is done before its output is read.
        dev.synchronize()?;
        let staging = &mut self.staging;
        (self.runner_scope)(&mut || Self::copy_out(dev, output, out, staging))
    }
}

impl Submission for PythonSubmission {
    fn name(&self) -> &str {
        &self.name
    }

    fn build_layer(&mut self, dev: &Device, layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.build_stack(dev, &mut [layer], cfg)
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        // The cache was handed over in build_layer as tensors; the module writes it through them.
        _layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        self.step(dev, 1, x, pos, None, out)
    }

    /// Every layer's tensors to the one `build_layer` of the module, in order.
    fn build_stack(&mut self, dev: &Device, layers: &mut [Layer<'_>], cfg: &Config) -> Result<(), SubmissionError> {
        if layers.is_empty() {
            return Err(SubmissionError::Refused("a stack of no layers".into()));
        }
        self.teardown();
        let tensors = |layer: &Layer<'_>| {
            let weights = Tensor::WEIGHTS.iter().map(|&t| (t, layer.weights.get(t)));
            let cache = [(Tensor::KCache, &layer.cache.k), (Tensor::VCache, &layer.cache.v)];
            weights
                .chain(cache)
                .map(|(t, buffer)| DeviceTensor {
                    name: t.name(),
                    address: device_address(dev, buffer),
                    shape: t.shape(cfg),
                })
                .collect::<Vec<_>>()
        };
        let tensors: Vec<_> = layers.iter().map(tensors).collect();
        dev.ctx().bind_to_thread().context("making the grader's context current for the submission")?;
        // `NotImplementedError` declines the config (unsupported); anything else is the module failing.
        self.shim.build(cfg, &tensors)?;
        self.built = Some((layers.len(), cfg.batch, cfg.d));
        self.staging = (vec![0.0; cfg.batch * cfg.d], vec![bf16::ZERO; cfg.batch * cfg.d]);
        Ok(())
    }

    fn stack_step(
        &mut self,
        dev: &Device,
        // The caches were handed over in build_stack as tensors; the module writes them through them.
        layers: &mut [Layer<'_>],
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        self.step(dev, layers.len(), x, pos, hidden, out)
    }

    fn teardown(&mut self) {
        if self.built.take().is_some()
            && let Err(e) = self.shim.teardown()
        {
            // Teardown is optional in the contract and its failure changes no verdict; say it.
            eprintln!("{}: {e}", self.name);
        }
    }
}

impl Drop for PythonSubmission {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// The submission's file name, for messages before it is loaded.
pub fn display_name(module: &Path) -> String {
    module.file_name().map_or_else(|| module.display().to_string(), |n| n.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests;
