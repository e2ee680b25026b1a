//! Compiles `kernels/megakernel.cu` (bulk copies and mbarriers: Hopper only) with the workspace's nvcc,
//! and puts the CUDA library folders on the `megakernel` command's run path.

fn main() {
    let toolchain = cuda_build::Toolchain::from_cuda();
    cuda_build::build(&toolchain, cuda_build::Files { hopper_only: &["megakernel.cu"], rdc: &[] }, "");
    cuda_build::link_cuda_run_path();
}
