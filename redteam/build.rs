//! Compiles the red team's kernels with the workspace's nvcc: `redteam_cdp.cu` launches kernels from
//! the device, so it is relocatable device code, device-linked against libcudadevrt.a.

fn main() {
    let toolchain = cuda_build::Toolchain::from_cuda();
    cuda_build::build(&toolchain, cuda_build::Files { hopper_only: &[], rdc: &["redteam_cdp.cu"] }, "");
}
