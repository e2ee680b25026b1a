//! The megakernel's kernel file, `kernels/megakernel.cu` (with the program's layout, `kernels/program.cuh`),
//! compiled by build.rs for Hopper and embedded.

cuda::embed_kernels!(cuda::kernels::Spills {
    function: "megakernel_model_bf16",
    bytes: 8,
    why: "the model kernel's per-position state (its io, token and head count) cannot live in the parameter bank as \
          the layer kernels' does; kept in shared memory, one register still spills around the phases (4 bytes \
          stored, 8 loaded, once per phase); every variant tried kept it or spilled more (docs/model.md)",
});
