// Task kind GateUp: h2 = rmsnorm(x1); act = silu(Wg h2) * (Wu h2) over gate/up-interleaved rows.
#pragma once
#include "vm_gemv.cuh"

// The end of a GateUp phase: act = silu(gate) * up from the sums of rows [r0, r1) in `part`.
__device__ inline void gateup_epilogue(bf16* act, const Partials& part, uint32_t r0, uint32_t r1) {
    for (uint32_t p = threadIdx.x; p < (r1 - r0) / 2; p += THREADS) {
        act[r0 / 2 + p] = silu_mul(bf(row_sum(part.red, 2 * p)), bf(row_sum(part.red, 2 * p + 1)));
    }
}

// h2 = rmsnorm(x1); act = silu(Wg h2) * (Wu h2) over gate/up-interleaved rows.
template <bool SLICED, bool TRACED = false, uint32_t CODES = BF16_ROWS>
__device__ __forceinline__ void phase_gateup(const OpRow& op, Ring& ring, Partials part) {
    const uint32_t d = (uint32_t)op[gateup::D];
    const float eps = __int_as_float((int)op[gateup::EpsBits]);
    bf16* act = act_ptr<bf16>(op, gateup::ActOut);
    const bf16* x1 = act_ptr<const bf16>(op, gateup::X1);
    const bf16* g = reinterpret_cast<const bf16*>(layer_address(op, gateup::Norm));
    uint32_t r0, r1;
    if (SLICED) {
        gemv_rows<CODES, SLICED>(op, r0, r1);
        stream_phase<SLICED, TRACED, CODES>(op, [&](uint32_t t) { return rmsnorm_input<SLICED>(x1, g, d, eps, t); }, ring, part, r0, r1);
    } else {
        // The norm's loads before the rows' arithmetic, as the layer kernels were measured.
        const Slice s = rmsnorm_slice(x1, g, d, eps);
        gemv_rows<CODES, SLICED>(op, r0, r1);
        gemv_phase<CODES, SLICED>(op, s, ring, part, r0, r1);
    }
    gateup_epilogue(act, part, r0, r1);
}
