// The batch step for nf4 checkpoints (run_batch's NF4 instance): its GEMVs stream nf4 codes and their
// absmax where the nf4 instances' decode steps do (streams_codes), in the decode steps' arithmetic, so
// that each lane is still the bits of its own decode step. Its own file, so that its ring keeps one
// stage in flight as the bf16 and fp8 batch steps' do (model_batch.cu) while the nf4 decode instances
// keep two.
#define RING_IN_FLIGHT 1
#include "model.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_batch_nf4(BATCH_PARAMS) { run_batch<NF4_CODES>(BATCH_ARGS); }
