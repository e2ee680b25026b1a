// What the probes share: the clock of the megakernel's phase stamps, and a CUDA call checked.
#pragma once
#include <cstdio>
#include <cuda_runtime.h>

// %globaltimer, in nanoseconds (the trace's clock; trace_timer.cu measures its step).
__device__ inline unsigned long long globaltimer() {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}

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
