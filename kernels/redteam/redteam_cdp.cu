// Kernels of the red team's device-launch adversary (redteam/src/device_launch.rs): a
// parent kernel that launches child kernels from the device, with CUDA dynamic parallelism. On Hopper,
// CUPTI's activity records count only the kernels the host launches, so the children of a parent are
// invisible to a kernel count built on them; the grader must refuse the module instead.
//
// Built by build.rs apart from the other files: relocatable device code (-rdc=true), device-linked
// against libcudadevrt.a, the device runtime that implements the <<<...>>> launches below.
#include <stdint.h>

// Counts its launch: one atomic add, so the parent's host can check that every child ran.
extern "C" __global__ void cdp_child_count_u64(unsigned long long* launches) { atomicAdd(launches, 1ull); }

// Launches `children` one-thread children, each counting itself in *launches. The parent's grid
// completes only when all of its children have, so a step that waits for the parent waits for them.
// One thread is enough; launch <<<1, 1>>>.
extern "C" __global__ void cdp_parent_launch_u64(unsigned long long* launches, uint32_t children) {
    for (uint32_t i = 0; i < children; ++i) cdp_child_count_u64<<<1, 1>>>(launches);
}
