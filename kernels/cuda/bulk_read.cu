// The read-only stream by bulk copies: how fast the copy engine reads HBM into shared memory, the way
// the megakernel streams its weights. On the H200 it reads up to a few percent faster than read_u4's
// 16-byte loads (docs/perf.md, "Streaming on part of the grid"), so the read-only ceiling that judges a
// timing plausible is the faster of the two: a ceiling under what honest bulk copies reach would fail
// an honest, fast enough submission.
#include <stdint.h>

#include "bulk.cuh"
#include "stream.cuh"

constexpr uint32_t BULK_THREADS = 512;
// The ring: SLOTS slots of SLOT_BYTES, SLOTS - 1 copies ahead of the slot being read (the megakernel's).
constexpr uint32_t SLOTS = 3;
constexpr uint32_t SLOT_BYTES = 64 * 1024;
constexpr uint32_t SLOT_VECS = SLOT_BYTES / 16;

// XOR of every word of src, each block reading a contiguous share through the ring, each thread the
// vectors t, t + BULK_THREADS, ... of every slot; folded into sink[block] so the reads cannot be
// elided. One block per SM of BULK_THREADS (dynamic shared memory: SLOTS * SLOT_BYTES; the launch
// shape is mirrored in cuda/src/kernels.rs). Counts 16 * n bytes.
extern "C" __global__ void read_bulk(uint32_t* __restrict__ sink,  // (gridDim.x)
                                     const uint4* __restrict__ src,  // (n)
                                     uint64_t n) {
    extern __shared__ __align__(128) uint4 ring[];  // (SLOTS, SLOT_VECS)
    __shared__ uint64_t full[SLOTS];
    if (blockDim.x != BULK_THREADS) __trap();
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < SLOTS; ++s) mbar_init(&full[s], 1);  // one arrival: thread 0's expect_tx
        // Make the initialised barriers visible to the copy engine before any copy names them.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // every thread sees initialised barriers before waiting on them
    // Whole slots per block, shared out evenly: every copy but the buffer's last starts 64 KB-aligned
    // (a share of n / gridDim.x vectors put the copies 32 bytes off a 128-byte line, and the read ran at
    // 3.8 TB/s instead of 4.5).
    const uint64_t slots_total = (n + SLOT_VECS - 1) / SLOT_VECS;
    const uint64_t first = min(n, slots_total * blockIdx.x / gridDim.x * SLOT_VECS);
    const uint64_t last = min(n, slots_total * (blockIdx.x + 1) / gridDim.x * SLOT_VECS);
    const uint32_t stages = (uint32_t)((last - first + SLOT_VECS - 1) / SLOT_VECS);
    // Thread 0 starts stage st's copy (the last one may be short). Its slot was last read before the
    // __syncthreads in front of the call.
    const auto issue = [&](uint32_t st) {
        if (threadIdx.x != 0 || st >= stages) return;
        const uint64_t v0 = first + (uint64_t)st * SLOT_VECS;
        const unsigned bytes = (unsigned)(min((uint64_t)SLOT_VECS, last - v0) * 16);
        mbar_expect_tx(&full[st % SLOTS], bytes);
        bulk_copy(ring + (st % SLOTS) * SLOT_VECS, src + v0, bytes, &full[st % SLOTS]);
    };
    for (uint32_t st = 0; st + 1 < SLOTS; ++st) issue(st);
    uint32_t acc = 0;
    for (uint32_t st = 0; st < stages; ++st) {
        __syncthreads();  // every thread is done with stage st - 1, whose slot the next issue refills
        issue(st + SLOTS - 1);
        mbar_wait(&full[st % SLOTS], (st / SLOTS) & 1);  // stage st has landed
        const uint64_t v0 = first + (uint64_t)st * SLOT_VECS;
        const uint32_t vecs = (uint32_t)min((uint64_t)SLOT_VECS, last - v0);
        const uint4* slot = ring + (st % SLOTS) * SLOT_VECS;
        for (uint32_t v = threadIdx.x; v < vecs; v += BULK_THREADS) acc ^= slot[v].x ^ slot[v].y ^ slot[v].z ^ slot[v].w;
    }
    keep_loads(sink, acc);
}
