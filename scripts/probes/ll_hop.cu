// What a hand-off costs when the data carries its own readiness. Today a phase's consumer waits on a
// counter: the producer's threads store their slice, the block synchronises, thread 0's
// `red.release.gpu` (a fence that waits for the stores' acknowledgements, then the add); the consumer's
// thread 0 polls with `ld.acquire.gpu`, the block synchronises, and only then do its threads load the
// input: about three L2 round trips between the last producer's store and the consumer's data. Here
// the other protocol (NCCL's "LL"): every 8-byte word is two bf16 of data and a 32-bit sequence number,
// written by one 64-bit store (single-copy atomic), so a consumer that reads a word with the sequence
// it expects also has its data; each thread polls its own words, and no counter or fence is on the
// path: about one round trip.
//
// The chain is Llama-3.2-1B's five all-to-all hops a layer (x 2048 -> qkv 3072 -> attention out 2048 ->
// x1 2048 -> act 8192 -> x 2048), every block reading the whole input vector, summing it (the norm's
// stand-in: a block reduction) and writing its share of the next; 16 layers, many tokens in one launch,
// less a launch of a tenth as many. With `weights`, each task streams its share of 1B's weights after
// its input (16 layers apart, so L2 holds none), so that the hops are timed with HBM busy.
// Build and run on the GPU:
//   nvcc -O3 -arch=sm_90a -o ll_hop scripts/probes/ll_hop.cu && ./ll_hop
#include "probe.cuh"
#include <cuda_bf16.h>
#include <stdint.h>

constexpr int LAYERS = 16, THREADS = 512, WARPS = THREADS / 32, TOKENS = 200, HOPS = 5;
// The input of each hop, in bf16: x, qkv, attention's output, x1, act.
__host__ __device__ constexpr int width(int hop) { return hop == 1 ? 3072 : hop == 4 ? 8192 : 2048; }
constexpr int MAX_WIDTH = 8192;
// The bytes each hop's task streams after its input, as Llama-3.2-1B's (attention's cached rows are
// a few KB: none).
__host__ __device__ constexpr size_t weight_bytes(int hop) {
    return hop == 0 ? 2048ull * 3072 * 2 : hop == 2 ? 2048ull * 2048 * 2 : hop == 3 ? 2ull * 8192 * 2048 * 2 : hop == 4 ? 8192ull * 2048 * 2 : 0;
}
constexpr int UNROLL = 8;

// LL_FENCED: LL with a `fence.acq_rel.gpu` before the producer's stores and after the consumer's
// reads, which makes the hand-off a synchronisation in PTX's memory model (fence-fence), so that
// whatever else the producer wrote before (a cache row) is visible to the consumer as well.
enum Protocol { COUNTERS, LL, LL_BACKOFF, LL_FENCED };

// Two LL words (16 bytes) as one relaxed load: each 8-byte element is single-copy atomic, the pair
// is not (each word's sequence is checked on its own).
__device__ ulonglong2 ld_relaxed2(const unsigned long long* p) {
    ulonglong2 v;
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
    return v;
}
__device__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ void st_relaxed(unsigned long long* p, unsigned long long v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Sum of the block's values, in every thread (the norm's reduction, in warp then warp order).
__device__ float block_sum(float v) {
    __shared__ float warps[WARPS];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
    __syncthreads();  // every warp's sum is in shared memory
    float s = 0.f;
    for (int w = 0; w < WARPS; ++w) s += warps[w];
    __syncthreads();  // every thread has read the sums before the next reduction overwrites them
    return s;
}
__device__ float sum_pair(uint32_t p) {
    __nv_bfloat162 b;
    memcpy(&b, &p, 4);
    return __low2float(b) + __high2float(b);
}
__device__ uint32_t pair_of(float v) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(v, -v);
    uint32_t p;
    memcpy(&p, &b, 4);
    return p;
}

struct Buffers {
    uint4* plain[HOPS];               // (WIDTH / 8) 16-byte vectors of bf16
    unsigned long long* ll[HOPS];     // (WIDTH / 2) words: two bf16, then the sequence
    unsigned* done;                   // (HOPS) blocks done, never reset
    const uint4* weights;
    float* sink;
};

// The hop's input, summed: counters (thread 0 waits for `target` blocks, then every thread loads).
__device__ float input_counters(const Buffers& b, int hop, unsigned target) {
    const int in = (hop + HOPS - 1) % HOPS;
    if (threadIdx.x == 0)
        while ((int)(ld_acquire(&b.done[in]) - target) < 0) __nanosleep(64);
    __syncthreads();  // the rest of the block waits for thread 0's acquire
    float s = 0.f;
    for (int i = threadIdx.x; i < width(hop) / 8; i += THREADS) {
        const uint4 v = __ldcg(b.plain[in] + i);
        s += sum_pair(v.x) + sum_pair(v.y) + sum_pair(v.z) + sum_pair(v.w);
    }
    return block_sum(s);
}
// The hop's input, summed: LL (each thread polls its own words until each has the sequence `seq`).
__device__ float input_ll(const Buffers& b, int hop, unsigned seq, bool backoff, bool fenced) {
    const int in = (hop + HOPS - 1) % HOPS;
    constexpr int MAX_PER = MAX_WIDTH / 4 / THREADS;  // 16-byte loads (two words) a thread at most
    const int pairs = width(hop) / 4;
    // Every load of the thread in flight at once, then only those whose words lack the sequence again:
    // a vector polled to completion before the next is loaded costs a round trip each.
    ulonglong2 v[MAX_PER];
    bool ready[MAX_PER];
#pragma unroll
    for (int j = 0; j < MAX_PER; ++j) {
        const int i = threadIdx.x + j * THREADS;
        ready[j] = i >= pairs;
        if (!ready[j]) v[j] = ld_relaxed2(b.ll[in] + 2 * i);
    }
    for (;;) {
        bool all = true;
#pragma unroll
        for (int j = 0; j < MAX_PER; ++j) {
            if (!ready[j]) ready[j] = (unsigned)(v[j].x >> 32) == seq && (unsigned)(v[j].y >> 32) == seq;
            all = all && ready[j];
        }
        if (all) break;
        if (backoff) __nanosleep(32);
#pragma unroll
        for (int j = 0; j < MAX_PER; ++j)
            if (!ready[j]) v[j] = ld_relaxed2(b.ll[in] + 2 * (threadIdx.x + j * THREADS));
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < MAX_PER; ++j)
        if (threadIdx.x + j * THREADS < pairs) s += sum_pair((uint32_t)v[j].x) + sum_pair((uint32_t)v[j].y);
    if (fenced) fence_acq_rel();  // reads after this see what the producers wrote before their fence
    return block_sum(s);
}

// This block's slice of the hop's output (pairs of bf16), from the input's sum.
__device__ void output(const Buffers& b, int hop, Protocol p, float sum, unsigned seq) {
    // Every block writes a share: one that wrote none would not be waited for and could fall a layer
    // behind, to find its input overwritten.
    const int words = width((hop + 1) % HOPS) / 2;
    const int first = words * blockIdx.x / gridDim.x, last = words * (blockIdx.x + 1) / gridDim.x;
    const uint32_t data = pair_of(sum * 1e-9f + (float)(seq % 64));
    if (p == LL_FENCED) fence_acq_rel();  // every write before this one is visible to whoever reads it
    for (int i = first + threadIdx.x; i < last; i += THREADS) {
        if (p != COUNTERS) st_relaxed(b.ll[hop] + i, ((unsigned long long)seq << 32) | data);
        else reinterpret_cast<uint32_t*>(b.plain[hop])[i] = data;
    }
    if (p == COUNTERS) {
        __syncthreads();  // every thread's stores precede thread 0's release
        if (threadIdx.x == 0) red_release(&b.done[hop]);
    }
}

// This block's share of the hop's weights, streamed and folded (the dot product's stand-in).
__device__ void stream(const Buffers& b, int layer, int hop) {
    size_t offset = 0;
    for (int h = 0; h < HOPS; ++h) offset += weight_bytes(h);
    offset *= layer;
    for (int h = 0; h < hop; ++h) offset += weight_bytes(h);
    const size_t words = weight_bytes(hop) / 16, per = (words + gridDim.x - 1) / gridDim.x;
    const size_t begin = min(words, per * blockIdx.x), end = min(words, begin + per);
    const uint4* w = b.weights + offset / 16;
    unsigned acc = 0;
    size_t i = begin + threadIdx.x;
    for (; i + (UNROLL - 1) * THREADS < end; i += UNROLL * THREADS) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(w + i + u * THREADS);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < end; i += THREADS) acc ^= __ldcs(w + i).x;
    if (acc == 0x9e3779b9u) b.sink[threadIdx.x] = 1.f;  // keeps the loads; never true for these bytes
}

__global__ void chain(Buffers b, int tokens, Protocol p, bool weights) {
    for (int t = 0; t < tokens; ++t)
        for (int l = 0; l < LAYERS; ++l) {
            const unsigned seq = (unsigned)(t * LAYERS + l) + 1;
            for (int hop = 0; hop < HOPS; ++hop) {
                // Hop 0 reads the layer before's x (written with seq - 1); at the first token nothing.
                const bool first = t == 0 && l == 0 && hop == 0;
                const unsigned in_seq = hop == 0 ? seq - 1 : seq;
                float s = 0.f;
                if (!first) s = p == COUNTERS ? input_counters(b, hop, gridDim.x * in_seq) : input_ll(b, hop, in_seq, p == LL_BACKOFF, p == LL_FENCED);
                if (weights) stream(b, l, hop);
                output(b, hop, p, s, seq);
            }
        }
}

static float launch_ms(Buffers b, int blocks, int tokens, Protocol p, bool weights) {
    cudaMemset(b.done, 0, HOPS * sizeof(unsigned));
    for (int h = 0; h < HOPS; ++h) cudaMemset(b.ll[h], 0, MAX_WIDTH * 4);
    return elapsed_ms([&] { chain<<<blocks, THREADS>>>(b, tokens, p, weights); });
}

// Five samples of us a layer, sorted (median at 2): a `tokens`-token launch less one of a tenth as many.
constexpr int SAMPLES = 5;
static void row(const char* name, Buffers b, int blocks, int tokens, Protocol p, bool weights) {
    float us[SAMPLES];
    const int warm = tokens / 10;
    for (float& u : us) u = (launch_ms(b, blocks, tokens, p, weights) - launch_ms(b, blocks, warm, p, weights)) * 1e3f / ((tokens - warm) * LAYERS);
    for (int i = 0; i < SAMPLES; ++i)
        for (int j = i + 1; j < SAMPLES; ++j)
            if (us[j] < us[i]) { const float x = us[i]; us[i] = us[j]; us[j] = x; }
    printf("%-34s %7.2f  [%.2f-%.2f]\n", name, us[2], us[0], us[SAMPLES - 1]);
}

int main() {
    int sms = 0;
    TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    Buffers b;
    for (int h = 0; h < HOPS; ++h) {
        TRY(cudaMalloc(&b.plain[h], MAX_WIDTH * 2));
        TRY(cudaMemset(b.plain[h], 0, MAX_WIDTH * 2));
        TRY(cudaMalloc(&b.ll[h], MAX_WIDTH * 4));
    }
    TRY(cudaMalloc(&b.done, HOPS * sizeof(unsigned)));
    size_t layer_bytes = 0;
    for (int h = 0; h < HOPS; ++h) layer_bytes += weight_bytes(h);
    TRY(cudaMalloc((void**)&b.weights, layer_bytes * LAYERS));
    TRY(cudaMemset((void*)b.weights, 0x5a, layer_bytes * LAYERS));
    TRY(cudaMalloc(&b.sink, THREADS * sizeof(float)));
    printf("%d blocks of %d threads, 5 all-to-all hops a layer      us a layer (median of %d) [range]\n", sms, THREADS, SAMPLES);
    row("counters, no weights", b, sms, TOKENS, COUNTERS, false);
    row("LL words, no weights", b, sms, TOKENS, LL, false);
    row("LL words, 32 ns back-off", b, sms, TOKENS, LL_BACKOFF, false);
    row("LL words, fenced", b, sms, TOKENS, LL_FENCED, false);
    row("counters, 1B's weights streamed", b, sms, TOKENS / 4, COUNTERS, true);
    row("LL words, 1B's weights streamed", b, sms, TOKENS / 4, LL, true);
    row("LL, back-off, 1B's weights streamed", b, sms, TOKENS / 4, LL_BACKOFF, true);
    row("LL, fenced, 1B's weights streamed", b, sms, TOKENS / 4, LL_FENCED, true);
    TRY(cudaDeviceSynchronize());
    TRY(cudaGetLastError());
    return 0;
}
