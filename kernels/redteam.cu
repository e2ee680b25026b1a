// Kernels of the red team (submission/src/redteam/): adversarial submissions that try to fool the
// grader, each of which the grader must catch with a specific gate or status. Nothing here belongs to
// a real submission.
//
// Every kernel that waits on something is bounded by the GPU's global timer, so none can hold the
// device longer than its limit even if the grader's watchdog never kills the process: a red-team run
// must never leave a shared GPU stuck.
#include <stdint.h>

// Nanoseconds of the GPU's global timer (%globaltimer). It is wall-clock time, the same on every SM
// and independent of the SM clock, unlike clock64(), which counts one SM's cycles and whose rate
// changes with the clock; its resolution (about a microsecond) is ample for limits of seconds.
__device__ inline uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Pause between two polls of a word the host writes: a microsecond keeps one warp's polling from
// flooding L2 with loads and is invisible next to the limits (seconds) and the host's reaction time.
constexpr unsigned POLL_SLEEP_NS = 1000;

// ---------------------------------------------------------------------------------------------------
// hang: a step that never finishes
// ---------------------------------------------------------------------------------------------------

// Waits for *flag to become nonzero, which nothing ever does, so the step hangs until the grader's
// watchdog kills the process. Safety exit: it returns anyway once limit_ns have passed since it
// started, so the GPU is freed even if no watchdog acts. One thread is enough; launch <<<1, 1>>>.
extern "C" __global__ void spin_until_flag_u32(const uint32_t* flag,  // (1), zero, never written
                                               uint64_t limit_ns) {
    const volatile uint32_t* f = flag;  // volatile: every poll reads memory, never a register copy
    const uint64_t start = global_ns();
    while (*f == 0) {
        if (global_ns() - start >= limit_ns) return;
        __nanosleep(POLL_SLEEP_NS);
    }
}

// ---------------------------------------------------------------------------------------------------
// crash: a step that faults
// ---------------------------------------------------------------------------------------------------

// Stores value at target, which the host sets to an unmapped address (just above the null pointer).
// The store faults: the context reports CUDA_ERROR_ILLEGAL_ADDRESS at the next synchronisation and is
// unusable from then on. Launch <<<1, 1>>>.
extern "C" __global__ void store_to_address_u32(uint32_t* target, uint32_t value) { *target = value; }

// ---------------------------------------------------------------------------------------------------
// build-kernel: a persistent "server" launched in build_layer, fed by memcpys
// ---------------------------------------------------------------------------------------------------

// Words of the mailbox (unsigned long long each), mirrored in submission/src/redteam/build_kernel.rs.
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
