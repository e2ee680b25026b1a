//! The CPU golden model of the layer and the eager GPU reference, with the reference's kernels
//! (`kernels/reference/reference.cu`, one per elementary op) and the device side of the data recipe
//! (`kernels/reference/rng.cu`).

pub mod golden;
pub mod gpu;
pub mod kernels;
