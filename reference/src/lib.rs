//! The CPU golden model of the layer and the eager GPU reference, with the reference's kernels
//! (`kernels/reference.cu`, one per elementary op) and the device side of the data recipe
//! (`kernels/rng.cu`).

pub mod golden;
pub mod gpu;
pub mod kernels;
