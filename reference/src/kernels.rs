//! The reference's kernel files: `kernels/reference.cu` (the eager ops) and `kernels/rng.cu` (the
//! data recipe on the device), compiled by build.rs and embedded.

cuda::embed_kernels!();
