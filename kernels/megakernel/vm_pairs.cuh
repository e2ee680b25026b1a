// The nf4 stream on the tensor cores, for rows of NF4_PAIR_COLS or NF4_PAIR_COLS / 2 columns in pair
// tiles (the loader packs them so: megakernel/src/model/code_stream.rs, pair_tiled). A tile is
// NF4_TILE_ROWS rows and a stage holds a tile of the wide rows or two of the narrow ones (a group
// stream's two slices), 32 KB of codes either way; warp w takes PAIR_WARP_COLS columns of its tile's,
// a 64-column group (one absmax) at a time, as PAIR_STEPS bf16 mmas (m16n8k16). An A register is two
// adjacent columns of a row, one byte of codes, so one load from a table of each byte's two values as
// bf16x2 (pair_table) takes the place of the fused form's two lookups and two FMAs (run_codes); the mma
// sums the products across the fragment's lanes. B's eight columns are input vectors: a decode step's
// x in every one, a batch step's lanes one a column, so that each lane's sums are its decode step's
// bits (an mma's output column depends on its own column of B alone). scripts/probes/nf4_mma.cu
// measured this form at 1.03-1.07x the ring's copy-only time, where the fused form took 1.2-1.24x, and a
// lane's column bitwise its decode's (docs/perf.md, "The nf4 stream's arithmetic on the tensor cores:
// a probe"). The codebook is rounded to bf16 (2^-9 relative a value), as the loader rounds every bf16
// weight.
#pragma once
#include "vm_stream.cuh"

constexpr uint32_t NF4_PAIR_COLS = 4096;
constexpr uint32_t NF4_TILE_ROWS = 16;
constexpr uint32_t PAIR_WARP_COLS = NF4_PAIR_COLS / WARPS;           // a warp's columns of a tile: 256
constexpr uint32_t PAIR_GROUPS = PAIR_WARP_COLS / NF4_SCALE_COLS;    // a warp's absmax groups: 4
constexpr uint32_t PAIR_K = 16;                                      // an mma's columns of A (k)
constexpr uint32_t PAIR_STEPS = NF4_SCALE_COLS / PAIR_K;             // mmas a group: 4
constexpr uint32_t PAIR_WARP_STEPS = PAIR_GROUPS * PAIR_STEPS;       // mmas a warp a stage: 16
constexpr uint32_t PAIR_B_LANES = 4;                                 // lanes holding a column of B (q = lane % 4)
constexpr uint32_t PAIR_COLUMNS = 8;                                 // B's columns (n)
constexpr uint32_t PAIR_ENTRY_BYTES = WARP * 4;                      // a byte's entry: a bf16x2 for each lane
constexpr uint32_t PAIR_TABLE_BYTES = 256 * PAIR_ENTRY_BYTES;        // 32 KB
static_assert(RowStream<1, NF4_CODES>::SLICE_ROWS == NF4_TILE_ROWS, "a stage of pair-tiled rows is one tile");
static_assert(NF4_PAIR_COLS == THREADS * VEC, "thread t holds vector t of x (or of the narrow rows' slice), whose words are B's registers (write_pair_b)");
static_assert(MAX_BATCH == PAIR_COLUMNS, "a batch's lanes are B's columns");

// The table and B's columns live in the upper halves of the ring's slots, which an nf4 stage
// (stage_code_bytes: half a slot) never fills: the table in slot 0's, B in slot 1's (warps [0, WARPS /
// 2)) and slot 2's (the rest). Phases of other rows (bf16 stages, attention's chunks) use whole slots,
// so a phase streaming pair tiles writes both as it starts (the probe's pairs-rewrite, its table
// written every 4 stages, cost nothing measurable). Ordering: those ordinary stores follow the phase
// before's last read and copy into the halves (finish_phase's barrier; every copy it issued was waited
// for), and precede the copy engine's next writes there (a later phase's bf16 stages) through the
// proxy fence each phase ends with (finish_phase).
constexpr uint32_t PAIR_HALF_BYTES = STAGE_BYTES - stage_code_bytes<NF4_CODES>();
constexpr uint32_t PAIR_WARP_B_BYTES = PAIR_WARP_STEPS * PAIR_COLUMNS * PAIR_B_LANES * 8;  // a warp's B: 4 KB
static_assert(PAIR_TABLE_BYTES <= PAIR_HALF_BYTES && WARPS / 2 * PAIR_WARP_B_BYTES <= PAIR_HALF_BYTES && STAGES >= 3, "the table and B fit the slots' upper halves");

// Whether rows of `cols` columns, `rows` of them, are in pair tiles when they stream as nf4 codes: the
// wide rows, and where NARROW the narrow ones that a group stream holds two tiles of in a stage
// (row_slices 2). NARROW: an instance that meets narrow rows (the sliced one, the batch step); the
// instance for wide rows keeps the machine code it was measured with.
template <bool NARROW>
__device__ inline bool pair_tiled_shape(uint32_t rows, uint32_t cols) {
    return (cols == NF4_PAIR_COLS || (NARROW && cols == NF4_PAIR_COLS / 2)) && rows % NF4_TILE_ROWS == 0;
}

__device__ inline char* slot_upper_half(const Ring& ring, uint32_t slot) {
    return reinterpret_cast<char*>(ring.data + slot * (STAGE_BYTES / 16)) + stage_code_bytes<NF4_CODES>();
}
__device__ inline uint32_t* pair_table(const Ring& ring) { return reinterpret_cast<uint32_t*>(slot_upper_half(ring, 0)); }

// Warp w's B: for k-step k, lane q of column c loads uint2 k PAIR_COLUMNS PAIR_B_LANES + (c ^ k % 4)
// PAIR_B_LANES + q. The XOR by k % 4 makes both sides conflict-free: a k-step's load by a half-warp
// (columns 0-3 or 4-7, its uint2 a bank pair each) and write_pair_b's stores (32 lanes, 16 k-steps,
// each store a bank of its own); a decode step's lanes all read column 0, one address for each q.
__device__ inline uint2* pair_b(const Ring& ring, uint32_t w) {
    return reinterpret_cast<uint2*>(slot_upper_half(ring, 1 + w / (WARPS / 2)) + w % (WARPS / 2) * PAIR_WARP_B_BYTES);
}

// The table: byte e's entry, the values of its low and high nibbles' codes as bf16x2 (the low nibble,
// the even column, in the lower half), a copy for each lane in its own bank so that a warp's lookups
// never conflict; by the whole block, four lanes' copies a 16-byte store.
__device__ inline void write_pair_table(const Ring& ring) {
    constexpr uint32_t PER_STORE = 4, STORES = PAIR_TABLE_BYTES / 16;
    uint4* table = reinterpret_cast<uint4*>(pair_table(ring));
    for (uint32_t i = threadIdx.x; i < STORES; i += THREADS) {
        const uint32_t e = i / (WARP / PER_STORE);
        const bf162 v = __floats2bfloat162_rn(NF4_VALUES[e % 16], NF4_VALUES[e / 16]);
        const uint32_t word = *reinterpret_cast<const uint32_t*>(&v);
        table[i] = make_uint4(word, word, word, word);
    }
}

// Column c of B from x as thread t holds it: its vector t, or for the narrow rows column_thread's, the
// vector of its tile's columns (warp w takes columns 256 (w % 8) of tile w / 8). Register h of warp w's
// k-step k for lane q is the warp's columns 16 k + 8 h + 2q and the next, word q of thread 32 w + 2 k +
// h's vector, so each thread stores its four words, store i its word (i + k / 4) % 4 (pair_b: each
// store of the warp a bank of its own).
__device__ inline void write_pair_b(const Ring& ring, uint32_t c, uint4 x) {
    const uint32_t lane = threadIdx.x % WARP, k = lane / 2, h = lane % 2;
    uint32_t* b = reinterpret_cast<uint32_t*>(pair_b(ring, threadIdx.x / WARP) + (k * PAIR_COLUMNS + (c ^ k % 4)) * PAIR_B_LANES) + h;
    const uint32_t words[PAIR_B_LANES] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (uint32_t i = 0; i < PAIR_B_LANES; ++i) {
        const uint32_t q = (i + k / 4) % PAIR_B_LANES;
        // words[q] by selects: a runtime index into the array would put it in local memory.
        const uint32_t word = q == 0 ? words[0] : q == 1 ? words[1] : q == 2 ? words[2] : words[3];
        b[2 * q] = word;
    }
}

// red[(c n + r - r0)][warp] = warp `warp`'s partial of row r with column c of B, for c < live: run_group's
// layout for a group of `live` lanes, run_codes's for one. A warp's partial is its groups' mma sums, each
// times its absmax, added in group order; lane 4g + q holds rows g and g + 8 of columns 2q and 2q + 1. In
// a stage of two tiles a warp stores 0 for the other tile's rows, so that each row's sum over the warps
// (row_sum) is its own tile's warps' in warp order, plus zeros. Needs the stream's first stages primed
// and the table and B's columns written (each thread's writes precede the first stage's barrier);
// advances ring.seq. NARROW: as pair_tiled_shape's (otherwise a stage is one tile).
template <bool NARROW>
__device__ inline void run_pairs(const RowStream<1, NF4_CODES>& stream, uint32_t live, Ring& ring, Partials part) {
    const uint32_t lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, q = lane % 4;
    // The launcher sizes the partials; a block's rows are whole tiles (block_rows with row_unit's unit),
    // a stage one tile or two (a group stream of the narrow rows).
    const uint32_t tiles = NARROW ? stream.stage_rows / NF4_TILE_ROWS : 1;
    if (stream.n * live > part.rows || live > PAIR_COLUMNS || stream.stage_rows != tiles * NF4_TILE_ROWS || tiles > 2 || stream.n % NF4_TILE_ROWS != 0) __trap();
    const uint32_t tile = NARROW ? warp / (WARPS / tiles) : 0;
    const uint32_t table = smem_addr(pair_table(ring)) + lane * 4;
    // Lanes of B's columns past live read the last live one's (their sums are never stored); b[x] is the
    // lane's uint2 of k-steps k with k % 4 == x, less k's offset (pair_b).
    const uint32_t c = min(g, live - 1);
    const uint2* b[4];
#pragma unroll
    for (uint32_t x = 0; x < 4; ++x) b[x] = pair_b(ring, warp) + (c ^ x) * PAIR_B_LANES + q;
    const float* slots = scale_slots<NF4_CODES>(ring);
    for (uint32_t st = 0; st < stream.nstages; ++st) {
        const uint4* codes = stream.next_stage(ring, st) + warp * PAIR_GROUPS * WARP + lane;
        // The tile's absmax: rows g and g + 8 of a group side by side (code_stream.rs, pair_scale_index).
        const float2* scales = reinterpret_cast<const float2*>(slots + (ring.seq + st) % STAGES * (NF4_SCALE_SLOT_BYTES / 4)) + warp * PAIR_GROUPS * (NF4_TILE_ROWS / 2) + g;
        // A stage's tiles: two, or one where the block's rows end half way through it.
        const uint32_t row0 = st * stream.stage_rows, present = NARROW ? min(tiles, (stream.n - row0) / NF4_TILE_ROWS) : 1;
        float rows[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // as an mma's d: row g at columns 2q, 2q + 1, then row g + 8
        if (tile < present) {  // the same in the whole warp, as each mma needs
#pragma unroll
            for (uint32_t j = 0; j < PAIR_GROUPS; ++j) {
                const uint4 lane_codes = codes[j * WARP];
                const uint32_t words[PAIR_STEPS] = {lane_codes.x, lane_codes.y, lane_codes.z, lane_codes.w};
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (uint32_t m = 0; m < PAIR_STEPS; ++m) {
                    uint32_t a[4];
                    // Byte r of word m is register r of k-step m. Not volatile: the table is written before the
                    // barrier each stage's wait begins with, and each address comes from codes read after it.
#pragma unroll
                    for (uint32_t r = 0; r < 4; ++r) asm("ld.shared.b32 %0, [%1];" : "=r"(a[r]) : "r"(table + __byte_perm(words[m], 0, 0x4440 + r) * PAIR_ENTRY_BYTES));
                    const uint32_t k = j * PAIR_STEPS + m;
                    const uint2 bk = b[k % 4][k * PAIR_COLUMNS * PAIR_B_LANES];
                    const uint32_t bf[2] = {bk.x, bk.y};
                    mma_bf16_m16n8k16(d, a, bf);
                }
                const float2 s = scales[j * (NF4_TILE_ROWS / 2)];
                rows[0] = fmaf(d[0], s.x, rows[0]);
                rows[1] = fmaf(d[1], s.x, rows[1]);
                rows[2] = fmaf(d[2], s.y, rows[2]);
                rows[3] = fmaf(d[3], s.y, rows[3]);
            }
        }
        for (uint32_t t = 0; t < present; ++t) {
            const bool own = t == tile;
#pragma unroll
            for (uint32_t e = 0; e < 2; ++e) {
                const uint32_t col = 2 * q + e;
                if (col >= live) continue;
                float* red = part.red + ((size_t)col * stream.n + row0 + t * NF4_TILE_ROWS + g) * WARPS + warp;
                red[0] = own ? rows[e] : 0.0f;
                red[NF4_TILE_ROWS / 2 * WARPS] = own ? rows[2 + e] : 0.0f;
            }
        }
    }
    ring.seq += stream.nstages;
    __syncthreads();  // every warp's partials are in red before any thread adds them up
}
