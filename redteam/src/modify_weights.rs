//! **modify-weights**: computes correctly, and on its first call flips the lowest bit of one element
//! of `w.o`, through its raw device address (the contract hands weights out read-only).
//!
//! The exploit: weights rewritten in place (repacked, pre-scaled, quantised) between calls, saving
//! the copy a private layout would cost. Caught by correctness: the grader compares every weight with
//! a pristine copy after the run ("weights were modified").

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::raw::nudge_in_place;

pub const NAME: &str = "modify-weights";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, ModifyWeights { done: false })
}

struct ModifyWeights {
    /// Once only: flipping the bit twice would restore it.
    done: bool,
}

impl Twist for ModifyWeights {
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
        if !self.done {
            // SAFETY: the grader reads the weights only between steps, after synchronising; the
            // write is synchronous (nudge_in_place waits for it).
            unsafe { nudge_in_place(dev, &layer.weights.o, 0) }?;
            self.done = true;
        }
        Ok(())
    }
}
