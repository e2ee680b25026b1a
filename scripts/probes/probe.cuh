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

// A failed CUDA call, said in one line, and 1 returned from the function that made it.
#define TRY(call)                                                               \
    do {                                                                        \
        const cudaError_t e_ = (call);                                          \
        if (e_ != cudaSuccess) {                                                \
            printf("%s failed: %s\n", #call, cudaGetErrorString(e_));           \
            return 1;                                                           \
        }                                                                       \
    } while (0)
