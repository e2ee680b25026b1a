// A phase's GEMV: which matrix and rows the program row names, this block's share of them, its first
// stages primed before the phase's wait, and its input (loaded, or normed) as each thread holds it.
#pragma once
#include "vm_pairs.cuh"
#include "vm_trace.cuh"

// The GEMV of a phase: matrix, row length and rows, as the program row names them.
struct Gemv {
    const bf16* w;
    uint32_t cols, rows;
    bool in_place;  // the phase's rows may come from an in-place source (a stack's layer: row_source)
};

// Where each GEMV phase's matrix is; attention has none.
__device__ inline bool gemv_of(const OpRow& op, Gemv& g) {
    switch (op[0]) {
        case OP_QKV: g = {reinterpret_cast<const bf16*>(layer_address(op, qkv::W)), (uint32_t)op[qkv::D], (uint32_t)((op[qkv::NQ] + 2 * op[qkv::NKv]) * op[qkv::Hd]), op.table != nullptr}; return true;
        case OP_O_PROJ: g = {reinterpret_cast<const bf16*>(layer_address(op, oproj::W)), (uint32_t)op[oproj::Cols], (uint32_t)op[oproj::Rows], op.table != nullptr}; return true;
        case OP_GATE_UP: g = {reinterpret_cast<const bf16*>(layer_address(op, gateup::W)), (uint32_t)op[gateup::D], (uint32_t)(2 * op[gateup::Ffn]), op.table != nullptr}; return true;
        case OP_DOWN: g = {reinterpret_cast<const bf16*>(layer_address(op, down::W)), (uint32_t)op[down::Cols], (uint32_t)op[down::Rows], op.table != nullptr}; return true;
        default: return false;
    }
}

// Starts streaming this block's weights of phase `op` into the ring (nothing for a phase without a
// GEMV).
// Thread 0: where phase `op`'s rows come from. The layer's table names Wk, Wv and Wup when its Qkv and
// GateUp rows are read in place; otherwise (and always for one layer) they are packed.
__device__ inline void set_row_source(const OpRow& op) {
    RowSource& src = row_source;
    src.kind = SOURCE_PACKED;
    src.grouped = false;
    if (op.table == nullptr) return;
    if (op[0] == OP_QKV && op.table[SLOT_WK] != 0) {
        const uint32_t half = (uint32_t)op[qkv::Hd] / 2;
        src = {SOURCE_QKV, true, {reinterpret_cast<const char*>(layer_address(op, qkv::W)), reinterpret_cast<const char*>(op.table[SLOT_WK]), reinterpret_cast<const char*>(op.table[SLOT_WV])},
               (uint32_t)op[qkv::NQ] * half, (uint32_t)op[qkv::NKv] * half, half};
    } else if (op[0] == OP_GATE_UP && op.table[SLOT_WUP] != 0) {
        src = {SOURCE_GATE_UP, true, {reinterpret_cast<const char*>(layer_address(op, gateup::W)), reinterpret_cast<const char*>(op.table[SLOT_WUP]), nullptr}, 0, 0, 0};
    }
}

// Rows a block's share of phase `op` comes in: pairs, or for a Qkv phase of a layer with per-head q/k
// norms (`qk_norms` not null) whole heads, whose norm needs all of a head's rows in one block.
__device__ inline uint32_t qkv_unit(const OpRow& op, const bf16* qk_norms) {
    return op[0] == OP_QKV && qk_norms != nullptr ? (uint32_t)op[qkv::Hd] : 2;
}

// Whether an instance for a format's codes (CODES) streams phase g's rows in pair tiles (vm_pairs.cuh):
// nf4 rows of NF4_PAIR_COLS columns, or where NARROW (pair_tiled_shape) half that, in whole tiles, as
// the loader packs them (code_stream.rs, pair_tiled). The instance for wide rows never meets narrow
// ones (the launcher runs a model with any in the sliced instance).
template <uint32_t CODES, bool NARROW>
__device__ inline bool pair_tiled(const Gemv& g) { return CODES == NF4_CODES && pair_tiled_shape<NARROW>(g.rows, g.cols); }

// Rows a block's share of phase `op` comes in, in an instance for CODES: qkv_unit's, or whole tiles
// where the rows stream in pair tiles (up to NF4_TILE_ROWS - 2 rows more than an even share in pairs,
// which the launcher sizes the partials for). NARROW: as pair_tiled's.
template <uint32_t CODES = BF16_ROWS, bool NARROW = false>
__device__ inline uint32_t row_unit(const OpRow& op, const bf16* qk_norms) {
    const uint32_t unit = qkv_unit(op, qk_norms);
    if constexpr (CODES == NF4_CODES) {
        Gemv g;
        if (gemv_of(op, g) && pair_tiled<CODES, NARROW>(g)) return max(unit, NF4_TILE_ROWS);
    }
    return unit;
}

// Lanes of a batch step's group (lanes_gemv): as many as the group holds (G, group_of) and the
// partials fit for a unit of rows each; at least one where the launcher sized the partials.
__device__ inline uint32_t lanes_per_group(uint32_t G, uint32_t unit, uint32_t part_rows) { return min(G, part_rows / unit); }
// Rows of a chunk of a group of `live` lanes: as many whole units as their partials fit.
__device__ inline uint32_t chunk_rows(uint32_t live, uint32_t unit, uint32_t part_rows) { return part_rows / live / unit * unit; }

// Whether an instance for a format's codes (CODES: the model kernel's for fp8 or nf4 checkpoints, a
// decode step's) streams a GEMV's rows as codes (run_codes): those too wide for slices; narrower rows
// stream bf16 there too. The loader packs each matrix by the same rule (code_stream.rs).
__device__ inline bool streams_codes(const Gemv& g) { return !in_slices(g.cols); }

// A coded matrix's scales (run_codes): after its codes, in the same allocation; a row has one for each
// scale_cols columns, the last maybe partial. fp8's codes are a byte a weight, nf4's half a byte. (One
// function for both, a template over the format, moved four pairs of loads in the fp8 batch step's
// machine code, which no GPU has timed.)
__device__ inline const float* fp8_scales(const Gemv& g) {
    return reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(g.w) + (size_t)g.rows * g.cols);
}
__device__ inline uint32_t fp8_groups(const Gemv& g) { return (g.cols + FP8_SCALE_COLS - 1) / FP8_SCALE_COLS; }
__device__ inline const float* nf4_scales(const Gemv& g) {
    return reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(g.w) + (size_t)g.rows * (g.cols / 2));
}
__device__ inline uint32_t nf4_groups(const Gemv& g) { return (g.cols + NF4_SCALE_COLS - 1) / NF4_SCALE_COLS; }

// A stream of g's codes that copies its scales too (StreamScales).
template <typename Stream>
__device__ inline Stream with_scales(Stream stream, const Gemv& g) {
    if constexpr (Stream::CODE_BYTES == NF4_CODES) {
        stream.scales = nf4_scales(g);
        stream.groups = nf4_groups(g);
    } else {
        stream.scales = fp8_scales(g);
        stream.groups = fp8_groups(g);
    }
    return stream;
}

// The block's rows [r0, r1) of a phase in pair tiles, a stream that copies their scales: where NARROW a
// group stream, so that a stage holds two tiles of the narrow rows (row_slices), one of the wide.
template <bool NARROW>
__device__ inline RowStream<1, NF4_CODES> pair_stream(const Gemv& g, uint32_t r0, uint32_t r1) {
    return with_scales(RowStream<1, NF4_CODES>(g.w, g.cols / VEC, r0, r1, false, NARROW), g);
}

// The end of a batch step's first stream over a block's rows [r0, r1) of VPT vectors a thread, in
// units of `unit` rows, of `lanes` lanes with partials of `part_rows` rows: lanes_gemv's first group's
// first chunk.
template <uint32_t VPT>
__device__ inline uint32_t first_chunk_end(uint32_t r0, uint32_t r1, uint32_t unit, uint32_t lanes, uint32_t part_rows) {
    const uint32_t live = max(1u, min(lanes_per_group(group_of<VPT>(), unit, part_rows), lanes));
    return min(r1, r0 + chunk_rows(live, unit, part_rows));
}

// For a batch step of `lanes` lanes (0: a decode step) with partials of `part_rows` rows, the first
// stream is its first group's first chunk (lanes_gemv); a decode step's is the block's rows. CODES: as
// streams_codes; NARROW: as pair_tiled's (without it the wide rows' pair tiles are primed as codes of
// one vector a thread, the same stream).
template <bool SLICED = false, uint32_t CODES = BF16_ROWS, bool NARROW = SLICED>
__device__ void prime_phase(const OpRow& op, const Ring& ring, const bf16* qk_norms, uint32_t lanes = 0, uint32_t part_rows = 0) {
    Gemv g;
    if (!gemv_of(op, g)) return;
    if (threadIdx.x == 0) set_row_source(op);
    const uint32_t unit = row_unit<CODES, NARROW>(op, qk_norms);
    uint32_t r0, r1;
    block_rows(g.rows, blocks_of(op), r0, r1, unit);
    // Packed (the loader packs every coded matrix): no row source to read.
    if constexpr (CODES == NF4_CODES && NARROW) {
        if (pair_tiled<CODES, NARROW>(g)) {
            const RowStream<1, NF4_CODES> all = pair_stream<NARROW>(g, r0, r1);
            if (lanes == 0) return all.prime(ring);
            return all.rows(r0, first_chunk_end<1>(r0, r1, unit, lanes, part_rows)).prime(ring);
        }
    }
    if constexpr (CODES != BF16_ROWS) {
        if (streams_codes(g)) {
            return with_stream<CODES>(g.w, g.cols, r0, r1, false, [&](auto stream) {
                const auto all = with_scales(stream, g);
                if (lanes == 0) return all.prime(ring);
                all.rows(r0, first_chunk_end<decltype(stream)::VECS_PER_THREAD>(r0, r1, unit, lanes, part_rows)).prime(ring);
            });
        }
    }
    with_stream(g.w, g.cols, r0, r1, g.in_place, [&](auto stream) {
        using Stream = decltype(stream);
        // A decode step: run()'s stages; or, where its rows run in slices, a group of one's, in the model
        // kernel (stream_phase's SLICED, one stage primed) and in Qwen3's Qkv (phase_qkv_normed, two).
        if (lanes == 0 && SLICED && unit == 2 && row_slices(stream.vecs) > 1) return prime_solo(group_stream<1>(g.w, stream.vecs, r0, r1, g.in_place), ring);
        if (lanes == 0 && (unit == 2 || !in_slices(g.cols))) return stream.prime(ring);
        if (lanes == 0) return group_stream<Stream::VECS_PER_THREAD>(g.w, stream.vecs, r0, r1, g.in_place).prime(ring);
        group_stream<Stream::VECS_PER_THREAD>(g.w, stream.vecs, r0, first_chunk_end<Stream::VECS_PER_THREAD>(r0, r1, unit, lanes, part_rows), g.in_place).prime(ring);
    });
}

// This block's rows [r0, r1) of phase `op`'s GEMV (`qk_norms` as for qkv_unit; CODES and NARROW as
// row_unit's).
template <uint32_t CODES = BF16_ROWS, bool NARROW = false>
__device__ inline void gemv_rows(const OpRow& op, uint32_t& r0, uint32_t& r1, const bf16* qk_norms = nullptr) {
    Gemv g;
    if (!gemv_of(op, g)) __trap();
    block_rows(g.rows, blocks_of(op), r0, r1, row_unit<CODES, NARROW>(op, qk_norms));
}

// Rows [r0, r1) of g in pair tiles against x as s holds it (write_pair_b), into red (the ring already
// primed). The slots' upper halves are free: the phase before ended on finish_phase's barrier.
template <bool NARROW>
__device__ __forceinline__ void pair_phase(const Gemv& g, const Slice& s, Ring& ring, Partials part, uint32_t r0, uint32_t r1) {
    write_pair_table(ring);
    write_pair_b(ring, 0, s.h[0]);
    run_pairs<NARROW>(pair_stream<NARROW>(g, r0, r1), 1, ring, part);
    stamp(TRACE_STREAMED);
}

// This block's rows [r0, r1) of phase `op`'s GEMV against the slice, into red (the ring already
// primed). CODES: as streams_codes; CODES and NARROW: as pair_tiled.
template <uint32_t CODES = BF16_ROWS, bool NARROW = false>
__device__ void gemv_phase(const OpRow& op, const Slice& s, Ring& ring, Partials part, uint32_t r0, uint32_t r1) {
    Gemv g;
    if (!gemv_of(op, g)) __trap();
    stamp(TRACE_INPUT);
    if constexpr (CODES == NF4_CODES) {
        if (pair_tiled<CODES, NARROW>(g)) return pair_phase<NARROW>(g, s, ring, part, r0, r1);
    }
    if constexpr (CODES != BF16_ROWS) {
        if (streams_codes(g)) {
            with_stream<CODES>(g.w, g.cols, r0, r1, false, [&](auto stream) { with_scales(stream, g).run_codes(s, ring, part); });
            stamp(TRACE_STREAMED);
            return;
        }
    }
    with_stream(g.w, g.cols, r0, r1, g.in_place, [&](auto stream) { stream.run(s, ring, part); });
    stamp(TRACE_STREAMED);
}

// A traced instance's TRACE_INPUT: thread 0 stamps once its vectors of the input have landed (the
// empty asm reads one, so the stamp waits for the load).
__device__ inline void stamp_input(const Slice& s) {
    asm volatile("" ::"r"(s.h[0].x));
    stamp(TRACE_INPUT);
}

// gemv_phase against the input as thread t holds it (input(t), a Slice); where SLICED (the model
// kernel) and the rows run in slices (at most 2048 columns), as a group of one in full stages
// (prime_solo), each thread holding the input of the thread whose columns it takes (column_thread).
// The vector's products, sums and rounding are run()'s (run_group), so every output keeps its bits.
// Narrow rows in pair tiles take the same input (their warps' columns are column_thread's).
// CODES: as gemv_phase's.
template <bool SLICED, bool TRACED = false, uint32_t CODES = BF16_ROWS, typename In>
__device__ __forceinline__ void stream_phase(const OpRow& op, In input, Ring& ring, Partials part, uint32_t r0, uint32_t r1) {
    Gemv g;
    // in_slices(g.cols), spelled out: called here it changed the measured kernels' PTX.
    if (SLICED && gemv_of(op, g) && row_slices(g.cols / VEC) > 1) {
        const Slice s = input(column_thread(g.cols));
        if (TRACED) stamp_input(s);
        if constexpr (CODES == NF4_CODES) {
            if (pair_tiled<CODES, SLICED>(g)) return pair_phase<SLICED>(g, s, ring, part, r0, r1);
        }
        const RowStream<1> stream = group_stream<1>(g.w, g.cols / VEC, r0, r1, g.in_place);
        start_solo(stream, ring);
        solo_group(stream, s, stream.n, ring, part, [](uint32_t, const Partials&, uint32_t, uint32_t) {});  // the caller's epilogue follows
        if (TRACED) stamp(TRACE_STREAMED);
        return;
    }
    gemv_phase<CODES, SLICED>(op, input(threadIdx.x), ring, part, r0, r1);
}

// The sum of row r's warp partials, in warp order.
__device__ inline float row_sum(const float* red, uint32_t r) {
    float total = red[r * WARPS];
    for (uint32_t w = 1; w < WARPS; ++w) total += red[r * WARPS + w];
    return total;
}

// A slice of a vector in global memory written earlier in this launch, as thread t holds it (t is this
// thread but where a batch's rows run side by side: RowStream::run_group).
__device__ inline Slice load_slice(const bf16* v, uint32_t len, uint32_t t = threadIdx.x) {
    Slice s;
    s.vecs = len / VEC;
    s.vpt = (s.vecs + THREADS - 1) / THREADS;
#pragma unroll
    for (uint32_t j = 0; j < MAX_VPT; ++j) s.h[j] = owns(s, j, t) ? load_cg(v, t + j * THREADS) : make_uint4(0, 0, 0, 0);
    return s;
}

// The inverse root of the mean square of the block's slice of x (d elements), in every thread: every
// block computes the same sum in the same order.
// `counted`: whether this thread's vectors count (a thread holding another's copy adds +0.0, as a thread
// without vectors does).
__device__ inline float slice_inv_rms(const Slice& s, uint32_t d, float eps, bool counted = true) {
    float acc = 0.0f;
#pragma unroll
    for (uint32_t j = 0; j < MAX_VPT; ++j) acc = sumsq8(s.h[j], acc);  // zero vectors add nothing
    return inv_rms(__fdiv_rn(block_reduce(counted ? acc : 0.0f, Add{}), (float)d), eps);
}

// The slice s of thread t scaled by r and the norm's weights g.
__device__ inline void scale_slice(Slice& s, const bf16* g, float r, uint32_t t = threadIdx.x) {
#pragma unroll
    for (uint32_t j = 0; j < MAX_VPT; ++j) {
        if (owns(s, j, t)) s.h[j] = rms_scale8(s.h[j], __ldg(reinterpret_cast<const uint4*>(g) + t + j * THREADS), r);
    }
}

// rmsnorm(x, g) as a slice, as thread t holds it (this thread's, or in a group stream the one whose
// columns it takes: the norm's sum then counts the first slice's threads, which are every thread's own).
__device__ inline Slice rmsnorm_slice(const bf16* x, const bf16* g, uint32_t d, float eps, uint32_t t = threadIdx.x) {
    Slice s = load_slice(x, d, t);
    scale_slice(s, g, slice_inv_rms(s, d, eps, threadIdx.x == t), t);
    return s;
}

// rmsnorm_slice where a thread holds at most one vector of x (d <= THREADS * VEC; the model kernels'
// rows in slices take it, d <= 2048), as thread t holds it: the same sum, root and scaling on the one
// vector, so the same bits (the other vectors' products in rmsnorm_slice are exact zeros added to a
// sum of squares), with the norm's weights asked for beside x, after the wait, where scale_slice asks
// after the sum's barriers, and without the zero vectors' chain of products.
__device__ inline Slice rmsnorm_one(const bf16* x, const bf16* g, uint32_t d, float eps, uint32_t t) {
    Slice s;
    s.vecs = d / VEC;
    s.vpt = 1;
    const bool own = t < s.vecs;
    s.h[0] = own ? load_cg(x, t) : make_uint4(0, 0, 0, 0);
    const uint4 w = own ? __ldg(reinterpret_cast<const uint4*>(g) + t) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (uint32_t j = 1; j < MAX_VPT; ++j) s.h[j] = make_uint4(0, 0, 0, 0);
    const float acc = sumsq8(s.h[0], 0.0f);
    const float r = inv_rms(__fdiv_rn(block_reduce(threadIdx.x == t ? acc : 0.0f, Add{}), (float)d), eps);
    if (own) s.h[0] = rms_scale8(s.h[0], w, r);
    return s;
}

// rmsnorm(x, g) as stream_phase takes it: rmsnorm_one where SLICED and the rows run in slices (the
// input is then column_thread's), rmsnorm_slice elsewhere.
template <bool SLICED>
__device__ inline Slice rmsnorm_input(const bf16* x, const bf16* g, uint32_t d, float eps, uint32_t t) {
    if (SLICED && in_slices(d)) return rmsnorm_one(x, g, d, eps, t);
    return rmsnorm_slice(x, g, d, eps, t);
}

__device__ inline float bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Element threadIdx.x of v[0, n) (0 past n), for an epilogue that adds it: loaded before the phase's
// stream, it is in a register when the epilogue runs instead of one more round trip at the phase's
// end, where the last block's round trip delays the phase's done count.
__device__ inline float preload(const bf16* v, uint32_t n) { return threadIdx.x < n ? __bfloat162float(__ldcg(v + threadIdx.x)) : 0.0f; }
