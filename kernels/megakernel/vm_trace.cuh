// The phase trace (`grader profile`, and `megakernel bench --trace` in the model kernel's traced
// instances): each block's global-timer stamps of each phase it runs.
#pragma once
#include "vm_config.cuh"

// The stamps of a phase: when the block starts its work (its dependencies met); for a GEMV phase, when
// its input is in registers (norm or load done) and when its stream's last stage is reduced (in the
// model kernel's traced instances, an attention phase's thread 0 too: when its team's first chunk has
// landed and when its item's last chunk is summed); and when the whole block has finished the phase.
// The gap to the block's next phase's start is waiting. Beside the times, not a time: the SM the block
// ran on, written with its start (which SMs a phase's late blocks run on: docs/perf.md, "Where the
// later blocks' time comes from").
constexpr uint32_t TRACE_START = 0;
constexpr uint32_t TRACE_INPUT = 1;
constexpr uint32_t TRACE_STREAMED = 2;
constexpr uint32_t TRACE_END = 3;
constexpr uint32_t TRACE_SM = 4;
constexpr uint32_t TRACE_STAMPS = 5;

// Where this block's stamps of the current phase go (null in every graded or timed launch). In shared memory,
// not a parameter of every phase function, so that tracing costs the stream no register.
__shared__ uint64_t* trace_row;

// Thread 0 writes the global timer (ns) into the current phase's stamp `which`; nothing when not
// tracing. A plain store: the host reads the trace after the launch has finished.
__device__ inline void stamp(uint32_t which) {
    if (threadIdx.x != 0 || trace_row == nullptr) return;
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
    trace_row[which] = ns;
    if (which == TRACE_START) {
        uint32_t sm;
        asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
        trace_row[TRACE_SM] = sm;
    }
}
