//! **abort**: computes correctly, and on its third call aborts the whole process.
//!
//! The exploit: none; it checks that the grader survives a submission that takes its process down
//! mid-run (a panic across FFI, an assertion in a library) and reports it. Caught by the process
//! boundary: the runner dies of SIGABRT and the judge records the run as crashed.

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use submission::{Layer, Submission, SubmissionError};

use super::CallCount;
use super::honest::{Twist, Twisted, honest_step};

pub const NAME: &str = "abort";

/// The call (from 0) that aborts: the third, so the run is well under way.
const ABORT_AT_CALL: usize = 2;

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, Abort { calls: CallCount::default() })
}

struct Abort {
    calls: CallCount,
}

impl Twist for Abort {
    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        if self.calls.next() == ABORT_AT_CALL {
            std::process::abort();
        }
        honest_step(eager, dev, layer, x, pos, out)
    }
}
