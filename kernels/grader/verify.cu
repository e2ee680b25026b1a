// Checks the grader runs on device buffers after a submission: how many 16-byte vectors of two
// buffers differ (weights and inputs must come back unmodified). Integer atomics only count.
#include <stdint.h>

// *count += number of i in [0, n) with a[i] != b[i], 16-byte vectors, grid-stride.
extern "C" __global__ void count_differences_u4(unsigned long long* __restrict__ count,  // (1)
                                                const uint4* __restrict__ a,  // (n)
                                                const uint4* __restrict__ b,  // (n)
                                                uint64_t n) {
    unsigned long long local = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        uint4 x = a[i], y = b[i];
        local += (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
    }
    // One atomic per thread that saw a difference: an unmodified buffer costs none.
    if (local) atomicAdd(count, local);
}
