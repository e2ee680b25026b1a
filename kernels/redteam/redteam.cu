// Kernels of the red team (redteam/src/): adversarial submissions that try to fool the
// grader, each of which the grader must catch with a specific gate or status. Nothing here belongs to
// a real submission.
//
// Every kernel that waits on something is bounded by the GPU's global timer, so none can hold the
// device longer than its limit even if the grader's watchdog never kills the process: a red-team run
// must never leave a shared GPU stuck.
#include <stdint.h>

#include "layer_math.cuh"

// Nanoseconds of the GPU's global timer (%globaltimer). It is wall-clock time, the same on every SM
// and independent of the SM clock, unlike clock64(), which counts one SM's cycles and whose rate
// changes with the clock; its resolution (about a microsecond) is ample for limits of seconds.
__device__ inline uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Pause between two polls of a word the host writes, or of the clock: a microsecond keeps one warp's
// polling from flooding L2 with loads and is invisible next to the limits (seconds), the host's
// reaction time, and the padding of a step (hundreds of microseconds).
constexpr unsigned POLL_SLEEP_NS = 1000;

// ---------------------------------------------------------------------------------------------------
// hang, recording-off-waiter: a kernel that waits for a flag
// ---------------------------------------------------------------------------------------------------

// Waits for *flag to equal value. hang waits for a value nothing ever writes, so the step hangs until
// the grader's watchdog kills the process; recording-off-waiter waits, on a stream of its own, for
// the epoch store_to_address_u32 writes once the step's hidden kernels have run. Safety exit: it
// returns anyway once limit_ns have passed since it started, so the GPU is freed even if no watchdog
// acts or no store comes. One thread is enough; launch <<<1, 1>>>.
extern "C" __global__ void spin_until_flag_u32(const uint32_t* flag,  // (1)
                                               uint32_t value, uint64_t limit_ns) {
    // volatile: every poll is a load from memory, never a register copy, so a store another kernel
    // makes (it lands in L2) is seen; no fence follows, as the flag publishes no other data.
    const volatile uint32_t* f = flag;
    const uint64_t start = global_ns();
    while (*f != value) {
        if (global_ns() - start >= limit_ns) return;
        __nanosleep(POLL_SLEEP_NS);
    }
}

// ---------------------------------------------------------------------------------------------------
// crash, recording-off-waiter: one store
// ---------------------------------------------------------------------------------------------------

// Stores value at target. Launch <<<1, 1>>>.
// - crash aims it at an unmapped address (just above the null pointer): the store faults, the context
//   reports CUDA_ERROR_ILLEGAL_ADDRESS at the next synchronisation and is unusable from then on.
// - recording-off-waiter sets its flag with it, after the step's hidden kernels on the same stream
//   (stream order: they have all finished when it runs). A plain store is enough: global stores write
//   through to L2, where the waiter's volatile loads look, and no fence is needed because the flag
//   publishes no other data.
extern "C" __global__ void store_to_address_u32(uint32_t* target, uint32_t value) { *target = value; }

// ---------------------------------------------------------------------------------------------------
// build-kernel: a persistent "server" launched in build_layer, fed by memcpys
// ---------------------------------------------------------------------------------------------------

// Words of the mailbox (unsigned long long each), mirrored in redteam/src/build_kernel.rs.
// The host writes SRC, DST and LEN, then (by a later copy on the same stream) SEQ; the server answers
// each new SEQ by copying LEN 16-bit elements from SRC to DST and then writing SEQ to DONE. STOP
// nonzero asks it to exit.
constexpr int MAILBOX_SEQ = 0;
constexpr int MAILBOX_SRC = 1;
constexpr int MAILBOX_DST = 2;
constexpr int MAILBOX_LEN = 3;
constexpr int MAILBOX_STOP = 4;
constexpr int MAILBOX_DONE = 5;

// What the block does in one round of the loop, decided by thread 0 and shared with the others.
constexpr int ACTION_WAIT = 0;
constexpr int ACTION_SERVE = 1;
constexpr int ACTION_EXIT = 2;

// Serves copy requests until STOP is set or no request came for idle_limit_ns (measured from the
// launch or from the last request answered). The idle exit is the safety exit: a server nobody talks
// to leaves the GPU on its own. One block (any multiple of 32 threads); thread 0 polls the mailbox.
extern "C" __global__ void serve_copies_u16(unsigned long long* mailbox,  // (6), see MAILBOX_*
                                            uint64_t idle_limit_ns) {
    volatile unsigned long long* box = mailbox;  // volatile: each poll sees the host's latest copy
    __shared__ int action;
    __shared__ unsigned long long req_src, req_dst, req_len, req_seq;
    unsigned long long served = 0;  // thread 0's: the last sequence number answered
    uint64_t last = global_ns();    // thread 0's: when it was answered (or the launch)
    for (;;) {
        if (threadIdx.x == 0) {
            const unsigned long long seq = box[MAILBOX_SEQ];
            if (box[MAILBOX_STOP] != 0 || global_ns() - last >= idle_limit_ns) {
                action = ACTION_EXIT;
            } else if (seq != served) {
                __threadfence();  // the payload is read after the sequence number that announced it
                req_src = box[MAILBOX_SRC];
                req_dst = box[MAILBOX_DST];
                req_len = box[MAILBOX_LEN];
                req_seq = seq;
                action = ACTION_SERVE;
            } else {
                action = ACTION_WAIT;
            }
        }
        __syncthreads();  // the decision and the request are visible to every thread
        const int a = action;
        if (a == ACTION_EXIT) return;  // uniform: every thread read the same decision
        if (a == ACTION_SERVE) {
            const uint16_t* src = reinterpret_cast<const uint16_t*>(req_src);
            uint16_t* dst = reinterpret_cast<uint16_t*>(req_dst);
            for (unsigned long long i = threadIdx.x; i < req_len; i += blockDim.x) dst[i] = src[i];
        }
        __syncthreads();  // every thread is done with the request before thread 0 takes the next
        if (threadIdx.x == 0) {
            if (a == ACTION_SERVE) {
                __threadfence();  // the copy is visible before the completion word
                box[MAILBOX_DONE] = req_seq;
                served = req_seq;
                last = global_ns();
            } else {
                __nanosleep(POLL_SLEEP_NS);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// int8-down, int8-down-padded: the down projection streamed as int8 rows plus exact outliers
// ---------------------------------------------------------------------------------------------------

// int8 weights per 16-byte vector: a row's length must be a multiple of it (the launcher checks).
constexpr uint32_t I8_PER_VEC = 16;
// Independent 16-byte weight loads a lane keeps in flight.
constexpr int I8_GEMV_UNROLL = 4;

// acc + the dot product of 16 int8 weights (one vector) with 16 bf16 activations (two vectors), f32.
__device__ inline float dot16_i8(uint4 w, uint4 h_lo, uint4 h_hi, float acc) {
    const int8_t* ws = reinterpret_cast<const int8_t*>(&w);
    const bf16* lo = reinterpret_cast<const bf16*>(&h_lo);
    const bf16* hi = reinterpret_cast<const bf16*>(&h_hi);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf((float)ws[j], __bfloat162float(lo[j]), acc);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf((float)ws[8 + j], __bfloat162float(hi[j]), acc);
    return acc;
}

// y[r] = bf16(scale[r] * (q[r, :] . h) + the row's outliers . h), one warp per row: lane l reads the
// row's int8 vectors l, l + 32, ... and its outliers l, l + 32, ...; the warp's butterflies add the
// lanes' two sums. cols is a multiple of I8_PER_VEC and every pointer the base of an allocation, so
// the 16-byte loads are aligned.
extern "C" __global__ void gemv_i8_outliers_bf16(
    bf16* __restrict__ y,                      // (rows)
    const int8_t* __restrict__ q,              // (rows, cols), zero where an outlier is
    const float* __restrict__ scale,           // (rows)
    const uint32_t* __restrict__ row_start,    // (rows + 1): row r's outliers are [row_start[r], row_start[r + 1])
    const uint32_t* __restrict__ outlier_col,  // (outliers)
    const bf16* __restrict__ outlier_val,      // (outliers)
    const bf16* __restrict__ h,                // (cols)
    uint32_t rows, uint32_t cols) {
    const uint32_t warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const uint32_t row = blockIdx.x * (blockDim.x / WARP) + warp;
    if (row >= rows) return;  // the whole warp leaves together: its shuffles below stay converged
    const uint4* qr = reinterpret_cast<const uint4*>(q + (size_t)row * cols);  // (cols / I8_PER_VEC)
    const uint4* hv = reinterpret_cast<const uint4*>(h);                       // (cols / VEC)
    float dense = 0.0f;
#pragma unroll I8_GEMV_UNROLL
    for (uint32_t c = lane; c < cols / I8_PER_VEC; c += WARP) dense = dot16_i8(qr[c], hv[2 * c], hv[2 * c + 1], dense);
    float sparse = 0.0f;
    for (uint32_t i = row_start[row] + lane; i < row_start[row + 1]; i += WARP) {
        sparse = fmaf(__bfloat162float(outlier_val[i]), __bfloat162float(h[outlier_col[i]]), sparse);
    }
    dense = warp_reduce(dense, Add{});
    sparse = warp_reduce(sparse, Add{});
    if (lane == 0) y[row] = __float2bfloat16_rn(fmaf(scale[row], dense, sparse));
}

// ---------------------------------------------------------------------------------------------------
// int8-down-padded: a step stretched to a chosen length
// ---------------------------------------------------------------------------------------------------

// *start = the global timer, when the GPU reaches this launch: the first of the step. Launch <<<1, 1>>>.
extern "C" __global__ void record_global_ns_u64(uint64_t* start) {  // (1)
    *start = global_ns();
}

// Sleeps until duration_ns have passed since *start, which record_global_ns_u64 wrote earlier on the
// same stream (stream order makes it visible here). Bounded by construction: it never waits past
// start + duration_ns, and a start in the future reads as long past (unsigned wrap). Launch <<<1, 1>>>.
extern "C" __global__ void spin_until_elapsed_u64(const uint64_t* __restrict__ start,  // (1)
                                                  uint64_t duration_ns) {
    const uint64_t begin = *start;
    while (global_ns() - begin < duration_ns) __nanosleep(POLL_SLEEP_NS);
}
