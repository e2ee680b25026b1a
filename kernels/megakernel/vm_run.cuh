// The interpreter: a block's ring and partials in shared memory, the walk over a program's rows (a
// phase is row f % phases of layer f / phases), and run_program, the layer and stack kernels' step:
// each block runs the rows that name it, priming each row's inputs before waiting for its
// dependencies.
#pragma once
#include "op_qkv.cuh"
#include "op_attention.cuh"
#include "op_oproj.cuh"
#include "op_gateup.cuh"
#include "op_down.cuh"
#include "op_reduce.cuh"

// 128-byte aligned: where dynamic shared memory starts depends on the static variables before it, and
// ring slots 16 bytes off a 32-byte boundary made every bulk copy, so every GEMV phase, about 25% slower
// (measured in docs/perf.md). RING_BYTES of ring, then red_rows * WARPS floats of row partials.
extern __shared__ __align__(128) uint4 smem[];

// This block's ring over the dynamic shared memory, its barriers `full` initialised. Call once, first.
__device__ inline Ring start_ring(uint64_t* full) {
    if (blockDim.x != THREADS) __trap();
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < STAGES; ++s) mbar_init(&full[s], 1);  // one arrival: thread 0's expect_tx
        // Make the initialised barriers visible to the copy engine before any copy names them.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // every thread sees initialised barriers before waiting on them
    return Ring{smem, full, 0};
}

// The row partials after the ring: red_rows rows of WARPS floats.
__device__ inline Partials row_partials(uint32_t red_rows) { return Partials{reinterpret_cast<float*>(smem + RING_BYTES / 16), red_rows}; }

// The program as the kernels walk it: phase f, numbered over every layer, is row f % phases run for
// layer f / phases.
template <uint32_t TABLES>
struct Walk {
    const Program<TABLES>& program;
    uint32_t phases, layers;
    __device__ const int64_t* row(uint32_t f) const { return program.words + (size_t)(f % phases) * PROGRAM_ROW_WORDS; }
    // Phase f's row for its layer (one layer: the rows hold its addresses, no table).
    __device__ OpRow op(uint32_t f) const { return OpRow{row(f), TABLES == 1 ? nullptr : program.tables[f / phases], 0, 0}; }
    // The first phase in [f, end) that this block runs (end if none).
    __device__ uint32_t next_own(uint32_t f, uint32_t end) const {
        while (f < end && !runs(blocks_of(row(f)))) ++f;
        return f;
    }
};

// Where a step's layers read and write: layer 0 reads x, layer l > 0 row l - 1 of hidden; the last
// layer writes out, the others their row of hidden. `step` counts the steps run before this one.
struct StepIo {
    const bf16* x;
    bf16* out;
    bf16* hidden;
    uint32_t d, pos, step;
};

// Ends this block's share of a phase and counts it done on `counter`. The next phase's first weights
// (or attention's cached rows) are to stream in while the block waits for that phase's dependencies,
// across layers too, so the ring must be free: once every thread is past this phase. Attention wrote
// it with ordinary stores, so each thread orders those before the copy engine's writes (proxy fence),
// then the block synchronises before thread 0 issues (and before it counts the phase done: every write
// of the phase precedes the count).
__device__ inline void finish_phase(unsigned* phase_done, uint32_t counter) {
    fence_proxy_async();
    __syncthreads();
    stamp(TRACE_END);
    count_done(phase_done, counter);
}

// Starts loading what phase `op` reads that no phase of this step writes, before the block waits for
// the phases it depends on: a GEMV phase's first weights, or an attention phase's cached rows.
// `qk_norms`: the layer's q/k norm weights, or null (see qkv_unit). CODES: as streams_codes.
template <bool SLICED, uint32_t CODES = BF16_ROWS>
__device__ void prime_inputs(const OpRow& op, const Ring& ring, uint32_t pos, const bf16* qk_norms) {
    if (op[0] == OP_ATTENTION) prime_attention(op, pos, ring.data);
    else prime_phase<SLICED, CODES>(op, ring, qk_norms);
}

// Attention as a call of its own. In the model kernels' instances without q/k norms, inlined, ptxas's
// allocation of the whole kernel moved with any change to attention (its tiles trimmed to the live
// slots: the narrow-rows instance from 4 to 136 bytes spilled); called, attention keeps its own
// registers and the kernel spills none. In the q/k-norm instance the call spilled 368 bytes, so it stays
// inline there, as in the judge's kernels, which spill nothing either way (docs/perf.md, "Attention on
// blocks of its own").
// BY_VALUE: the row is the call's argument in registers. By reference it stays in the caller's frame,
// and the call re-read its words, table and cache offset (three local loads) before each 16-byte copy
// of the cache's rows: 50 local loads in the sliced bf16 instance, 2 by value. The instances for fp8
// and nf4 codes keep the reference: by value their allocation spilled more (sliced nf4 936 to 1636
// bytes loaded; docs/perf.md, "The normed input from its producers' vector sums").
template <bool BY_VALUE>
struct RowArg {
    using T = const OpRow&;
};
template <>
struct RowArg<true> {
    using T = OpRow;
};
template <bool TRACED, bool BY_VALUE>
__device__ __noinline__ void attention_call(typename RowArg<BY_VALUE>::T op, uint32_t pos, uint4* smem) {
    phase_attention<TRACED>(op, pos, smem, true);
}

// Runs phase f of the step on this block, which runs it: waits for the phases it depends on (those of
// the layer before too when `chained`, see wait_for), does its share, counts it done. `trace_at`: the
// phase's stamps, or null. `qk_norms`: the layer's q/k norm weights (a model's with them), or null.
// SLICED: narrow rows stream as groups of one (stream_phase), in the model kernel; the layer and stack
// kernels keep their measured machine code. The GEMV phases are forced inline into it: as a call,
// ptxas saves the caller's registers around it (the model kernel spilled 120 bytes when the inliner
// left phase_gateup out). ATTN_CALL: attention through attention_call (the model kernels' instances
// without q/k norms). SPLIT: the split kernel's, which also runs Reduce rows (op_reduce.cuh); the other
// kernels' instances compile none of it, so their machine code is what it was. CODES: the model
// kernel's instances for fp8 and nf4 checkpoints (streams_codes). POLLERS: as wait_for's.
template <uint32_t TABLES, bool SLICED, bool TRACED = false, bool ATTN_CALL = false, bool SPLIT = false, uint32_t CODES = BF16_ROWS,
          uint32_t POLLERS = 0>
__device__ __forceinline__ void run_phase(const Walk<TABLES>& walk, uint32_t f, bool chained, const StepIo& io, unsigned* phase_done,
                                          Ring& ring, const Partials& part, uint64_t* trace_at, const bf16* qk_norms) {
    const OpRow op = walk.op(f);
    const uint32_t l = f / walk.phases;
    wait_for<POLLERS>(walk.program.words, (uint64_t)op[ROW_WAITS], phase_done, io.step, walk.layers, l, chained);
    // Thread 0 alone sets and reads the trace row: no synchronisation needed.
    if (threadIdx.x == 0) trace_row = trace_at;
    stamp(TRACE_START);
    const bf16* x_l = l == 0 ? io.x : io.hidden + (size_t)(l - 1) * io.d;
    bf16* out_l = l + 1 == walk.layers ? io.out : io.hidden + (size_t)l * io.d;
    if constexpr (SPLIT) {
        if (op[0] == OP_REDUCE) {
            phase_reduce(op, x_l, out_l);
            finish_phase(phase_done, f % walk.phases);
            return;
        }
    }
    switch (op[0]) {
        case OP_NOP: break;
        case OP_QKV:
            if (qk_norms != nullptr) phase_qkv_normed<TRACED>(op, x_l, io.pos, ring, part, qk_norms);
            else phase_qkv<SLICED, TRACED, CODES>(op, x_l, io.pos, ring, part);
            break;
        case OP_ATTENTION:
            if (ATTN_CALL) attention_call<TRACED, CODES == BF16_ROWS>(op, io.pos, ring.data);
            else phase_attention<TRACED>(op, io.pos, ring.data, true);
            break;
        case OP_O_PROJ: phase_oproj<SLICED, TRACED, CODES>(op, x_l, ring, part); break;
        case OP_GATE_UP: phase_gateup<SLICED, TRACED, CODES>(op, ring, part); break;
        case OP_DOWN: phase_down<SLICED, TRACED, CODES>(op, out_l, ring, part); break;
        default: __trap();  // an unknown opcode is a broken program
    }
    finish_phase(phase_done, f % walk.phases);
}

// Runs phases [phase_begin, phase_end) of step `step` of the program over a stack of `layers` layers,
// the phases numbered flat (phase f is row f % phases of layer f / phases): each block runs the phases
// that name it, each after the phases it waits for. The grid must be co-resident, or a block could wait
// for one not yet running (the launcher uses a cooperative launch). A step's phases run in order from
// phase 0, in one launch or several (the launcher enforces it), so that the counts a phase waits for
// are this step's. `trace`, when not null, receives each block's phase stamps (zero for the phases it
// does not run, and for the stamps a phase does not take). SLICED: as run_phase's, for layers with
// rows of at most 2048 columns somewhere (the launcher picks the instance); SPLIT: as run_phase's.
template <uint32_t TABLES, bool SLICED, bool SPLIT = false>
__device__ __forceinline__ void run_program(const Program<TABLES>& program, uint32_t phases, uint32_t layers, uint32_t phase_begin,
                                            uint32_t phase_end, const bf16* x, bf16* out, bf16* hidden, uint32_t d, uint32_t pos,
                                            uint32_t step, unsigned* phase_done, uint32_t red_rows, uint64_t* trace) {
    __shared__ uint64_t full[STAGES];
    Ring ring = start_ring(full);
    const Partials part = row_partials(red_rows);
    // The launcher checks these; a bigger range reads past the tables.
    if (phases > PROGRAM_MAX_PHASES || layers > TABLES || phase_end > phases * layers) __trap();
    const Walk<TABLES> walk{program, phases, layers};
    const StepIo io{x, out, hidden, d, pos, step};
    const uint32_t traced = phase_end - phase_begin;
    uint32_t f = walk.next_own(phase_begin, phase_end);
    // Each phase's first weights stream in before it waits (see finish_phase).
    if (f < phase_end) prime_inputs<SLICED>(walk.op(f), ring, pos, nullptr);
    while (f < phase_end) {
        run_phase<TABLES, SLICED, false, false, SPLIT>(walk, f, f >= phases, io, phase_done, ring, part,
                  trace == nullptr ? nullptr : trace + ((size_t)blockIdx.x * traced + (f - phase_begin)) * TRACE_STAMPS, nullptr);
        f = walk.next_own(f + 1, phase_end);
        if (f < phase_end) prime_inputs<SLICED>(walk.op(f), ring, pos, nullptr);
    }
}

// The parameters of the kernels that run a program (megakernel.cu's, split.cu's), and the call of
// run_program with them.
#define MEGAKERNEL_PARAMS(TABLES)                                                                                             \
    const __grid_constant__ Program<TABLES> program, /* by value: see program.cuh */                                        \
        uint32_t phases,                             /* rows of the program: one layer's phases */                          \
        uint32_t layers, uint32_t phase_begin, uint32_t phase_end, const bf16* __restrict__ x, /* (d) */                    \
        bf16* __restrict__ out,                      /* (d) */                                                              \
        bf16* __restrict__ hidden,                   /* (layers - 1, d); null for one layer */                              \
        uint32_t d, uint32_t pos, uint32_t step,     /* steps launched before this one */                                   \
        unsigned* __restrict__ phase_done,           /* (PROGRAM_MAX_PHASES): see wait_for */                               \
        uint32_t red_rows, uint64_t* __restrict__ trace /* (gridDim.x, phase_end - phase_begin, TRACE_STAMPS) or null */
#define MEGAKERNEL_ARGS program, phases, layers, phase_begin, phase_end, x, out, hidden, d, pos, step, phase_done, red_rows, trace
