// Whether the nf4 stream's arithmetic belongs on the tensor cores (issue 49). The megakernel's nf4 decode
// step is bound by its SMs' instructions, not by its bytes: a weight costs a byte permutation (its
// codebook entry's address), a shared-memory load and an FMA, and a row's 16 warp partials a sum across
// the warp. On the tensor cores the FMA and the warp's sum go into one mma.sync m16n8k8 (tf32) per 128
// weights: the codebook values are A (16 rows by 8 columns of the stage), x is B's first column (bf16,
// so exact in tf32), and each lane's 16 bytes of a 64-column group are the codes of its own fragment
// elements, packed so (pack_tensor), read in one 16-byte load. A weight is then the permutation and the
// load; the absmax of each 64 columns scales the group's sum after its eight mmas.
//
// Every form streams the same matrix (8B's GateUp, 28672 rows of 4096 columns, four copies: 264 MB
// with their absmax, far past L2) through the megakernel's ring as a block of a decode step has it:
// 512 threads, three slots of one stage each (16 rows: 32 KB of codes, 4 KB of absmax, one bulk copy
// each on the slot's mbarrier), a block an SM. Variants:
//   copy   the ring alone, no arithmetic: the stream's own rate, the floor the others are read against;
//   fused  the megakernel's form (vm_stream.cuh's nf4_values8, fused8 and reduce_transposed, two passes
//          of 8 rows a stage, the warps' partials added in warp order);
//   mma    the tensor-core form, its codebook rounded to tf32 (cvt.rna), the warps' partials as fused's;
//   pairs  the tensor cores in bf16 (mma.sync m16n8k16): A's registers are pairs of adjacent columns of a
//          row, one byte of codes, so each is one load from a table of a byte's two values (bf16x2) that
//          every lane has a copy of in its own bank (256 entries x 32 lanes: 32 KB, conflict-free); a
//          byte is a permutation, a multiply-add for its address and a load: 1.5 instructions a weight
//          where the lookups of fused and mma take 2, and half their codebook loads a weight;
//   pairs-rewrite  pairs with its table written again every REWRITE_STAGES stages, behind a barrier:
//          the megakernel has no 32 KB to keep it in, so it would write it into a slot's idle half at
//          each nf4 phase (a block's share of 8B's Qkv, O, GateUp and Down is 3 to 14 stages);
//   pairs-batch  pairs as a batch step would run it: B's eight columns all hold vectors (x1 in column 1,
//          x in 0, x times powers of two in 2-7) and the sums of column 1 are stored; they must be the
//          bits of pairs run on x1 alone in column 0 (the plan's batch lanes keep their decode bits);
//   fused-alu, mma-alu  the same with each codebook load replaced by a shift of its address (one ALU
//          instruction, no shared-memory access; the values are not the codebook's): what the lookups'
//          shared-memory traffic costs each form, beyond their instructions.
// Each output is checked against f64 products on the CPU with the exact codebook (worst |error| over
// sum |w x| of its row), every output poisoned before each run. Build and run on the GPU (-fpermissive:
// the megakernel's headers are device code that its own cubin build never parses for the host, where
// one template names __clz before the host compiler has a declaration of it):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Xcompiler -fpermissive -I kernels/include -I kernels/megakernel \
//     -I scripts/probes -o nf4_mma scripts/probes/nf4_mma.cu && ./nf4_mma
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>

#include "vm_stream.cuh"
#define PROBE_WITH_MEGAKERNEL
#include "probe.cuh"

constexpr uint32_t COLS = 4096;                                  // 8B's Qkv, O and GateUp rows
constexpr uint32_t MATRIX_ROWS = 28672;                          // 8B's GateUp
constexpr uint32_t COPIES = 4;                                   // of the matrix, one after another
constexpr uint32_t ROWS = MATRIX_ROWS * COPIES;                  // streamed a launch
constexpr uint32_t STAGE_ROWS = 16;                              // the megakernel's nf4 stage at 4096 columns
constexpr uint32_t ROW_WORDS = COLS / VEC;                       // 32-bit words of 8 codes a row
constexpr uint32_t ROW_GROUPS = COLS / NF4_SCALE_COLS;           // absmax a row
constexpr uint32_t STAGE_CODE_BYTES = STAGE_ROWS * COLS / 2;     // 32 KB
constexpr uint32_t STAGE_SCALES = STAGE_ROWS * ROW_GROUPS;       // 1024 absmax: 4 KB
constexpr uint32_t SLOTS = 3;                                    // the ring, two stages in flight ahead of use
constexpr uint32_t PASS = 8;                                     // fused's rows a pass (run_rows' PASS_ROWS here)
// The mma form: warp w takes columns [WARP_COLS w, WARP_COLS (w + 1)) of every row of a stage, a group
// of 64 columns (one absmax) at a time, eight k-steps of 8 columns a group.
constexpr uint32_t WARP_COLS = COLS / WARPS;                     // 256
constexpr uint32_t WARP_GROUPS = WARP_COLS / NF4_SCALE_COLS;     // 4
constexpr uint32_t GROUP_STEPS = NF4_SCALE_COLS / 8;             // 8 mmas of k = 8
constexpr uint32_t WARP_STEPS = WARP_GROUPS * GROUP_STEPS;       // 32
constexpr uint32_t X_LANES = 4;                                  // the lanes holding B's column 0 (x)
constexpr uint32_t PAIR_STEPS = NF4_SCALE_COLS / 16;             // pairs: 4 mmas of k = 16 a group
constexpr uint32_t PAIR_ENTRY_BYTES = WARP * 4;                  // a byte's entry: one bf16x2 a lane
constexpr uint32_t REWRITE_STAGES = 4;                           // pairs-rewrite: stages a table serves
constexpr int REPS = 10;

// Shared memory (dynamic): the ring's codes and absmax, the codebook, the tensor-core forms' B fragments
// of x (mma: WARPS x WARP_STEPS x X_LANES float2; pairs: half of that in bf16x2 pairs, pairs-batch's x1
// in the other half), a run of zeros the other lanes read B from (placed 32 bytes off x's banks, so a
// step's two addresses never share a bank), the warps' partials of two stages, pairs' table.
constexpr uint32_t SM_CODES = 0;
constexpr uint32_t SM_SCALES = SM_CODES + SLOTS * STAGE_CODE_BYTES;
constexpr uint32_t SM_BOOK = SM_SCALES + SLOTS * STAGE_SCALES * 4;
constexpr uint32_t SM_XF = SM_BOOK + NF4_BOOK_ALIGN;
constexpr uint32_t XF_BYTES = WARPS * WARP_STEPS * X_LANES * 8;
constexpr uint32_t SM_ZEROS = SM_XF + XF_BYTES + 32;
constexpr uint32_t ZERO_BYTES = WARP_STEPS * X_LANES * 8;
constexpr uint32_t SM_RED = (SM_ZEROS + ZERO_BYTES + 127) / 128 * 128;
constexpr uint32_t SM_TABLE = SM_RED + 2 * STAGE_ROWS * WARPS * 4;
constexpr uint32_t SM_BYTES = SM_TABLE + 256 * PAIR_ENTRY_BYTES;
static_assert(SM_BOOK % NF4_BOOK_ALIGN == 0, "nf4_values8's addressing needs the aligned codebook");

enum class Kind { Copy, Fused, FusedAlu, Mma, MmaAlu, Pairs, PairsRewrite, PairsBatch };
constexpr const char* NAMES[] = {"copy", "fused", "fused-alu", "mma", "mma-alu", "pairs", "pairs-rewrite", "pairs-batch"};
// The table's forms, each against the f64 products; pairs-batch is judged apart, against pairs on its
// second vector.
constexpr Kind KINDS[] = {Kind::Copy, Kind::Fused, Kind::FusedAlu, Kind::Mma, Kind::MmaAlu, Kind::Pairs, Kind::PairsRewrite};
__host__ __device__ constexpr bool is_mma(Kind k) { return k == Kind::Mma || k == Kind::MmaAlu; }
__host__ __device__ constexpr bool is_pairs(Kind k) { return k == Kind::Pairs || k == Kind::PairsRewrite || k == Kind::PairsBatch; }
__host__ __device__ constexpr bool looks_up(Kind k) { return k == Kind::Fused || k == Kind::Mma || is_pairs(k); }
// pairs-batch's multiples of x in B's columns 2-7 (powers of two: exact in bf16).
__constant__ float BATCH_SCALES[8] = {1.0f, 1.0f, -0.5f, 0.25f, -2.0f, 4.0f, 0.5f, -1.0f};

// pairs' table: byte e's entry, a copy for each lane (the low nibble's value in the lower half), by the
// whole block in 16-byte stores (four lanes' copies each: 32 KB in 4 stores a thread).
__device__ inline void write_pair_table(uint32_t* table) {
    constexpr uint32_t PER_STORE = 4, STORES = 256 * WARP / PER_STORE;
    for (uint32_t i = threadIdx.x; i < STORES; i += THREADS) {
        const uint32_t e = i / (WARP / PER_STORE);
        const bf162 v = __floats2bfloat162_rn(NF4_VALUES[e % 16], NF4_VALUES[e / 16]);
        const uint32_t word = *reinterpret_cast<const uint32_t*>(&v);
        reinterpret_cast<uint4*>(table)[i] = make_uint4(word, word, word, word);
    }
}

// The ALU variants' stand-in for nf4_values8: each entry's address as nf4_values8 makes it, then one
// shift in place of the load (values of no meaning, finite: addresses below 2^18).
__device__ inline void alu_values8(uint32_t word, uint32_t book, float (&f)[VEC]) {
    const uint32_t low = (book & 0xFF) * 0x01010101u;
    const uint32_t even = ((word << 2) & 0x3C3C3C3Cu) | low, odd = ((word >> 2) & 0x3C3C3C3Cu) | low;
#pragma unroll
    for (uint32_t e = 0; e < VEC; ++e) f[e] = __uint_as_float(__byte_perm(e % 2 ? odd : even, book, 0x7650 + e / 2) << 7);
}

// Eight codes' values: the codebook's (LOOKUP) or the ALU variants' stand-ins.
template <bool LOOKUP>
__device__ inline void values8(uint32_t word, uint32_t book, float (&f)[VEC]) {
    if constexpr (LOOKUP) nf4_values8(word, book, f);
    else alu_values8(word, book, f);
}

// An f32 rounded to tf32 (nearest, ties away), as the mma's operands should be.
__device__ inline float tf32(float v) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return __uint_as_float(r);
}

// d += A B for one m16n8k8 tile: a in the A fragment's order (rows g, g + 8 at column q, then at q + 4;
// g = lane / 4, q = lane % 4), b rows q and q + 4 of column g.
__device__ inline void mma_tf32(float (&d)[4], const float* a, float2 b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])), "r"(__float_as_uint(a[3])),
                   "r"(__float_as_uint(b.x)), "r"(__float_as_uint(b.y)));
}

// d += A B for one m16n8k16 tile in bf16: a's registers rows g, g + 8 at columns 2q, 2q + 1, then at
// 2q + 8, 2q + 9 (the lower column in the lower half); b columns k = 2q, 2q + 1 and 2q + 8, 2q + 9 of g.
__device__ inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint2 b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

// Stage `stage`, the block's n-th, into slot n % SLOTS: its codes and absmax, one bulk copy each on the
// slot's barrier (thread 0).
__device__ inline void issue(const uint8_t* codes, const float* scales, uint8_t* sm, uint64_t* full, uint32_t stage, uint32_t n) {
    const uint32_t slot = n % SLOTS;
    mbar_expect_tx(&full[slot], STAGE_CODE_BYTES + STAGE_SCALES * 4);
    bulk_copy(sm + SM_CODES + slot * STAGE_CODE_BYTES, codes + (size_t)stage * STAGE_CODE_BYTES, STAGE_CODE_BYTES, &full[slot], l2_evict_first());
    bulk_copy(sm + SM_SCALES + slot * STAGE_SCALES * 4, scales + (size_t)stage * STAGE_SCALES, STAGE_SCALES * 4, &full[slot], l2_evict_first());
}

// The megakernel's form on one stage: thread t's word t of each row, two passes of PASS rows, each
// pass's sums across the warp at once; lanes k WARP / PASS hold row i0 + k's partial.
template <bool LOOKUP>
__device__ inline void fused_stage(const uint32_t* words, const float* scales, uint32_t book, const float (&x)[VEC], float* red) {
    const uint32_t t = threadIdx.x, lane = t % WARP, warp = t / WARP;
#pragma unroll
    for (uint32_t i0 = 0; i0 < STAGE_ROWS; i0 += PASS) {
        float acc[PASS];
#pragma unroll
        for (uint32_t i = 0; i < PASS; ++i) {
            float c[VEC];
            values8<LOOKUP>(words[(i0 + i) * ROW_WORDS + t], book, c);
            acc[i] = fused8(c, scales[(i0 + i) * ROW_GROUPS + t / (NF4_SCALE_COLS / VEC)], x, 0.0f);
        }
        const float sum = reduce_transposed<PASS>(acc);
        if (lane % (WARP / PASS) == 0) red[(i0 + scatter_mask<PASS>()) * WARPS + warp] = sum;
    }
}

// The tensor-core forms' stage: warp w's four groups of 64 columns, group(d, words, j) adding group j's
// mmas to d from the lane's 16 bytes of codes; the group's sum times its absmax (rows g and g + 8: the
// pair sg). Lanes q = 0 hold rows g and g + 8 of B's column COL in d[COL], d[2 + COL].
template <uint32_t COL = 0, typename Group>
__device__ inline void tensor_stage(const uint4* codes, const float2* scales, float* red, Group group) {
    const uint32_t lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4;
    float row_g = 0.0f, row_g8 = 0.0f;
#pragma unroll
    for (uint32_t j = 0; j < WARP_GROUPS; ++j) {
        const uint4 q = codes[(warp * WARP_GROUPS + j) * WARP + lane];
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        group(d, words, j);
        const float2 sg = scales[(warp * WARP_GROUPS + j) * 8 + g];
        row_g = fmaf(d[COL], sg.x, row_g);
        row_g8 = fmaf(d[2 + COL], sg.y, row_g8);
    }
    if (lane % 4 == 0) {
        red[g * WARPS + warp] = row_g;
        red[(g + 8) * WARPS + warp] = row_g8;
    }
}

// mma's group: eight tf32 mmas, word m's code e at k-step 2m + e / 4, fragment element e % 4; B is x's
// fragment (xb: the lane's run of WARP_STEPS float2, zeros past lane X_LANES).
template <bool LOOKUP>
__device__ inline void tf32_group(float (&d)[4], const uint32_t (&words)[4], uint32_t j, uint32_t book, const float2* xb) {
#pragma unroll
    for (uint32_t m = 0; m < 4; ++m) {
        float a[VEC];
        values8<LOOKUP>(words[m], book, a);
        mma_tf32(d, a, xb[(j * GROUP_STEPS + 2 * m) * X_LANES]);
        mma_tf32(d, a + 4, xb[(j * GROUP_STEPS + 2 * m + 1) * X_LANES]);
    }
}

// pairs' group: four bf16 mmas, word m's byte r register r of k-step m, each a load of the lane's copy of
// the byte's entry (`table`: the lane's column of the pair table); B as mma's, two bf16x2 a lane a step
// (BATCH: every lane's, times its column's multiple).
template <bool BATCH = false>
__device__ inline void pair_group(float (&d)[4], const uint32_t (&words)[4], uint32_t j, uint32_t table, const uint2* xb, bf162 multiple = {}) {
#pragma unroll
    for (uint32_t m = 0; m < 4; ++m) {
        uint32_t a[4];
#pragma unroll
        for (uint32_t r = 0; r < 4; ++r)
            asm("ld.shared.b32 %0, [%1];" : "=r"(a[r]) : "r"(table + __byte_perm(words[m], 0, 0x4440 + r) * PAIR_ENTRY_BYTES));
        uint2 b = xb[(j * PAIR_STEPS + m) * X_LANES];
        if constexpr (BATCH) {
            const bf162 lo = __hmul2(*reinterpret_cast<const bf162*>(&b.x), multiple), hi = __hmul2(*reinterpret_cast<const bf162*>(&b.y), multiple);
            b = make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
        }
        mma_bf16(d, a, b);
    }
}

// y = W x over the block's even share of stages, each stage's rows summed in warp order by threads
// 0-15 at the next stage's barrier.
template <Kind KIND>
__global__ void __launch_bounds__(THREADS, 1) stream(const uint8_t* codes, const float* scales, const float* xg, float* y) {
    extern __shared__ __align__(128) uint8_t sm[];
    __shared__ uint64_t full[SLOTS];
    const uint32_t t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    const uint32_t stages = ROWS / STAGE_ROWS, first = stages * blockIdx.x / gridDim.x, last = stages * (blockIdx.x + 1) / gridDim.x;
    float* book = reinterpret_cast<float*>(sm + SM_BOOK);
    float2* xf = reinterpret_cast<float2*>(sm + SM_XF);
    float* red = reinterpret_cast<float*>(sm + SM_RED);
    if (t == 0) {
        for (uint32_t s = 0; s < SLOTS; ++s) mbar_init(&full[s], 1);  // one arrival: thread 0's expect_tx
        // The initialised barriers are visible to the copy engine before any copy names them.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (uint32_t n = 0; n < SLOTS - 1 && first + n < last; ++n) issue(codes, scales, sm, full, first + n, n);
    }
    if (t < 16) book[t] = is_mma(KIND) ? tf32(NF4_VALUES[t]) : NF4_VALUES[t];
    // B's fragments: warp w's k-step s, lane l < X_LANES. mma: x at columns 8s + l and 8s + l + 4 of its
    // range; pairs: columns 16s + 2l, + 1 and 16s + 2l + 8, + 9 as bf16x2.
    for (uint32_t i = t; i < WARPS * WARP_STEPS * X_LANES; i += THREADS) {
        const uint32_t w = i / (WARP_STEPS * X_LANES), s = i / X_LANES % WARP_STEPS, l = i % X_LANES;
        if (!is_pairs(KIND)) {
            const uint32_t col = w * WARP_COLS + 8 * s + l;
            xf[i] = make_float2(xg[col], xg[col + 4]);
        } else {
            // pairs-batch keeps x1's fragments (xg's second COLS) after x's, in the half pairs leaves.
            const uint32_t v = s / (WARP_GROUPS * PAIR_STEPS), ps = s % (WARP_GROUPS * PAIR_STEPS);
            const uint32_t col = v * COLS + w * WARP_COLS + 16 * ps + 2 * l;
            if (v == 0 || KIND == Kind::PairsBatch) {
                const bf162 lo = __floats2bfloat162_rn(xg[col], xg[col + 1]), hi = __floats2bfloat162_rn(xg[col + 8], xg[col + 9]);
                reinterpret_cast<uint2*>(xf)[((v * WARPS + w) * WARP_GROUPS * PAIR_STEPS + ps) * X_LANES + l] =
                    make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
            }
        }
    }
    uint32_t* table = reinterpret_cast<uint32_t*>(sm + SM_TABLE);
    if (is_pairs(KIND)) write_pair_table(table);
    for (uint32_t i = t; i < ZERO_BYTES / 4; i += THREADS) reinterpret_cast<float*>(sm + SM_ZEROS)[i] = 0.0f;
    float x[VEC];
#pragma unroll
    for (uint32_t e = 0; e < VEC; ++e) x[e] = xg[t * VEC + e];
    const float2* xb = lane < X_LANES ? xf + warp * WARP_STEPS * X_LANES + lane : reinterpret_cast<const float2*>(sm + SM_ZEROS) + lane % X_LANES;
    const uint2* pair_xb = lane < X_LANES ? reinterpret_cast<const uint2*>(xf) + warp * WARP_GROUPS * PAIR_STEPS * X_LANES + lane
                                          : reinterpret_cast<const uint2*>(sm + SM_ZEROS) + lane % X_LANES;
    // pairs-batch: lane (g, q) holds B's column g, x1's fragment for g = 1 and x's for the others.
    const uint2* batch_xb = reinterpret_cast<const uint2*>(xf) + ((lane / 4 == 1 ? WARPS : 0) + warp) * WARP_GROUPS * PAIR_STEPS * X_LANES + lane % 4;
    const bf162 multiple = __float2bfloat162_rn(BATCH_SCALES[lane / 4]);
    const uint32_t table_at = smem_addr(table) + lane * 4;
    const uint32_t book_at = smem_addr(book);
    // Stage k's rows from its warps' partials, in warp order (threads 0-15, past the barrier after them).
    const auto store_rows = [&](uint32_t k) {
        if (t >= STAGE_ROWS) return;
        const float* r = red + (k % 2) * STAGE_ROWS * WARPS + t * WARPS;
        float sum = 0.0f;
        for (uint32_t w = 0; w < WARPS; ++w) sum += r[w];
        y[k * STAGE_ROWS + t] = sum;
    };
    for (uint32_t k = first; k < last; ++k) {
        // Every thread is done with stage k - 1's slot (the copy below refills it) and has written its
        // partials of stage k - 1; the initialisation above is visible before the first wait.
        __syncthreads();
        const uint32_t n = k - first, slot = n % SLOTS;
        if (t == 0 && k + SLOTS - 1 < last) issue(codes, scales, sm, full, k + SLOTS - 1, n + SLOTS - 1);
        if (k > first) store_rows(k - 1);
        if (KIND == Kind::PairsRewrite && n > 0 && n % REWRITE_STAGES == 0) {
            write_pair_table(table);  // no stage reads the table meanwhile: all are past the barrier above
            __syncthreads();          // the new table is written before any lookup reads it
        }
        mbar_wait(&full[slot], (n / SLOTS) & 1);  // stage k has landed
        float* stage_red = red + (k % 2) * STAGE_ROWS * WARPS;
        if constexpr (KIND == Kind::Fused || KIND == Kind::FusedAlu)
            fused_stage<looks_up(KIND)>(reinterpret_cast<const uint32_t*>(sm + SM_CODES + slot * STAGE_CODE_BYTES),
                        reinterpret_cast<const float*>(sm + SM_SCALES + slot * STAGE_SCALES * 4), book_at, x, stage_red);
        const uint4* slot_codes = reinterpret_cast<const uint4*>(sm + SM_CODES + slot * STAGE_CODE_BYTES);
        const float2* slot_scales = reinterpret_cast<const float2*>(sm + SM_SCALES + slot * STAGE_SCALES * 4);
        if constexpr (is_mma(KIND))
            tensor_stage(slot_codes, slot_scales, stage_red,
                         [&](float (&d)[4], const uint32_t (&w)[4], uint32_t j) { tf32_group<looks_up(KIND)>(d, w, j, book_at, xb); });
        if constexpr (KIND == Kind::Pairs || KIND == Kind::PairsRewrite)
            tensor_stage(slot_codes, slot_scales, stage_red, [&](float (&d)[4], const uint32_t (&w)[4], uint32_t j) { pair_group(d, w, j, table_at, pair_xb); });
        if constexpr (KIND == Kind::PairsBatch)
            tensor_stage<1>(slot_codes, slot_scales, stage_red,
                            [&](float (&d)[4], const uint32_t (&w)[4], uint32_t j) { pair_group<true>(d, w, j, table_at, batch_xb, multiple); });
        if constexpr (KIND == Kind::Copy)
            if (t < STAGE_ROWS * WARPS) stage_red[t] = reinterpret_cast<const float*>(sm + SM_SCALES + slot * STAGE_SCALES * 4)[t];
    }
    __syncthreads();  // the last stage's partials
    if (last > first) store_rows(last - 1);
}

// Where a tensor-core form's lane l (g = l / 4, q = l % 4) takes code e of word m of a group: the row of
// the stage and the column of the group. mma: row g + 8 (e % 2), column 8 (2m + e / 4) + q + 4 ((e % 4) /
// 2). pairs: byte r = e / 2 is register r of k-step m, row g + 8 (r % 2), column 16m + 2q + 8 (r / 2),
// the low nibble the even column.
struct Place {
    uint32_t row, col;
};
Place mma_place(uint32_t l, uint32_t m, uint32_t e) { return {l / 4 + 8 * (e % 2), 8 * (2 * m + e / 4) + l % 4 + 4 * ((e % 4) / 2)}; }
Place pair_place(uint32_t l, uint32_t m, uint32_t e) { return {l / 4 + 8 * (e / 2 % 2), 16 * m + 2 * (l % 4) + 8 * (e / 4) + e % 2}; }

// A tensor-core form's packing of a stage (its 16 rows' codes row-major, code e of a word at bits 4e, as
// the megakernel packs them): lane l of warp w's 16 bytes of group j at uint4 (4w + j) 32 + l, its codes
// where `place` puts them. Absmax: the pair (row g, row g + 8) of group 4w + j at float2 (4w + j) 8 + g.
template <typename P>
void pack_tensor(const std::vector<uint32_t>& words, const std::vector<float>& scales, std::vector<uint32_t>& mwords, std::vector<float>& mscales, P place) {
    for (uint32_t st = 0; st < ROWS / STAGE_ROWS; ++st) {
        const uint32_t* src = words.data() + (size_t)st * STAGE_ROWS * ROW_WORDS;
        uint32_t* dst = mwords.data() + (size_t)st * STAGE_ROWS * ROW_WORDS;
        for (uint32_t w = 0; w < WARPS; ++w)
            for (uint32_t j = 0; j < WARP_GROUPS; ++j)
                for (uint32_t l = 0; l < WARP; ++l)
                    for (uint32_t m = 0; m < 4; ++m) {
                        uint32_t word = 0;
                        for (uint32_t e = 0; e < VEC; ++e) {
                            const Place at = place(l, m, e);
                            const uint32_t col = w * WARP_COLS + NF4_SCALE_COLS * j + at.col;
                            word |= ((src[at.row * ROW_WORDS + col / VEC] >> (4 * (col % VEC))) & 0xF) << (4 * e);
                        }
                        dst[((w * WARP_GROUPS + j) * WARP + l) * 4 + m] = word;
                    }
        for (uint32_t grp = 0; grp < ROW_GROUPS; ++grp)
            for (uint32_t g = 0; g < 8; ++g)
                for (uint32_t h = 0; h < 2; ++h)
                    mscales[(size_t)st * STAGE_SCALES + (grp * 8 + g) * 2 + h] = scales[(size_t)st * STAGE_SCALES + (g + 8 * h) * ROW_GROUPS + grp];
    }
}

int main() {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) return printf("no CUDA device\n"), 1;
    // Random codes, absmax in [0.01, 0.11), x bf16 values in [-1, 1).
    std::vector<uint32_t> words((size_t)ROWS * ROW_WORDS), mwords(words.size()), pwords(words.size());
    // x, then x1 (pairs-batch's second vector).
    std::vector<float> scales((size_t)ROWS * ROW_GROUPS), mscales(scales.size()), x(2 * COLS);
    uint64_t r = 0x9E3779B97F4A7C15ull ^ (uint64_t)time(nullptr);
    const auto next = [&] { return r ^= r << 13, r ^= r >> 7, r ^= r << 17, r; };
    for (uint32_t& w : words) w = (uint32_t)next();
    for (float& s : scales) s = 0.01f + 0.1f * (float)(next() >> 40) / (float)(1ull << 24);
    for (float& v : x) v = __bfloat162float(__float2bfloat16((float)(next() >> 40) / (float)(1ull << 23) - 1.0f));
    pack_tensor(words, scales, mwords, mscales, mma_place);
    pack_tensor(words, scales, pwords, mscales, pair_place);
    // The f64 reference of the first copy's rows, and each row's sum |w x| (the error's scale).
    std::vector<double> want(MATRIX_ROWS), scale(MATRIX_ROWS);
    float book[16];
    TRY(cudaMemcpyFromSymbol(book, NF4_VALUES, sizeof book));  // the kernels' codebook, exact
    for (uint32_t row = 0; row < MATRIX_ROWS; ++row) {
        double sum = 0.0, mag = 0.0;
        for (uint32_t c = 0; c < COLS; ++c) {
            const double w = (double)book[(words[(size_t)row * ROW_WORDS + c / VEC] >> (4 * (c % VEC))) & 0xF] * scales[(size_t)row * ROW_GROUPS + c / 64];
            sum += w * x[c], mag += fabs(w * x[c]);
        }
        want[row] = sum, scale[row] = mag;
    }
    uint8_t *codes = nullptr, *mcodes = nullptr, *pcodes = nullptr;
    float *d_scales = nullptr, *d_mscales = nullptr, *d_x = nullptr, *y = nullptr;
    TRY(cudaMalloc(&codes, words.size() * 4));
    TRY(cudaMalloc(&mcodes, words.size() * 4));
    TRY(cudaMalloc(&pcodes, words.size() * 4));
    TRY(cudaMalloc(&d_scales, scales.size() * 4));
    TRY(cudaMalloc(&d_mscales, scales.size() * 4));
    TRY(cudaMalloc(&d_x, 2 * COLS * 4));
    TRY(cudaMalloc(&y, (size_t)ROWS * 4));
    TRY(cudaMemcpy(codes, words.data(), words.size() * 4, cudaMemcpyHostToDevice));
    TRY(cudaMemcpy(mcodes, mwords.data(), words.size() * 4, cudaMemcpyHostToDevice));
    TRY(cudaMemcpy(pcodes, pwords.data(), words.size() * 4, cudaMemcpyHostToDevice));
    TRY(cudaMemcpy(d_scales, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
    TRY(cudaMemcpy(d_mscales, mscales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
    TRY(cudaMemcpy(d_x, x.data(), 2 * COLS * 4, cudaMemcpyHostToDevice));
    const auto kernel = [](Kind kind) {
        switch (kind) {
            case Kind::Copy: return stream<Kind::Copy>;
            case Kind::Fused: return stream<Kind::Fused>;
            case Kind::FusedAlu: return stream<Kind::FusedAlu>;
            case Kind::Mma: return stream<Kind::Mma>;
            case Kind::MmaAlu: return stream<Kind::MmaAlu>;
            case Kind::Pairs: return stream<Kind::Pairs>;
            case Kind::PairsRewrite: return stream<Kind::PairsRewrite>;
            default: return stream<Kind::PairsBatch>;
        }
    };
    for (Kind kind : KINDS) TRY(cudaFuncSetAttribute(kernel(kind), cudaFuncAttributeMaxDynamicSharedMemorySize, SM_BYTES));
    TRY(cudaFuncSetAttribute(kernel(Kind::PairsBatch), cudaFuncAttributeMaxDynamicSharedMemorySize, SM_BYTES));
    const double bytes = words.size() * 4.0 + scales.size() * 4.0;
    printf("%u rows of %u columns (%u copies of 8B's GateUp), %.0f MB of nf4 codes and absmax, %d blocks of %u threads\n", ROWS, COLS, COPIES,
           bytes / 1e6, sms, THREADS);
    printf("%-13s %10s %8s %8s  %s\n", "form", "us", "TB/s", "x copy", "worst |error| / sum |w x| of the first copy's rows");
    float copy_us = 0.0f;
    // Form `kind` on xg (x, or x1 at d_x + COLS), REPS times, every output poisoned first (NaN: a row
    // left unwritten shows): the median us a launch, its outputs in `out`; or a negative time on an error.
    const auto run = [&](Kind kind, const float* xg, std::vector<float>& out) -> float {
        const bool tensor = is_mma(kind) || is_pairs(kind);
        const uint8_t* c = is_pairs(kind) ? pcodes : tensor ? mcodes : codes;
        const auto launch = [&] { kernel(kind)<<<sms, THREADS, SM_BYTES>>>(c, tensor ? d_mscales : d_scales, xg, y); };
        std::vector<float> times;
        for (int rep = 0; rep < REPS; ++rep) {
            if (cudaMemset(y, 0xFF, (size_t)ROWS * 4) != cudaSuccess) return -1.0f;
            times.push_back(elapsed_ms(launch) * 1e3f);
        }
        if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return -1.0f;
        if (cudaMemcpy(out.data(), y, out.size() * 4, cudaMemcpyDeviceToHost) != cudaSuccess) return -1.0f;
        std::sort(times.begin(), times.end());
        return times[REPS / 2];
    };
    const auto print_row = [&](Kind kind, float us, const char* text) {
        printf("%-13s %10.1f %8.2f %8.3f  %s\n", NAMES[(int)kind], us, bytes / (us * 1e-6) / 1e12, us / copy_us, text);
    };
    for (Kind kind : KINDS) {
        std::vector<float> got(MATRIX_ROWS);
        const float us = run(kind, d_x, got);
        if (us < 0.0f) return printf("%s failed\n", NAMES[(int)kind]), 1;
        if (kind == Kind::Copy) copy_us = us;
        double worst = 0.0;
        for (uint32_t row = 0; row < MATRIX_ROWS; ++row) {
            const double e = fabs((double)got[row] - want[row]) / scale[row];
            worst = e > worst || e != e ? e : worst;
        }
        char text[64] = "(no arithmetic)";
        if (looks_up(kind)) snprintf(text, sizeof text, "%.2e", worst);
        else if (kind != Kind::Copy) snprintf(text, sizeof text, "(not the codebook's values)");
        print_row(kind, us, text);
    }
    // A batch's lane against its own decode (the plan's item 3): pairs on x1 alone, then pairs-batch with
    // x1 in column 1 beside x and its multiples; every row's sum compared bit for bit.
    std::vector<float> alone(ROWS), lane1(ROWS);
    if (run(Kind::Pairs, d_x + COLS, alone) < 0.0f) return printf("pairs on x1 failed\n"), 1;
    const float batch_us = run(Kind::PairsBatch, d_x, lane1);
    if (batch_us < 0.0f) return printf("pairs-batch failed\n"), 1;
    size_t differ = 0;
    for (uint32_t row = 0; row < ROWS; ++row) differ += memcmp(&alone[row], &lane1[row], 4) != 0;
    char text[96] = "column 1 bitwise pairs on x1 alone";
    if (differ != 0) snprintf(text, sizeof text, "column 1 against pairs on x1 alone: %zu of %u rows differ", differ, ROWS);
    print_row(Kind::PairsBatch, batch_us, text);
    for (void* p : {(void*)codes, (void*)mcodes, (void*)pcodes, (void*)d_scales, (void*)d_mscales, (void*)d_x, (void*)y}) cudaFree(p);
    return 0;
}
