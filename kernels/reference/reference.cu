// The eager GPU reference: one kernel per elementary op of the decoder layer, launched one after
// another the way an eager framework (PyTorch, bf16) runs it. Every op reads bf16, computes in f32
// (f32 accumulation in every reduction) and stores bf16, except the attention scores and softmax
// weights, which stay f32. The rounding points are those of reference/src/golden.rs; where the golden
// model rounds each f32 operation separately (RMSNorm's two products, RoPE, SiLU), the kernels use the
// explicitly rounded intrinsics (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn) so that
// nvcc cannot fuse them into a multiply-add. Dot products use fmaf: their summation order differs from
// the golden model's anyway.
//
// Every reduction runs in a fixed order (a per-thread sequential sum, a shuffle butterfly within each
// warp, then the warps' partials added in warp order), so a result is the same bits on every run.
// Block sizes are chosen by the launcher (reference/src/gpu/eager.rs); kernels read them from
// blockDim and need only that they are multiples of the warp size, at most 1024 threads.
//
// Batch 1: the KV cache tensors are (n_kv, max_seq_len, hd). Sizes are uint32_t; offsets into the
// matrices and the cache are computed in 64 bits.
#include <math_constants.h>
#include <stdint.h>

#include "layer_math.cuh"

// Independent 16-byte loads a GEMV lane keeps in flight: enough to cover HBM latency.
constexpr int GEMV_UNROLL = 4;
// Independent V loads an attention-sum warp keeps in flight.
constexpr int WSUM_UNROLL = 4;

// Slots in the range [first, end); 0 when end <= first (attention over nothing).
__device__ inline uint32_t span_len(uint32_t first, uint32_t end) { return end > first ? end - first : 0; }

// ---------------------------------------------------------------------------------------------------
// RMSNorm: out = bf16((x * (1 / sqrt(mean(x^2) + eps))) * g), in two launches
// ---------------------------------------------------------------------------------------------------

// ms[0] = sum(x^2) / n, by one block.
extern "C" __global__ void rms_sumsq_f32(
    float* __restrict__ ms,       // (1)
    const bf16* __restrict__ x,   // (n)
    uint32_t n) {
    float acc = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = __bfloat162float(x[i]);
        acc = fmaf(v, v, acc);
    }
    const float total = block_reduce(acc, Add{});
    if (threadIdx.x == 0) ms[0] = __fdiv_rn(total, (float)n);
}

// The inverse root in IEEE f32 (no rsqrtf), then the two products each rounded, as the golden model.
extern "C" __global__ void rms_scale_bf16(
    bf16* __restrict__ out,        // (n)
    const bf16* __restrict__ x,    // (n)
    const bf16* __restrict__ g,    // (n)
    const float* __restrict__ ms,  // (1)
    uint32_t n, float eps) {
    const float r = inv_rms(ms[0], eps);
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        out[i] = rms_scale(__bfloat162float(x[i]), r, __bfloat162float(g[i]));
    }
}

// ---------------------------------------------------------------------------------------------------
// GEMV: y = bf16(W h), one warp per row
// ---------------------------------------------------------------------------------------------------

// Lane l reads the row's 16-byte vectors l, l + 32, ... and accumulates them in that order; the warp's
// butterfly adds the 32 lane sums. cols is a multiple of VEC and w, h are 16-byte aligned (cudaMalloc
// bases, rows of a multiple of 16 bytes): the launcher checks both.
extern "C" __global__ void gemv_bf16(
    bf16* __restrict__ y,         // (rows)
    const bf16* __restrict__ w,   // (rows, cols)
    const bf16* __restrict__ h,   // (cols)
    uint32_t rows, uint32_t cols) {
    const uint32_t warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const uint32_t row = blockIdx.x * (blockDim.x / WARP) + warp;
    if (row >= rows) return;  // the whole warp leaves together: its shuffles below stay converged
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * cols);  // (cols / VEC)
    const uint4* hv = reinterpret_cast<const uint4*>(h);                       // (cols / VEC)
    const uint32_t vecs = cols / VEC;
    float acc = 0.0f;
#pragma unroll GEMV_UNROLL
    for (uint32_t c = lane; c < vecs; c += WARP) acc = dot8(wr[c], hv[c], acc);
    acc = warp_reduce(acc, Add{});
    if (lane == 0) y[row] = __float2bfloat16_rn(acc);
}

// ---------------------------------------------------------------------------------------------------
// RoPE and the cache write
// ---------------------------------------------------------------------------------------------------

// Rotate-half, in place: element i < hd/2 of each head pairs with i + hd/2. Each thread owns one pair,
// so no two threads touch the same element. Separate f32 products, no fused multiply-add.
extern "C" __global__ void rope_bf16(
    bf16* __restrict__ v,                 // (heads, hd)
    const float* __restrict__ cos_table,  // (max_seq_len, hd / 2)
    const float* __restrict__ sin_table,  // (max_seq_len, hd / 2)
    uint32_t heads, uint32_t hd, uint32_t pos) {
    const uint32_t half = hd / 2, n = heads * half;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const uint32_t head = i / half, j = i % half;
        bf16* row = v + (size_t)head * hd;  // (hd)
        const float a = __bfloat162float(row[j]), b = __bfloat162float(row[j + half]);
        const float c = cos_table[(size_t)pos * half + j], s = sin_table[(size_t)pos * half + j];
        rope_pair(a, b, c, s, &row[j], &row[j + half]);
    }
}

// Slot pos of every KV head: cache[head, pos, :] = row[head, :]. Called once for K, once for V.
extern "C" __global__ void cache_write_bf16(
    bf16* __restrict__ cache,      // (n_kv, max_seq_len, hd)
    const bf16* __restrict__ row,  // (n_kv, hd)
    uint32_t n_kv, uint32_t max_seq_len, uint32_t hd, uint32_t pos) {
    const uint32_t n = n_kv * hd;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const uint32_t head = i / hd, c = i % hd;
        cache[((size_t)head * max_seq_len + pos) * hd + c] = row[i];
    }
}

// ---------------------------------------------------------------------------------------------------
// Attention over the slots [first, end) (empty when end <= first), in three launches.
// Query head j reads KV head j / (n_q / n_kv). Only the span's entries of s are written and read.
// ---------------------------------------------------------------------------------------------------

// s[j, p] = (q_j . K[kv(j), p]) / sqrt(hd) in f32. Grid (ceil(len / warps), n_q): one warp per
// (query head, slot); lane l reads bf16 pairs l, l + 32, ... of the head.
extern "C" __global__ void attn_scores_f32(
    float* __restrict__ s,              // (n_q, max_seq_len)
    const bf16* __restrict__ q,         // (n_q, hd)
    const bf16* __restrict__ k_cache,   // (n_kv, max_seq_len, hd)
    uint32_t n_q, uint32_t n_kv, uint32_t max_seq_len, uint32_t hd, uint32_t first, uint32_t end) {
    const uint32_t warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const uint32_t head = blockIdx.y, kv = head / (n_q / n_kv);
    const uint32_t i = blockIdx.x * (blockDim.x / WARP) + warp;
    if (i >= span_len(first, end)) return;  // the whole warp leaves together: shuffles stay converged
    const uint32_t p = first + i;
    const bf162* qh = reinterpret_cast<const bf162*>(q + (size_t)head * hd);                         // (hd / 2)
    const bf162* kp = reinterpret_cast<const bf162*>(k_cache + ((size_t)kv * max_seq_len + p) * hd);  // (hd / 2)
    float acc = 0.0f;
    for (uint32_t c = lane; c < hd / 2; c += WARP) {
        const float2 a = __bfloat1622float2(qh[c]), b = __bfloat1622float2(kp[c]);
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
    }
    acc = warp_reduce(acc, Add{});
    if (lane == 0) s[(size_t)head * max_seq_len + p] = __fdiv_rn(acc, __fsqrt_rn((float)hd));
}

// In place, per query head (one block each): s = exp(s - max) / sum(exp(s - max)) over the span, f32.
// An empty span writes nothing.
extern "C" __global__ void softmax_f32(
    float* __restrict__ s,  // (n_q, max_seq_len)
    uint32_t n_q, uint32_t max_seq_len, uint32_t first, uint32_t end) {
    if (blockIdx.x >= n_q) return;  // uniform across the block: the barriers below are all reached
    float* row = s + (size_t)blockIdx.x * max_seq_len + first;  // (len)
    const uint32_t len = span_len(first, end);
    float m = -CUDART_INF_F;
    for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) m = fmaxf(m, row[i]);
    m = block_reduce(m, Max{});
    float sum = 0.0f;
    for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) {
        const float e = expf(__fsub_rn(row[i], m));
        row[i] = e;
        sum += e;
    }
    sum = block_reduce(sum, Add{});
    // Each thread divides exactly the elements it wrote above, so no barrier is needed for them.
    for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) row[i] = __fdiv_rn(row[i], sum);
}

// a[j, :] = bf16(sum_p prob[j, p] * V[kv(j), p, :]) in f32; zero for an empty span. Grid
// (n_q, ceil(hd / (2 * WARP))): a block covers one query head and 2 * WARP columns, lane l the bf16
// pair l of that chunk; warp w sums slots w, w + warps, ... and the warps' partials are added in warp
// order.
extern "C" __global__ void attn_wsum_bf16(
    bf16* __restrict__ a,              // (n_q, hd)
    const float* __restrict__ prob,    // (n_q, max_seq_len)
    const bf16* __restrict__ v_cache,  // (n_kv, max_seq_len, hd)
    uint32_t n_q, uint32_t n_kv, uint32_t max_seq_len, uint32_t hd, uint32_t first, uint32_t end) {
    __shared__ float2 partials[MAX_WARPS][WARP];  // (warps, WARP)
    const uint32_t warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    const uint32_t head = blockIdx.x, kv = head / (n_q / n_kv);
    const uint32_t pairs = hd / 2, pair = blockIdx.y * WARP + lane;
    const bool active = pair < pairs;
    const float* ph = prob + (size_t)head * max_seq_len;                                        // (max_seq_len)
    const bf162* vh = reinterpret_cast<const bf162*>(v_cache + (size_t)kv * max_seq_len * hd);  // (max_seq_len, hd / 2)
    const uint32_t len = span_len(first, end);
    float2 acc = make_float2(0.0f, 0.0f);
    if (active) {
#pragma unroll WSUM_UNROLL
        for (uint32_t i = warp; i < len; i += warps) {
            const uint32_t p = first + i;
            const float w = ph[p];
            const float2 v = __bfloat1622float2(vh[(size_t)p * pairs + pair]);
            acc.x = fmaf(w, v.x, acc.x);
            acc.y = fmaf(w, v.y, acc.y);
        }
    }
    partials[warp][lane] = acc;
    __syncthreads();  // every warp's partial is written before warp 0 adds them
    if (warp == 0 && active) {
        float2 total = partials[0][lane];
        for (uint32_t w = 1; w < warps; ++w) {
            total.x += partials[w][lane].x;
            total.y += partials[w][lane].y;
        }
        reinterpret_cast<bf162*>(a + (size_t)head * hd)[pair] = __floats2bfloat162_rn(total.x, total.y);
    }
}

// ---------------------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------------------

// out = bf16(a + b) in f32. out may not alias a or b.
extern "C" __global__ void add_bf16(
    bf16* __restrict__ out,      // (n)
    const bf16* __restrict__ a,  // (n)
    const bf16* __restrict__ b,  // (n)
    uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        out[i] = add_round(__bfloat162float(a[i]), __bfloat162float(b[i]));
    }
}

// out = bf16(silu(gate) * up), silu(g) = g / (1 + exp(-g)), each f32 operation rounded separately.
extern "C" __global__ void silu_mul_bf16(
    bf16* __restrict__ out,         // (n)
    const bf16* __restrict__ gate,  // (n)
    const bf16* __restrict__ up,    // (n)
    uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        out[i] = silu_mul(__bfloat162float(gate[i]), __bfloat162float(up[i]));
    }
}
