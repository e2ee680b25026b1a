// The model's kernels (`megakernel generate/bench/check`, megakernel/src/model): a whole checkpoint's
// positions in one launch (run_model), in three instances and their traced twins (the batch step is
// model_batch.cu's). The device code they run is ../megakernel.cuh; compiled by the megakernel
// crate's build script with its `model` feature, apart from the judge's kernels
// (../megakernel.cu), so that the grader's build never waits for these; each kernel's machine code is
// the one it had when all shared one file. The traced twins stay in this file: without them the
// other instances compile to different machine code (the cubins' code sections compared), and theirs
// is the code that was measured.
#include "model.cuh"

// A model's positions from pos0 on, in one launch (run_model). Three instances, each the machine code
// measured for its models (code a model does not run still moves ptxas's allocation and schedule of
// what it runs; docs/perf.md): for layers with per-head q/k norms (Qwen3); for layers without them
// whose rows are all too wide for slices (row_slices; Llama-3.1-8B decoded 2.7% slower with the sliced
// code in its kernel); and for the rest, whose narrow rows stream as groups of one (SLICED). In the
// q/k-norm instance the LM head streams as a group of one too (phase_head_solo). The instances for fp8
// checkpoints are model_fp8.cu's.
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_bf16(MODEL_PARAMS) { run_model<false, false, false>(MODEL_ARGS, nullptr); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_sliced_bf16(MODEL_PARAMS) { run_model<false, true, false>(MODEL_ARGS, nullptr); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_qk_norm_bf16(MODEL_PARAMS) { run_model<true, true, false>(MODEL_ARGS, nullptr); }
// The same three with every block stamping the global timer around each phase of every position
// (`megakernel bench --trace`): for reading where a token's time goes, not for timing, as their machine
// code is not the instances' above.
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_traced_bf16(MODEL_TRACE_PARAMS) { run_model<false, false, true>(MODEL_ARGS, trace); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_sliced_traced_bf16(MODEL_TRACE_PARAMS) { run_model<false, true, true>(MODEL_ARGS, trace); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_qk_norm_traced_bf16(MODEL_TRACE_PARAMS) { run_model<true, true, true>(MODEL_ARGS, trace); }
