//! **corrupt-prefix**: computes correctly, and on its first call flips the lowest bit of one element
//! of the cached prefix (K, head 0, slot 0), a change far too small to move any output.
//!
//! The exploit: a submission that repacks or quantises the cache in place, or uses the prefix as
//! scratch, can leave it subtly different while every output stays within tolerance. Caught by
//! correctness: the grader compares the prefix bitwise with the generated one ("prefix were
//! modified").

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::raw::{nudged, read_one};

pub const NAME: &str = "corrupt-prefix";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, CorruptPrefix { done: false })
}

struct CorruptPrefix {
    /// Once only: flipping the bit twice would restore it.
    done: bool,
}

impl Twist for CorruptPrefix {
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
            let k = &mut layer.cache.k;
            let value = nudged(read_one(dev, k, 0)?);
            dev.stream().memcpy_htod(&[value], &mut k.slice_mut(0..1)).context("writing into the prefix")?;
            self.done = true;
        }
        Ok(())
    }
}
