//! DLPack's structs (`dlpack.h` 0.8, the unversioned `DLManagedTensor` that a capsule named
//! "dltensor" carries), laid out as the header lays them out: the one definition of them for the
//! crates that hand device memory to Python (the Python submissions' runner, the model's bindings) or
//! take tensors from it.

use std::ffi::c_void;

/// `DLDeviceType`: host memory.
pub const DEVICE_CPU: i32 = 1;
/// `DLDeviceType`: CUDA device memory.
pub const DEVICE_CUDA: i32 = 2;
/// `DLDeviceType`: CUDA pinned host memory.
pub const DEVICE_CUDA_HOST: i32 = 3;
/// `DLDeviceType`: CUDA managed memory.
pub const DEVICE_CUDA_MANAGED: i32 = 13;
/// `DLDataTypeCode`: IEEE floats.
pub const CODE_FLOAT: u8 = 2;
/// `DLDataTypeCode`: bfloat16.
pub const CODE_BFLOAT: u8 = 4;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DlDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DlDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub struct DlTensor {
    pub data: *mut c_void,
    pub device: DlDevice,
    pub ndim: i32,
    pub dtype: DlDataType,
    pub shape: *mut i64,
    /// In elements; null for a compact row-major tensor.
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DlManagedTensor {
    pub dl_tensor: DlTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout dlpack.h fixes (x86-64 and aarch64): torch reads these offsets.
    #[test]
    fn the_structs_have_dlpacks_layout() {
        assert_eq!(std::mem::offset_of!(DlTensor, device), 8);
        assert_eq!(std::mem::offset_of!(DlTensor, ndim), 16);
        assert_eq!(std::mem::offset_of!(DlTensor, dtype), 20);
        assert_eq!(std::mem::offset_of!(DlTensor, shape), 24);
        assert_eq!(std::mem::offset_of!(DlTensor, byte_offset), 40);
        assert_eq!(size_of::<DlTensor>(), 48);
        assert_eq!(std::mem::offset_of!(DlManagedTensor, deleter), 56);
    }
}
