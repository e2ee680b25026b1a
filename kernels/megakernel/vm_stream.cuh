// The weight stream: a block's rows of a GEMV through its ring of shared-memory stages, each filled by
// a bulk copy, the input vector in registers (RowStream::run), or several input vectors against the
// same rows, each with the bits it has alone (run_group, for batch steps and chunked prefill).
#pragma once
#include <cuda_fp8.h>

#include "vm_config.cuh"
#include "vm_deps.cuh"

// The input vector of a GEMV as this thread holds it: h[v] is 16-byte vector t + v * THREADS.
struct Slice {
    uint4 h[MAX_VPT];
    uint32_t vecs;  // 16-byte vectors per row
    uint32_t vpt;   // vectors per thread, ceil(vecs / THREADS)
};

// Whether thread t's v-th vector of the slice is in the row.
__device__ inline bool owns(const Slice& s, uint32_t v, uint32_t t = threadIdx.x) { return t + v * THREADS < s.vecs; }

// This block's rows of a GEMV with `rows` rows run by `set`: an even share, in whole units of `unit`
// rows (pairs; or a Qkv phase's whole heads where the layer has q/k norms, qkv_unit).
// A division by a value known only at run time is a chain of some twenty dependent instructions, a
// 64-bit one a subroutine of hundreds of cycles, and a phase ran several before its first load: so 32
// bits where the products fit, and shifts for the slices' powers of two below (docs/perf.md, "The
// chain alone, and the index arithmetic").
__device__ inline void block_rows(uint32_t rows, const BlockSet& set, uint32_t& r0, uint32_t& r1, uint32_t unit) {
    const uint32_t units = rows / unit, i = rank(set);
    if (units <= UINT32_MAX / set.count) {
        r0 = unit * (units * i / set.count);
        r1 = unit * (units * (i + 1) / set.count);
        return;
    }
    r0 = unit * (uint32_t)((uint64_t)units * i / set.count);
    r1 = unit * (uint32_t)((uint64_t)units * (i + 1) / set.count);
}

// Where a GEMV phase keeps its row partials: red_rows rows of WARPS floats after the ring.
struct Partials {
    float* red;
    uint32_t rows;
};

// Stages a stream keeps in flight ahead of the one in use: STAGES - 1, or what a translation unit
// defines as RING_IN_FLIGHT before the headers (the batch steps' files, model_batch.cu,
// model_fp8_batch.cu and model_nf4_batch.cu: 1). With fewer, a stage's copy is issued when the one
// before lands, not when a slot frees: one 64 KB stage per SM already moves HBM at its rate, and
// every byte in flight past it lengthens each L2 hit and hand-off of every SM (docs/perf.md, "What
// bytes in flight do to a hop"). A batch stage takes longer to sum than to land, so one ahead feeds
// it; a decode step's stream of a few stages a block would pay a round trip a stage, so it keeps
// two ("One stage in flight, run").
#ifdef RING_IN_FLIGHT
constexpr uint32_t IN_FLIGHT = RING_IN_FLIGHT;
#else
constexpr uint32_t IN_FLIGHT = STAGES - 1;
#endif
static_assert(IN_FLIGHT >= 1 && IN_FLIGHT <= STAGES - 1, "at least one stage ahead, at most the free slots");

// The ring: STAGES slots of STAGE_BYTES, each filled by one bulk copy that completes on the slot's
// mbarrier. `seq` counts the stages a launch has issued so far (the same in every thread): stage k
// uses slot k % STAGES and completes phase (k / STAGES) & 1 of that slot's barrier.
struct Ring {
    uint4* data;     // (STAGES, STAGE_BYTES / 16)
    uint64_t* full;  // (STAGES)
    uint32_t seq;
};

// Commits this thread's cp.async copies issued since the last commit as one group, and waits until at
// most `pending` of its groups are in flight (groups complete in order).
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <uint32_t PENDING>
__device__ inline void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

// Where a GEMV phase's weight rows come from. Packed: one matrix whose rows are in the order the phase
// computes them, a stage one bulk copy. In place (a stack too large for packed copies): Qkv's and
// GateUp's rows come in pairs, (i, i + hd/2) of a head or (gate r, up r), from the layout the contract
// hands over, where the two rows of a pair lie in different runs; a stage then holds its pairs' first
// rows and then their second rows, each run one bulk copy, and the GEMV's epilogue sees them in pair
// order as from a packed stage (RowStream::run). Thread 0 sets it when it primes a GEMV phase, before
// the phase's own stages; every thread reads `grouped` after the phase's wait (a __syncthreads).
constexpr uint32_t SOURCE_PACKED = 0;
constexpr uint32_t SOURCE_QKV = 1;      // base: Wq, Wk, Wv
constexpr uint32_t SOURCE_GATE_UP = 2;  // base: Wgate, Wup
struct RowSource {
    uint32_t kind;
    bool grouped;  // a stage holds its pairs' first rows, then their second rows
    const char* base[3];
    uint32_t q_pairs, kv_pairs, half;  // Qkv: pairs of the q heads, of the k (and v) heads; hd / 2
};
__shared__ RowSource row_source;

// Where packed row p (a pair's member p % 2) of the phase starts in the handed layout, rows of
// `row_bytes`.
__device__ inline const char* handed_row(const RowSource& src, uint32_t p, uint32_t row_bytes) {
    const uint32_t pair = p / 2, member = p % 2;
    if (src.kind == SOURCE_GATE_UP) return src.base[member] + (size_t)pair * row_bytes;
    // Qkv: q heads' pairs, then k's, then v's; pair j of a tensor is row (j / half) * hd + j % half of
    // its heads, and its second member half rows further (pack::qkv_source).
    const uint32_t t = pair < src.q_pairs ? 0 : pair < src.q_pairs + src.kv_pairs ? 1 : 2;
    const uint32_t j = pair - (t == 0 ? 0 : t == 1 ? src.q_pairs : src.q_pairs + src.kv_pairs);
    const uint32_t row = (j / src.half) * 2 * src.half + j % src.half + member * src.half;
    return src.base[t] + (size_t)row * row_bytes;
}

// Thread 0: copies stage rows [first, first + count) of an in-place source into `dst`, its pairs' first
// rows, then their second rows (one row when count is 1), one bulk copy per run of rows that lie
// next to each other in the source.
__device__ inline void gather_stage(const RowSource& src, uint4* dst, uint32_t first, uint32_t count, uint32_t row_bytes, uint64_t* bar) {
    const uint32_t pairs = count / 2, members = pairs == 0 ? 1 : 2, per_member = pairs == 0 ? 1 : pairs;
    const char* run = nullptr;
    char* run_dst = reinterpret_cast<char*>(dst);
    uint32_t run_bytes = 0;
    for (uint32_t m = 0; m < members; ++m) {
        for (uint32_t k = 0; k < per_member; ++k) {
            const char* row = handed_row(src, pairs == 0 ? first : first + 2 * k + m, row_bytes);
            if (run != nullptr && row == run + run_bytes) {
                run_bytes += row_bytes;
                continue;
            }
            if (run != nullptr) bulk_copy(run_dst, run, run_bytes, bar, l2_evict_first());
            run = row;
            run_dst = reinterpret_cast<char*>(dst) + (size_t)(m * per_member + k) * row_bytes;
            run_bytes = row_bytes;
        }
    }
    bulk_copy(run_dst, run, run_bytes, bar, l2_evict_first());
}

// The 8 bf16 of a 16-byte vector as f32, in order (as dot8 widens them).
__device__ inline void widen8(uint4 a, float (&f)[VEC]) {
    const bf162* x = reinterpret_cast<const bf162*>(&a);
#pragma unroll
    for (uint32_t j = 0; j < VEC / 2; ++j) {
        const float2 p = __bfloat1622float2(x[j]);
        f[2 * j] = p.x;
        f[2 * j + 1] = p.y;
    }
}

// The warp's sums of N values per lane (N a power of two up to WARP), each summed as warp_reduce sums
// one value: the same pairs at offsets 16, 8, ..., 1, so the same bits, in fewer shuffles than N
// butterflies. Lane l holds value k at v[k ^ scatter_mask<N>()]: at each of the first log2(N) offsets
// a lane keeps the lower half of its positions, adds its partner's copies of them (which the partner
// holds in its upper half, its mask differing in that bit) and hands over its upper half (N - 1
// shuffles); then one butterfly over the rest. Returns, in lanes [k WARP / N, (k + 1) WARP / N), the
// sum of value k.
template <uint32_t N>
__device__ inline uint32_t scatter_mask() { return threadIdx.x % WARP / (WARP / N); }
// The end of reduce_scatter and reduce_transposed, once each lane holds one of the N values: the
// butterfly over the offsets below WARP / N, warp_reduce's last log2(WARP / N) levels.
template <uint32_t N>
__device__ inline float finish_sums(float sum) {
    for (uint32_t offset = WARP / 2 / N; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, offset);
    return sum;
}
template <uint32_t N>
__device__ inline float reduce_scatter(float (&v)[N]) {
    static_assert(N >= 1 && N <= WARP && (N & (N - 1)) == 0, "a power of two of values per lane");
#pragma unroll
    for (uint32_t level = 1; level < N; level *= 2) {
        const uint32_t half = N / 2 / level, offset = WARP / 2 / level;
#pragma unroll
        for (uint32_t j = 0; j < half; ++j) v[j] += __shfl_xor_sync(FULL_MASK, v[j + half], offset);
    }
    return finish_sums<N>(v[0]);
}

// reduce_scatter for values in the same place in every lane (value k at v[k]): at each of the first
// log2(N) offsets a lane chooses by its bit of that offset which half it keeps and which it hands over
// (two selects a pair), so the same pairs are added in the same order, the same bits, in N - 1 +
// log2(WARP / N) shuffles. Lanes [k WARP / N, (k + 1) WARP / N) end with the sum of value k
// (scatter_mask<N>() == k). The values stay where the loads put them, so their addresses need no
// lane's permutation (which, in run_rows, cost registers that the model's instances spilled).
template <uint32_t N>
__device__ inline float reduce_transposed(float (&v)[N]) {
    static_assert(N >= 1 && N <= WARP && (N & (N - 1)) == 0, "a power of two of values per lane");
    const uint32_t lane = threadIdx.x % WARP;
#pragma unroll
    for (uint32_t level = 1; level < N; level *= 2) {
        const uint32_t half = N / 2 / level, offset = WARP / 2 / level;
        const bool upper = (lane & offset) != 0;
#pragma unroll
        for (uint32_t j = 0; j < half; ++j) {
            const float send = upper ? v[j] : v[j + half], keep = upper ? v[j + half] : v[j];
            v[j] = keep + __shfl_xor_sync(FULL_MASK, send, offset);
        }
    }
    return finish_sums<N>(v[0]);
}

// Slices of the block that run a group's stage side by side (RowStream::run_group), for rows of `vecs`
// 16-byte vectors: for rows of at most THREADS vectors, as many as leave each slice the warps a whole
// block would have with columns (a power of two); else one. The stage then holds that many times the
// rows, so that narrow rows fill it as wide ones do, and every warp has columns.
// Its log2 by bit operations: the count is a power of two, so a quotient by it is a shift (see block_rows).
__device__ inline uint32_t slices_log2(uint32_t vecs) {
    if (vecs > THREADS) return 0;
    const uint32_t need = (vecs + WARP - 1) / WARP;                    // warps with columns, at least
    const uint32_t warps_log2 = need <= 1 ? 0 : 32 - __clz(need - 1);  // the next power of two's
    return WARPS_LOG2 - warps_log2;
}
__device__ inline uint32_t row_slices(uint32_t vecs) { return 1u << slices_log2(vecs); }

// Whether rows of `cols` bf16 run in more than one slice (at most 2048 columns).
__device__ inline bool in_slices(uint32_t cols) { return row_slices(cols / VEC) > 1; }

// The thread whose columns this thread takes in a stream of rows of `cols` (row_slices): itself in the
// first slice, its counterpart there in the others.
__device__ inline uint32_t column_thread(uint32_t cols) { return threadIdx.x & ((THREADS >> slices_log2(cols / VEC)) - 1); }

// What a GEMV's rows hold for each 16-byte vector (8 columns) of x, by format: bf16 weights (16 bytes),
// e4m3 codes (8: the fp8 stream, run_codes) or nf4 codes (4: the nf4 stream). A kernel instance's CODES
// names the format its wide rows stream in (BF16_ROWS: none but bf16).
constexpr uint32_t BF16_ROWS = 16;
constexpr uint32_t E4M3_CODES = 8;
constexpr uint32_t NF4_CODES = 4;

// The fp8 stream's scales: one f32 for each FP8_SCALE_COLS columns of a packed row (the checkpoint's
// blocks of 128 x 128 as transformers and Qwen3's FP8 checkpoints have them, expanded to each row by
// the loader: megakernel/src/model/code_stream.rs), FP8_SCALE_VECS of a thread's 16-byte vectors of x.
constexpr uint32_t FP8_SCALE_COLS = 128;
constexpr uint32_t FP8_SCALE_VECS = FP8_SCALE_COLS / VEC;
// The nf4 stream's: one f32 (the block's absmax, double quantisation resolved by the loader) for each
// NF4_SCALE_COLS columns, bitsandbytes' usual block.
constexpr uint32_t NF4_SCALE_COLS = 64;

// Columns a scale covers in rows of a format's codes.
template <uint32_t VEC_BYTES>
__host__ __device__ constexpr uint32_t scale_cols() { return VEC_BYTES == NF4_CODES ? NF4_SCALE_COLS : FP8_SCALE_COLS; }

// Bytes of codes a stage holds at most: an nf4 stage half a slot, so that its scales (twice fp8's for
// each byte of codes: a scale per 64 weights at half a byte each) fit slots of 4 KB, and the partials
// beside them still the rows of a block of Llama-3.1-8B's GateUp (megakernel/src/model/gpu.rs sizes
// them). 32 KB of codes is 64 KB of bf16 weights: the stream's bytes in flight stay what it needs.
template <uint32_t VEC_BYTES>
__host__ __device__ constexpr uint32_t stage_code_bytes() { return VEC_BYTES == NF4_CODES ? STAGE_BYTES / 2 : STAGE_BYTES; }

// Eight e4m3 codes (the first in the low byte) as their values in f32, in order: each pair made f16x2
// by one conversion, exact (every e4m3 value is an f16), and widened.
__device__ inline void fp8_values8(uint2 codes, float (&f)[VEC]) {
    const uint32_t pairs[VEC / 2] = {codes.x & 0xFFFF, codes.x >> 16, codes.y & 0xFFFF, codes.y >> 16};
#pragma unroll
    for (uint32_t j = 0; j < VEC / 2; ++j) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)pairs[j], __NV_E4M3);
        const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&h));
        f[2 * j] = v.x;
        f[2 * j + 1] = v.y;
    }
}

// bitsandbytes' NF4 code values, code 0 to 15 (its quant_map; the loader streams bf16 for a weight
// whose quant_map is not these bits).
__constant__ float NF4_VALUES[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f, -0.18477343022823334f,
                                     -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
                                     0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
constexpr uint32_t NF4_BOOK_BYTES = 16 * 4;
// The codebook's alignment, which nf4_values8's addressing needs (its 4 x code never carries out of
// the address's low byte): the tail's bytes and the partials' rows are multiples of it.
constexpr uint32_t NF4_BOOK_ALIGN = 64;

// Eight nf4 codes as their values in f32, in order: the packing puts code e of a vector at bits 4e of
// its word (megakernel/src/model/code_stream.rs), and each names an entry of the codebook in shared
// memory (16 floats in 16 banks: a warp's lookups never conflict). `book` is the codebook's address in
// the shared window, NF4_BOOK_ALIGN-aligned (fill_codebook checks), so an entry's address is the
// book's with its low byte ORed with 4 x code: two masks place every code's byte offset, the low byte
// already ORed in, in a byte of `even` (codes 0, 2, 4, 6) or `odd` (1, 3, 5, 7), and one byte
// permutation a weight takes that byte under the book's upper three. A weight is that permutation, a
// load and its product (the form that added the base to each masked code took five instructions).
__device__ inline void nf4_values8(uint32_t word, uint32_t book, float (&f)[VEC]) {
    const uint32_t low = (book & 0xFF) * 0x01010101u;
    const uint32_t even = ((word << 2) & 0x3C3C3C3Cu) | low, odd = ((word >> 2) & 0x3C3C3C3Cu) | low;
#pragma unroll
    for (uint32_t e = 0; e < VEC; ++e) {
        // Byte e / 2 of even or odd, then the book's bytes 1-3 (__byte_perm's bytes 5-7).
        const uint32_t entry = __byte_perm(e % 2 ? odd : even, book, 0x7650 + e / 2);
        // Not volatile: the codebook is written once, before the barrier that every stage's wait
        // begins with, and never again; each load's address comes from codes read after that wait, so
        // the compiler may schedule the loads freely but cannot lift them above it.
        asm("ld.shared.f32 %0, [%1];" : "=f"(f[e]) : "r"(entry));
    }
}

// The fused product of one vector of code values c (fp8_values8's or nf4_values8's) with x's 8 values,
// added to acc: the products summed from zero in order, then times the scale of the vector's columns.
// No weight is rounded to bf16 (the loader's form took about 5 instructions a weight, this one about
// 3.5 for e4m3); a decode step's run_codes and a batch step's run_group both take it, so each lane of
// a batch step is its decode step's bits.
__device__ inline float fused8(const float (&c)[VEC], float scale, const float (&x)[VEC], float acc) {
    float d = 0.0f;
#pragma unroll
    for (uint32_t e = 0; e < VEC; ++e) d = fmaf(c[e], x[e], d);
    return fmaf(d, scale, acc);
}

// A stage's scales in shared memory (run_codes): one slot per ring slot, filled by a second bulk copy
// on the slot's mbarrier, so that the scales are in shared memory when the codes are. A stage's rows
// hold at most stage_code_bytes codes, so for fp8 at most STAGE_BYTES / FP8_SCALE_COLS scales of 4 bytes.
constexpr uint32_t FP8_SCALE_SLOT_BYTES = STAGE_BYTES / FP8_SCALE_COLS * 4;
constexpr uint32_t FP8_SCALE_SLOTS_BYTES = STAGES * FP8_SCALE_SLOT_BYTES;
constexpr uint32_t NF4_SCALE_SLOT_BYTES = stage_code_bytes<NF4_CODES>() * 2 / NF4_SCALE_COLS * 4;
template <uint32_t VEC_BYTES>
__host__ __device__ constexpr uint32_t scale_slot_bytes() { return VEC_BYTES == NF4_CODES ? NF4_SCALE_SLOT_BYTES : FP8_SCALE_SLOT_BYTES; }
// What an instance of a format's codes keeps at the end of its dynamic shared memory: the scale slots,
// and for nf4 the codebook after them (megakernel/src/model/code_stream.rs mirrors these).
constexpr uint32_t NF4_TAIL_BYTES = STAGES * NF4_SCALE_SLOT_BYTES + NF4_BOOK_BYTES;
template <uint32_t VEC_BYTES>
__host__ __device__ constexpr uint32_t code_tail_bytes() { return VEC_BYTES == NF4_CODES ? NF4_TAIL_BYTES : FP8_SCALE_SLOTS_BYTES; }

// The end of the block's dynamic shared memory (which starts at the ring).
__device__ inline char* dynamic_end(const Ring& ring) {
    uint32_t bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return reinterpret_cast<char*>(ring.data) + bytes;
}

// The scale slots of a format's codes: the first of code_tail_bytes at the end of the block's dynamic
// shared memory, left past the partials by the launcher of a coded instance (megakernel/src/model/gpu.rs).
template <uint32_t VEC_BYTES>
__device__ inline float* scale_slots(const Ring& ring) {
    return reinterpret_cast<float*>(dynamic_end(ring) - code_tail_bytes<VEC_BYTES>());
}

// The nf4 codebook: the last NF4_BOOK_BYTES of the dynamic shared memory; nf4_book is its address in
// the shared window, which nf4_values8 reads it by.
__device__ inline float* nf4_codebook(const Ring& ring) { return reinterpret_cast<float*>(dynamic_end(ring) - NF4_BOOK_BYTES); }
__device__ inline uint32_t nf4_book(const Ring& ring) { return (uint32_t)__cvta_generic_to_shared(nf4_codebook(ring)); }

// An nf4 instance writes its codebook once, as it starts; the first read of it follows a stage's wait,
// which next_stage begins with a __syncthreads, so every thread sees it written. A codebook off
// NF4_BOOK_ALIGN would make nf4_values8 read other bytes: the launcher sized shared memory wrongly.
template <uint32_t CODES>
__device__ inline void fill_codebook(const Ring& ring) {
    if constexpr (CODES == NF4_CODES) {
        if (nf4_book(ring) % NF4_BOOK_ALIGN != 0) __trap();
        if (threadIdx.x < 16) nf4_codebook(ring)[threadIdx.x] = NF4_VALUES[threadIdx.x];
    }
}

// What a stream of codes copies beside them: its matrix's scales (rows of `groups` f32, after the
// codes) into scale_slots(). bf16 rows have none, and their RowStream no such members.
template <uint32_t VEC_BYTES>
struct StreamScales {
    const float* scales = nullptr;
    uint32_t groups = 0;
};
template <>
struct StreamScales<BF16_ROWS> {};

// The largest power of two at most v (1 for v < 2).
__host__ __device__ constexpr uint32_t floor_pow2(uint32_t v) { return v < 2 ? 1 : 2 * floor_pow2(v / 2); }

// A GEMV's stream of weight rows [r0, r1) through the ring, for rows of at most VPT vectors per
// thread; each stage is SLICE_ROWS consecutive rows per slice of the block, one bulk copy from a packed
// matrix (or a few, one per run, from the handed layout: see RowSource). A layer kernel's stream (run)
// has one slice; a group's (run_group, `group`) runs in row_slices, so that its narrow rows fill the
// stages, and so does a model's decode step where its rows run in slices (a group of one: stream_phase).
// What a decode step primes before its wait decides: its input queues behind those bytes, and full
// stages with the whole ring primed (up to six times the bytes primed below 4096 columns) made
// Llama-3.2-1B 23% slower on the H200; full stages with one primed (SOLO_PRIMED), 11% faster
// (docs/perf.md, "Full stages for the batch step" and "Qwen3's Qkv in full stages").
// VEC_BYTES: the bytes a row holds for each 16-byte vector of the input: BF16_ROWS, or a format's codes
// (E4M3_CODES, NF4_CODES: run_codes).
template <uint32_t VPT, uint32_t VEC_BYTES = BF16_ROWS>
struct RowStream : StreamScales<VEC_BYTES> {
    static constexpr uint32_t VECS_PER_THREAD = VPT;
    static constexpr uint32_t CODE_BYTES = VEC_BYTES;
    // As many rows a slice as a stage holds, rounded down to a power of two (bf16's are already).
    static constexpr uint32_t SLICE_ROWS = floor_pow2(stage_code_bytes<VEC_BYTES>() / VEC_BYTES / (THREADS * VPT));
    static_assert(SLICE_ROWS * THREADS * VPT * VEC_BYTES <= stage_code_bytes<VEC_BYTES>(), "a row must fit a ring stage");
    // Rows run_rows sums side by side: a slice's, but half of a coded stage's, whose fused products hold
    // a partial a vector beside each row's sum (all of an fp8 stage's at once spilled 332 bytes).
    static constexpr uint32_t PASS_ROWS = VEC_BYTES != BF16_ROWS && SLICE_ROWS > 1 ? SLICE_ROWS / 2 : SLICE_ROWS;
    // Rows per reduce_scatter in run_group: two where a slice's rows pair up.
    static constexpr uint32_t ROWS_PER_SUM = SLICE_ROWS % 2 == 0 ? 2 : 1;
    // So that a stage's rows (SLICE_ROWS times the slices) are a power of two: nstages is a shift.
    static_assert((SLICE_ROWS & (SLICE_ROWS - 1)) == 0, "a power of two");
    const bf16* w;  // (rows, vecs * VEC); for codes, the codes (rows, vecs * VEC_BYTES bytes) viewed as bf16 pairs
    uint32_t vecs, r0, n, slices, stage_rows, nstages;
    // Whether row_source may name an in-place source: false in the one-layer kernel, where the compiler
    // then drops every read of it (they cost the graded layer 10 us, docs/perf.md).
    bool in_place;

    __device__ RowStream(const bf16* w_, uint32_t vecs_, uint32_t r0_, uint32_t r1_, bool in_place_, bool group = false)
        : w(w_), vecs(vecs_), r0(r0_), n(r1_ - r0_), slices(group ? row_slices(vecs_) : 1), stage_rows(SLICE_ROWS * slices),
          nstages((r1_ - r0_ + stage_rows - 1) >> (31 - __clz(stage_rows))), in_place(in_place_) {}

    // Rows [c0, c1) of the same matrix as a group's stream (run_group), its scales too. They are copied
    // member by member, not by assigning the base (static_cast<StreamScales<8>&>(sub) = *this): nvcc 13.0
    // makes every field of a stream so made undefined and drops its stages and products (docs/perf.md,
    // "The fp8 batch step's fault, bisected").
    __device__ RowStream rows(uint32_t c0, uint32_t c1) const {
        RowStream sub(w, vecs, c0, c1, in_place, true);
        if constexpr (VEC_BYTES != BF16_ROWS) {
            sub.scales = this->scales;
            sub.groups = this->groups;
        }
        return sub;
    }

    __device__ const bf16* stage_src(uint32_t st) const { return w + (size_t)(r0 + st * stage_rows) * vecs * (VEC_BYTES / 2); }
    __device__ uint32_t stage_count(uint32_t st) const { return min(stage_rows, n - st * stage_rows); }

    // Thread 0 starts the copy of stage st into its slot. The slot's previous contents must be dead:
    // the callers reach this only after a __syncthreads that follows every read of them.
    __device__ void issue(const Ring& ring, uint32_t st) const {
        if (threadIdx.x != 0 || st >= nstages) return;
        const uint32_t k = ring.seq + st;
        uint4* slot = ring.data + (k % STAGES) * (STAGE_BYTES / 16);
        if constexpr (VEC_BYTES != BF16_ROWS) {
            // The stage's rows' scales, consecutive after the codes as its rows are: one more copy on the
            // slot's barrier, counted with the codes', so that a stage lands with its scales.
            const uint32_t scale_bytes = stage_count(st) * this->groups * 4;
            mbar_expect_tx(&ring.full[k % STAGES], stage_count(st) * vecs * VEC_BYTES + scale_bytes);
            bulk_copy(scale_slots<VEC_BYTES>(ring) + (k % STAGES) * (scale_slot_bytes<VEC_BYTES>() / 4), this->scales + (size_t)(r0 + st * stage_rows) * this->groups, scale_bytes,
                      &ring.full[k % STAGES], l2_evict_first());
            bulk_copy(slot, stage_src(st), stage_count(st) * vecs * VEC_BYTES, &ring.full[k % STAGES], l2_evict_first());
            return;
        }
        mbar_expect_tx(&ring.full[k % STAGES], stage_count(st) * vecs * VEC_BYTES);
        if (in_place && row_source.kind != SOURCE_PACKED) {
            gather_stage(row_source, slot, r0 + st * stage_rows, stage_count(st), vecs * VEC_BYTES, &ring.full[k % STAGES]);
            return;
        }
        // Evict-first: each weight is read once a step, so its lines should not push out the cache and
        // the activations, which are read again (docs/perf.md measured it).
        bulk_copy(slot, stage_src(st), stage_count(st) * vecs * VEC_BYTES, &ring.full[k % STAGES], l2_evict_first());
    }

    // The first IN_FLIGHT stages. Weights do not depend on anything the layer computes, so this runs
    // before the phase's input exists: before its norm, and before the wait for its dependencies.
    __device__ void prime(const Ring& ring) const {
        for (uint32_t st = 0; st < IN_FLIGHT; ++st) issue(ring, st);
    }

    // Waits for stage st to land and returns its slot. With the whole ring in flight, first refills the
    // slot stage st - 1 used with stage st + STAGES - 1; with fewer, issues stage st + IN_FLIGHT once
    // stage st has landed, into the slot of a stage at or before st - 2 (every thread was done with it
    // before the barrier of next_stage(st - 1)).
    __device__ const uint4* next_stage(const Ring& ring, uint32_t st) const {
        __syncthreads();  // every thread is done with stage st - 1, whose slot the next issue may refill
        if constexpr (IN_FLIGHT == STAGES - 1) issue(ring, st + STAGES - 1);
        const uint32_t k = ring.seq + st;
        mbar_wait(&ring.full[k % STAGES], (k / STAGES) & 1);  // stage st has landed
        if constexpr (IN_FLIGHT < STAGES - 1) issue(ring, st + IN_FLIGHT);
        return ring.data + (k % STAGES) * (STAGE_BYTES / 16);
    }

    // A grouped stage's pairs (0 otherwise): it holds its pairs' first rows, then their second rows, so
    // slot row i is the stage's row slot_row(i, pairs): pair i % pairs's member i / pairs.
    __device__ uint32_t stage_pairs(uint32_t count) const { return in_place && row_source.grouped ? count / 2 : 0; }
    __device__ static uint32_t slot_row(uint32_t i, uint32_t pairs) { return pairs == 0 ? i : 2 * (i % pairs) + i / pairs; }

    // red[r - r0][warp] = the warp's partial dot product of row r with the slice, for a stream of one
    // slice of bf16 rows; needs prime() first. Advances ring.seq past this stream's stages.
    __device__ void run(const Slice& s, Ring& ring, Partials part) const {
        static_assert(VEC_BYTES == 16, "bf16 rows");
        run_rows(s, ring, part, [&](const uint4* slot, uint32_t, uint32_t i, uint32_t v, float acc) {
            const uint32_t vec = v * THREADS + threadIdx.x;
            return vec < vecs ? dot8(slot[i * vecs + vec], s.h[v], acc) : acc;
        });
    }

    // Slot row i's codes for 16-byte vector `vec` of x as their values (into c); `book`: the nf4
    // codebook's shared address (nf4_book), unread for e4m3.
    __device__ void values8(const uint4* slot, uint32_t i, uint32_t vec, uint32_t book, float (&c)[VEC]) const {
        if constexpr (VEC_BYTES == E4M3_CODES) fp8_values8(reinterpret_cast<const uint2*>(slot)[i * vecs + vec], c);
        else nf4_values8(reinterpret_cast<const uint32_t*>(slot)[i * vecs + vec], book, c);
    }

    // The codebook values8 reads: the nf4 one, or none.
    __device__ static uint32_t codebook(const Ring& ring) { return VEC_BYTES == NF4_CODES ? nf4_book(ring) : 0; }

    // run() for rows of codes: each vector of a row's codes dotted with x in the fused form
    // (fused8), its scale that of its scale_cols columns from the stage's scale slot (issue
    // copied them there with the codes); the threads' partials, their butterflies and the warps' order
    // are run()'s. A stage's rows past its count are stale slot memory whose sums are never stored;
    // their scales are read at its last row, within what the stage's copy wrote. The slice is widened
    // to f32 once, not once a row. No branch around a row's products: every thread has each of its
    // vectors but perhaps the last, and for that one a thread past the row computes on the row's last
    // vector and keeps acc, so that the rows' loads and arithmetic interleave as in the probe's
    // unguarded loop.
    __device__ void run_codes(const Slice& s, Ring& ring, Partials part) const {
        static_assert(VEC_BYTES != BF16_ROWS, "rows of codes");
        float x[VPT][VEC];
#pragma unroll
        for (uint32_t v = 0; v < VPT; ++v) widen8(s.h[v], x[v]);
        // code_values8's read, spelled out with the slots' base hoisted: calling it moved the fp8 decode
        // instances' machine code by 128-384 bytes, which no GPU has timed.
        const float* slots = scale_slots<VEC_BYTES>(ring);
        const uint32_t book = codebook(ring);
        run_rows(s, ring, part, [&](const uint4* slot, uint32_t st, uint32_t i, uint32_t v, float acc) {
            const uint32_t vec = v * THREADS + threadIdx.x, at = min(vec, vecs - 1);
            const float* stage_scales = slots + (ring.seq + st) % STAGES * (scale_slot_bytes<VEC_BYTES>() / 4);
            const float scale = stage_scales[min(i, stage_count(st) - 1) * this->groups + at / (scale_cols<VEC_BYTES>() / VEC)];
            float c[VEC];
            values8(slot, i, at, book, c);
            const float sum = fused8(c, scale, x[v], acc);
            return v + 1 < VPT || vec < vecs ? sum : acc;
        });
    }

    // The walk of run() and run_codes: dot(slot, st, i, v, acc) adds to acc the products of slot row i's
    // vector t + v * THREADS of stage st (thread t's v-th) with this thread's v-th vector of the slice,
    // where the row has that vector (acc as it was where not). A pass of nf4 rows is summed across the
    // warp at once (reduce_transposed: PASS_ROWS - 1 + log2(WARP / PASS_ROWS) shuffles, not a
    // butterfly's 5 a row), the same pairs in the same order, so the same bits; lanes [k WARP /
    // PASS_ROWS, ...) end with row i0 + k's sum. The nf4 step is bound by the SMs' instructions; bf16
    // and fp8 rows keep a butterfly a row, since with the transposed sums the Qwen3 and the sliced fp8
    // instances spilled more, and no GPU has timed them so (docs/perf.md).
    template <typename Dot>
    __device__ __forceinline__ void run_rows(const Slice& s, Ring& ring, Partials part, Dot dot) const {
        const uint32_t t = threadIdx.x, lane = t % WARP, warp = t / WARP;
        // The launcher sized red for fewer rows than this block got; or a group's stream (group_stream).
        if (n > part.rows || slices != 1) __trap();
        for (uint32_t st = 0; st < nstages; ++st) {
            const uint4* slot = next_stage(ring, st);
#pragma unroll
            for (uint32_t i0 = 0; i0 < SLICE_ROWS; i0 += PASS_ROWS) {
                float acc[PASS_ROWS];
#pragma unroll
                for (uint32_t i = 0; i < PASS_ROWS; ++i) {
                    acc[i] = 0.0f;
#pragma unroll
                    for (uint32_t v = 0; v < VPT; ++v) acc[i] = dot(slot, st, i0 + i, v, acc[i]);
                }
                if constexpr (VEC_BYTES == NF4_CODES) {
                    const float sum = reduce_transposed<PASS_ROWS>(acc);
                    const uint32_t i = i0 + scatter_mask<PASS_ROWS>(), count = stage_count(st);
                    if (lane % (WARP / PASS_ROWS) == 0 && i < count) part.red[(st * SLICE_ROWS + slot_row(i, stage_pairs(count))) * WARPS + warp] = sum;
                } else {
                    // Independent butterflies, one per row, so their shuffles overlap.
#pragma unroll
                    for (uint32_t i = 0; i < PASS_ROWS; ++i) acc[i] = warp_reduce(acc[i], Add{});
                    if (lane == 0) {
                        const uint32_t count = stage_count(st), pairs = stage_pairs(count);
#pragma unroll
                        for (uint32_t i = 0; i < PASS_ROWS; ++i) {
                            const uint32_t r = slot_row(i0 + i, pairs);
                            if (i0 + i < count) part.red[(st * SLICE_ROWS + r) * WARPS + warp] = acc[i];
                        }
                    }
                }
            }
        }
        ring.seq += nstages;
        __syncthreads();  // every warp's partials are in red before any thread adds them up
    }

    // run_group's codes: slot row i's for 16-byte vector `vec` of x in stage st as their values (into
    // c), and returns their scale, from the stage's scale slot as run_codes reads it (rows past the
    // stage's count at its last row: their sums are never stored).
    __device__ float code_values8(const Ring& ring, const uint4* slot, uint32_t st, uint32_t i, uint32_t vec, float (&c)[VEC]) const {
        static_assert(VEC_BYTES != BF16_ROWS, "rows of codes");
        values8(slot, i, vec, codebook(ring), c);
        const float* stage_scales = scale_slots<VEC_BYTES>(ring) + (ring.seq + st) % STAGES * (scale_slot_bytes<VEC_BYTES>() / 4);
        return stage_scales[min(i, stage_count(st) - 1) * this->groups + vec / (scale_cols<VEC_BYTES>() / VEC)];
    }

    // Several input vectors against the same rows, the weights read once for all of them, R =
    // ROWS_PER_SUM rows and G vectors per reduce_scatter (N = R G values). The block runs a stage's rows
    // in `slices` side by side (a group stream's, row_slices), slice s taking slot rows s, s + slices,
    // ...; its thread t' = t % (THREADS / slices) does what thread t' of run() does.
    // h[p] holds vector p ^ (scatter_mask<N>() % G)'s elements as a Slice would (16-byte vector t' + v
    // THREADS at h[p][v]), widened to f32 once; the lane takes row position rp from slot row rp ^
    // (scatter_mask<N>() / G), so that value rp G + p is reduce_scatter's. red[(g n + r - r0)][warp]
    // = warp `warp` of run()'s partial of row r with vector g < live; the warps run() has without
    // columns are the caller's to zero (their +0.0 partials). Each vector's products, their order per
    // thread (dot8's; for codes, fused8's), its butterfly and row_sum's warp order are run()'s (or
    // run_codes's), so each vector's sums are bitwise those of run() (run_codes) alone, whatever the other
    // vectors are. Needs prime(); advances ring.seq.
    template <uint32_t G>
    __device__ void run_group(const float (&h)[G][VPT][VEC], uint32_t live, Ring& ring, Partials part) const {
        constexpr uint32_t R = ROWS_PER_SUM, N = R * G;
        // THREADS / slices threads a slice, a power of two: a mask and a shift.
        const uint32_t per_log2 = THREADS_LOG2 - (31 - __clz(slices));
        const uint32_t t = threadIdx.x & ((1u << per_log2) - 1), sub = threadIdx.x >> per_log2, lane = threadIdx.x % WARP;
        const uint32_t warp = t / WARP, mask = scatter_mask<N>();
        if (n * live > part.rows || live > G) __trap();  // the caller sizes these
        for (uint32_t st = 0; st < nstages; ++st) {
            const uint4* slot = next_stage(ring, st);
            const uint32_t count = stage_count(st), pairs = stage_pairs(count);
            // Slot rows sub + slices * (j + ...) from j on are all past the stage's count once slices * j
            // is: such a pass computes only rows that are never stored, so it is skipped (a block's last
            // stage, or a phase of a few rows a block), and its loads, products and shuffles no longer
            // sit on the phase's critical path. The bound is the same in every thread of the block, so the
            // warps stay converged for the reduce-scatter's shuffles.
            for (uint32_t j = 0; j < SLICE_ROWS && slices * j < count; j += R) {
                float acc[N];
#pragma unroll
                for (uint32_t k = 0; k < N; ++k) acc[k] = 0.0f;
#pragma unroll
                for (uint32_t rp = 0; rp < R; ++rp) {
                    const uint32_t i = sub + slices * (j + (rp ^ mask / G));
#pragma unroll
                    for (uint32_t v = 0; v < VPT; ++v) {
                        if (t + v * THREADS >= vecs) continue;
                        float w[VEC];
                        if constexpr (VEC_BYTES != BF16_ROWS) {
                            // The codes' values once for the group; each vector's fused product as run_codes's.
                            const float scale = code_values8(ring, slot, st, i, v * THREADS + t, w);
#pragma unroll
                            for (uint32_t p = 0; p < G; ++p) acc[rp * G + p] = fused8(w, scale, h[p][v], acc[rp * G + p]);
                            continue;
                        }
                        widen8(slot[i * vecs + v * THREADS + t], w);
#pragma unroll
                        for (uint32_t p = 0; p < G; ++p) {
                            // dot8's products in dot8's order, the weight first.
#pragma unroll
                            for (uint32_t e = 0; e < VEC; ++e) acc[rp * G + p] = fmaf(w[e], h[p][v][e], acc[rp * G + p]);
                        }
                    }
                }
                const float sum = reduce_scatter<N>(acc);
                const uint32_t g = mask % G, i = sub + slices * (j + mask / G);
                if (lane % (WARP / N) == 0 && g < live && i < count) part.red[(g * n + st * stage_rows + slot_row(i, pairs)) * WARPS + warp] = sum;
            }
        }
        ring.seq += nstages;
        __syncthreads();  // every warp's partials are in red before any thread adds them up
    }
};

// A stream of rows [r0, r1) for run_group (RowStream's `group`).
template <uint32_t VPT>
__device__ inline RowStream<VPT> group_stream(const bf16* w, uint32_t vecs, uint32_t r0, uint32_t r1, bool in_place) {
    return RowStream<VPT>(w, vecs, r0, r1, in_place, true);
}

// A model's decode step streams rows that run in slices as a group of one (stream_phase's SLICED), in
// full stages, of which it issues SOLO_PRIMED before the wait (prime_solo): as many bytes as the two
// stages of one slice a layer kernel primes at 2048 columns, so that the input after the wait queues
// behind no more than before. The rest of the first IN_FLIGHT go as the stream starts (start_solo).
// Two primed full stages made Llama-3.2-1B 4% slower than one (docs/perf.md, "Qwen3's Qkv in full
// stages").
constexpr uint32_t SOLO_PRIMED = 1;
static_assert(SOLO_PRIMED <= IN_FLIGHT, "primed stages are in flight");
__device__ inline void prime_solo(const RowStream<1>& stream, const Ring& ring) {
    for (uint32_t st = 0; st < SOLO_PRIMED; ++st) stream.issue(ring, st);
}
__device__ inline void start_solo(const RowStream<1>& stream, const Ring& ring) {
    for (uint32_t st = SOLO_PRIMED; st < IN_FLIGHT; ++st) stream.issue(ring, st);
}

// Calls f(RowStream<VPT, VEC_BYTES>) for the VPT of rows of `cols` columns: the loops above unroll at
// compile time. `group`: a stream for run_group (RowStream's).
template <uint32_t VEC_BYTES = 16, typename F>
__device__ void with_stream(const bf16* w, uint32_t cols, uint32_t r0, uint32_t r1, bool in_place, F f, bool group = false) {
    const uint32_t vecs = cols / VEC;
    switch ((vecs + THREADS - 1) / THREADS) {
        case 1: f(RowStream<1, VEC_BYTES>(w, vecs, r0, r1, in_place, group)); break;
        case 2: f(RowStream<2, VEC_BYTES>(w, vecs, r0, r1, in_place, group)); break;
        case 3: f(RowStream<3, VEC_BYTES>(w, vecs, r0, r1, in_place, group)); break;
        case 4: f(RowStream<4, VEC_BYTES>(w, vecs, r0, r1, in_place, group)); break;
        case 5: f(RowStream<5, VEC_BYTES>(w, vecs, r0, r1, in_place, group)); break;
        case 6: f(RowStream<6, VEC_BYTES>(w, vecs, r0, r1, in_place, group)); break;
        case 7: f(RowStream<7, VEC_BYTES>(w, vecs, r0, r1, in_place, group)); break;
        default: __trap();  // the launcher refuses rows longer than MAX_VPT vectors per thread
    }
}

// Vectors one stream serves at most: a batch's sequences, or a prompt chunk's positions.
constexpr uint32_t MAX_BATCH = 8;
// Vectors a thread holds at once for rows of VPT vectors per thread: MAX_BATCH 16-byte vectors of
// input, widened to 64 f32 registers; the whole batch at VPT 1 (rows up to 4096). A batch larger
// than its group takes a pass over the weights per group.
template <uint32_t VPT>
__host__ __device__ constexpr uint32_t group_of() { return VPT >= MAX_BATCH ? 1 : MAX_BATCH / VPT; }

// A group's inputs for a RowStream<VPT>'s run_group<G>, R its ROWS_PER_SUM (an fp8 stream's stages hold
// twice a bf16 stream's rows, so at five or more vectors a thread its R is 2 where bf16's is 1), widened
// once: h[p] holds
// vector p ^ (scatter_mask<R G>() % G) as thread t holds it (input(g, t), a Slice, for g < live; zero
// past live). Each thread loads its own order of vectors from memory, so that every place of h is a
// register the compiler names.
template <uint32_t VPT, uint32_t G, uint32_t R = RowStream<VPT>::ROWS_PER_SUM, typename In>
__device__ inline void group_inputs(float (&h)[G][VPT][VEC], uint32_t live, uint32_t t, In input) {
    const uint32_t order = scatter_mask<R * G>() % G;
#pragma unroll
    for (uint32_t p = 0; p < G; ++p) {
        const uint32_t g = p ^ order;
        const Slice s = g < live ? input(g, t) : Slice{};
#pragma unroll
        for (uint32_t v = 0; v < VPT; ++v) widen8(g < live ? s.h[v] : make_uint4(0, 0, 0, 0), h[p][v]);
    }
}

// Zeroes the row partials: the warps a slice of run_group leaves without columns never write theirs,
// which must read +0.0 as run()'s column-less warps write them. Call after every read of them before.
__device__ inline void zero_partials(const Partials& part) {
    for (uint32_t i = threadIdx.x; i < part.rows * WARPS; i += THREADS) part.red[i] = 0.0f;
}

// `all`'s rows in streams of `chunk` rows, each run by run(stream), which leaves the partials of lanes
// [b0, b0 + live) as run_group does, and ended lane by lane by epilogue(b, part, c0, c1). The first
// stream's first stages are in the ring unless `prime_first`.
template <typename Stream, typename Run, typename Out>
__device__ __forceinline__ void chunk_streams(const Stream& all, uint32_t b0, uint32_t live, uint32_t chunk, bool prime_first, Ring& ring, Partials part, Run run,
                                              Out epilogue) {
    const uint32_t end = all.r0 + all.n;
    for (uint32_t c0 = all.r0; c0 < end; c0 += chunk) {
        const uint32_t c1 = min(c0 + chunk, end);
        const Stream stream = all.rows(c0, c1);
        // The ring is free: the stream before and its epilogues (Qwen3's uses the ring's memory) ended on
        // a __syncthreads.
        if (c0 != all.r0 || prime_first) stream.prime(ring);
        run(stream);
        for (uint32_t g = 0; g < live; ++g) {
            epilogue(b0 + g, Partials{part.red + (size_t)g * (c1 - c0) * WARPS, c1 - c0}, c0, c1);
            // The next lane's epilogue, the next stream and its partials come after every read of these.
            __syncthreads();
        }
    }
}

// Lanes [b0, b0 + live) of `all`'s rows through run_group<G>, in group streams of `chunk` rows:
// input(b, t) is lane b's input as thread t holds it (no block-wide step: each thread takes the lanes
// in its own order), epilogue(b, part, c0, c1) ends lane b's rows [c0, c1) from their partials. The
// first stream's first stages are in the ring unless `prime_first`.
template <uint32_t VPT, uint32_t G, uint32_t VEC_BYTES, typename In, typename Out>
__device__ void lanes_group(const RowStream<VPT, VEC_BYTES>& all, uint32_t b0, uint32_t live, uint32_t chunk, bool prime_first, Ring& ring, Partials part, In input,
                            Out epilogue) {
    float h[G][VPT][VEC];
    group_inputs<VPT, G, RowStream<VPT, VEC_BYTES>::ROWS_PER_SUM>(h, live, column_thread(all.vecs * VEC), [&](uint32_t g, uint32_t t) { return input(b0 + g, t); });
    chunk_streams(all, b0, live, chunk, prime_first, ring, part, [&](const RowStream<VPT, VEC_BYTES>& stream) { stream.template run_group<G>(h, live, ring, part); }, epilogue);
}

// A decode step's rows through run_group as a group of one, the input `s` as column_thread holds it:
// full stages where the rows run in slices, each output's products, sums and rounding run()'s, so its
// bits too. `stream` (the block's rows) has its first IN_FLIGHT stages issued; they go in chunks of
// `chunk` rows (as many as the partials hold), epilogue(0, part, c0, c1) ending each. The phase before
// ended on a __syncthreads, so the partials are free to zero.
template <typename Out>
__device__ __forceinline__ void solo_group(const RowStream<1>& stream, const Slice& s, uint32_t chunk, Ring& ring, Partials part, Out epilogue) {
    zero_partials(part);
    lanes_group<1, 1>(stream, 0, 1, chunk, false, ring, part, [&](uint32_t, uint32_t) { return s; }, epilogue);
}
