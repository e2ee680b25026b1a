// Kernels that do nothing, for timing the launch path of a call in parts (`grader profile`, the
// launch path): each takes the launch the megakernel's takes one respect at a time. Neither reads
// or writes memory unless `sink` is set (never, in the probes): their time is the launch's own.
#include <stdint.h>

// The size of the megakernel's program parameter (megakernel/kernels/program.cuh: 12 rows of 16
// int64 words; a test in grader/src/profile/launch.rs checks the mirror).
constexpr int PROBE_PARAM_WORDS = 12 * 16;
struct ProbeParam {
    int64_t words[PROBE_PARAM_WORDS];
};

// No parameter block beyond the sink pointer.
extern "C" __global__ void probe_empty(uint32_t* sink) {
    if (sink != nullptr && threadIdx.x == 0) sink[blockIdx.x] = 1;
}

// The megakernel's parameter block, read as its words are (from the launch's constant bank); the
// read keeps the parameter from being optimised away.
extern "C" __global__ void probe_param(const __grid_constant__ ProbeParam param, uint32_t* sink) {
    if (sink != nullptr && threadIdx.x == 0) sink[blockIdx.x] = (uint32_t)param.words[blockIdx.x % PROBE_PARAM_WORDS];
}
