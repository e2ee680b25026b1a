//! The CUDA side of persistent-layer: every `kernels/*.cu` compiled by build.rs and embedded as a
//! fatbin ([`kernels`]), and a thin runtime over cudarc ([`Device`]) that opens the card with a clear
//! error for each way that can fail and records the facts a report needs.

mod device;
mod error;
pub mod ipc;
pub mod kernels;

pub use cudarc;
pub use device::{Device, DeviceFacts, grid_1d};
pub use error::{Context, CudaError};
