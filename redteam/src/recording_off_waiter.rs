//! **recording-off-waiter**: recording-off, plus a one-thread "waiter" kernel launched at the start of
//! each step, while the records are still on, on a stream of its own. It spins until a flag holds the
//! step's epoch, which a one-thread store launched after the hidden kernels (and hidden with them)
//! writes; the device's stream then waits for the waiter's stream, so the step ends with both.
//!
//! The exploit: recording-off leaves most of each call's time outside any recorded kernel, which the
//! coverage check sees; here the recorded waiter runs alongside the hidden work for the whole step,
//! so the record shows two kernels (the waiter and the step's first launch), the waiter's share near
//! 1, and GPU work covering the call's time. Caught by the launch record all the same: the callback
//! view still sees the hidden launches, which left no GPU record ("left no GPU record"); the
//! hardware's count of thread blocks also exceeds the recorded kernels'.
//!
//! The waiter is hang's spin kernel and the store crash's (`kernels/redteam/redteam.cu`), given a flag and
//! an epoch that grows by one per step, so the flag never needs resetting.

use std::sync::Arc;

use crate::kernels::REDTEAM;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaStream, PushKernelArg};
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted};
use super::{ONE_THREAD, crash, hang, not_built, recording};

pub const NAME: &str = "recording-off-waiter";

/// The waiter's safety exit: 100 ms is over 100 times an eager step at the graded size (0.6 ms), and
/// a waiter left without its store (should switching the records synchronise the device, say) costs
/// the run only seconds.
const WAITER_LIMIT_NS: u64 = 100_000_000;

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, RecordingOffWaiter { built: None })
}

struct Built {
    wait: CudaFunction,
    store: CudaFunction,
    /// The waiter's stream: non-blocking, so it runs beside the device's stream.
    side: Arc<CudaStream>,
    /// `(1)`: the epoch of the last step whose hidden kernels have all run.
    flag: CudaSlice<u32>,
    /// The current step's epoch; the flag starts at 0, the first step's epoch is 1.
    epoch: u32,
}

struct RecordingOffWaiter {
    built: Option<Built>,
}

impl Twist for RecordingOffWaiter {
    fn build(&mut self, dev: &Device, _layer: &mut Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        recording::require_cupti()?;
        self.built = Some(Built {
            wait: dev.function(&REDTEAM, hang::KERNEL)?,
            store: dev.function(&REDTEAM, crash::KERNEL)?,
            side: dev.ctx().new_stream().context("creating the waiter's stream")?,
            flag: dev.stream().alloc_zeros::<u32>(1).context("allocating the waiter's flag")?,
            epoch: 0,
        });
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
        let b = self.built.as_mut().ok_or_else(not_built)?;
        b.epoch = b.epoch.wrapping_add(1);
        let epoch = b.epoch;
        let mut args = b.side.launch_builder(&b.wait);
        args.arg(&b.flag).arg(&epoch).arg(&WAITER_LIMIT_NS);
        // SAFETY: spin_until_flag_u32(flag (1), value: u32, limit_ns: u64), one thread; it only reads
        // flag, a live one-element allocation.
        unsafe { args.launch(ONE_THREAD) }.context("launching the waiter")?;
        recording::step_mostly_hidden(eager, dev, layer, x, pos, out, || {
            let mut args = dev.stream().launch_builder(&b.store);
            args.arg(&mut b.flag).arg(&epoch);
            // SAFETY: store_to_address_u32(target: u32*, value: u32), one thread; target is flag, a
            // live one-element allocation.
            unsafe { args.launch(ONE_THREAD) }.context("launching the waiter's store")?;
            Ok(())
        })?;
        dev.stream().join(&b.side).context("joining the waiter's stream")?;
        Ok(())
    }

    fn teardown(&mut self) {
        if let Some(b) = self.built.take() {
            // Teardown cannot fail: a failed wait leaves the flag to be freed in stream order.
            let _ = b.side.synchronize();
        }
    }
}
