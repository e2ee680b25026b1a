// The arithmetic the eager reference (kernels/reference/reference.cu), the megakernel
// (kernels/megakernel/) and the red team (kernels/redteam/redteam.cu) share: warp
// and block reductions in a fixed order, the bf16 dot product, and the elementwise steps whose
// rounding must match the golden model's (each f32 operation rounded separately: the explicitly
// rounded intrinsics keep nvcc from fusing them into a multiply-add).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

constexpr uint32_t WARP = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
// The most warps a block can hold (1024 threads): the size of shared partial-sum arrays.
constexpr uint32_t MAX_WARPS = 1024 / WARP;
// bf16 per 16-byte vector.
constexpr uint32_t VEC = 8;

struct Add {
    __device__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// A xor butterfly: every lane ends with the same value, because each pairwise step computes
// op(a, b) and op(b, a), which are equal for + and max.
template <typename Op>
__device__ inline float warp_reduce(float v, Op op) {
    for (uint32_t offset = WARP / 2; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// The block's total, returned to every thread: each warp's butterfly, then the warps' partials combined
// in warp order by every thread (the same order everywhere). Every thread of the block must call it.
template <typename Op>
__device__ float block_reduce(float v, Op op) {
    __shared__ float partials[MAX_WARPS];  // (warps)
    const uint32_t warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    v = warp_reduce(v, op);
    if (lane == 0) partials[warp] = v;
    __syncthreads();  // every warp's partial is written before any thread reads them
    float total = partials[0];
    for (uint32_t w = 1; w < warps; ++w) total = op(total, partials[w]);
    __syncthreads();  // every thread has read the partials before a later call overwrites them
    return total;
}

// acc + dot of two 16-byte vectors of 8 bf16, in f32.
__device__ inline float dot8(uint4 a, uint4 b, float acc) {
    const bf162* x = reinterpret_cast<const bf162*>(&a);
    const bf162* y = reinterpret_cast<const bf162*>(&b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 fx = __bfloat1622float2(x[j]), fy = __bfloat1622float2(y[j]);
        acc = fmaf(fx.x, fy.x, acc);
        acc = fmaf(fx.y, fy.y, acc);
    }
    return acc;
}

// Sum of squares of a 16-byte vector of 8 bf16, added to acc.
__device__ inline float sumsq8(uint4 a, float acc) { return dot8(a, a, acc); }

// RMSNorm's inverse root from the mean of squares: IEEE f32 (no rsqrtf), as the golden model.
__device__ inline float inv_rms(float mean_square, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, eps)));
}

// RMSNorm's output element: bf16((x * r) * g), the two products rounded separately.
__device__ inline bf16 rms_scale(float x, float r, float g) {
    return __float2bfloat16_rn(__fmul_rn(__fmul_rn(x, r), g));
}

// The 8 elements of a 16-byte vector of x normalised: rms_scale of each with its weight.
__device__ inline uint4 rms_scale8(uint4 x, uint4 g, float r) {
    uint4 out;
    const bf16* xs = reinterpret_cast<const bf16*>(&x);
    const bf16* gs = reinterpret_cast<const bf16*>(&g);
    bf16* o = reinterpret_cast<bf16*>(&out);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = rms_scale(__bfloat162float(xs[j]), r, __bfloat162float(gs[j]));
    return out;
}

// Rotate-half RoPE of one pair (a, b) = (v[i], v[i + hd/2]) by (cos, sin): separate f32 products.
__device__ inline void rope_pair(float a, float b, float c, float s, bf16* out_a, bf16* out_b) {
    *out_a = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    *out_b = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

// bf16(silu(g) * u), silu(g) = g / (1 + exp(-g)), each f32 operation rounded separately.
__device__ inline bf16 silu_mul(float g, float u) {
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    return __float2bfloat16_rn(__fmul_rn(silu, u));
}

// bf16(a + b) in f32.
__device__ inline bf16 add_round(float a, float b) { return __float2bfloat16_rn(__fadd_rn(a, b)); }
