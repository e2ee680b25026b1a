//! The target side of CUPTI's range profiler: the calls that touch the GPU and its context
//! (cupti_profiler_target.h, cupti_target.h, cupti_range_profiler.h), each a safe function over
//! one `*_Params` struct with `structSize` set to the CUDA 13.0 header's `*_STRUCT_SIZE`.

use std::ffi::{CStr, CString};
use std::ptr::{NonNull, null, null_mut};
use std::sync::atomic::{AtomicBool, Ordering};

use cuda::cudarc::cupti::sys;
use cuda::cudarc::driver::sys::{CUcontext, CUdevice};

use super::error::Support;
use super::image::Image;
use super::names::Metrics;
use super::{AuditError, call};

/// One nesting level: the audit's ranges do not nest.
const NESTING_LEVELS: u16 = 1;
/// Nesting levels count from 1.
const OUTER_LEVEL: u16 = 1;
/// User replay starts at pass 0 (and, with a one-pass configuration, ends there).
const FIRST_PASS: usize = 0;
/// Joins nested range names; the audit's ranges have one level, so it never shows.
const RANGE_DELIMITER: &CStr = c"/";

/// Whether CUPTI's profiler interface has been initialised in this process.
static PROFILER_READY: AtomicBool = AtomicBool::new(false);

/// Initialises CUPTI's profiler interface once per process and leaves it so, as NVIDIA's samples
/// do: audits that follow one another (the selftest's) never deinitialise and re-initialise it.
/// The caller holds the process's audit slot, so no two threads get here at once.
pub(super) fn initialize_profiler() -> Result<(), AuditError> {
    if PROFILER_READY.load(Ordering::Acquire) {
        return Ok(());
    }
    let mut p = sys::CUpti_Profiler_Initialize_Params {
        structSize: sys::Profiler_Initialize_Params_STRUCT_SIZE as usize,
        pPriv: null_mut(),
    };
    // SAFETY: a complete params struct with its header size.
    unsafe { call("cuptiProfilerInitialize", sys::cuptiProfilerInitialize, &mut p) }?;
    PROFILER_READY.store(true, Ordering::Release);
    Ok(())
}

/// What CUPTI says about profiling through `api` (the range profiler, PM sampling) on `device`
/// (needs [`initialize_profiler`] first).
pub(super) fn device_support(device: CUdevice, api: sys::CUpti_Profiler_API) -> Result<Support, AuditError> {
    use sys::CUpti_Profiler_Support_Level::CUPTI_PROFILER_CONFIGURATION_UNKNOWN as UNKNOWN;
    let mut p = sys::CUpti_Profiler_DeviceSupported_Params {
        structSize: sys::Profiler_DeviceSupported_Params_STRUCT_SIZE as usize,
        pPriv: null_mut(),
        cuDevice: device,
        isSupported: UNKNOWN,
        architecture: UNKNOWN,
        sli: UNKNOWN,
        vGpu: UNKNOWN,
        confidentialCompute: UNKNOWN,
        cmp: UNKNOWN,
        wsl: UNKNOWN,
        api,
    };
    // SAFETY: a complete params struct with its header size; the outputs are plain enum fields.
    unsafe { call("cuptiProfilerDeviceSupported", sys::cuptiProfilerDeviceSupported, &mut p) }?;
    // The outputs are read as numbers: a level newer than the bindings must not become an invalid
    // Rust enum.
    let level = |field: *const sys::CUpti_Profiler_Support_Level| {
        // SAFETY: `field` points to a 4-byte enum field of `p` (a repr(u32) enum), initialised above.
        unsafe { field.cast::<u32>().read() }
    };
    Ok(Support {
        overall: level(&raw const p.isSupported),
        architecture: level(&raw const p.architecture),
        sli: level(&raw const p.sli),
        vgpu: level(&raw const p.vGpu),
        confidential_compute: level(&raw const p.confidentialCompute),
        cmp: level(&raw const p.cmp),
        wsl: level(&raw const p.wsl),
    })
}

/// The chip name the host library needs, e.g. `GH100`.
pub(super) fn chip_name(device_ordinal: usize) -> Result<CString, AuditError> {
    let mut p = sys::CUpti_Device_GetChipName_Params {
        structSize: sys::Device_GetChipName_Params_STRUCT_SIZE as usize,
        pPriv: null_mut(),
        deviceIndex: device_ordinal,
        pChipName: null(),
    };
    // SAFETY: a complete params struct with its header size.
    unsafe { call("cuptiDeviceGetChipName", sys::cuptiDeviceGetChipName, &mut p) }?;
    if p.pChipName.is_null() {
        return Err(AuditError::Decoded("cuptiDeviceGetChipName returned no name".into()));
    }
    // SAFETY: CUPTI returned a NUL-terminated string it owns; it is copied at once.
    Ok(unsafe { CStr::from_ptr(p.pChipName) }.to_owned())
}

/// Which counters this context can collect (restricted ones filtered out), for the host library.
/// Must run before the range profiler is enabled: CUPTI refuses it during a session.
pub(super) fn counter_availability(ctx: CUcontext) -> Result<Image, AuditError> {
    let mut p = sys::CUpti_Profiler_GetCounterAvailability_Params {
        structSize: sys::Profiler_GetCounterAvailability_Params_STRUCT_SIZE as usize,
        pPriv: null_mut(),
        ctx,
        counterAvailabilityImageSize: 0,
        pCounterAvailabilityImage: null_mut(),
    };
    // SAFETY: a null image asks for the size only.
    unsafe { call("cuptiProfilerGetCounterAvailability", sys::cuptiProfilerGetCounterAvailability, &mut p) }?;
    let mut image = Image::zeroed(p.counterAvailabilityImageSize);
    p.pCounterAvailabilityImage = image.as_mut_ptr();
    // SAFETY: the image holds the `counterAvailabilityImageSize` bytes CUPTI asked for.
    unsafe { call("cuptiProfilerGetCounterAvailability", sys::cuptiProfilerGetCounterAvailability, &mut p) }?;
    Ok(image)
}

/// The range profiler object of one context. Dropping it stops a started pass and disables the
/// profiler on the context; the images handed to [`Target::set_config`] must outlive it.
pub(super) struct Target {
    object: NonNull<sys::CUpti_RangeProfiler_Object>,
    started: bool,
}

impl Target {
    pub fn enable(ctx: CUcontext) -> Result<Target, AuditError> {
        let mut p = sys::CUpti_RangeProfiler_Enable_Params {
            structSize: sys::RangeProfiler_Enable_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            ctx,
            pRangeProfilerObject: null_mut(),
        };
        // SAFETY: a complete params struct with its header size; `ctx` is a live context.
        unsafe { call("cuptiRangeProfilerEnable", sys::cuptiRangeProfilerEnable, &mut p) }?;
        let object = NonNull::new(p.pRangeProfilerObject)
            .ok_or_else(|| AuditError::Decoded("cuptiRangeProfilerEnable returned no profiler object".into()))?;
        Ok(Target { object, started: false })
    }

    /// A counter data image initialised for `metrics` over at most `max_ranges` ranges.
    pub fn counter_data(&self, metrics: &Metrics, max_ranges: usize) -> Result<Image, AuditError> {
        let mut size = sys::CUpti_RangeProfiler_GetCounterDataSize_Params {
            structSize: sys::RangeProfiler_GetCounterDataSize_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
            pMetricNames: metrics.as_ptrs(),
            numMetrics: metrics.len(),
            maxNumOfRanges: max_ranges,
            // One level of ranges: one tree node per range.
            maxNumRangeTreeNodes: u32::try_from(max_ranges)
                .map_err(|_| AuditError::Misuse(format!("max_ranges {max_ranges} does not fit CUPTI's u32")))?,
            counterDataSize: 0,
        };
        // SAFETY: a complete params struct; the metric name array lives in `metrics` (read only).
        unsafe { call("cuptiRangeProfilerGetCounterDataSize", sys::cuptiRangeProfilerGetCounterDataSize, &mut size) }?;
        let mut image = Image::zeroed(size.counterDataSize);
        let mut init = sys::CUpti_RangeProfiler_CounterDataImage_Initialize_Params {
            structSize: sys::RangeProfiler_CounterDataImage_Initialize_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
            counterDataSize: image.len(),
            pCounterData: image.as_mut_ptr(),
        };
        // SAFETY: the image holds the `counterDataSize` bytes CUPTI asked for.
        unsafe {
            call(
                "cuptiRangeProfilerCounterDataImageInitialize",
                sys::cuptiRangeProfilerCounterDataImageInitialize,
                &mut init,
            )
        }?;
        Ok(image)
    }

    /// User ranges, user replay (the caller's own calls, never replayed by CUPTI), one level,
    /// pass 0. CUPTI keeps both image pointers: they must outlive `self`.
    pub fn set_config(&self, config: &Image, counter_data: &mut Image, max_ranges: usize) -> Result<(), AuditError> {
        let mut p = sys::CUpti_RangeProfiler_SetConfig_Params {
            structSize: sys::RangeProfiler_SetConfig_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
            configSize: config.len(),
            pConfig: config.as_ptr(),
            counterDataImageSize: counter_data.len(),
            pCounterDataImage: counter_data.as_mut_ptr(),
            range: sys::CUpti_ProfilerRange::CUPTI_UserRange,
            replayMode: sys::CUpti_ProfilerReplayMode::CUPTI_UserReplay,
            maxRangesPerPass: max_ranges,
            numNestingLevels: NESTING_LEVELS,
            minNestingLevel: OUTER_LEVEL,
            passIndex: FIRST_PASS,
            targetNestingLevel: OUTER_LEVEL,
        };
        // SAFETY: a complete params struct; both images are live (and outlive the object, which
        // the caller guarantees).
        unsafe { call("cuptiRangeProfilerSetConfig", sys::cuptiRangeProfilerSetConfig, &mut p) }
    }

    /// Begins the (only) pass: ranges pushed from now on are collected.
    pub fn start(&mut self) -> Result<(), AuditError> {
        let mut p = sys::CUpti_RangeProfiler_Start_Params {
            structSize: sys::RangeProfiler_Start_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
        };
        // SAFETY: a complete params struct on a live profiler object.
        unsafe { call("cuptiRangeProfilerStart", sys::cuptiRangeProfilerStart, &mut p) }?;
        self.started = true;
        Ok(())
    }

    pub fn push(&self, name: &CStr) -> Result<(), AuditError> {
        let mut p = sys::CUpti_RangeProfiler_PushRange_Params {
            structSize: sys::RangeProfiler_PushRange_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
            pRangeName: name.as_ptr(),
        };
        // SAFETY: a complete params struct; `name` is NUL-terminated and kept alive by the caller
        // until the counter data is decoded.
        unsafe { call("cuptiRangeProfilerPushRange", sys::cuptiRangeProfilerPushRange, &mut p) }
    }

    pub fn pop(&self) -> Result<(), AuditError> {
        let mut p = sys::CUpti_RangeProfiler_PopRange_Params {
            structSize: sys::RangeProfiler_PopRange_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
        };
        // SAFETY: a complete params struct on a live profiler object.
        unsafe { call("cuptiRangeProfilerPopRange", sys::cuptiRangeProfilerPopRange, &mut p) }
    }

    /// Ends the pass; with a one-pass configuration every pass has then been submitted.
    pub fn stop(&mut self) -> Result<(), AuditError> {
        let mut p = sys::CUpti_RangeProfiler_Stop_Params {
            structSize: sys::RangeProfiler_Stop_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
            passIndex: 0,
            targetNestingLevel: 0,
            isAllPassSubmitted: 0,
        };
        // SAFETY: a complete params struct on a live profiler object.
        unsafe { call("cuptiRangeProfilerStop", sys::cuptiRangeProfilerStop, &mut p) }?;
        self.started = false;
        if p.isAllPassSubmitted == 0 {
            return Err(AuditError::Decoded(format!(
                "CUPTI wants another pass (next pass {}) although the configuration needs one",
                p.passIndex
            )));
        }
        Ok(())
    }

    /// Decodes the pass into the counter data image; returns how many ranges did not fit.
    pub fn decode(&self) -> Result<usize, AuditError> {
        let mut p = sys::CUpti_RangeProfiler_DecodeData_Params {
            structSize: sys::RangeProfiler_DecodeData_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
            numOfRangeDropped: 0,
        };
        // SAFETY: a complete params struct; CUPTI writes into the counter data image SetConfig
        // registered, which outlives the object.
        unsafe { call("cuptiRangeProfilerDecodeData", sys::cuptiRangeProfilerDecodeData, &mut p) }?;
        Ok(p.numOfRangeDropped)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // Errors are ignored: this runs on error paths and after `finish`, and nothing is left
        // to report them to.
        if self.started {
            let _ = self.stop();
        }
        let mut p = sys::CUpti_RangeProfiler_Disable_Params {
            structSize: sys::RangeProfiler_Disable_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pRangeProfilerObject: self.object.as_ptr(),
        };
        // SAFETY: a complete params struct; the object is disabled once, here.
        let _ = unsafe { call("cuptiRangeProfilerDisable", sys::cuptiRangeProfilerDisable, &mut p) };
    }
}

/// How many ranges a decoded counter data image holds.
pub(super) fn range_count(counter_data: &Image) -> Result<usize, AuditError> {
    let mut p = sys::CUpti_RangeProfiler_GetCounterDataInfo_Params {
        structSize: sys::RangeProfiler_GetCounterDataInfo_Params_STRUCT_SIZE as usize,
        pPriv: null_mut(),
        pCounterDataImage: counter_data.as_ptr(),
        counterDataImageSize: counter_data.len(),
        numTotalRanges: 0,
    };
    // SAFETY: a complete params struct over a live image (read only).
    unsafe { call("cuptiRangeProfilerGetCounterDataInfo", sys::cuptiRangeProfilerGetCounterDataInfo, &mut p) }?;
    Ok(p.numTotalRanges)
}

/// The name of range `index` of a decoded counter data image.
pub(super) fn range_name(counter_data: &Image, index: usize) -> Result<String, AuditError> {
    let mut p = sys::CUpti_RangeProfiler_CounterData_GetRangeInfo_Params {
        structSize: sys::RangeProfiler_CounterData_GetRangeInfo_Params_STRUCT_SIZE as usize,
        pPriv: null_mut(),
        pCounterDataImage: counter_data.as_ptr(),
        counterDataImageSize: counter_data.len(),
        rangeIndex: index,
        rangeDelimiter: RANGE_DELIMITER.as_ptr(),
        rangeName: null(),
    };
    // SAFETY: a complete params struct over a live image (read only).
    unsafe {
        call("cuptiRangeProfilerCounterDataGetRangeInfo", sys::cuptiRangeProfilerCounterDataGetRangeInfo, &mut p)
    }?;
    if p.rangeName.is_null() {
        return Err(AuditError::Decoded(format!("range {index} has no name")));
    }
    // SAFETY: CUPTI returned a NUL-terminated string; it is copied at once. The header does not
    // hand its ownership over (unlike cuptiProfilerHostGetRangeName's), so it is not freed.
    Ok(unsafe { CStr::from_ptr(p.rangeName) }.to_string_lossy().into_owned())
}
