// Task kind OProj: x1 = x + Wo a, through the residual GEMV that Down shares (residual_gemv).
#pragma once
#include "vm_gemv.cuh"

// dst = residual + W v over the columns the row names: all of them; or a first part, whose f32 products
// go to part_out; or a middle part, whose products are added to part_in's and go to part_out (the same
// rows of the same buffer, on the same block); or the last, whose products are added to part_in's
// before rounding. The O projection and Down are this GEMV.
// Where a residual GEMV's rows [r0, r1) end (see residual_gemv), and this thread's first row's residual
// and partial sum, loaded before the stream (see preload).
struct ResidualOut {
    const bf16* residual;
    bf16* dst;
    const float* part_in;
    float* part_out;
    float first_res, first_part;
};
__device__ inline ResidualOut residual_out(const bf16* residual, bf16* dst, const float* part_in, float* part_out, uint32_t r0, uint32_t r1) {
    const float first_res = part_out == nullptr ? preload(residual + r0, r1 - r0) : 0.0f;
    const float first_part = part_in != nullptr && threadIdx.x < r1 - r0 ? __ldcg(part_in + r0 + threadIdx.x) : 0.0f;
    return {residual, dst, part_in, part_out, first_res, first_part};
}

// The end of a residual GEMV: the sums of rows [r0, r1) in `part`, added to part_in's where it has one,
// to part_out, or rounded and added to the residual into dst.
__device__ inline void residual_epilogue(const ResidualOut& o, const Partials& part, uint32_t r0, uint32_t r1) {
    for (uint32_t r = threadIdx.x; r < r1 - r0; r += THREADS) {
        const bool first = r == threadIdx.x;
        const float y = row_sum(part.red, r);
        const float sum = o.part_in == nullptr ? y : __fadd_rn(first ? o.first_part : __ldcg(o.part_in + r0 + r), y);
        if (o.part_out != nullptr) {
            o.part_out[r0 + r] = sum;
            continue;
        }
        const float res = first ? o.first_res : __bfloat162float(__ldcg(o.residual + r0 + r));
        o.dst[r0 + r] = add_round(res, bf(sum));
    }
}

template <bool SLICED, bool TRACED = false, uint32_t CODES = BF16_ROWS>
__device__ void residual_gemv(const OpRow& op, const bf16* v, uint32_t cols, const bf16* residual, bf16* dst,
                              const float* part_in, float* part_out, Ring& ring, Partials part) {
    uint32_t r0, r1;
    gemv_rows<CODES, SLICED>(op, r0, r1);
    const ResidualOut o = residual_out(residual, dst, part_in, part_out, r0, r1);
    stream_phase<SLICED, TRACED, CODES>(op, [&](uint32_t t) { return load_slice(v, cols, t); }, ring, part, r0, r1);
    residual_epilogue(o, part, r0, r1);
}

// x1 = x + Wo a over the columns the row names: all of them; or those of the first half of the KV
// groups (f32 products to PartOut); or those of the second half, added to PartIn's, which the first
// half's blocks wrote (this phase waits for theirs).
template <bool SLICED, bool TRACED = false, uint32_t CODES = BF16_ROWS>
__device__ __forceinline__ void phase_oproj(const OpRow& op, const bf16* x, Ring& ring, Partials part) {
    residual_gemv<SLICED, TRACED, CODES>(op, act_ptr<const bf16>(op, oproj::A), (uint32_t)op[oproj::Cols], x, act_ptr<bf16>(op, oproj::X1Out),
                  part_ptr<const float>(op, oproj::PartIn), part_ptr<float>(op, oproj::PartOut), ring, part);
}
