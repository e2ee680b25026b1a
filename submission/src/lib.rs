//! The submission contract of TASK.md in Rust, and the built-in submissions selected by name.
//!
//! `build_layer` is untimed; `layer_step` is one timed token. Weights and `x` are read-only; the KV
//! cache is the only thing a step writes in place (slot `pos`), besides its own output. The grader
//! checks all of that after the run, so a submission that breaks a rule fails instead of being
//! trusted.

pub mod device_code;
mod eager;
pub mod external;
pub mod megakernel;
pub mod redteam;

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

impl Layer<'_> {
    /// The same layer for a shorter borrow: to hand it to a submission this one wraps.
    pub fn reborrow(&mut self) -> Layer<'_> {
        Layer { weights: self.weights, cache: &mut *self.cache }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SubmissionError {
    #[error(
        "unknown submission '{name}': built-in ones are {known} (the red team's are in submission/src/redteam); a library is given by its path"
    )]
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

/// A submission by what `--submission` says: a built-in name, a red-team adversary, or the path of
/// a shared library speaking the C ABI of `include/persistent_layer.h`.
pub fn load(name_or_path: &str) -> Result<Box<dyn Submission>, SubmissionError> {
    if is_library(name_or_path) { external::load(std::path::Path::new(name_or_path)) } else { builtin(name_or_path) }
}

/// Refuses, with the list of built-in names, what [`load`] could never load; a library path is
/// checked when it is loaded.
pub fn check_name(name_or_path: &str) -> Result<(), SubmissionError> {
    if is_library(name_or_path) || BUILTIN.contains(&name_or_path) || redteam::find(name_or_path).is_some() {
        Ok(())
    } else {
        Err(SubmissionError::Unknown { name: name_or_path.into(), known: BUILTIN.join(", ") })
    }
}

/// A path names a library: it has a folder in it or the shared-library suffix.
fn is_library(name_or_path: &str) -> bool {
    name_or_path.ends_with(".so") || name_or_path.contains('/')
}

/// A built-in submission, or a red-team adversary, by name.
pub fn builtin(name: &str) -> Result<Box<dyn Submission>, SubmissionError> {
    match name {
        "reference" => Ok(Box::new(eager::EagerSubmission::default())),
        "megakernel" => Ok(Box::new(megakernel::Megakernel::new(megakernel::Mode::Fused))),
        "megakernel-phases" => Ok(Box::new(megakernel::Megakernel::new(megakernel::Mode::PerPhase))),
        _ => match redteam::find(name) {
            Some(adversary) => Ok((adversary.make)()),
            None => Err(SubmissionError::Unknown { name: name.into(), known: BUILTIN.join(", ") }),
        },
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
