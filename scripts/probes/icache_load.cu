// Whether a phase's first pass through its code waits for instruction fetches that queue behind the
// weight streams (issue 47, docs/perf.md "A reading to test: instruction fetch under load"). A few
// "runner" blocks each execute a straight line of CODE_INSTRS independent FMAs (no loop, no branch:
// every instruction fetched once a pass) twice, timing each pass with %globaltimer, while the other
// blocks of the grid either idle or stream a buffer far larger than L2 from HBM with 16-byte loads, as
// the megakernel's other blocks stream weights while attention runs. The first pass fetches the code
// from L2 (or HBM); the second finds it in the SM's instruction caches where it fits them.
//
// Reported for each code size, with and without the stream: the runners' first and second pass in
// nanoseconds (median over runners and repeats), and the stream's rate. Prediction (written before it
// ran): without the stream the first pass costs about as much as the second plus one L2 round trip per
// fetch run; with the stream the first pass of 16-64 KB of code is 2-5 times its unloaded time, the
// second pass unchanged; if so, a phase's first pass through several KB of new code costs about a
// microsecond under load, the size of the sub-microsecond parts docs/perf.md could not explain. (It
// did not: docs/perf.md, call 4 of 2026-12-05.)
//   nvcc -O3 -arch=sm_90a -o icache_load scripts/probes/icache_load.cu && ./icache_load
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include <vector>
#include "probe.cuh"

constexpr int THREADS = 512;       // the megakernel's block
constexpr int RUNNERS = 8;         // blocks 0..7 run the code, as attention's 8 blocks at Llama-3.2-1B
constexpr int REPEATS = 20;        // launches per configuration
constexpr unsigned long long SETTLE_NS = 100000;  // the runners start once the stream has run this long
constexpr size_t STREAM_BYTES = 8ull << 30;       // far past the 60 MB L2
constexpr int SMEM_BYTES = 120 << 10;             // unused; more than half an SM's, so one block an SM

// Eight independent FMAs, one instruction each: a warp issues them back to back once fetched.
#define FMA8                                                                                              \
    asm volatile(                                                                                         \
        "fma.rn.f32 %0, %0, 0f3F800001, 0f3A83126F;\n fma.rn.f32 %1, %1, 0f3F800001, 0f3A83126F;\n"       \
        "fma.rn.f32 %2, %2, 0f3F800001, 0f3A83126F;\n fma.rn.f32 %3, %3, 0f3F800001, 0f3A83126F;\n"       \
        "fma.rn.f32 %4, %4, 0f3F800001, 0f3A83126F;\n fma.rn.f32 %5, %5, 0f3F800001, 0f3A83126F;\n"       \
        "fma.rn.f32 %6, %6, 0f3F800001, 0f3A83126F;\n fma.rn.f32 %7, %7, 0f3F800001, 0f3A83126F;\n"       \
        : "+f"(a[0]), "+f"(a[1]), "+f"(a[2]), "+f"(a[3]), "+f"(a[4]), "+f"(a[5]), "+f"(a[6]), "+f"(a[7]));
#define X2(s) s s
#define X4(s) s s s s
#define FMA_16KB X2(X4(X4(X4(FMA8))))  // 1024 FMAs, 16 bytes of machine code each

// One pass of KB16 times 16 KB of code, straight-line.
template <int KB16>
__device__ __forceinline__ void pass(float (&a)[8]) {
    if constexpr (KB16 > 0) {
        FMA_16KB
        pass<KB16 - 1>(a);
    }
}

// Blocks below RUNNERS: wait for the stream to settle (or not, without one), run the code twice, stamp
// each pass. The others stream `words` 16-byte words of `buf` when `stream`, else return at once.
template <int KB16>
__global__ void __launch_bounds__(THREADS, 1) probe(const uint4* buf, size_t words, bool stream, unsigned long long* ns, float* sink) {
    if (blockIdx.x >= RUNNERS) {
        if (!stream) return;
        uint32_t s = 0;
        const size_t stride = (size_t)(gridDim.x - RUNNERS) * THREADS;
        for (size_t i = (size_t)(blockIdx.x - RUNNERS) * THREADS + threadIdx.x; i < words; i += stride) {
            const uint4 v = __ldcs(buf + i);
            s ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        if (s == 0x12345678u) sink[0] = (float)s;  // keeps the loads
        return;
    }
    __shared__ unsigned long long t0;
    if (threadIdx.x == 0) {
        const unsigned long long start = globaltimer();
        while (globaltimer() - start < SETTLE_NS) {}
        t0 = globaltimer();
    }
    __syncthreads();  // every warp starts the code together, after the settle
    float a[8];
    for (int k = 0; k < 8; ++k) a[k] = (float)(threadIdx.x + k);
    unsigned long long stamps[3];
    stamps[0] = t0;
#pragma unroll 1
    for (int p = 0; p < 2; ++p) {
        pass<KB16>(a);
        __syncthreads();  // the block's slowest warp ends the pass
        stamps[p + 1] = globaltimer();
    }
    if (threadIdx.x == 0) {
        ns[blockIdx.x * 2] = stamps[1] - stamps[0];
        ns[blockIdx.x * 2 + 1] = stamps[2] - stamps[1];
    }
    float s = 0;
    for (int k = 0; k < 8; ++k) s += a[k];
    if (s == 1.2345f) sink[1] = s;  // keeps the FMAs
}

template <int KB16>
int measure(const uint4* buf, size_t words, int grid, unsigned long long* ns, float* sink) {
    TRY(cudaFuncSetAttribute(probe<KB16>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    for (bool stream : {false, true}) {
        std::vector<unsigned long long> first, second;
        float total_ms = 0;
        for (int r = 0; r < REPEATS; ++r) {
            total_ms += elapsed_ms([&] { probe<KB16><<<grid, THREADS, SMEM_BYTES>>>(buf, words, stream, ns, sink); });
            TRY(cudaGetLastError());
            std::vector<unsigned long long> h(RUNNERS * 2);
            TRY(cudaMemcpy(h.data(), ns, h.size() * sizeof h[0], cudaMemcpyDeviceToHost));
            for (int i = 0; i < RUNNERS; ++i) {
                first.push_back(h[2 * i]);
                second.push_back(h[2 * i + 1]);
            }
        }
        std::sort(first.begin(), first.end());
        std::sort(second.begin(), second.end());
        const double rate = stream ? words * 16.0 / (total_ms / REPEATS * 1e-3) / 1e12 : 0.0;
        printf("%6d KB  %-9s %12llu %12llu %10.2f\n", KB16 * 16, stream ? "streamed" : "idle", first[first.size() / 2], second[second.size() / 2], rate);
    }
    return 0;
}

int main() {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
        printf("no CUDA device\n");
        return 1;
    }
    uint4* buf = nullptr;
    unsigned long long* ns = nullptr;
    float* sink = nullptr;
    TRY(cudaMalloc(&buf, STREAM_BYTES));
    TRY(cudaMemset(buf, 1, STREAM_BYTES));
    TRY(cudaMalloc(&ns, RUNNERS * 2 * sizeof *ns));
    TRY(cudaMalloc(&sink, 2 * sizeof *sink));
    const size_t words = STREAM_BYTES / 16;
    printf("%9s  %-9s %12s %12s %10s\n", "code", "others", "pass 1 ns", "pass 2 ns", "TB/s");
    if (measure<1>(buf, words, sms, ns, sink) || measure<4>(buf, words, sms, ns, sink) || measure<8>(buf, words, sms, ns, sink)) return 1;
    return 0;
}
