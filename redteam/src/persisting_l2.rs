//! **persisting-l2**: the megakernel, plus, in `build_layer`, the largest persisting-L2 set-aside the
//! device allows (`CU_LIMIT_PERSISTING_L2_CACHE_SIZE`) and an access-policy window (hit ratio 1,
//! persisting) over the first part of `w_o` on the stream the megakernel launches on: the device's.
//! `w_o` is the first matrix the megakernel streams from the grader's buffers; the QKV and gate/up
//! matrices it streams are packed copies of its own.
//!
//! The exploit: in a real model the other layers evict this layer's weights from L2 between two of
//! its tokens; pinning tens of megabytes of them there makes every step read that much less from
//! DRAM, which no single-layer benchmark should credit. Caught by L2 hygiene: the runner requires
//! the persisting limit to be 0 around every call, and the l2_persisting gate names it. Nothing is
//! undone at teardown: the set-aside and the window belong to the runner's context and end with it.

use cuda::cudarc::driver::sys::{
    self, CUaccessPolicyWindow, CUaccessProperty, CUdevice_attribute, CUlimit, CUstreamAttrID, CUstreamAttrValue,
};
use cuda::cudarc::driver::{CudaSlice, DevicePtr};
use cuda::{Context, CudaError, Device};
use half::bf16;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Extra, WithExtra};

pub const NAME: &str = "persisting-l2";

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, PersistingL2)
}

struct PersistingL2;

/// Attaches `window` to the device's stream: every kernel launched there from now on applies it.
fn set_window(dev: &Device, window: CUaccessPolicyWindow) -> Result<(), CudaError> {
    let value = CUstreamAttrValue { accessPolicyWindow: window };
    dev.ctx().bind_to_thread().context("binding the context")?;
    // SAFETY: the device's stream is live for the device's lifetime, and the value is a whole
    // CUstreamAttrValue whose accessPolicyWindow member is the one this attribute reads.
    unsafe {
        sys::cuStreamSetAttribute(
            dev.stream().cu_stream(),
            CUstreamAttrID::CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW,
            &value,
        )
    }
    .result()
    .context("setting an access-policy window on the device's stream")
}

impl Extra for PersistingL2 {
    fn build(&mut self, dev: &Device, layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        let attr = |a: CUdevice_attribute| -> Result<usize, CudaError> {
            let v = dev.ctx().attribute(a).context(format!("reading {a:?}"))?;
            Ok(usize::try_from(v).unwrap_or(0))
        };
        let set_aside = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)?;
        let max_window = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE)?;
        if set_aside == 0 || max_window == 0 {
            return Err(SubmissionError::Refused("this device offers no persisting L2 to pin weights in".into()));
        }
        let o: &CudaSlice<bf16> = &layer.weights.o;
        let base = o.device_ptr(dev.stream()).0;
        // As much of w_o as the set-aside holds, so that a hit ratio of 1 does not thrash it.
        let num_bytes = set_aside.min(max_window).min(o.len() * size_of::<bf16>());
        let limit = CUlimit::CU_LIMIT_PERSISTING_L2_CACHE_SIZE;
        dev.ctx().set_limit(limit, set_aside).context("setting the persisting-L2 limit")?;
        set_window(
            dev,
            CUaccessPolicyWindow {
                base_ptr: base as *mut std::ffi::c_void,
                num_bytes,
                hitRatio: 1.0,
                hitProp: CUaccessProperty::CU_ACCESS_PROPERTY_PERSISTING,
                missProp: CUaccessProperty::CU_ACCESS_PROPERTY_STREAMING,
            },
        )?;
        Ok(())
    }
}
