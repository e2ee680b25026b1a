// What dequantising nf4 weights inside the weight stream costs (issue 49), before the megakernel
// streams them: a GEMV over bitsandbytes nf4 weights (two 4-bit codes a byte, the high nibble first;
// an f32 absmax per 64 weights) against the same GEMV over the bf16 weights the model loader makes of
// them (each weight the f32 product of its code's value and its block's absmax, rounded once to bf16).
// At 4.5 bits a weight, a token reads 0.28 of bf16's bytes, so the stream must dequantise about 3.5
// times as many weights a second: roughly five instructions a weight against bf16's two, near what an
// SM issues at the read rate. This probe measures how close each way of dequantising gets to the read
// rate, and checks that the two bitwise ways give the bf16 GEMV's outputs bit for bit.
//
// Every variant runs the megakernel's arithmetic (`dot8`'s products in its order, with x widened to f32
// once as the batch step holds it; `warp_reduce`; thread t taking 16-byte vectors t + v * THREADS of a
// row; the warps' sums added in warp order):
//   bf16      the loader's dequantised weights, 16 bytes a vector (the reference and the bf16 rate);
//   codebook  the 16 code values in shared memory: per weight a nibble, a lookup, an f32 product with
//             the block's absmax, a round to bf16 (two at a time), then dot8 as for bf16: bitwise bf16's;
//   pairs     a 256-entry table of both values of a byte: one 8-byte lookup per two weights, then as
//             codebook: bitwise bf16's;
//   fused     not bitwise: each vector's codes' values dotted with x in f32, the sum times the absmax
//             (no rounding to bf16): what the rounding costs, and its outputs' largest relative
//             difference from bf16's.
// And for fp8 (the step beyond nf4: e4m3 weights, an f32 scale a block of 128 x 128, as transformers'
// FineGrainedFP8Config and Qwen3's FP8 checkpoints store them; half of bf16's bytes), against the bf16
// GEMV over the loader's weights of the same codes (each code's value times its block's scale in f32,
// rounded once to bf16):
//   fp8-round each pair of codes made f16 by one conversion (sm_89 and later), widened, times the
//             block's scale, rounded to bf16, then dot8: bitwise bf16's;
//   fp8-fused not bitwise: each vector's values dotted with x in f32, the sum times the scale.
// Each variant loads its vectors from global memory, so its bytes in flight are what a thread holds;
// the `-ring` rows run the same arithmetic over stages of the block's rows that bulk copies bring into
// shared memory (gemv_staged), as the megakernel streams weights, so that only the arithmetic differs.
// Each launch reads every copy of a shape (over 512 MB of packed weights, far past the 60 MB L2); the
// read rate is a plain 16-byte stream over the bf16 copies. Build and run on the GPU:
//   nvcc -O3 -std=c++17 -arch=sm_90a -I kernels/include -o nf4_gemv scripts/probes/nf4_gemv.cu && ./nf4_gemv
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <type_traits>
#include <vector>

#include "bulk.cuh"
#include "layer_math.cuh"
#include "probe.cuh"

constexpr int THREADS = 256;
constexpr int BLOCK_WARPS = THREADS / WARP;
constexpr int BLOCKS_PER_SM = 2;
constexpr int NF4_BLOCK = 64;                       // weights per absmax (bitsandbytes' usual blocksize)
constexpr int VECS_PER_ABSMAX = NF4_BLOCK / VEC;    // 16-byte vectors (8 weights) per absmax
constexpr int FP8_BLOCK = 128;                      // rows and columns an fp8 scale covers
constexpr int VECS_PER_SCALE = FP8_BLOCK / VEC;     // 16-byte bf16 vectors (8 weights) a scale covers in a row
constexpr size_t PACKED_TARGET = 512ull << 20;      // packed bytes a launch reads, at least
constexpr int IN_FLIGHT_BYTES = 32 << 10;           // bytes a block loads before it computes, at most
constexpr int MAX_LOADS = 16;                       // vectors a thread loads before it computes, at most
constexpr int MAX_HELD_BYTES = 160;                 // bytes of loads a thread holds before it computes, at most
constexpr int REPS = 20;
constexpr int RING_STAGES = 3;               // gemv_staged's ring: stages of a block's rows in shared memory
constexpr int RING_STAGE_BYTES = 32 << 10;   // two blocks an SM: 192 KB of ring

// bitsandbytes' NF4 code values, code 0 to 15.
__constant__ float NF4_VALUES[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                                     -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                                     0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
                                     0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// The tables the lookups read, in shared memory: the 16 code values, and both values of each byte
// (high nibble, low nibble). Every gemv block writes them first.
__shared__ float s_values[16];
__shared__ float2 s_pairs[256];

// Code e (0..7) of the 8 a 32-bit word holds, its bytes in memory order, each byte's high nibble first.
__device__ __forceinline__ uint32_t code(uint32_t word, int e) { return (word >> (8 * (e / 2) + (e % 2 == 0 ? 4 : 0))) & 0xF; }

// The byte offset, in a table of 2^SCALE_LOG2-byte entries, of the entry the field of `word` at bit
// `shift` (`mask` wide) names: one shift and one mask, the entry size folded into the shift.
template <int SCALE_LOG2>
__device__ __forceinline__ uint32_t entry(uint32_t word, int shift, uint32_t mask) {
    const uint32_t m = mask << SCALE_LOG2;
    return shift >= SCALE_LOG2 ? (word >> (shift - SCALE_LOG2)) & m : (word << (SCALE_LOG2 - shift)) & m;
}
// The byte offsets into s_values (code * 4) of the 8 codes of `word`, in element order: every high
// nibble's offset in one register and every low nibble's in another, a byte each (two shifts and two
// masks), then each byte moved out by a byte permute: 12 instructions for 8 codes, where a shift and
// a mask each take 16.
__device__ __forceinline__ void offsets(uint32_t word, uint32_t (&off)[VEC]) {
    const uint32_t hi = (word >> 2) & 0x3C3C3C3Cu, lo = (word << 2) & 0x3C3C3C3Cu;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        off[2 * j] = __byte_perm(hi, 0, 0x4440 + j);  // element 2j: byte j's high nibble, zero-extended
        off[2 * j + 1] = __byte_perm(lo, 0, 0x4440 + j);
    }
}
// The tables' addresses, taken once per kernel: read through a helper each time, the compiler
// recomputed the shared window's base for every vector (S2UR, ULEA: half an instruction a weight).
struct Tables {
    const char* values;  // s_values
    const char* pairs;   // s_pairs
};
__device__ __forceinline__ float value_at(const Tables& tb, uint32_t offset) { return *reinterpret_cast<const float*>(tb.values + offset); }
__device__ __forceinline__ float2 pair(const Tables& tb, uint32_t word, int j) {
    return *reinterpret_cast<const float2*>(tb.pairs + entry<3>(word, 8 * j, 0xFF));
}

// The loader's weight: the code's value times the block's absmax in f32, rounded once to bf16.
__device__ __forceinline__ bf162 weights2(float v0, float v1, float absmax) {
    return __floats2bfloat162_rn(__fmul_rn(v0, absmax), __fmul_rn(v1, absmax));
}

// acc + the dot of 8 bf16 weights with x (widened), in dot8's order: dot8's bits. Each bf16 pair widens
// in two instructions (a shift, a mask) where __bfloat1622float2 took three.
__device__ __forceinline__ float dot8f(uint4 w, const float (&x)[VEC], float acc) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        acc = fmaf(__uint_as_float(words[j] << 16), x[2 * j], acc);
        acc = fmaf(__uint_as_float(words[j] & 0xFFFF0000u), x[2 * j + 1], acc);
    }
    return acc;
}

// A thread's load of a weight word: streamed from global memory (gemv), or read from a ring stage in
// shared memory (STAGED: gemv_staged).
template <bool STAGED, typename T>
__device__ __forceinline__ T fetch(const T* p) {
    if constexpr (STAGED) return *p;
    else return __ldcs(p);
}

// One variant's view of a matrix of rows of `vecs` vectors: from row r0 on, in global memory (`at`) or
// in a ring stage (`staged`: the copy's source is `src`), what a thread loads for vector v of row r0 + i
// (`Raw`, by 32-bit offsets from the group's first row), and how it adds that vector's products with x
// to acc.
struct Bf16 {
    static constexpr int BYTES = 16;
    struct Raw {
        uint4 w;
    };
    template <bool STAGED>
    struct Rows {
        const uint4* w;
        int vecs;
        __device__ Raw load(int i, int v) const { return {fetch<STAGED>(w + i * vecs + v)}; }
    };
    const uint4* w;
    int vecs;
    __device__ Rows<false> at(int r0) const { return {w + (size_t)r0 * vecs, vecs}; }
    __device__ const void* src(int r0) const { return w + (size_t)r0 * vecs; }
    __device__ Rows<true> staged(const void* slot, int) const { return {static_cast<const uint4*>(slot), vecs}; }
    __device__ float dot(const Raw& raw, const float (&x)[VEC], float acc, const Tables&) const { return dot8f(raw.w, x, acc); }
};

struct Nf4 {
    static constexpr int BYTES = 4;  // plus an absmax per 8 vectors, read through L1
    struct Raw {
        uint32_t codes;
        float absmax;
    };
    // Staged, the codes are in the ring and the absmax still comes through L1.
    template <bool STAGED>
    struct Rows {
        const uint32_t* codes;
        const float* absmax;
        int vecs;
        __device__ Raw load(int i, int v) const {
            return {fetch<STAGED>(codes + i * vecs + v), __ldg(absmax + (i * vecs + v) / VECS_PER_ABSMAX)};
        }
    };
    const uint32_t* codes;
    const float* absmax;
    int vecs;
    __device__ Rows<false> at(int r0) const {
        return {codes + (size_t)r0 * vecs, absmax + (size_t)r0 * vecs / VECS_PER_ABSMAX, vecs};
    }
    __device__ const void* src(int r0) const { return codes + (size_t)r0 * vecs; }
    __device__ Rows<true> staged(const void* slot, int r0) const {
        return {static_cast<const uint32_t*>(slot), absmax + (size_t)r0 * vecs / VECS_PER_ABSMAX, vecs};
    }
};

struct Codebook : Nf4 {
    __device__ float dot(const Raw& raw, const float (&x)[VEC], float acc, const Tables& tb) const {
        uint32_t off[VEC];
        offsets(raw.codes, off);
        uint4 w;
        bf162* h = reinterpret_cast<bf162*>(&w);
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = weights2(value_at(tb, off[2 * j]), value_at(tb, off[2 * j + 1]), raw.absmax);
        return dot8f(w, x, acc);
    }
};

struct Pairs : Nf4 {
    __device__ float dot(const Raw& raw, const float (&x)[VEC], float acc, const Tables& tb) const {
        uint4 w;
        bf162* h = reinterpret_cast<bf162*>(&w);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 p = pair(tb, raw.codes, j);
            h[j] = weights2(p.x, p.y, raw.absmax);
        }
        return dot8f(w, x, acc);
    }
};

struct Fused : Nf4 {
    __device__ float dot(const Raw& raw, const float (&x)[VEC], float acc, const Tables& tb) const {
        uint32_t off[VEC];
        offsets(raw.codes, off);
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) part = fmaf(value_at(tb, off[e]), x[e], part);
        return fmaf(part, raw.absmax, acc);
    }
};

// Two e4m3 codes (the first in the low byte) as f32, exactly: one conversion to f16x2, widened.
__device__ __forceinline__ float2 e4m3x2(uint32_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)pair, __NV_E4M3);
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// The loader's fp8 weights of a pair of codes: each value times the block's scale in f32, rounded once
// to bf16.
__device__ __forceinline__ bf162 fp8_weights2(uint32_t pair, float scale) {
    const float2 v = e4m3x2(pair);
    return __floats2bfloat162_rn(__fmul_rn(v.x, scale), __fmul_rn(v.y, scale));
}

struct Fp8 {
    static constexpr int BYTES = 8;  // plus a scale per 16 vectors of a row and 128 rows, read through L1
    struct Raw {
        uint2 codes;
        float scale;
    };
    // Staged, the codes are in the ring and the scales still come through L1.
    template <bool STAGED>
    struct Rows {
        const uint2* codes;
        const float* scales;  // the whole matrix's: a row's block row is (r0 + i) / FP8_BLOCK
        int vecs, r0;
        __device__ Raw load(int i, int v) const {
            const float* block_row = scales + (size_t)((r0 + i) / FP8_BLOCK) * (vecs / VECS_PER_SCALE);
            return {fetch<STAGED>(codes + (size_t)i * vecs + v), __ldg(block_row + v / VECS_PER_SCALE)};
        }
    };
    const uint2* codes;
    const float* scales;
    int vecs;
    __device__ Rows<false> at(int r0) const { return {codes + (size_t)r0 * vecs, scales, vecs, r0}; }
    __device__ const void* src(int r0) const { return codes + (size_t)r0 * vecs; }
    __device__ Rows<true> staged(const void* slot, int r0) const { return {static_cast<const uint2*>(slot), scales, vecs, r0}; }
};

struct Fp8Rounded : Fp8 {
    __device__ float dot(const Raw& raw, const float (&x)[VEC], float acc, const Tables&) const {
        uint4 w;
        bf162* h = reinterpret_cast<bf162*>(&w);
        h[0] = fp8_weights2(raw.codes.x & 0xFFFF, raw.scale);
        h[1] = fp8_weights2(raw.codes.x >> 16, raw.scale);
        h[2] = fp8_weights2(raw.codes.y & 0xFFFF, raw.scale);
        h[3] = fp8_weights2(raw.codes.y >> 16, raw.scale);
        return dot8f(w, x, acc);
    }
};

struct Fp8Fused : Fp8 {
    __device__ float dot(const Raw& raw, const float (&x)[VEC], float acc, const Tables&) const {
        const uint32_t pairs[4] = {raw.codes.x & 0xFFFF, raw.codes.x >> 16, raw.codes.y & 0xFFFF, raw.codes.y >> 16};
        float part = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 v = e4m3x2(pairs[j]);
            part = fmaf(v.x, x[2 * j], part);
            part = fmaf(v.y, x[2 * j + 1], part);
        }
        return fmaf(part, raw.scale, acc);
    }
};

// Every gemv block's start: the lookup tables written, and this thread's vectors of x widened to f32.
template <int VPT>
__device__ __forceinline__ Tables start_block(const uint4* x, float (&xs)[VPT][VEC]) {
    const int t = threadIdx.x;
    if (t < 16) s_values[t] = NF4_VALUES[t];
    s_pairs[t] = make_float2(NF4_VALUES[t >> 4], NF4_VALUES[t & 15]);
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
        const uint4 h = x[t + v * THREADS];
        const bf162* p = reinterpret_cast<const bf162*>(&h);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(p[j]);
            xs[v][2 * j] = f.x;
            xs[v][2 * j + 1] = f.y;
        }
    }
    __syncthreads();  // the tables are written before any lookup
    return Tables{reinterpret_cast<const char*>(s_values), reinterpret_cast<const char*>(s_pairs)};
}

// Rows r0 + i (i < count) of y from each thread's partial sums acc[i]: each warp's sum, then the warps'
// in warp order (the megakernel's order). `red` holds ROWS rows of a block's warps.
template <int ROWS>
__device__ __forceinline__ void store_rows(float (&acc)[ROWS], float (*red)[BLOCK_WARPS], float* y, int r0, int count) {
    const int t = threadIdx.x, lane = t % WARP, warp = t / WARP;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) acc[i] = warp_reduce(acc[i], Add{});
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < ROWS; ++i) red[i][warp] = acc[i];
    __syncthreads();  // every warp's sums are in red before they are added
    for (int i = t; i < count; i += THREADS) {
        float total = red[i][0];
        for (int k = 1; k < BLOCK_WARPS; ++k) total += red[i][k];
        y[r0 + i] = total;
    }
    __syncthreads();  // red is read before the next rows overwrite it
}

enum class Kind { Bf16, Codebook, Pairs, Fused, Fp8Rounded, Fp8Fused };
constexpr int KINDS = 6;
constexpr const char* NAMES[KINDS] = {"bf16", "codebook", "pairs", "fused", "fp8-round", "fp8-fused"};

// y = W x for rows [0, rows) of W, a block taking an even share of them, ROWS at a time: every load of
// those rows issued before any product, each row's sum in the megakernel's order.
template <int VPT, typename W>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM) gemv(W w, const uint4* x, float* y, int rows) {
    // IN_FLIGHT_BYTES a block, within MAX_LOADS loads and MAX_HELD_BYTES of them a thread (more spilled
    // at 128 registers: fp8's 12 bytes a vector, its codes and scale, at two rows of 7 vectors).
    constexpr int BY_BYTES = IN_FLIGHT_BYTES / (W::BYTES * VPT * THREADS), BY_LOADS = MAX_LOADS / VPT;
    constexpr int BY_HELD = MAX_HELD_BYTES / ((int)sizeof(typename W::Raw) * VPT);
    constexpr int BY_REGS = BY_LOADS < BY_HELD ? BY_LOADS : BY_HELD;
    constexpr int ROWS = BY_BYTES < 1 || BY_REGS < 1 ? 1 : BY_BYTES < BY_REGS ? BY_BYTES : BY_REGS;
    static_assert(THREADS == 256, "one thread per entry of the byte table");
    __shared__ float red[ROWS][BLOCK_WARPS];
    const int t = threadIdx.x;
    float xs[VPT][VEC];
    const Tables tb = start_block<VPT>(x, xs);
    const int first = (int)((long long)rows * blockIdx.x / gridDim.x), last = (int)((long long)rows * (blockIdx.x + 1) / gridDim.x);
    for (int r0 = first; r0 < last; r0 += ROWS) {
        // Rows of VPT * THREADS vectors exactly (main checks it): only the block's last group of rows
        // can be short, and the full groups run a copy of the loop without a guard, as a ring's full
        // stages do (guarded, every row was a branch of its own).
        float acc[ROWS];
        const auto products = [&](auto guarded) {
            const auto rows_here = w.at(r0);
            typename W::Raw raw[ROWS][VPT];
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int v = 0; v < VPT; ++v)
                    if (!decltype(guarded)::value || r0 + i < last) raw[i][v] = rows_here.load(i, t + v * THREADS);
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
                acc[i] = 0.0f;
#pragma unroll
                for (int v = 0; v < VPT; ++v)
                    if (!decltype(guarded)::value || r0 + i < last) acc[i] = w.dot(raw[i][v], xs[v], acc[i], tb);
            }
        };
        if (r0 + ROWS <= last) products(std::false_type{});
        else products(std::true_type{});
        store_rows<ROWS>(acc, red, y, r0, min(ROWS, last - r0));
    }
}

// The ring's case (the megakernel's weight stream): the same GEMV with each block's rows copied into
// shared memory by bulk copies, RING_STAGES stages of RING_STAGE_BYTES in a ring, RING_STAGES - 1 of
// them in flight ahead of use, and each thread's vectors read from the stage. What a thread loads no
// longer bounds the bytes in flight, so the variants differ only in their arithmetic (and in the
// absmax or scale each still reads through L1).
template <int VPT, typename W>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM) gemv_staged(W w, const uint4* x, float* y, int rows) {
    constexpr int ROW_BYTES = W::BYTES * VPT * THREADS, ROWS = RING_STAGE_BYTES / ROW_BYTES;
    static_assert(ROWS >= 1, "a row fits a stage");
    extern __shared__ __align__(128) char ring[];
    __shared__ uint64_t full[RING_STAGES];
    __shared__ float red[ROWS][BLOCK_WARPS];
    const int t = threadIdx.x;
    if (t == 0) {
        for (int s = 0; s < RING_STAGES; ++s) mbar_init(&full[s], 1);  // one arrival: thread 0's expect_tx
        // The initialised barriers are visible to the copy engine before any copy names them.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    float xs[VPT][VEC];
    const Tables tb = start_block<VPT>(x, xs);  // its barrier also orders the mbarriers' initialisation
    const int first = (int)((long long)rows * blockIdx.x / gridDim.x), last = (int)((long long)rows * (blockIdx.x + 1) / gridDim.x);
    const int stages = (last - first + ROWS - 1) / ROWS;
    // Thread 0 copies stage k's rows into slot k % RING_STAGES; the slot's previous stage is dead (the
    // caller is past a __syncthreads that follows every read of it).
    const auto issue = [&](int k) {
        if (t != 0 || k >= stages) return;
        const int r0 = first + k * ROWS, bytes = min(ROWS, last - r0) * ROW_BYTES;
        mbar_expect_tx(&full[k % RING_STAGES], bytes);
        bulk_copy(ring + (k % RING_STAGES) * RING_STAGE_BYTES, w.src(r0), bytes, &full[k % RING_STAGES], l2_evict_first());
    };
    for (int k = 0; k < RING_STAGES - 1; ++k) issue(k);
    for (int k = 0; k < stages; ++k) {
        const int r0 = first + k * ROWS, count = min(ROWS, last - r0);
        issue(k + RING_STAGES - 1);  // into the slot stage k - 1 used, freed by store_rows' last barrier
        mbar_wait(&full[k % RING_STAGES], (k / RING_STAGES) & 1);  // stage k has landed
        const auto stage = w.staged(ring + (k % RING_STAGES) * RING_STAGE_BYTES, r0);
        float acc[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            acc[i] = 0.0f;
#pragma unroll
            for (int v = 0; v < VPT; ++v)
                if (i < count) acc[i] = w.dot(stage.load(i, t + v * THREADS), xs[v], acc[i], tb);
        }
        store_rows<ROWS>(acc, red, y, r0, count);
    }
}

// A 64-bit hash of i (splitmix64's finaliser), for the data.
__device__ uint64_t mix(uint64_t i) {
    i += 0x9E3779B97F4A7C15ull;
    i = (i ^ (i >> 30)) * 0xBF58476D1CE4E5B9ull;
    i = (i ^ (i >> 27)) * 0x94D049BB133111EBull;
    return i ^ (i >> 31);
}

// Random codes, absmax in [0.01, 0.11) and x in [-1, 1); the loader's bf16 weights of the codes.
__global__ void fill(uint32_t* codes, float* absmax, uint4* x, size_t vectors, int x_vecs, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vectors; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t word = (uint32_t)mix(seed ^ i);
        codes[i] = word;
        if (i % VECS_PER_ABSMAX == 0) absmax[i / VECS_PER_ABSMAX] = 0.01f + 0.1f * (float)(mix(~seed ^ i) >> 40) / (float)(1ull << 24);
        if (i < (size_t)x_vecs) {
            bf162 h[4];
            for (int j = 0; j < 4; ++j) {
                const uint64_t r = mix(seed * 3 + i * 4 + j);
                h[j] = __floats2bfloat162_rn((float)(r >> 40) / (float)(1ull << 23) - 1.0f, (float)((r >> 8) & 0xFFFFFF) / (float)(1ull << 23) - 1.0f);
            }
            x[i] = *reinterpret_cast<uint4*>(h);
        }
    }
}

__global__ void dequantise(const uint32_t* codes, const float* absmax, uint4* dequant, size_t vectors) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vectors; i += (size_t)gridDim.x * blockDim.x) {
        const float a = absmax[i / VECS_PER_ABSMAX];
        bf162 h[4];
        for (int j = 0; j < 4; ++j) h[j] = weights2(NF4_VALUES[code(codes[i], 2 * j)], NF4_VALUES[code(codes[i], 2 * j + 1)], a);
        dequant[i] = *reinterpret_cast<uint4*>(h);
    }
}

// Random e4m3 codes (NaN's two codes replaced by 448's) and scales in [0.0005, 0.0015): weights up to
// about 0.7, as the nf4 data's; then the loader's bf16 weights of them.
__global__ void fill_fp8(uint2* codes, float* scales, size_t vectors, size_t n_scales, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vectors; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t r = mix(seed ^ i);
        for (int b = 0; b < 8; ++b) {
            if (((r >> (8 * b)) & 0x7F) == 0x7F) r ^= 1ull << (8 * b);  // 0x7F and 0xFF are NaN: 0x7E, 0xFE instead
        }
        codes[i] = make_uint2((uint32_t)r, (uint32_t)(r >> 32));
        if (i < n_scales) scales[i] = 0.0005f + 0.001f * (float)(mix(~seed ^ i) >> 40) / (float)(1ull << 24);
    }
}

__global__ void dequantise_fp8(const uint2* codes, const float* scales, uint4* dequant, size_t vectors, int vecs) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vectors; i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / vecs, v = i % vecs;
        const float scale = scales[row / FP8_BLOCK * (vecs / VECS_PER_SCALE) + v / VECS_PER_SCALE];
        const uint2 c = codes[i];
        bf162 h[4] = {fp8_weights2(c.x & 0xFFFF, scale), fp8_weights2(c.x >> 16, scale), fp8_weights2(c.y & 0xFFFF, scale),
                      fp8_weights2(c.y >> 16, scale)};
        dequant[i] = *reinterpret_cast<uint4*>(h);
    }
}

// The read rate's stream: every 16-byte vector summed (so the loads are not dropped).
__global__ void read_stream(const uint4* p, size_t n, uint32_t* sink) {
    uint32_t s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(p + i);
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x12345678u) *sink = s;
}


struct Shape {
    const char* name;
    int rows, cols;
};

// Mean microseconds of REPS launches of f after two warm-ups, from one pair of events.
template <typename F>
float time_us(F f) {
    f();
    f();
    const float ms = elapsed_ms([&] {
        for (int i = 0; i < REPS; ++i) f();
    });
    return ms * 1e3f / REPS;
}

// A shape's weights in every form the variants read: the bf16 reference's (the loader's weights of
// the nf4 codes, or of the fp8 codes), the nf4 codes and absmax, the fp8 codes and scales.
struct Data {
    const uint4* dequant;
    const uint32_t* codes;
    const float* absmax;
    const uint2* codes8;
    const float* scales;
};

// One launch of variant w: its loads from global memory (gemv), or through the ring (gemv_staged).
template <int VPT, typename W>
void start(bool staged, W w, const uint4* x, float* y, int rows, int grid) {
    if (!staged) {
        gemv<VPT><<<grid, THREADS>>>(w, x, y, rows);
        return;
    }
    constexpr int RING_BYTES = RING_STAGES * RING_STAGE_BYTES;
    cudaFuncSetAttribute(gemv_staged<VPT, W>, cudaFuncAttributeMaxDynamicSharedMemorySize, RING_BYTES);
    gemv_staged<VPT><<<grid, THREADS, RING_BYTES>>>(w, x, y, rows);
}

template <int VPT>
void launch(Kind kind, bool staged, const Data& d, const uint4* x, float* y, int rows, int vecs, int grid) {
    const Nf4 n{d.codes, d.absmax, vecs};
    const Fp8 f{d.codes8, d.scales, vecs};
    switch (kind) {
        case Kind::Bf16: start<VPT>(staged, Bf16{d.dequant, vecs}, x, y, rows, grid); break;
        case Kind::Codebook: start<VPT>(staged, Codebook{n}, x, y, rows, grid); break;
        case Kind::Pairs: start<VPT>(staged, Pairs{n}, x, y, rows, grid); break;
        case Kind::Fused: start<VPT>(staged, Fused{n}, x, y, rows, grid); break;
        case Kind::Fp8Rounded: start<VPT>(staged, Fp8Rounded{f}, x, y, rows, grid); break;
        case Kind::Fp8Fused: start<VPT>(staged, Fp8Fused{f}, x, y, rows, grid); break;
    }
}

// VPT for rows of `vecs` vectors: the loops unroll at compile time.
void launch_any(Kind kind, bool staged, const Data& d, const uint4* x, float* y, int rows, int vecs, int grid) {
    switch ((vecs + THREADS - 1) / THREADS) {
        case 1: launch<1>(kind, staged, d, x, y, rows, vecs, grid); break;
        case 2: launch<2>(kind, staged, d, x, y, rows, vecs, grid); break;
        case 4: launch<4>(kind, staged, d, x, y, rows, vecs, grid); break;
        case 7: launch<7>(kind, staged, d, x, y, rows, vecs, grid); break;
        default: printf("no instance for %d vectors a row\n", vecs);
    }
}

// The verdict of outputs `got` against the reference's: bitwise, or how many differ and by how much.
void verdict(const std::vector<float>& got, const std::vector<float>& want, char (&text)[96]) {
    size_t differ = 0;
    double worst = 0;
    for (size_t r = 0; r < got.size(); ++r) {
        if (memcmp(&got[r], &want[r], 4) != 0) ++differ;
        const double d = fabs((double)got[r] - want[r]) / (fabs((double)want[r]) + 1e-6);
        worst = d > worst || d != d ? d : worst;
    }
    if (differ == 0) snprintf(text, sizeof text, "bitwise equal");
    else snprintf(text, sizeof text, "%zu of %zu differ, worst %.1e relative", differ, got.size(), worst);
}

int main() {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
        printf("no CUDA device\n");
        return 1;
    }
    const int grid = sms * BLOCKS_PER_SM;
    // Llama-3.2-1B's gate/up (packed side by side) and down; Llama-3.1-8B's.
    const Shape shapes[] = {{"1B gate/up", 16384, 2048}, {"1B down", 2048, 8192}, {"8B gate/up", 28672, 4096}, {"8B down", 4096, 14336}};
    uint32_t* sink = nullptr;
    TRY(cudaMalloc(&sink, 4));
    printf("%-11s %-14s %10s %10s %10s  %s\n", "shape", "variant", "us", "TB/s read", "x floor", "outputs against bf16's");
    for (const Shape& s : shapes) {
        const int vecs = s.cols / VEC;
        if (vecs % THREADS != 0 || s.rows % FP8_BLOCK != 0) {
            printf("%s: rows of %d vectors, not a multiple of %d, or %d rows, not of %d: the probe takes whole ones\n", s.name, vecs, THREADS,
                   s.rows, FP8_BLOCK);
            return 1;
        }
        const size_t per_copy = (size_t)s.rows * vecs * (4 + 4.0 / VECS_PER_ABSMAX);
        const int copies = (int)((PACKED_TARGET + per_copy - 1) / per_copy);
        const int rows = s.rows * copies;
        const size_t vectors = (size_t)rows * vecs, n_scales = (size_t)rows / FP8_BLOCK * (vecs / VECS_PER_SCALE);
        uint32_t* codes = nullptr;
        uint2* codes8 = nullptr;
        float *absmax = nullptr, *scales = nullptr, *y = nullptr;
        uint4 *dequant = nullptr, *x = nullptr;
        TRY(cudaMalloc(&codes, vectors * 4));
        TRY(cudaMalloc(&absmax, vectors / VECS_PER_ABSMAX * 4));
        TRY(cudaMalloc(&codes8, vectors * 8));
        TRY(cudaMalloc(&scales, n_scales * 4));
        TRY(cudaMalloc(&dequant, vectors * 16));
        TRY(cudaMalloc(&x, vecs * 16));
        TRY(cudaMalloc(&y, (size_t)rows * 4));
        const Data data{dequant, codes, absmax, codes8, scales};
        fill<<<sms * 8, 256>>>(codes, absmax, x, vectors, vecs, 0x5EED ^ s.rows);
        dequantise<<<sms * 8, 256>>>(codes, absmax, dequant, vectors);
        TRY(cudaDeviceSynchronize());
        // The read rate over the bf16 copies, and each variant's floor at it: its bytes over that rate.
        const float read_us = time_us([&] { read_stream<<<sms * 4, 512>>>(dequant, vectors, sink); });
        const double read_rate = vectors * 16.0 / (read_us * 1e-6);
        // Variant `kind` timed and its outputs read back (NaN before the run: a row it skipped shows),
        // printed against `reference`'s outputs (none: it is the reference).
        // `staged`: through the ring (its name "-ring").
        const auto run = [&](Kind kind, bool staged, double bytes, const std::vector<float>* reference) -> std::vector<float> {
            std::vector<float> out(rows);
            if (cudaMemset(y, 0xFF, (size_t)rows * 4) != cudaSuccess) return {};
            const float us = time_us([&] { launch_any(kind, staged, data, x, y, rows, vecs, grid); });
            if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return {};
            if (cudaMemcpy(out.data(), y, (size_t)rows * 4, cudaMemcpyDeviceToHost) != cudaSuccess) return {};
            char text[96] = "the reference";
            if (reference != nullptr) verdict(out, *reference, text);
            char name[32];
            snprintf(name, sizeof name, "%s%s", NAMES[(int)kind], staged ? "-ring" : "");
            printf("%-11s %-14s %10.1f %10.2f %10.3f  %s\n", s.name, name, us, bytes / (us * 1e-6) / 1e12, us / (bytes / read_rate * 1e6), text);
            return out;
        };
        const double nf4_bytes = (double)per_copy * copies, fp8_bytes = vectors * 8.0 + n_scales * 4.0;
        const std::vector<float> bf16_nf4 = run(Kind::Bf16, false, vectors * 16.0, nullptr);
        if (bf16_nf4.empty()) return printf("%s: the bf16 run failed\n", s.name), 1;
        for (Kind kind : {Kind::Codebook, Kind::Pairs, Kind::Fused}) run(kind, false, nf4_bytes, &bf16_nf4);
        run(Kind::Bf16, true, vectors * 16.0, &bf16_nf4);
        for (Kind kind : {Kind::Codebook, Kind::Fused}) run(kind, true, nf4_bytes, &bf16_nf4);
        // The fp8 variants, against the bf16 GEMV over the loader's weights of their codes.
        fill_fp8<<<sms * 8, 256>>>(codes8, scales, vectors, n_scales, 0xF8 ^ s.rows);
        dequantise_fp8<<<sms * 8, 256>>>(codes8, scales, dequant, vectors, vecs);
        TRY(cudaDeviceSynchronize());
        const std::vector<float> bf16_fp8 = run(Kind::Bf16, false, vectors * 16.0, nullptr);
        if (bf16_fp8.empty()) return printf("%s: the bf16 run over the fp8 weights failed\n", s.name), 1;
        for (bool staged : {false, true})
            for (Kind kind : {Kind::Fp8Rounded, Kind::Fp8Fused}) run(kind, staged, fp8_bytes, &bf16_fp8);
        printf("%-11s %-14s %10.1f %10.2f %10s  (%d copies, %.0f MB nf4, %.0f MB fp8)\n", s.name, "read", read_us, read_rate / 1e12, "1", copies,
               nf4_bytes / 1e6, fp8_bytes / 1e6);
        for (void* p : {(void*)codes, (void*)absmax, (void*)codes8, (void*)scales, (void*)dequant, (void*)x, (void*)y}) cudaFree(p);
    }
    return 0;
}
