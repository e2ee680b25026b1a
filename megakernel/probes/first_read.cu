// What a block's first read costs at a kernel's start, cold and warm: each of 132 blocks of 512 threads
// reads 64 or 128 KB (16-byte loads, 8 in flight per thread) at its own place in a 2 GiB buffer, and
// stamps the global timer from its start to the last load landed. Cases: after a 3 GiB stream (the
// TLBs and L2 cold for the buffer), the next lines of the same pages (translations warm, L2 cold), the
// same lines again (both warm), after a 128 MB stream (L2 cold), and the blocks 64 KB or 2 MB apart
// (5 or 132 pages). Three rounds.
//
// The question (docs/perf.md, "DRAM over time"): is the megakernel's slow start (its first weights
// land several microseconds into the launch) cold address translation?
//
// Build and run on the GPU (as sm_stream.cu):
//   nvcc -O3 -arch=sm_90a -o first_read megakernel/probes/first_read.cu && ./first_read
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>

#include "../../kernels/include/stream.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// Loads each thread has in flight in touch.
constexpr int IN_FLIGHT = 8;

__device__ __forceinline__ uint64_t global_ns() { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

// Block b reads `bytes` at base + b * stride + off; out[b] = ns from block start to all loads landed.
__global__ void touch(const uint4* base, size_t stride, size_t off, size_t bytes, uint64_t* out, uint32_t* sink) {
    __syncthreads();
    uint64_t t0 = global_ns();
    const uint4* p = base + (blockIdx.x * stride + off) / 16;
    uint32_t acc = 0;
    size_t n = bytes / 16;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x * IN_FLIGHT) {
        uint4 v[IN_FLIGHT];
#pragma unroll
        for (int j = 0; j < IN_FLIGHT; ++j) v[j] = (i + j * blockDim.x < n) ? __ldcg(p + i + j * blockDim.x) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < IN_FLIGHT; ++j) acc ^= v[j].x ^ v[j].w;
    }
    keep_loads(sink, acc);
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = global_ns() - t0;
}

// Reads z[0, n) once (the read-only stream's loop): evicts L2, and the translations of whatever it
// pushes out of the TLBs.
__global__ void evict(const uint4* z, size_t n, uint32_t* sink) {
    keep_loads(sink, xor_stream(z, n, blockIdx.x * (uint64_t)blockDim.x + threadIdx.x, (uint64_t)gridDim.x * blockDim.x, 0));
}

int main() {
    const int G = 132, T = 512, EVICT_BLOCKS = 4 * G;
    const size_t WB = 2ull << 30, ZB = 3ull << 30, E = 128ull << 20;
    uint4 *w, *z; uint64_t* out; uint32_t* sink;
    CK(cudaMalloc(&w, WB)); CK(cudaMalloc(&z, ZB)); CK(cudaMalloc(&out, G * 8)); CK(cudaMalloc(&sink, EVICT_BLOCKS * sizeof(uint32_t)));  // a word per block (keep_loads)
    CK(cudaMemset(w, 1, WB)); CK(cudaMemset(z, 2, ZB));
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<uint64_t> h(G);
    auto run = [&](const char* name, size_t stride, size_t off, size_t bytes) {
        cudaEventRecord(a);
        touch<<<G, T>>>(w, stride, off, bytes, out, sink);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b);
        cudaMemcpy(h.data(), out, G * 8, cudaMemcpyDeviceToHost);
        std::sort(h.begin(), h.end());
        printf("%-44s block median %6.2f us  max %6.2f us  kernel %6.2f us\n", name, h[G / 2] / 1e3, h[G - 1] / 1e3, ms * 1e3);
    };
    auto cold_all = [&]() { evict<<<EVICT_BLOCKS, T>>>(z, ZB / 16, sink); cudaDeviceSynchronize(); };  // 1500 pages: TLB and L2
    auto cold_l2 = [&]() { evict<<<EVICT_BLOCKS, T>>>(z, E / 16, sink); cudaDeviceSynchronize(); };     // 64 pages: L2
    // A Qkv block's share of its half of the packed QKV rows (84 MB over 132 blocks), and one ring stage.
    const size_t QKV = 636 * 1024, K64 = 64 * 1024;
    for (int rep = 0; rep < 3; ++rep) {
        printf("-- round %d\n", rep);
        for (size_t bytes : {K64, 2 * K64}) {
            printf(" %zu KB per block, blocks 636 KB apart (about 42 pages)\n", bytes / 1024);
            cold_all(); run("  after a 3 GB stream (TLB + L2 cold)", QKV, 0, bytes);
            run("  next lines, same pages (TLB warm, L2 cold)", QKV, 2 * K64, bytes);
            run("  the same lines again (both warm)", QKV, 0, bytes);
            cold_l2(); run("  after a 128 MB stream (L2 cold, TLB?)", QKV, 0, bytes);
            cold_all(); run("  after 3 GB: blocks 64 KB apart (5 pages)", bytes, 0, bytes);
            cold_all(); run("  after 3 GB: blocks 2 MB apart (132 pages)", 2ull << 20, 0, bytes);
            run("  2 MB apart, next lines (TLB warm)", 2ull << 20, 4 * K64, bytes);
        }
    }
    CK(cudaGetLastError());
    return 0;
}
