//! The megakernel's kernel file, `kernels/megakernel.cu` (with the program's layout, `kernels/program.cuh`),
//! compiled by build.rs for Hopper and embedded.

cuda::embed_kernels!();
