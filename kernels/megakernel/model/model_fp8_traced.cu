// The traced twins of model_fp8.cu's instances (`megakernel bench --trace` and `decode_step_timed` on an
// fp8 checkpoint that streams codes): every block stamps the global timer around each phase of every
// position, for reading where a token's time goes in the fp8 stream, never for a timed figure. Their own
// file: in model_fp8.cu they changed the machine code of the instances measured there.
#include "model.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_traced_fp8(MODEL_TRACE_PARAMS) { run_model<false, false, true, E4M3_CODES>(MODEL_ARGS, trace); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_sliced_traced_fp8(MODEL_TRACE_PARAMS) { run_model<false, true, true, E4M3_CODES>(MODEL_ARGS, trace); }
