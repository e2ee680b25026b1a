// Task kind Reduce, for a layer split over GPUs (program.rs, Split): dst = residual + the sum of every
// GPU's f32 partials in rank order, rounded as the last part of a residual GEMV rounds
// (residual_epilogue). Over one GPU (the split's own path, Split::Over(1)) the sum is the partials this
// GPU's last part left, which is the `sum` that part would have rounded itself: the output's bits are
// the unsplit program's. The multi-GPU kernel (docs/parallel.md) adds the other GPUs' partials here,
// through NCCL's symmetric window, in the same order on every GPU.
#pragma once
#include "vm_gemv.cuh"

// This block's rows of the phase (an even share over its blocks): x1 after O, or the layer's output
// after Down. `x`: the layer's input, the residual where the row names none; `out`: the layer's output,
// where the row names no buffer.
__device__ inline void phase_reduce(const OpRow& op, const bf16* x, bf16* out) {
    uint32_t r0, r1;
    block_rows((uint32_t)op[reduce::Rows], blocks_of(op), r0, r1, 1);
    const float* parts = part_ptr<const float>(op, reduce::Parts);
    const bf16* residual = op[reduce::Residual] == 0 ? x : act_ptr<const bf16>(op, reduce::Residual);
    bf16* dst = op[reduce::Out] == 0 ? out : act_ptr<bf16>(op, reduce::Out);
    // The partials and the residual were written by other blocks in this launch: read through L2 (.cg),
    // after the phase's wait acquired their counts.
    for (uint32_t r = r0 + threadIdx.x; r < r1; r += THREADS) {
        const float sum = __ldcg(parts + r);
        dst[r] = add_round(__bfloat162float(__ldcg(residual + r)), bf(sum));
    }
}
