//! The audit's one error type. Every message is a sentence a person reads in a verdict
//! (`unaudited: <message>`): what went wrong, the CUPTI call and its result code where there is
//! one, and what to do about it.

use cuda::cudarc::cupti::sys::{CUpti_Profiler_Support_Level, CUptiResult};
use cuda::cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("CUPTI (libcupti.so) could not be loaded: put the CUDA toolkit's lib64 folder on LD_LIBRARY_PATH")]
    NoCupti,
    #[error(
        "the libcupti.so found has no {symbol}: the audit needs CUPTI 12.6 or newer (the grader is built \
         against CUDA 13.0): put a newer toolkit's lib64 first on LD_LIBRARY_PATH"
    )]
    OldCupti { symbol: &'static str },
    #[error("a range audit is already active in this process: CUPTI's profiler is process-wide, finish the first one")]
    AlreadyActive,
    #[error("CUPTI reports that this GPU cannot be profiled: {reasons}")]
    DeviceUnsupported { reasons: String },
    #[error("{}", describe_call(call, *code))]
    Call { call: &'static str, code: CUptiResult },
    #[error(
        "{metrics} need {passes} passes on this GPU; the audit collects in one pass because the audited calls write \
         the KV cache in place and cannot be replayed: audit fewer metrics"
    )]
    Passes { metrics: String, passes: usize },
    #[error("the range audit was used wrongly: {0}")]
    Misuse(String),
    #[error(
        "CUPTI dropped {dropped} of the {pushed} ranges for lack of room in the counter data: the ranges' values \
         are incomplete (raise max_ranges)"
    )]
    Dropped { dropped: usize, pushed: usize },
    #[error("CUPTI's decoded counter data does not match the ranges pushed: {0}")]
    Decoded(String),
    #[error("CUDA call failed while {context}: {source}")]
    Driver { context: &'static str, source: DriverError },
}

/// What a failing result means for the audit and what to do, where the code (or the call and the
/// code) says more than its name.
fn advice(call: &str, code: CUptiResult) -> Option<(&'static str, &'static str)> {
    use CUptiResult::*;
    Some(match (call, code) {
        (_, CUPTI_ERROR_INSUFFICIENT_PRIVILEGES) => (
            "the GPU's hardware counters are not accessible to this user",
            "run as root, or load the nvidia kernel module with NVreg_RestrictProfilingToAdminUsers=0",
        ),
        (_, CUPTI_ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES) => (
            "the hypervisor does not allow profiling on this virtual GPU",
            "enable profiling for the virtual GPU in the hypervisor, or audit on a bare-metal GPU",
        ),
        (_, CUPTI_ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED) => {
            ("this virtual GPU does not support profiling", "audit on a bare-metal or passthrough GPU")
        }
        (_, CUPTI_ERROR_HARDWARE_BUSY) => (
            "another client holds the GPU's performance monitors",
            "stop the other profiler (Nsight Compute, DCGM profiling, another grader) and retry",
        ),
        (_, CUPTI_ERROR_MIG_DEVICE_NOT_SUPPORTED) => {
            ("profiling a MIG instance is not supported", "audit on a whole GPU")
        }
        (_, CUPTI_ERROR_CONFIDENTIAL_COMPUTING_NOT_SUPPORTED) => (
            "profiling is not allowed in confidential computing mode",
            "audit on a GPU with confidential computing off",
        ),
        (_, CUPTI_ERROR_CMP_DEVICE_NOT_SUPPORTED | CUPTI_ERROR_SLI_DEVICE_NOT_SUPPORTED) => {
            ("CUPTI does not profile this kind of device", "audit on a data-center or desktop GPU")
        }
        (_, CUPTI_ERROR_WSL_DEVICE_NOT_SUPPORTED) => {
            ("CUPTI does not profile this GPU under WSL", "audit on a native Linux machine")
        }
        (_, CUPTI_ERROR_INVALID_CHIP_NAME) => {
            ("this CUPTI does not know the GPU's chip", "use the CUPTI of a CUDA toolkit at least as new as the GPU")
        }
        (_, CUPTI_ERROR_OLD_PROFILER_API_INITIALIZED) => (
            "CUPTI's legacy event or metric API was used earlier in this process",
            "do not use it in a process that audits",
        ),
        ("cuptiProfilerHostInitialize", CUPTI_ERROR_NOT_INITIALIZED) => (
            "CUPTI's profiler host library could not be loaded (libnvperf_host.so)",
            "put the folder that holds it (the CUDA toolkit's lib64) on LD_LIBRARY_PATH",
        ),
        ("cuptiProfilerInitialize", _) => (
            "CUPTI's profiler could not initialise",
            "check that libnvperf_target.so is on LD_LIBRARY_PATH beside libcupti.so and that the driver is loaded",
        ),
        ("cuptiProfilerHostConfigAddMetrics", CUPTI_ERROR_INVALID_PARAMETER | CUPTI_ERROR_INVALID_METRIC_NAME) => {
            ("a metric name is not known on this chip", "check the names (e.g. dram__bytes_read.sum)")
        }
        ("cuptiRangeProfilerSetConfig", CUPTI_ERROR_INVALID_OPERATION) => {
            ("CUPTI refused the range configuration", "lower max_ranges: the counter buffer holds a few thousand")
        }
        (_, CUPTI_ERROR_NOT_SUPPORTED) => (
            "this device or driver does not support range profiling",
            "use a driver and CUPTI of CUDA 12.6 or newer on a Turing or newer GPU",
        ),
        _ => return None,
    })
}

fn describe_call(call: &str, code: CUptiResult) -> String {
    match advice(call, code) {
        Some((what, fix)) => format!("{what} ({call} returned {code:?}): {fix}"),
        None => format!("{call} returned {code:?}: unexpected; report it with the CUPTI and driver versions"),
    }
}

/// The flags of `cuptiProfilerDeviceSupported`, by name, as CUPTI wrote them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Support {
    pub overall: u32,
    pub architecture: u32,
    pub sli: u32,
    pub vgpu: u32,
    pub confidential_compute: u32,
    pub cmp: u32,
    pub wsl: u32,
}

const SUPPORTED: u32 = CUpti_Profiler_Support_Level::CUPTI_PROFILER_CONFIGURATION_SUPPORTED as u32;
const UNSUPPORTED: u32 = CUpti_Profiler_Support_Level::CUPTI_PROFILER_CONFIGURATION_UNSUPPORTED as u32;
const DISABLED: u32 = CUpti_Profiler_Support_Level::CUPTI_PROFILER_CONFIGURATION_DISABLED as u32;

impl Support {
    /// `Err` with every reason CUPTI gives when it says the device cannot be profiled. An unknown
    /// overall level passes: the calls that follow fail with their own codes if profiling is
    /// really impossible.
    pub fn check(&self) -> Result<(), AuditError> {
        if self.overall != UNSUPPORTED && self.overall != DISABLED {
            return Ok(());
        }
        let flags: [(u32, &str); 6] = [
            (self.architecture, "the GPU's architecture has no range profiling (Turing or newer is needed)"),
            (self.sli, "SLI is enabled"),
            (self.vgpu, "profiling is not enabled on this virtual GPU (the hypervisor must allow it)"),
            (self.confidential_compute, "confidential computing is on"),
            (self.cmp, "the GPU is a crypto-mining processor"),
            (self.wsl, "WSL does not support profiling on this system"),
        ];
        let reasons: Vec<&str> = flags.iter().filter(|(level, _)| *level != SUPPORTED).map(|(_, why)| *why).collect();
        let reasons = if reasons.is_empty() {
            format!("unsupported without a reason given (isSupported = {})", self.overall)
        } else {
            reasons.join("; ")
        };
        Err(AuditError::DeviceUnsupported { reasons })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(call: &'static str, code: CUptiResult) -> String {
        AuditError::Call { call, code }.to_string()
    }

    #[test]
    fn restricted_counters_say_what_to_do() {
        let msg = call("cuptiProfilerGetCounterAvailability", CUptiResult::CUPTI_ERROR_INSUFFICIENT_PRIVILEGES);
        assert_eq!(
            msg,
            "the GPU's hardware counters are not accessible to this user (cuptiProfilerGetCounterAvailability \
             returned CUPTI_ERROR_INSUFFICIENT_PRIVILEGES): run as root, or load the nvidia kernel module with \
             NVreg_RestrictProfilingToAdminUsers=0"
        );
    }

    #[test]
    fn the_same_code_means_different_things_in_different_calls() {
        let host = call("cuptiProfilerHostInitialize", CUptiResult::CUPTI_ERROR_NOT_INITIALIZED);
        assert!(host.starts_with("CUPTI's profiler host library could not be loaded (libnvperf_host.so)"), "{host}");
        assert!(host.contains("LD_LIBRARY_PATH"), "{host}");
        let metric = call("cuptiProfilerHostConfigAddMetrics", CUptiResult::CUPTI_ERROR_INVALID_PARAMETER);
        assert!(metric.starts_with("a metric name is not known on this chip"), "{metric}");
        let other = call("cuptiRangeProfilerPushRange", CUptiResult::CUPTI_ERROR_INVALID_PARAMETER);
        assert_eq!(
            other,
            "cuptiRangeProfilerPushRange returned CUPTI_ERROR_INVALID_PARAMETER: unexpected; report it with the \
             CUPTI and driver versions"
        );
    }

    #[test]
    fn every_environment_code_has_advice() {
        use CUptiResult::*;
        for code in [
            CUPTI_ERROR_INSUFFICIENT_PRIVILEGES,
            CUPTI_ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES,
            CUPTI_ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED,
            CUPTI_ERROR_HARDWARE_BUSY,
            CUPTI_ERROR_MIG_DEVICE_NOT_SUPPORTED,
            CUPTI_ERROR_CONFIDENTIAL_COMPUTING_NOT_SUPPORTED,
            CUPTI_ERROR_CMP_DEVICE_NOT_SUPPORTED,
            CUPTI_ERROR_SLI_DEVICE_NOT_SUPPORTED,
            CUPTI_ERROR_WSL_DEVICE_NOT_SUPPORTED,
            CUPTI_ERROR_INVALID_CHIP_NAME,
            CUPTI_ERROR_NOT_SUPPORTED,
        ] {
            let msg = call("cuptiRangeProfilerEnable", code);
            assert!(advice("cuptiRangeProfilerEnable", code).is_some(), "{code:?}");
            assert!(msg.contains(&format!("(cuptiRangeProfilerEnable returned {code:?}): ")), "{msg}");
        }
    }

    fn support(overall: u32) -> Support {
        Support {
            overall,
            architecture: SUPPORTED,
            sli: SUPPORTED,
            vgpu: SUPPORTED,
            confidential_compute: SUPPORTED,
            cmp: SUPPORTED,
            wsl: SUPPORTED,
        }
    }

    #[test]
    fn device_support_names_every_reason() {
        assert!(support(SUPPORTED).check().is_ok());
        // CUPTI could not tell: the calls that follow decide.
        assert!(support(0).check().is_ok());
        let vgpu = Support { vgpu: DISABLED, confidential_compute: UNSUPPORTED, ..support(UNSUPPORTED) };
        assert_eq!(
            vgpu.check().unwrap_err().to_string(),
            "CUPTI reports that this GPU cannot be profiled: profiling is not enabled on this virtual GPU (the \
             hypervisor must allow it); confidential computing is on"
        );
        let silent = support(DISABLED).check().unwrap_err().to_string();
        assert!(silent.ends_with("unsupported without a reason given (isSupported = 2)"), "{silent}");
    }
}
