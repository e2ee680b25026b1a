//! **nan-output**: computes correctly, then writes a NaN into `out[0]`.
//!
//! The exploit: a relative error computed naively is NaN, and NaN compares false with everything, so
//! `err > tol` is false and a broken output passes. Caught by correctness: the grader treats any NaN
//! or Inf in an output as a failure of its own ("returned NaN or Inf").

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};

pub const NAME: &str = "nan-output";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, NanOutput)
}

struct NanOutput;

impl Twist for NanOutput {
    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        honest_step(eager, dev, layer, x, pos, out)?;
        dev.stream().memcpy_htod(&[bf16::NAN], &mut out.slice_mut(0..1)).context("writing a NaN")?;
        Ok(())
    }
}
