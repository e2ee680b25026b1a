// A batch step: up to MAX_BATCH lanes (the sequences of a batch, or the positions of one prompt's
// chunk) through one step of the model, the weights streamed once per group of lanes, each lane's
// values bitwise those of its own decode step.
#pragma once
#include "op_head.cuh"

// A batch step's own arguments (mirrored by BatchArgs in megakernel/src/model/gpu.rs). Lane b decodes
// token[b] at position pos[b] of sequence seq[b]: its activation buffers are lane 0's (the program's)
// plus b act_stride bytes, its caches sequence 0's plus seq[b] cache_stride bytes. Lanes of one sequence
// hold consecutive positions in lane order (a chunk of its prompt): a lane's attention reads what the
// lanes before it wrote in the same Qkv phase, which every block has finished first.
struct BatchArgs {
    int64_t act_stride;
    int64_t cache_stride;
    int32_t* next;  // (lanes): each lane's greedy token, -1 when every logit was NaN
    uint32_t lanes;
    uint32_t token[MAX_BATCH];
    uint32_t pos[MAX_BATCH];
    uint32_t seq[MAX_BATCH];
};
constexpr uint32_t BATCH_ARGS_BYTES = 3 * 8 + 4 + 3 * MAX_BATCH * 4 + 4;
static_assert(sizeof(BatchArgs) == BATCH_ARGS_BYTES, "BatchArgs must have the layout megakernel/src/model/gpu.rs gives it");

// `op` as it runs for lane b.
__device__ inline OpRow lane_op(OpRow op, const BatchArgs& ba, uint32_t b) {
    op.act = (int64_t)b * ba.act_stride;
    op.cache = (int64_t)ba.seq[b] * ba.cache_stride;
    return op;
}

// Where lane b's layers read and write: layer 0 reads its token's embedding row, layer l > 0 the lane's
// row l - 1 of hidden; the last layer writes the lane's row of out, the others their row of hidden.
struct BatchIo {
    const bf16* embed;
    bf16* out;     // (lanes, d)
    bf16* hidden;  // (lanes, layers - 1, d)
    uint32_t d, layers;
    __device__ const bf16* x(const BatchArgs& ba, uint32_t b, uint32_t l) const {
        return l == 0 ? embed + (size_t)ba.token[b] * d : hidden + ((size_t)b * (layers - 1) + l - 1) * d;
    }
    __device__ bf16* y(uint32_t b, uint32_t l) const { return l + 1 == layers ? out + (size_t)b * d : hidden + ((size_t)b * (layers - 1) + l) * d; }
};

// Each lane's inverse root for its norm (lane_norms), in shared memory: a thread's group holds the lanes
// in its own order (group_inputs). And each lane's warp partials of its sum of squares, one array for
// every caller (declared in the template, each instance would have its own).
__shared__ float lane_inv_rms[MAX_BATCH];
__shared__ float lane_sums[MAX_BATCH][WARPS];

// Every lane's inverse root of the mean square of x(b) (d elements) into lane_inv_rms, each sum of
// squares the one rmsnorm_slice takes (every thread its own vectors, block_reduce's order). Every thread
// calls it; the caller has finished every read of lane_inv_rms before.
template <typename X>
__device__ void lane_norms(uint32_t lanes, uint32_t d, float eps, X x) {
    const uint32_t warp = threadIdx.x / WARP;
    // block_reduce's sum for every lane at once: each warp's butterfly, then the warps' partials in warp
    // order.
#pragma unroll
    for (uint32_t b = 0; b < MAX_BATCH; ++b) {
        if (b >= lanes) break;
        const Slice s = load_slice(x(b), d);
        float acc = 0.0f;
#pragma unroll
        for (uint32_t j = 0; j < MAX_VPT; ++j) acc = sumsq8(s.h[j], acc);  // zero vectors add nothing
        acc = warp_reduce(acc, Add{});
        if (threadIdx.x % WARP == 0) lane_sums[b][warp] = acc;
    }
    __syncthreads();  // every lane's warp partials are written
    if (threadIdx.x < lanes) {
        float total = lane_sums[threadIdx.x][0];
        for (uint32_t w = 1; w < WARPS; ++w) total += lane_sums[threadIdx.x][w];
        lane_inv_rms[threadIdx.x] = inv_rms(__fdiv_rn(total, (float)d), eps);
    }
    __syncthreads();  // every lane's root is in shared memory (and the partials read before a later call)
}

// rmsnorm(x, g) for lane b as thread t holds it (load_slice), its root from lane_norms.
__device__ inline Slice lane_rmsnorm(const bf16* x, const bf16* g, uint32_t d, uint32_t b, uint32_t t) {
    Slice s = load_slice(x, d, t);
    scale_slice(s, g, lane_inv_rms[b], t);
    return s;
}

// lanes_gemv for rows in pair tiles (run_pairs): its groups and chunks lanes_group's (and so
// prime_phase's first chunk), a group's lanes B's columns, written once a group (each thread the
// vector of the columns it takes: column_thread), the table once a phase.
template <typename In, typename Out>
__device__ void lanes_pairs(const RowStream<1, NF4_CODES>& all, uint32_t lanes, uint32_t unit, Ring& ring, Partials part, In input, Out epilogue) {
    const uint32_t fit = lanes_per_group(group_of<1>(), unit, part.rows);
    if (fit == 0) __trap();  // the launcher sizes the partials for a unit of rows of every phase
    write_pair_table(ring);  // the slots' upper halves are free: the phase before ended on finish_phase's barrier
    for (uint32_t b0 = 0; b0 < lanes; b0 += fit) {
        const uint32_t live = min(fit, lanes - b0);
        // The group before's columns were last read before its last epilogue's __syncthreads.
        for (uint32_t c = 0; c < live; ++c) write_pair_b(ring, c, input(b0 + c, column_thread(all.vecs * VEC)).h[0]);
        chunk_streams(all, b0, live, chunk_rows(live, unit, part.rows), b0 > 0, ring, part,
                      [&](const RowStream<1, NF4_CODES>& stream) { run_pairs<true>(stream, live, ring, part); }, epilogue);
    }
}

// Rows a block's share of a batch phase without a Qkv's q/k norms comes in (row_unit's). Pairs spelled
// out for the bf16 and fp8 instances, not row_unit's test of the opcode at run time: so their batch
// steps keep the machine code they were measured with (fatbins compared by function).
template <uint32_t CODES>
__device__ inline uint32_t batch_unit(const OpRow& op) {
    if constexpr (CODES == NF4_CODES) return row_unit<CODES, true>(op, nullptr);
    else return 2;
}

// Phase `op`'s GEMV for lanes [0, lanes) over this block's rows [r0, r1) in units of `unit` rows, as
// lanes_group: the weights streamed once per group of lanes (lanes_per_group), each group's rows in
// chunks whose partials fit (chunk_rows). The first group's first chunk is in the ring (prime_phase with
// the lanes); every later stream primes its own. CODES: as streams_codes, the codes decoded once for every
// lane of a group.
template <uint32_t CODES, typename In, typename Out>
__device__ void lanes_gemv(const OpRow& op, uint32_t lanes, uint32_t unit, uint32_t r0, uint32_t r1, Ring& ring, Partials part, In input, Out epilogue) {
    Gemv gemv;
    if (!gemv_of(op, gemv)) __trap();
    const auto groups = [&](auto all) {
        constexpr uint32_t VPT = decltype(all)::VECS_PER_THREAD, G = group_of<VPT>();
        const uint32_t fit = lanes_per_group(G, unit, part.rows);
        if (fit == 0) __trap();  // the launcher sizes the partials for a unit of rows of every phase
        if (row_slices(all.vecs) > 1) zero_partials(part);  // the phase before's epilogue ended on a __syncthreads
        for (uint32_t b0 = 0; b0 < lanes; b0 += fit) {
            const uint32_t live = min(fit, lanes - b0);
            lanes_group<VPT, G>(all, b0, live, chunk_rows(live, unit, part.rows), b0 > 0, ring, part, input, epilogue);
        }
    };
    if constexpr (CODES == NF4_CODES) {
        if (pair_tiled<CODES, true>(gemv)) return lanes_pairs(pair_stream<true>(gemv, r0, r1), lanes, unit, ring, part, input, epilogue);
    }
    if constexpr (CODES != BF16_ROWS) {
        // Packed (the loader packs every coded matrix): no row source to read.
        if (streams_codes(gemv)) return with_stream<CODES>(gemv.w, gemv.cols, r0, r1, false, [&](auto all) { groups(with_scales(all, gemv)); });
    }
    with_stream(gemv.w, gemv.cols, r0, r1, gemv.in_place, groups);
}

// Phase `op` of a batch step for every lane (`l` its layer): the GEMV phases through lanes_gemv, with
// each lane's input and epilogue those of the decode step's phase; attention lane after lane. CODES: the
// GEMVs as streams_codes (the model kernel's batch steps for fp8 and nf4 checkpoints).
template <uint32_t CODES>
__device__ void batch_phase(const OpRow& op, uint32_t l, const ModelArgs& m, const BatchArgs& ba, const BatchIo& io, Ring& ring, Partials part) {
    const uint32_t lanes = ba.lanes;
    uint32_t r0, r1;
    switch (op[0]) {
        case OP_NOP: break;
        case OP_QKV: {
            const bf16* norms = m.qk_norms[l];
            gemv_rows<CODES, true>(op, r0, r1, norms);
            const uint32_t d = (uint32_t)op[qkv::D];
            lane_norms(lanes, d, __int_as_float((int)op[qkv::EpsBits]), [&](uint32_t b) { return io.x(ba, b, l); });
            const auto input = [&](uint32_t b, uint32_t t) { return lane_rmsnorm(io.x(ba, b, l), reinterpret_cast<const bf16*>(layer_address(op, qkv::Norm)), d, b, t); };
            const uint32_t unit = row_unit<CODES, true>(op, norms);
            if (norms != nullptr) {
                lanes_gemv<CODES>(op, lanes, unit, r0, r1, ring, part, input,
                             [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) { qkv_normed_epilogue(lane_op(op, ba, b), ba.pos[b], ring, p, norms, c0, c1); });
            } else {
                lanes_gemv<CODES>(op, lanes, unit, r0, r1, ring, part, input, [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) {
                    const OpRow lop = lane_op(op, ba, b);
                    const QkvOut out = qkv_out(lop, ba.pos[b]);
                    qkv_epilogue(lop, ba.pos[b], out, p, c0, c1, rope_first(lop, out, c0, c1));
                });
            }
            break;
        }
        case OP_ATTENTION: {
            // Each lane has its own partials and counters, so a team of one lane never meets another
            // lane's arrivals. Where every lane's items fit the teams, the lanes run side by side, lane b's
            // items on the teams after the lanes before it (each item its own team, as a head's splits
            // must all run at once: AttnItems); else lane after lane over all of them. Lane 0's first
            // chunks were primed (batch_prime) on the teams a decode step gives them either way.
            uint32_t total = 0;
            for (uint32_t b = 0; b < lanes; ++b) total += AttnItems(op, ba.pos[b]).count;
            const bool side_by_side = total <= blocks_of(op).count * TEAMS;
            for (uint32_t b = 0, base = 0; b < lanes; ++b) {
                phase_attention(lane_op(op, ba, b), ba.pos[b], ring.data, b == 0, side_by_side ? base : 0);
                base += AttnItems(op, ba.pos[b]).count;
            }
            break;
        }
        // The O projection and Down written out apiece: folded into one function taking their residual
        // and destination as lambdas, ptxas gave this kernel a 504-byte stack frame for 448 and more
        // spill loads (ptxas's report).
        case OP_O_PROJ:
            gemv_rows<CODES, true>(op, r0, r1);
            lanes_gemv<CODES>(
                op, lanes, batch_unit<CODES>(op), r0, r1, ring, part, [&](uint32_t b, uint32_t t) { return load_slice(act_ptr<const bf16>(lane_op(op, ba, b), oproj::A), (uint32_t)op[oproj::Cols], t); },
                [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) {
                    const OpRow lop = lane_op(op, ba, b);
                    residual_epilogue(residual_out(io.x(ba, b, l), act_ptr<bf16>(lop, oproj::X1Out), part_ptr<const float>(lop, oproj::PartIn), part_ptr<float>(lop, oproj::PartOut), c0, c1), p, c0, c1);
                });
            break;
        case OP_GATE_UP: {
            const uint32_t d = (uint32_t)op[gateup::D];
            const auto x1 = [&](uint32_t b) { return act_ptr<const bf16>(lane_op(op, ba, b), gateup::X1); };
            lane_norms(lanes, d, __int_as_float((int)op[gateup::EpsBits]), x1);
            gemv_rows<CODES, true>(op, r0, r1);
            lanes_gemv<CODES>(
                op, lanes, batch_unit<CODES>(op), r0, r1, ring, part, [&](uint32_t b, uint32_t t) { return lane_rmsnorm(x1(b), reinterpret_cast<const bf16*>(layer_address(op, gateup::Norm)), d, b, t); },
                [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) { gateup_epilogue(act_ptr<bf16>(lane_op(op, ba, b), gateup::ActOut), p, c0, c1); });
            break;
        }
        case OP_DOWN:
            gemv_rows<CODES, true>(op, r0, r1);
            lanes_gemv<CODES>(
                op, lanes, batch_unit<CODES>(op), r0, r1, ring, part, [&](uint32_t b, uint32_t t) { return load_slice(act_ptr<const bf16>(lane_op(op, ba, b), down::Act), (uint32_t)op[down::Cols], t); },
                [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) {
                    const OpRow lop = lane_op(op, ba, b);
                    residual_epilogue(residual_out(act_ptr<const bf16>(lop, down::X1), io.y(b, l), part_ptr<const float>(lop, down::PartIn), part_ptr<float>(lop, down::PartOut), c0, c1), p, c0, c1);
                });
            break;
        default: __trap();  // an unknown opcode is a broken program
    }
}

// Lanes a group of the LM head holds (group_of for rows of d).
__device__ inline uint32_t head_group(uint32_t d) { return max(1u, MAX_BATCH / ((d / VEC + THREADS - 1) / THREADS)); }

// The LM head's rows [r0, r1) of this block for lanes [b0, b0 + live) through run_group<G>: each
// lane's logits (its row of m.logits) from rmsnorm of its row of out, and its best row into
// candidates[lane][block]. The rows go through the partials in chunks of part.rows / G, the first one
// in the ring already, each next one primed while the one before is summed.
template <uint32_t VPT, uint32_t G>
__device__ void head_lanes(const ModelArgs& m, const bf16* out, uint32_t d, uint32_t b0, uint32_t live, uint32_t r0, uint32_t r1,
                           Ring& ring, Partials part) {
    const uint32_t chunk = part.rows / G, vecs = d / VEC;
    float h[G][VPT][VEC];
    group_inputs<VPT, G>(h, live, column_thread(d), [&](uint32_t g, uint32_t t) { return lane_rmsnorm(out + (size_t)(b0 + g) * d, m.final_norm, d, b0 + g, t); });
    uint64_t best[G] = {};
    for (uint32_t c0 = r0; c0 < r1; c0 += chunk) {
        const uint32_t c1 = min(c0 + chunk, r1);
        group_stream<VPT>(m.head, vecs, c0, c1, false).template run_group<G>(h, live, ring, part);
        // The ring is free: run_group ended on a __syncthreads after its last read of it.
        if (c1 < r1) group_stream<VPT>(m.head, vecs, c1, min(c1 + chunk, r1), false).prime(ring);
#pragma unroll
        for (uint32_t g = 0; g < G; ++g) {
            if (g >= live) continue;
            float* logits = m.logits + (size_t)(b0 + g) * m.vocab;
            for (uint32_t r = threadIdx.x; r < c1 - c0; r += THREADS) {
                const float v = row_sum(part.red + (size_t)g * (c1 - c0) * WARPS, r);
                logits[c0 + r] = v;
                best[g] = max(best[g], logit_key(v, c0 + r));
            }
        }
        __syncthreads();  // every read of the partials comes before the next chunk's stream writes them
    }
#pragma unroll
    for (uint32_t g = 0; g < G; ++g) {
        if (g >= live) continue;
        const uint64_t key = block_max_u64(best[g]);
        if (threadIdx.x == 0) m.candidates[(size_t)(b0 + g) * gridDim.x + blockIdx.x] = key;
    }
}

// The LM head for every lane (head_lanes), a group of lanes at a time: the first group's first chunk was
// primed before the head's wait (prime_head), each later group streams the rows again.
__device__ void batch_head(const ModelArgs& m, const BatchArgs& ba, const bf16* out, uint32_t d, Ring& ring, Partials part) {
    uint32_t r0, r1;
    head_rows(m.vocab, r0, r1);
    with_stream(m.head, d, r0, r1, false, [&](auto all) {
        constexpr uint32_t VPT = decltype(all)::VECS_PER_THREAD, G = group_of<VPT>();
        if (row_slices(all.vecs) > 1) zero_partials(part);  // the last layer's phases ended on a __syncthreads
        lane_norms(ba.lanes, d, __int_as_float((int)m.eps_bits), [&](uint32_t b) { return out + (size_t)b * d; });
        for (uint32_t b0 = 0; b0 < ba.lanes; b0 += G) {
            // The ring is free: the group before ended on a __syncthreads after its last read of it.
            if (b0 > 0) group_stream<VPT>(m.head, all.vecs, r0, min(r0 + part.rows / G, r1), false).prime(ring);
            head_lanes<VPT, G>(m, out, d, b0, min(G, ba.lanes - b0), r0, r1, ring, part);
        }
    });
}

// Block 0: each lane's greedy token, once every block has counted its head phase (the `heads`-th): the
// maximum of the lane's candidates, as next_token takes it.
__device__ inline void batch_tokens(const ModelArgs& m, const BatchArgs& ba, const unsigned* phase_done, uint32_t heads) {
    if (threadIdx.x == 0) {
        // Acquire: the candidates are read only after every block's count was seen.
        while ((int)(ld_acquire(&phase_done[HEAD_COUNTER]) - gridDim.x * heads) < 0) __nanosleep(64);
    }
    __syncthreads();  // the rest of the block waits for thread 0 to see every count
    const uint32_t warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    for (uint32_t b = warp; b < ba.lanes; b += WARPS) {
        uint64_t best = 0;
        for (uint32_t k = lane; k < gridDim.x; k += WARP) best = max(best, (uint64_t)__ldcg(reinterpret_cast<const unsigned long long*>(m.candidates) + (size_t)b * gridDim.x + k));
        best = warp_max_u64(best);
        if (lane == 0) ba.next[b] = best == 0 ? -1 : (int32_t)(UINT32_MAX - (uint32_t)best);
    }
}

// Before the wait of phase f of a batch step, what does not depend on the step (as prime_inputs): a GEMV
// phase's first stream of lanes_gemv, or lane 0's first cached rows for its attention.
template <uint32_t CODES>
__device__ inline void batch_prime(const Walk<PROGRAM_MAX_LAYERS>& walk, uint32_t f, const ModelArgs& m, const BatchArgs& ba, const Ring& ring, const Partials& part) {
    const OpRow op = lane_op(walk.op(f), ba, 0);
    if (op[0] == OP_ATTENTION) prime_attention(op, ba.pos[0], ring.data);
    else prime_phase<false, CODES, true>(op, ring, m.qk_norms[f / walk.phases], ba.lanes, part.rows);
}

// One step of every lane of `ba` through the model, in one launch: the stack's phases as run_model runs
// a position's (each phase for every lane before it counts done), then the head for every lane and,
// in block 0, each lane's greedy token. The model's positions, tokens, done counts and end-of-sequence
// tokens are not read: a batch step is one step, its lanes given. CODES: the GEMVs whose rows are too wide
// for slices stream as that format's codes (streams_codes), as its decode steps do; not with q/k
// norms, whose Qkv phase streams bf16 rows.
template <uint32_t CODES = BF16_ROWS>
__device__ __forceinline__ void run_batch(const Program<PROGRAM_MAX_LAYERS>& program, const ModelArgs& m, const BatchArgs& ba, uint32_t phases, uint32_t layers,
                                          bf16* out, bf16* hidden, uint32_t d, uint32_t step, unsigned* phase_done, uint32_t red_rows) {
    __shared__ uint64_t full[STAGES];
    Ring ring = start_ring(full);
    const Partials part = row_partials(red_rows);
    // The launcher checks these.
    if (phases > PROGRAM_MAX_PHASES || layers > PROGRAM_MAX_LAYERS || ba.lanes == 0 || ba.lanes > MAX_BATCH || (CODES != BF16_ROWS && m.qk_norms[0] != nullptr)) __trap();
    for (uint32_t b = 0; b < ba.lanes; ++b) {
        if (ba.pos[b] >= m.max_seq || ba.token[b] >= m.vocab) __trap();
    }
    if (threadIdx.x == 0) trace_row = nullptr;  // a batch step is not traced
    fill_codebook<CODES>(ring);
    const Walk<PROGRAM_MAX_LAYERS> walk{program, phases, layers};
    const BatchIo io{m.embed, out, hidden, d, layers};
    const uint32_t per_step = phases * layers;
    uint32_t f = walk.next_own(0, per_step);
    if (f < per_step) batch_prime<CODES>(walk, f, m, ba, ring, part);
    while (f < per_step) {
        const OpRow op = walk.op(f);
        wait_for(program.words, (uint64_t)op[ROW_WAITS], phase_done, step, layers, f / phases, f >= phases);
        batch_phase<CODES>(op, f / phases, m, ba, io, ring, part);
        finish_phase(phase_done, f % phases);
        f = walk.next_own(f + 1, per_step);
        if (f < per_step) batch_prime<CODES>(walk, f, m, ba, ring, part);
    }
    prime_head<false>(m, d, ring, part.rows / head_group(d), true);
    // Every row of the last layer, as the layer before the head: every lane's output is whole.
    wait_for(program.words, ((1ull << phases) - 1) << PREV_LAYER_WAITS, phase_done, step, layers, layers, true);
    batch_head(m, ba, out, d, ring, part);
    finish_phase(phase_done, HEAD_COUNTER);
    if (blockIdx.x == 0) batch_tokens(m, ba, phase_done, m.heads_before + 1);
}
