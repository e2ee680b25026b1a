//! The buffers next to the ones a call is given. `grader run` places every call's input, then every
//! call's output, one after another in one region of device memory, each a row of `d` bf16 rounded up
//! to the region's alignment; so a call's own `x` and `out` say where later calls' inputs and outputs
//! will be. lookahead and batcher reach for them this way, each checking that what it reaches is
//! inside the allocation that holds the buffer it was given.

use cuda::cudarc::driver::sys::{self, CUdeviceptr};
use cuda::cudarc::driver::{CudaSlice, DevicePtr};
use cuda::ipc::{Borrowed, VIEW_ALIGN};
use cuda::{Context, Device};
use half::bf16;
use spec::Config;

use submission::SubmissionError;

/// Bytes from one call's input (or output) buffer to the next call's: a row of `d` bf16, rounded up
/// to the alignment of every buffer in the region.
pub fn buffer_stride(cfg: &Config) -> usize {
    (cfg.batch * cfg.d * size_of::<bf16>()).next_multiple_of(VIEW_ALIGN)
}

/// The allocation holding `ptr`: its base address and size in bytes.
fn allocation_of(dev: &Device, ptr: CUdeviceptr) -> Result<(CUdeviceptr, usize), SubmissionError> {
    dev.ctx().bind_to_thread().context("binding the context")?;
    let (mut base, mut bytes): (CUdeviceptr, usize) = (0, 0);
    // SAFETY: two valid out-pointers; the context is current (bound above). The driver only looks
    // the address up.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut bytes, ptr) }
        .result()
        .context("looking up the allocation of a call's buffer")?;
    Ok((base, bytes))
}

/// The buffer as long as `buf` that starts `strides` times `stride` bytes after it, as a view that
/// frees nothing; refused when it would run past the allocation holding `buf`.
pub fn buffer_after(
    dev: &Device,
    buf: &CudaSlice<bf16>,
    strides: usize,
    stride: usize,
) -> Result<Borrowed<CudaSlice<bf16>>, SubmissionError> {
    let start = buf.device_ptr(dev.stream()).0;
    let (base, bytes) = allocation_of(dev, start)?;
    let offset = strides.checked_mul(stride).and_then(|o| o.checked_add(buf.len() * size_of::<bf16>()));
    let inside = offset.is_some_and(|end| start - base + end as u64 <= bytes as u64);
    if !inside {
        return Err(SubmissionError::Refused(format!(
            "the buffer {strides} stride(s) after a call's is outside its allocation: the buffers are not laid out as \
             `grader run` lays them out"
        )));
    }
    let at = start + (strides * stride) as u64;
    // SAFETY: `at .. at + 2 * buf.len()` lies inside the live allocation that holds `buf` (checked
    // above), which the caller keeps for the whole run; bf16 has no invalid bit patterns. `Borrowed`
    // leaks the slice instead of freeing it.
    let view = unsafe { dev.stream().upgrade_device_ptr::<bf16>(at, buf.len()) };
    Ok(Borrowed::new(view, |v| {
        v.leak();
    }))
}
