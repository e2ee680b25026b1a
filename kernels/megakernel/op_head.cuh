// Task kind Head (a model's): the final norm, the LM head's logits and each block's best row, then the
// greedy token every block takes.
#pragma once
#include "vm_run.cuh"

// End-of-sequence tokens a model launch stops at, at most.
constexpr uint32_t MODEL_MAX_EOS = 4;
// A model launch's own arguments, beside the stack's program (mirrored by ModelArgs in
// megakernel/src/model/gpu.rs; MODEL_ARGS_BYTES checks the layout on both sides).
struct ModelArgs {
    const bf16* embed;       // (vocab, d)
    const bf16* final_norm;  // (d)
    const bf16* head;        // (vocab, d): the LM head (the embedding itself when tied)
    float* logits;           // (vocab): those of the launch's last position
    uint64_t* candidates;    // (gridDim.x): each block's best row of the last head phase, as logit_key
    int32_t* tokens;         // (max_seq + 1): position p's token, given below prompt_end, generated from there
    uint32_t* done;          // (2): positions this launch ran, tokens it generated
    uint32_t vocab;
    uint32_t pos0;        // the launch's first position
    uint32_t prompt_end;  // positions before it have their tokens given; the head runs from prompt_end - 1
    uint32_t max_new;     // tokens to generate at most (at least 1)
    uint32_t max_seq;     // the caches' positions
    uint32_t heads_before;  // head phases of the launches before (the head's counter: HEAD_COUNTER)
    uint32_t eps_bits;    // the final norm's epsilon, as f32 bits
    uint32_t eos_count;
    uint32_t eos[MODEL_MAX_EOS];
    // Qwen3: each layer's q and k norm weights (hd each, one after the other); null without them.
    const bf16* qk_norms[PROGRAM_MAX_LAYERS];
};
constexpr uint32_t MODEL_ARGS_BYTES = 7 * 8 + 12 * 4 + PROGRAM_MAX_LAYERS * 8;
static_assert(sizeof(ModelArgs) == MODEL_ARGS_BYTES, "ModelArgs must have the layout megakernel/src/model/gpu.rs gives it");

// The head phase's counter, after the layer's rows' counters (phase_done holds PROGRAM_MAX_PHASES + 1).
constexpr uint32_t HEAD_COUNTER = PROGRAM_MAX_PHASES;

// Row `row`'s logit as a key that orders as the greedy choice does: the larger logit first, then the
// lower row (its complement in the low word); NaN is 0, below every other key, so never chosen while a
// number is there. -0 counts as +0, as the CPU's comparison has them equal.
__device__ inline uint64_t logit_key(float v, uint32_t row) {
    if (isnan(v)) return 0;
    uint32_t bits = __float_as_uint(v == 0.0f ? 0.0f : v);
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // IEEE order as unsigned order
    return ((uint64_t)bits << 32) | (UINT32_MAX - row);
}

__device__ inline uint64_t warp_max_u64(uint64_t v) {
    for (uint32_t offset = WARP / 2; offset > 0; offset /= 2) v = max(v, (uint64_t)__shfl_xor_sync(FULL_MASK, (unsigned long long)v, offset));
    return v;
}

// The largest of the block's keys, in every thread.
__device__ inline uint64_t block_max_u64(uint64_t v) {
    __shared__ uint64_t warp_best[WARPS];
    v = warp_max_u64(v);
    if (threadIdx.x % WARP == 0) warp_best[threadIdx.x / WARP] = v;
    __syncthreads();  // every warp's best is in shared memory
    v = warp_best[0];
    for (uint32_t w = 1; w < WARPS; ++w) v = max(v, warp_best[w]);
    __syncthreads();  // every thread has read them before a later call overwrites them
    return v;
}

// This block's rows of the LM head: an even share of the vocabulary, in single rows, over the grid.
__device__ inline void head_rows(uint32_t vocab, uint32_t& r0, uint32_t& r1) {
    r0 = (uint32_t)((uint64_t)vocab * blockIdx.x / gridDim.x);
    r1 = (uint32_t)((uint64_t)vocab * (blockIdx.x + 1) / gridDim.x);
}

// Head rows a decode step streams together as one row of `bundle` times d columns, in the instance for
// narrow rows (SLICED): where a row of d is a power of two of 16-byte vectors, at least a warp's and
// under the block's, run() on its own leaves the threads past the row without columns and fills each
// stage only to that fraction. Bundled, thread t takes row t / vecs of the bundle, its columns those of
// thread t % vecs, and row j's warp partials are warps [j WARPS / bundle, (j + 1) WARPS / bundle):
// each the partial that warp w % (WARPS / bundle) has for that row alone (head_logits adds them so
// that each logit keeps its bits). Llama-3.2-1B's 525 MB head went from 196 us (2.7 TB/s, 32 KB in
// each of two stages in flight) to 131 us, its decode step 6.6% faster (docs/perf.md, "The head in
// bundles"). 1 elsewhere, and where the vocabulary does not divide.
template <bool SLICED>
__device__ inline uint32_t head_bundle(const ModelArgs& m, uint32_t d) {
    const uint32_t vecs = d / VEC;
    if (!SLICED || vecs < WARP || vecs >= THREADS || (vecs & (vecs - 1)) != 0) return 1;
    const uint32_t bundle = THREADS / vecs;
    return m.vocab % bundle == 0 ? bundle : 1;
}

// Starts streaming the head's rows [r0, r1) (at most the partials' rows) of `cols` columns into the
// ring, for run() or for run_group (`group`, RowStream's).
__device__ inline void prime_head_rows(const ModelArgs& m, uint32_t cols, const Ring& ring, uint32_t r0, uint32_t r1, bool group = false) {
    with_stream(m.head, cols, r0, r1, false, [&](auto stream) { stream.prime(ring); }, group);
}

// The head's first weights, before the head waits for the last layer: a decode step's (phase_head) in
// bundles, or a batch step's (`group`: head_lanes's streams).
template <bool SLICED>
__device__ inline void prime_head(const ModelArgs& m, uint32_t d, const Ring& ring, uint32_t chunk_rows, bool group = false) {
    const uint32_t bundle = group ? 1 : head_bundle<SLICED>(m, d);
    uint32_t r0, r1;
    head_rows(m.vocab / bundle, r0, r1);
    prime_head_rows(m, bundle * d, ring, r0, min(r0 + chunk_rows, r1), group);
}

// This block's rows of the LM head as one group-of-one stream (phase_head_solo).
__device__ inline RowStream<1> head_solo_stream(const ModelArgs& m, uint32_t d) {
    uint32_t r0, r1;
    head_rows(m.vocab, r0, r1);
    return group_stream<1>(m.head, d / VEC, r0, r1, false);
}

// The logits of head rows [c0, c1) from their sums in `part` (each row's warp partials in warp order),
// into m.logits, and the best of them and `best` (logit_key). Rows of `bundle` (head_bundle) share a
// row of the partials, row j of them its WARPS / bundle warps; the warps past them, which in run() of
// that row alone add +0.0, are one +0.0 here (the same bits: only -0.0 changes, to +0.0, and once).
__device__ inline uint64_t head_logits(const ModelArgs& m, const Partials& part, uint32_t c0, uint32_t c1, uint64_t best, uint32_t bundle = 1) {
    // bundle is a power of two: its quotients are shifts.
    const uint32_t lg = 31 - __clz(bundle), warps = WARPS >> lg;
    for (uint32_t r = threadIdx.x; r < (c1 - c0) << lg; r += THREADS) {
        const float* red = part.red + (size_t)(r >> lg) * WARPS + (r & (bundle - 1)) * warps;
        float v = red[0];
        for (uint32_t w = 1; w < warps; ++w) v += red[w];
        if (bundle > 1) v += 0.0f;
        m.logits[(c0 << lg) + r] = v;
        best = max(best, logit_key(v, (c0 << lg) + r));
    }
    return best;
}

// logits = head rmsnorm(y, final_norm) over this block's rows, f32 (each row's warp partials summed in
// warp order), and the block's best row to its candidate slot. The rows go through the partials
// `part.rows` at a time (bundles of head_bundle rows); the next chunk's first stages stream while this
// one's logits are summed.
template <bool SLICED>
__device__ void phase_head(const ModelArgs& m, const bf16* y, uint32_t d, Ring& ring, Partials part) {
    const uint32_t bundle = head_bundle<SLICED>(m, d);
    // Thread t's columns in a bundle are thread t % (THREADS / bundle)'s of one row.
    const uint32_t t = bundle == 1 ? threadIdx.x : threadIdx.x & (THREADS / bundle - 1);
    const Slice s = rmsnorm_slice(y, m.final_norm, d, __int_as_float((int)m.eps_bits), t);
    uint32_t r0, r1;
    head_rows(m.vocab / bundle, r0, r1);
    uint64_t best = 0;
    for (uint32_t c0 = r0; c0 < r1; c0 += part.rows) {
        const uint32_t c1 = min(c0 + part.rows, r1);
        with_stream(m.head, bundle * d, c0, c1, false, [&](auto stream) { stream.run(s, ring, part); });
        // The ring is free: run ended on a __syncthreads after its last read of it.
        if (c1 < r1) prime_head_rows(m, bundle * d, ring, c1, min(c1 + part.rows, r1));
        // The next chunk's run starts with a __syncthreads before it writes red, so these reads of it
        // come first.
        best = head_logits(m, part, c0, c1, best, bundle);
    }
    best = block_max_u64(best);
    if (threadIdx.x == 0) m.candidates[blockIdx.x] = best;
}

// phase_head where rows of d run in slices, in the model kernel's instance for q/k norms: the rows
// stream as a group of one in full stages (solo_group, each logit's bits run()'s), in chunks the
// partials hold, SOLO_PRIMED stages primed before the wait (prime_solo of head_solo_stream). In one
// slice a stage of Qwen3-0.6B's head holds 16 KB, two of them in flight, and the head streams well
// under the copy rate: this made Qwen3-0.6B 8% faster. In the instance for narrow rows its code
// (inlined or called) moved ptxas's allocation of the rest to 88 bytes of spills, which cost
// TinyLlama-1.1B 5.5% and left Llama-3.2-1B, whose head is 4x larger, 1.7% faster (docs/perf.md,
// "The head in full stages"): that instance streams its head in bundles (head_bundle) instead.
__device__ void phase_head_solo(const ModelArgs& m, const bf16* y, uint32_t d, Ring& ring, Partials part) {
    const Slice s = rmsnorm_slice(y, m.final_norm, d, __int_as_float((int)m.eps_bits), column_thread(d));
    const RowStream<1> all = head_solo_stream(m, d);
    start_solo(all, ring);
    uint64_t best = 0;
    solo_group(all, s, part.rows, ring, part, [&](uint32_t, const Partials& p, uint32_t c0, uint32_t c1) { best = head_logits(m, p, c0, c1, best); });
    best = block_max_u64(best);
    if (threadIdx.x == 0) m.candidates[blockIdx.x] = best;
}

// The greedy token: every block waits until every block has counted its `heads`-th head phase, then
// reduces the grid's candidates itself (the maximum of the keys, which is order-free), so that every
// block takes the same token without a second wait. -1 when every logit was NaN.
__device__ inline int32_t next_token(const ModelArgs& m, const unsigned* phase_done, uint32_t heads) {
    __shared__ uint64_t chosen;
    if (threadIdx.x == 0) {
        // Acquire: the candidates are read only after every block's count was seen.
        while ((int)(ld_acquire(&phase_done[HEAD_COUNTER]) - gridDim.x * heads) < 0) __nanosleep(64);
    }
    __syncthreads();  // the rest of the block waits for thread 0 to see every count
    if (threadIdx.x < WARP) {
        uint64_t best = 0;
        for (uint32_t b = threadIdx.x; b < gridDim.x; b += WARP) best = max(best, (uint64_t)__ldcg(reinterpret_cast<const unsigned long long*>(m.candidates) + b));
        best = warp_max_u64(best);
        if (threadIdx.x == 0) chosen = best;
    }
    __syncthreads();  // `chosen` is written; the next call writes it only after its own first __syncthreads
    const uint64_t best = chosen;
    return best == 0 ? -1 : (int32_t)(UINT32_MAX - (uint32_t)best);
}
