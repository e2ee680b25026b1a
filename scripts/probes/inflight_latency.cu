// What bytes in flight do to a dependency's latency. Every try at asking for weights sooner (a second
// primed stage, L2 prefetches, GateUp's first stage landed during attention: docs/perf.md) made the
// chain slower by about what it saved the stream: the hops and inputs on the critical path took longer
// while the extra bytes were in flight. This probe measures that directly, and where it comes from: a
// queue in the SM that has the bytes in flight, or one that every SM's misses share.
//
// Block 0's thread 0 times two things while the other blocks stream: a chase of dependent L2 hits
// (`ld.relaxed.gpu`, each load's address the one before's value, over 1 MB that L2 holds), and a
// ping-pong of a flag with block 1's thread 0 (`st.release.gpu` / `ld.acquire.gpu`, the megakernel's
// hand-off without the fan-in), one way's mean. The other blocks' thread 0 keep `others` bulk copies of
// 64 KB in flight each (the megakernel's ring stages, evict-first, each block over its own 16 MB so
// that every copy misses L2); blocks 0 and 1 keep `own` in flight themselves, from another warp.
// Build and run on the GPU:
//   nvcc -O3 -arch=sm_90a -o inflight_latency scripts/probes/inflight_latency.cu && ./inflight_latency
#include "probe.cuh"
#include "probe_stream.cuh"
#include <stdint.h>
#include <vector>

constexpr uint32_t THREADS = 128, MAX_STAGES = 3;
constexpr size_t REGION_BYTES = 16ull << 20;  // each block's stream, read round and round
constexpr uint32_t CHASE_WORDS = 1u << 18;    // 1 MB of indices
constexpr uint32_t CHASE_STRIDE = 64;         // words between consecutive loads' lines (256 bytes)
constexpr uint32_t CHASE_LOADS = 4000, PINGS = 2000;
constexpr unsigned long long RAMP_NS = 30000;  // the streams reach their rate before the timing starts

__device__ inline void st_release(unsigned* p, unsigned v) { asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }

struct Result {
    unsigned long long chase_ns, ping_ns, window_ns;
};

__global__ void __launch_bounds__(THREADS, 1)
    probe(const char* weights, const uint32_t* chase, unsigned* flags, unsigned long long* landed, Result* out, uint32_t others, uint32_t own) {
    extern __shared__ __align__(128) char ring[];
    __shared__ uint64_t full[MAX_STAGES];
    unsigned* ping = flags;      // the ping-pong's word
    unsigned* stop = flags + 1;  // set by block 0 when it is done
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < MAX_STAGES; ++s) mbar_init(&full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the barriers are initialised before any copy names them
    const char* region = weights + (size_t)blockIdx.x * REGION_BYTES;
    const bool timed = blockIdx.x < 2;
    // Blocks 0 and 1: thread 0 times, warp 1 streams `own`; the others: thread 0 streams `others`.
    if (timed && threadIdx.x == 32) landed[blockIdx.x] = stream_bulk(region, REGION_BYTES, own, stop, 1, ring, full);
    if (!timed && threadIdx.x == 0) landed[blockIdx.x] = stream_bulk(region, REGION_BYTES, others, stop, 1, ring, full);
    if (!timed || threadIdx.x != 0) return;
    const unsigned long long t0 = globaltimer();
    while (globaltimer() - t0 < RAMP_NS) {
    }
    if (blockIdx.x == 1) {
        // The pong: each odd value block 0 writes is answered with the next even one.
        for (unsigned i = 0; i < PINGS; ++i) {
            while (ld_acquire(ping) != 2 * i + 1) {
            }
            st_release(ping, 2 * i + 2);
        }
        return;
    }
    const unsigned long long c0 = globaltimer();
    uint32_t at = 0;
    for (uint32_t i = 0; i < CHASE_LOADS; ++i) at = ld_relaxed(chase + at);
    const unsigned long long c1 = globaltimer();
    for (unsigned i = 0; i < PINGS; ++i) {
        st_release(ping, 2 * i + 1);
        while (ld_acquire(ping) != 2 * i + 2) {
        }
    }
    const unsigned long long c2 = globaltimer();
    st_release(stop, 1);
    // `at` is stored so that the chase is not optimised away.
    *out = Result{(c1 - c0) / CHASE_LOADS + (at == 0xFFFFFFFFu), (c2 - c1) / (2 * PINGS), c2 - t0};
}

int main() {
    int sms = 0;
    TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    TRY(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs; blocks 0 and 1 time, the other %d stream 64 KB stages (each over its own 16 MB)\n", prop.name, sms, sms - 2);
    char* weights;
    uint32_t *chase;
    unsigned* flags;
    unsigned long long* landed;
    Result* out;
    TRY(stream_regions(sms, REGION_BYTES, &weights));
    TRY(cudaMalloc(&chase, CHASE_WORDS * 4));
    TRY(cudaMalloc(&flags, 8));
    TRY(cudaMalloc(&landed, sms * 8));
    TRY(cudaMalloc(&out, sizeof(Result)));
    // One cycle through every line of the chase's 1 MB in a scrambled order.
    const uint32_t lines = CHASE_WORDS / CHASE_STRIDE;
    std::vector<uint32_t> order(lines), host(CHASE_WORDS, 0);
    for (uint32_t i = 0; i < lines; ++i) order[i] = i;
    uint32_t seed = 12345;
    for (uint32_t i = lines - 1; i > 0; --i) {
        seed = seed * 1664525u + 1013904223u;
        std::swap(order[i], order[seed % (i + 1)]);
    }
    for (uint32_t i = 0; i < lines; ++i) host[order[i] * CHASE_STRIDE] = order[(i + 1) % lines] * CHASE_STRIDE;
    TRY(cudaMemcpy(chase, host.data(), CHASE_WORDS * 4, cudaMemcpyHostToDevice));
    const uint32_t smem = MAX_STAGES * STREAM_STAGE;
    TRY(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    printf("%-26s %14s %14s %12s\n", "in flight (64 KB stages)", "L2 hit, ns", "hand-off, ns", "TB/s");
    const uint32_t cases[][2] = {{0, 0}, {1, 0}, {2, 0}, {3, 0}, {0, 2}, {2, 2}, {0, 3}, {3, 3}};
    for (int rep = 0; rep < 2; ++rep) {
        for (const auto& c : cases) {
            TRY(cudaMemset(flags, 0, 8));
            TRY(cudaMemset(landed, 0, sms * 8));
            void* args[] = {&weights, &chase, &flags, &landed, &out, (void*)&c[0], (void*)&c[1]};
            TRY(cudaLaunchCooperativeKernel((void*)probe, sms, THREADS, args, smem, 0));
            TRY(cudaDeviceSynchronize());
            Result r;
            unsigned long long bytes;
            TRY(cudaMemcpy(&r, out, sizeof r, cudaMemcpyDeviceToHost));
            TRY(landed_bytes(landed, sms, &bytes));
            char name[64];
            snprintf(name, sizeof name, "others %u, own %u", c[0], c[1]);
            printf("%-26s %14llu %14llu %12.2f\n", name, r.chase_ns, r.ping_ns, bytes / (double)r.window_ns / 1e3);
        }
    }
    return 0;
}
