// The batch step for fp8 checkpoints (run_batch's FP8 instance): its GEMVs stream e4m3 codes where the
// fp8 instances' decode steps do (streams_codes), decoded once for every lane of a group, so that each
// lane is still the bits of its own decode step. Its own file, as model_fp8.cu's instances have theirs;
// its ring keeps one stage in flight, as the bf16 batch step's (model_batch.cu).
#define RING_IN_FLIGHT 1
#include "model.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_batch_fp8(BATCH_PARAMS) { run_batch<E4M3_CODES>(BATCH_ARGS); }
