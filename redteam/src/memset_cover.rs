//! **memset-cover**: the megakernel, plus [`device_launch`](super::device_launch)'s parent kernel
//! (its children, one block each, escape CUPTI's record on Hopper) and [`SETS`] one-byte memsets
//! every step.
//!
//! The exploit: the launch record compares the thread blocks the hardware ran in a call with those of
//! the recorded kernels, and the driver runs copies and sets as blocks of its own, so each copy or set
//! brings an allowance. When that allowance was 4096 blocks whatever the size, one cheap memset
//! covered a hidden layer's kernels. Caught by the launch record: a set's allowance follows its bytes
//! (3 blocks for one byte), far short of the children's blocks. (The module scan refuses the parent
//! too; this one checks the count on its own.)

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::device_launch::Parent;
use super::honest::{Extra, WithExtra};
use super::not_built;

pub const NAME: &str = "memset-cover";

/// One-byte memsets per step: under the old rule, 2 x 4096 blocks of cover; under the size rule, 6.
pub const SETS: usize = 2;

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, MemsetCover { built: None })
}

struct MemsetCover {
    built: Option<(Parent, CudaSlice<u8>)>,
}

impl Extra for MemsetCover {
    fn build(&mut self, dev: &Device, _layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        let byte = dev.stream().alloc_zeros::<u8>(1).context("allocating the byte the sets clear")?;
        self.built = Some((Parent::new(dev)?, byte));
        Ok(())
    }

    fn after_step(&mut self, dev: &Device) -> Result<(), SubmissionError> {
        let (parent, byte) = self.built.as_mut().ok_or_else(not_built)?;
        parent.launch(dev)?;
        for _ in 0..SETS {
            dev.stream().memset_zeros(byte).context("clearing one byte")?;
        }
        Ok(())
    }

    fn teardown(&mut self) {
        self.built = None;
    }
}
