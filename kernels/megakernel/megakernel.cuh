// The megakernel: the whole decoder layer in one persistent launch per token. The layer is compiled
// (megakernel/src/program.rs) into a table of phases, each naming the blocks that run it and
// the phases it waits for; every block of a grid sized to be co-resident walks the table, and for each
// of its phases waits until every block of the phases it depends on has finished them, then does its
// share. In the two-role plan (wide layers) the grid's halves take turns: one streams weights while the
// other runs attention's latency-bound chain, so HBM keeps streaming; and the MLP runs in parts of ffn
// (two, three when ffn is over two of the stream's longest rows), so that Down's first part depends
// only on GateUp's first, finished long before, and no block waits between GateUp and Down (program.rs,
// Plan and compile). The same code runs one phase per launch (phase_begin + 1 ==
// phase_end) for debugging and per-phase timing; the results are bitwise identical because nothing
// else changes.
//
// Weight streaming (the 1.71 GB that decide the score): a GEMV phase splits its rows evenly over the
// blocks, in RoPE / gate-up pairs. A block streams its rows through a ring of STAGES shared-memory
// slots, each filled by one bulk copy of whole consecutive rows (the copy engine, completing on the
// slot's mbarrier), IN_FLIGHT slots ahead of use (STAGES - 1; one in a model's batch steps). Thread t
// owns the 16-byte vectors t, t + THREADS, ... of every row and holds the matching vectors of the
// input in registers; each warp reduces a row with a shuffle butterfly and the warps' partials meet in
// shared memory once, at the end of the phase, where they are added in warp order. A phase's first
// slots are filled before its input exists (before the norm, while the block waits for the phases it
// depends on), so the stream does not stop between phases; attention's first cached rows are loaded
// before its wait too. Weights are not prefetched to L2: bulk prefetches of rows the ring then copies
// made the phases slower (docs/perf.md); the ring's copies mark them evict-first instead. No float
// atomics anywhere: outputs are bitwise reproducible.
//
// Rounding follows the eager reference: q, k, v, a, o, x1, h, h2, gate, up, act and down are rounded to
// bf16 where the reference stores them; scores, maxima and sums stay f32, and the softmax weights are
// rounded to bf16 only as the P V product's operand (the sum is of the rounded weights).
//
// The code is a small machine and its task kinds (the anchors keep one op per file): vm_*.cuh is the
// machine (sizes, memory operations, blocks and counters, the trace, the weight stream, its nf4 form on the tensor cores, a phase's GEMV,
// the interpreter, the model's loop and the batch step), op_*.cuh one file per kind of task. They are
// one translation unit with the kernels that include this file, so ptxas sees (and reports) each
// kernel whole.
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

#include "bulk.cuh"
#include "layer_math.cuh"
#include "program.cuh"
#include "vm_config.cuh"
#include "vm_memory.cuh"
#include "vm_deps.cuh"
#include "vm_trace.cuh"
#include "vm_stream.cuh"
#include "vm_pairs.cuh"
#include "vm_gemv.cuh"
#include "op_qkv.cuh"
#include "op_attention.cuh"
#include "op_oproj.cuh"
#include "op_gateup.cuh"
#include "op_down.cuh"
#include "op_reduce.cuh"
#include "vm_run.cuh"
#include "op_head.cuh"
#include "vm_model.cuh"
#include "vm_batch.cuh"
