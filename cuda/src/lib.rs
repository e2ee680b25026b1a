//! The CUDA side every crate shares: a thin runtime over cudarc ([`Device`]) that opens the card with
//! a clear error for each way that can fail and records the facts a report needs; how a crate embeds
//! the kernels its build script compiled ([`kernels`]); the device headers of `include/` that every
//! crate's kernels may include; and the bulk read stream, launched by the grader and the red team.

// The generated kernel constants name `cuda::kernels::Kernel`, here as in every other crate.
extern crate self as cuda;

mod device;
mod error;
pub mod ipc;
pub mod kernels;

pub use cudarc;
pub use device::{Device, DeviceFacts, grid_1d};
pub use error::{Context, CudaError};
