//! **hang**: computes correctly, then launches a kernel that waits for a flag nobody ever sets.
//!
//! The exploit: none; it checks that a submission that never returns cannot stall the grader. Caught
//! by the watchdog: the runner stops reporting progress, the judge kills it, and the run is recorded
//! as timed out. The kernel has a safety exit of its own ([`SAFETY_EXIT_NS`]), so the GPU comes back
//! even if no watchdog acts; the next call then hangs again, so the run as a whole still outlasts
//! any reasonable watchdog (every call costs the full limit).

use crate::kernels::REDTEAM;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::{ONE_THREAD, not_built};

pub const NAME: &str = "hang";
/// The spinning kernel of `kernels/redteam/redteam.cu`.
pub const KERNEL: &str = "spin_until_flag_u32";

/// The kernel gives up after 30 s: long past any step's time (a step takes about a millisecond), so
/// only a watchdog can end the run in time, yet short enough that a GPU is never stuck for long.
pub const SAFETY_EXIT_NS: u64 = 30_000_000_000;

/// The value the kernel waits for: the flag is zero and nothing writes it.
const NEVER_WRITTEN: u32 = 1;

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, Hang { built: None })
}

struct Built {
    spin: CudaFunction,
    /// Zero, and never written.
    flag: CudaSlice<u32>,
}

struct Hang {
    built: Option<Built>,
}

impl Twist for Hang {
    fn build(&mut self, dev: &Device, _layer: &mut Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        let spin = dev.function(&REDTEAM, KERNEL)?;
        let flag = dev.stream().alloc_zeros::<u32>(1).context("allocating the flag")?;
        self.built = Some(Built { spin, flag });
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
        let b = self.built.as_ref().ok_or_else(not_built)?;
        honest_step(eager, dev, layer, x, pos, out)?;
        let mut args = dev.stream().launch_builder(&b.spin);
        args.arg(&b.flag).arg(&NEVER_WRITTEN).arg(&SAFETY_EXIT_NS);
        // SAFETY: spin_until_flag_u32(flag (1), value: u32, limit_ns: u64), one thread; it only reads
        // the flag.
        unsafe { args.launch(ONE_THREAD) }.context("launching spin_until_flag_u32")?;
        Ok(())
    }

    fn teardown(&mut self) {
        self.built = None;
    }
}
