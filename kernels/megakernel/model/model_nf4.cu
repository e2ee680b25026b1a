// The model kernel for bitsandbytes nf4 checkpoints (`megakernel generate/bench/check` on a checkpoint
// saved after loading with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")): run_model's
// instances whose rows too wide for slices stream as nf4 codes and their blocks' absmax (streams_codes),
// a little over a quarter of bf16's bytes, each vector of 8 codes' values dotted with x in f32 and
// the sum times its absmax (fused8: no weight rounded to bf16), or on the tensor cores where the loader
// put them in pair tiles (vm_pairs.cuh: rows of 4096 columns, and of 2048 in the sliced instance's
// group streams). For layers without q/k norms: with rows all too wide for slices, and with some narrow
// rows, which stream bf16 in slices as in the bf16 instance where they are not in pair tiles. Their own
// file: the bf16 and fp8 instances keep the machine code that was measured. The batch step that streams
// the same codes in the same arithmetic is model_nf4_batch.cu's.
// No traced twins: `megakernel bench --trace` on an nf4 checkpoint traces its bf16 stream and says so.
#include "model.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_nf4(MODEL_PARAMS) { run_model<false, false, false, NF4_CODES>(MODEL_ARGS, nullptr); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_model_sliced_nf4(MODEL_PARAMS) { run_model<false, true, false, NF4_CODES>(MODEL_ARGS, nullptr); }
