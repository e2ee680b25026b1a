//! cudarc dlopens libcuda, libnvrtc and libcupti by name at run time. Add the standard CUDA library
//! folders to the binary's run path so a default install is found without LD_LIBRARY_PATH (which
//! still takes precedence).
fn main() {
    for dir in ["/usr/local/cuda/lib64", "/usr/local/cuda/extras/CUPTI/lib64", "/usr/local/nvidia/lib64"] {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{dir}");
    }
}
