//! **int8-down-padded**: **int8-down**, plus a kernel at the end of each step that keeps the GPU busy
//! until the step has lasted as long as the honest bytes would take at [`CEILING_BYTES_PER_S`], a
//! read-only ceiling a little above what an H200 measures (4.45-4.53 TB/s).
//!
//! The exploit: a submission that reads too few bytes could be told by a time under what physics
//! allows for the bytes it should read; padded, its time sits just above that bound. Only the
//! DRAM-traffic audit can tell it from an honest one: bytes_read fails as for int8-down. A first
//! kernel stamps the GPU's clock, the last sleeps until the stamp plus the padded length; where the
//! step's own work takes longer (the eager ops on the H200), the last kernel returns at once.

use crate::kernels::REDTEAM;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::{ByteModel, Config};
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted};
use super::int8::Int8Down;
use super::{ONE_THREAD, not_built};

pub const NAME: &str = "int8-down-padded";
/// The kernels of `kernels/redteam/redteam.cu` that stamp the step's start and pad its end.
pub const STAMP: &str = "record_global_ns_u64";
pub const SPIN: &str = "spin_until_elapsed_u64";

/// The read-only bandwidth the padding is sized for, bytes per second.
pub const CEILING_BYTES_PER_S: f64 = 4.6e12;

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, Padded { int8: Int8Down::default(), pad: None })
}

/// Nanoseconds a step of `cfg` lasts when its byte model streams at [`CEILING_BYTES_PER_S`].
fn padded_ns(cfg: &Config) -> u64 {
    (ByteModel::of(cfg).total as f64 / CEILING_BYTES_PER_S * 1e9).ceil() as u64
}

/// The two kernels and the word the first leaves for the second.
struct Pad {
    stamp: CudaFunction,
    spin: CudaFunction,
    /// `(1)`: the global timer at the step's start.
    start: CudaSlice<u64>,
    step_ns: u64,
}

struct Padded {
    int8: Int8Down,
    pad: Option<Pad>,
}

impl Twist for Padded {
    fn build(&mut self, dev: &Device, layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.int8.build(dev, layer, cfg)?;
        self.pad = Some(Pad {
            stamp: dev.function(&REDTEAM, STAMP)?,
            spin: dev.function(&REDTEAM, SPIN)?,
            start: dev.stream().alloc_zeros::<u64>(1).context("allocating the step's start stamp")?,
            step_ns: padded_ns(cfg),
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
        let pad = self.pad.as_mut().ok_or_else(not_built)?;
        let mut args = dev.stream().launch_builder(&pad.stamp);
        args.arg(&mut pad.start);
        // SAFETY: record_global_ns_u64(start (1)), one thread; start holds one u64.
        unsafe { args.launch(ONE_THREAD) }.context("launching record_global_ns_u64")?;
        self.int8.step(eager, dev, layer, x, pos, out)?;
        let mut args = dev.stream().launch_builder(&pad.spin);
        args.arg(&pad.start).arg(&pad.step_ns);
        // SAFETY: spin_until_elapsed_u64(start (1), duration_ns: u64), one thread; start holds the
        // stamp the first launch of this step wrote on the same stream.
        unsafe { args.launch(ONE_THREAD) }.context("launching spin_until_elapsed_u64")?;
        Ok(())
    }

    fn teardown(&mut self) {
        self.pad = None;
        self.int8.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The graded step is padded to its 1.728 GB at 4.6 TB/s: about 376 us.
    #[test]
    fn graded_steps_are_padded_to_the_ceiling_time() {
        let us = padded_ns(&Config::graded()) as f64 / 1e3;
        assert!((375.0..377.0).contains(&us), "{us} us");
    }
}
