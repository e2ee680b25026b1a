//! **phase-aware**: counts its calls; on the last [`WATCHED_TAIL`] calls of the run it runs the
//! megakernel (one kernel), on every other call the eager reference (21 kernels). Both write the same
//! cache slots, so every output is right.
//!
//! The exploit: a grader that profiles only some calls (this one once profiled only the last few)
//! sees a one-kernel submission, while the calls it does not watch run as many kernels as they like.
//! Caught by the kernel count: every call of the run is recorded and the worst one decides ("at most
//! 21 kernels in a call").

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use megakernel::{Megakernel, Mode};
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::CallCount;
use super::honest::{Twist, Twisted, honest_step};

pub const NAME: &str = "phase-aware";

/// The calls at the end of the run that run the megakernel: those the grader used to profile.
const WATCHED_TAIL: usize = 4;

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, PhaseAware { mega: Megakernel::new(Mode::Fused), calls: CallCount::default(), total: 0 })
}

struct PhaseAware {
    mega: Megakernel,
    calls: CallCount,
    /// Calls in the run, from the schedule of the config.
    total: usize,
}

impl Twist for PhaseAware {
    fn build(&mut self, dev: &Device, layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.total = spec::schedule(cfg).len();
        self.mega.build_layer(dev, layer.reborrow(), cfg)
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
        if self.calls.next() + WATCHED_TAIL >= self.total {
            self.mega.layer_step(dev, layer.reborrow(), x, pos, out)
        } else {
            honest_step(eager, dev, layer, x, pos, out)
        }
    }

    fn teardown(&mut self) {
        self.mega.teardown();
    }
}
