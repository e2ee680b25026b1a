// One step of up to MAX_BATCH lanes of a bf16 model, in one launch (run_batch). Its own file, so that
// its ring keeps one stage in flight (IN_FLIGHT) while the decode instances keep two: a batch stage
// takes longer to sum than to land, so one stage ahead keeps its stream fed, and the smaller queue
// shortens every hand-off and attention round trip (docs/perf.md, "One stage in flight, run" and
// "The batch step with one stage in flight").
#define RING_IN_FLIGHT 1
#include "model.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_batch_bf16(BATCH_PARAMS) { run_batch(BATCH_ARGS); }
