// How finely %globaltimer, the clock of every phase stamp (`megakernel bench --trace`, `grader
// profile`), resolves time on this card: one thread reads it back to back and records each step it
// sees, with the SM cycles between steps. A trace's parts under a microsecond (an attention phase's
// scores, softmax and P V; a norm's reduction) mean something only if the steps are much shorter;
// with coarse steps a per-position median is quantised, and only a mean over many positions is a
// fair estimate. Build and run on the GPU:
//   nvcc -O3 -arch=sm_90a -o trace_timer scripts/probes/trace_timer.cu && ./trace_timer
#include <cstdio>
#include <cuda_runtime.h>
#include "probe.cuh"

constexpr int STEPS = 4096;  // steps recorded
constexpr int SKIP = 16;     // the first steps, while the loop warms up, left out

__global__ void record_steps(unsigned long long* step_ns, unsigned long long* step_cycles) {
    unsigned long long last = globaltimer(), cycles = clock64();
    for (int k = 0; k < STEPS;) {
        const unsigned long long now = globaltimer();
        if (now == last) continue;
        const unsigned long long c = clock64();
        step_ns[k] = now - last;
        step_cycles[k] = c - cycles;
        last = now;
        cycles = c;
        ++k;
    }
}

int main() {
    unsigned long long *ns = nullptr, *cycles = nullptr;
    if (cudaMallocManaged(&ns, STEPS * sizeof *ns) != cudaSuccess || cudaMallocManaged(&cycles, STEPS * sizeof *cycles) != cudaSuccess) {
        printf("no CUDA device, or no memory for %d steps\n", STEPS);
        return 1;
    }
    record_steps<<<1, 1>>>(ns, cycles);
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
        printf("the probe failed: %s\n", cudaGetErrorString(err));
        return 1;
    }
    unsigned long long least = ~0ull, most = 0, total_ns = 0, total_cycles = 0;
    for (int k = SKIP; k < STEPS; ++k) {
        least = ns[k] < least ? ns[k] : least;
        most = ns[k] > most ? ns[k] : most;
        total_ns += ns[k];
        total_cycles += cycles[k];
    }
    const int n = STEPS - SKIP;
    printf("%%globaltimer over %d steps: least %llu ns, most %llu ns, mean %.1f ns; %.0f SM cycles a step (%.2f GHz)\n", n, least, most,
           (double)total_ns / n, (double)total_cycles / n, (double)total_cycles / total_ns);
    printf("the first steps after the warm-up, ns:");
    for (int k = SKIP; k < SKIP + 12; ++k) printf(" %llu", ns[k]);
    printf("\n");
    return 0;
}
