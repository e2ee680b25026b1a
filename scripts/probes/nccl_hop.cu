// What one Reduce of the stack split over GPUs costs (issue 50, docs/parallel.md) before the kernel has
// one: a persistent kernel on each of N GPUs that, over and over, writes its share of d f32 partials
// into a symmetric NCCL window, meets the other GPUs at an LSA barrier (NCCL's device API), and adds
// every GPU's partials in rank order by NVLink loads, as the Reduce phase will. Each block takes an even
// share of the d rows and meets the same block of the other GPUs (one LSA barrier per block), so the
// hop is the megakernel's: a release, the peers' polls, the reload. Reported per N, d and block count:
// microseconds a hop with the reduce, and with the barrier alone; every sum is checked against the
// same sum computed locally, bit for bit.
//
// No NVLink multicast (the LSA barrier's multimem off, as NCCL_NVLS_ENABLE=0 keeps NCCL): the device
// machines forbid it. Build and run on a machine of one GPU or more (one GPU: N = 1, the probe's own
// check), with the NCCL wheel of the image's Python:
//   NCCL=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])")
//   nvcc -O3 -std=c++17 -arch=sm_90a -I $NCCL/include -o nccl_hop scripts/probes/nccl_hop.cu \
//        -L $NCCL/lib -l:libnccl.so.2 -Xlinker -rpath=$NCCL/lib && NCCL_NVLS_ENABLE=0 ./nccl_hop
#include <cstdio>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <thread>
#include <vector>
#include "probe.cuh"

constexpr int THREADS = 512;
constexpr int ITERS = 4000;
constexpr int MAX_D = 16384;       // the 405B layer's width; the 70B's is 8192
constexpr int BUFFERS = 2;         // partials double-buffered: one barrier a hop (see hops)
constexpr int MAX_GPUS = 8;

// GPU `rank`'s partial of row r at hop `it`: exact in f32, different for every rank, row and hop.
__device__ float partial(int rank, int it, int r) { return (float)((rank + 1) * (it % 7 + 1)) + (float)(r % 1024) * 0.25f; }

// `iters` hops over d rows: each block writes its rows of this GPU's partials (buffer it % 2), meets the
// same block of every GPU at its LSA barrier, then (`reduce`) adds its rows of every GPU's partials in
// rank order and checks the sums. A GPU writes buffer it % 2 again at hop it + 2, after the barrier of
// hop it + 1, which no GPU passes before every GPU has arrived there, after its reads of hop it: so one
// barrier a hop keeps writes off partials still being read. ns[block]: the block's time over the hops.
__global__ void __launch_bounds__(THREADS) hops(ncclWindow_t win, ncclDevComm comm, int d, int iters, bool reduce, unsigned long long* ns,
                                                unsigned* wrong) {
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), comm, ncclTeamTagLsa(), blockIdx.x};
    const int rank = comm.rank, ranks = comm.nRanks, t = threadIdx.x;
    const int r0 = (int)((long long)d * blockIdx.x / gridDim.x), r1 = (int)((long long)d * (blockIdx.x + 1) / gridDim.x);
    float* mine = static_cast<float*>(ncclGetLocalPointer(win, 0));
    const float* peers[MAX_GPUS];
    for (int p = 0; p < ranks; ++p) peers[p] = static_cast<const float*>(ncclGetLsaPointer(win, 0, p));
    unsigned bad = 0;
    bar.sync(ncclCoopCta(), cuda::memory_order_relaxed);  // every GPU's block is running before the clock starts
    const unsigned long long start = globaltimer();
    for (int it = 0; it < iters; ++it) {
        const int at = (it % BUFFERS) * d;
        if (reduce)
            for (int r = r0 + t; r < r1; r += THREADS) mine[at + r] = partial(rank, it, r);
        // Release this block's partials, acquire every GPU's: the Reduce's one hop.
        bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
        if (reduce) {
            for (int r = r0 + t; r < r1; r += THREADS) {
                float sum = 0.0f, want = 0.0f;
                for (int p = 0; p < ranks; ++p) {
                    sum = __fadd_rn(sum, peers[p][at + r]);
                    want = __fadd_rn(want, partial(p, it, r));
                }
                bad += __float_as_uint(sum) != __float_as_uint(want);
            }
        }
    }
    const unsigned long long end = globaltimer();
    if (bad != 0) atomicAdd(wrong, bad);
    if (t == 0) ns[blockIdx.x] = end - start;
}

// A failed call of GPU `rank`'s part, said in one line, and the part given up.
#define CHECK(call, ok, describe)                                                                 \
    do {                                                                                         \
        const auto e_ = (call);                                                                  \
        if (e_ != ok) {                                                                          \
            printf("GPU %d: %s failed: %s\n", rank, #call, describe(e_));                         \
            return false;                                                                        \
        }                                                                                        \
    } while (0)
#define CHECK_CUDA(call) CHECK(call, cudaSuccess, cudaGetErrorString)
#define CHECK_NCCL(call) CHECK(call, ncclSuccess, ncclGetErrorString)

struct Case {
    int d;
    bool reduce;
};
constexpr Case CASES[] = {{8192, false}, {8192, true}, {16384, false}, {16384, true}};
constexpr int N_CASES = sizeof CASES / sizeof CASES[0];

// One GPU's part of a run over `ranks` GPUs: its communicator, window and device communicator, every
// case in the same order as the other GPUs (the barriers are collective), and per case its slowest
// block's microseconds a hop (us[case]) and its wrong sums.
bool gpu(int rank, int ranks, ncclUniqueId id, int blocks, double* us, unsigned* wrong) {
    CHECK_CUDA(cudaSetDevice(rank));
    ncclComm_t comm;
    CHECK_NCCL(ncclCommInitRank(&comm, ranks, id, rank));
    void* buf = nullptr;
    ncclWindow_t win;
    const size_t bytes = (size_t)BUFFERS * MAX_D * sizeof(float);
    CHECK_NCCL(ncclMemAlloc(&buf, bytes));
    CHECK_NCCL(ncclCommWindowRegister(comm, buf, bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
    ncclDevComm dev;
    // Releases after 2.28 version the struct through their initializer; 2.28 (the device machines'
    // wheel, 2.28.9) has none and takes a zeroed struct.
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
    ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
    ncclDevCommRequirements reqs = {};
#endif
    reqs.lsaBarrierCount = blocks;  // one barrier per block: block b meets block b of every GPU
    CHECK_NCCL(ncclDevCommCreate(comm, &reqs, &dev));
    unsigned long long* ns = nullptr;
    unsigned* bad = nullptr;
    CHECK_CUDA(cudaMalloc(&ns, blocks * sizeof *ns));
    CHECK_CUDA(cudaMalloc(&bad, sizeof *bad));
    std::vector<unsigned long long> host(blocks);
    for (int c = 0; c < N_CASES; ++c) {
        CHECK_CUDA(cudaMemset(bad, 0, sizeof *bad));
        hops<<<blocks, THREADS>>>(win, dev, CASES[c].d, ITERS, CASES[c].reduce, ns, bad);
        CHECK_CUDA(cudaGetLastError());
        CHECK_CUDA(cudaDeviceSynchronize());
        CHECK_CUDA(cudaMemcpy(host.data(), ns, blocks * sizeof *ns, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(&wrong[c], bad, sizeof *bad, cudaMemcpyDeviceToHost));
        unsigned long long slowest = 0;
        for (unsigned long long v : host) slowest = v > slowest ? v : slowest;
        us[c] = slowest / 1e3 / ITERS;
    }
    cudaFree(ns);
    cudaFree(bad);
    CHECK_NCCL(ncclDevCommDestroy(comm, &dev));
    CHECK_NCCL(ncclCommWindowDeregister(comm, win));
    CHECK_NCCL(ncclMemFree(buf));
    CHECK_NCCL(ncclCommFinalize(comm));
    CHECK_NCCL(ncclCommDestroy(comm));
    return true;
}

int main() {
    int gpus = 0, sms = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0 || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
        printf("no CUDA device\n");
        return 1;
    }
    printf("%d GPU(s), %d SMs; %d hops a case\n", gpus, sms, ITERS);
    printf("%4s %6s %6s %-8s %10s  %s\n", "GPUs", "d", "blocks", "hop", "us a hop", "sums");
    bool ok = true;
    for (int ranks = 1; ranks <= gpus && ranks <= MAX_GPUS; ranks *= 2) {
        for (int blocks : {sms, 16}) {
            ncclUniqueId id;
            if (ncclGetUniqueId(&id) != ncclSuccess) {
                printf("ncclGetUniqueId failed\n");
                return 1;
            }
            std::vector<std::vector<double>> us(ranks, std::vector<double>(N_CASES));
            std::vector<std::vector<unsigned>> wrong(ranks, std::vector<unsigned>(N_CASES));
            std::vector<char> done(ranks);
            std::vector<std::thread> threads;
            for (int r = 0; r < ranks; ++r)
                threads.emplace_back([&, r] { done[r] = gpu(r, ranks, id, blocks, us[r].data(), wrong[r].data()); });
            for (auto& th : threads) th.join();
            for (int r = 0; r < ranks; ++r) ok = ok && done[r];
            if (!ok) break;
            for (int c = 0; c < N_CASES; ++c) {
                double worst = 0;
                unsigned bad = 0;
                for (int r = 0; r < ranks; ++r) {
                    worst = us[r][c] > worst ? us[r][c] : worst;
                    bad += wrong[r][c];
                }
                const char* what = !CASES[c].reduce ? "-" : bad == 0 ? "every sum bitwise" : "WRONG";
                printf("%4d %6d %6d %-8s %10.2f  %s", ranks, CASES[c].d, blocks, CASES[c].reduce ? "reduce" : "barrier", worst, what);
                if (bad != 0) printf(" (%u wrong)", bad);
                printf("\n");
                ok = ok && bad == 0;
            }
        }
    }
    return ok ? 0 : 1;
}
