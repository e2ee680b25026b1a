// The megakernel's sizes, fixed at compile time: the block, the weight-stream ring, attention's teams,
// chunks and tiles, the combine. megakernel/src/lib.rs mirrors the ones the host needs and a test
// checks each against this file.
#pragma once
#include "layer_math.cuh"

// Threads per block; one block per SM (__launch_bounds__ below) leaves 128 registers per thread.
constexpr uint32_t THREADS = 512;
constexpr uint32_t WARPS = THREADS / WARP;
constexpr uint32_t THREADS_LOG2 = 9, WARPS_LOG2 = 4;
static_assert(1u << THREADS_LOG2 == THREADS && 1u << WARPS_LOG2 == WARPS, "the shifts of slices_log2 and run_group");
// The ring: STAGES slots of STAGE_BYTES, up to STAGES - 1 of them in flight ahead of use (IN_FLIGHT).
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
// conflicts and attention at 128k compute-bound (docs/perf.md, "The megakernel for the whole family",
// the steps not kept); so the rows arrive by per-thread copies.
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
