// Bulk copies global -> shared by the copy engine (Hopper's cp.async.bulk), completing on an mbarrier
// in shared memory that counts the bytes landing: the weight ring of the megakernel
// (kernels/megakernel/vm_stream.cuh) and the read-only stream that measures how fast such copies read
// HBM (bulk_read.cu).
#pragma once
#include <stdint.h>

__device__ inline unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// mbarriers (one per ring slot) that count the bytes of a bulk copy landing in shared memory.
__device__ inline void mbar_init(uint64_t* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// The producer's arrival, announcing how many bytes the slot's copy will deliver.
__device__ inline void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Waits until the barrier's phase `parity` has completed (all bytes landed).
__device__ inline void mbar_wait(uint64_t* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\n WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
// One bulk copy global -> shared by the copy engine, completing on `bar`. 16-byte aligned, whole
// 16-byte multiples.
__device__ inline void bulk_copy(void* smem, const void* gmem, unsigned bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
// An L2 policy for data read once: L2 evicts its lines first, so a stream of it does not push out
// what is read again.
__device__ inline uint64_t l2_evict_first() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// The same copy, with an L2 cache policy (such as l2_evict_first()) for the lines it reads.
__device__ inline void bulk_copy(void* smem, const void* gmem, unsigned bytes, uint64_t* bar, uint64_t policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
                     smem_addr(smem)),
                 "l"(gmem), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
                 : "memory");
}
