//! The submission contract of the task (`docs/task.md`) in Rust: the [`Submission`] trait, the
//! [`Layer`] it works on and its errors; the loaders of the submissions given by path (a shared
//! library through the C ABI of `include/persistent_layer.h`, [`external`]; a Python module,
//! [`python`]); the scanner of the device code a submission loads ([`device_code`]); and the eager
//! reference as a submission ([`EagerSubmission`]).
//!
//! `build_layer` is untimed; `layer_step` is one timed token. Weights and `x` are read-only; the KV
//! cache is the only thing a step writes in place (slot `pos`), besides its own output. The grader
//! checks all of that after the run, so a submission that breaks a rule fails instead of being
//! trusted.

pub mod child;
pub mod device_code;
mod eager;
pub mod external;
pub mod python;

pub use eager::EagerSubmission;

use std::mem::ManuallyDrop;

use cuda::cudarc::driver::{CudaSlice, DevicePtr};
use cuda::{CudaError, Device};
use half::bf16;
use reference::gpu::{DeviceCache, DeviceWeights};
use spec::Config;

/// The layer a submission works on: the weights (read-only) and the cache (written at `pos`). The
/// buffers stay where they are for the whole run, so raw pointers taken in `build_layer` stay valid.
pub struct Layer<'a> {
    pub weights: &'a DeviceWeights,
    pub cache: &'a mut DeviceCache,
}

impl Layer<'_> {
    /// The same layer for a shorter borrow: to hand it to a submission this one wraps.
    pub fn reborrow(&mut self) -> Layer<'_> {
        Layer { weights: self.weights, cache: &mut *self.cache }
    }

    /// A stack's layers, in order: layer `l` of `weights[l]` and `caches[l]`.
    pub fn stack<'a>(weights: &'a [DeviceWeights], caches: &'a mut [DeviceCache]) -> Vec<Layer<'a>> {
        weights.iter().zip(caches).map(|(w, c)| Layer { weights: w, cache: c }).collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SubmissionError {
    #[error("unknown submission '{name}': it is neither a file nor a built-in name (`grader list` names them all)")]
    Unknown { name: String },
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("the submission refused: {0}")]
    Refused(String),
    /// `build_layer` declined a config it does not implement, saying which limit it is over: an
    /// honest answer, judged `unsupported` rather than `crashed`. The C ABI says it with
    /// `PL_ERR_UNSUPPORTED`, a Python module by raising `NotImplementedError`.
    #[error("the submission does not support this config: {0}")]
    Unsupported(String),
    #[error("{0}")]
    NotALibrary(String),
    /// A Python submission's problem, said for a Python user (an exception with its traceback, a
    /// broken contract, an interpreter that cannot be used).
    #[error("{0}")]
    Python(String),
}

/// What a submission implements. All work goes on [`Device::stream`] or streams the grader can see
/// through device-wide synchronisation; every step is timed between two of them.
pub trait Submission {
    /// The name reports show.
    fn name(&self) -> &str;

    /// Untimed: repack, fuse, build tables, allocate.
    fn build_layer(&mut self, dev: &Device, layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError>;

    /// One decoded token at `pos`: `out` (`d` elements, bf16) from `x`, K and V for `pos` appended.
    fn layer_step(
        &mut self,
        dev: &Device,
        layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError>;

    /// Untimed, for a stack of `layers.len()` layers of `cfg`'s shape (`cfg.layers` of them), each
    /// with its own weights and cache, in order. A stack of one is `build_layer`'s layer; a submission
    /// that implements one layer declines deeper stacks as unsupported.
    fn build_stack(&mut self, dev: &Device, layers: &mut [Layer<'_>], cfg: &Config) -> Result<(), SubmissionError> {
        match layers {
            [one] => self.build_layer(dev, one.reborrow(), cfg),
            _ => Err(SubmissionError::Unsupported(format!(
                "a stack of {} layers: this submission implements one layer (build_layer and layer_step)",
                layers.len()
            ))),
        }
    }

    /// One decoded token at `pos` through every layer of the stack: `out` (`d` elements) from `x`, and
    /// row `l` of `hidden` (`(layers - 1, d)`; `None` for one layer) the output of layer `l`, which is
    /// layer `l + 1`'s input; K and V for `pos` appended to every layer's cache. A stack of one is
    /// `layer_step`.
    fn stack_step(
        &mut self,
        dev: &Device,
        layers: &mut [Layer<'_>],
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        match (layers, hidden) {
            ([one], None) => self.layer_step(dev, one.reborrow(), x, pos, out),
            (layers, _) => Err(SubmissionError::Refused(format!(
                "stack_step over {} layers: this submission implements one layer",
                layers.len()
            ))),
        }
    }

    /// Frees what `build_layer` or `build_stack` allocated; dropping the submission does the same.
    fn teardown(&mut self) {}
}

/// Runs `step(l, layer, input, output)` for each layer of a stack in order, as a layer-by-layer
/// `stack_step` does: layer `l` reads `x` (`l = 0`) or row `l - 1` of `hidden`, and writes row `l` of
/// `hidden`, or `out` for the last layer. The rows are views of `hidden`, so nothing is copied.
pub fn walk_stack(
    dev: &Device,
    layers: &mut [Layer<'_>],
    x: &CudaSlice<bf16>,
    hidden: Option<&mut CudaSlice<bf16>>,
    out: &mut CudaSlice<bf16>,
    mut step: impl FnMut(usize, &mut Layer<'_>, &CudaSlice<bf16>, &mut CudaSlice<bf16>) -> Result<(), SubmissionError>,
) -> Result<(), SubmissionError> {
    let (row, last) = (out.len(), layers.len().saturating_sub(1));
    let mut rows: Vec<ManuallyDrop<CudaSlice<bf16>>> = match checked_hidden(layers.len(), row, hidden)? {
        None => Vec::new(),
        Some(h) => {
            let base = device_address(dev, h);
            let view = |l: usize| {
                let at = base + (l * row * size_of::<bf16>()) as u64;
                // SAFETY: row l of `hidden`, a live allocation that outlives this call; the view is never
                // freed (ManuallyDrop), and no two views are used mutably at once.
                ManuallyDrop::new(unsafe { dev.stream().upgrade_device_ptr::<bf16>(at, row) })
            };
            (0..last).map(view).collect()
        }
    };
    for (l, layer) in layers.iter_mut().enumerate() {
        let (before, rest) = rows.split_at_mut(l.min(last));
        let input: &CudaSlice<bf16> = if l == 0 { x } else { &before[l - 1] };
        let output: &mut CudaSlice<bf16> = if l == last { &mut *out } else { &mut rest[0] };
        step(l, layer, input, output)?;
    }
    Ok(())
}

/// The hidden states a step over `layers` layers of rows of `row` elements is given, checked: none for
/// one layer, exactly `(layers - 1) * row` elements for more, since a step writes all of them. Every
/// `stack_step` that hands `hidden` on (to a kernel, a library, a module) checks it with this.
pub fn checked_hidden(
    layers: usize,
    row: usize,
    hidden: Option<&mut CudaSlice<bf16>>,
) -> Result<Option<&mut CudaSlice<bf16>>, SubmissionError> {
    let want = layers.saturating_sub(1) * row;
    match (layers, hidden) {
        (0, _) => Err(SubmissionError::Refused("a step through a stack of no layers".into())),
        (1, None) => Ok(None),
        (2.., Some(h)) if h.len() == want => Ok(Some(h)),
        (_, h) => Err(SubmissionError::Refused(format!(
            "a step through {layers} layer(s) takes hidden states of (layers - 1) x batch x d = {want} elements \
             (none for one layer), not {}",
            h.map_or("none".to_string(), |h| h.len().to_string())
        ))),
    }
}

/// A device buffer's address, for a program table, an ABI call or a tensor handed to Python.
pub fn device_address<T>(dev: &Device, s: &CudaSlice<T>) -> u64 {
    // Event tracking is off on the grader's context, so the guard does nothing and can go at once.
    s.device_ptr(dev.stream()).0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One layer takes no hidden states; a deeper stack must have them, and no stack is empty (the
    /// size check of given states needs a device buffer: the GPU selftests pass them).
    #[test]
    fn hidden_states_are_none_for_one_layer_and_required_for_more() {
        assert!(matches!(checked_hidden(1, 8, None), Ok(None)));
        for layers in [0, 2, 80] {
            let err = checked_hidden(layers, 8, None).unwrap_err().to_string();
            assert!(err.contains(&format!("{layers} layer")) || err.contains("no layers"), "{err}");
        }
    }
}
