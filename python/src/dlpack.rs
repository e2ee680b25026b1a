//! DLPack, the tensor-exchange protocol torch, numpy, JAX and CuPy speak (dmlc/dlpack's `dlpack.h`,
//! version 0.8's unversioned `DLManagedTensor` in a capsule named "dltensor"): logits handed out as
//! a tensor on the GPU without a copy through the host, and a loaded model's weights taken in by their
//! `__dlpack__` without a detour through disk.
//!
//! Ownership follows the protocol: a capsule that no consumer renamed to "used_dltensor" still owns
//! its tensor, and its destructor calls the tensor's deleter; a consumer that took the tensor renames
//! the capsule and calls the deleter itself when done with the memory.

use std::ffi::{CStr, c_void};
use std::ptr;

use cuda::cudarc::driver::result::memcpy_dtoh_sync;
use cuda::cudarc::driver::{CudaSlice, DevicePtr};
use cuda::dlpack::{
    CODE_BFLOAT, CODE_FLOAT, DEVICE_CPU, DEVICE_CUDA, DEVICE_CUDA_HOST, DEVICE_CUDA_MANAGED, DlDataType, DlDevice,
    DlManagedTensor, DlTensor,
};
use half::bf16;
use megakernel::model::Element;
use pyo3::ffi;
use pyo3::prelude::*;

const CAPSULE: &CStr = c"dltensor";
const USED: &CStr = c"used_dltensor";

/// f32 logits on the GPU, owned by the tensor that hands them out.
#[repr(C)]
struct DeviceLogits {
    /// First, so that the tensor's address is the allocation's.
    managed: DlManagedTensor,
    shape: [i64; 1],
    /// Given although a compact tensor may leave them null: not every consumer computes them.
    strides: [i64; 1],
    logits: CudaSlice<f32>,
}

unsafe extern "C" fn drop_device_logits(managed: *mut DlManagedTensor) {
    // SAFETY: `managed` is the first field of the DeviceLogits boxed in `export_logits`, whose
    // manager_ctx is that box; the protocol calls the deleter once.
    unsafe { drop(Box::from_raw((*managed).manager_ctx as *mut DeviceLogits)) }
}

/// A capsule's destructor: the tensor still owned (no consumer renamed the capsule) is deleted.
unsafe extern "C" fn drop_unconsumed(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed; IsValid sets no exception.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, CAPSULE.as_ptr()) as *mut DlManagedTensor;
            if let Some(delete) = (*managed).deleter {
                delete(managed);
            }
        }
    }
}

/// `logits` (a vector of f32 on GPU `ordinal`, complete on the device) as a DLPack capsule that owns
/// them: `torch.from_dlpack` makes it a tensor on that GPU without a copy.
pub fn export_logits(py: Python<'_>, logits: CudaSlice<f32>, ordinal: usize) -> PyResult<Py<PyAny>> {
    let len = logits.len() as i64;
    let data = logits.device_ptr(logits.stream()).0 as *mut c_void;
    let mut owned = Box::new(DeviceLogits {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data,
                device: DlDevice { device_type: DEVICE_CUDA, device_id: ordinal as i32 },
                ndim: 1,
                dtype: DlDataType { code: CODE_FLOAT, bits: 32, lanes: 1 },
                shape: ptr::null_mut(),
                strides: ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: ptr::null_mut(),
            deleter: Some(drop_device_logits),
        },
        shape: [len],
        strides: [1],
        logits,
    });
    // The box does not move from here on: the shape's, the strides' and the box's own addresses stay
    // valid.
    owned.managed.dl_tensor.shape = owned.shape.as_mut_ptr();
    owned.managed.dl_tensor.strides = owned.strides.as_mut_ptr();
    let raw = Box::into_raw(owned);
    // SAFETY: raw is a live DeviceLogits; manager_ctx points at it.
    unsafe { (*raw).managed.manager_ctx = raw as *mut c_void };
    // SAFETY: a capsule of the tensor under the protocol's name, with the destructor above; on
    // failure (no capsule made) the tensor is deleted here.
    unsafe {
        let capsule = ffi::PyCapsule_New(raw as *mut c_void, CAPSULE.as_ptr(), Some(drop_unconsumed));
        if capsule.is_null() {
            drop_device_logits(raw as *mut DlManagedTensor);
            return Err(PyErr::fetch(py));
        }
        Ok(Py::from_owned_ptr(py, capsule))
    }
}

/// A tensor taken from its producer: deleted (its deleter called) when this is dropped.
struct Taken(*mut DlManagedTensor);

impl Drop for Taken {
    fn drop(&mut self) {
        // SAFETY: the consumer of a renamed capsule calls its tensor's deleter once.
        unsafe {
            if let Some(delete) = (*self.0).deleter {
                delete(self.0);
            }
        }
    }
}

/// Reads GPU memory into the host (`address`, `len` bytes) for a tensor on GPU `ordinal`.
pub type GpuRead<'a> = dyn FnMut(usize, u64, &mut [u8]) -> Result<(), String> + 'a;

/// The tensor `obj` (anything with `__dlpack__`) as bf16, checked to have `shape` and a compact
/// row-major layout and to be bf16, f16 or f32 (the folder loader's conversions); memory on a GPU is
/// read through `gpu`. The refusal says what is wrong, for the caller to name the tensor.
pub fn take_tensor(obj: &Bound<'_, PyAny>, shape: &[usize], gpu: &mut GpuRead<'_>) -> Result<Vec<bf16>, String> {
    if !obj.hasattr("__dlpack__").unwrap_or(false) {
        return Err(format!("a {}, not a tensor (no __dlpack__)", type_name(obj)));
    }
    let capsule = obj.call_method0("__dlpack__").map_err(|e| format!("__dlpack__ failed: {e}"))?;
    let cap = capsule.as_ptr();
    // SAFETY: IsValid checks the object and the name without raising; the pointer of a valid
    // "dltensor" capsule is a DLManagedTensor the producer keeps alive until its deleter runs.
    let taken = unsafe {
        if ffi::PyCapsule_IsValid(cap, CAPSULE.as_ptr()) != 1 {
            return Err("__dlpack__ gave no unused \"dltensor\" capsule".into());
        }
        let managed = ffi::PyCapsule_GetPointer(cap, CAPSULE.as_ptr()) as *mut DlManagedTensor;
        // Ours from here: the capsule's destructor must not delete the tensor too.
        if ffi::PyCapsule_SetName(cap, USED.as_ptr()) != 0 {
            ffi::PyErr_Clear();
            return Err("the capsule could not be marked as used".into());
        }
        Taken(managed)
    };
    // SAFETY: the tensor lives until `taken` drops (its deleter runs).
    let t = unsafe { &(*taken.0).dl_tensor };
    // SAFETY: a DLTensor's shape has ndim entries, and so do its strides when not null.
    let (dims, strides) = unsafe {
        let n = usize::try_from(t.ndim).unwrap_or(0);
        let dims = if n == 0 { &[][..] } else { std::slice::from_raw_parts(t.shape, n) };
        let strides = (!t.strides.is_null() && n > 0).then(|| std::slice::from_raw_parts(t.strides, n));
        (dims, strides)
    };
    if dims.len() != shape.len() || dims.iter().zip(shape).any(|(&d, &s)| d != s as i64) {
        return Err(format!("shape {dims:?}, expected {shape:?}"));
    }
    if let Some(strides) = strides {
        let mut want = 1i64;
        for (&d, &s) in dims.iter().zip(strides).rev() {
            if d != 1 && s != want {
                return Err(format!(
                    "strides {strides:?} of shape {dims:?}: not compact row-major (take .contiguous())"
                ));
            }
            want *= d;
        }
    }
    let element = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
        (CODE_BFLOAT, 16, 1) => Element::Bf16,
        (CODE_FLOAT, 16, 1) => Element::F16,
        (CODE_FLOAT, 32, 1) => Element::F32,
        (code, bits, lanes) => {
            return Err(format!(
                "DLPack dtype code {code}, {bits} bits, {lanes} lanes: the loader reads bf16, f16 and f32"
            ));
        }
    };
    let count: usize = shape.iter().product();
    let mut bytes = vec![0u8; count * element.bytes()];
    let address = t.data as u64 + t.byte_offset;
    match t.device.device_type {
        DEVICE_CPU | DEVICE_CUDA_HOST => {
            let len = bytes.len();
            // SAFETY: a compact tensor of `count` elements at `address` in host memory (checked above).
            let host = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
            bytes.copy_from_slice(host)
        }
        DEVICE_CUDA | DEVICE_CUDA_MANAGED => gpu(t.device.device_id.max(0) as usize, address, &mut bytes)?,
        other => return Err(format!("on DLPack device type {other}: the loader reads host and CUDA memory")),
    }
    drop(taken);
    Ok(element.to_bf16(&bytes))
}

/// Copies `dst.len()` bytes from GPU address `src` (the calling thread's context current).
pub fn read_device(src: u64, dst: &mut [u8]) -> Result<(), String> {
    // SAFETY: the caller's tensor holds `dst.len()` bytes at `src` in the current context's address space.
    unsafe { memcpy_dtoh_sync(dst, src) }.map_err(|e| format!("reading it from the GPU: {e:?}"))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
}
