//! **pass-through**: `out = x`, one device-to-device copy, no layer at all.
//!
//! The exploit: a residual layer's output is close to its input, so a lazy check (or a loose
//! tolerance) might accept the input itself. Caught by correctness: the data makes the layer's
//! contribution large (the selftest requires a pass-through to miss the tolerance by a margin), so
//! every step is over the tolerance; the cache is never written either.

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use spec::Config;

use submission::{Layer, Submission, SubmissionError};

pub const NAME: &str = "pass-through";

pub fn make() -> Box<dyn Submission> {
    Box::new(PassThrough)
}

struct PassThrough;

impl Submission for PassThrough {
    fn name(&self) -> &str {
        NAME
    }

    fn build_layer(&mut self, _dev: &Device, _layer: Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        Ok(())
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        _layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        _pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        dev.stream().memcpy_dtod(x, out).context("copying x to out")?;
        Ok(())
    }
}
