// How fast HBM streams when only part of the grid streams, the way the megakernel streams weights:
// each block (one per SM) reads a contiguous share of a buffer far larger than L2 through a ring of
// shared-memory slots, one bulk copy (cp.async.bulk, completing on the slot's mbarrier) per slot,
// SLOTS - 1 slots ahead of use, and its threads read every slot once (an XOR standing in for the dot
// products) or takes the megakernel's dot products of every 16 KB row with a vector held in registers
// (`dot`). It prints the read bandwidth for each number of streaming blocks and ring shape; then, for
// one launch of a whole grid (one block per SM) in which only some blocks stream, the bandwidth of
// each choice of half (the first or second half of the blocks, the even or the odd ones), and the SM
// each block ran on (%smid).
//
// The question (docs/perf.md, "Streaming on part of the grid"): can part of the grid keep HBM at the
// whole grid's rate while the rest does latency-bound work such as attention?
//
// Build and run on the GPU (any nvcc for sm_90a; with the pinned wheels that the cargo build installs
// into .cuda-venv/, add -L for the wheel's lib folder, as scripts/build-example does):
//   nvcc -O3 -arch=sm_90a -o sm_stream megakernel/probes/sm_stream.cu && ./sm_stream [MiB per launch]
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "../../kernels/include/bulk.cuh"
#include "../../kernels/include/layer_math.cuh"

constexpr uint32_t THREADS = 512;
constexpr uint32_t MAX_SLOTS = 8;
constexpr uint32_t WARPS = THREADS / WARP;
constexpr uint64_t BUFFER_BYTES = 1ull << 31;  // 2 GiB: no share of it stays in the 60 MB L2
constexpr int REPS = 10;
// `dot`: rows of ROW_BYTES (the graded layer's d = 8192 bf16), 2 vectors of each per thread, at most
// MAX_SLOT_ROWS rows a slot (64 KB).
constexpr uint32_t ROW_BYTES = 16 * 1024;
constexpr uint32_t VPT = ROW_BYTES / 16 / THREADS;
constexpr uint32_t MAX_SLOT_ROWS = 4;

// How the threads consume a slot.
enum class Work { Xor, Dot };

#define CHECK(call)                                                                   \
    do {                                                                              \
        cudaError_t e = (call);                                                       \
        if (e != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e)); \
            return 1;                                                                 \
        }                                                                             \
    } while (0)

// The ring of the megakernel (kernels/megakernel/vm_stream.cuh, RowStream): stage k goes to slot k % slots and
// completes phase (k / slots) & 1 of that slot's mbarrier.
// Which blocks of the launch stream: all of them, or one half of a whole grid's launch (the others
// return at once).
enum class Half : int { All, First, Second, Even, Odd };

// This block's rank among the streaming blocks, or -1 if it does not stream.
__device__ inline int streaming_rank(Half half) {
    const uint32_t b = blockIdx.x, n = gridDim.x;
    switch (half) {
        case Half::All: return (int)b;
        case Half::First: return b < n / 2 ? (int)b : -1;
        case Half::Second: return b >= n / 2 ? (int)(b - n / 2) : -1;
        case Half::Even: return b % 2 == 0 ? (int)(b / 2) : -1;
        case Half::Odd: return b % 2 == 1 ? (int)(b / 2) : -1;
    }
    return -1;
}

template <Work WORK>
__global__ void __launch_bounds__(THREADS, 1) ring_stream(const char* __restrict__ src, uint64_t share_bytes, uint32_t slot_bytes,
                                                          uint32_t slots, Half half, uint32_t* __restrict__ sink,
                                                          uint32_t* __restrict__ smids) {
    extern __shared__ __align__(128) uint4 ring[];
    __shared__ uint64_t full[MAX_SLOTS];
    __shared__ float red[WARPS * MAX_SLOT_ROWS];  // the warps' row partials, as the megakernel's red
    if (threadIdx.x == 0) asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smids[blockIdx.x]));
    const int rank = streaming_rank(half);
    if (rank < 0) return;
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < slots; ++s) mbar_init(&full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // the barriers are initialised before anyone waits on them
    const char* base = src + (uint64_t)rank * share_bytes;
    const uint32_t stages = (uint32_t)(share_bytes / slot_bytes), slot_vecs = slot_bytes / 16;
    // Thread 0 starts stage st's copy; its slot was last read before the __syncthreads in front of it.
    auto issue = [&](uint32_t st) {
        if (threadIdx.x != 0 || st >= stages) return;
        mbar_expect_tx(&full[st % slots], slot_bytes);
        bulk_copy(ring + (st % slots) * slot_vecs, base + (uint64_t)st * slot_bytes, slot_bytes, &full[st % slots]);
    };
    for (uint32_t st = 0; st + 1 < slots; ++st) issue(st);
    uint32_t acc = 0;
    uint4 h[VPT];  // the input vector's share, as the megakernel's Slice
#pragma unroll
    for (uint32_t v = 0; v < VPT; ++v) h[v] = make_uint4(threadIdx.x, v, 0x3f803f80u, blockIdx.x);
    float facc = 0.0f;
    for (uint32_t st = 0; st < stages; ++st) {
        __syncthreads();  // every thread is done with stage st - 1, whose slot the next issue refills
        issue(st + slots - 1);
        mbar_wait(&full[st % slots], (st / slots) & 1);  // stage st has landed
        const uint4* slot = ring + (st % slots) * slot_vecs;
        if (WORK == Work::Xor) {
            for (uint32_t v = threadIdx.x; v < slot_vecs; v += THREADS) acc ^= slot[v].x ^ slot[v].y ^ slot[v].z ^ slot[v].w;
        } else {
            // The megakernel's RowStream::run: a dot product per row (dot8 of layer_math.cuh), a
            // butterfly per row, lane 0 storing the warp's partials.
            float row[MAX_SLOT_ROWS];
#pragma unroll
            for (uint32_t i = 0; i < MAX_SLOT_ROWS; ++i) {
                row[i] = 0.0f;
#pragma unroll
                for (uint32_t v = 0; v < VPT; ++v) {
                    if (i < slot_bytes / ROW_BYTES) row[i] = dot8(slot[i * (ROW_BYTES / 16) + v * THREADS + threadIdx.x], h[v], row[i]);
                }
            }
#pragma unroll
            for (uint32_t i = 0; i < MAX_SLOT_ROWS; ++i) row[i] = warp_reduce(row[i], Add{});
            if (threadIdx.x % WARP == 0) {
#pragma unroll
                for (uint32_t i = 0; i < MAX_SLOT_ROWS; ++i) red[threadIdx.x / WARP * MAX_SLOT_ROWS + i] = row[i];
            }
            facc += row[0];
        }
    }
    // Every thread's accumulator must be used, or the compiler drops its reads.
    acc ^= __float_as_uint(facc);
    if (acc == 0xFFFFFFFFu || threadIdx.x == 0) sink[blockIdx.x] = acc + (uint32_t)red[threadIdx.x % (WARPS * MAX_SLOT_ROWS)];
}

// The median bandwidth of REPS launches of `blocks` blocks (`half` of them streaming) reading `total`
// bytes, in TB/s (0 on error).
template <Work WORK>
double measure(const char* src, uint32_t* sink, uint32_t* smids, uint64_t total, int blocks, Half half, uint32_t slots, uint32_t slot_bytes,
               cudaEvent_t start, cudaEvent_t stop) {
    const int streaming = half == Half::All ? blocks : half == Half::First || half == Half::Even ? (blocks + 1) / 2 : blocks / 2;
    const uint64_t share = total / streaming / slot_bytes * slot_bytes;
    const size_t smem = (size_t)slots * slot_bytes;
    if (cudaFuncSetAttribute(ring_stream<WORK>, cudaFuncAttributeMaxDynamicSharedMemorySize, 224 * 1024) != cudaSuccess) return 0;
    std::vector<float> ms;
    for (int i = 0; i <= REPS; ++i) {
        cudaEventRecord(start);
        ring_stream<WORK><<<blocks, THREADS, smem>>>(src, share, slot_bytes, slots, half, sink, smids);
        cudaEventRecord(stop);
        if (cudaEventSynchronize(stop) != cudaSuccess) return 0;
        float t;
        cudaEventElapsedTime(&t, start, stop);
        if (i > 0) ms.push_back(t);  // launch 0 warms up
    }
    if (cudaGetLastError() != cudaSuccess) return 0;
    std::sort(ms.begin(), ms.end());
    return (double)share * streaming / (ms[REPS / 2] * 1e-3) / 1e12;
}

int main(int argc, char** argv) {
    const uint64_t total = argc > 1 ? std::min<uint64_t>(strtoull(argv[1], nullptr, 10) << 20, BUFFER_BYTES) : BUFFER_BYTES;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    char* src;
    uint32_t *sink, *smids;
    CHECK(cudaMalloc(&src, BUFFER_BYTES));
    CHECK(cudaMalloc(&sink, sms * sizeof(uint32_t)));
    CHECK(cudaMalloc(&smids, sms * sizeof(uint32_t)));
    CHECK(cudaMemset(src, 0x5a, BUFFER_BYTES));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    const auto failed = [] {
        fprintf(stderr, "launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
        return 1;
    };
    const struct { uint32_t slots, slot_bytes; } rings[] = {{3, 64 * 1024}, {6, 32 * 1024}, {3, 32 * 1024}};
    printf("%d SMs; %llu MiB read per launch; median of %d launches; TB/s (GB/s per SM)\n", sms, (unsigned long long)(total >> 20), REPS);
    printf("%8s %7s %10s %18s %18s\n", "blocks", "slots", "slot KiB", "xor", "dot");
    for (const auto& r : rings) {
        for (int blocks : {sms, sms * 7 / 8, sms * 3 / 4, sms * 5 / 8, sms / 2, sms * 3 / 8, sms / 4}) {
            const double x = measure<Work::Xor>(src, sink, smids, total, blocks, Half::All, r.slots, r.slot_bytes, start, stop);
            const double d = measure<Work::Dot>(src, sink, smids, total, blocks, Half::All, r.slots, r.slot_bytes, start, stop);
            if (x == 0 || d == 0) return failed();
            printf("%8d %7u %10u %9.3f (%5.1f) %9.3f (%5.1f)\n", blocks, r.slots, r.slot_bytes / 1024, x, x * 1e3 / blocks, d, d * 1e3 / blocks);
        }
    }
    // Half of one whole grid's launch streaming (3 x 64 KB slots, xor): the halves the megakernel's
    // two-role plan could give each role.
    printf("\n%d blocks launched, half of them streaming (3 x 64 KiB slots, xor); TB/s\n", sms);
    const struct { Half half; const char* name; } halves[] = {
        {Half::All, "all"}, {Half::First, "first half"}, {Half::Second, "second half"}, {Half::Even, "even blocks"}, {Half::Odd, "odd blocks"}};
    for (const auto& h : halves) {
        const double x = measure<Work::Xor>(src, sink, smids, total, sms, h.half, 3, 64 * 1024, start, stop);
        if (x == 0) return failed();
        printf("%12s %9.3f\n", h.name, x);
    }
    std::vector<uint32_t> on(sms);
    CHECK(cudaMemcpy(on.data(), smids, sms * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    printf("SM of each block in that launch:");
    for (uint32_t s : on) printf(" %u", s);
    printf("\n");
    return 0;
}
