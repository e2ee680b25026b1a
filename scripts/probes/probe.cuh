// What the probes share: the clock of the megakernel's phase stamps, the counters' release and acquire,
// an event-timed launch, and a CUDA call checked.
#pragma once
#include <cstdio>
#include <cuda_runtime.h>

// %globaltimer, in nanoseconds (the trace's clock; trace_timer.cu measures its step).
__device__ inline unsigned long long globaltimer() {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}

// A counter's acquire load and release add, as the megakernel's phases signal and wait on them. A probe
// that includes the megakernel's headers (PROBE_WITH_MEGAKERNEL) has the acquire load from vm_memory.cuh.
#ifndef PROBE_WITH_MEGAKERNEL
__device__ inline unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
#endif
__device__ inline void red_release(unsigned* p) { asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory"); }

// Milliseconds between two events recorded around launch() on the default stream.
template <typename Launch>
float elapsed_ms(Launch launch) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return ms;
}

// A failed CUDA call, said in one line, and 1 returned from the function that made it.
#define TRY(call)                                                               \
    do {                                                                        \
        const cudaError_t e_ = (call);                                          \
        if (e_ != cudaSuccess) {                                                \
            printf("%s failed: %s\n", #call, cudaGetErrorString(e_));           \
            return 1;                                                           \
        }                                                                       \
    } while (0)
