//! The host side of CUPTI's profilers (cupti_profiler_host.h), the range profiler's and PM
//! sampling's: turning metric names into a config image for a chip, counting the passes it needs,
//! and evaluating decoded counter data (a range, or a sample) into metric values. None of it touches a GPU, so it also runs (and is tested) on a machine without
//! one, given libcupti and libnvperf_host.

use std::ffi::CString;
use std::ptr::{NonNull, null, null_mut};

use cuda::cudarc::cupti::sys;

use super::image::Image;
use super::names::Metrics;
use super::{AuditError, call};

/// A profiler host object for one chip. The chip name and counter availability image it was made
/// from live as long as it does (the header does not say whether CUPTI keeps pointers to them).
pub(super) struct Host {
    object: NonNull<sys::CUpti_Profiler_Host_Object>,
    _chip: CString,
    _availability: Option<Image>,
}

impl Host {
    /// A host object for profiling of `kind` on `chip`; `availability` filters out counters the
    /// device cannot collect (optional for chips this CUPTI release knows).
    pub fn new(kind: sys::CUpti_ProfilerType, chip: CString, availability: Option<Image>) -> Result<Host, AuditError> {
        let mut p = sys::CUpti_Profiler_Host_Initialize_Params {
            structSize: sys::Profiler_Host_Initialize_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            profilerType: kind,
            pChipName: chip.as_ptr(),
            pCounterAvailabilityImage: availability.as_ref().map_or(null(), Image::as_ptr),
            pHostObject: null_mut(),
        };
        // SAFETY: a complete params struct with its header size; the chip name and the image are
        // live and stay so in the returned Host.
        unsafe { call("cuptiProfilerHostInitialize", sys::cuptiProfilerHostInitialize, &mut p) }?;
        let object = NonNull::new(p.pHostObject)
            .ok_or_else(|| AuditError::Decoded("cuptiProfilerHostInitialize returned no host object".into()))?;
        Ok(Host { object, _chip: chip, _availability: availability })
    }

    /// The config image that schedules `metrics`, and the number of passes it needs.
    pub fn config(&self, metrics: &Metrics) -> Result<(Image, usize), AuditError> {
        let mut add = sys::CUpti_Profiler_Host_ConfigAddMetrics_Params {
            structSize: sys::Profiler_Host_ConfigAddMetrics_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pHostObject: self.object.as_ptr(),
            ppMetricNames: metrics.as_ptrs(),
            numMetrics: metrics.len(),
        };
        // SAFETY: a complete params struct; the name array lives in `metrics` (read only).
        unsafe { call("cuptiProfilerHostConfigAddMetrics", sys::cuptiProfilerHostConfigAddMetrics, &mut add) }?;
        let mut size = sys::CUpti_Profiler_Host_GetConfigImageSize_Params {
            structSize: sys::Profiler_Host_GetConfigImageSize_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pHostObject: self.object.as_ptr(),
            configImageSize: 0,
        };
        // SAFETY: a complete params struct on a live host object.
        unsafe { call("cuptiProfilerHostGetConfigImageSize", sys::cuptiProfilerHostGetConfigImageSize, &mut size) }?;
        let mut image = Image::zeroed(size.configImageSize);
        let mut get = sys::CUpti_Profiler_Host_GetConfigImage_Params {
            structSize: sys::Profiler_Host_GetConfigImage_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pHostObject: self.object.as_ptr(),
            configImageSize: image.len(),
            pConfigImage: image.as_mut_ptr(),
        };
        // SAFETY: the image holds the `configImageSize` bytes CUPTI asked for.
        unsafe { call("cuptiProfilerHostGetConfigImage", sys::cuptiProfilerHostGetConfigImage, &mut get) }?;
        let mut passes = sys::CUpti_Profiler_Host_GetNumOfPasses_Params {
            structSize: sys::Profiler_Host_GetNumOfPasses_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            configImageSize: image.len(),
            pConfigImage: image.as_mut_ptr(),
            numOfPasses: 0,
        };
        // SAFETY: a complete params struct over the config image just written.
        unsafe { call("cuptiProfilerHostGetNumOfPasses", sys::cuptiProfilerHostGetNumOfPasses, &mut passes) }?;
        Ok((image, passes.numOfPasses))
    }

    /// The values of `metrics`, in order, for range (or sample) `index` of a decoded counter data
    /// image.
    pub fn evaluate(&self, counter_data: &Image, index: usize, metrics: &Metrics) -> Result<Vec<f64>, AuditError> {
        let mut values = vec![f64::NAN; metrics.len()];
        let mut p = sys::CUpti_Profiler_Host_EvaluateToGpuValues_Params {
            structSize: sys::Profiler_Host_EvaluateToGpuValues_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pHostObject: self.object.as_ptr(),
            pCounterDataImage: counter_data.as_ptr(),
            counterDataImageSize: counter_data.len(),
            rangeIndex: index,
            ppMetricNames: metrics.as_ptrs(),
            numMetrics: metrics.len(),
            pMetricValues: values.as_mut_ptr(),
        };
        // SAFETY: a complete params struct; `values` holds one f64 per metric for CUPTI to write.
        unsafe { call("cuptiProfilerHostEvaluateToGpuValues", sys::cuptiProfilerHostEvaluateToGpuValues, &mut p) }?;
        Ok(values)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let mut p = sys::CUpti_Profiler_Host_Deinitialize_Params {
            structSize: sys::Profiler_Host_Deinitialize_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pHostObject: self.object.as_ptr(),
        };
        // SAFETY: a complete params struct; the object is destroyed once, here. A failure leaks it.
        let _ = unsafe { call("cuptiProfilerHostDeinitialize", sys::cuptiProfilerHostDeinitialize, &mut p) };
    }
}
