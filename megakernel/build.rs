//! With the `model` feature, compiles the model's kernels (`kernels/megakernel/model/model.cu`,
//! `model_batch.cu`, `model_fp8.cu`, `model_fp8_traced.cu`, `model_fp8_batch.cu`, `model_nf4.cu` and
//! `model_nf4_batch.cu`, a whole checkpoint in one launch) with the nvcc the root package's build script
//! found, and puts the CUDA library folders on the `megakernel` command's run path. The judge's kernels
//! (`kernels/megakernel/megakernel.cu`) are the root package's: the grader never waits for these.

fn main() {
    if std::env::var_os("CARGO_FEATURE_MODEL").is_some() {
        let toolchain = cuda_build::Toolchain::from_links();
        let model = cuda_build::Owner {
            name: "model",
            folder: "megakernel/model",
            hopper_only: &[
                "model.cu",
                "model_batch.cu",
                "model_fp8.cu",
                "model_fp8_traced.cu",
                "model_fp8_batch.cu",
                "model_nf4.cu",
                "model_nf4_batch.cu",
            ],
            rdc: &[],
        };
        cuda_build::build(&toolchain, &[model], "");
    } else {
        // Nothing to compile: run again only if the feature changes (cargo reruns then anyway).
        println!("cargo:rerun-if-changed=build.rs");
    }
    cuda_build::link_cuda_run_path();
}
