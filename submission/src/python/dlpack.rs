//! DLPack (`dlpack.h`, the legacy unversioned `DLManagedTensor`): how the runner's device buffers
//! reach Python as tensors without a copy. Each tensor is a capsule named `"dltensor"` that
//! `torch.utils.dlpack.from_dlpack` consumes; torch keeps the pointer and calls the deleter when its
//! tensor dies. The deleter is null (the runner owns the memory) and the struct itself is leaked on
//! purpose: a submission may keep a tensor past teardown, and torch reads the struct when it frees
//! one, so it must outlive the interpreter (a few dozen structs of 100 bytes per run).

use std::ffi::c_void;

use cuda::dlpack::{CODE_BFLOAT, DEVICE_CUDA, DlDataType, DlDevice, DlManagedTensor, DlTensor};

/// The most dimensions a tensor of the contract has (the cache: batch, n_kv, slots, hd).
const MAX_DIMS: usize = 4;

/// A managed tensor and the shape and strides it points to, in one allocation.
#[repr(C)]
struct Described {
    managed: DlManagedTensor,
    shape: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
}

/// A row-major bf16 tensor of `shape` at device address `data` on CUDA device `ordinal`, as the
/// pointer a `"dltensor"` capsule carries. Never freed (see the module's comment).
pub fn bf16_tensor(data: u64, shape: &[usize], ordinal: usize) -> Result<*mut c_void, String> {
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(format!("a tensor of {} dimensions", shape.len()));
    }
    let int = |v: usize| i64::try_from(v).map_err(|_| format!("a dimension of {v} elements"));
    let (mut dims, mut strides) = ([0i64; MAX_DIMS], [0i64; MAX_DIMS]);
    let mut stride = 1i64;
    for i in (0..shape.len()).rev() {
        dims[i] = int(shape[i])?;
        strides[i] = stride;
        stride = stride.checked_mul(dims[i]).ok_or("a tensor of more than 2^63 elements")?;
    }
    let described = Box::leak(Box::new(Described {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: data as *mut c_void,
                device: DlDevice {
                    device_type: DEVICE_CUDA,
                    device_id: i32::try_from(ordinal).map_err(|_| "a device ordinal")?,
                },
                ndim: shape.len() as i32,
                dtype: DlDataType { code: CODE_BFLOAT, bits: 16, lanes: 1 },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: None,
        },
        shape: dims,
        strides,
    }));
    // The struct is leaked, so pointers into it stay valid for the life of the process.
    described.managed.dl_tensor.shape = described.shape.as_mut_ptr();
    described.managed.dl_tensor.strides = described.strides.as_mut_ptr();
    Ok((&mut described.managed as *mut DlManagedTensor).cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bf16_tensor_is_described_row_major() {
        let p = bf16_tensor(0xdead_0000, &[2, 3, 4], 1).unwrap().cast::<DlManagedTensor>();
        // SAFETY: a leaked, initialised struct.
        let t = unsafe { &(*p).dl_tensor };
        // SAFETY: three dimensions were described.
        let (shape, strides) =
            unsafe { (std::slice::from_raw_parts(t.shape, 3), std::slice::from_raw_parts(t.strides, 3)) };
        assert_eq!(
            (shape, strides, t.device.device_id, t.data as u64),
            ([2, 3, 4].as_slice(), [12, 4, 1].as_slice(), 1, 0xdead_0000)
        );
        assert!(bf16_tensor(0, &[], 0).is_err());
    }
}
