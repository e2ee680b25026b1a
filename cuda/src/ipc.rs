//! Device memory that one process allocates and another maps, through CUDA IPC.
//!
//! The judge owns every buffer a submission works on (weights, KV cache, each call's input and
//! output) in one [`SharedRegion`], and the runner process maps it: the judge writes each input just
//! before its call and reads each output itself right after, without asking the runner. One
//! allocation means one handle to pass and one mapping to close.
//!
//! The region comes from `cuMemAlloc`, not the stream-ordered pool cudarc allocates from: pool memory
//! cannot be exported with `cuIpcGetMemHandle`. Views into it are ordinary [`CudaSlice`]s (so every
//! kernel launcher takes them), held in a [`Borrowed`] that gives the pointer back instead of freeing
//! it: only the region frees (or unmaps) its memory.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};

use cudarc::driver::CudaSlice;
use cudarc::driver::sys::{self, CUdeviceptr, CUipcMem_flags_enum, CUipcMemHandle};
use serde::{Deserialize, Serialize};

use crate::device::Device;
use crate::error::{Context, CudaError};

/// Alignment of every view's offset: the C ABI promises 256-byte aligned buffers.
pub const VIEW_ALIGN: usize = 256;

/// A `CUipcMemHandle` that travels as text (hex) in a job description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionHandle {
    pub bytes: usize,
    pub handle_hex: String,
}

/// One device allocation, either made here (and exportable) or opened from another process's handle.
pub struct SharedRegion {
    base: CUdeviceptr,
    bytes: usize,
    /// Made here with `cuMemAlloc` (freed on drop), or opened with `cuIpcOpenMemHandle` (closed).
    owned: bool,
    dev: DeviceRef,
}

/// What a region needs to give its memory back: the stream (and so the context) it was made on.
#[derive(Clone)]
struct DeviceRef(std::sync::Arc<cudarc::driver::CudaStream>);

impl SharedRegion {
    /// Allocates `bytes` on `dev`'s context, exportable to other processes.
    pub fn allocate(dev: &Device, bytes: usize) -> Result<Self, CudaError> {
        dev.ctx().bind_to_thread().context("making the context current")?;
        let mut base: CUdeviceptr = 0;
        // SAFETY: cuMemAlloc_v2 writes one device pointer through a valid out-pointer; the context is
        // current (bound above).
        unsafe { sys::cuMemAlloc_v2(&mut base, bytes) }.result().context("allocating the shared region")?;
        Ok(Self { base, bytes, owned: true, dev: DeviceRef(dev.stream().clone()) })
    }

    /// The handle another process opens with [`SharedRegion::open`].
    pub fn handle(&self) -> Result<RegionHandle, CudaError> {
        let mut handle = CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `base` is a live cuMemAlloc allocation of this process; the out-pointer is valid.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.base) }.result().context("exporting the shared region")?;
        let handle_hex = handle.reserved.iter().map(|&b| format!("{:02x}", b as u8)).collect();
        Ok(RegionHandle { bytes: self.bytes, handle_hex })
    }

    /// Maps the region another process exported, into `dev`'s context.
    pub fn open(dev: &Device, h: &RegionHandle) -> Result<Self, CudaError> {
        let raw = decode_hex(&h.handle_hex).ok_or_else(|| CudaError::WrongResult("a malformed IPC handle".into()))?;
        let mut handle = CUipcMemHandle { reserved: [0; 64] };
        for (dst, src) in handle.reserved.iter_mut().zip(raw) {
            *dst = src as _;
        }
        dev.ctx().bind_to_thread().context("making the context current")?;
        let mut base: CUdeviceptr = 0;
        let flags = CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: the handle came from cuIpcGetMemHandle in the judge, which keeps the allocation alive
        // until this process has exited; the out-pointer is valid; the context is current.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, handle, flags) }
            .result()
            .context("opening the judge's shared region")?;
        Ok(Self { base, bytes: h.bytes, owned: false, dev: DeviceRef(dev.stream().clone()) })
    }

    /// `len` elements of `T` at byte `offset`, as a slice that must not outlive the region.
    ///
    /// # Panics
    /// When the view is misaligned or runs past the region (a layout bug, never input-dependent).
    pub fn view<T>(&self, offset: usize, len: usize) -> Borrowed<CudaSlice<T>> {
        assert!(offset.is_multiple_of(VIEW_ALIGN), "view offset {offset} is not {VIEW_ALIGN}-byte aligned");
        let end = offset.checked_add(len * size_of::<T>()).expect("view size overflows");
        assert!(end <= self.bytes, "view {offset}..{end} runs past the {}-byte region", self.bytes);
        // SAFETY: the range lies inside the region's live allocation (asserted above); `Borrowed`
        // leaks the slice instead of freeing it, and callers drop views before the region.
        let slice = unsafe { self.dev.0.upgrade_device_ptr::<T>(self.base + offset as CUdeviceptr, len) };
        Borrowed::new(slice, |s| {
            s.leak();
        })
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // A context that is already gone (process exit) cannot be helped; nothing to report then.
        let _ = self.dev.0.context().bind_to_thread();
        // SAFETY: `base` is this region's allocation (owned) or mapping (opened), released once.
        let _ = unsafe { if self.owned { sys::cuMemFree_v2(self.base) } else { sys::cuIpcCloseMemHandle(self.base) } };
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() != 128 {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// A value holding device pointers it does not own (views into a [`SharedRegion`]): on drop,
/// `release` hands them back without freeing anything.
pub struct Borrowed<T> {
    value: ManuallyDrop<T>,
    release: fn(T),
}

impl<T> Borrowed<T> {
    pub fn new(value: T, release: fn(T)) -> Self {
        Self { value: ManuallyDrop::new(value), release }
    }

    /// Builds a compound value (weights, a cache) from views: `make` takes the views' slices, and
    /// `release` must leak every slice of the result.
    pub fn compose<U>(
        parts: Vec<Borrowed<CudaSlice<U>>>,
        make: impl FnOnce(Vec<CudaSlice<U>>) -> T,
        release: fn(T),
    ) -> Self {
        let slices = parts.into_iter().map(Borrowed::into_inner).collect();
        Self::new(make(slices), release)
    }

    /// The value, no longer released on drop: the caller takes over giving its pointers back.
    fn into_inner(self) -> T {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the value is taken exactly once.
        unsafe { ManuallyDrop::take(&mut this.value) }
    }
}

impl<T> Deref for Borrowed<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> DerefMut for Borrowed<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // SAFETY: drop runs once; the value is not used afterwards.
        let value = unsafe { ManuallyDrop::take(&mut self.value) };
        (self.release)(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_through_hex() {
        let bytes: Vec<u8> = (0..64).map(|i| (i * 37 % 256) as u8).collect();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(decode_hex(&hex), Some(bytes));
        assert_eq!(decode_hex("00"), None, "a handle is 64 bytes");
        assert_eq!(decode_hex(&"zz".repeat(64)), None);
    }

    #[test]
    fn borrowed_values_are_released_once_and_never_dropped() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static RELEASED: AtomicUsize = AtomicUsize::new(0);
        {
            let b = Borrowed::new(vec![1, 2, 3], |v| {
                assert_eq!(v, vec![1, 2, 3]);
                RELEASED.fetch_add(1, Ordering::SeqCst);
            });
            assert_eq!(b.len(), 3);
        }
        assert_eq!(RELEASED.load(Ordering::SeqCst), 1);
    }
}
