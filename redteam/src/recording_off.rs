//! **recording-off**: the eager reference, with CUPTI's kernel records switched off
//! (`cuptiActivityDisable(CONCURRENT_KERNEL)`) just after each step's first launch and on again before
//! the step returns ([`recording`](super::recording)).
//!
//! The exploit: the kernel count and the dominant share come from CUPTI's records, so a step whose
//! records are off for all but one launch looks like a one-kernel step however many it runs (here
//! 21). Caught by the launch record: the callback view, which a submission cannot switch off for
//! good (the runner subscribes before loading it and checks the subscription after every command),
//! still sees the 20 hidden launches, and a launch with no GPU record fails the gate ("left no GPU
//! record"). The one recorded kernel covers little of the call's time either.

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted};
use super::recording;

pub const NAME: &str = "recording-off";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, RecordingOff)
}

struct RecordingOff;

impl Twist for RecordingOff {
    fn build(&mut self, _dev: &Device, _layer: &mut Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        recording::require_cupti()
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
        recording::step_mostly_hidden(eager, dev, layer, x, pos, out, || Ok(()))
    }
}
