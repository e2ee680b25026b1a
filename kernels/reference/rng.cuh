// The counter-based hash RNG, mirrored line for line from spec/src/rng.rs: a value depends only on
// (seed, stream, index), so the GPU fill equals the CPU's bitwise. Only integer hashing and two
// explicitly rounded f32 operations (__fmul_rn, __fadd_rn: no fused multiply-add) are used.
#pragma once
#include <stdint.h>

namespace rng {

// 2^64 / golden ratio: the splitmix64 increment.
constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;
// Mean of the sum of four 16-bit uniforms, 4 * 65535 / 2.
constexpr int32_t IRWIN_HALL_MEAN = 131070;

// The splitmix64 finaliser: a bijection on u64 with full avalanche.
__host__ __device__ inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__host__ __device__ inline uint64_t stream_key(uint64_t seed, uint64_t stream) {
    return mix64(seed ^ mix64(stream * GOLDEN));
}

__host__ __device__ inline uint64_t bits(uint64_t key, uint64_t index) {
    return mix64(key ^ mix64(index));
}

// Sum of the four 16-bit lanes minus its mean: in [-131070, 131070], exact in f32.
__device__ inline int32_t centred_sum(uint64_t b) {
    uint64_t lanes = (b & 0xFFFF) + ((b >> 16) & 0xFFFF) + ((b >> 32) & 0xFFFF) + (b >> 48);
    return (int32_t)lanes - IRWIN_HALL_MEAN;
}

// mean + centred_sum * scale, each operation rounded once, as Rust's `mean + (i as f32) * scale`.
__device__ inline float normal_f32(uint64_t key, uint64_t index, float mean, float scale) {
    float product = __fmul_rn(__int2float_rn(centred_sum(bits(key, index))), scale);
    return __fadd_rn(mean, product);
}

}  // namespace rng
