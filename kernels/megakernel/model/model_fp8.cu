// The model kernel for fp8 checkpoints (`megakernel generate/bench/check` on a checkpoint saved with
// transformers' FineGrainedFP8Config): run_model's instances whose rows too wide for slices stream as
// e4m3 codes and their scales (streams_codes), half of bf16's bytes, each vector of 8 codes' values
// dotted with x in f32 and the sum times its scale (fused8: no weight rounded to bf16).
// For layers without q/k norms: with rows all too wide for slices (Llama-3.1-8B), and with some
// narrow rows, which stream bf16 in slices as in the bf16 instance (Llama-3.2-1B's Down alone streams
// fp8). Their own file: model.cu's instances keep the machine code that was measured.
#include "model.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_fp8(MODEL_PARAMS) { run_model<false, false, false, E4M3_CODES>(MODEL_ARGS, nullptr); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_sliced_fp8(MODEL_PARAMS) { run_model<false, true, false, E4M3_CODES>(MODEL_ARGS, nullptr); }
