//! **crash**: computes correctly, then launches a kernel that stores to an unmapped address (just
//! above the null pointer).
//!
//! The exploit: none; it checks that a submission that faults the GPU cannot take the grader down
//! with it or leave a verdict behind. Caught by the process boundary: the fault surfaces as
//! CUDA_ERROR_ILLEGAL_ADDRESS at the runner's next synchronisation, the context is lost, the runner
//! reports the error and exits, and the judge records the run as crashed.

use crate::kernels::REDTEAM;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::{ONE_THREAD, not_built};

pub const NAME: &str = "crash";
/// The faulting kernel of `kernels/redteam/redteam.cu`.
pub const KERNEL: &str = "store_to_address_u32";

/// Where the store goes: inside the never-mapped page at address 0, aligned for a u32.
const UNMAPPED_ADDRESS: u64 = 16;

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, Crash { store: None })
}

struct Crash {
    store: Option<CudaFunction>,
}

impl Twist for Crash {
    fn build(&mut self, dev: &Device, _layer: &mut Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        self.store = Some(dev.function(&REDTEAM, KERNEL)?);
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
        let store = self.store.as_ref().ok_or_else(not_built)?;
        honest_step(eager, dev, layer, x, pos, out)?;
        let value = 0xdead_beef_u32;
        let mut args = dev.stream().launch_builder(store);
        args.arg(&UNMAPPED_ADDRESS).arg(&value);
        // SAFETY: store_to_address_u32(target: u32*, value: u32), one thread. The store faults on
        // purpose: it reaches no memory of this process, and the fault kills only this context.
        unsafe { args.launch(ONE_THREAD) }.context("launching store_to_address_u32")?;
        Ok(())
    }

    fn teardown(&mut self) {
        self.store = None;
    }
}
