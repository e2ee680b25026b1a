// An example external submission: the layer of persistent_layer.h in plain CUDA C++, one launch per
// op (10 per step), built into a shared library by scripts/build-example. It is correct and simple,
// not fast: it fails the launch gates on purpose, like the built-in `reference`. Start from it to
// write a real one. It speaks ABI version 2: a stack (pl_build_stack, pl_stack_step) runs the same
// layer once per layer, one after another, on one set of scratch buffers.
//
// Every op reads bf16, computes in f32 (f32 accumulation in every reduction) and stores bf16, at the
// rounding points of the grader's eager reference: h, q, k, v, q and k after RoPE, the attention output
// a, o = a @ Wo^T, x1 = x + o, h2, gate and up, act = silu(gate) * up, down, out = x1 + down. Scores and
// softmax probabilities stay f32.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "persistent_layer.h"

typedef __nv_bfloat16 bf16;

namespace {

constexpr int WARP = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
// bf16 per 16-byte vector: GEMV rows are read in these.
constexpr int VEC = 8;
// GEMV rows per block, one warp each.
constexpr int GEMV_WARPS = 8;
// Threads of the one block that normalises a vector.
constexpr int NORM_THREADS = 1024;
// Threads per block of the RoPE / cache-append kernel.
constexpr int ELEM_THREADS = 256;
// The most blocks of the grid-stride RoPE / cache-append kernel.
constexpr int ELEM_MAX_BLOCKS = 1024;
// The largest head size the attention kernel handles (one thread per element of a head).
constexpr int MAX_HD = 1024;
// Identifies a live handle.
constexpr uint32_t MAGIC = 0x504c4531u;  // "PLE1"

// ---------------------------------------------------------------------------------------------------
// Device code
// ---------------------------------------------------------------------------------------------------

__device__ inline float bf(bf16 v) { return __bfloat162float(v); }

// f32 rounded to bf16 and back: the value a bf16 store keeps.
__device__ inline float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ inline float warp_sum(float v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ inline float warp_max(float v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// The block's sum, returned to every thread; every thread must call it (blockDim a multiple of 32).
__device__ float block_sum(float v) {
    __shared__ float partials[32];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();  // an earlier call's readers are done with partials
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += partials[w];
    return total;
}

// The block's maximum, as block_sum.
__device__ float block_max(float v) {
    __shared__ float partials[32];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    float total = -INFINITY;
    for (int w = 0; w < warps; ++w) total = fmaxf(total, partials[w]);
    return total;
}

// acc + the dot product of two 16-byte vectors of 8 bf16, in f32.
__device__ inline float dot8(uint4 a, uint4 b, float acc) {
    const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 fx = __bfloat1622float2(x[j]), fy = __bfloat1622float2(y[j]);
        acc = fmaf(fx.x, fy.x, acc);
        acc = fmaf(fx.y, fy.y, acc);
    }
    return acc;
}

// The dot product of row `row` of W (rows, cols) with h (cols), summed over the warp; cols % 8 == 0
// and W, h 16-byte aligned. Every lane of the warp gets the total.
__device__ inline float row_dot(const bf16* __restrict__ W, const bf16* __restrict__ h, int row, int cols) {
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)row * cols);
    const uint4* x = reinterpret_cast<const uint4*>(h);
    const int lane = threadIdx.x % WARP, vectors = cols / VEC;
    float acc = 0.0f;
    for (int i = lane; i < vectors; i += WARP) acc = dot8(__ldg(&w[i]), x[i], acc);
    return warp_sum(acc);
}

// out = bf16((x * (1 / sqrt(mean(x^2) + eps))) * g), by one block.
__global__ void rmsnorm_kernel(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ g,
                               int n, float eps) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum = fmaf(bf(x[i]), bf(x[i]), sum);
    const float mean = __fdiv_rn(block_sum(sum), (float)n);
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(bf(x[i]), r), bf(g[i])));
}

// y = bf16(W h), or with `residual`, y = bf16(residual + bf16(W h)). One warp per row.
__global__ void gemv_kernel(bf16* __restrict__ y, const bf16* __restrict__ W, const bf16* __restrict__ h, int rows,
                            int cols, const bf16* __restrict__ residual) {
    const int row = blockIdx.x * GEMV_WARPS + threadIdx.x / WARP;
    if (row >= rows) return;  // the whole warp leaves together
    const float dot = row_dot(W, h, row, cols);
    if (threadIdx.x % WARP == 0) {
        float v = round_bf16(dot);
        if (residual != nullptr) v = __fadd_rn(bf(residual[row]), v);
        y[row] = __float2bfloat16_rn(v);
    }
}

// act = bf16(silu(bf16(Wgate h)) * bf16(Wup h)), silu(g) = g / (1 + exp(-g)). One warp per row.
__global__ void gate_up_kernel(bf16* __restrict__ act, const bf16* __restrict__ Wg, const bf16* __restrict__ Wu,
                               const bf16* __restrict__ h, int rows, int cols) {
    const int row = blockIdx.x * GEMV_WARPS + threadIdx.x / WARP;
    if (row >= rows) return;
    const float g = round_bf16(row_dot(Wg, h, row, cols));
    const float u = round_bf16(row_dot(Wu, h, row, cols));
    if (threadIdx.x % WARP == 0) {
        const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
        act[row] = __float2bfloat16_rn(__fmul_rn(silu, u));
    }
}

// Rotate-half RoPE at pos of q (n_q heads, in place) and k (n_kv heads, written straight into slot pos
// of cache_k), and v copied into slot pos of cache_v. Grid-stride; each thread owns whole outputs.
__global__ void rope_append_kernel(bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                   bf16* __restrict__ cache_k, bf16* __restrict__ cache_v,
                                   const float* __restrict__ cos_table, const float* __restrict__ sin_table, int n_q,
                                   int n_kv, int hd, int max_seq_len, int pos) {
    const int half = hd / 2;
    const int pairs = (n_q + n_kv) * half, total = pairs + n_kv * hd;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        if (i < pairs) {
            const int head = i / half, j = i % half;
            const float c = cos_table[(size_t)pos * half + j], s = sin_table[(size_t)pos * half + j];
            const bf16* in = head < n_q ? q + (size_t)head * hd : k + (size_t)(head - n_q) * hd;
            bf16* out = head < n_q ? q + (size_t)head * hd
                                   : cache_k + ((size_t)(head - n_q) * max_seq_len + pos) * hd;
            const float a = bf(in[j]), b = bf(in[j + half]);
            out[j] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
            out[j + half] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
        } else {
            const int t = i - pairs, head = t / hd, e = t % hd;
            cache_v[((size_t)head * max_seq_len + pos) * hd + e] = v[t];
        }
    }
}

// a[head] = softmax(q[head] . K[0..len) / sqrt(hd)) @ V[0..len), one block per query head. scores:
// (n_q, max_seq_len) f32 scratch. Dynamic shared memory: blockDim.x floats.
__global__ void attention_kernel(bf16* __restrict__ a, const bf16* __restrict__ q, const bf16* __restrict__ cache_k,
                                 const bf16* __restrict__ cache_v, float* __restrict__ scores, int n_q, int n_kv,
                                 int hd, int max_seq_len, int len) {
    extern __shared__ float partial[];  // (blockDim.x)
    const int head = blockIdx.x, kv_head = head / (n_q / n_kv);
    const bf16* qh = q + (size_t)head * hd;
    const bf16* K = cache_k + (size_t)kv_head * max_seq_len * hd;
    const bf16* V = cache_v + (size_t)kv_head * max_seq_len * hd;
    float* s = scores + (size_t)head * max_seq_len;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;

    // Scores, one warp per slot.
    const float root = __fsqrt_rn((float)hd);
    for (int p = warp; p < len; p += warps) {
        float acc = 0.0f;
        for (int e = lane; e < hd; e += WARP) acc = fmaf(bf(qh[e]), bf(K[(size_t)p * hd + e]), acc);
        acc = warp_sum(acc);
        if (lane == 0) s[p] = __fdiv_rn(acc, root);
    }
    __syncthreads();  // the scores (global memory) are visible to the whole block

    // Softmax in f32: exp(s - max) in place, and their sum.
    float m = -INFINITY;
    for (int p = threadIdx.x; p < len; p += blockDim.x) m = fmaxf(m, s[p]);
    m = block_max(m);
    float sum = 0.0f;
    for (int p = threadIdx.x; p < len; p += blockDim.x) {
        const float e = expf(s[p] - m);
        s[p] = e;
        sum += e;
    }
    sum = block_sum(sum);  // its barriers also publish the exponentials
    const float inv = __fdiv_rn(1.0f, sum);

    // Weighted sum of values: groups of hd threads split the slots, one thread per element.
    const int groups = blockDim.x / hd, group = threadIdx.x / hd, e = threadIdx.x % hd;
    float acc = 0.0f;
    if (group < groups)
        for (int p = group; p < len; p += groups) acc = fmaf(s[p], bf(V[(size_t)p * hd + e]), acc);
    partial[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < hd) {
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) total += partial[g * hd + threadIdx.x];
        a[(size_t)head * hd + threadIdx.x] = __float2bfloat16_rn(total * inv);
    }
}

// ---------------------------------------------------------------------------------------------------
// Host code
// ---------------------------------------------------------------------------------------------------

// The message pl_last_error returns, per thread.
thread_local std::string last_error;

int fail(int code, const std::string& message) {
    last_error = message;
    return code;
}

std::string cuda_message(const char* what, cudaError_t e) {
    return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Returns PL_ERR_CUDA from the enclosing function when a CUDA call fails.
#define CHECK_CUDA(call, what)                                          \
    do {                                                                \
        const cudaError_t e_ = (call);                                  \
        if (e_ != cudaSuccess) return fail(PL_ERR_CUDA, cuda_message(what, e_)); \
    } while (0)

// Returns PL_ERR_CUDA when the launch just made was refused (bad configuration, no kernel image, ...).
#define CHECK_LAUNCH(name) CHECK_CUDA(cudaGetLastError(), "launching " name)

// Everything a step needs, made by pl_build_layer (one layer) or pl_build_stack (several, which run one
// after another and so share the scratch and the tables).
struct Layers {
    uint32_t magic = MAGIC;
    pl_config cfg{};
    // Each layer's weights and cache, layer 0's first.
    std::vector<pl_weights> w;
    std::vector<pl_kv_cache> cache;
    int attention_threads = 0;
    // Scratch, bf16: h and h2 (d), q (n_q * hd), k and v (n_kv * hd), a (n_q * hd), x1 (d), act (ffn).
    bf16 *h = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *a = nullptr, *x1 = nullptr, *h2 = nullptr,
         *act = nullptr;
    // (max_seq_len, hd / 2) f32: cos and sin of pos * theta^(-2i / hd), computed in f64.
    float *cos_table = nullptr, *sin_table = nullptr;
    // (n_q, max_seq_len) f32: attention scores, then probabilities.
    float* scores = nullptr;
};

void destroy(Layers* L) {
    void* buffers[] = {L->h, L->q, L->k, L->v, L->a, L->x1, L->h2, L->act, L->cos_table, L->sin_table, L->scores};
    for (void* p : buffers)
        if (p != nullptr) cudaFree(p);  // nothing to report to: teardown returns void
    L->magic = 0;
    delete L;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int validate(const pl_config& c) {
    const int32_t positive[] = {c.d, c.ffn, c.n_q, c.n_kv, c.hd, c.max_seq_len, c.batch};
    for (int32_t v : positive)
        if (v <= 0) return fail(PL_ERR_INVALID_ARGUMENT, "every size of the config must be positive");
    if (c.batch != 1) return fail(PL_ERR_UNSUPPORTED, "external_eager handles batch 1 only, not " + std::to_string(c.batch));
    if (c.n_q % c.n_kv != 0) return fail(PL_ERR_INVALID_ARGUMENT, "n_q must be a multiple of n_kv");
    if (c.hd % 2 != 0) return fail(PL_ERR_INVALID_ARGUMENT, "hd must be even");
    if (c.d % VEC != 0 || c.ffn % VEC != 0 || (int64_t)c.n_q * c.hd % VEC != 0)
        return fail(PL_ERR_UNSUPPORTED, "d, ffn and n_q * hd must be multiples of 8 (16-byte rows)");
    if (c.hd > MAX_HD) return fail(PL_ERR_UNSUPPORTED, "hd above " + std::to_string(MAX_HD) + " is not handled");
    if ((int64_t)(c.n_q + c.n_kv) * c.hd > INT32_MAX / 2)
        return fail(PL_ERR_UNSUPPORTED, "(n_q + n_kv) * hd is too large for this example's 32-bit indexing");
    if (!(c.eps > 0.0f) || !std::isfinite(c.eps)) return fail(PL_ERR_INVALID_ARGUMENT, "eps must be positive and finite");
    if (!(c.theta > 1.0) || !std::isfinite(c.theta)) return fail(PL_ERR_INVALID_ARGUMENT, "theta must be finite and above 1");
    return PL_OK;
}

// Checks layer `l`'s pointers and keeps them.
int add_layer(uint32_t l, const pl_weights& w, const pl_kv_cache& cache, Layers* L) {
    const std::string which = "layer " + std::to_string(l) + ": ";
    const void* pointers[] = {w.in_norm, w.post_norm, w.q, w.k, w.v, w.o, w.gate, w.up, w.down, cache.k, cache.v};
    for (const void* p : pointers)
        if (p == nullptr) return fail(PL_ERR_INVALID_ARGUMENT, which + "a weight or cache pointer is NULL");
    const void* matrices[] = {w.q, w.k, w.v, w.o, w.gate, w.up, w.down};
    for (const void* p : matrices)
        if (!aligned16(p)) return fail(PL_ERR_INVALID_ARGUMENT, which + "a weight matrix is not 16-byte aligned");
    L->w.push_back(w);
    L->cache.push_back(cache);
    return PL_OK;
}

// The n layers of w and caches, and the scratch and tables they share.
int build(const pl_config* cfg, uint32_t n, const pl_weights* w, const pl_kv_cache* caches, cudaStream_t stream,
          Layers* L) {
    const pl_config& c = *cfg;
    if (const int rc = validate(c)) return rc;
    for (uint32_t l = 0; l < n; ++l)
        if (const int rc = add_layer(l, w[l], caches[l], L)) return rc;
    L->cfg = c;
    L->attention_threads = c.hd <= 512 ? 512 : MAX_HD;

    const size_t qd = (size_t)c.n_q * c.hd, kvd = (size_t)c.n_kv * c.hd, half = (size_t)c.hd / 2;
    const size_t table = (size_t)c.max_seq_len * half;
    auto alloc_bf16 = [](bf16** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n * sizeof(bf16)); };
    auto alloc_f32 = [](float** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n * sizeof(float)); };
    CHECK_CUDA(alloc_bf16(&L->h, c.d), "allocating h");
    CHECK_CUDA(alloc_bf16(&L->h2, c.d), "allocating h2");
    CHECK_CUDA(alloc_bf16(&L->x1, c.d), "allocating x1");
    CHECK_CUDA(alloc_bf16(&L->q, qd), "allocating q");
    CHECK_CUDA(alloc_bf16(&L->a, qd), "allocating the attention output");
    CHECK_CUDA(alloc_bf16(&L->k, kvd), "allocating k");
    CHECK_CUDA(alloc_bf16(&L->v, kvd), "allocating v");
    CHECK_CUDA(alloc_bf16(&L->act, c.ffn), "allocating the MLP activation");
    CHECK_CUDA(alloc_f32(&L->cos_table, table), "allocating the RoPE cos table");
    CHECK_CUDA(alloc_f32(&L->sin_table, table), "allocating the RoPE sin table");
    CHECK_CUDA(alloc_f32(&L->scores, (size_t)c.n_q * c.max_seq_len), "allocating the attention scores");

    // RoPE: angle i of position p is p * theta^(-2i / hd), in f64, each cos and sin rounded once to f32.
    std::vector<float> cos_host(table), sin_host(table);
    for (size_t p = 0; p < (size_t)c.max_seq_len; ++p)
        for (size_t i = 0; i < half; ++i) {
            const double angle = (double)p * std::pow(c.theta, -2.0 * (double)i / (double)c.hd);
            cos_host[p * half + i] = (float)std::cos(angle);
            sin_host[p * half + i] = (float)std::sin(angle);
        }
    CHECK_CUDA(cudaMemcpyAsync(L->cos_table, cos_host.data(), table * sizeof(float), cudaMemcpyHostToDevice, stream),
               "uploading the RoPE cos table");
    CHECK_CUDA(cudaMemcpyAsync(L->sin_table, sin_host.data(), table * sizeof(float), cudaMemcpyHostToDevice, stream),
               "uploading the RoPE sin table");
    CHECK_CUDA(cudaStreamSynchronize(stream), "waiting for the RoPE tables");  // the host vectors die here

    // Load every kernel now (module loading is lazy), so that a missing image fails here, untimed.
    cudaFuncAttributes attr;
    CHECK_CUDA(cudaFuncGetAttributes(&attr, rmsnorm_kernel), "loading rmsnorm_kernel");
    CHECK_CUDA(cudaFuncGetAttributes(&attr, gemv_kernel), "loading gemv_kernel");
    CHECK_CUDA(cudaFuncGetAttributes(&attr, gate_up_kernel), "loading gate_up_kernel");
    CHECK_CUDA(cudaFuncGetAttributes(&attr, rope_append_kernel), "loading rope_append_kernel");
    CHECK_CUDA(cudaFuncGetAttributes(&attr, attention_kernel), "loading attention_kernel");
    return PL_OK;
}

int blocks_for(int64_t n, int per_block) { return (int)((n + per_block - 1) / per_block); }

// Layer l at pos: out from x, K and V into slot pos of layer l's cache.
int step(const Layers* L, size_t l, const bf16* x, int32_t pos, bf16* out, cudaStream_t stream) {
    const pl_config& c = L->cfg;
    const pl_weights& w = L->w[l];
    auto wt = [](const void* p) { return static_cast<const bf16*>(p); };
    bf16* cache_k = static_cast<bf16*>(L->cache[l].k);
    bf16* cache_v = static_cast<bf16*>(L->cache[l].v);
    const int qd = c.n_q * c.hd, kvd = c.n_kv * c.hd;
    const dim3 gemv_block(GEMV_WARPS * WARP);

    rmsnorm_kernel<<<1, NORM_THREADS, 0, stream>>>(L->h, x, wt(w.in_norm), c.d, c.eps);
    CHECK_LAUNCH("rmsnorm_kernel (in_norm)");
    gemv_kernel<<<blocks_for(qd, GEMV_WARPS), gemv_block, 0, stream>>>(L->q, wt(w.q), L->h, qd, c.d, nullptr);
    CHECK_LAUNCH("gemv_kernel (q)");
    gemv_kernel<<<blocks_for(kvd, GEMV_WARPS), gemv_block, 0, stream>>>(L->k, wt(w.k), L->h, kvd, c.d, nullptr);
    CHECK_LAUNCH("gemv_kernel (k)");
    gemv_kernel<<<blocks_for(kvd, GEMV_WARPS), gemv_block, 0, stream>>>(L->v, wt(w.v), L->h, kvd, c.d, nullptr);
    CHECK_LAUNCH("gemv_kernel (v)");

    const int64_t elems = (int64_t)(c.n_q + c.n_kv) * (c.hd / 2) + kvd;
    const int elem_blocks = blocks_for(elems, ELEM_THREADS) < ELEM_MAX_BLOCKS ? blocks_for(elems, ELEM_THREADS) : ELEM_MAX_BLOCKS;
    rope_append_kernel<<<elem_blocks, ELEM_THREADS, 0, stream>>>(L->q, L->k, L->v, cache_k, cache_v, L->cos_table,
                                                                L->sin_table, c.n_q, c.n_kv, c.hd, c.max_seq_len, pos);
    CHECK_LAUNCH("rope_append_kernel");
    const int threads = L->attention_threads;
    attention_kernel<<<c.n_q, threads, threads * sizeof(float), stream>>>(L->a, L->q, cache_k, cache_v, L->scores, c.n_q,
                                                                          c.n_kv, c.hd, c.max_seq_len, pos + 1);
    CHECK_LAUNCH("attention_kernel");

    gemv_kernel<<<blocks_for(c.d, GEMV_WARPS), gemv_block, 0, stream>>>(L->x1, wt(w.o), L->a, c.d, qd, x);
    CHECK_LAUNCH("gemv_kernel (o + residual)");
    rmsnorm_kernel<<<1, NORM_THREADS, 0, stream>>>(L->h2, L->x1, wt(w.post_norm), c.d, c.eps);
    CHECK_LAUNCH("rmsnorm_kernel (post_norm)");
    gate_up_kernel<<<blocks_for(c.ffn, GEMV_WARPS), gemv_block, 0, stream>>>(L->act, wt(w.gate), wt(w.up), L->h2,
                                                                             c.ffn, c.d);
    CHECK_LAUNCH("gate_up_kernel");
    gemv_kernel<<<blocks_for(c.d, GEMV_WARPS), gemv_block, 0, stream>>>(out, wt(w.down), L->act, c.d, c.ffn, L->x1);
    CHECK_LAUNCH("gemv_kernel (down + residual)");
    return PL_OK;
}

// Every layer at pos, one after another: layer l reads x or row l - 1 of hidden and writes row l of
// hidden, the last one out. hidden is (layers - 1, batch, d); NULL for one layer.
int step_all(const Layers* L, const bf16* x, int32_t pos, bf16* hidden, bf16* out, cudaStream_t stream) {
    const size_t row = (size_t)L->cfg.batch * L->cfg.d, last = L->w.size() - 1;
    for (size_t l = 0; l <= last; ++l) {
        const bf16* in = l == 0 ? x : hidden + (l - 1) * row;
        if (const int rc = step(L, l, in, pos, l == last ? out : hidden + l * row, stream)) return rc;
    }
    return PL_OK;
}

// pl_build_layer and pl_build_stack: a handle of n layers in *handle, or none and the error
// (`function` names the entry point in messages).
int make(const char* function, const pl_config* cfg, uint32_t n, const pl_weights* w, const pl_kv_cache* caches,
         void* stream, void** handle) {
    try {
        const std::string name(function);
        if (cfg == nullptr || w == nullptr || caches == nullptr || handle == nullptr)
            return fail(PL_ERR_INVALID_ARGUMENT, name + ": its pointer arguments must not be NULL");
        if (n == 0) return fail(PL_ERR_INVALID_ARGUMENT, name + ": a stack of no layers");
        *handle = nullptr;
        Layers* L = new Layers();
        const int rc = build(cfg, n, w, caches, static_cast<cudaStream_t>(stream), L);
        if (rc != PL_OK) {
            destroy(L);
            return rc;
        }
        *handle = L;
        return PL_OK;
    } catch (const std::exception& e) {
        return fail(PL_ERR_INTERNAL, std::string(function) + ": " + e.what());
    } catch (...) {
        return fail(PL_ERR_INTERNAL, std::string(function) + ": unknown exception");
    }
}

// pl_layer_step (`one_layer`: a handle of pl_build_layer) and pl_stack_step (any handle; hidden may be
// NULL for one layer), its arguments checked first (`function` names the entry point in messages).
int run(const char* function, bool one_layer, void* handle, const void* x, int64_t pos, void* hidden, void* out,
        void* stream) {
    try {
        const Layers* L = static_cast<const Layers*>(handle);
        const std::string name(function);
        if (L == nullptr || L->magic != MAGIC || (one_layer && L->w.size() != 1))
            return fail(PL_ERR_INVALID_ARGUMENT,
                        name + ": not a handle from " + (one_layer ? "pl_build_layer" : "pl_build_stack"));
        if (x == nullptr || out == nullptr || (L->w.size() > 1 && hidden == nullptr))
            return fail(PL_ERR_INVALID_ARGUMENT, name + ": x, out or hidden is NULL");
        if (pos < 0 || pos >= L->cfg.max_seq_len)
            return fail(PL_ERR_INVALID_ARGUMENT, name + ": pos " + std::to_string(pos) + " is outside the cache's " +
                                                     std::to_string(L->cfg.max_seq_len) + " slots");
        return step_all(L, static_cast<const bf16*>(x), (int32_t)pos, static_cast<bf16*>(hidden),
                        static_cast<bf16*>(out), static_cast<cudaStream_t>(stream));
    } catch (const std::exception& e) {
        return fail(PL_ERR_INTERNAL, std::string(function) + ": " + e.what());
    } catch (...) {
        return fail(PL_ERR_INTERNAL, std::string(function) + ": unknown exception");
    }
}

}  // namespace

extern "C" {

uint32_t pl_abi_version(void) { return PL_ABI_VERSION; }

int pl_build_layer(const pl_config* cfg, const pl_weights* w, const pl_kv_cache* cache, void* stream, void** handle) {
    return make("pl_build_layer", cfg, 1, w, cache, stream, handle);
}

int pl_layer_step(void* handle, const void* x, int32_t pos, void* out, void* stream) {
    return run("pl_layer_step", true, handle, x, pos, nullptr, out, stream);
}

int pl_build_stack(const pl_config* cfg, uint32_t n_layers, const pl_weights* w, const pl_kv_cache* caches,
                   void* stream, void** handle) {
    return make("pl_build_stack", cfg, n_layers, w, caches, stream, handle);
}

int pl_stack_step(void* handle, const void* x, uint32_t pos, void* hidden, void* out, void* stream) {
    return run("pl_stack_step", false, handle, x, pos, hidden, out, stream);
}

void pl_teardown(void* handle) {
    Layers* L = static_cast<Layers*>(handle);
    if (L == nullptr || L->magic != MAGIC) return;
    destroy(L);
}

const char* pl_last_error(void) { return last_error.c_str(); }

}  // extern "C"
