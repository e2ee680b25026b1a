// Fills the run's data on the GPU from the seeded RNG (rng.cuh) with the recipe of spec::data, bitwise
// equal to the CPU's. One thread per element, grid-stride: generating the graded layer's 1.7 GB is
// bandwidth-bound.
#include <cuda_bf16.h>
#include <stdint.h>

#include "rng.cuh"

// Channels per block of the outlier layout, each block holding one outlier channel:
// spec::data::OUTLIER_SPACING.
constexpr uint64_t OUTLIER_SPACING = 256;
// Prefix slots per block of the anchor layout, each block holding one anchor key per KV head:
// spec::data::ANCHOR_SPACING.
constexpr uint64_t ANCHOR_SPACING = 16;
// The input's massive channels are the outlier channels of this many first blocks:
// spec::data::MASSIVE_CHANNELS.
constexpr uint64_t MASSIVE_CHANNELS = 4;

// Whether channel c is the outlier channel of its block (spec::data::Axis::is_outlier).
__device__ inline bool is_outlier(uint64_t axis_key, uint64_t c) {
    return c % OUTLIER_SPACING == rng::bits(axis_key, c / OUTLIER_SPACING) % OUTLIER_SPACING;
}

// The mean and scale of each class of element, class 2 * (in an outlier row) + (in an outlier
// column): spec::data::Tensor::classes.
struct Classes {
    float mean[4];
    float scale[4];
};

// out[i] = bf16(mean + normal(i) * scale) of element i's class, for the (n / cols, cols) matrix out.
extern "C" __global__ void fill_weight_bf16(
    __nv_bfloat16* __restrict__ out,  // (n / cols, cols)
    uint64_t n, uint64_t cols, uint64_t key, uint64_t row_key, uint64_t col_key, uint32_t outlier_rows,
    uint32_t outlier_cols, Classes classes) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        const bool row = outlier_rows && is_outlier(row_key, i / cols);
        const bool col = outlier_cols && is_outlier(col_key, i % cols);
        const int c = 2 * row + col;
        out[i] = __float2bfloat16_rn(rng::normal_f32(key, i, classes.mean[c], classes.scale[c]));
    }
}

// The KV prefix: slots [0, prefill) drawn with the anchor scale at the head's anchor slots
// (spec::data::is_anchor) and the normal scale elsewhere; slots [prefill, max_seq_len) zero.
// Counter index = flat element index.
extern "C" __global__ void fill_cache_bf16(
    __nv_bfloat16* __restrict__ out,  // (batch, n_kv, max_seq_len, hd)
    uint64_t n, uint32_t n_kv, uint32_t max_seq_len, uint32_t hd, uint32_t prefill, uint64_t key,
    uint64_t anchor_key, float scale, float anchor_scale) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t row = i / hd;
        const uint64_t p = row % max_seq_len, h = (row / max_seq_len) % n_kv;
        if (p >= prefill) {
            out[i] = __float2bfloat16_rn(0.0f);
            continue;
        }
        const uint64_t draw = rng::bits(anchor_key, (h << 32) | (p / ANCHOR_SPACING));
        const bool anchor = p < 3 * (uint64_t)prefill / 4 && p % ANCHOR_SPACING == draw % ANCHOR_SPACING;
        out[i] = __float2bfloat16_rn(rng::normal_f32(key, i, 0.0f, anchor ? anchor_scale : scale));
    }
}

// The input x, (n / d, d): unit normal (scale) except the massive channels, the outlier channels of the
// first MASSIVE_CHANNELS blocks of model_key's layout, drawn around +-magnitude (the sign is the top bit
// of the block's draw) with massive_scale: spec::data::input.
extern "C" __global__ void fill_input_bf16(
    __nv_bfloat16* __restrict__ out,  // (n / d, d)
    uint64_t n, uint64_t d, uint64_t key, float scale, uint64_t model_key, float magnitude,
    float massive_scale) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t c = i % d;
        float mean = 0.0f, s = scale;
        if (c / OUTLIER_SPACING < MASSIVE_CHANNELS && is_outlier(model_key, c)) {
            mean = rng::bits(model_key, c / OUTLIER_SPACING) >> 63 ? -magnitude : magnitude;
            s = massive_scale;
        }
        out[i] = __float2bfloat16_rn(rng::normal_f32(key, i, mean, s));
    }
}
