//! **audit-off**: int8-down (reads about 0.87 of the byte model), which also stops the audit from
//! inside its process in `build_layer`: it tears CUPTI's profiler interface down
//! (`cuptiProfilerDeInitialize`, which ends the runner's range profiler), then tries to take the
//! device's performance monitors for itself (`cuptiPmSamplingEnable`).
//!
//! The exploit: when the DRAM audit lived in the runner's process, stopping it left the run
//! `PASS (unaudited)`, and a lossy submission met only the correctness gate. Caught by the judge's
//! own audit: PM sampling in the judge's process, started before the submission was loaded, holds
//! the device's monitors (the grab fails) and counts every call's DRAM bytes whatever the runner's
//! process does, so bytes_read fails as for int8-down.

use std::ptr::null_mut;

use cuda::Device;
use cuda::cudarc::cupti::sys;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted};
use super::int8::Int8Down;
use super::recording;

pub const NAME: &str = "audit-off";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, AuditOff(Int8Down::default()))
}

struct AuditOff(Int8Down);

impl Twist for AuditOff {
    fn build(&mut self, dev: &Device, layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.0.build(dev, layer, cfg)?;
        recording::require_cupti()?;
        let mut deinit = sys::CUpti_Profiler_DeInitialize_Params {
            structSize: sys::Profiler_DeInitialize_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
        };
        // SAFETY: a complete params struct; libcupti is present (require_cupti). Whatever it returns
        // is what the exploit gets.
        let _ = unsafe { sys::cuptiProfilerDeInitialize(&mut deinit) };
        let mut grab = sys::CUpti_PmSampling_Enable_Params {
            structSize: sys::PmSampling_Enable_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            deviceIndex: dev.facts().ordinal,
            pPmSamplingObject: null_mut(),
        };
        // SAFETY: as above; a failure (the judge holds the monitors) is ignored.
        let _ = unsafe { sys::cuptiPmSamplingEnable(&mut grab) };
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
        self.0.step(eager, dev, layer, x, pos, out)
    }

    fn teardown(&mut self) {
        self.0.teardown();
    }
}
