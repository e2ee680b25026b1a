// The split kernel: the stack's program with Reduce rows (program.rs, Split), the path a layer split
// over GPUs takes (docs/parallel.md). Over one GPU (Split::Over(1)) its outputs must be the stack
// kernel's bit for bit (`grader selftest --filter split`); the multi-GPU kernel will be this one with
// the other GPUs' partials added in its Reduce. A file of its own, so that megakernel.cu's kernels keep
// their machine code byte for byte.
#include "megakernel.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_split_bf16(MEGAKERNEL_PARAMS(PROGRAM_MAX_LAYERS)) {
    run_program<PROGRAM_MAX_LAYERS, false, true>(MEGAKERNEL_ARGS);
}
