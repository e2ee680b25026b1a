//! The judge's own view of the hardware: CUPTI's PM sampling (cupti_pmsampling.h) reads the GPU's
//! performance monitors for the whole device, every context of every process, at a fixed interval
//! of GPU time. The judge runs it in its own process, so nothing the submission's process does can
//! stop it or change what it reports; it can only keep the counters from it by holding them first,
//! which the judge's probe before the submission is loaded rules out ([`DeviceSampler::start`]).
//!
//! What a call read is the sum of the samples that overlap the call's window on the judge's clock
//! (CUPTI's timestamps, [`now_ns`]): the device is idle around every call the judge times (the
//! runner's bookkeeping is done and the judge waits [`QUIET_INTERVALS`] sampling intervals before
//! its "go"), so a sample that straddles a window's edge adds nothing but idle time.
//!
//! The CUPTI calls, in order:
//! - start: `cuptiProfilerInitialize`, `cuptiProfilerDeviceSupported` (PM sampling),
//!   `cuptiDeviceGetChipName`, `cuptiPmSamplingGetCounterAvailability` (size, then image),
//!   `cuptiProfilerHostInitialize` (PM sampling), the config image (one pass), `cuptiPmSamplingEnable`,
//!   `cuptiPmSamplingGetCounterDataSize`, `cuptiPmSamplingCounterDataImageInitialize`,
//!   `cuptiPmSamplingSetConfig` (GPU-time trigger), `cuptiPmSamplingStart`;
//! - drain (between calls, untimed): `cuptiPmSamplingDecodeData` until the records end, then per
//!   completed sample `cuptiPmSamplingCounterDataGetSampleInfo` and
//!   `cuptiProfilerHostEvaluateToGpuValues`, and the counter data image initialised again;
//! - finish: a last drain, `cuptiPmSamplingStop`, `cuptiPmSamplingDisable`.

use std::ptr::{NonNull, null_mut};

use cuda::cudarc::cupti::sys;
use cuda::cudarc::driver::sys::CUdevice;
use serde::Serialize;

use super::host::Host;
use super::image::Image;
use super::names::Metrics;
use super::{AuditError, Slot, call, load_cupti, target};

/// The GPU time between samples: 10,000 samples a second, which the decode keeps up with (measured on
/// the H200: at 20 us, 50,000 a second, decoding fell behind until the counter data image overflowed
/// within seconds, as CUPTI_ERROR_OUT_OF_MEMORY). A call shorter than this is summed from the one or
/// two samples that hold it, the device idle around it.
pub const SAMPLING_INTERVAL_NS: u64 = 100_000;
/// Sampling intervals of idle device the judge leaves before each "go": a sample that overlaps the
/// window then began after the runner's last work (its L2 eviction) ended.
pub const QUIET_INTERVALS: u64 = 3;
/// The hardware buffer the samples land in before a drain decodes them.
const HARDWARE_BUFFER_BYTES: usize = 512 << 20;
/// Samples one decode takes before the counter data image is evaluated and reused: 10 s of them.
const SAMPLES_PER_DECODE: u32 = 100_000;

/// One sample: the GPU time it covers (CUPTI's clock, ns) and its metric values, in the order the
/// metrics were given to [`DeviceSampler::start`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    pub start_ns: u64,
    pub end_ns: u64,
    pub values: Vec<f64>,
}

/// Now on CUPTI's clock, in ns: the time base of the samples' timestamps.
pub fn now_ns() -> Result<u64, AuditError> {
    let mut t = 0u64;
    // SAFETY: writes one u64 through a valid pointer.
    match unsafe { sys::cuptiGetTimestamp(&mut t) } {
        sys::CUptiResult::CUPTI_SUCCESS => Ok(t),
        code => Err(AuditError::Call { call: "cuptiGetTimestamp", code }),
    }
}

/// The sum of metric `metric` over the samples that overlap `[start_ns, end_ns]`, and how many did.
pub fn window_sum(samples: &[Sample], start_ns: u64, end_ns: u64, metric: usize) -> (f64, usize) {
    samples
        .iter()
        .filter(|s| s.end_ns > start_ns && s.start_ns < end_ns)
        .fold((0.0, 0), |(sum, n), s| (sum + s.values[metric], n + 1))
}

/// PM sampling on one device, from [`DeviceSampler::start`] to [`DeviceSampler::finish`]. Fields
/// drop in the order CUPTI needs: the sampling object (stopped, disabled) before the images it
/// points to, then the host object, and the process's profiler slot last.
pub struct DeviceSampler {
    object: NonNull<sys::CUpti_PmSampling_Object>,
    counter_data: Image,
    config: Image,
    host: Host,
    metrics: Metrics,
    samples: Vec<Sample>,
    started: bool,
    _slot: Slot,
}

impl DeviceSampler {
    /// Starts sampling `metrics` on the device of CUDA ordinal `ordinal`. Every error says why the
    /// judge cannot audit on this device (its message is the verdict's reason).
    pub fn start(ordinal: usize, device: CUdevice, metrics: &[&str]) -> Result<DeviceSampler, AuditError> {
        load_cupti()?;
        let metrics = Metrics::new(metrics)?;
        let slot = Slot::take()?;
        target::initialize_profiler()?;
        target::device_support(device, sys::CUpti_Profiler_API::CUPTI_PROFILER_PM_SAMPLING)?.check()?;
        let chip = target::chip_name(ordinal)?;
        let availability = counter_availability(ordinal)?;
        let host = Host::new(sys::CUpti_ProfilerType::CUPTI_PROFILER_TYPE_PM_SAMPLING, chip, Some(availability))?;
        let (config, passes) = host.config(&metrics)?;
        if passes != 1 {
            return Err(AuditError::Passes { metrics: metrics.names().join(", "), passes });
        }
        let mut enable = sys::CUpti_PmSampling_Enable_Params {
            structSize: sys::PmSampling_Enable_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            deviceIndex: ordinal,
            pPmSamplingObject: null_mut(),
        };
        // SAFETY: a complete params struct with its header size.
        unsafe { call("cuptiPmSamplingEnable", sys::cuptiPmSamplingEnable, &mut enable) }?;
        let object = NonNull::new(enable.pPmSamplingObject)
            .ok_or_else(|| AuditError::Decoded("cuptiPmSamplingEnable returned no object".into()))?;
        let mut sampler = DeviceSampler {
            object,
            // Replaced below: the sampling object sizes it. Built in place so an error from here on
            // tears down in field order.
            counter_data: Image::zeroed(0),
            config,
            host,
            metrics,
            samples: Vec::new(),
            started: false,
            _slot: slot,
        };
        sampler.counter_data = sampler.counter_data_image()?;
        sampler.set_config()?;
        let mut p = sys::CUpti_PmSampling_Start_Params {
            structSize: sys::PmSampling_Start_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pPmSamplingObject: sampler.object.as_ptr(),
        };
        // SAFETY: a complete params struct on a live, configured sampling object.
        unsafe { call("cuptiPmSamplingStart", sys::cuptiPmSamplingStart, &mut p) }?;
        sampler.started = true;
        Ok(sampler)
    }

    /// A counter data image for [`SAMPLES_PER_DECODE`] samples of the metrics, initialised.
    fn counter_data_image(&self) -> Result<Image, AuditError> {
        let mut size = sys::CUpti_PmSampling_GetCounterDataSize_Params {
            structSize: sys::PmSampling_GetCounterDataSize_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pPmSamplingObject: self.object.as_ptr(),
            pMetricNames: self.metrics.as_ptrs(),
            numMetrics: self.metrics.len(),
            maxSamples: SAMPLES_PER_DECODE,
            counterDataSize: 0,
        };
        // SAFETY: a complete params struct; the names live in `self.metrics` (read only).
        unsafe { call("cuptiPmSamplingGetCounterDataSize", sys::cuptiPmSamplingGetCounterDataSize, &mut size) }?;
        let mut image = Image::zeroed(size.counterDataSize);
        self.initialize(&mut image)?;
        Ok(image)
    }

    fn initialize(&self, image: &mut Image) -> Result<(), AuditError> {
        let mut p = sys::CUpti_PmSampling_CounterDataImage_Initialize_Params {
            structSize: sys::PmSampling_CounterDataImage_Initialize_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pPmSamplingObject: self.object.as_ptr(),
            counterDataSize: image.len(),
            pCounterData: image.as_mut_ptr(),
        };
        // SAFETY: the image holds the `counterDataSize` bytes CUPTI asked for.
        unsafe {
            call("cuptiPmSamplingCounterDataImageInitialize", sys::cuptiPmSamplingCounterDataImageInitialize, &mut p)
        }
    }

    fn set_config(&mut self) -> Result<(), AuditError> {
        let mut p = sys::CUpti_PmSampling_SetConfig_Params {
            structSize: sys::PmSampling_SetConfig_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pPmSamplingObject: self.object.as_ptr(),
            configSize: self.config.len(),
            pConfig: self.config.as_ptr(),
            hardwareBufferSize: HARDWARE_BUFFER_BYTES,
            samplingInterval: SAMPLING_INTERVAL_NS,
            triggerMode: sys::CUpti_PmSampling_TriggerMode::CUPTI_PM_SAMPLING_TRIGGER_MODE_GPU_TIME_INTERVAL,
            // A full buffer is an overflow the decode reports, never samples silently replaced.
            hwBufferAppendMode:
                sys::CUpti_PmSampling_HardwareBuffer_AppendMode::CUPTI_PM_SAMPLING_HARDWARE_BUFFER_APPEND_MODE_KEEP_OLDEST,
        };
        // SAFETY: a complete params struct; the config image lives in `self` as long as the object.
        unsafe { call("cuptiPmSamplingSetConfig", sys::cuptiPmSamplingSetConfig, &mut p) }
    }

    /// Decodes every sample the hardware has completed so far, and keeps the values of those that
    /// end after `keep_from` (CUPTI's clock; `None`: none). Only kept samples are evaluated: the
    /// host library evaluates some 20,000 samples a second, fewer than the hardware takes, so the
    /// samples outside the judge's windows are decoded (the hardware buffer freed) and dropped.
    pub fn drain(&mut self, keep_from: Option<u64>) -> Result<(), AuditError> {
        loop {
            let mut p = sys::CUpti_PmSampling_DecodeData_Params {
                structSize: sys::PmSampling_DecodeData_Params_STRUCT_SIZE as usize,
                pPriv: null_mut(),
                pPmSamplingObject: self.object.as_ptr(),
                pCounterDataImage: self.counter_data.as_mut_ptr(),
                counterDataImageSize: self.counter_data.len(),
                decodeStopReason: sys::CUpti_PmSampling_DecodeStopReason::CUPTI_PM_SAMPLING_DECODE_STOP_REASON_OTHER,
                overflow: 0,
            };
            // SAFETY: a complete params struct; the image is this object's, sized by it.
            unsafe { call("cuptiPmSamplingDecodeData", sys::cuptiPmSamplingDecodeData, &mut p) }?;
            if p.overflow != 0 {
                return Err(AuditError::Decoded(
                    "the PM sampling hardware buffer overflowed: samples were lost, so no window's sum can be trusted"
                        .into(),
                ));
            }
            // Read as a number: a reason newer than the bindings must not become an invalid enum.
            // SAFETY: a 4-byte repr(u32) enum field of `p`, written by CUPTI.
            let reason = unsafe { (&raw const p.decodeStopReason).cast::<u32>().read() };
            self.take_samples(keep_from)?;
            const FULL: u32 =
                sys::CUpti_PmSampling_DecodeStopReason::CUPTI_PM_SAMPLING_DECODE_STOP_REASON_COUNTER_DATA_FULL as u32;
            if reason != FULL {
                return Ok(());
            }
        }
    }

    /// Evaluates the completed samples of the counter data image that end after `keep_from`, then
    /// initialises it again.
    fn take_samples(&mut self, keep_from: Option<u64>) -> Result<(), AuditError> {
        let mut info = sys::CUpti_PmSampling_GetCounterDataInfo_Params {
            structSize: sys::PmSampling_GetCounterDataInfo_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pCounterDataImage: self.counter_data.as_ptr(),
            counterDataImageSize: self.counter_data.len(),
            numTotalSamples: 0,
            numPopulatedSamples: 0,
            numCompletedSamples: 0,
        };
        // SAFETY: a complete params struct over the live image.
        unsafe { call("cuptiPmSamplingGetCounterDataInfo", sys::cuptiPmSamplingGetCounterDataInfo, &mut info) }?;
        for index in 0..info.numCompletedSamples {
            let mut s = sys::CUpti_PmSampling_CounterData_GetSampleInfo_Params {
                structSize: sys::PmSampling_CounterData_GetSampleInfo_Params_STRUCT_SIZE as usize,
                pPriv: null_mut(),
                pPmSamplingObject: self.object.as_ptr(),
                pCounterDataImage: self.counter_data.as_ptr(),
                counterDataImageSize: self.counter_data.len(),
                sampleIndex: index,
                startTimestamp: 0,
                endTimestamp: 0,
            };
            // SAFETY: a complete params struct over the live image; `index` is a completed sample.
            unsafe {
                call("cuptiPmSamplingCounterDataGetSampleInfo", sys::cuptiPmSamplingCounterDataGetSampleInfo, &mut s)
            }?;
            if keep_from.is_none_or(|from| s.endTimestamp <= from) {
                continue;
            }
            let values = self.host.evaluate(&self.counter_data, index, &self.metrics)?;
            self.samples.push(Sample { start_ns: s.startTimestamp, end_ns: s.endTimestamp, values });
        }
        let mut image = std::mem::replace(&mut self.counter_data, Image::zeroed(0));
        let reinitialized = self.initialize(&mut image);
        self.counter_data = image;
        reinitialized
    }

    /// Every sample decoded since the last take, handed over.
    pub fn take(&mut self) -> Vec<Sample> {
        std::mem::take(&mut self.samples)
    }

    /// A last drain (keeping what ends after `keep_from`), then stops sampling; every sample kept.
    pub fn finish(mut self, keep_from: Option<u64>) -> Result<Vec<Sample>, AuditError> {
        self.drain(keep_from)?;
        self.stop()?;
        Ok(std::mem::take(&mut self.samples))
    }

    fn stop(&mut self) -> Result<(), AuditError> {
        if !self.started {
            return Ok(());
        }
        self.started = false;
        let mut p = sys::CUpti_PmSampling_Stop_Params {
            structSize: sys::PmSampling_Stop_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pPmSamplingObject: self.object.as_ptr(),
        };
        // SAFETY: a complete params struct on the live, started object.
        unsafe { call("cuptiPmSamplingStop", sys::cuptiPmSamplingStop, &mut p) }
    }
}

// SAFETY: the sampling object is CUPTI's, per device and process, not tied to the thread that made
// it; the judge moves the sampler to its drain thread and serialises every call behind one mutex.
unsafe impl Send for DeviceSampler {}

impl Drop for DeviceSampler {
    fn drop(&mut self) {
        let _ = self.stop();
        let mut p = sys::CUpti_PmSampling_Disable_Params {
            structSize: sys::PmSampling_Disable_Params_STRUCT_SIZE as usize,
            pPriv: null_mut(),
            pPmSamplingObject: self.object.as_ptr(),
        };
        // SAFETY: a complete params struct; the object is disabled once, here. A failure leaks it.
        let _ = unsafe { call("cuptiPmSamplingDisable", sys::cuptiPmSamplingDisable, &mut p) };
    }
}

/// Which counters PM sampling can collect on the device, for the host library.
fn counter_availability(ordinal: usize) -> Result<Image, AuditError> {
    let mut p = sys::CUpti_PmSampling_GetCounterAvailability_Params {
        structSize: sys::PmSampling_GetCounterAvailability_Params_STRUCT_SIZE as usize,
        pPriv: null_mut(),
        deviceIndex: ordinal,
        counterAvailabilityImageSize: 0,
        pCounterAvailabilityImage: null_mut(),
    };
    // SAFETY: a null image asks for the size only.
    unsafe { call("cuptiPmSamplingGetCounterAvailability", sys::cuptiPmSamplingGetCounterAvailability, &mut p) }?;
    let mut image = Image::zeroed(p.counterAvailabilityImageSize);
    p.pCounterAvailabilityImage = image.as_mut_ptr();
    // SAFETY: the image holds the `counterAvailabilityImageSize` bytes CUPTI asked for.
    unsafe { call("cuptiPmSamplingGetCounterAvailability", sys::cuptiPmSamplingGetCounterAvailability, &mut p) }?;
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(start_ns: u64, end_ns: u64, bytes: f64) -> Sample {
        Sample { start_ns, end_ns, values: vec![bytes, 1.0] }
    }

    /// A window sums exactly the samples that overlap it, straddling ones included, touching ones
    /// not.
    #[test]
    fn a_window_sums_the_samples_that_overlap_it() {
        let samples = [sample(0, 10, 1.0), sample(10, 20, 2.0), sample(20, 30, 4.0), sample(30, 40, 8.0)];
        assert_eq!(window_sum(&samples, 12, 25, 0), (6.0, 2));
        assert_eq!(window_sum(&samples, 10, 20, 0), (2.0, 1), "touching samples are outside");
        assert_eq!(window_sum(&samples, 0, 40, 1), (4.0, 4));
        assert_eq!(window_sum(&samples, 41, 50, 0), (0.0, 0));
    }
}
