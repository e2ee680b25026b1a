//! The CUDA side every crate shares: a thin runtime over cudarc ([`Device`]) that opens the card with
//! a clear error for each way that can fail and records the facts a report needs; the embedded
//! kernels as every crate names them ([`kernels`]); DLPack's structs ([`dlpack`]), how device memory
//! crosses into Python; and the bulk read stream, launched by the grader and the red team.

mod device;
pub mod dlpack;
mod error;
pub mod ipc;
pub mod kernels;

pub use cudarc;
pub use device::{Device, DeviceFacts, grid_1d};
pub use error::{Context, CudaError};
