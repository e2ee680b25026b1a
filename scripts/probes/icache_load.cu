// Whether a phase's first pass through its code waits for instruction fetches that queue behind the
// weight streams (issue 47, docs/perf.md "A reading to test: instruction fetch under load"). A few
// "runner" blocks each execute a straight line of CODE_INSTRS independent FMAs (no loop, no branch:
// every instruction fetched once a pass) twice, timing each pass with %globaltimer, while the other
// blocks of the grid idle, stream from HBM with 16-byte loads (`plain`), or keep 64 KB bulk copies in
// flight as the megakernel's ring does (`bulk 1`, `bulk 2`: stages in flight a block, evict-first, each
// block over its own 16 MB). The first pass fetches the code from L2 (or HBM); the second finds it in
// the SM's instruction caches where it fits them.
//
// Reported for each code size and stream: the runners' first and second pass in nanoseconds (median over
// runners and repeats), and the stream's rate. The plain stream (call 4 of 2026-12-05) did not slow the
// first pass; but it keeps about 1 MB in flight, where the ring keeps 8-17 MB, and docs/perf.md's
// inflight_latency.cu measured L2 hits 1.4-7x slower behind the ring's bytes. The bulk modes' predictions
// and outcome are in docs/perf.md ("Instruction fetch behind the ring's bytes"): code that fits the SM's
// instruction cache (up to 64 KB) ran as fast behind them as idle; 128 KB, which does not, 1.6-2.2x slower.
//   nvcc -O3 -arch=sm_90a -o icache_load scripts/probes/icache_load.cu && ./icache_load
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include <vector>
#include "probe.cuh"
#include "probe_stream.cuh"

constexpr int THREADS = 512;       // the megakernel's block
constexpr int RUNNERS = 8;         // blocks 0..7 run the code, as attention's 8 blocks at Llama-3.2-1B
constexpr int REPEATS = 20;        // launches per configuration
constexpr unsigned long long SETTLE_NS = 100000;  // the runners start once the stream has run this long
constexpr size_t REGION_BYTES = 16ull << 20;      // a streaming block's own region, read round and round
constexpr uint32_t MAX_STAGES = 2;                        // the bulk modes' ring
constexpr int SMEM_BYTES = MAX_STAGES * STREAM_STAGE;     // more than half an SM's: one block an SM

// What the blocks past the runners do: nothing, 16-byte loads, or bulk copies with 1 or 2 in flight.
enum Stream : int { IDLE = 0, PLAIN = 1, BULK1 = 2, BULK2 = 3 };
const char* const STREAM_NAMES[] = {"idle", "plain", "bulk 1", "bulk 2"};

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

// 16-byte loads of the block's region, round and round, until every runner is done; the bytes read.
__device__ unsigned long long stream_plain(const uint4* region, const unsigned* done) {
    constexpr size_t WORDS = REGION_BYTES / 16;
    uint32_t s = 0;
    unsigned long long words = 0;
    for (size_t i = threadIdx.x;; i = (i + THREADS) % WORDS) {
        const uint4 v = __ldcs(region + i);
        s ^= v.x ^ v.y ^ v.z ^ v.w;
        ++words;
        if (words % 64 == 0 && ld_relaxed(done) == RUNNERS) break;  // a poll every 64 loads
    }
    if (s == 0x12345678u) words = 0;  // keeps the loads
    return words * 16;
}

// Blocks below RUNNERS: wait for the stream to settle, run the code twice, stamp each pass, count
// themselves done. The others stream their region as `mode` says until every runner is done.
template <int KB16>
__global__ void __launch_bounds__(THREADS, 1)
    probe(const char* buf, Stream mode, unsigned* done, unsigned long long* landed, unsigned long long* ns, float* sink) {
    extern __shared__ __align__(128) char ring[];
    __shared__ uint64_t full[MAX_STAGES];
    if (blockIdx.x >= RUNNERS) {
        const char* region = buf + (size_t)(blockIdx.x - RUNNERS) * REGION_BYTES;
        if (mode == PLAIN) {
            const unsigned long long bytes = stream_plain(reinterpret_cast<const uint4*>(region), done);
            atomicAdd(&landed[blockIdx.x], bytes);
        } else if (mode != IDLE && threadIdx.x == 0) {
            for (uint32_t k = 0; k < MAX_STAGES; ++k) mbar_init(&full[k], 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // before any copy names them
            landed[blockIdx.x] = stream_bulk(region, REGION_BYTES, mode == BULK1 ? 1 : 2, done, RUNNERS, ring, full);
        }
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
        ns[2 * RUNNERS + blockIdx.x] = stamps[2] - stamps[0] + SETTLE_NS;  // the runner's window
        red_release(done);  // the streams stop once every runner is here
    }
    float s = 0;
    for (int k = 0; k < 8; ++k) s += a[k];
    if (s == 1.2345f) sink[1] = s;  // keeps the FMAs
}

template <int KB16>
int measure(const char* buf, int grid, unsigned* done, unsigned long long* landed, unsigned long long* ns, float* sink) {
    TRY(cudaFuncSetAttribute(probe<KB16>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    for (Stream mode : {IDLE, PLAIN, BULK1, BULK2}) {
        std::vector<unsigned long long> first, second;
        double bytes = 0, window_ns = 0;
        for (int r = 0; r < REPEATS; ++r) {
            TRY(cudaMemset(done, 0, sizeof *done));
            TRY(cudaMemset(landed, 0, grid * sizeof *landed));
            void* args[] = {(void*)&buf, &mode, &done, &landed, &ns, &sink};
            // Cooperative: every block resident at once, so the runners' count can stop the streams.
            TRY(cudaLaunchCooperativeKernel((void*)probe<KB16>, grid, THREADS, args, SMEM_BYTES, 0));
            TRY(cudaDeviceSynchronize());
            std::vector<unsigned long long> h(RUNNERS * 3), l(grid);
            TRY(cudaMemcpy(h.data(), ns, h.size() * sizeof h[0], cudaMemcpyDeviceToHost));
            TRY(cudaMemcpy(l.data(), landed, grid * sizeof l[0], cudaMemcpyDeviceToHost));
            for (int i = 0; i < RUNNERS; ++i) {
                first.push_back(h[2 * i]);
                second.push_back(h[2 * i + 1]);
            }
            for (int b = 0; b < grid; ++b) bytes += l[b];
            window_ns += *std::max_element(h.begin() + 2 * RUNNERS, h.end());
        }
        std::sort(first.begin(), first.end());
        std::sort(second.begin(), second.end());
        // The rate over the runners' windows (the streams run a little longer, to their poll).
        printf("%6d KB  %-9s %12llu %12llu %10.2f\n", KB16 * 16, STREAM_NAMES[mode], first[first.size() / 2], second[second.size() / 2],
               bytes / window_ns / 1e3);
    }
    return 0;
}

int main() {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
        printf("no CUDA device\n");
        return 1;
    }
    char* buf = nullptr;
    unsigned* done = nullptr;
    unsigned long long *ns = nullptr, *landed = nullptr;
    float* sink = nullptr;
    TRY(stream_regions(sms, REGION_BYTES, &buf));
    TRY(cudaMalloc(&done, sizeof *done));
    TRY(cudaMalloc(&landed, sms * sizeof *landed));
    TRY(cudaMalloc(&ns, RUNNERS * 3 * sizeof *ns));
    TRY(cudaMalloc(&sink, 2 * sizeof *sink));
    printf("%9s  %-9s %12s %12s %10s\n", "code", "others", "pass 1 ns", "pass 2 ns", "TB/s");
    if (measure<1>(buf, sms, done, landed, ns, sink) || measure<2>(buf, sms, done, landed, ns, sink) ||
        measure<4>(buf, sms, done, landed, ns, sink) || measure<8>(buf, sms, done, landed, ns, sink))
        return 1;
    return 0;
}
