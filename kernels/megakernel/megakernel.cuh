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
// slot's mbarrier), STAGES - 1 slots ahead of use. Thread t owns the 16-byte vectors t, t + THREADS,
// ... of every row and holds the matching vectors of the input in registers; each warp reduces a row
// with a shuffle butterfly and the warps' partials meet in shared memory once, at the end of the
// phase, where they are added in warp order. A phase's first slots are filled before its input
// exists (before the norm, while the block waits for the phases it depends on), so the stream does not
// stop between phases; attention's first cached rows are loaded before its wait too. Weights are not prefetched to L2:
// bulk prefetches of rows the ring then copies made the phases slower (docs/perf.md); the ring's copies
// mark them evict-first instead. No float atomics anywhere: outputs are bitwise reproducible.
//
// Rounding follows the eager reference: q, k, v, a, o, x1, h, h2, gate, up, act and down are rounded to
// bf16 where the reference stores them; scores, maxima and sums stay f32, and the softmax weights are
// rounded to bf16 only as the P V product's operand (the sum is of the rounded weights).
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

#include "bulk.cuh"
#include "layer_math.cuh"
#include "program.cuh"

// Threads per block; one block per SM (__launch_bounds__ below) leaves 128 registers per thread.
constexpr uint32_t THREADS = 512;
constexpr uint32_t WARPS = THREADS / WARP;
constexpr uint32_t THREADS_LOG2 = 9, WARPS_LOG2 = 4;
static_assert(1u << THREADS_LOG2 == THREADS && 1u << WARPS_LOG2 == WARPS, "the shifts of slices_log2 and run_group");
// The ring: STAGES slots of STAGE_BYTES, STAGES - 1 of them in flight ahead of use.
constexpr uint32_t STAGES = 3;
constexpr uint32_t STAGE_BYTES = 64 * 1024;
constexpr uint32_t RING_BYTES = STAGES * STAGE_BYTES;
// Input vectors a thread holds: rows of up to MAX_VPT * THREADS * VEC = 28672 bf16.
constexpr uint32_t MAX_VPT = 7;
// Attention work items: a KV head's cached positions in chunks of ATTN_CHUNK_ELEMS / hd slots, at most
// ATTN_MAX_CHUNK (64 slots at hd 128, 32 at hd 256; the program row's Chunk word), so that a chunk's K
// and V rows take the same shared memory at every head size. An item is a run of consecutive chunks of
// one KV head (a split of it), scored a chunk at a time with a running max and sum while the next
// chunk loads into the team's other buffer.
constexpr uint32_t ATTN_MAX_CHUNK = 128;
constexpr uint32_t ATTN_CHUNK_ELEMS = 64 * 128;
// Chunk buffers per team: one is scored while the copy engine fills the other.
constexpr uint32_t ATTN_BUFFERS = 2;
constexpr uint32_t ATTN_MAX_HD = 256;
// Query heads per KV head: two tiles of the tensor-core products' 8 columns.
constexpr uint32_t ATTN_MAX_GROUP = 16;
// Splits of one KV head at most: the combine's lanes hold each split's max and sum in registers.
constexpr uint32_t ATTN_MAX_SPLITS = 128;
// bf16 of padding after each K, V and Q row in shared memory: rows then start 4 banks apart, so
// ldmatrix's 8 rows of 16 bytes and the Q fragments' loads (8 rows x 4 words per warp) hit 32 distinct
// banks. Unpadded rows (which one bulk copy per chunk could fill) made the fragment loads 4- and 8-way
// conflicts and attention at 128k compute-bound (docs/perf.md, v25c-v25d); so the rows arrive by
// per-thread copies.
constexpr uint32_t KS_PAD = 8;
// Attention runs as TEAMS independent teams per block, each on its own work item, so one team's
// latency chain (load, scores, softmax, sums) overlaps the other's.
constexpr uint32_t TEAMS = 2;
constexpr uint32_t TEAM_THREADS = THREADS / TEAMS;
constexpr uint32_t TEAM_WARPS = TEAM_THREADS / WARP;
// bf16 of padding after each query head's row of softmax weights: rows start 4 banks apart, so the
// B fragments' loads (8 heads x 4 words per warp) hit 32 distinct banks.
constexpr uint32_t PB_PAD = 8;
// f32 of padding after each query head's row of scores (see the P V product in phase_attention).
constexpr uint32_t PS_PAD = 4;
// Each team owns an equal share of the ring (free outside GEMV phases).
constexpr uint32_t TEAM_SMEM_BYTES = RING_BYTES / TEAMS;
// A team's shared memory for chunks of `chunk` slots at head size hd: K and V of each buffer and Q
// (bf16, rows padded by KS_PAD), the scores (f32), and each query head's running max, sum and rescale
// (f32), then the softmax weights (bf16, rows padded by PB_PAD). The launcher checks its chunk against
// the same sum (megakernel/src/lib.rs, attention_smem_bytes).
constexpr uint32_t attn_smem_bytes(uint32_t chunk, uint32_t hd) {
    return (2 * ATTN_BUFFERS * chunk + ATTN_MAX_GROUP) * (hd + KS_PAD) * 2 + ATTN_MAX_GROUP * (chunk + PS_PAD) * 4 + 3 * ATTN_MAX_GROUP * 4 +
           ATTN_MAX_GROUP * (chunk + PB_PAD) * 2;
}
static_assert(attn_smem_bytes(ATTN_MAX_CHUNK, ATTN_CHUNK_ELEMS / ATTN_MAX_CHUNK) <= TEAM_SMEM_BYTES, "a team's chunk must fit its share of the ring");
static_assert(attn_smem_bytes(ATTN_CHUNK_ELEMS / ATTN_MAX_HD, ATTN_MAX_HD) <= TEAM_SMEM_BYTES, "a team's chunk must fit its share of the ring");
// Tiles of the P V product each warp accumulates across a split's chunks: of 16 along the head
// dimension, and of 8 query heads.
constexpr uint32_t PV_M = ATTN_MAX_HD / 16 / TEAM_WARPS;
constexpr uint32_t PV_N = ATTN_MAX_GROUP / 8;
// The combine: outputs each thread of a team sums per window; the splits' scales, then the partials
// of a pass, in the team's shared memory.
constexpr uint32_t COMBINE_OUTPUTS = 4;
constexpr uint32_t COMBINE_WINDOW = COMBINE_OUTPUTS * TEAM_THREADS;
constexpr uint32_t COMBINE_SCALES = ATTN_MAX_SPLITS * ATTN_MAX_GROUP;
constexpr uint32_t COMBINE_STAGE_FLOATS = TEAM_SMEM_BYTES / 4 - COMBINE_SCALES;
constexpr uint32_t COMBINE_SPLITS_PER_LANE = ATTN_MAX_SPLITS / WARP;
static_assert(COMBINE_SPLITS_PER_LANE * WARP == ATTN_MAX_SPLITS, "the combine's lanes must reach every split a head can have");

// ---------------------------------------------------------------------------------------------------
// Memory helpers
// ---------------------------------------------------------------------------------------------------

// GPU-scope release and acquire on counters that blocks signal through. A release reduction returns
// nothing, so the signalling thread does not wait for its round trip; an acquire load orders the
// reads after it without a separate fence (a __threadfence plus a plain atomic or volatile load
// costs a full fence and a round trip more; docs/perf.md has the measurement).
__device__ inline void red_release_add(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ inline unsigned atom_acq_rel_add(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ inline unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// A 16-byte global -> shared copy completing asynchronously, through L2 only (other blocks wrote the
// data earlier in this launch); cp_async_wait_all() waits for this thread's copies.
__device__ inline void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}
__device__ inline void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory accesses before later copy-engine writes.
__device__ inline void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Activations written earlier in this launch by other blocks are read through L2 (ld.global.cg):
// L1 is not coherent across SMs, and the dependency counts' release and acquire order only L2.
__device__ inline uint4 load_cg(const bf16* p, uint32_t vector) { return __ldcg(reinterpret_cast<const uint4*>(p) + vector); }

// Tensor-core products of one warp, D = A B + D, f32 accumulation (the PTX ISA's fragment layouts:
// lane l holds row l / 4 and columns 2 (l % 4) + {0, 1} of D, etc.).
// A 16x16 bf16 (row), B 16x8 bf16 (col).
__device__ inline void mma_bf16_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Two consecutive bf16 in shared memory as one 32-bit fragment register.
__device__ inline uint32_t pair_at(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }
// Four 8x8 bf16 matrices from shared memory, lane i giving the address of row i % 8 of matrix i / 8
// (16 bytes); register j holds matrix j as an A fragment holds it (lane l: row l / 4, columns
// 2 (l % 4) + {0, 1}), or, transposed, that of its transpose.
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const bf16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row))
                 : "memory");
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row))
                 : "memory");
}

// ---------------------------------------------------------------------------------------------------
// Blocks and dependencies
// ---------------------------------------------------------------------------------------------------

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
__device__ inline void wait_for(const int64_t* program, uint64_t waits, const unsigned* phase_done, uint32_t step,
                                uint32_t layers, uint32_t l, bool chained) {
    if (threadIdx.x == 0) {
        for (uint32_t w = 0; w < PROGRAM_MAX_PHASES; ++w) {
            const bool own = (waits >> w) & 1, before = chained && ((waits >> (PREV_LAYER_WAITS + w)) & 1);
            if (!own && !before) continue;
            // The layer before's count, then this layer's (which implies it). For l = 0 the layer before
            // is the step before's last: count * (step * layers) is where that step ended.
            const unsigned target = blocks_of(program + (size_t)w * PROGRAM_ROW_WORDS).count * (step * layers + l + (own ? 1 : 0));
            // Acquire: no read of this phase moves above the observation of the last block's count.
            while ((int)(ld_acquire(&phase_done[w]) - target) < 0) __nanosleep(64);
        }
    }
    __syncthreads();  // the rest of the block waits for thread 0 to see every count
}

// Counts this block as done with phase p: call after a __syncthreads that follows every write of it.
__device__ inline void count_done(unsigned* phase_done, uint32_t p) {
    // Release: the block's writes (ordered before thread 0 by the caller's bar.sync) become visible
    // device-wide before the count does.
    if (threadIdx.x == 0) red_release_add(&phase_done[p], 1);
}

// ---------------------------------------------------------------------------------------------------
// The phase trace (`grader profile`, and `megakernel bench --trace` in the model kernel's traced
// instances)
// ---------------------------------------------------------------------------------------------------

// The stamps of a phase: when the block starts its work (its dependencies met); for a GEMV phase, when
// its input is in registers (norm or load done) and when its stream's last stage is reduced (in the
// model kernel's traced instances, an attention phase's thread 0 too: when its team's first chunk has
// landed and when its item's last chunk is summed); and when the whole block has finished the phase.
// The gap to the block's next phase's start is waiting.
constexpr uint32_t TRACE_START = 0;
constexpr uint32_t TRACE_INPUT = 1;
constexpr uint32_t TRACE_STREAMED = 2;
constexpr uint32_t TRACE_END = 3;
constexpr uint32_t TRACE_STAMPS = 4;

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
}

// ---------------------------------------------------------------------------------------------------
// The streamed GEMV
// ---------------------------------------------------------------------------------------------------

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
template <uint32_t N>
__device__ inline float reduce_scatter(float (&v)[N]) {
    static_assert(N >= 1 && N <= WARP && (N & (N - 1)) == 0, "a power of two of values per lane");
#pragma unroll
    for (uint32_t level = 1; level < N; level *= 2) {
        const uint32_t half = N / 2 / level, offset = WARP / 2 / level;
#pragma unroll
        for (uint32_t j = 0; j < half; ++j) v[j] += __shfl_xor_sync(FULL_MASK, v[j + half], offset);
    }
    float sum = v[0];
    for (uint32_t offset = WARP / 2 / N; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, offset);
    return sum;
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

// A GEMV's stream of weight rows [r0, r1) through the ring, for rows of at most VPT vectors per
// thread; each stage is SLICE_ROWS consecutive rows per slice of the block, one bulk copy from a packed
// matrix (or a few, one per run, from the handed layout: see RowSource). A layer kernel's stream (run)
// has one slice; a group's (run_group, `group`) runs in row_slices, so that its narrow rows fill the
// stages, and so does a model's decode step where its rows run in slices (a group of one: stream_phase).
// What a decode step primes before its wait decides: its input queues behind those bytes, and full
// stages with the whole ring primed (up to six times the bytes primed below 4096 columns) made
// Llama-3.2-1B 23% slower on the H200; full stages with one primed (SOLO_PRIMED), 11% faster
// (docs/perf.md, "Full stages for the batch step" and E3).
template <uint32_t VPT>
struct RowStream {
    static constexpr uint32_t VECS_PER_THREAD = VPT;
    static constexpr uint32_t SLICE_ROWS = STAGE_BYTES / 16 / (THREADS * VPT) > 0 ? STAGE_BYTES / 16 / (THREADS * VPT) : 1;
    static_assert(SLICE_ROWS * THREADS * VPT * 16 <= STAGE_BYTES, "a row must fit a ring stage");
    // Rows per reduce_scatter in run_group: two where a slice's rows pair up.
    static constexpr uint32_t ROWS_PER_SUM = SLICE_ROWS % 2 == 0 ? 2 : 1;
    // So that a stage's rows (SLICE_ROWS times the slices) are a power of two: nstages is a shift.
    static_assert((SLICE_ROWS & (SLICE_ROWS - 1)) == 0, "a power of two");
    const bf16* w;  // (rows, vecs * VEC)
    uint32_t vecs, r0, n, slices, stage_rows, nstages;
    // Whether row_source may name an in-place source: false in the one-layer kernel, where the compiler
    // then drops every read of it (they cost the graded layer 10 us, docs/perf.md).
    bool in_place;

    __device__ RowStream(const bf16* w_, uint32_t vecs_, uint32_t r0_, uint32_t r1_, bool in_place_, bool group = false)
        : w(w_), vecs(vecs_), r0(r0_), n(r1_ - r0_), slices(group ? row_slices(vecs_) : 1), stage_rows(SLICE_ROWS * slices),
          nstages((r1_ - r0_ + stage_rows - 1) >> (31 - __clz(stage_rows))), in_place(in_place_) {}

    __device__ const bf16* stage_src(uint32_t st) const { return w + (size_t)(r0 + st * stage_rows) * vecs * VEC; }
    __device__ uint32_t stage_count(uint32_t st) const { return min(stage_rows, n - st * stage_rows); }

    // Thread 0 starts the copy of stage st into its slot. The slot's previous contents must be dead:
    // the callers reach this only after a __syncthreads that follows every read of them.
    __device__ void issue(const Ring& ring, uint32_t st) const {
        if (threadIdx.x != 0 || st >= nstages) return;
        const uint32_t k = ring.seq + st;
        uint4* slot = ring.data + (k % STAGES) * (STAGE_BYTES / 16);
        mbar_expect_tx(&ring.full[k % STAGES], stage_count(st) * vecs * 16);
        if (in_place && row_source.kind != SOURCE_PACKED) {
            gather_stage(row_source, slot, r0 + st * stage_rows, stage_count(st), vecs * 16, &ring.full[k % STAGES]);
            return;
        }
        // Evict-first: each weight is read once a step, so its lines should not push out the cache and
        // the activations, which are read again (docs/perf.md measured it).
        bulk_copy(slot, stage_src(st), stage_count(st) * vecs * 16, &ring.full[k % STAGES], l2_evict_first());
    }

    // The first STAGES - 1 stages. Weights do not depend on anything the layer computes, so this runs
    // before the phase's input exists: before its norm, and before the wait for its dependencies.
    __device__ void prime(const Ring& ring) const {
        for (uint32_t st = 0; st < STAGES - 1; ++st) issue(ring, st);
    }

    // Waits for stage st to land and returns its slot, after refilling the slot stage st - 1 used with
    // stage st + STAGES - 1.
    __device__ const uint4* next_stage(const Ring& ring, uint32_t st) const {
        __syncthreads();  // every thread is done with stage st - 1, whose slot the next issue refills
        issue(ring, st + STAGES - 1);
        const uint32_t k = ring.seq + st;
        mbar_wait(&ring.full[k % STAGES], (k / STAGES) & 1);  // stage st has landed
        return ring.data + (k % STAGES) * (STAGE_BYTES / 16);
    }

    // A grouped stage's pairs (0 otherwise): it holds its pairs' first rows, then their second rows, so
    // slot row i is the stage's row slot_row(i, pairs): pair i % pairs's member i / pairs.
    __device__ uint32_t stage_pairs(uint32_t count) const { return in_place && row_source.grouped ? count / 2 : 0; }
    __device__ static uint32_t slot_row(uint32_t i, uint32_t pairs) { return pairs == 0 ? i : 2 * (i % pairs) + i / pairs; }

    // red[r - r0][warp] = the warp's partial dot product of row r with the slice, for a stream of one
    // slice; needs prime() first. Advances ring.seq past this stream's stages.
    __device__ void run(const Slice& s, Ring& ring, Partials part) const {
        const uint32_t t = threadIdx.x, lane = t % WARP, warp = t / WARP;
        // The launcher sized red for fewer rows than this block got; or a group's stream (group_stream).
        if (n > part.rows || slices != 1) __trap();
        for (uint32_t st = 0; st < nstages; ++st) {
            const uint4* slot = next_stage(ring, st);
            float acc[SLICE_ROWS];
#pragma unroll
            for (uint32_t i = 0; i < SLICE_ROWS; ++i) {
                acc[i] = 0.0f;
#pragma unroll
                for (uint32_t v = 0; v < VPT; ++v) {
                    if (t + v * THREADS < vecs) acc[i] = dot8(slot[i * vecs + v * THREADS + t], s.h[v], acc[i]);
                }
            }
            // Independent butterflies, one per row, so their shuffles overlap.
#pragma unroll
            for (uint32_t i = 0; i < SLICE_ROWS; ++i) acc[i] = warp_reduce(acc[i], Add{});
            if (lane == 0) {
                const uint32_t count = stage_count(st), pairs = stage_pairs(count);
#pragma unroll
                for (uint32_t i = 0; i < SLICE_ROWS; ++i) {
                    const uint32_t r = slot_row(i, pairs);
                    if (i < count) part.red[(st * SLICE_ROWS + r) * WARPS + warp] = acc[i];
                }
            }
        }
        ring.seq += nstages;
        __syncthreads();  // every warp's partials are in red before any thread adds them up
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
    // thread (dot8's), its butterfly and row_sum's warp order are run()'s, so each vector's sums are
    // bitwise those of run() alone, whatever the other vectors are. Needs prime(); advances ring.seq.
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
            for (uint32_t j = 0; j < SLICE_ROWS; j += R) {
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
// behind no more than before. The rest of the first STAGES - 1 go as the stream starts (start_solo).
// Two primed full stages made Llama-3.2-1B 4% slower than one (docs/perf.md, E3).
constexpr uint32_t SOLO_PRIMED = 1;
__device__ inline void prime_solo(const RowStream<1>& stream, const Ring& ring) {
    for (uint32_t st = 0; st < SOLO_PRIMED; ++st) stream.issue(ring, st);
}
__device__ inline void start_solo(const RowStream<1>& stream, const Ring& ring) {
    for (uint32_t st = SOLO_PRIMED; st < STAGES - 1; ++st) stream.issue(ring, st);
}

// Calls f(RowStream<VPT>) for the VPT of rows of `cols` bf16: the loops above unroll at compile time.
// `group`: a stream for run_group (RowStream's).
template <typename F>
__device__ void with_stream(const bf16* w, uint32_t cols, uint32_t r0, uint32_t r1, bool in_place, F f, bool group = false) {
    const uint32_t vecs = cols / VEC;
    switch ((vecs + THREADS - 1) / THREADS) {
        case 1: f(RowStream<1>(w, vecs, r0, r1, in_place, group)); break;
        case 2: f(RowStream<2>(w, vecs, r0, r1, in_place, group)); break;
        case 3: f(RowStream<3>(w, vecs, r0, r1, in_place, group)); break;
        case 4: f(RowStream<4>(w, vecs, r0, r1, in_place, group)); break;
        case 5: f(RowStream<5>(w, vecs, r0, r1, in_place, group)); break;
        case 6: f(RowStream<6>(w, vecs, r0, r1, in_place, group)); break;
        case 7: f(RowStream<7>(w, vecs, r0, r1, in_place, group)); break;
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

// A group's inputs for RowStream<VPT>::run_group<G>, R its ROWS_PER_SUM, widened once: h[p] holds
// vector p ^ (scatter_mask<R G>() % G) as thread t holds it (input(g, t), a Slice, for g < live; zero
// past live). Each thread loads its own order of vectors from memory, so that every place of h is a
// register the compiler names.
template <uint32_t VPT, uint32_t G, typename In>
__device__ inline void group_inputs(float (&h)[G][VPT][VEC], uint32_t live, uint32_t t, In input) {
    const uint32_t order = scatter_mask<RowStream<VPT>::ROWS_PER_SUM * G>() % G;
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

// Lanes [b0, b0 + live) of `all`'s rows through run_group<G>, in group streams of `chunk` rows:
// input(b, t) is lane b's input as thread t holds it (no block-wide step: each thread takes the lanes
// in its own order), epilogue(b, part, c0, c1) ends lane b's rows [c0, c1) from their partials. The
// first stream's first stages are in the ring unless `prime_first`.
template <uint32_t VPT, uint32_t G, typename In, typename Out>
__device__ void lanes_group(const RowStream<VPT>& all, uint32_t b0, uint32_t live, uint32_t chunk, bool prime_first, Ring& ring, Partials part, In input,
                            Out epilogue) {
    float h[G][VPT][VEC];
    group_inputs<VPT, G>(h, live, column_thread(all.vecs * VEC), [&](uint32_t g, uint32_t t) { return input(b0 + g, t); });
    const uint32_t end = all.r0 + all.n;
    for (uint32_t c0 = all.r0; c0 < end; c0 += chunk) {
        const uint32_t c1 = min(c0 + chunk, end);
        const RowStream<VPT> stream = group_stream<VPT>(all.w, all.vecs, c0, c1, all.in_place);
        // The ring is free: the stream before and its epilogues (Qwen3's uses the ring's memory) ended on
        // a __syncthreads.
        if (c0 != all.r0 || prime_first) stream.prime(ring);
        stream.template run_group<G>(h, live, ring, part);
        for (uint32_t g = 0; g < live; ++g) {
            epilogue(b0 + g, Partials{part.red + (size_t)g * (c1 - c0) * WARPS, c1 - c0}, c0, c1);
            // The next lane's epilogue, the next stream and its partials come after every read of these.
            __syncthreads();
        }
    }
}

// A decode step's rows through run_group as a group of one, the input `s` as column_thread holds it:
// full stages where the rows run in slices, each output's products, sums and rounding run()'s, so its
// bits too. `stream` (the block's rows) has its first STAGES - 1 stages issued; they go in chunks of
// `chunk` rows (as many as the partials hold), epilogue(0, part, c0, c1) ending each. The phase before
// ended on a __syncthreads, so the partials are free to zero.
template <typename Out>
__device__ __forceinline__ void solo_group(const RowStream<1>& stream, const Slice& s, uint32_t chunk, Ring& ring, Partials part, Out epilogue) {
    zero_partials(part);
    lanes_group<1, 1>(stream, 0, 1, chunk, false, ring, part, [&](uint32_t, uint32_t) { return s; }, epilogue);
}

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

// Lanes of a batch step's group (lanes_gemv): as many as the group holds (G, group_of) and the
// partials fit for a unit of rows each; at least one where the launcher sized the partials.
__device__ inline uint32_t lanes_per_group(uint32_t G, uint32_t unit, uint32_t part_rows) { return min(G, part_rows / unit); }
// Rows of a chunk of a group of `live` lanes: as many whole units as their partials fit.
__device__ inline uint32_t chunk_rows(uint32_t live, uint32_t unit, uint32_t part_rows) { return part_rows / live / unit * unit; }

// For a batch step of `lanes` lanes (0: a decode step) with partials of `part_rows` rows, the first
// stream is its first group's first chunk (lanes_gemv); a decode step's is the block's rows.
template <bool SLICED = false>
__device__ void prime_phase(const OpRow& op, const Ring& ring, const bf16* qk_norms, uint32_t lanes = 0, uint32_t part_rows = 0) {
    Gemv g;
    if (!gemv_of(op, g)) return;
    if (threadIdx.x == 0) set_row_source(op);
    const uint32_t unit = qkv_unit(op, qk_norms);
    uint32_t r0, r1;
    block_rows(g.rows, blocks_of(op), r0, r1, unit);
    with_stream(g.w, g.cols, r0, r1, g.in_place, [&](auto stream) {
        using Stream = decltype(stream);
        // A decode step: run()'s stages; or, where its rows run in slices, a group of one's, in the model
        // kernel (stream_phase's SLICED, one stage primed) and in Qwen3's Qkv (phase_qkv_normed, two).
        if (lanes == 0 && SLICED && unit == 2 && row_slices(stream.vecs) > 1) return prime_solo(group_stream<1>(g.w, stream.vecs, r0, r1, g.in_place), ring);
        if (lanes == 0 && (unit == 2 || !in_slices(g.cols))) return stream.prime(ring);
        if (lanes == 0) return group_stream<Stream::VECS_PER_THREAD>(g.w, stream.vecs, r0, r1, g.in_place).prime(ring);
        const uint32_t live = max(1u, min(lanes_per_group(group_of<Stream::VECS_PER_THREAD>(), unit, part_rows), lanes));
        group_stream<Stream::VECS_PER_THREAD>(g.w, stream.vecs, r0, min(r1, r0 + chunk_rows(live, unit, part_rows)), g.in_place).prime(ring);
    });
}

// This block's rows [r0, r1) of phase `op`'s GEMV (`qk_norms` as for qkv_unit).
__device__ inline void gemv_rows(const OpRow& op, uint32_t& r0, uint32_t& r1, const bf16* qk_norms = nullptr) {
    Gemv g;
    if (!gemv_of(op, g)) __trap();
    block_rows(g.rows, blocks_of(op), r0, r1, qkv_unit(op, qk_norms));
}

// This block's rows [r0, r1) of phase `op`'s GEMV against the slice, into red (the ring already
// primed).
__device__ void gemv_phase(const OpRow& op, const Slice& s, Ring& ring, Partials part, uint32_t r0, uint32_t r1) {
    Gemv g;
    if (!gemv_of(op, g)) __trap();
    stamp(TRACE_INPUT);
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
template <bool SLICED, bool TRACED = false, typename In>
__device__ __forceinline__ void stream_phase(const OpRow& op, In input, Ring& ring, Partials part, uint32_t r0, uint32_t r1) {
    Gemv g;
    // in_slices(g.cols), spelled out: called here it changed the measured kernels' PTX.
    if (SLICED && gemv_of(op, g) && row_slices(g.cols / VEC) > 1) {
        const Slice s = input(column_thread(g.cols));
        if (TRACED) stamp_input(s);
        const RowStream<1> stream = group_stream<1>(g.w, g.cols / VEC, r0, r1, g.in_place);
        start_solo(stream, ring);
        solo_group(stream, s, stream.n, ring, part, [](uint32_t, const Partials&, uint32_t, uint32_t) {});  // the caller's epilogue follows
        if (TRACED) stamp(TRACE_STREAMED);
        return;
    }
    gemv_phase(op, input(threadIdx.x), ring, part, r0, r1);
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

__device__ inline float bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Element threadIdx.x of v[0, n) (0 past n), for an epilogue that adds it: loaded before the phase's
// stream, it is in a register when the epilogue runs instead of one more round trip at the phase's
// end, where the last block's round trip delays the phase's done count.
__device__ inline float preload(const bf16* v, uint32_t n) { return threadIdx.x < n ? __bfloat162float(__ldcg(v + threadIdx.x)) : 0.0f; }

// ---------------------------------------------------------------------------------------------------
// Phases
// ---------------------------------------------------------------------------------------------------

// The GEMV phases are forced inline into the program runner: as a call, ptxas saves the caller's
// registers around it (the model kernel spilled 120 bytes when the inliner left phase_gateup out).

// Where a Qkv phase's epilogue writes for position pos (the lane's q and its sequence's caches), and
// the rows of cos and sin it rotates by; resolved before the stream, as the phase's first loads.
struct QkvOut {
    bf16 *q, *k_cache, *v_cache;
    const float *cos_row, *sin_row;
};
__device__ inline QkvOut qkv_out(const OpRow& op, uint32_t pos) {
    const uint32_t half = (uint32_t)op[qkv::Hd] / 2;
    return {act_ptr<bf16>(op, qkv::QOut), cache_ptr<bf16>(op, qkv::KCache), cache_ptr<bf16>(op, qkv::VCache),
            reinterpret_cast<const float*>(op[qkv::Cos]) + (size_t)pos * half, reinterpret_cast<const float*>(op[qkv::Sin]) + (size_t)pos * half};
}

// The RoPE factors of this thread's first pair of a Qkv phase's rows [r0, r1), loaded before the
// stream (see preload); zero for a thread without pairs or whose first pair is v's.
struct RopeFirst {
    float cos, sin;
};
__device__ inline RopeFirst rope_first(const OpRow& op, const QkvOut& out, uint32_t r0, uint32_t r1) {
    const uint32_t half = (uint32_t)op[qkv::Hd] / 2, q_pairs = (uint32_t)op[qkv::NQ] * half, k_pairs = (uint32_t)op[qkv::NKv] * half;
    const auto rope_index = [&](uint32_t gp) { return (gp < q_pairs ? gp : gp - q_pairs) % half; };
    RopeFirst first{0.0f, 0.0f};
    if (threadIdx.x < (r1 - r0) / 2 && r0 / 2 + threadIdx.x < q_pairs + k_pairs) {
        first.cos = out.cos_row[rope_index(r0 / 2 + threadIdx.x)];
        first.sin = out.sin_row[rope_index(r0 / 2 + threadIdx.x)];
    }
    return first;
}

// The end of a Qkv phase: the sums of rows [r0, r1) in `part`, pair p of the packed matrix being
// (row i, row i + hd/2) of one head (q heads, then k, then v): q's pairs rotated into q, k's rotated
// into the K cache at pos, v's stored into the V cache at pos.
__device__ inline void qkv_epilogue(const OpRow& op, uint32_t pos, const QkvOut& out, const Partials& part, uint32_t r0, uint32_t r1, RopeFirst first) {
    const uint32_t hd = (uint32_t)op[qkv::Hd], max_seq = (uint32_t)op[qkv::MaxSeq], half = hd / 2;
    const uint32_t q_pairs = (uint32_t)op[qkv::NQ] * half, k_pairs = (uint32_t)op[qkv::NKv] * half;
    for (uint32_t p = threadIdx.x; p < (r1 - r0) / 2; p += THREADS) {
        const uint32_t gp = r0 / 2 + p;
        const float a = bf(row_sum(part.red, 2 * p)), b = bf(row_sum(part.red, 2 * p + 1));
        if (gp < q_pairs + k_pairs) {
            const bool is_q = gp < q_pairs;
            const uint32_t j = is_q ? gp : gp - q_pairs, head = j / half, i = j % half;
            bf16* dst = is_q ? out.q + (size_t)head * hd : out.k_cache + ((size_t)head * max_seq + pos) * hd;
            const bool at_first = p == threadIdx.x;
            rope_pair(a, b, at_first ? first.cos : out.cos_row[i], at_first ? first.sin : out.sin_row[i], &dst[i], &dst[i + half]);
        } else {
            const uint32_t j = gp - q_pairs - k_pairs, head = j / half, i = j % half;
            bf16* dst = out.v_cache + ((size_t)head * max_seq + pos) * hd;
            dst[i] = __float2bfloat16_rn(a);
            dst[i + half] = __float2bfloat16_rn(b);
        }
    }
}

// h = rmsnorm(x); [q|k|v] = W h over pair-interleaved rows; rope q and k; append k and v at pos.
template <bool SLICED, bool TRACED = false>
__device__ __forceinline__ void phase_qkv(const OpRow& op, const bf16* x, uint32_t pos, Ring& ring, Partials part) {
    const uint32_t d = (uint32_t)op[qkv::D];
    const float eps = __int_as_float((int)op[qkv::EpsBits]);
    const QkvOut out = qkv_out(op, pos);
    uint32_t r0, r1;
    gemv_rows(op, r0, r1);
    const RopeFirst first = rope_first(op, out, r0, r1);
    const bf16* g = reinterpret_cast<const bf16*>(layer_address(op, qkv::Norm));
    stream_phase<SLICED, TRACED>(op, [&](uint32_t t) { return rmsnorm_slice(x, g, d, eps, t); }, ring, part, r0, r1);
    qkv_epilogue(op, pos, out, part, r0, r1, first);
}

// The end of phase_qkv_normed: the sums of rows [r0, r1) in `part`, the ring's shared memory as
// scratch (the stream is done).
__device__ void qkv_normed_epilogue(const OpRow& op, uint32_t pos, const Ring& ring, const Partials& part, const bf16* norms, uint32_t r0, uint32_t r1) {
    const uint32_t hd = (uint32_t)op[qkv::Hd], half = hd / 2, max_seq = (uint32_t)op[qkv::MaxSeq], n = r1 - r0;
    const uint32_t q_pairs = (uint32_t)op[qkv::NQ] * half, k_pairs = (uint32_t)op[qkv::NKv] * half;
    const uint32_t warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    float* vals = reinterpret_cast<float*>(ring.data);  // (n): pair p's values at 2p and 2p + 1
    float* inv = vals + n;                              // (n / hd): each head's inverse root
    for (uint32_t r = threadIdx.x; r < n; r += THREADS) vals[r] = bf(row_sum(part.red, r));
    __syncthreads();  // every value is in shared memory
    for (uint32_t h = warp; h < n / hd; h += WARPS) {
        float sum = 0.0f;
        for (uint32_t j = lane; j < hd; j += WARP) sum = fmaf(vals[h * hd + j], vals[h * hd + j], sum);
        sum = warp_reduce(sum, Add{});
        if (lane == 0) inv[h] = inv_rms(__fdiv_rn(sum, (float)hd), __int_as_float((int)op[qkv::EpsBits]));
    }
    __syncthreads();  // every head's inverse root is in shared memory
    const float* cos_row = reinterpret_cast<const float*>(op[qkv::Cos]) + (size_t)pos * half;
    const float* sin_row = reinterpret_cast<const float*>(op[qkv::Sin]) + (size_t)pos * half;
    for (uint32_t p = threadIdx.x; p < n / 2; p += THREADS) {
        const uint32_t gp = r0 / 2 + p;
        const float a = vals[2 * p], b = vals[2 * p + 1];
        if (gp >= q_pairs + k_pairs) {
            const uint32_t j = gp - q_pairs - k_pairs, head = j / half, i = j % half;
            bf16* dst = cache_ptr<bf16>(op, qkv::VCache) + ((size_t)head * max_seq + pos) * hd;
            dst[i] = __float2bfloat16_rn(a);
            dst[i + half] = __float2bfloat16_rn(b);
            continue;
        }
        const bool is_q = gp < q_pairs;
        const uint32_t j = is_q ? gp : gp - q_pairs, head = j / half, i = j % half;
        const bf16* g = norms + (is_q ? 0 : hd);
        const float r = inv[p / half];  // the block's heads start at its first row
        bf16* dst = is_q ? act_ptr<bf16>(op, qkv::QOut) + (size_t)head * hd : cache_ptr<bf16>(op, qkv::KCache) + ((size_t)head * max_seq + pos) * hd;
        rope_pair(__bfloat162float(rms_scale(a, r, __bfloat162float(g[i]))), __bfloat162float(rms_scale(b, r, __bfloat162float(g[i + half]))),
                  cos_row[i], sin_row[i], &dst[i], &dst[i + half]);
    }
}

// Qkv of a layer with Qwen3's per-head q/k norms (`norms`: q's hd weights, then k's): as phase_qkv,
// each block with whole heads (qkv_unit), q's and k's heads normalised before RoPE. The row sums as
// rounded and each head's inverse root go to the ring's shared memory (free: the stream is done); each
// pair is then scaled as the layer's norms scale (rms_scale) and rotated; v's heads are stored as they
// are. Everything after the stream is read again from the row, so that no register holds it across.
// Where the rows run in slices (at most 2048 columns) they stream as a group of one in full stages
// (solo_group), two of them primed: the phase runs on the few blocks that hold whole heads (32 of 132
// at Qwen3-0.6B), each streaming many stages, and the bytes a stage holds limit how fast (16 KB at d
// 1024 in one slice, 64 KB in four).
template <bool TRACED = false>
__device__ __forceinline__ void phase_qkv_normed(const OpRow& op, const bf16* x, uint32_t pos, Ring& ring, Partials part, const bf16* norms) {
    uint32_t r0, r1;
    gemv_rows(op, r0, r1, norms);
    const uint32_t d = (uint32_t)op[qkv::D];
    const float eps = __int_as_float((int)op[qkv::EpsBits]);
    const bf16* g = reinterpret_cast<const bf16*>(layer_address(op, qkv::Norm));
    const auto epilogue = [&](uint32_t, const Partials& p, uint32_t c0, uint32_t c1) {
        if (TRACED) stamp(TRACE_STREAMED);
        qkv_normed_epilogue(op, pos, ring, p, norms, c0, c1);
    };
    if (!in_slices(d)) {
        gemv_phase(op, rmsnorm_slice(x, g, d, eps), ring, part, r0, r1);
        epilogue(0, part, r0, r1);
        return;
    }
    // Each thread holds the vectors of the thread whose columns it takes.
    const Slice s = rmsnorm_slice(x, g, d, eps, column_thread(d));
    if (TRACED) stamp_input(s);
    Gemv w;
    if (!gemv_of(op, w)) __trap();
    solo_group(group_stream<1>(w.w, d / VEC, r0, r1, w.in_place), s, r1 - r0, ring, part, epilogue);
}

// A team of TEAM_THREADS threads of the block, synchronised by its own named barrier.
struct Team {
    uint32_t id, t, lane, warp;  // team index; thread, lane and warp within the team
    __device__ Team() : id(threadIdx.x / TEAM_THREADS), t(threadIdx.x % TEAM_THREADS), lane(threadIdx.x % WARP), warp(threadIdx.x % TEAM_THREADS / WARP) {}
    // Barrier 0 is __syncthreads; team i uses barrier 1 + i, counting only its own threads.
    __device__ void sync() const { asm volatile("bar.sync %0, %1;\n" ::"r"(1 + id), "n"(TEAM_THREADS) : "memory"); }
};

// Outputs [lo, hi) of KV head kv's attention (query head i / hd, dimension i % hd, over the group):
// a = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M) over the head's n_splits partials in order
// (deterministic, whichever team and share computes it). lo and hi are multiples of 4. Every split's
// scale is computed once into shared memory, so the sums below are streams of independent loads. The
// caller has made the head's partials visible (acquire). `scratch` is the team's shared memory, free.
__device__ void combine(const Team& team, uint32_t kv, uint32_t n_splits, uint32_t max_splits, uint32_t group, uint32_t hd,
                        uint32_t lo, uint32_t hi, const float* part_o, const float* part_ml, bf16* a_out, float* scratch) {
    const float* pm = part_ml + (size_t)kv * max_splits * group * 2;  // (n_splits, group, 2)
    const float* po = part_o + (size_t)kv * max_splits * group * hd;  // (n_splits, group, hd)
    float* scale = scratch;                                           // (ATTN_MAX_SPLITS, ATTN_MAX_GROUP)
    float* stage = scratch + COMBINE_SCALES;                          // (COMBINE_STAGE_FLOATS)
    // The outputs go a window of COMBINE_WINDOW at a time (thread t sums outputs t, t + TEAM_THREADS,
    // ... of the window, each over the splits in order); the window's share of each split's partials
    // passes through shared memory as many splits at a time as fit: every thread's copies are in
    // flight together, so a pass costs one round trip, and the first pass's copies start before the
    // scales' loads, which do not depend on them, so the two overlap.
    const uint32_t per_split = group * hd;
    const auto load_pass = [&](uint32_t w0, uint32_t width, uint32_t s0, uint32_t sn) {
        for (uint32_t i = team.t; i < sn * width / 4; i += TEAM_THREADS) {
            const uint32_t s = 4 * i / width, off = 4 * i % width;
            cp_async16(stage + 4 * i, po + (size_t)(s0 + s) * per_split + w0 + off);
        }
    };
    for (uint32_t w0 = lo; w0 < hi; w0 += COMBINE_WINDOW) {
        const uint32_t width = min(COMBINE_WINDOW, hi - w0), per_pass = COMBINE_STAGE_FLOATS / width;
        if (w0 > lo) team.sync();  // every thread is done with the previous window's last pass
        load_pass(w0, width, 0, min(per_pass, n_splits));
        if (w0 == lo) {
            // Each lane loads the running max and sum of its splits once (lane, lane + WARP, ...).
            for (uint32_t g = team.warp; g < group; g += TEAM_WARPS) {
                float sm[COMBINE_SPLITS_PER_LANE], sl[COMBINE_SPLITS_PER_LANE];
                float m = -CUDART_INF_F;
#pragma unroll
                for (uint32_t k = 0; k < COMBINE_SPLITS_PER_LANE; ++k) {
                    const uint32_t s = team.lane + k * WARP;
                    sm[k] = s < n_splits ? __ldcg(pm + (s * group + g) * 2) : -CUDART_INF_F;
                    sl[k] = s < n_splits ? __ldcg(pm + (s * group + g) * 2 + 1) : 0.0f;
                    m = fmaxf(m, sm[k]);
                }
                m = warp_reduce(m, Max{});
                float l = 0.0f;
#pragma unroll
                for (uint32_t k = 0; k < COMBINE_SPLITS_PER_LANE; ++k) {
                    const uint32_t s = team.lane + k * WARP;
                    if (s < n_splits) {
                        sm[k] = expf(__fsub_rn(sm[k], m));
                        l = fmaf(sl[k], sm[k], l);
                    }
                }
                l = warp_reduce(l, Add{});
#pragma unroll
                for (uint32_t k = 0; k < COMBINE_SPLITS_PER_LANE; ++k) {
                    const uint32_t s = team.lane + k * WARP;
                    if (s < n_splits) scale[s * ATTN_MAX_GROUP + g] = __fdiv_rn(sm[k], l);
                }
            }
        }
        float o[COMBINE_OUTPUTS] = {};
        for (uint32_t s0 = 0; s0 < n_splits; s0 += per_pass) {
            const uint32_t sn = min(per_pass, n_splits - s0);
            if (s0 > 0) {
                team.sync();  // every thread is done with the previous pass before this one overwrites it
                load_pass(w0, width, s0, sn);
            }
            cp_async_wait_all();
            team.sync();  // the pass's partials (and, on the first, every split's scale) are in shared memory
#pragma unroll
            for (uint32_t k = 0; k < COMBINE_OUTPUTS; ++k) {
                const uint32_t i = team.t + k * TEAM_THREADS;
                if (i >= width) break;
                for (uint32_t s = 0; s < sn; ++s) o[k] = fmaf(stage[s * width + i], scale[(s0 + s) * ATTN_MAX_GROUP + (w0 + i) / hd], o[k]);
            }
        }
#pragma unroll
        for (uint32_t k = 0; k < COMBINE_OUTPUTS; ++k) {
            const uint32_t i = team.t + k * TEAM_THREADS;
            if (i < width) a_out[(size_t)kv * per_split + w0 + i] = __float2bfloat16_rn(o[k]);
        }
    }
}

// The work items of an attention phase at one position: a KV head's chunks in `splits` runs of `span`
// consecutive chunks, item kv * splits + split, taken by the phase's teams in turn (item i by team
// i % TEAMS of the phase's block i / TEAMS % its count). With fewer KV heads than teams, each head is
// split over as many teams as it can have (at most ATTN_MAX_SPLITS), so every team holds at most one
// item and the teams of a head then combine it together, each a share; with as many heads as teams or
// more, a head is one item (one split) and its team writes its output itself.
struct AttnItems {
    BlockSet set;
    uint32_t chunk, n_chunks, span, splits, count;
    // The team of the phase that takes item 0 (a batch step's later lanes run beside the first's).
    uint32_t base;
    __device__ AttnItems(const OpRow& op, uint32_t pos, uint32_t base_ = 0)
        : set(blocks_of(op)), chunk((uint32_t)op[attn::Chunk]), n_chunks(pos / chunk + 1), base(base_) {
        const uint32_t n_kv = (uint32_t)op[attn::NKv], teams = set.count * TEAMS;
        const uint32_t most = n_kv >= teams ? 1 : min(min(teams / n_kv, ATTN_MAX_SPLITS), n_chunks);
        span = (n_chunks + most - 1) / most;
        splits = (n_chunks + span - 1) / span;
        count = n_kv * splits;
    }
    // A team before `base` wraps to an item past count: it has none.
    __device__ uint32_t first(const Team& team) const { return rank(set) * TEAMS + team.id - base; }
    __device__ uint32_t stride() const { return set.count * TEAMS; }
    // The first slot of item i's split, and its chunks [chunk_begin, chunk_end).
    __device__ uint32_t chunk_begin(uint32_t i) const { return i % splits * span; }
    __device__ uint32_t chunk_end(uint32_t i) const { return min(chunk_begin(i) + span, n_chunks); }
};

// A team's chunk buffers, Q rows, scores and per-head running statistics in shared memory (its share of
// the ring, laid out as attn_smem_bytes sums it).
struct AttnSmem {
    bf16* base;                      // buffer b's K rows at base + b * 2 * rows, its V rows after them
    uint32_t rows;                   // chunk * (hd + KS_PAD)
    bf16* qs;                        // (ATTN_MAX_GROUP, hd + KS_PAD)
    float* ps;                       // (ATTN_MAX_GROUP, chunk + PS_PAD)
    float *run_m, *run_l, *rescale;  // (ATTN_MAX_GROUP) each
    bf16* pb;                        // (ATTN_MAX_GROUP, chunk + PB_PAD)
    __device__ AttnSmem(uint4* smem, const Team& team, uint32_t chunk, uint32_t hd) {
        base = reinterpret_cast<bf16*>(reinterpret_cast<char*>(smem) + team.id * TEAM_SMEM_BYTES);
        rows = chunk * (hd + KS_PAD);
        qs = base + ATTN_BUFFERS * 2 * rows;
        ps = reinterpret_cast<float*>(qs + ATTN_MAX_GROUP * (hd + KS_PAD));
        run_m = ps + ATTN_MAX_GROUP * (chunk + PS_PAD);
        run_l = run_m + ATTN_MAX_GROUP;
        rescale = run_l + ATTN_MAX_GROUP;
        pb = reinterpret_cast<bf16*>(rescale + ATTN_MAX_GROUP);
    }
    __device__ bf16* ks(uint32_t b) const { return base + b * 2 * rows; }
    __device__ bf16* vs(uint32_t b) const { return base + b * 2 * rows + rows; }
};

// Starts loading chunk c of KV head kv (slots first + r for r < len) into buffer b: rows under len but
// `skip` by asynchronous copies of every thread of the team, committed as one group per thread;
// rows from len on zeroed, so the P V product may run over the whole chunk. The buffer's previous
// contents must be dead: the callers reach this only after a team.sync that follows every read of them.
constexpr uint32_t NO_ROW = UINT32_MAX;
__device__ void load_chunk(const Team& team, const OpRow& op, const AttnSmem& sm, uint32_t b, uint32_t kv, uint32_t first,
                           uint32_t len, uint32_t chunk, uint32_t skip) {
    const bf16* k_cache = cache_ptr<const bf16>(op, attn::KCache);
    const bf16* v_cache = cache_ptr<const bf16>(op, attn::VCache);
    const uint32_t hd = (uint32_t)op[attn::Hd], row_vecs = hd / VEC, row = hd + KS_PAD;
    const size_t at = ((size_t)kv * (uint32_t)op[attn::MaxSeq] + first) * hd;
    for (uint32_t i = team.t; i < chunk * row_vecs; i += TEAM_THREADS) {
        const uint32_t r = i / row_vecs, col = i % row_vecs;
        uint4* kd = reinterpret_cast<uint4*>(sm.ks(b) + r * row) + col;
        uint4* vd = reinterpret_cast<uint4*>(sm.vs(b) + r * row) + col;
        if (r >= len) {
            *kd = make_uint4(0, 0, 0, 0);
            *vd = make_uint4(0, 0, 0, 0);
        } else if (r != skip) {
            cp_async16(kd, reinterpret_cast<const uint4*>(k_cache + at) + i);
            cp_async16(vd, reinterpret_cast<const uint4*>(v_cache + at) + i);
        }
    }
    cp_async_commit();
}

// Loads of an item's first chunks issued before any is scored: one per buffer.
__device__ inline uint32_t head_start(const AttnItems& items, uint32_t item) {
    return min(items.chunk_end(item) - items.chunk_begin(item), ATTN_BUFFERS);
}

// Before the wait in front of attention: each team starts loading its first item's first chunks, all
// but the slot at pos, which this launch's Qkv phase writes. They do not depend on this step, so HBM
// streams them while the block waits for the Qkv phase it depends on; the phase then loads only the
// queries and the row at pos.
__device__ void prime_attention(const OpRow& op, uint32_t pos, uint4* smem) {
    const Team team;
    const AttnItems items(op, pos);
    const uint32_t item = items.first(team);
    if (item >= items.count) return;
    const AttnSmem sm(smem, team, items.chunk, (uint32_t)op[attn::Hd]);
    const uint32_t c0 = items.chunk_begin(item);
    for (uint32_t c = c0; c < c0 + head_start(items, item); ++c) {
        const uint32_t first = c * items.chunk;
        load_chunk(team, op, sm, c - c0, item / items.splits, first, min(items.chunk, pos + 1 - first), items.chunk, pos - first);
    }
}

// Starts loading what phase `op` reads that no phase of this step writes, before the block waits for
// the phases it depends on: a GEMV phase's first weights, or an attention phase's cached rows.
// `qk_norms`: the layer's q/k norm weights, or null (see qkv_unit).
template <bool SLICED>
__device__ void prime_inputs(const OpRow& op, const Ring& ring, uint32_t pos, const bf16* qk_norms) {
    if (op[0] == OP_ATTENTION) prime_attention(op, pos, ring.data);
    else prime_phase<SLICED>(op, ring, qk_norms);
}

// Attention: work item (KV head, split of its chunks) -> for each query head of the group, the
// softmax numerator over the split's slots and its max and sum, kept running across the split's
// chunks (flash-decoding); then, with one split per head, the output, and with several, the combine
// of the head's partials into a (see AttnItems). Each KV chunk is loaded once for all of its query
// heads, the next chunk's copies in flight while this one is scored (chunk c0 + i of an item in buffer
// i % ATTN_BUFFERS). Where the block ran prime_attention for this phase and lane (`primed`: always but for
// a batch step's later lanes), each team's first item's first chunks lack only the row at pos.
// TRACED: thread 0 stamps when its team's first chunk has landed (TRACE_INPUT) and when its item's
// last chunk is summed (TRACE_STREAMED).
template <bool TRACED = false>
__device__ void phase_attention(const OpRow& op, uint32_t pos, uint4* smem, bool primed_first, uint32_t team_base = 0) {
    const bf16* q = act_ptr<const bf16>(op, attn::Q);
    float* part_o = act_ptr<float>(op, attn::PartO);
    float* part_ml = act_ptr<float>(op, attn::PartMl);
    unsigned* counters = act_ptr<unsigned>(op, attn::Counters);
    bf16* a_out = act_ptr<bf16>(op, attn::AOut);
    const uint32_t n_q = (uint32_t)op[attn::NQ], n_kv = (uint32_t)op[attn::NKv], hd = (uint32_t)op[attn::Hd];
    const uint32_t max_seq = (uint32_t)op[attn::MaxSeq], group = n_q / n_kv, per_head = group * hd;
    const AttnItems items(op, pos, team_base);
    const uint32_t chunk = items.chunk, splits = items.splits;
    // The partials' room per head: as many splits as the deepest slot can need (lib.rs allocates it).
    const uint32_t max_splits = min((max_seq + chunk - 1) / chunk, ATTN_MAX_SPLITS);
    unsigned* arrivals = counters;           // (n_kv) splits of each head whose partials are written
    unsigned* departures = counters + n_kv;  // (n_kv) teams done with the shared combine
    const float inv_sqrt_hd = __fdiv_rn(1.0f, __fsqrt_rn((float)hd));
    const Team team;
    const uint32_t t = team.t, lane = team.lane, warp = team.warp;
    const uint32_t row_vecs = hd / VEC, row = hd + KS_PAD, ps_row = chunk + PS_PAD;  // strides
    // Fragment coordinates of this lane: its group of the tiles' rows and columns, its quad position.
    const uint32_t g = lane / 4, quad = lane % 4;
    const uint32_t n_tiles = (group + 7) / 8, pb_row = chunk + PB_PAD;  // head tiles of 8; weights' stride
    const AttnSmem sm(smem, team, chunk, hd);
    float* ps = sm.ps;

    for (uint32_t item = items.first(team); item < items.count; item += items.stride()) {
        const uint32_t kv = item / splits, split = item % splits;
        const uint32_t c0 = items.chunk_begin(item), c1 = items.chunk_end(item);
        const bool primed = primed_first && item == items.first(team);
        // The queries (and, primed, the row at pos) join the chunk loads' groups: the first chunk's
        // wait is for all of them.
        for (uint32_t i = t; i < group * row_vecs; i += TEAM_THREADS) {
            cp_async16(reinterpret_cast<uint4*>(sm.qs + (i / row_vecs) * row) + i % row_vecs, reinterpret_cast<const uint4*>(q + (size_t)kv * group * hd) + i);
        }
        for (uint32_t h = t; h < group; h += TEAM_THREADS) {
            sm.run_m[h] = -CUDART_INF_F;
            sm.run_l[h] = 0.0f;
        }
        if (primed) {
            // The primed chunks lack the row this step's Qkv phase wrote (the block has waited for it).
            for (uint32_t c = c0; c < c0 + head_start(items, item); ++c) {
                const uint32_t first = c * chunk, r = pos - first;
                if (r >= min(chunk, pos + 1 - first)) continue;
                const size_t at = ((size_t)kv * max_seq + pos) * row_vecs;
                for (uint32_t i = t; i < row_vecs; i += TEAM_THREADS) {
                    cp_async16(reinterpret_cast<uint4*>(sm.ks(c - c0) + r * row) + i, cache_ptr<const uint4>(op, attn::KCache) + at + i);
                    cp_async16(reinterpret_cast<uint4*>(sm.vs(c - c0) + r * row) + i, cache_ptr<const uint4>(op, attn::VCache) + at + i);
                }
            }
            cp_async_commit();
        } else {
            for (uint32_t c = c0; c < c0 + head_start(items, item); ++c) {
                load_chunk(team, op, sm, c - c0, kv, c * chunk, min(chunk, pos + 1 - c * chunk), chunk, NO_ROW);
            }
        }
        // The numerator O^T (head dimension x heads) of this lane's tiles, across the split's chunks:
        // column tiles warp, warp + TEAM_WARPS, ... of 16, head tiles of 8 (see the P V product).
        float acc[PV_M][PV_N][4] = {};
        for (uint32_t c = c0; c < c1; ++c) {
            const uint32_t first = c * chunk, len = min(chunk, pos + 1 - first), b = (c - c0) % ATTN_BUFFERS;
            const bf16 *ks = sm.ks(b), *vs = sm.vs(b);
            // This chunk's group has landed once at most the groups issued after it are in flight: the
            // next chunk's, when it is issued and nothing but chunk loads came after this one (a first
            // chunk waits for the queries' group, issued after the primed chunks).
            if (c + 1 < c1 && !(primed && c == c0)) cp_async_wait_group<1>();
            else cp_async_wait_group<0>();
            team.sync();  // the chunk, the queries and the running statistics are in shared memory
            if (TRACED && c == c0) stamp(TRACE_INPUT);
            // Scores S^T = K Q^T on the tensor cores: A = K (16 slots x 16 of the head dimension, by
            // ldmatrix), B = Q^T (16 x 8 query heads; heads past the group zero). Warp w takes the
            // (slot tile, head tile) units w, w + TEAM_WARPS, ...; the even and odd steps along the head
            // accumulate apart, so two chains of products are in flight. Lane (g, quad) ends with slots
            // g and g + 8's scores of heads 2 quad + {0, 1}.
            for (uint32_t u = warp; u < chunk / 16 * n_tiles; u += TEAM_WARPS) {
                const uint32_t st = u / n_tiles, head = u % n_tiles * 8 + g;
                const bf16* a_row = ks + (st * 16 + lane % 8 + 8 * (lane / 8 % 2)) * row + 8 * (lane / 16);
                const bf16* q_row = sm.qs + head * row + 2 * quad;
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f}, e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (uint32_t k0 = 0; k0 < hd; k0 += 16) {
                    uint32_t a[4];
                    ldmatrix_x4(a, a_row + k0);
                    const uint32_t bq[2] = {head < group ? pair_at(q_row + k0) : 0u, head < group ? pair_at(q_row + k0 + 8) : 0u};
                    if (k0 / 16 % 2) mma_bf16_m16n8k16(e, a, bq);
                    else mma_bf16_m16n8k16(d, a, bq);
                }
                const uint32_t s = st * 16 + g, h = u % n_tiles * 8 + 2 * quad;
#pragma unroll
                for (uint32_t i = 0; i < 4; ++i) {
                    const uint32_t slot = s + 8 * (i / 2), hi = h + i % 2;
                    if (hi < group && slot < len) ps[hi * ps_row + slot] = __fmul_rn(__fadd_rn(d[i], e[i]), inv_sqrt_hd);
                }
            }
            team.sync();  // every score is in ps

            // Softmax of each query head over the chunk, against the running max: warp h. Weights past
            // len are zero; each is rounded to bf16 for the P V product, and the sum is of the rounded
            // weights, so the output's weights sum to 1. The running sum and the numerator are
            // rescaled by e^(old max - new max), which is 0 on a split's first chunk (the max was
            // -inf), so a one-chunk split's figures are the chunk's own.
            const bool last_chunk = c + 1 == items.chunk_end(item);
            float* ml = part_ml + (((size_t)kv * max_splits + split) * group) * 2;
            for (uint32_t h = warp; h < group; h += TEAM_WARPS) {
                float m = -CUDART_INF_F;
                for (uint32_t j = lane; j < len; j += WARP) m = fmaxf(m, ps[h * ps_row + j]);
                const float old_m = sm.run_m[h];
                m = fmaxf(old_m, warp_reduce(m, Max{}));
                float l = 0.0f;
                for (uint32_t j = lane; j < chunk; j += WARP) {
                    const bf16 e = __float2bfloat16_rn(j < len ? expf(__fsub_rn(ps[h * ps_row + j], m)) : 0.0f);
                    sm.pb[h * pb_row + j] = e;
                    l += __bfloat162float(e);
                }
                const float alpha = expf(__fsub_rn(old_m, m));
                l = fmaf(sm.run_l[h], alpha, warp_reduce(l, Add{}));
                __syncwarp();  // every lane has read run_m and run_l before lane 0 replaces them
                if (lane == 0) {
                    sm.run_m[h] = m;
                    sm.run_l[h] = l;
                    sm.rescale[h] = alpha;
                    if (last_chunk && splits > 1) {
                        ml[h * 2] = m;
                        ml[h * 2 + 1] = l;
                    }
                }
            }
            team.sync();  // the weights, the running statistics and the rescales are in shared memory

            // Numerator O^T = O^T e^(old max - new max) + V^T P^T on the tensor cores: A = V^T (16 of the
            // head dimension x 16 slots, by transposing ldmatrix), B = P^T (16 slots x 8 heads, the bf16
            // weights). Lane (g, quad) holds dimensions g and g + 8 of its column tile for heads
            // 2 quad + {0, 1} of its head tile.
#pragma unroll
            for (uint32_t nt = 0; nt < PV_N; ++nt) {
                const uint32_t h = nt * 8 + 2 * quad;
                const float r0 = h < group ? sm.rescale[h] : 0.0f, r1 = h + 1 < group ? sm.rescale[h + 1] : 0.0f;
#pragma unroll
                for (uint32_t mi = 0; mi < PV_M; ++mi) {
                    acc[mi][nt][0] *= r0;
                    acc[mi][nt][1] *= r1;
                    acc[mi][nt][2] *= r0;
                    acc[mi][nt][3] *= r1;
                }
            }
            for (uint32_t s0 = 0; s0 < chunk; s0 += 16) {
                uint32_t bp[PV_N][2];
#pragma unroll
                for (uint32_t nt = 0; nt < PV_N; ++nt) {
                    const uint32_t head = nt * 8 + g;
                    bp[nt][0] = head < group ? pair_at(sm.pb + head * pb_row + s0 + 2 * quad) : 0u;
                    bp[nt][1] = head < group ? pair_at(sm.pb + head * pb_row + s0 + 8 + 2 * quad) : 0u;
                }
#pragma unroll
                for (uint32_t mi = 0; mi < PV_M; ++mi) {
                    const uint32_t mt = warp + mi * TEAM_WARPS;
                    if (mt >= hd / 16) break;
                    uint32_t a[4];
                    ldmatrix_x4_trans(a, vs + (s0 + lane % 8 + 8 * (lane / 16)) * row + mt * 16 + 8 * (lane / 8 % 2));
#pragma unroll
                    for (uint32_t nt = 0; nt < PV_N; ++nt) {
                        if (nt < n_tiles) mma_bf16_m16n8k16(acc[mi][nt], a, bp[nt]);
                    }
                }
            }
            // The chunk's buffer is free once every thread is past its P V: it takes chunk c + ATTN_BUFFERS.
            if (c + ATTN_BUFFERS < c1) {
                team.sync();
                const uint32_t next = (c + ATTN_BUFFERS) * chunk;
                load_chunk(team, op, sm, b, kv, next, min(chunk, pos + 1 - next), chunk, NO_ROW);
            }
        }

        if (TRACED) stamp(TRACE_STREAMED);
        // Calls f(head, dimension, value) for each element of the numerator this lane holds.
        const auto each_output = [&](auto f) {
#pragma unroll
            for (uint32_t mi = 0; mi < PV_M; ++mi) {
                const uint32_t mt = warp + mi * TEAM_WARPS;
                if (mt >= hd / 16) break;
#pragma unroll
                for (uint32_t nt = 0; nt < PV_N; ++nt) {
#pragma unroll
                    for (uint32_t i = 0; i < 4; ++i) {
                        const uint32_t h = nt * 8 + 2 * quad + i % 2, dim = mt * 16 + g + 8 * (i / 2);
                        if (h < group) f(h, dim, acc[mi][nt][i]);
                    }
                }
            }
        };
        if (splits == 1) {
            // The head is this item: a = O / l, rounded as the combine of one split rounds it.
            bf16* a_head = a_out + (size_t)kv * per_head;
            each_output([&](uint32_t h, uint32_t dim, float o) {
                a_head[h * hd + dim] = __float2bfloat16_rn(fmaf(o, __fdiv_rn(1.0f, sm.run_l[h]), 0.0f));
            });
            team.sync();  // the team's shared memory is free for its next item
            continue;
        }

        float* po = part_o + (((size_t)kv * max_splits + split) * group) * hd;
        each_output([&](uint32_t h, uint32_t dim, float o) { po[h * hd + dim] = o; });
        team.sync();  // all of this team's partials are written (and its shared memory is free again)

        // Several splits: every team holds one item (AttnItems), so every split of the head arrives.
        unsigned departed = 0;  // thread 0: teams of the head past their wait before this one
        if (t == 0) {
            // Count this split in (release: its partials first) and wait for the rest (acquire: the
            // head's partials are read only after every arrival was seen).
            red_release_add(&arrivals[kv], 1);
            while (ld_acquire(&arrivals[kv]) < splits) __nanosleep(32);
            // Counted out as soon as it is past the wait; the count is read only after the combine,
            // so the atomic's round trip overlaps it.
            departed = atomicAdd(&departures[kv], 1u);
        }
        team.sync();  // every thread of the team sees every arrival
        // Split s's team combines outputs [s share, (s + 1) share) of the head.
        const uint32_t share = ((per_head + splits - 1) / splits + 3) & ~3u;
        const uint32_t lo = min(split * share, per_head), hi = min(lo + share, per_head);
        if (lo < hi) combine(team, kv, splits, max_splits, group, hd, lo, hi, part_o, part_ml, a_out, reinterpret_cast<float*>(sm.base));
        if (t == 0 && departed == splits - 1) {
            // Every team of the head is past its wait: reset both for the next step (the launch
            // boundary orders this before any later arrival: a step runs each attention phase once).
            arrivals[kv] = 0;
            departures[kv] = 0;
        }
        team.sync();  // the team's shared memory is free for its next item
    }
}

// dst = residual + W v over the columns the row names: all of them; or a first part, whose f32 products
// go to part_out; or a middle part, whose products are added to part_in's and go to part_out (the same
// rows of the same buffer, on the same block); or the last, whose products are added to part_in's
// before rounding. The O projection and Down are this GEMV.
// Where a residual GEMV's rows [r0, r1) end (see residual_gemv), and this thread's first row's residual
// and partial sum, loaded before the stream (see preload).
struct ResidualOut {
    const bf16* residual;
    bf16* dst;
    const float* part_in;
    float* part_out;
    float first_res, first_part;
};
__device__ inline ResidualOut residual_out(const bf16* residual, bf16* dst, const float* part_in, float* part_out, uint32_t r0, uint32_t r1) {
    const float first_res = part_out == nullptr ? preload(residual + r0, r1 - r0) : 0.0f;
    const float first_part = part_in != nullptr && threadIdx.x < r1 - r0 ? __ldcg(part_in + r0 + threadIdx.x) : 0.0f;
    return {residual, dst, part_in, part_out, first_res, first_part};
}

// The end of a residual GEMV: the sums of rows [r0, r1) in `part`, added to part_in's where it has one,
// to part_out, or rounded and added to the residual into dst.
__device__ inline void residual_epilogue(const ResidualOut& o, const Partials& part, uint32_t r0, uint32_t r1) {
    for (uint32_t r = threadIdx.x; r < r1 - r0; r += THREADS) {
        const bool first = r == threadIdx.x;
        const float y = row_sum(part.red, r);
        const float sum = o.part_in == nullptr ? y : __fadd_rn(first ? o.first_part : __ldcg(o.part_in + r0 + r), y);
        if (o.part_out != nullptr) {
            o.part_out[r0 + r] = sum;
            continue;
        }
        const float res = first ? o.first_res : __bfloat162float(__ldcg(o.residual + r0 + r));
        o.dst[r0 + r] = add_round(res, bf(sum));
    }
}

template <bool SLICED, bool TRACED = false>
__device__ void residual_gemv(const OpRow& op, const bf16* v, uint32_t cols, const bf16* residual, bf16* dst,
                              const float* part_in, float* part_out, Ring& ring, Partials part) {
    uint32_t r0, r1;
    gemv_rows(op, r0, r1);
    const ResidualOut o = residual_out(residual, dst, part_in, part_out, r0, r1);
    stream_phase<SLICED, TRACED>(op, [&](uint32_t t) { return load_slice(v, cols, t); }, ring, part, r0, r1);
    residual_epilogue(o, part, r0, r1);
}

// x1 = x + Wo a over the columns the row names: all of them; or those of the first half of the KV
// groups (f32 products to PartOut); or those of the second half, added to PartIn's, which the first
// half's blocks wrote (this phase waits for theirs).
template <bool SLICED, bool TRACED = false>
__device__ __forceinline__ void phase_oproj(const OpRow& op, const bf16* x, Ring& ring, Partials part) {
    residual_gemv<SLICED, TRACED>(op, act_ptr<const bf16>(op, oproj::A), (uint32_t)op[oproj::Cols], x, act_ptr<bf16>(op, oproj::X1Out),
                  part_ptr<const float>(op, oproj::PartIn), part_ptr<float>(op, oproj::PartOut), ring, part);
}

// The end of a GateUp phase: act = silu(gate) * up from the sums of rows [r0, r1) in `part`.
__device__ inline void gateup_epilogue(bf16* act, const Partials& part, uint32_t r0, uint32_t r1) {
    for (uint32_t p = threadIdx.x; p < (r1 - r0) / 2; p += THREADS) {
        act[r0 / 2 + p] = silu_mul(bf(row_sum(part.red, 2 * p)), bf(row_sum(part.red, 2 * p + 1)));
    }
}

// h2 = rmsnorm(x1); act = silu(Wg h2) * (Wu h2) over gate/up-interleaved rows.
template <bool SLICED, bool TRACED = false>
__device__ __forceinline__ void phase_gateup(const OpRow& op, Ring& ring, Partials part) {
    const uint32_t d = (uint32_t)op[gateup::D];
    const float eps = __int_as_float((int)op[gateup::EpsBits]);
    bf16* act = act_ptr<bf16>(op, gateup::ActOut);
    const bf16* x1 = act_ptr<const bf16>(op, gateup::X1);
    const bf16* g = reinterpret_cast<const bf16*>(layer_address(op, gateup::Norm));
    uint32_t r0, r1;
    if (SLICED) {
        gemv_rows(op, r0, r1);
        stream_phase<SLICED, TRACED>(op, [&](uint32_t t) { return rmsnorm_slice(x1, g, d, eps, t); }, ring, part, r0, r1);
    } else {
        // The norm's loads before the rows' arithmetic, as the layer kernels were measured.
        const Slice s = rmsnorm_slice(x1, g, d, eps);
        gemv_rows(op, r0, r1);
        gemv_phase(op, s, ring, part, r0, r1);
    }
    gateup_epilogue(act, part, r0, r1);
}

// out = x1 + Wd act over the columns of act the row names: all of them; or a part of them (f32 products
// to PartOut, added to PartIn's where the row names them; the last part rounds). Every part runs on the
// same blocks with the same rows, so a block adds the partials it wrote itself: program order, no wait.
template <bool SLICED, bool TRACED = false>
__device__ __forceinline__ void phase_down(const OpRow& op, bf16* out, Ring& ring, Partials part) {
    residual_gemv<SLICED, TRACED>(op, act_ptr<const bf16>(op, down::Act), (uint32_t)op[down::Cols], act_ptr<const bf16>(op, down::X1), out,
                  part_ptr<const float>(op, down::PartIn), part_ptr<float>(op, down::PartOut), ring, part);
}

// ---------------------------------------------------------------------------------------------------
// Running the program
// ---------------------------------------------------------------------------------------------------

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
// Runs phase f of the step on this block, which runs it: waits for the phases it depends on (those of
// the layer before too when `chained`, see wait_for), does its share, counts it done. `trace_at`: the
// phase's stamps, or null. `qk_norms`: the layer's q/k norm weights (a model's with them), or null.
// SLICED: narrow rows stream as groups of one (stream_phase), in the model kernel; the layer and stack
// kernels keep their measured machine code.
template <uint32_t TABLES, bool SLICED, bool TRACED = false>
__device__ __forceinline__ void run_phase(const Walk<TABLES>& walk, uint32_t f, bool chained, const StepIo& io, unsigned* phase_done,
                                          Ring& ring, const Partials& part, uint64_t* trace_at, const bf16* qk_norms) {
    const OpRow op = walk.op(f);
    const uint32_t l = f / walk.phases;
    wait_for(walk.program.words, (uint64_t)op[ROW_WAITS], phase_done, io.step, walk.layers, l, chained);
    // Thread 0 alone sets and reads the trace row: no synchronisation needed.
    if (threadIdx.x == 0) trace_row = trace_at;
    stamp(TRACE_START);
    const bf16* x_l = l == 0 ? io.x : io.hidden + (size_t)(l - 1) * io.d;
    bf16* out_l = l + 1 == walk.layers ? io.out : io.hidden + (size_t)l * io.d;
    switch (op[0]) {
        case OP_NOP: break;
        case OP_QKV:
            if (qk_norms != nullptr) phase_qkv_normed<TRACED>(op, x_l, io.pos, ring, part, qk_norms);
            else phase_qkv<SLICED, TRACED>(op, x_l, io.pos, ring, part);
            break;
        case OP_ATTENTION: phase_attention<TRACED>(op, io.pos, ring.data, true); break;
        case OP_O_PROJ: phase_oproj<SLICED, TRACED>(op, x_l, ring, part); break;
        case OP_GATE_UP: phase_gateup<SLICED, TRACED>(op, ring, part); break;
        case OP_DOWN: phase_down<SLICED, TRACED>(op, out_l, ring, part); break;
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
// does not run, and for the stamps a phase does not take).
template <uint32_t TABLES>
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
    if (f < phase_end) prime_inputs<false>(walk.op(f), ring, pos, nullptr);
    while (f < phase_end) {
        run_phase<TABLES, false>(walk, f, f >= phases, io, phase_done, ring, part,
                  trace == nullptr ? nullptr : trace + ((size_t)blockIdx.x * traced + (f - phase_begin)) * TRACE_STAMPS, nullptr);
        f = walk.next_own(f + 1, phase_end);
        if (f < phase_end) prime_inputs<false>(walk.op(f), ring, pos, nullptr);
    }
}

// ---------------------------------------------------------------------------------------------------
// A model: the token's embedding row into the stack, the final norm, the LM head and a greedy argmax,
// for every position of a generation in one launch
// ---------------------------------------------------------------------------------------------------

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

// Starts streaming the head's rows [r0, r1) (at most the partials' rows) into the ring, for run() or
// for run_group (`group`, RowStream's).
__device__ inline void prime_head_rows(const ModelArgs& m, uint32_t d, const Ring& ring, uint32_t r0, uint32_t r1, bool group = false) {
    with_stream(m.head, d, r0, r1, false, [&](auto stream) { stream.prime(ring); }, group);
}

// The head's first weights, before the head waits for the last layer (`group` as for prime_head_rows).
__device__ inline void prime_head(const ModelArgs& m, uint32_t d, const Ring& ring, uint32_t chunk_rows, bool group = false) {
    uint32_t r0, r1;
    head_rows(m.vocab, r0, r1);
    prime_head_rows(m, d, ring, r0, min(r0 + chunk_rows, r1), group);
}

// This block's rows of the LM head as one group-of-one stream (phase_head_solo).
__device__ inline RowStream<1> head_solo_stream(const ModelArgs& m, uint32_t d) {
    uint32_t r0, r1;
    head_rows(m.vocab, r0, r1);
    return group_stream<1>(m.head, d / VEC, r0, r1, false);
}

// The logits of head rows [c0, c1) from their sums in `part` (each row's warp partials in warp order),
// into m.logits, and the best of them and `best` (logit_key).
__device__ inline uint64_t head_logits(const ModelArgs& m, const Partials& part, uint32_t c0, uint32_t c1, uint64_t best) {
    for (uint32_t r = threadIdx.x; r < c1 - c0; r += THREADS) {
        const float v = row_sum(part.red, r);
        m.logits[c0 + r] = v;
        best = max(best, logit_key(v, c0 + r));
    }
    return best;
}

// logits = head rmsnorm(y, final_norm) over this block's rows, f32 (each row's warp partials summed in
// warp order), and the block's best row to its candidate slot. The rows go through the partials
// `part.rows` at a time; the next chunk's first stages stream while this one's logits are summed.
__device__ void phase_head(const ModelArgs& m, const bf16* y, uint32_t d, Ring& ring, Partials part) {
    const Slice s = rmsnorm_slice(y, m.final_norm, d, __int_as_float((int)m.eps_bits));
    uint32_t r0, r1;
    head_rows(m.vocab, r0, r1);
    uint64_t best = 0;
    for (uint32_t c0 = r0; c0 < r1; c0 += part.rows) {
        const uint32_t c1 = min(c0 + part.rows, r1);
        with_stream(m.head, d, c0, c1, false, [&](auto stream) { stream.run(s, ring, part); });
        // The ring is free: run ended on a __syncthreads after its last read of it.
        if (c1 < r1) prime_head_rows(m, d, ring, c1, min(c1 + part.rows, r1));
        // The next chunk's run starts with a __syncthreads before it writes red, so these reads of it
        // come first.
        best = head_logits(m, part, c0, c1, best);
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
// TinyLlama-1.1B 5.5% and left Llama-3.2-1B, whose head is 4x larger, 1.7% faster: not there
// (docs/perf.md, the ninth session).
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
// the phases and stamps a block does not take).
template <bool QK_NORM, bool SLICED, bool TRACED>
__device__ __forceinline__ void run_model(const Program<PROGRAM_MAX_LAYERS>& program, const ModelArgs& m, uint32_t phases, uint32_t layers,
                                          bf16* out, bf16* hidden, uint32_t d, uint32_t step, unsigned* phase_done, uint32_t red_rows,
                                          uint64_t* trace) {
    __shared__ uint64_t full[STAGES];
    Ring ring = start_ring(full);
    const Partials part = row_partials(red_rows);
    // The launcher checks these.
    if (phases > PROGRAM_MAX_PHASES || layers > PROGRAM_MAX_LAYERS || m.pos0 >= m.prompt_end || m.prompt_end > m.max_seq || m.max_new == 0) __trap();
    if (threadIdx.x == 0) trace_row = nullptr;  // set per phase in the traced instances only
    const Walk<PROGRAM_MAX_LAYERS> walk{program, phases, layers};
    const uint32_t per_step = phases * layers;
    // Phase f's q/k norm weights: null at compile time in the instance for models without them.
    const auto norms = [&](uint32_t f) -> const bf16* { return QK_NORM ? m.qk_norms[f / phases] : nullptr; };
    // The loop's state in shared memory, written by thread 0 between barriers: this step's io, the next
    // token, and the head phases run (the tokens generated are its offset from m.heads_before). Held
    // in registers across the phases (where the layer kernels' io is in their parameters), it spilled
    // 40 bytes; so it spills one word (megakernel/src/kernels.rs allows it).
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
    if (f < per_step) prime_inputs<SLICED>(walk.op(f), ring, io.pos, norms(f));
    for (;;) {
        while (f < per_step) {
            run_phase<PROGRAM_MAX_LAYERS, SLICED, TRACED>(walk, f, io.step != step || f >= phases, io, phase_done, ring, part, trace_at(f), norms(f));
            f = walk.next_own(f + 1, per_step);
            if (f < per_step) prime_inputs<SLICED>(walk.op(f), ring, io.pos, norms(f));
        }
        const uint32_t pos = io.pos;
        bool stop = false;
        if (pos + 1 >= m.prompt_end) {
            // The q/k-norm instance streams the head in full stages where rows of d run in slices
            // (phase_head_solo says why that instance alone).
            if (QK_NORM && in_slices(d)) prime_solo(head_solo_stream(m, d), ring);
            else prime_head(m, d, ring, part.rows);
            // Every row of the last layer, as the layer before the head: its output is whole.
            if (TRACED && threadIdx.x == 0) trace_row = trace_at(per_step);
            wait_for(program.words, ((1ull << phases) - 1) << PREV_LAYER_WAITS, phase_done, io.step, layers, layers, true);
            if (TRACED) stamp(TRACE_START);
            if (QK_NORM && in_slices(d)) phase_head_solo(m, out, d, ring, part);
            else phase_head(m, out, d, ring, part);
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
        if (f < per_step) prime_inputs<SLICED>(walk.op(f), ring, pos + 1, norms(f));
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        m.done[0] = io.step - step + 1;
        m.done[1] = heads - m.heads_before;
    }
}

// ---------------------------------------------------------------------------------------------------
// A batch step: up to MAX_BATCH lanes (the sequences of a batch, or the positions of one prompt's
// chunk) through one step of the model, the weights streamed once per group of lanes, each lane's
// values bitwise those of its own decode step
// ---------------------------------------------------------------------------------------------------

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

// Phase `op`'s GEMV for lanes [0, lanes) over this block's rows [r0, r1) in units of `unit` rows, as
// lanes_group: the weights streamed once per group of lanes (lanes_per_group), each group's rows in
// chunks whose partials fit (chunk_rows). The first group's first chunk is in the ring (prime_phase with
// the lanes); every later stream primes its own.
template <typename In, typename Out>
__device__ void lanes_gemv(const OpRow& op, uint32_t lanes, uint32_t unit, uint32_t r0, uint32_t r1, Ring& ring, Partials part, In input, Out epilogue) {
    Gemv gemv;
    if (!gemv_of(op, gemv)) __trap();
    with_stream(gemv.w, gemv.cols, r0, r1, gemv.in_place, [&](auto all) {
        constexpr uint32_t VPT = decltype(all)::VECS_PER_THREAD, G = group_of<VPT>();
        const uint32_t fit = lanes_per_group(G, unit, part.rows);
        if (fit == 0) __trap();  // the launcher sizes the partials for a unit of rows of every phase
        if (row_slices(all.vecs) > 1) zero_partials(part);  // the phase before's epilogue ended on a __syncthreads
        for (uint32_t b0 = 0; b0 < lanes; b0 += fit) {
            const uint32_t live = min(fit, lanes - b0);
            lanes_group<VPT, G>(all, b0, live, chunk_rows(live, unit, part.rows), b0 > 0, ring, part, input, epilogue);
        }
    });
}

// Phase `op` of a batch step for every lane (`l` its layer): the GEMV phases through lanes_gemv, with
// each lane's input and epilogue those of the decode step's phase; attention lane after lane.
__device__ void batch_phase(const OpRow& op, uint32_t l, const ModelArgs& m, const BatchArgs& ba, const BatchIo& io, Ring& ring, Partials part) {
    const uint32_t lanes = ba.lanes;
    uint32_t r0, r1;
    switch (op[0]) {
        case OP_NOP: break;
        case OP_QKV: {
            const bf16* norms = m.qk_norms[l];
            gemv_rows(op, r0, r1, norms);
            const uint32_t d = (uint32_t)op[qkv::D];
            lane_norms(lanes, d, __int_as_float((int)op[qkv::EpsBits]), [&](uint32_t b) { return io.x(ba, b, l); });
            const auto input = [&](uint32_t b, uint32_t t) { return lane_rmsnorm(io.x(ba, b, l), reinterpret_cast<const bf16*>(layer_address(op, qkv::Norm)), d, b, t); };
            const uint32_t unit = qkv_unit(op, norms);
            if (norms != nullptr) {
                lanes_gemv(op, lanes, unit, r0, r1, ring, part, input,
                           [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) { qkv_normed_epilogue(lane_op(op, ba, b), ba.pos[b], ring, p, norms, c0, c1); });
            } else {
                lanes_gemv(op, lanes, unit, r0, r1, ring, part, input, [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) {
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
        // spill loads, a build not run on the GPU.
        case OP_O_PROJ:
            gemv_rows(op, r0, r1);
            lanes_gemv(
                op, lanes, 2, r0, r1, ring, part, [&](uint32_t b, uint32_t t) { return load_slice(act_ptr<const bf16>(lane_op(op, ba, b), oproj::A), (uint32_t)op[oproj::Cols], t); },
                [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) {
                    const OpRow lop = lane_op(op, ba, b);
                    residual_epilogue(residual_out(io.x(ba, b, l), act_ptr<bf16>(lop, oproj::X1Out), part_ptr<const float>(lop, oproj::PartIn), part_ptr<float>(lop, oproj::PartOut), c0, c1), p, c0, c1);
                });
            break;
        case OP_GATE_UP: {
            const uint32_t d = (uint32_t)op[gateup::D];
            const auto x1 = [&](uint32_t b) { return act_ptr<const bf16>(lane_op(op, ba, b), gateup::X1); };
            lane_norms(lanes, d, __int_as_float((int)op[gateup::EpsBits]), x1);
            gemv_rows(op, r0, r1);
            lanes_gemv(
                op, lanes, 2, r0, r1, ring, part, [&](uint32_t b, uint32_t t) { return lane_rmsnorm(x1(b), reinterpret_cast<const bf16*>(layer_address(op, gateup::Norm)), d, b, t); },
                [&](uint32_t b, const Partials& p, uint32_t c0, uint32_t c1) { gateup_epilogue(act_ptr<bf16>(lane_op(op, ba, b), gateup::ActOut), p, c0, c1); });
            break;
        }
        case OP_DOWN:
            gemv_rows(op, r0, r1);
            lanes_gemv(
                op, lanes, 2, r0, r1, ring, part, [&](uint32_t b, uint32_t t) { return load_slice(act_ptr<const bf16>(lane_op(op, ba, b), down::Act), (uint32_t)op[down::Cols], t); },
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
__device__ inline void batch_prime(const Walk<PROGRAM_MAX_LAYERS>& walk, uint32_t f, const ModelArgs& m, const BatchArgs& ba, const Ring& ring, const Partials& part) {
    const OpRow op = lane_op(walk.op(f), ba, 0);
    if (op[0] == OP_ATTENTION) prime_attention(op, ba.pos[0], ring.data);
    else prime_phase(op, ring, m.qk_norms[f / walk.phases], ba.lanes, part.rows);
}

// One step of every lane of `ba` through the model, in one launch: the stack's phases as run_model runs
// a position's (each phase for every lane before it counts done), then the head for every lane and,
// in block 0, each lane's greedy token. The model's positions, tokens, done counts and end-of-sequence
// tokens are not read: a batch step is one step, its lanes given.
__device__ __forceinline__ void run_batch(const Program<PROGRAM_MAX_LAYERS>& program, const ModelArgs& m, const BatchArgs& ba, uint32_t phases, uint32_t layers,
                                          bf16* out, bf16* hidden, uint32_t d, uint32_t step, unsigned* phase_done, uint32_t red_rows) {
    __shared__ uint64_t full[STAGES];
    Ring ring = start_ring(full);
    const Partials part = row_partials(red_rows);
    // The launcher checks these.
    if (phases > PROGRAM_MAX_PHASES || layers > PROGRAM_MAX_LAYERS || ba.lanes == 0 || ba.lanes > MAX_BATCH) __trap();
    for (uint32_t b = 0; b < ba.lanes; ++b) {
        if (ba.pos[b] >= m.max_seq || ba.token[b] >= m.vocab) __trap();
    }
    if (threadIdx.x == 0) trace_row = nullptr;  // a batch step is not traced
    const Walk<PROGRAM_MAX_LAYERS> walk{program, phases, layers};
    const BatchIo io{m.embed, out, hidden, d, layers};
    const uint32_t per_step = phases * layers;
    uint32_t f = walk.next_own(0, per_step);
    if (f < per_step) batch_prime(walk, f, m, ba, ring, part);
    while (f < per_step) {
        const OpRow op = walk.op(f);
        wait_for(program.words, (uint64_t)op[ROW_WAITS], phase_done, step, layers, f / phases, f >= phases);
        batch_phase(op, f / phases, m, ba, io, ring, part);
        finish_phase(phase_done, f % phases);
        f = walk.next_own(f + 1, per_step);
        if (f < per_step) batch_prime(walk, f, m, ba, ring, part);
    }
    prime_head(m, d, ring, part.rows / head_group(d), true);
    // Every row of the last layer, as the layer before the head: every lane's output is whole.
    wait_for(program.words, ((1ull << phases) - 1) << PREV_LAYER_WAITS, phase_done, step, layers, layers, true);
    batch_head(m, ba, out, d, ring, part);
    finish_phase(phase_done, HEAD_COUNTER);
    if (blockIdx.x == 0) batch_tokens(m, ba, phase_done, m.heads_before + 1);
}

