// What a hand-off costs inside a thread-block cluster, against the megakernel's global one, while the
// other SMs stream. Every hop of the megakernel goes through L2 (a release of the phase's writes, a
// count, a poll, then the input's reload), and behind the ring's bytes each round trip costs 2-5x its
// idle time (inflight_latency.cu, docs/perf.md). Blocks of one cluster can instead write each other's
// shared memory (DSMEM) and signal there, which no L2 queue stands in front of, if the SM-to-SM network
// is not the same queue. A dataflow layout with a cluster per KV head (its Qkv rows, its attention, the
// O projection's columns of its head) would turn two of a layer's five global hops into such hand-offs.
//
// Block ranks 0 (A) and 1 (B) of cluster 0 time, one way's mean over a ping-pong:
//   flag, global   A st.release.gpu a word in global memory, B polls it with ld.acquire.gpu
//   flag, DSMEM    A st.release.cluster a word in B's shared memory, B polls its own with ld.acquire.cluster
//   4 KB, global   A's 256 threads store a vector of 4 KB to global memory, bar.sync, a release of the
//                  flag; B polls, bar.sync, its 256 threads load the vector (ld.cg) and use it: the
//                  megakernel's hop and input without the fan-in
//   4 KB, DSMEM    the same with the vector stored into B's shared memory and the flag there
// and, in a run of its own, every thread of cluster 0 crossing the cluster's barrier (barrier.cluster
// arrive.release / wait.acquire) in a loop: a round's mean. Every other block keeps `others` bulk
// copies of 64 KB in flight (probe_stream.cuh: evict-first, each block over its own 16 MB). It also
// prints how many clusters of each size can be resident with the megakernel's block (512 threads,
// 226 KB of shared memory).
// Build and run on the GPU:
//   nvcc -O3 -arch=sm_90a -o cluster_hop scripts/probes/cluster_hop.cu && ./cluster_hop
#include "probe.cuh"
#include "probe_stream.cuh"
#include <algorithm>
#include <cooperative_groups.h>
#include <stdint.h>

namespace cg = cooperative_groups;

constexpr uint32_t THREADS = 512, MAX_STAGES = 3;
constexpr uint32_t VEC_THREADS = 256;          // the 4 KB vector: 16 bytes a thread
constexpr size_t REGION_BYTES = 16ull << 20;   // each block's stream, read round and round
constexpr uint32_t PINGS = 2000, ROUNDS = 2000;
constexpr unsigned long long RAMP_NS = 30000;  // the streams reach their rate before the timing starts
constexpr uint32_t MEGAKERNEL_SMEM = 231424;   // the megakernel's dynamic shared memory (its plan line)

enum Mode : uint32_t { FLAG_GLOBAL, FLAG_DSMEM, VEC_GLOBAL, VEC_DSMEM, CLUSTER_BARRIER, MODES };
const char* const MODE_NAMES[MODES] = {"flag, global", "flag, DSMEM", "4 KB, global", "4 KB, DSMEM", "cluster barrier"};

__device__ inline void st_release_gpu(unsigned* p, unsigned v) { asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }
// Generic addresses: `p` may be another block's shared memory (map_shared_rank) or this block's.
__device__ inline void st_release_cluster(unsigned* p, unsigned v) { asm volatile("st.release.cluster.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }
__device__ inline unsigned ld_acquire_cluster(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.cluster.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// One side's wait for `value` in its flag, then the vector's use (its words' xor, which the caller
// keeps so that the loads are not dropped): thread 0 polls, the block's barrier orders the other
// threads' reads after it.
__device__ inline uint32_t receive(Mode m, const unsigned* flag, const uint4* vec, unsigned value) {
    if (threadIdx.x == 0) {
        if (m == FLAG_GLOBAL || m == VEC_GLOBAL) {
            while (ld_acquire(flag) != value) {
            }
        } else {
            while (ld_acquire_cluster(flag) != value) {
            }
        }
    }
    if (m == FLAG_GLOBAL || m == FLAG_DSMEM) return 0;
    __syncthreads();  // every thread's read of the vector after thread 0 saw the flag
    uint32_t s = 0;
    if (threadIdx.x < VEC_THREADS) {
        const uint4 v = m == VEC_GLOBAL ? __ldcg(vec + threadIdx.x) : vec[threadIdx.x];
        s = v.x ^ v.y ^ v.z ^ v.w;
    }
    return s;
}

// One side's send: the vector (its 256 threads, 16 bytes each), then the flag once every store is done.
__device__ inline void send(Mode m, unsigned* flag, uint4* vec, unsigned value) {
    if (m == VEC_GLOBAL || m == VEC_DSMEM) {
        if (threadIdx.x < VEC_THREADS) vec[threadIdx.x] = make_uint4(value, value + 1, value + 2, value + 3);
        __syncthreads();  // thread 0's release follows every thread's store (as the megakernel's count)
    }
    if (threadIdx.x != 0) return;
    if (m == FLAG_GLOBAL || m == VEC_GLOBAL) st_release_gpu(flag, value);
    else st_release_cluster(flag, value);
}

struct Result {
    unsigned long long one_way_ns, window_ns;
};

__global__ void __launch_bounds__(THREADS, 1)
    probe(const char* weights, unsigned* flags, uint4* gvec, unsigned long long* landed, Result* out, uint32_t others, Mode mode) {
    extern __shared__ __align__(128) char ring[];
    __shared__ uint64_t full[MAX_STAGES];
    __shared__ unsigned dflag;  // this block's DSMEM flag
    __shared__ uint4 dvec[VEC_THREADS];
    cg::cluster_group cluster = cg::this_cluster();
    const uint32_t rank = cluster.block_rank();
    const bool timing_cluster = blockIdx.x < cluster.num_blocks();
    const bool timed = timing_cluster && (mode == CLUSTER_BARRIER || rank < 2);
    unsigned* gflags = flags;    // [0]: A's global flag, [1]: B's
    unsigned* stop = flags + 2;  // set once the timing is done
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < MAX_STAGES; ++s) mbar_init(&full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        dflag = 0;
    }
    // Every block's flag is initialised before any block of the cluster writes another's.
    cluster.sync();
    if (!timed) {
        if (threadIdx.x == 0) landed[blockIdx.x] = stream_bulk(weights + (size_t)blockIdx.x * REGION_BYTES, REGION_BYTES, others, stop, 1, ring, full);
        cluster.sync();  // pairs with the timed blocks' last cluster.sync: no block exits while another may write it
        return;
    }
    const unsigned long long t0 = globaltimer();
    while (globaltimer() - t0 < RAMP_NS) {
    }
    __syncthreads();  // every thread has ramped
    unsigned long long c0 = globaltimer(), c1 = c0;
    if (mode == CLUSTER_BARRIER) {
        for (uint32_t i = 0; i < ROUNDS; ++i) cluster.sync();
        c1 = globaltimer();
        if (rank == 0 && threadIdx.x == 0) *out = Result{(c1 - c0) / ROUNDS, c1 - t0};
    } else {
        const uint32_t peer = 1 - rank;
        // Where this side writes (the peer's flag and vector) and where it waits (its own).
        unsigned* to_flag = mode == FLAG_GLOBAL || mode == VEC_GLOBAL ? gflags + peer : cluster.map_shared_rank(&dflag, peer);
        uint4* to_vec = mode == VEC_GLOBAL ? gvec + peer * VEC_THREADS : cluster.map_shared_rank(dvec, peer);
        const unsigned* my_flag = mode == FLAG_GLOBAL || mode == VEC_GLOBAL ? gflags + rank : &dflag;
        const uint4* my_vec = mode == VEC_GLOBAL ? gvec + rank * VEC_THREADS : dvec;
        uint32_t seen = 0;
        for (unsigned i = 0; i < PINGS; ++i) {
            if (rank == 0) {
                send(mode, to_flag, to_vec, 2 * i + 1);
                seen ^= receive(mode, my_flag, my_vec, 2 * i + 2);
            } else {
                seen ^= receive(mode, my_flag, my_vec, 2 * i + 1);
                send(mode, to_flag, to_vec, 2 * i + 2);
            }
            __syncthreads();  // the vector is read before the next send overwrites the peer's
        }
        c1 = globaltimer();
        if (rank == 0 && threadIdx.x == 0) *out = Result{(c1 - c0) / (2 * PINGS), c1 - t0};
        if (seen == 0xFFFFFFFFu) out->window_ns = 0;  // never: keeps the vector's loads
    }
    if (rank == 0 && threadIdx.x == 0) st_release_gpu(stop, 1);
    cluster.sync();  // no block of the cluster exits while another may still write its shared memory
}

// A launch of `grid` blocks of THREADS threads and `smem` bytes of dynamic shared memory, in clusters of
// `size`. Not copied: the configuration points at its own attribute.
struct ClusterLaunch {
    cudaLaunchAttribute attr{};
    cudaLaunchConfig_t config{};
    ClusterLaunch(uint32_t size, uint32_t grid, uint32_t smem) {
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = size;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        config.gridDim = dim3(grid);
        config.blockDim = dim3(THREADS);
        config.dynamicSmemBytes = smem;
        config.attrs = &attr;
        config.numAttrs = 1;
    }
    ClusterLaunch(const ClusterLaunch&) = delete;
    ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// Clusters of `size` blocks of THREADS threads and `smem` bytes of dynamic shared memory that can be
// resident at once (0 if none; the function's maximum must allow `smem`).
int resident_clusters(uint32_t size, uint32_t smem) {
    const ClusterLaunch launch(size, size * 16, smem);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, (void*)probe, &launch.config) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

int main() {
    int sms = 0;
    TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    TRY(cudaGetDeviceProperties(&prop, 0));
    TRY(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    // The megakernel's dynamic shared memory less 8 KB, room for the probe's static (its vector and
    // flags): a block an SM either way, which is what decides the clusters resident.
    const uint32_t like_megakernel = MEGAKERNEL_SMEM - 8192;
    TRY(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, like_megakernel));
    cudaFuncAttributes attrs;
    TRY(cudaFuncGetAttributes(&attrs, probe));
    printf("%s, %d SMs\n", prop.name, sms);
    for (uint32_t size : {2u, 4u, 8u, 16u}) {
        const int n = resident_clusters(size, like_megakernel);
        printf("clusters of %2u blocks (%u threads, %zu bytes of shared memory; the megakernel's %u) resident at once: %d (%d blocks)\n",
               size, THREADS, like_megakernel + attrs.sharedSizeBytes, MEGAKERNEL_SMEM, n, n * (int)size);
    }
    char* weights;
    unsigned* flags;
    uint4* gvec;
    unsigned long long* landed;
    Result* out;
    TRY(stream_regions(sms, REGION_BYTES, &weights));
    TRY(cudaMalloc(&flags, 16));
    TRY(cudaMalloc(&gvec, 2 * VEC_THREADS * sizeof(uint4)));
    TRY(cudaMalloc(&landed, sms * 8));
    TRY(cudaMalloc(&out, sizeof(Result)));
    const uint32_t smem = MAX_STAGES * STREAM_STAGE;
    TRY(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    for (uint32_t size : {8u, 16u}) {
        const int resident = resident_clusters(size, smem);
        const uint32_t clusters = std::min<uint32_t>(resident, sms / size);
        if (clusters == 0) {
            printf("clusters of %u: none resident, skipped\n", size);
            continue;
        }
        printf("\nclusters of %u blocks, %u clusters (%u blocks); ns one way (the barrier: a round), and the others' TB/s\n", size, clusters,
               clusters * size);
        printf("%-18s", "others in flight");
        for (uint32_t m = 0; m < MODES; ++m) printf(" %16s", MODE_NAMES[m]);
        printf("\n");
        for (int rep = 0; rep < 2; ++rep) {
            for (uint32_t others = 0; others <= 2; ++others) {
                printf("%-18u", others);
                double tbs = 0;
                for (uint32_t m = 0; m < MODES; ++m) {
                    TRY(cudaMemset(flags, 0, 16));
                    TRY(cudaMemset(landed, 0, sms * 8));
                    const ClusterLaunch launch(size, clusters * size, smem);
                    const Mode mode = (Mode)m;
                    TRY(cudaLaunchKernelEx(&launch.config, probe, (const char*)weights, flags, gvec, landed, out, others, mode));
                    TRY(cudaDeviceSynchronize());
                    Result r;
                    unsigned long long bytes;
                    TRY(cudaMemcpy(&r, out, sizeof r, cudaMemcpyDeviceToHost));
                    TRY(landed_bytes(landed, sms, &bytes));
                    tbs += bytes / (double)r.window_ns / 1e3 / MODES;
                    printf(" %16llu", r.one_way_ns);
                }
                printf("   %.2f TB/s\n", tbs);
            }
        }
    }
    return 0;
}
