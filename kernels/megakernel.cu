// The megakernel: the whole decoder layer in one persistent launch per token. The layer is compiled
// (submission/src/megakernel/program.rs) into a table of phases; every block of a grid sized to be
// co-resident walks the table, does its share of each phase and crosses a grid barrier before the
// next. The same code runs one phase per launch (phase_begin + 1 == phase_end) for debugging and
// per-phase timing; the results are bitwise identical because nothing else changes.
//
// Weight streaming (the 1.71 GB that decide the score): a GEMV phase splits its rows evenly over the
// blocks, in RoPE / gate-up pairs. Within a block, thread t owns the 16-byte vectors t, t + THREADS,
// ... of every row, holds the matching vectors of the input in registers, and streams its vectors of
// STAGES row groups ahead through a per-thread cp.async ring in shared memory. A thread reads back
// only what it copied itself, so the ring needs no block barrier; each warp reduces a row with a
// shuffle butterfly and the warps' partials meet in shared memory once, at the end of the phase, where
// they are added in warp order. No float atomics anywhere: outputs are bitwise reproducible.
//
// Rounding follows the eager reference: q, k, v, a, o, x1, h, h2, gate, up, act and down are rounded to
// bf16 where the reference stores them; scores and softmax weights stay f32.
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

#include "layer_math.cuh"
#include "program.cuh"

// Threads per block; one block per SM (__launch_bounds__ below) leaves 128 registers per thread.
constexpr uint32_t THREADS = 512;
constexpr uint32_t WARPS = THREADS / WARP;
// The per-thread cp.async ring: STAGES groups of rows, STAGE_BYTES each, in flight ahead of use.
constexpr uint32_t STAGES = 3;
constexpr uint32_t STAGE_BYTES = 64 * 1024;
constexpr uint32_t RING_BYTES = STAGES * STAGE_BYTES;
// Input vectors a thread holds: rows of up to MAX_VPT * THREADS * VEC = 28672 bf16.
constexpr uint32_t MAX_VPT = 7;
// Attention work items: ATTN_CHUNK cached positions of one KV head for all of its query heads.
constexpr uint32_t ATTN_CHUNK = 128;
constexpr uint32_t ATTN_MAX_HD = 128;
constexpr uint32_t ATTN_MAX_GROUP = 8;

// ---------------------------------------------------------------------------------------------------
// Memory helpers
// ---------------------------------------------------------------------------------------------------

// A 16-byte global -> shared copy that completes asynchronously (cached in L2 only: weights are read
// once).
__device__ inline void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ inline void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Activations written earlier in this launch by other blocks are read through L2 (ld.global.cg):
// L1 is not coherent across SMs, and the grid barrier's fences order only L2.
__device__ inline uint4 load_cg(const bf16* p, uint32_t vector) { return __ldcg(reinterpret_cast<const uint4*>(p) + vector); }

// ---------------------------------------------------------------------------------------------------
// The grid barrier
// ---------------------------------------------------------------------------------------------------

// A monotonic counter: each block adds 1 per barrier and waits until the counter reaches `target`
// (the host passes the count every earlier barrier left behind, so it is never reset). The
// comparison is on the signed difference, so the 32-bit counter may wrap.
__device__ inline void grid_barrier(unsigned* counter, unsigned target) {
    __syncthreads();  // every thread of this block has finished the phase's writes
    if (threadIdx.x == 0) {
        // Release: the block's writes (ordered before this fence by the bar.sync above) become
        // visible device-wide before the arrival does.
        __threadfence();
        atomicAdd(counter, 1u);
        volatile unsigned* c = counter;
        while ((int)(*c - target) < 0) __nanosleep(64);
        // Acquire: no read of the next phase moves above the observation of the last arrival.
        __threadfence();
    }
    __syncthreads();  // the rest of the block waits for thread 0 to see every arrival
}

// ---------------------------------------------------------------------------------------------------
// The streamed GEMV
// ---------------------------------------------------------------------------------------------------

// The input vector of a GEMV as this thread holds it: h[v] is 16-byte vector t + v * THREADS.
struct Slice {
    uint4 h[MAX_VPT];
    uint32_t vecs;  // 16-byte vectors per row
    uint32_t vpt;   // vectors per thread, ceil(vecs / THREADS)
};

__device__ inline bool owns(const Slice& s, uint32_t v) { return threadIdx.x + v * THREADS < s.vecs; }

// This block's rows of a GEMV with `rows` rows: an even share, in whole pairs.
__device__ inline void block_rows(uint32_t rows, uint32_t& r0, uint32_t& r1) {
    const uint64_t pairs = rows / 2;
    r0 = 2 * (uint32_t)(pairs * blockIdx.x / gridDim.x);
    r1 = 2 * (uint32_t)(pairs * (blockIdx.x + 1) / gridDim.x);
}

// Where a GEMV phase keeps its row partials: red_rows rows of WARPS floats after the ring.
struct Partials {
    float* red;
    uint32_t rows;
};

// red[r - r0][warp] = warp's partial dot product of row r of w with the slice, for r in [r0, r1).
__device__ void gemv_rows(const bf16* __restrict__ w,  // (rows, s.vecs * VEC)
                          const Slice& s, uint32_t r0, uint32_t r1, uint4* ring, Partials part) {
    const uint32_t t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    if (r1 - r0 > part.rows) __trap();  // the launcher sized red for fewer rows than this block got
    float* red = part.red;
    const uint32_t row_slots = THREADS * s.vpt;  // ring slots of one row
    const uint32_t stage_rows = max(1u, STAGE_BYTES / 16 / row_slots);
    const uint32_t n = r1 - r0, nstages = (n + stage_rows - 1) / stage_rows;

    auto issue = [&](uint32_t st) {
        if (st < nstages) {
            uint4* slot = ring + (st % STAGES) * (STAGE_BYTES / 16);
            for (uint32_t i = 0; i < stage_rows && st * stage_rows + i < n; ++i) {
                const uint4* src = reinterpret_cast<const uint4*>(w + (size_t)(r0 + st * stage_rows + i) * s.vecs * VEC);
#pragma unroll
                for (uint32_t v = 0; v < MAX_VPT; ++v) {
                    if (owns(s, v)) cp_async16(slot + (i * s.vpt + v) * THREADS + t, src + t + v * THREADS);
                }
            }
        }
        // Every thread commits a group per stage, empty or not, so wait_group counts alike everywhere.
        cp_async_commit();
    };

    for (uint32_t st = 0; st < STAGES - 1; ++st) issue(st);
    for (uint32_t st = 0; st < nstages; ++st) {
        // Reusing the slot of stage st - 1 is safe: this thread's reads of it fed the reduction below,
        // which completed before this point.
        issue(st + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // this thread's copies of stage st have landed
        const uint4* slot = ring + (st % STAGES) * (STAGE_BYTES / 16);
        for (uint32_t i = 0; i < stage_rows && st * stage_rows + i < n; ++i) {
            float acc = 0.0f;
#pragma unroll
            for (uint32_t v = 0; v < MAX_VPT; ++v) {
                if (owns(s, v)) acc = dot8(slot[(i * s.vpt + v) * THREADS + t], s.h[v], acc);
            }
            acc = warp_reduce(acc, Add{});
            if (lane == 0) red[(st * stage_rows + i) * WARPS + warp] = acc;
        }
    }
    cp_async_wait<0>();  // drain the trailing empty groups
    __syncthreads();     // every warp's partials are in red before any thread adds them up
}

// The sum of row r's warp partials, in warp order.
__device__ inline float row_sum(const float* red, uint32_t r) {
    float total = red[r * WARPS];
    for (uint32_t w = 1; w < WARPS; ++w) total += red[r * WARPS + w];
    return total;
}

// A slice of a vector in global memory written earlier in this launch.
__device__ inline Slice load_slice(const bf16* v, uint32_t len) {
    Slice s;
    s.vecs = len / VEC;
    s.vpt = (s.vecs + THREADS - 1) / THREADS;
#pragma unroll
    for (uint32_t j = 0; j < MAX_VPT; ++j) s.h[j] = owns(s, j) ? load_cg(v, threadIdx.x + j * THREADS) : make_uint4(0, 0, 0, 0);
    return s;
}

// rmsnorm(x, g) as a slice: every block computes the same sum of squares in the same order.
__device__ inline Slice rmsnorm_slice(const bf16* x, const bf16* g, uint32_t d, float eps) {
    Slice s = load_slice(x, d);
    float acc = 0.0f;
#pragma unroll
    for (uint32_t j = 0; j < MAX_VPT; ++j) acc = sumsq8(s.h[j], acc);  // zero vectors add nothing
    const float r = inv_rms(__fdiv_rn(block_reduce(acc, Add{}), (float)d), eps);
#pragma unroll
    for (uint32_t j = 0; j < MAX_VPT; ++j) {
        if (owns(s, j)) s.h[j] = rms_scale8(s.h[j], __ldg(reinterpret_cast<const uint4*>(g) + threadIdx.x + j * THREADS), r);
    }
    return s;
}

__device__ inline float bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// ---------------------------------------------------------------------------------------------------
// Phases
// ---------------------------------------------------------------------------------------------------

// h = rmsnorm(x); [q|k|v] = W h over pair-interleaved rows; rope q and k; append k and v at pos.
__device__ void phase_qkv(const int64_t* op, const bf16* x, uint32_t pos, uint4* ring, Partials part) {
    const bf16* w = reinterpret_cast<const bf16*>(op[qkv::W]);
    const uint32_t d = (uint32_t)op[qkv::D], n_q = (uint32_t)op[qkv::NQ], n_kv = (uint32_t)op[qkv::NKv];
    const uint32_t hd = (uint32_t)op[qkv::Hd], max_seq = (uint32_t)op[qkv::MaxSeq], half = hd / 2;
    const float eps = __int_as_float((int)op[qkv::EpsBits]);
    bf16* q_out = reinterpret_cast<bf16*>(op[qkv::QOut]);
    bf16* k_cache = reinterpret_cast<bf16*>(op[qkv::KCache]);
    bf16* v_cache = reinterpret_cast<bf16*>(op[qkv::VCache]);
    const float* cos_row = reinterpret_cast<const float*>(op[qkv::Cos]) + (size_t)pos * half;
    const float* sin_row = reinterpret_cast<const float*>(op[qkv::Sin]) + (size_t)pos * half;

    const Slice s = rmsnorm_slice(x, reinterpret_cast<const bf16*>(op[qkv::Norm]), d, eps);
    uint32_t r0, r1;
    block_rows((n_q + 2 * n_kv) * hd, r0, r1);
    gemv_rows(w, s, r0, r1, ring, part);

    // Pair p of the packed matrix is (row i, row i + hd/2) of one head: q heads, then k, then v.
    const uint32_t q_pairs = n_q * half, k_pairs = n_kv * half;
    for (uint32_t p = threadIdx.x; p < (r1 - r0) / 2; p += THREADS) {
        const uint32_t gp = r0 / 2 + p;
        const float a = bf(row_sum(part.red, 2 * p)), b = bf(row_sum(part.red, 2 * p + 1));
        if (gp < q_pairs + k_pairs) {
            const bool is_q = gp < q_pairs;
            const uint32_t j = is_q ? gp : gp - q_pairs, head = j / half, i = j % half;
            bf16* dst = is_q ? q_out + (size_t)head * hd : k_cache + ((size_t)head * max_seq + pos) * hd;
            rope_pair(a, b, cos_row[i], sin_row[i], &dst[i], &dst[i + half]);
        } else {
            const uint32_t j = gp - q_pairs - k_pairs, head = j / half, i = j % half;
            bf16* dst = v_cache + ((size_t)head * max_seq + pos) * hd;
            dst[i] = __float2bfloat16_rn(a);
            dst[i + half] = __float2bfloat16_rn(b);
        }
    }
}

// The last block to finish a KV head's chunks: a = sum_c o_c e^(m_c - M) / sum_c l_c e^(m_c - M) for
// each query head of the group, chunks in order (deterministic). Every chunk's scale is computed
// once into shared memory, so the sums below are streams of independent loads.
__device__ void combine(uint32_t kv, uint32_t n_chunks, uint32_t max_chunks, uint32_t group, uint32_t hd,
                        unsigned* counters, const float* part_o, const float* part_ml, bf16* a_out, float* scale) {
    const uint32_t t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    // Acquire: the other chunks' partials were released before their arrivals.
    __threadfence();
    const float* pm = part_ml + (size_t)kv * max_chunks * group * 2;  // (n_chunks, group, 2)
    const float* po = part_o + (size_t)kv * max_chunks * group * hd;  // (n_chunks, group, hd)
    for (uint32_t g = warp; g < group; g += WARPS) {
        float m = -CUDART_INF_F;
        for (uint32_t c = lane; c < n_chunks; c += WARP) m = fmaxf(m, __ldcg(pm + (c * group + g) * 2));
        m = warp_reduce(m, Max{});
        float l = 0.0f;
        for (uint32_t c = lane; c < n_chunks; c += WARP) {
            const float e = expf(__fsub_rn(__ldcg(pm + (c * group + g) * 2), m));
            scale[c * ATTN_MAX_GROUP + g] = e;
            l = fmaf(__ldcg(pm + (c * group + g) * 2 + 1), e, l);
        }
        l = warp_reduce(l, Add{});
        // Each lane rescales only the entries it wrote itself: no synchronisation needed.
        for (uint32_t c = lane; c < n_chunks; c += WARP) scale[c * ATTN_MAX_GROUP + g] = __fdiv_rn(scale[c * ATTN_MAX_GROUP + g], l);
    }
    __syncthreads();  // every chunk's scale is in shared memory
    for (uint32_t i = t; i < group * hd; i += THREADS) {
        const uint32_t g = i / hd;
        float o = 0.0f;
#pragma unroll 8
        for (uint32_t c = 0; c < n_chunks; ++c) o = fmaf(__ldcg(po + (size_t)c * group * hd + i), scale[c * ATTN_MAX_GROUP + g], o);
        a_out[(size_t)kv * group * hd + i] = __float2bfloat16_rn(o);
    }
    // Every chunk of this head has arrived: reset for the next step (the launch boundary, or the
    // next grid barrier, orders it before any later arrival).
    if (t == 0) counters[kv] = 0;
}

// Attention: work item (KV head, chunk of ATTN_CHUNK slots) -> partial softmax numerator and its
// running max and sum for each query head of the group; the block that finishes a KV head's last
// chunk combines that head's partials into a.
__device__ void phase_attention(const int64_t* op, uint32_t pos, uint4* ring) {
    const bf16* q = reinterpret_cast<const bf16*>(op[attn::Q]);
    const bf16* k_cache = reinterpret_cast<const bf16*>(op[attn::KCache]);
    const bf16* v_cache = reinterpret_cast<const bf16*>(op[attn::VCache]);
    float* part_o = reinterpret_cast<float*>(op[attn::PartO]);
    float* part_ml = reinterpret_cast<float*>(op[attn::PartMl]);
    unsigned* counters = reinterpret_cast<unsigned*>(op[attn::Counters]);
    bf16* a_out = reinterpret_cast<bf16*>(op[attn::AOut]);
    const uint32_t n_q = (uint32_t)op[attn::NQ], n_kv = (uint32_t)op[attn::NKv], hd = (uint32_t)op[attn::Hd];
    const uint32_t max_seq = (uint32_t)op[attn::MaxSeq], group = n_q / n_kv;
    const uint32_t n_chunks = (pos + ATTN_CHUNK) / ATTN_CHUNK, max_chunks = (max_seq + ATTN_CHUNK - 1) / ATTN_CHUNK;
    const float inv_sqrt_hd = __fdiv_rn(1.0f, __fsqrt_rn((float)hd));
    const uint32_t t = threadIdx.x, lane = t % WARP, warp = t / WARP;

    bf16* ks = reinterpret_cast<bf16*>(ring);                 // (ATTN_CHUNK, hd)
    bf16* vs = ks + ATTN_CHUNK * ATTN_MAX_HD;                  // (ATTN_CHUNK, hd)
    float* qs = reinterpret_cast<float*>(vs + ATTN_CHUNK * ATTN_MAX_HD);  // (group, hd)
    float* ps = qs + ATTN_MAX_GROUP * ATTN_MAX_HD;             // (group, ATTN_CHUNK)
    __shared__ bool last;

    for (uint32_t item = blockIdx.x; item < n_kv * n_chunks; item += gridDim.x) {
        const uint32_t kv = item / n_chunks, c = item % n_chunks, first = c * ATTN_CHUNK;
        const uint32_t len = min(ATTN_CHUNK, pos + 1 - first);
        const size_t base = ((size_t)kv * max_seq + first) * hd;
#pragma unroll 4
        for (uint32_t i = t; i < len * hd / VEC; i += THREADS) {
            reinterpret_cast<uint4*>(ks)[i] = load_cg(k_cache + base, i);
            reinterpret_cast<uint4*>(vs)[i] = load_cg(v_cache + base, i);
        }
        for (uint32_t i = t; i < group * hd; i += THREADS) qs[i] = __bfloat162float(__ldcg(q + (size_t)kv * group * hd + i));
        __syncthreads();  // the chunk and the queries are in shared memory

        // Scores: one warp per (query head, slot), lanes over the head dimension.
        for (uint32_t i = warp; i < group * len; i += WARPS) {
            const uint32_t g = i / len, j = i % len;
            float acc = 0.0f;
            for (uint32_t e = lane; e < hd; e += WARP) acc = fmaf(qs[g * hd + e], __bfloat162float(ks[j * hd + e]), acc);
            acc = warp_reduce(acc, Add{});
            if (lane == 0) ps[g * ATTN_CHUNK + j] = __fmul_rn(acc, inv_sqrt_hd);
        }
        __syncthreads();  // every score is in ps

        // Partial softmax of each query head over the chunk: warp g.
        float* ml = part_ml + (((size_t)kv * max_chunks + c) * group) * 2;
        for (uint32_t g = warp; g < group; g += WARPS) {
            float m = -CUDART_INF_F;
            for (uint32_t j = lane; j < len; j += WARP) m = fmaxf(m, ps[g * ATTN_CHUNK + j]);
            m = warp_reduce(m, Max{});
            float l = 0.0f;
            for (uint32_t j = lane; j < len; j += WARP) {
                const float e = expf(__fsub_rn(ps[g * ATTN_CHUNK + j], m));
                ps[g * ATTN_CHUNK + j] = e;
                l += e;
            }
            l = warp_reduce(l, Add{});
            if (lane == 0) {
                ml[g * 2] = m;
                ml[g * 2 + 1] = l;
            }
        }
        __syncthreads();  // the exponentials are in ps

        // Partial numerator: thread per (query head, column), slots in order.
        float* po = part_o + (((size_t)kv * max_chunks + c) * group) * hd;
        for (uint32_t i = t; i < group * hd; i += THREADS) {
            const uint32_t g = i / hd, e = i % hd;
            float acc = 0.0f;
            for (uint32_t j = 0; j < len; ++j) acc = fmaf(ps[g * ATTN_CHUNK + j], __bfloat162float(vs[j * hd + e]), acc);
            po[i] = acc;
        }
        __syncthreads();  // all of this block's partials are written (and shared memory is free again)

        if (t == 0) {
            // Release the partials device-wide before counting this chunk in.
            __threadfence();
            last = atomicAdd(&counters[kv], 1u) == n_chunks - 1;
        }
        __syncthreads();  // every thread sees `last`
        if (last) combine(kv, n_chunks, max_chunks, group, hd, counters, part_o, part_ml, a_out, ps);
    }
}

// x1 = x + Wo a.
__device__ void phase_oproj(const int64_t* op, const bf16* x, uint4* ring, Partials part) {
    const uint32_t rows = (uint32_t)op[oproj::Rows], cols = (uint32_t)op[oproj::Cols];
    bf16* x1 = reinterpret_cast<bf16*>(op[oproj::X1Out]);
    const Slice s = load_slice(reinterpret_cast<const bf16*>(op[oproj::A]), cols);
    uint32_t r0, r1;
    block_rows(rows, r0, r1);
    gemv_rows(reinterpret_cast<const bf16*>(op[oproj::W]), s, r0, r1, ring, part);
    for (uint32_t r = threadIdx.x; r < r1 - r0; r += THREADS) {
        x1[r0 + r] = add_round(__bfloat162float(x[r0 + r]), bf(row_sum(part.red, r)));
    }
}

// h2 = rmsnorm(x1); act = silu(Wg h2) * (Wu h2) over gate/up-interleaved rows.
__device__ void phase_gateup(const int64_t* op, uint4* ring, Partials part) {
    const uint32_t d = (uint32_t)op[gateup::D], ffn = (uint32_t)op[gateup::Ffn];
    const float eps = __int_as_float((int)op[gateup::EpsBits]);
    bf16* act = reinterpret_cast<bf16*>(op[gateup::ActOut]);
    const Slice s = rmsnorm_slice(reinterpret_cast<const bf16*>(op[gateup::X1]), reinterpret_cast<const bf16*>(op[gateup::Norm]), d, eps);
    uint32_t r0, r1;
    block_rows(2 * ffn, r0, r1);
    gemv_rows(reinterpret_cast<const bf16*>(op[gateup::W]), s, r0, r1, ring, part);
    for (uint32_t p = threadIdx.x; p < (r1 - r0) / 2; p += THREADS) {
        act[r0 / 2 + p] = silu_mul(bf(row_sum(part.red, 2 * p)), bf(row_sum(part.red, 2 * p + 1)));
    }
}

// out = x1 + Wd act.
__device__ void phase_down(const int64_t* op, bf16* out, uint4* ring, Partials part) {
    const uint32_t rows = (uint32_t)op[down::Rows], cols = (uint32_t)op[down::Cols];
    const bf16* x1 = reinterpret_cast<const bf16*>(op[down::X1]);
    const Slice s = load_slice(reinterpret_cast<const bf16*>(op[down::Act]), cols);
    uint32_t r0, r1;
    block_rows(rows, r0, r1);
    gemv_rows(reinterpret_cast<const bf16*>(op[down::W]), s, r0, r1, ring, part);
    for (uint32_t r = threadIdx.x; r < r1 - r0; r += THREADS) {
        out[r0 + r] = add_round(__bfloat162float(__ldcg(x1 + r0 + r)), bf(row_sum(part.red, r)));
    }
}

// ---------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------

// Runs phases [phase_begin, phase_end) of the program, with a grid barrier between consecutive
// phases. The grid must be co-resident (the launcher uses a cooperative launch). Dynamic shared
// memory: RING_BYTES of ring, then red_rows * WARPS floats of row partials.
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_bf16(
    const int64_t* __restrict__ program,  // (phases, PROGRAM_ROW_WORDS)
    uint32_t phase_begin, uint32_t phase_end,
    const bf16* __restrict__ x,  // (d)
    bf16* __restrict__ out,      // (d)
    uint32_t pos,
    unsigned* __restrict__ barrier,  // (1) monotonic arrival counter
    unsigned barrier_base,           // its value when this launch started
    uint32_t red_rows) {
    extern __shared__ uint4 smem[];
    uint4* ring = smem;                                                  // (RING_BYTES / 16)
    const Partials part{reinterpret_cast<float*>(smem + RING_BYTES / 16), red_rows};  // (red_rows, WARPS)
    if (blockDim.x != THREADS) __trap();
    for (uint32_t p = phase_begin; p < phase_end; ++p) {
        const int64_t* op = program + (size_t)p * PROGRAM_ROW_WORDS;
        switch (op[0]) {
            case OP_NOP: break;
            case OP_QKV: phase_qkv(op, x, pos, ring, part); break;
            case OP_ATTENTION: phase_attention(op, pos, ring); break;
            case OP_O_PROJ: phase_oproj(op, x, ring, part); break;
            case OP_GATE_UP: phase_gateup(op, ring, part); break;
            case OP_DOWN: phase_down(op, out, ring, part); break;
            default: __trap();  // an unknown opcode is a broken program
        }
        if (p + 1 < phase_end) grid_barrier(barrier, barrier_base + (p - phase_begin + 1) * gridDim.x);
    }
}

// dst row r = the row at src_rows[r]: packs weights into the layouts the phases stream.
extern "C" __global__ void gather_rows_u4(uint4* __restrict__ dst,  // (rows, vecs)
                                          const uint64_t* __restrict__ src_rows,  // (rows) addresses
                                          uint32_t rows, uint32_t vecs) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (uint64_t)rows * vecs; i += (uint64_t)gridDim.x * blockDim.x) {
        dst[i] = reinterpret_cast<const uint4*>(src_rows[i / vecs])[i % vecs];
    }
}
