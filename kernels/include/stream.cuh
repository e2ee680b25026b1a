// The read-only stream of 16-byte vectors of the bandwidth measurement (kernels/grader/bandwidth.cu): the loop of
// read_u4, one of the two reads whose faster measures the read-only ceiling (bulk_read.cu is the
// other), and keep_loads, which both use so that their reads cannot be elided.
#pragma once
#include <stdint.h>

// Independent 16-byte loads each thread issues before the first use.
constexpr int LOADS_IN_FLIGHT = 4;

// acc XOR every word of this thread's share of a grid-stride read of src: vectors first,
// first + stride, ... below n, LOADS_IN_FLIGHT of them in flight at a time.
__device__ __forceinline__ uint32_t xor_stream(const uint4* __restrict__ src,  // (n)
                                               uint64_t n, uint64_t first, uint64_t stride, uint32_t acc) {
    uint64_t i = first;
    for (; i + (LOADS_IN_FLIGHT - 1) * stride < n; i += LOADS_IN_FLIGHT * stride) {
        uint4 v[LOADS_IN_FLIGHT];
#pragma unroll
        for (int j = 0; j < LOADS_IN_FLIGHT; ++j) v[j] = src[i + j * stride];
#pragma unroll
        for (int j = 0; j < LOADS_IN_FLIGHT; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < n; i += stride) acc ^= src[i].x ^ src[i].y ^ src[i].z ^ src[i].w;
    return acc;
}

// Folds a thread's accumulator into sink[blockIdx.x] so that its loads cannot be elided: every
// accumulator must be used, or the compiler drops that thread's loads, so thread 0 always writes and
// the others only on an all-ones value the compiler cannot rule out. Racing writes of one word per
// block are fine: nobody reads a particular one.
__device__ __forceinline__ void keep_loads(uint32_t* __restrict__ sink,  // (gridDim.x)
                                           uint32_t acc) {
    if (acc == 0xFFFFFFFFu) sink[blockIdx.x] = acc;
    else if (threadIdx.x == 0) sink[blockIdx.x] = acc;
}
