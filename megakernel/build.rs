//! Compiles `kernels/megakernel.cu` (bulk copies and mbarriers: Hopper only) with the workspace's nvcc.

fn main() {
    let toolchain = cuda_build::Toolchain::from_cuda();
    cuda_build::build(&toolchain, cuda_build::Files { hopper_only: &["megakernel.cu"], rdc: &[] }, "");
}
