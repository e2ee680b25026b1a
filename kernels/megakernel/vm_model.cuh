// A model's generation in one launch: every position runs the stack's program, from the prompt's last
// position on with the head and the greedy token, until an end-of-sequence token, max_new tokens or
// the caches' end.
#pragma once
#include "op_head.cuh"

__device__ inline bool is_eos(const ModelArgs& m, int32_t token) {
    for (uint32_t i = 0; i < m.eos_count && i < MODEL_MAX_EOS; ++i) {
        if ((uint32_t)token == m.eos[i]) return true;
    }
    return false;
}

// Positions pos0, pos0 + 1, ... of a model through the stack's program, in one launch: each position's
// layer 0 reads its token's embedding row (no copy), the stack runs as one step, and from the prompt's
// last position on the head phase turns the last layer's output into logits and every block takes the
// greedy token, which is the next position's; the prompt's earlier positions skip the head. Every
// block stops at the same position: at an end-of-sequence token, after max_new tokens, or at the
// caches' end. Steps chain as a stack's layers do: a position's first layer waits for the phases of
// the position before's last layer that it would wait for in a stack, and its Qkv waits for the whole
// of the Down before it, so every block has finished the step before (and read its token) first.
// TRACED: the instance stamps into `trace` (null in the others) each block's phases at every position
// the launch runs, (positions, gridDim.x, layers * phases + 1, TRACE_STAMPS), the head's last (zero for
// the phases and stamps a block does not take). CODES: the rows too wide for slices stream as that
// format's codes (streams_codes; not with q/k norms, whose Qkv phase streams bf16 rows).
template <bool QK_NORM, bool SLICED, bool TRACED, uint32_t CODES = BF16_ROWS>
__device__ __forceinline__ void run_model(const Program<PROGRAM_MAX_LAYERS>& program, const ModelArgs& m, uint32_t phases, uint32_t layers,
                                          bf16* out, bf16* hidden, uint32_t d, uint32_t step, unsigned* phase_done, uint32_t red_rows,
                                          uint64_t* trace) {
    __shared__ uint64_t full[STAGES];
    Ring ring = start_ring(full);
    const Partials part = row_partials(red_rows);
    // The launcher checks these.
    if (phases > PROGRAM_MAX_PHASES || layers > PROGRAM_MAX_LAYERS || m.pos0 >= m.prompt_end || m.prompt_end > m.max_seq || m.max_new == 0) __trap();
    if (threadIdx.x == 0) trace_row = nullptr;  // set per phase in the traced instances only
    fill_codebook<CODES>(ring);
    const Walk<PROGRAM_MAX_LAYERS> walk{program, phases, layers};
    const uint32_t per_step = phases * layers;
    // Phase f's q/k norm weights: null at compile time in the instance for models without them.
    const auto norms = [&](uint32_t f) -> const bf16* { return QK_NORM ? m.qk_norms[f / phases] : nullptr; };
    // The loop's state in shared memory, written by thread 0 between barriers: this step's io, the next
    // token, and the head phases run (the tokens generated are its offset from m.heads_before). Held
    // in registers across the phases (where the layer kernels' io is in their parameters), it spilled
    // 40 bytes (megakernel/src/kernels.rs has what each instance spills now, and why).
    __shared__ StepIo io;
    __shared__ int32_t token;
    __shared__ uint32_t heads;
    if (threadIdx.x == 0) {
        io = StepIo{m.embed + (size_t)m.tokens[m.pos0] * d, out, hidden, d, m.pos0, step};
        heads = m.heads_before;
    }
    __syncthreads();  // the first step's io is written
    // Where this block's stamps of phase f (per_step: the head) of the running position go.
    const auto trace_at = [&](uint32_t f) -> uint64_t* {
        return !TRACED ? nullptr : trace + (((size_t)(io.step - step) * gridDim.x + blockIdx.x) * (per_step + 1) + f) * TRACE_STAMPS;
    };
    uint32_t f = walk.next_own(0, per_step);
    static_assert(!(QK_NORM && CODES != BF16_ROWS), "the q/k-norm Qkv phase streams bf16 rows");
    // The waits' pollers in the second warp in the bf16 instances without q/k norms (wait_for). In the
    // q/k-norm instance the move spilled more and Qwen3-0.6B gained nothing, and the judge's layer
    // kernels timed slower with it (docs/perf.md, "The pollers in the second warp"); the fp8 and nf4
    // instances keep the machine code they were timed with.
    constexpr uint32_t POLLERS = !QK_NORM && CODES == BF16_ROWS ? WARP : 0;
    if (f < per_step) prime_inputs<SLICED, CODES>(walk.op(f), ring, io.pos, norms(f));
    for (;;) {
        while (f < per_step) {
            run_phase<PROGRAM_MAX_LAYERS, SLICED, TRACED, !QK_NORM, false, CODES, POLLERS>(walk, f, io.step != step || f >= phases, io, phase_done, ring, part,
                                                                                         trace_at(f), norms(f));
            f = walk.next_own(f + 1, per_step);
            if (f < per_step) prime_inputs<SLICED, CODES>(walk.op(f), ring, io.pos, norms(f));
        }
        const uint32_t pos = io.pos;
        bool stop = false;
        if (pos + 1 >= m.prompt_end) {
            // The q/k-norm instance streams the head in full stages where rows of d run in slices
            // (phase_head_solo says why that instance alone).
            if (QK_NORM && in_slices(d)) prime_solo(head_solo_stream(m, d), ring);
            else prime_head<SLICED>(m, d, ring, part.rows);
            // Every row of the last layer, as the layer before the head: its output is whole.
            if (TRACED && threadIdx.x == 0) trace_row = trace_at(per_step);
            wait_for<POLLERS>(program.words, ((1ull << phases) - 1) << PREV_LAYER_WAITS, phase_done, io.step, layers, layers, true);
            if (TRACED) stamp(TRACE_START);
            if (QK_NORM && in_slices(d)) phase_head_solo(m, out, d, ring, part);
            else phase_head<SLICED>(m, out, d, ring, part);
            finish_phase(phase_done, HEAD_COUNTER);
            const int32_t next = next_token(m, phase_done, heads + 1);
            // Only this block writes generated tokens, and no block reads them: each has its own copy.
            if (blockIdx.x == 0 && threadIdx.x == 0) m.tokens[pos + 1] = next;
            stop = next < 0 || is_eos(m, next) || heads + 1 - m.heads_before == m.max_new || pos + 1 == m.max_seq;
            __syncthreads();  // every thread has read the head count
            if (threadIdx.x == 0) {
                token = next;
                heads += 1;
            }
        } else if (threadIdx.x == 0) {
            token = m.tokens[pos + 1];  // given by the host: no block writes it
        }
        if (stop) break;
        __syncthreads();  // every thread has read this step's io; the next token is written
        if (threadIdx.x == 0) io = StepIo{m.embed + (size_t)token * d, out, hidden, d, pos + 1, io.step + 1};
        __syncthreads();  // the next step's io is written
        // The next position's first weights (the ring is free: the last phase ended on finish_phase).
        f = walk.next_own(0, per_step);
        if (f < per_step) prime_inputs<SLICED, CODES>(walk.op(f), ring, pos + 1, norms(f));
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        m.done[0] = io.step - step + 1;
        m.done[1] = heads - m.heads_before;
    }
}
