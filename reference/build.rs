//! Compiles the reference's kernels (`kernels/*.cu`) with the workspace's nvcc.

fn main() {
    cuda_build::build(&cuda_build::Toolchain::from_cuda(), cuda_build::Files::default(), "");
}
