// The megakernel's weight stream as the probes keep it beside what they time: one thread keeps
// `stages` bulk copies of STREAM_STAGE bytes in flight from a region (evict-first, round and round)
// until a word reaches a target; on the host, the regions and the bytes the streams landed. Shared by
// inflight_latency.cu, icache_load.cu and cluster_hop.cu.
#pragma once
#include <stdint.h>
#include <vector>
#include "../../kernels/include/bulk.cuh"

constexpr uint32_t STREAM_STAGE = 64 * 1024;  // the ring's stage

__device__ inline uint32_t ld_relaxed(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Streams `region` (region_bytes, a multiple of STREAM_STAGE) through `ring` (stages x STREAM_STAGE of
// shared memory, one initialised mbarrier in `full` per stage) until `*until` reaches `target`; returns
// the bytes landed. One thread.
__device__ unsigned long long stream_bulk(const char* region, size_t region_bytes, uint32_t stages, const uint32_t* until, uint32_t target,
                                          char* ring, uint64_t* full) {
    if (stages == 0) return 0;
    const uint64_t policy = l2_evict_first();
    const uint32_t per_region = region_bytes / STREAM_STAGE;
    for (uint32_t k = 0; k < stages; ++k) {
        mbar_expect_tx(&full[k], STREAM_STAGE);
        bulk_copy(ring + k * STREAM_STAGE, region + (size_t)k * STREAM_STAGE, STREAM_STAGE, &full[k], policy);
    }
    unsigned long long landed = 0;
    uint32_t k = 0;
    for (;; ++k) {
        mbar_wait(&full[k % stages], (k / stages) & 1);
        landed += STREAM_STAGE;
        if (ld_relaxed(until) >= target) break;
        mbar_expect_tx(&full[k % stages], STREAM_STAGE);
        bulk_copy(ring + k % stages * STREAM_STAGE, region + (size_t)((k + stages) % per_region) * STREAM_STAGE, STREAM_STAGE,
                  &full[k % stages], policy);
    }
    // The copies still in flight land before the block exits (they write its shared memory).
    for (uint32_t j = k + 1; j < k + stages; ++j) mbar_wait(&full[j % stages], (j / stages) & 1);
    return landed;
}

// The bytes the blocks' streams landed (stream_bulk's returns, one word a block in `landed`), summed.
inline cudaError_t landed_bytes(const unsigned long long* landed, int blocks, unsigned long long* bytes) {
    std::vector<unsigned long long> l(blocks);
    const cudaError_t e = cudaMemcpy(l.data(), landed, blocks * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
    *bytes = 0;
    for (const unsigned long long b : l) *bytes += b;
    return e;
}

// `blocks` regions of `region_bytes` for stream_bulk, one a block, filled (so that no read finds a
// page untouched).
inline cudaError_t stream_regions(int blocks, size_t region_bytes, char** regions) {
    const cudaError_t e = cudaMalloc(regions, (size_t)blocks * region_bytes);
    return e != cudaSuccess ? e : cudaMemset(*regions, 1, (size_t)blocks * region_bytes);
}
