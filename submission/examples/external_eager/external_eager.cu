// An example external submission: the layer of persistent_layer.h in plain CUDA C++, one launch per
// op (10 per step), built into a shared library by scripts/build-example. It is correct and simple,
// not fast: it fails the launch gates on purpose, like the built-in `reference`. Start from it to
// write a real one.
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

// Everything a step needs, made by pl_build_layer.
struct Layer {
    uint32_t magic = MAGIC;
    pl_config cfg{};
    pl_weights w{};
    pl_kv_cache cache{};
    int attention_threads = 0;
    // Scratch, bf16: h and h2 (d), q (n_q * hd), k and v (n_kv * hd), a (n_q * hd), x1 (d), act (ffn).
    bf16 *h = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *a = nullptr, *x1 = nullptr, *h2 = nullptr,
         *act = nullptr;
    // (max_seq_len, hd / 2) f32: cos and sin of pos * theta^(-2i / hd), computed in f64.
    float *cos_table = nullptr, *sin_table = nullptr;
    // (n_q, max_seq_len) f32: attention scores, then probabilities.
    float* scores = nullptr;
};

void destroy(Layer* layer) {
    void* buffers[] = {layer->h,  layer->q,   layer->k,         layer->v,         layer->a,     layer->x1,
                       layer->h2, layer->act, layer->cos_table, layer->sin_table, layer->scores};
    for (void* p : buffers)
        if (p != nullptr) cudaFree(p);  // nothing to report to: teardown returns void
    layer->magic = 0;
    delete layer;
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

int build(const pl_config* cfg, const pl_weights* w, const pl_kv_cache* cache, cudaStream_t stream, Layer* L) {
    const pl_config& c = *cfg;
    if (const int rc = validate(c)) return rc;
    const void* pointers[] = {w->in_norm, w->post_norm, w->q, w->k, w->v, w->o, w->gate, w->up, w->down, cache->k, cache->v};
    for (const void* p : pointers)
        if (p == nullptr) return fail(PL_ERR_INVALID_ARGUMENT, "a weight or cache pointer is NULL");
    const void* matrices[] = {w->q, w->k, w->v, w->o, w->gate, w->up, w->down};
    for (const void* p : matrices)
        if (!aligned16(p)) return fail(PL_ERR_INVALID_ARGUMENT, "a weight matrix is not 16-byte aligned");
    L->cfg = c;
    L->w = *w;
    L->cache = *cache;
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

int step(Layer* L, const bf16* x, int32_t pos, bf16* out, cudaStream_t stream) {
    const pl_config& c = L->cfg;
    const pl_weights& w = L->w;
    auto wt = [](const void* p) { return static_cast<const bf16*>(p); };
    bf16* cache_k = static_cast<bf16*>(L->cache.k);
    bf16* cache_v = static_cast<bf16*>(L->cache.v);
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

}  // namespace

extern "C" {

uint32_t pl_abi_version(void) { return PL_ABI_VERSION; }

int pl_build_layer(const pl_config* cfg, const pl_weights* w, const pl_kv_cache* cache, void* stream, void** handle) {
    try {
        if (cfg == nullptr || w == nullptr || cache == nullptr || handle == nullptr)
            return fail(PL_ERR_INVALID_ARGUMENT, "pl_build_layer: cfg, w, cache and handle must not be NULL");
        *handle = nullptr;
        Layer* layer = new Layer();
        const int rc = build(cfg, w, cache, static_cast<cudaStream_t>(stream), layer);
        if (rc != PL_OK) {
            destroy(layer);
            return rc;
        }
        *handle = layer;
        return PL_OK;
    } catch (const std::exception& e) {
        return fail(PL_ERR_INTERNAL, std::string("pl_build_layer: ") + e.what());
    } catch (...) {
        return fail(PL_ERR_INTERNAL, "pl_build_layer: unknown exception");
    }
}

int pl_layer_step(void* handle, const void* x, int32_t pos, void* out, void* stream) {
    try {
        Layer* layer = static_cast<Layer*>(handle);
        if (layer == nullptr || layer->magic != MAGIC)
            return fail(PL_ERR_INVALID_ARGUMENT, "pl_layer_step: not a handle from pl_build_layer");
        if (x == nullptr || out == nullptr) return fail(PL_ERR_INVALID_ARGUMENT, "pl_layer_step: x or out is NULL");
        if (pos < 0 || pos >= layer->cfg.max_seq_len)
            return fail(PL_ERR_INVALID_ARGUMENT, "pl_layer_step: pos " + std::to_string(pos) + " is outside the cache's " +
                                                     std::to_string(layer->cfg.max_seq_len) + " slots");
        return step(layer, static_cast<const bf16*>(x), pos, static_cast<bf16*>(out), static_cast<cudaStream_t>(stream));
    } catch (const std::exception& e) {
        return fail(PL_ERR_INTERNAL, std::string("pl_layer_step: ") + e.what());
    } catch (...) {
        return fail(PL_ERR_INTERNAL, "pl_layer_step: unknown exception");
    }
}

void pl_teardown(void* handle) {
    Layer* layer = static_cast<Layer*>(handle);
    if (layer == nullptr || layer->magic != MAGIC) return;
    destroy(layer);
}

const char* pl_last_error(void) { return last_error.c_str(); }

}  // extern "C"
