//! **no-kv-write**: computes the step correctly, then puts cache slot `pos` back as it was before the
//! step, as if the append had never happened.
//!
//! The exploit: a submission that keeps K and V in private memory and never writes the shared cache
//! (or skips the append to save a few writes) still returns the right output for the step. Caught by
//! correctness: the grader compares the slots the calls write with the reference's after the run,
//! and these hold zeros ("the appended K/V rows differ"); later steps also attend over a missing row.

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::not_built;
use super::raw::SlotRows;

pub const NAME: &str = "no-kv-write";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, NoKvWrite { saved: None })
}

struct NoKvWrite {
    saved: Option<SlotRows>,
}

impl Twist for NoKvWrite {
    fn build(&mut self, dev: &Device, _layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.saved = Some(SlotRows::new(dev, cfg)?);
        Ok(())
    }

    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let saved = self.saved.as_mut().ok_or_else(not_built)?;
        saved.save(dev, layer.cache, pos)?;
        honest_step(eager, dev, layer, x, pos, out)?;
        saved.restore(dev, layer.cache, pos)
    }

    fn teardown(&mut self) {
        self.saved = None;
    }
}
