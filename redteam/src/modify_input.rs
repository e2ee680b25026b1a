//! **modify-input**: computes correctly, then flips the lowest bit of `x[0]` through its raw device
//! address (the contract hands `x` out read-only).
//!
//! The exploit: using the input buffer as scratch (for the residual stream, say) saves an allocation
//! and some traffic, and the step's own output is still right. Caught by correctness: the grader
//! compares every input with its own copy after the run ("input x buffer(s) were modified").

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::raw::nudge_in_place;

pub const NAME: &str = "modify-input";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, ModifyInput)
}

struct ModifyInput;

impl Twist for ModifyInput {
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
        // SAFETY: every call gets a fresh x that the grader reads only after synchronising; the
        // write is synchronous (nudge_in_place waits for it), and each x is nudged once.
        unsafe { nudge_in_place(dev, x, 0) }
    }
}
