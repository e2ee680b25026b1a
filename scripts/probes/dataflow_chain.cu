// What a layer's chain of dependencies costs with no weights: Llama-3.2-1B's widths (hidden 2048,
// ffn 8192, 8 KV heads) on every SM, 16 layers a token, many tokens in one launch. Each task waits
// for counters, reads its input vector from L2, writes its share of the next one and counts itself
// done; no block ever waits at a grid barrier. Two graphs (issue 47's plan, docs/perf.md):
//   phases:   today's structure, five all-to-all hops a layer (every block waits for every block);
//   dataflow: attention per KV head waits only for its head's QKV blocks, the O projection split by
//             KV head waits only for its head's attention: three all-to-all hops and two narrow ones.
// Polling with and without a back-off; then, with and without the waits (what the stream alone takes), the dataflow graph with each task's share of 1B's weights
// (QKV 12.6 MB, O 8.4, GateUp 67.1, Down 33.6 a layer; 16 layers apart, so L2 holds none): streamed
// after its wait, or its first PRIME_BYTES copied to shared memory (cp.async) before the wait so that
// only the rest waits for the input. Build and run on the GPU:
//   nvcc -O3 -arch=sm_90a -o dataflow_chain scripts/probes/dataflow_chain.cu && ./dataflow_chain
#include "probe.cuh"

constexpr int HIDDEN = 2048, FFN = 8192, KV_HEADS = 8, LAYERS = 16, THREADS = 256;
constexpr int TOKENS = 200;
enum Op { QKV, ATTN, OPROJ, GATEUP, DOWN, OPS };

// Bytes a layer's op streams (bf16 weights of Llama-3.2-1B), and what a task may prime before its wait.
__host__ __device__ constexpr size_t op_bytes(int op) {
    return op == QKV ? 2048ull * 3072 * 2 : op == OPROJ ? 2048ull * 2048 * 2 : op == GATEUP ? 2ull * 8192 * 2048 * 2 : op == DOWN ? 8192ull * 2048 * 2 : 0;
}
// 16-byte loads in flight per thread: 132 x 256 x 8 x 16 B = 4.3 MB, the HBM's latency x bandwidth
// (-DPROBE_UNROLL=16 to try twice that).
#ifndef PROBE_UNROLL
#define PROBE_UNROLL 8
#endif
constexpr int UNROLL = PROBE_UNROLL;

struct Counters { unsigned op[LAYERS][OPS][KV_HEADS]; };


// Thread 0 waits until *c reaches target (counters only grow: one launch, never reset), then the block.
__device__ void wait_count(const unsigned* c, unsigned target, bool backoff) {
    if (threadIdx.x == 0)
        while ((int)(ld_acquire(c) - target) < 0)
            if (backoff) __nanosleep(64);
    __syncthreads();
}
// Counts the block done: the bar.sync orders every thread's writes before thread 0's release.
__device__ void signal(unsigned* c) {
    __syncthreads();
    if (threadIdx.x == 0) red_release(c);
}
// Reads n floats of src from L2 (.cg: the data changes every step, L1 must not keep it), writes this
// block's slice of dst: the task's input load and its output, with no weights.
__device__ void move(const float* src, int n, float* dst, int slice, int slices, int dst_n) {
    __shared__ float partial[THREADS];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += THREADS) s += __ldcg(src + i);
    partial[threadIdx.x] = s;
    __syncthreads();  // the block's sum must be complete before any thread writes from it
    const int per = (dst_n + slices - 1) / slices;
    for (int i = slice * per + threadIdx.x; i < min(dst_n, (slice + 1) * per); i += THREADS)
        dst[i] = partial[threadIdx.x % 32] * 1e-9f + 1.f;
}

struct Buffers { float *x, *qkv, *attn, *x1, *act; const uint4* weights; float* sink; };

// A task's share of the weights: [begin, end) in 16-byte words, and the part copied before its wait.
struct Share { const uint4* w; size_t begin, end, primed; };

__device__ Share share_of(const Buffers& b, int l, int op, size_t prime_words) {
    size_t offset = 0;
    for (int i = 0; i < OPS; ++i) offset += op_bytes(i);
    offset = offset * l;
    for (int i = 0; i < op; ++i) offset += op_bytes(i);
    const size_t words = op_bytes(op) / 16, per = (words + gridDim.x - 1) / gridDim.x;
    const size_t begin = min(words, per * blockIdx.x), end = min(words, begin + per);
    return {b.weights + offset / 16, begin, end, min(end - begin, prime_words)};
}
// Issues the primed part's copies into shared memory; they land while the block waits.
__device__ void prime(const Share& s, uint4* smem) {
    for (size_t i = threadIdx.x; i < s.primed; i += THREADS) {
        const unsigned dst = (unsigned)__cvta_generic_to_shared(smem + i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(s.w + s.begin + i) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Streams the rest after the wait and folds in the primed part (the dot product's stand-in).
__device__ void stream(const Share& s, const uint4* smem, float* sink) {
    unsigned acc = 0;
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();  // every thread's copies have landed before any reads another's
    for (size_t i = threadIdx.x; i < s.primed; i += THREADS) acc ^= smem[i].x ^ smem[i].w;
    size_t i = s.begin + s.primed + threadIdx.x;
    for (; i + (UNROLL - 1) * THREADS < s.end; i += UNROLL * THREADS) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(s.w + i + u * THREADS);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < s.end; i += THREADS) acc ^= __ldcs(s.w + i).x;
    if (acc == 0x9e3779b9u) sink[threadIdx.x] = 1.f;  // keeps the loads; never true for these bytes
    __syncthreads();  // the shared buffer is reused by the next task's prime
}

__global__ void chain(Counters* c, Buffers b, int tokens, bool dataflow, bool backoff, bool weights, size_t prime_words, bool waits) {
    extern __shared__ uint4 primed[];
    const unsigned gate = waits ? 1u : 0u;  // a target of 0 is met at once: the same tasks without their dependencies
    const unsigned blocks = gridDim.x, me = blockIdx.x, per_head = blocks / KV_HEADS;
    const unsigned head = min(me / per_head, (unsigned)KV_HEADS - 1);
    const unsigned head_blocks = head == KV_HEADS - 1 ? blocks - per_head * (KV_HEADS - 1) : per_head;
    const int head_dim = HIDDEN / KV_HEADS;
    for (int t = 0; t < tokens; ++t)
        for (int l = 0; l < LAYERS; ++l) {
            const unsigned n = t + 1;  // this token's count of each counter's completions, in blocks
            // QKV: every block waits for the whole Down of the layer before (of the token before at 0).
            Share w = share_of(b, l, QKV, prime_words);
            if (weights) prime(w, primed);
            if (l > 0) wait_count(&c->op[l - 1][DOWN][0], blocks * n * gate, backoff);
            else if (t > 0) wait_count(&c->op[LAYERS - 1][DOWN][0], blocks * t * gate, backoff);
            if (weights) stream(w, primed, b.sink);
            move(b.x, HIDDEN, b.qkv, me, blocks, 2 * HIDDEN);
            signal(&c->op[l][QKV][dataflow ? head : 0]);
            // Attention: its head's QKV blocks (dataflow) or all of them.
            if (dataflow) wait_count(&c->op[l][QKV][head], head_blocks * n * gate, backoff);
            else wait_count(&c->op[l][QKV][0], blocks * n * gate, backoff);
            move(b.qkv + head * head_dim, head_dim, b.attn, me, blocks, HIDDEN);
            signal(&c->op[l][ATTN][dataflow ? head : 0]);
            // O projection: split by KV head, it needs only its head's attention (dataflow).
            w = share_of(b, l, OPROJ, prime_words);
            if (weights) prime(w, primed);
            if (dataflow) wait_count(&c->op[l][ATTN][head], head_blocks * n * gate, backoff);
            else wait_count(&c->op[l][ATTN][0], blocks * n * gate, backoff);
            if (weights) stream(w, primed, b.sink);
            move(b.attn + (dataflow ? head * head_dim : 0), dataflow ? head_dim : HIDDEN, b.x1, me, blocks, HIDDEN);
            signal(&c->op[l][OPROJ][0]);
            // GateUp: rmsnorm of the whole x1 (the head partials summed in index order): all-to-all.
            w = share_of(b, l, GATEUP, prime_words);
            if (weights) prime(w, primed);
            wait_count(&c->op[l][OPROJ][0], blocks * n * gate, backoff);
            if (weights) stream(w, primed, b.sink);
            move(b.x1, HIDDEN, b.act, me, blocks, FFN);
            signal(&c->op[l][GATEUP][0]);
            // Down: the whole activation.
            w = share_of(b, l, DOWN, prime_words);
            if (weights) prime(w, primed);
            wait_count(&c->op[l][GATEUP][0], blocks * n * gate, backoff);
            if (weights) stream(w, primed, b.sink);
            move(b.act, FFN, b.x, me, blocks, HIDDEN);
            signal(&c->op[l][DOWN][0]);
        }
}

// What one configuration of the probe runs.
struct Case {
    bool dataflow, backoff, weights;
    size_t prime_bytes;
    bool waits;
};

static float launch_ms(Counters* c, Buffers b, int blocks, int tokens, Case k) {
    cudaMemset(c, 0, sizeof(Counters));
    return elapsed_ms([&] { chain<<<blocks, THREADS, k.prime_bytes>>>(c, b, tokens, k.dataflow, k.backoff, k.weights, k.prime_bytes / 16, k.waits); });
}

// Five samples of us a layer, sorted (median at 2). Each is the difference of a `tokens`-token launch
// and one of a tenth as many, which takes out the launch and the first tokens' ramp.
constexpr int SAMPLES = 5, WARMUP_DIVISOR = 10;
struct Samples { float us[SAMPLES]; };
static Samples us_a_layer(Counters* c, Buffers b, int blocks, int tokens, Case k) {
    Samples s;
    const int warm = tokens / WARMUP_DIVISOR;
    for (float& us : s.us)
        us = (launch_ms(c, b, blocks, tokens, k) - launch_ms(c, b, blocks, warm, k)) * 1e3f / ((tokens - warm) * LAYERS);
    for (int i = 0; i < SAMPLES; ++i)
        for (int j = i + 1; j < SAMPLES; ++j)
            if (s.us[j] < s.us[i]) { const float t = s.us[i]; s.us[i] = s.us[j]; s.us[j] = t; }
    return s;
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    Counters* c;
    Buffers b;
    cudaMalloc(&c, sizeof(Counters));
    for (float** p : {&b.x, &b.qkv, &b.attn, &b.x1, &b.act}) cudaMalloc(p, FFN * 2 * sizeof(float)), cudaMemset(*p, 0, FFN * 2 * sizeof(float));
    printf("graph     back-off  blocks  us a layer (median of %d; %d tokens x %d layers, less a tenth)\n", SAMPLES, TOKENS, LAYERS);
    for (int dataflow = 0; dataflow < 2; ++dataflow)
        for (int backoff = 1; backoff >= 0; --backoff) {
            const Samples s = us_a_layer(c, b, sms, TOKENS, {dataflow == 1, backoff == 1, false, 0, true});
            printf("%-9s %-9s %6d  %6.2f  [%.2f-%.2f]\n", dataflow ? "dataflow" : "phases", backoff ? "64 ns" : "none", sms, s.us[2], s.us[0], s.us[SAMPLES - 1]);
        }
    size_t layer_bytes = 0;
    for (int op = 0; op < OPS; ++op) layer_bytes += op_bytes(op);
    cudaMalloc((void**)&b.weights, layer_bytes * LAYERS);
    cudaMemset((void*)b.weights, 0x5a, layer_bytes * LAYERS);
    cudaMalloc(&b.sink, THREADS * sizeof(float));
    cudaFuncSetAttribute(chain, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
    printf("\nweights (dataflow, no back-off)            us a layer  TB/s  (%.1f MB a layer)\n", layer_bytes / 1e6);
    for (int waits = 1; waits >= 0; --waits)
        for (size_t prime_kb : {(size_t)0, (size_t)16, (size_t)64, (size_t)128}) {
            // A quarter of the tokens: a layer's weights take several times its hops.
            const Samples s = us_a_layer(c, b, sms, TOKENS / 4, {true, false, true, prime_kb * 1024, waits == 1});
            printf("%-13s primed %3zu KB a task   %6.2f  %.2f  [%.2f-%.2f]\n", waits ? "with waits" : "no waits", prime_kb, s.us[2],
                   layer_bytes / (s.us[2] * 1e6), s.us[0], s.us[SAMPLES - 1]);
        }
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) { printf("CUDA error: %s\n", cudaGetErrorString(err)); return 1; }
    return 0;
}
