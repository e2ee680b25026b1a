// The megakernel's program format, mirrored from megakernel/src/program.rs (the one
// source of truth; a test there checks every constant below against this file). A program is an
// int64 table of PROGRAM_ROW_WORDS words per phase: word 0 the opcode, then the op's operands, and
// the last two words the blocks that run the phase and the phases it waits for (ROW_BLOCKS, ROW_WAITS).
// The step's own arguments (x, out, hidden, pos) are kernel parameters, not table entries: QKV and
// OPROJ read the layer's input (x, or the layer before's row of hidden), DOWN writes its output (its
// row of hidden, or out for the last layer).
#pragma once
#include <stdint.h>

constexpr int PROGRAM_ROW_WORDS = 16;
// The table travels by value, as one kernel parameter of PROGRAM_MAX_PHASES rows (the rows after the
// program's are no-ops that no block runs): its words then sit in the launch's constant bank, so reading an operand costs
// no memory round trip. Read from global memory with L2 cold, the first row took about 6 us to arrive
// and the first weight copies and x's load waited on it; by value they are issued within about 1 us
// (measured in docs/perf.md), though x's own latency keeps the first dot product about where it was.
constexpr int PROGRAM_MAX_PHASES = 12;
// A stack runs the same rows for every layer. The addresses that differ between layers (weights,
// cache) are named in a row by reference: an operand word w < 0 stands for slot (~w) & LAYER_SLOT_MASK
// of the running layer's address table plus (~w) >> LAYER_SLOT_BITS bytes (resolve()). Each table has
// LAYER_WORDS words; the tables travel by value with the rows, one per layer (none for one layer, whose
// rows hold its addresses themselves).
constexpr int LAYER_WORDS = 15;
// Slots of a layer's table that no row names but the kernel reads: a stack too large for packed copies
// reads Qkv's and GateUp's rows in place, from Wq (the Qkv row's W) and these, and Wgate (GateUp's W)
// and Wup; zero when they are packed.
constexpr int SLOT_WK = 12;
constexpr int SLOT_WV = 13;
constexpr int SLOT_WUP = 14;
constexpr int LAYER_SLOT_BITS = 4;
constexpr int64_t LAYER_SLOT_MASK = (1 << LAYER_SLOT_BITS) - 1;
// The most layers a stack kernel's parameter block holds tables for (spec's MAX_LAYERS).
constexpr int PROGRAM_MAX_LAYERS = 128;
template <uint32_t TABLES>
struct Program {
    int64_t words[PROGRAM_MAX_PHASES * PROGRAM_ROW_WORDS];
    int64_t tables[TABLES][LAYER_WORDS];
};

// A row word as it reads for the layer whose address table is `table`.
__device__ inline int64_t resolve(int64_t w, const int64_t* table) {
    if (w >= 0) return w;
    const uint64_t v = ~(uint64_t)w;
    return table[v & LAYER_SLOT_MASK] + (int64_t)(v >> LAYER_SLOT_BITS);
}

// Opcodes: 0 is a no-op; an unknown opcode traps.
constexpr int64_t OP_NOP = 0;
constexpr int64_t OP_QKV = 1;       // h = rmsnorm(x); [q|k|v] = W h; rope q, k; append k, v at pos
constexpr int64_t OP_ATTENTION = 2; // chunked attention of q over the cache, combined into a
constexpr int64_t OP_O_PROJ = 3;    // x1 = x + Wo a
constexpr int64_t OP_GATE_UP = 4;   // h2 = rmsnorm(x1); act = silu(Wg h2) * (Wu h2)
constexpr int64_t OP_DOWN = 5;      // out = x1 + Wd act
// out = residual + every GPU's partials in rank order, for a layer split over GPUs (op_reduce.cuh):
// only the split kernel (split.cu) runs it; the others trap on it, as on any opcode they do not know.
constexpr int64_t OP_REDUCE = 6;

// The last two words of every row: the blocks that run it (first + i * stride for i < count: the count in
// bits 0-31, the first in bits 32-47, the stride in bits 48-62) and the phases it waits for (one bit per
// phase: of its own layer from bit 0, of the layer before from bit PREV_LAYER_WAITS).
constexpr int ROW_BLOCKS = PROGRAM_ROW_WORDS - 2;
constexpr int ROW_WAITS = PROGRAM_ROW_WORDS - 1;
constexpr int PREV_LAYER_WAITS = 16;

// Operand words of each opcode (word 0 is the opcode); the names are those of the Rust enums.
namespace qkv { enum : int { W = 1, Norm, QOut, KCache, VCache, Cos, Sin, D, NQ, NKv, Hd, MaxSeq, EpsBits }; }
namespace attn { enum : int { Q = 1, KCache, VCache, PartO, PartMl, Counters, AOut, NQ, NKv, Hd, MaxSeq, Chunk }; }
namespace oproj { enum : int { W = 1, A, X1Out, Rows, Cols, PartIn, PartOut }; }
namespace gateup { enum : int { W = 1, Norm, X1, ActOut, D, Ffn, EpsBits }; }
namespace down { enum : int { W = 1, Act, X1, Rows, Cols, PartIn, PartOut }; }
namespace reduce { enum : int { Parts = 1, Residual, Out, Rows }; }
