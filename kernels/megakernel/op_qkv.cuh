// Task kind Qkv: h = rmsnorm(x); [q|k|v] = W h over RoPE-pair-interleaved rows; rope q and k; append k
// and v to the caches at pos (phase_qkv); with Qwen3's per-head q/k norms, phase_qkv_normed.
#pragma once
#include "vm_gemv.cuh"

// Where a Qkv phase's epilogue writes for position pos (the lane's q and its sequence's caches), and
// the rows of cos and sin it rotates by; resolved before the stream, as the phase's first loads.
struct QkvOut {
    bf16 *q, *k_cache, *v_cache;
    const float *cos_row, *sin_row;
};
__device__ inline QkvOut qkv_out(const OpRow& op, uint32_t pos) {
    const uint32_t half = (uint32_t)op[qkv::Hd] / 2;
    return {act_ptr<bf16>(op, qkv::QOut), cache_ptr<bf16>(op, qkv::KCache), cache_ptr<bf16>(op, qkv::VCache),
            reinterpret_cast<const float*>(op[qkv::Cos]) + (size_t)pos * half, reinterpret_cast<const float*>(op[qkv::Sin]) + (size_t)pos * half};
}

// The RoPE factors of this thread's first pair of a Qkv phase's rows [r0, r1), loaded before the
// stream (see preload); zero for a thread without pairs or whose first pair is v's.
struct RopeFirst {
    float cos, sin;
};
__device__ inline RopeFirst rope_first(const OpRow& op, const QkvOut& out, uint32_t r0, uint32_t r1) {
    const uint32_t half = (uint32_t)op[qkv::Hd] / 2, q_pairs = (uint32_t)op[qkv::NQ] * half, k_pairs = (uint32_t)op[qkv::NKv] * half;
    const auto rope_index = [&](uint32_t gp) { return (gp < q_pairs ? gp : gp - q_pairs) % half; };
    RopeFirst first{0.0f, 0.0f};
    if (threadIdx.x < (r1 - r0) / 2 && r0 / 2 + threadIdx.x < q_pairs + k_pairs) {
        first.cos = out.cos_row[rope_index(r0 / 2 + threadIdx.x)];
        first.sin = out.sin_row[rope_index(r0 / 2 + threadIdx.x)];
    }
    return first;
}

// The end of a Qkv phase: the sums of rows [r0, r1) in `part`, pair p of the packed matrix being
// (row i, row i + hd/2) of one head (q heads, then k, then v): q's pairs rotated into q, k's rotated
// into the K cache at pos, v's stored into the V cache at pos.
__device__ inline void qkv_epilogue(const OpRow& op, uint32_t pos, const QkvOut& out, const Partials& part, uint32_t r0, uint32_t r1, RopeFirst first) {
    const uint32_t hd = (uint32_t)op[qkv::Hd], max_seq = (uint32_t)op[qkv::MaxSeq], half = hd / 2;
    const uint32_t q_pairs = (uint32_t)op[qkv::NQ] * half, k_pairs = (uint32_t)op[qkv::NKv] * half;
    for (uint32_t p = threadIdx.x; p < (r1 - r0) / 2; p += THREADS) {
        const uint32_t gp = r0 / 2 + p;
        const float a = bf(row_sum(part.red, 2 * p)), b = bf(row_sum(part.red, 2 * p + 1));
        if (gp < q_pairs + k_pairs) {
            const bool is_q = gp < q_pairs;
            const uint32_t j = is_q ? gp : gp - q_pairs, head = j / half, i = j % half;
            bf16* dst = is_q ? out.q + (size_t)head * hd : out.k_cache + ((size_t)head * max_seq + pos) * hd;
            const bool at_first = p == threadIdx.x;
            rope_pair(a, b, at_first ? first.cos : out.cos_row[i], at_first ? first.sin : out.sin_row[i], &dst[i], &dst[i + half]);
        } else {
            const uint32_t j = gp - q_pairs - k_pairs, head = j / half, i = j % half;
            bf16* dst = out.v_cache + ((size_t)head * max_seq + pos) * hd;
            dst[i] = __float2bfloat16_rn(a);
            dst[i + half] = __float2bfloat16_rn(b);
        }
    }
}

// h = rmsnorm(x); [q|k|v] = W h over pair-interleaved rows; rope q and k; append k and v at pos.
template <bool SLICED, bool TRACED = false, uint32_t CODES = BF16_ROWS>
__device__ __forceinline__ void phase_qkv(const OpRow& op, const bf16* x, uint32_t pos, Ring& ring, Partials part) {
    const uint32_t d = (uint32_t)op[qkv::D];
    const float eps = __int_as_float((int)op[qkv::EpsBits]);
    const QkvOut out = qkv_out(op, pos);
    uint32_t r0, r1;
    gemv_rows<CODES, SLICED>(op, r0, r1);
    const RopeFirst first = rope_first(op, out, r0, r1);
    const bf16* g = reinterpret_cast<const bf16*>(layer_address(op, qkv::Norm));
    stream_phase<SLICED, TRACED, CODES>(op, [&](uint32_t t) { return rmsnorm_input<SLICED>(x, g, d, eps, t); }, ring, part, r0, r1);
    qkv_epilogue(op, pos, out, part, r0, r1, first);
}

// The end of phase_qkv_normed: the sums of rows [r0, r1) in `part`, the ring's shared memory as
// scratch (the stream is done).
__device__ void qkv_normed_epilogue(const OpRow& op, uint32_t pos, const Ring& ring, const Partials& part, const bf16* norms, uint32_t r0, uint32_t r1) {
    const uint32_t hd = (uint32_t)op[qkv::Hd], half = hd / 2, max_seq = (uint32_t)op[qkv::MaxSeq], n = r1 - r0;
    const uint32_t q_pairs = (uint32_t)op[qkv::NQ] * half, k_pairs = (uint32_t)op[qkv::NKv] * half;
    const uint32_t warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    float* vals = reinterpret_cast<float*>(ring.data);  // (n): pair p's values at 2p and 2p + 1
    float* inv = vals + n;                              // (n / hd): each head's inverse root
    for (uint32_t r = threadIdx.x; r < n; r += THREADS) vals[r] = bf(row_sum(part.red, r));
    __syncthreads();  // every value is in shared memory
    for (uint32_t h = warp; h < n / hd; h += WARPS) {
        float sum = 0.0f;
        for (uint32_t j = lane; j < hd; j += WARP) sum = fmaf(vals[h * hd + j], vals[h * hd + j], sum);
        sum = warp_reduce(sum, Add{});
        if (lane == 0) inv[h] = inv_rms(__fdiv_rn(sum, (float)hd), __int_as_float((int)op[qkv::EpsBits]));
    }
    __syncthreads();  // every head's inverse root is in shared memory
    const float* cos_row = reinterpret_cast<const float*>(op[qkv::Cos]) + (size_t)pos * half;
    const float* sin_row = reinterpret_cast<const float*>(op[qkv::Sin]) + (size_t)pos * half;
    for (uint32_t p = threadIdx.x; p < n / 2; p += THREADS) {
        const uint32_t gp = r0 / 2 + p;
        const float a = vals[2 * p], b = vals[2 * p + 1];
        if (gp >= q_pairs + k_pairs) {
            const uint32_t j = gp - q_pairs - k_pairs, head = j / half, i = j % half;
            bf16* dst = cache_ptr<bf16>(op, qkv::VCache) + ((size_t)head * max_seq + pos) * hd;
            dst[i] = __float2bfloat16_rn(a);
            dst[i + half] = __float2bfloat16_rn(b);
            continue;
        }
        const bool is_q = gp < q_pairs;
        const uint32_t j = is_q ? gp : gp - q_pairs, head = j / half, i = j % half;
        const bf16* g = norms + (is_q ? 0 : hd);
        const float r = inv[p / half];  // the block's heads start at its first row
        bf16* dst = is_q ? act_ptr<bf16>(op, qkv::QOut) + (size_t)head * hd : cache_ptr<bf16>(op, qkv::KCache) + ((size_t)head * max_seq + pos) * hd;
        rope_pair(__bfloat162float(rms_scale(a, r, __bfloat162float(g[i]))), __bfloat162float(rms_scale(b, r, __bfloat162float(g[i + half]))),
                  cos_row[i], sin_row[i], &dst[i], &dst[i + half]);
    }
}

// Qkv of a layer with Qwen3's per-head q/k norms (`norms`: q's hd weights, then k's): as phase_qkv,
// each block with whole heads (qkv_unit), q's and k's heads normalised before RoPE. The row sums as
// rounded and each head's inverse root go to the ring's shared memory (free: the stream is done); each
// pair is then scaled as the layer's norms scale (rms_scale) and rotated; v's heads are stored as they
// are. Everything after the stream is read again from the row, so that no register holds it across.
// Where the rows run in slices (at most 2048 columns) they stream as a group of one in full stages
// (solo_group), two of them primed: the phase runs on the few blocks that hold whole heads (32 of 132
// at Qwen3-0.6B), each streaming many stages, and the bytes a stage holds limit how fast (16 KB at d
// 1024 in one slice, 64 KB in four).
template <bool TRACED = false>
__device__ __forceinline__ void phase_qkv_normed(const OpRow& op, const bf16* x, uint32_t pos, Ring& ring, Partials part, const bf16* norms) {
    uint32_t r0, r1;
    gemv_rows(op, r0, r1, norms);
    const uint32_t d = (uint32_t)op[qkv::D];
    const float eps = __int_as_float((int)op[qkv::EpsBits]);
    const bf16* g = reinterpret_cast<const bf16*>(layer_address(op, qkv::Norm));
    const auto epilogue = [&](uint32_t, const Partials& p, uint32_t c0, uint32_t c1) {
        if (TRACED) stamp(TRACE_STREAMED);
        qkv_normed_epilogue(op, pos, ring, p, norms, c0, c1);
    };
    if (!in_slices(d)) {
        gemv_phase(op, rmsnorm_slice(x, g, d, eps), ring, part, r0, r1);
        epilogue(0, part, r0, r1);
        return;
    }
    // Each thread holds the vectors of the thread whose columns it takes.
    const Slice s = rmsnorm_one(x, g, d, eps, column_thread(d));
    if (TRACED) stamp_input(s);
    Gemv w;
    if (!gemv_of(op, w)) __trap();
    solo_group(group_stream<1>(w.w, d / VEC, r0, r1, w.in_place), s, r1 - r0, ring, part, epilogue);
}
