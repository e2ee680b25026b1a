//! Switching the runner's kernel records off and on from inside the submission, as any library in its
//! process can: CUPTI is one per process, and `cuda::cudarc::cupti::sys` reaches the very libcupti the
//! runner loaded (a library of its own would reach it with `dlopen("libcupti.so", RTLD_NOLOAD)`).
//! Shared by recording-off and recording-off-waiter.

use cuda::Device;
use cuda::cudarc::cupti::sys::{self, CUpti_ActivityKind, CUptiResult};
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;

use submission::{Layer, SubmissionError};

/// The activity kind the runner records kernels with.
const KERNEL_RECORDS: CUpti_ActivityKind = CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;

/// Refuses where libcupti cannot be loaded: there is no recording to switch off then, and cudarc would
/// panic on the first CUPTI call.
pub fn require_cupti() -> Result<(), SubmissionError> {
    // SAFETY: only dlopens libcupti and reports whether it loaded.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(SubmissionError::Refused("libcupti cannot be loaded: there is no recording to switch off".into()))
    }
}

/// Switches CUPTI's kernel records on or off for the whole process.
fn kernel_records(on: bool) -> Result<(), SubmissionError> {
    // SAFETY: libcupti is present (require_cupti, in build_layer); both calls take a plain enum and
    // change only CUPTI's own state.
    let r = unsafe {
        if on { sys::cuptiActivityEnable(KERNEL_RECORDS) } else { sys::cuptiActivityDisable(KERNEL_RECORDS) }
    };
    if r == CUptiResult::CUPTI_SUCCESS {
        Ok(())
    } else {
        let call = if on { "cuptiActivityEnable" } else { "cuptiActivityDisable" };
        Err(SubmissionError::Refused(format!("{call}(CONCURRENT_KERNEL) failed: {r:?}")))
    }
}

/// The eager step with CUPTI's kernel records off from just after its first launch, `also_hidden`
/// enqueued while they are off, and the records switched back on before returning, whatever failed.
pub fn step_mostly_hidden(
    eager: &mut Eager,
    dev: &Device,
    layer: &mut Layer<'_>,
    x: &CudaSlice<bf16>,
    pos: usize,
    out: &mut CudaSlice<bf16>,
    also_hidden: impl FnOnce() -> Result<(), SubmissionError>,
) -> Result<(), SubmissionError> {
    let mut off = Ok(());
    let stepped =
        eager.step_after_first_launch(dev, layer.weights, layer.cache, x, pos, out, || off = kernel_records(false));
    let hidden = stepped.map_err(SubmissionError::from).and(off).and_then(|()| also_hidden());
    let on = kernel_records(true);
    hidden.and(on)
}
