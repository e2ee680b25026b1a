//! **device-launch**: the megakernel, honest and fast, plus a one-thread parent kernel every step that
//! launches [`CHILDREN`] child kernels from the device (CUDA dynamic parallelism, `kernels/redteam/redteam_cdp.cu`).
//!
//! The exploit: on Hopper, CUPTI's activity records hold the kernels the host launches, not those a
//! kernel launches, so this step is recorded as two kernels (the megakernel and the parent) while
//! `CHILDREN + 2` run; a submission could split its layer into as many kernels as it likes this way and
//! still pass the kernel count. The children here only count themselves: the point is the launches.
//! Caught by the launch record: the runner scans every module loaded in its process (CUPTI's
//! module-loaded callback hands over each cubin) with [`submission::device_code::scan`], and this one
//! imports the driver's device-side launch (`__cuda_syscall_cnpv2LaunchDeviceV2`).

use crate::kernels::REDTEAM_CDP;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};
use cuda::{Context, Device};
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Extra, WithExtra};
use super::{ONE_THREAD, not_built};

pub const NAME: &str = "device-launch";
/// The parent kernel of `kernels/redteam/redteam_cdp.cu`.
pub const KERNEL: &str = "cdp_parent_launch_u64";

/// Children per step: the twenty-odd kernels of an eager layer, launched by one parent.
pub const CHILDREN: u32 = 20;

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, DeviceLaunch { parent: None })
}

/// The parent kernel and the counter its children add to.
pub(super) struct Parent {
    func: CudaFunction,
    launches: CudaSlice<u64>,
}

impl Parent {
    pub(super) fn new(dev: &Device) -> Result<Self, SubmissionError> {
        let func = dev.function(&REDTEAM_CDP, KERNEL)?;
        let launches = dev.stream().alloc_zeros::<u64>(1).context("allocating the child launch counter")?;
        Ok(Self { func, launches })
    }

    /// One parent on the device's stream, which launches [`CHILDREN`] children.
    pub(super) fn launch(&mut self, dev: &Device) -> Result<(), SubmissionError> {
        let mut args = dev.stream().launch_builder(&self.func);
        args.arg(&mut self.launches).arg(&CHILDREN);
        // SAFETY: cdp_parent_launch_u64(launches: u64*, children: u32), one thread; each child adds one
        // to launches[0], a live one-element allocation.
        unsafe { args.launch(ONE_THREAD) }.context("launching cdp_parent_launch_u64")?;
        Ok(())
    }
}

struct DeviceLaunch {
    parent: Option<Parent>,
}

impl Extra for DeviceLaunch {
    fn build(&mut self, dev: &Device, _layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        self.parent = Some(Parent::new(dev)?);
        Ok(())
    }

    fn after_step(&mut self, dev: &Device) -> Result<(), SubmissionError> {
        self.parent.as_mut().ok_or_else(not_built)?.launch(dev)
    }

    fn teardown(&mut self) {
        self.parent = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parent's children run: after `runs` parents the counter holds `runs * CHILDREN`. On Hopper
    /// none of them is a host launch. `cargo test -p redteam -- --ignored device_launch`.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn children_launched_from_the_device_run() {
        let dev = Device::open(0).expect("no GPU");
        let mut parent = Parent::new(&dev).unwrap();
        let runs = 3;
        for _ in 0..runs {
            parent.launch(&dev).unwrap();
        }
        dev.synchronize().unwrap();
        let launches = dev.stream().clone_dtoh(&parent.launches).unwrap();
        assert_eq!(launches, [u64::from(runs * CHILDREN)]);
    }
}
