//! The reference's kernel files: `kernels/reference/reference.cu` (the eager ops) and
//! `kernels/reference/rng.cu` (the data recipe on the device), compiled by the root build script.

pub use ::kernels::reference::*;
