//! The launch path of a call, in parts: host round trips (launch, then synchronise) of kernels that
//! do nothing, each adding one respect of the megakernel's launch to the one before (its grid and
//! shared memory, the cooperative launch, the program's parameter block); then the megakernel's own
//! step, whose round trip less its kernel time is what a call pays beyond the kernel on this host;
//! then the same step observed as the runner observes a timed call (the CUPTI recording, then also an
//! open audit range). The judge's signalling is the ping `grader run` reports.

use std::time::Instant;

use cuda::cudarc::driver::sys::CUfunction_attribute;
use cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use cuda::{Context, CudaError, Device};
use serde::Serialize;

use crate::audit::{DRAM_BYTES_READ, RangeAudit};
use crate::cupti::{self, Recording, Tag};
use crate::error::GraderError;
use crate::kernels::LAUNCH_PROBE;
use crate::stats::Summary;

/// Untimed launches of each variant first, then the timed ones.
const WARMUP: usize = 20;
const TIMED: usize = 200;

/// `struct ProbeParam` of `kernels/grader/launch_probe.cu`: the size of the megakernel's program.
#[derive(Clone, Copy)]
#[repr(C)]
struct ProbeParam([i64; PROBE_PARAM_WORDS]);
const PROBE_PARAM_WORDS: usize = megakernel::program::MAX_PHASES * megakernel::program::ROW_WORDS;

// SAFETY: plain old data of the layout `struct ProbeParam` declares (int64 words, no padding).
unsafe impl DeviceRepr for ProbeParam {}

/// The row of the megakernel's own step, unobserved.
pub const STEP: &str = "the megakernel's step";

/// One way of launching, timed on the host.
#[derive(Debug, Clone, Serialize)]
pub struct LaunchPart {
    pub what: String,
    /// The launch call alone (median, us).
    pub api_us: f64,
    /// From before the launch to the synchronisation's return (median, us).
    pub round_trip_us: f64,
}

/// How the probes launch: a plain or a cooperative launch of `probe_empty` or `probe_param`.
#[derive(Clone, Copy)]
struct Probe {
    what: &'static str,
    cooperative: bool,
    param: bool,
    megakernel_shape: bool,
}

const PROBES: [Probe; 4] = [
    Probe { what: "plain, 1 block of 32 threads", cooperative: false, param: false, megakernel_shape: false },
    Probe {
        what: "plain, the megakernel's grid and shared memory",
        cooperative: false,
        param: false,
        megakernel_shape: true,
    },
    Probe { what: "cooperative, the same", cooperative: true, param: false, megakernel_shape: true },
    Probe {
        what: "cooperative, the same, with the program's parameter block",
        cooperative: true,
        param: true,
        megakernel_shape: true,
    },
];

/// Times every probe with the megakernel's launch shape (`grid` blocks of `threads` threads with
/// `smem` bytes of dynamic shared memory).
pub fn probes(dev: &Device, grid: u32, threads: u32, smem: u32) -> Result<Vec<LaunchPart>, CudaError> {
    let param = ProbeParam([1; PROBE_PARAM_WORDS]);
    let no_sink = 0u64;
    PROBES
        .iter()
        .map(|p| {
            let func = dev.function(&LAUNCH_PROBE, if p.param { "probe_param" } else { "probe_empty" })?;
            let cfg = if p.megakernel_shape {
                func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                    .context("raising a launch probe's shared memory limit")?;
                LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem }
            } else {
                LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 }
            };
            let timed = time(dev, || {
                let mut args = dev.stream().launch_builder(&func);
                if p.param {
                    args.arg(&param);
                }
                args.arg(&no_sink);
                // SAFETY: probe_empty(sink) / probe_param(param: ProbeParam by value, sink); a null sink
                // makes them touch no memory. The grid fits the card (the megakernel's, sized by occupancy).
                unsafe { if p.cooperative { args.launch_cooperative(cfg) } else { args.launch(cfg) } }
                    .map(drop)
                    .context("launching a launch probe")
            })?;
            Ok(LaunchPart { what: p.what.into(), api_us: timed.0, round_trip_us: timed.1 })
        })
        .collect()
}

/// `step` timed as [`time`] times it while observed as the runner observes a timed call: recorded
/// (CUPTI's activity records and API callbacks), then recorded and inside an open audit range (the
/// range profiler counting DRAM reads). Each row, or why it could not be measured here.
pub fn observed(dev: &Device, mut step: impl FnMut() -> Result<(), GraderError>) -> Vec<Result<LaunchPart, String>> {
    let mut recorded = |audited: bool| -> Result<LaunchPart, String> {
        dev.synchronize().map_err(|e| e.to_string())?;
        let recording = Recording::start().map_err(|e| format!("the recording: {e}"))?;
        cupti::set_current(Tag::Call(0));
        let timed = (|| -> Result<(f64, f64), String> {
            if !audited {
                return time(dev, &mut step).map_err(|e| e.to_string());
            }
            let mut audit =
                RangeAudit::enable(dev.ctx(), &[DRAM_BYTES_READ], 1).map_err(|e| format!("the audit: {e}"))?;
            audit.push("the launch path").map_err(|e| format!("the audit: {e}"))?;
            let timed = time(dev, &mut step).map_err(|e| e.to_string());
            audit.pop().map_err(|e| format!("the audit: {e}"))?;
            audit.finish().map_err(|e| format!("the audit: {e}"))?;
            timed
        })();
        cupti::set_current(Tag::Outside);
        dev.synchronize().map_err(|e| e.to_string())?;
        recording.finish().map_err(|e| format!("the recording: {e}"))?;
        let (api_us, round_trip_us) = timed?;
        let what = if audited {
            "the megakernel's step, recorded, in an open audit range (a timed call)"
        } else {
            "the megakernel's step, recorded (CUPTI activity and callbacks)"
        };
        Ok(LaunchPart { what: what.into(), api_us, round_trip_us })
    };
    vec![recorded(false), recorded(true)]
}

/// Median host times of `launch` alone and of `launch` then a stream synchronisation, in us.
pub fn time<E: From<CudaError>>(dev: &Device, mut launch: impl FnMut() -> Result<(), E>) -> Result<(f64, f64), E> {
    let [api, round] = medians(|| -> Result<[f64; 2], E> {
        let t = Instant::now();
        launch()?;
        let launched = t.elapsed();
        dev.stream().synchronize().context("synchronising after a timed launch")?;
        Ok([launched.as_secs_f64() * 1e6, t.elapsed().as_secs_f64() * 1e6])
    })?;
    Ok((api, round))
}

/// Median GPU time of `launch` in us by events, launched as [`time`] launches it (back to back, no
/// eviction between), so that its round trip less this is what the launch path adds.
pub fn kernel_us<E: From<CudaError>>(dev: &Device, mut launch: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    let [us] = medians(|| -> Result<[f64; 1], E> {
        let ms = dev.time_ms(&mut launch)?;
        dev.stream().synchronize().context("synchronising after a timed launch")?;
        Ok([ms as f64 * 1e3])
    })?;
    Ok(us)
}

/// Each figure's median over [`TIMED`] samples taken after [`WARMUP`] untimed ones.
fn medians<const N: usize, E>(mut sample: impl FnMut() -> Result<[f64; N], E>) -> Result<[f64; N], E> {
    for _ in 0..WARMUP {
        sample()?;
    }
    let samples: Vec<[f64; N]> = (0..TIMED).map(|_| sample()).collect::<Result<_, _>>()?;
    Ok(std::array::from_fn(|i| Summary::of(&samples.iter().map(|s| s[i]).collect::<Vec<_>>()).expect("timed").median))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_parameter_mirrors_the_kernel_and_the_megakernel_program() {
        let cu = include_str!("../../../kernels/grader/launch_probe.cu");
        let words = megakernel::program::MAX_PHASES * megakernel::program::ROW_WORDS;
        assert!(cu.contains(&format!(
            "constexpr int PROBE_PARAM_WORDS = {} * {};",
            megakernel::program::MAX_PHASES,
            megakernel::program::ROW_WORDS
        )));
        assert_eq!(std::mem::size_of::<ProbeParam>(), words * 8);
    }
}
