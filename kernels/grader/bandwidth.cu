// Stream kernels that measure HBM bandwidth, the denominator of the roofline floor. 16-byte vector
// accesses, grid-stride, several independent loads in flight per thread, buffers far larger than L2.
#include <stdint.h>

#include "stream.cuh"

// dst = src, n 16-byte vectors. Counts 2 * 16 * n bytes (read + write).
extern "C" __global__ void copy_u4(uint4* __restrict__ dst,  // (n)
                                   const uint4* __restrict__ src,  // (n)
                                   uint64_t n) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    for (; i + (LOADS_IN_FLIGHT - 1) * stride < n; i += LOADS_IN_FLIGHT * stride) {
        uint4 v[LOADS_IN_FLIGHT];
#pragma unroll
        for (int j = 0; j < LOADS_IN_FLIGHT; ++j) v[j] = src[i + j * stride];
#pragma unroll
        for (int j = 0; j < LOADS_IN_FLIGHT; ++j) dst[i + j * stride] = v[j];
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

// XOR of all of src per thread, folded into sink[block] so the loads cannot be elided. Counts 16 * n
// bytes (read only).
extern "C" __global__ void read_u4(uint32_t* __restrict__ sink,  // (gridDim.x)
                                   const uint4* __restrict__ src,  // (n)
                                   uint64_t n) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const uint64_t first = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    keep_loads(sink, xor_stream(src, n, first, stride, 0));
}
