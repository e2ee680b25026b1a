//! The submission contract of TASK.md in Rust, and the built-in submissions selected by name.
//!
//! `build_layer` is untimed; `layer_step` is one timed token. Weights and `x` are read-only; the KV
//! cache is the only thing a step writes in place (slot `pos`), besides its own output. The grader
//! checks all of that after the run, so a submission that breaks a rule fails instead of being
//! trusted.

mod eager;
pub mod megakernel;

use cuda::cudarc::driver::CudaSlice;
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

#[derive(Debug, thiserror::Error)]
pub enum SubmissionError {
    #[error("unknown submission '{name}': built-in ones are {known}")]
    Unknown { name: String, known: String },
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("the submission refused: {0}")]
    Refused(String),
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

    /// Frees what `build_layer` allocated; dropping the submission does the same.
    fn teardown(&mut self) {}
}

/// Names of the built-in submissions.
pub const BUILTIN: [&str; 3] = ["reference", "megakernel", "megakernel-phases"];

/// A built-in submission by name.
pub fn builtin(name: &str) -> Result<Box<dyn Submission>, SubmissionError> {
    match name {
        "reference" => Ok(Box::new(eager::EagerSubmission::default())),
        "megakernel" => Ok(Box::new(megakernel::Megakernel::new(megakernel::Mode::Fused))),
        "megakernel-phases" => Ok(Box::new(megakernel::Megakernel::new(megakernel::Mode::PerPhase))),
        _ => Err(SubmissionError::Unknown { name: name.into(), known: BUILTIN.join(", ") }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_list_the_known_ones() {
        let msg = builtin("fastest").err().unwrap().to_string();
        assert!(msg.contains("'fastest'") && msg.contains("reference"), "{msg}");
        assert_eq!(builtin("reference").unwrap().name(), "reference");
    }
}
