// Fills tensors on the GPU from the seeded RNG (rng.cuh), bitwise equal to spec::data on the CPU.
// One thread per element, grid-stride: generation of the graded layer's 1.7 GB is bandwidth-bound.
#include <cuda_bf16.h>
#include <stdint.h>

#include "rng.cuh"

// Large keys per KV head: spec::data::ANCHORS_PER_HEAD.
constexpr int ANCHORS_PER_HEAD = 8;

// out[i] = bf16(mean + normal(i) * std), for i in [0, n).
extern "C" __global__ void fill_normal_bf16(
    __nv_bfloat16* __restrict__ out,  // (n)
    uint64_t n, uint64_t key, float mean, float scale) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        out[i] = __float2bfloat16_rn(rng::normal_f32(key, i, mean, scale));
    }
}

// The KV prefix: slots [0, prefill) drawn with the anchor scale at the head's anchor positions and
// the normal scale elsewhere; slots [prefill, max_seq_len) zero. Counter index = flat element index.
extern "C" __global__ void fill_cache_bf16(
    __nv_bfloat16* __restrict__ out,    // (batch, n_kv, max_seq_len, hd)
    const uint32_t* __restrict__ anchors,  // (n_kv, ANCHORS_PER_HEAD)
    uint64_t n, uint32_t n_kv, uint32_t max_seq_len, uint32_t hd, uint32_t prefill,
    uint64_t key, float scale, float anchor_scale) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t row = i / hd;
        uint32_t p = (uint32_t)(row % max_seq_len);
        uint32_t h = (uint32_t)((row / max_seq_len) % n_kv);
        if (p >= prefill) {
            out[i] = __float2bfloat16_rn(0.0f);
            continue;
        }
        bool is_anchor = false;
        for (int j = 0; j < ANCHORS_PER_HEAD; ++j) is_anchor |= anchors[h * ANCHORS_PER_HEAD + j] == p;
        out[i] = __float2bfloat16_rn(rng::normal_f32(key, i, 0.0f, is_anchor ? anchor_scale : scale));
    }
}
