// Each SM's share of HBM while every SM streams. The megakernel's traces (`megakernel bench --trace
// --trace-stamps`, docs/perf.md "Where the later blocks' time comes from") show the same 16 blocks of
// a launch streaming every GEMV phase 15-40% slower than the others, in every layer, and which blocks
// they are changes from launch to launch. This probe asks whether the slow ones are SMs: every block
// (one an SM, as the megakernel's) streams its own region with the ring's 64 KB bulk copies for the
// same window, and writes the SM it ran on (%smid) and the bytes it landed. Between launches each
// block's region moves (block b streams region (b + 37 * launch) % blocks), so a rate that follows the
// SM and not the region is the SM's own.
// Build and run on the GPU:
//   nvcc -O3 -arch=sm_90a -o sm_share scripts/probes/sm_share.cu && ./sm_share
#include "probe.cuh"
#include "probe_stream.cuh"
#include <algorithm>
#include <stdint.h>
#include <vector>

constexpr uint32_t THREADS = 512, MAX_STAGES = 3;
constexpr size_t REGION_BYTES = 16ull << 20;     // each block's stream, read round and round
constexpr unsigned long long WINDOW_NS = 2000000;  // every block streams this long
constexpr int LAUNCHES = 6;

__device__ inline void st_relaxed(unsigned* p, unsigned v) { asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }

struct BlockResult {
    unsigned long long landed;
    uint32_t smid, region;
};

__global__ void __launch_bounds__(THREADS, 1) probe(const char* regions, unsigned* stop, BlockResult* out, uint32_t stages, uint32_t shift) {
    extern __shared__ __align__(128) char ring[];
    __shared__ uint64_t full[MAX_STAGES];
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < MAX_STAGES; ++s) mbar_init(&full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the barriers are initialised before any copy names them
    const uint32_t region = (blockIdx.x + shift) % gridDim.x;
    if (threadIdx.x == 0) {
        uint32_t smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        const unsigned long long landed = stream_bulk(regions + (size_t)region * REGION_BYTES, REGION_BYTES, stages, stop, 1, ring, full);
        out[blockIdx.x] = BlockResult{landed, smid, region};
    }
    // Block 0's second warp ends the window for everyone.
    if (blockIdx.x == 0 && threadIdx.x == 32) {
        const unsigned long long t0 = globaltimer();
        while (globaltimer() - t0 < WINDOW_NS) {
        }
        st_relaxed(stop, 1);
    }
}

int main() {
    int sms = 0;
    TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    TRY(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs: every block streams its own 16 MB region for %.1f ms\n", prop.name, sms, WINDOW_NS / 1e6);
    char* regions;
    unsigned* stop;
    BlockResult* out;
    TRY(stream_regions(sms, REGION_BYTES, &regions));
    TRY(cudaMalloc(&stop, 4));
    TRY(cudaMalloc(&out, sms * sizeof(BlockResult)));
    const uint32_t smem = MAX_STAGES * STREAM_STAGE;
    TRY(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    for (uint32_t stages : {1u, 2u}) {
        // rate[launch][smid], relative to the launch's median block; block_of[launch][smid].
        std::vector<std::vector<double>> rate(LAUNCHES, std::vector<double>(sms, 0));
        std::vector<std::vector<int>> block_of(LAUNCHES, std::vector<int>(sms, -1));
        printf("\n%u stage(s) of 64 KB in flight a block\n", stages);
        for (int l = 0; l < LAUNCHES; ++l) {
            uint32_t shift = 37u * l;
            TRY(cudaMemset(stop, 0, 4));
            void* args[] = {&regions, &stop, &out, &stages, &shift};
            TRY(cudaLaunchCooperativeKernel((void*)probe, sms, THREADS, args, smem, 0));
            TRY(cudaDeviceSynchronize());
            std::vector<BlockResult> r(sms);
            TRY(cudaMemcpy(r.data(), out, sms * sizeof(BlockResult), cudaMemcpyDeviceToHost));
            std::vector<double> bytes;
            double total = 0;
            for (const auto& b : r) bytes.push_back((double)b.landed), total += b.landed;
            std::vector<double> sorted = bytes;
            std::sort(sorted.begin(), sorted.end());
            const double median = sorted[sms / 2];
            for (int b = 0; b < sms; ++b) {
                rate[l][r[b].smid] = bytes[b] / median;
                block_of[l][r[b].smid] = b;
            }
            printf("launch %d (regions shifted by %u): %.2f TB/s in all; blocks' bytes min %.3f, max %.3f of the median\n", l, shift,
                   total / (WINDOW_NS * 1e3), sorted[0] / median, sorted[sms - 1] / median);
        }
        // Per SM: its rate in every launch, and the blocks it ran; the slowest SMs first.
        std::vector<int> order(sms);
        std::vector<double> mean(sms, 0);
        for (int s = 0; s < sms; ++s) {
            order[s] = s;
            for (int l = 0; l < LAUNCHES; ++l) mean[s] += rate[l][s] / LAUNCHES;
        }
        std::sort(order.begin(), order.end(), [&](int a, int b) { return mean[a] < mean[b]; });
        int same_map = 0;
        for (int s = 0; s < sms; ++s) same_map += block_of[0][s] == block_of[LAUNCHES - 1][s];
        printf("blocks on the same SM in the first and last launch: %d of %d\n", same_map, sms);
        printf("%6s %6s  rate in each launch (of the median)          blocks\n", "smid", "mean");
        for (int i = 0; i < sms; ++i) {
            const int s = order[i];
            if (i >= 24 && i < sms - 8) continue;  // the slowest 24 and the fastest 8
            printf("%6d %6.3f ", s, mean[s]);
            for (int l = 0; l < LAUNCHES; ++l) printf(" %5.3f", rate[l][s]);
            printf("   ");
            for (int l = 0; l < LAUNCHES; ++l) printf(" %3d", block_of[l][s]);
            printf("\n");
        }
    }
    return 0;
}
