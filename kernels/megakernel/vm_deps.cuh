// Blocks and dependencies: which blocks run a program row, the row as a phase reads it (its words, its
// layer's address table, the lane it runs for), and the counters a block waits on and signals.
#pragma once
#include "program.cuh"
#include "vm_memory.cuh"

// The blocks first + i * stride (i < count) that run a phase.
struct BlockSet {
    uint32_t first, count, stride;
};

__device__ inline BlockSet blocks_of(const int64_t* row) {
    const uint64_t w = (uint64_t)row[ROW_BLOCKS];
    return {(uint32_t)(w >> 32) & 0xFFFFu, (uint32_t)w, (uint32_t)(w >> 48) & 0x7FFFu};
}
// A phase row as a phase reads it: its words, in the launch's constant bank, and the address table of
// the layer it runs for, in the same bank (null for one layer, whose rows carry its addresses
// themselves). A reference resolved through the table is a constant-bank load the compiler can hoist
// and reuse; the same table read from shared memory cost about half a microsecond per phase at the
// graded layer (re-read after every shared-memory store; docs/perf.md).
struct OpRow {
    const int64_t* words;
    const int64_t* table;
    // Byte offsets of the lane a batch step runs the row for (run_batch), zero elsewhere: `act` to every
    // activation buffer the row names (each lane has its own arena of them), `cache` to the caches (each
    // sequence its own; zero for the positions of one prompt's chunk).
    int64_t act, cache;
    __device__ int64_t operator[](int i) const { return words[i]; }
};
__device__ inline BlockSet blocks_of(const OpRow& op) { return blocks_of(op.words); }

// Operand `word` of `op` for the layer it runs for.
__device__ inline int64_t layer_address(const OpRow& op, int word) {
    return op.table == nullptr ? op[word] : resolve(op[word], op.table);
}
// Activation buffer `word` of `op`, for the lane it runs for.
template <typename T>
__device__ inline T* act_ptr(const OpRow& op, int word) { return reinterpret_cast<T*>(op[word] + op.act); }
// An optional activation buffer (a partial sums' operand, 0 where the row has none): null stays null.
template <typename T>
__device__ inline T* part_ptr(const OpRow& op, int word) { return reinterpret_cast<T*>(op[word] + (op[word] != 0 ? op.act : 0)); }
// Cache `word` of `op`'s layer, for the sequence of the lane it runs for.
template <typename T>
__device__ inline T* cache_ptr(const OpRow& op, int word) { return reinterpret_cast<T*>(layer_address(op, word) + op.cache); }

// This block's place among the phase's blocks (blocks before `first` wrap to large ranks).
__device__ inline uint32_t rank(const BlockSet& b) { return (blockIdx.x - b.first) / b.stride; }
// Whether this block runs the phase.
__device__ inline bool runs(const BlockSet& b) { return (blockIdx.x - b.first) % b.stride == 0 && rank(b) < b.count; }

// phase_done[p] counts the blocks that have finished phase p, over every layer of every step so far:
// phase p has finished layer l of step `step` (the steps launched before this one) once it reaches
// count * (step * layers + l + 1). The counters are never reset; the comparison is on the signed
// difference, so they may wrap.

// Waits until every phase in the mask `waits` has finished: its own layer's phases (bits from 0) for
// layer l, and the layer before's (bits from PREV_LAYER_WAITS) when the layer is `chained` to one run
// earlier in this launch (a stack's layers after the first; a model's first layer after a step this
// launch ran; otherwise the launch boundary orders the step before). Call with the block converged.
// Thread POLLERS + w checks phase w's bits and polls its count: one thread's walk over every phase's
// bits, with each waited count polled in turn, cost a narrow model 0.17-0.35 us a phase (docs/perf.md,
// "Waits polled in parallel"). POLLERS: 0, or WARP where thread 0 has just issued the phase's prime, so
// that the polls do not wait in thread 0's warp for that issue (the model kernel's bf16 instances
// without q/k norms; docs/perf.md, "The pollers in the second warp").
template <uint32_t POLLERS = 0>
__device__ inline void wait_for(const int64_t* program, uint64_t waits, const unsigned* phase_done, uint32_t step,
                                uint32_t layers, uint32_t l, bool chained) {
    const uint32_t w = threadIdx.x - POLLERS;  // wraps past PROGRAM_MAX_PHASES for the threads before
    if (w < PROGRAM_MAX_PHASES) {
        const bool own = (waits >> w) & 1, before = chained && ((waits >> (PREV_LAYER_WAITS + w)) & 1);
        if (own || before) {
            // The layer before's count, then this layer's (which implies it). For l = 0 the layer before
            // is the step before's last: count * (step * layers) is where that step ended.
            const unsigned target = blocks_of(program + (size_t)w * PROGRAM_ROW_WORDS).count * (step * layers + l + (own ? 1 : 0));
            // Acquire: no read of this phase moves above the observation of the last block's count.
            while ((int)(ld_acquire(&phase_done[w]) - target) < 0) __nanosleep(64);
        }
    }
    __syncthreads();  // the rest of the block waits for the pollers to see every count
}

// Counts this block as done with phase p: call after a __syncthreads that follows every write of it.
__device__ inline void count_done(unsigned* phase_done, uint32_t p) {
    // Release: the block's writes (ordered before thread 0 by the caller's bar.sync) become visible
    // device-wide before the count does.
    if (threadIdx.x == 0) red_release_add(&phase_done[p], 1);
}
