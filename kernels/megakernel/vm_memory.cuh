// The memory operations the megakernel's code is written in: release and acquire on counters,
// asynchronous copies into shared memory, the proxy fence, L2-only activation loads, and the
// tensor-core products and fragment loads attention uses.
#pragma once
#include "bulk.cuh"
#include "layer_math.cuh"

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
