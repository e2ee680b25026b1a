// The model kernels' parameters (model.cu's instances, model_fp8.cu's), and their names as run_model's
// arguments; a traced instance's, with its stamps.
#pragma once
#include "../megakernel.cuh"

#define MODEL_PARAMS                                                                                                          \
    const __grid_constant__ Program<PROGRAM_MAX_LAYERS> program, const __grid_constant__ ModelArgs model, uint32_t phases, \
        uint32_t layers, bf16* __restrict__ out,    /* (d) */                                                               \
        bf16* __restrict__ hidden,                   /* (layers - 1, d); null for one layer */                              \
        uint32_t d, uint32_t step,                   /* steps run before this launch */                                     \
        unsigned* __restrict__ phase_done,           /* (PROGRAM_MAX_PHASES + 1) */                                         \
        uint32_t red_rows
#define MODEL_ARGS program, model, phases, layers, out, hidden, d, step, phase_done, red_rows
#define MODEL_TRACE_PARAMS MODEL_PARAMS, uint64_t* __restrict__ trace /* (positions, gridDim.x, layers * phases + 1, TRACE_STAMPS) */
// The batch step's parameters (run_batch's instances, model.cu's and model_fp8.cu's), and their names as
// its arguments.
#define BATCH_PARAMS                                                                                                                   \
    const __grid_constant__ Program<PROGRAM_MAX_LAYERS> program, const __grid_constant__ ModelArgs model,                              \
        const __grid_constant__ BatchArgs batch, uint32_t phases, uint32_t layers, bf16* __restrict__ out, /* (lanes, d) */         \
        bf16* __restrict__ hidden,                  /* (lanes, layers - 1, d); null for one layer */                                 \
        uint32_t d, uint32_t step,                  /* steps run before this launch */                                               \
        unsigned* __restrict__ phase_done,          /* (PROGRAM_MAX_PHASES + 1) */                                                   \
        uint32_t red_rows
#define BATCH_ARGS program, model, batch, phases, layers, out, hidden, d, step, phase_done, red_rows
