/*
 * persistent_layer.h: the C ABI of an external persistent-layer submission.
 *
 * A submission is a shared library (.so) that exports the seven functions below with C linkage. The
 * grader loads it (`grader run --submission path/to/libmine.so`), checks pl_abi_version() (see
 * "Versioning" at the end), then, for one layer, calls
 *
 *     pl_build_layer(cfg, weights, cache, stream, &handle)    once, untimed
 *     pl_layer_step(handle, x, pos, out, stream)              once per decoded token, timed
 *     pl_teardown(handle)                                     once, at the end
 *
 * and for a stack of n_layers >= 2 layers (rule 11)
 *
 *     pl_build_stack(cfg, n_layers, weights, caches, stream, &handle)    once, untimed
 *     pl_stack_step(handle, x, pos, hidden, out, stream)                 once per decoded token, timed
 *     pl_teardown(handle)                                                once, at the end
 *
 * all from one host thread. This is the contract of docs/task.md ("The contract") in C.
 *
 * The layer (one Llama-style decoder layer, batch 1, bf16):
 *
 *     h    = rmsnorm(x, in_norm)                 rmsnorm(v, g) = v / sqrt(mean(v^2) + eps) * g
 *     q, k, v = h @ Wq^T, h @ Wk^T, h @ Wv^T
 *     q, k = rope(q, pos), rope(k, pos)          rotate-half per head: element i < hd/2 pairs with
 *                                                i + hd/2, angle pos * theta^(-2i / hd)
 *     cache.k[:, :, pos], cache.v[:, :, pos] = k, v
 *     a    = softmax(q . K[0..=pos] / sqrt(hd)) @ V[0..=pos] per query head; query head j reads KV
 *            head j / (n_q / n_kv)
 *     x1   = x + a @ Wo^T
 *     h2   = rmsnorm(x1, post_norm)
 *     out  = x1 + (silu(h2 @ Wgate^T) * (h2 @ Wup^T)) @ Wdown^T
 *
 * Rules (the grader checks every one of them after the run; a submission that breaks one fails):
 *
 *  1. Memory. Every pointer in this ABI is a device pointer in the grader's CUDA context (the primary
 *     context of the device), allocated by the grader, 256-byte aligned, and valid from
 *     pl_build_layer until pl_teardown returns. All tensors are bf16 (__nv_bfloat16), row-major,
 *     dense.
 *  2. The weights are read-only, at every call. A matrix is (out, in) and applied as h @ W^T:
 *       in_norm, post_norm (d);  q (n_q*hd, d);  k, v (n_kv*hd, d);  o (d, n_q*hd);
 *       gate, up (ffn, d);  down (d, ffn).
 *     A submission may keep its own repacked copy, made in pl_build_layer (untimed).
 *  3. The KV cache, k and v, each (batch, n_kv, max_seq_len, hd). Slots [0, pos) hold the prefix and
 *     the earlier steps; the rest are zero. It is the ONLY grader memory a step writes besides `out`:
 *     pl_layer_step must write K and V (after RoPE) into slot `pos` of every KV head, and nothing
 *     else of the cache. The next step attends over it, and the grader compares the whole cache with
 *     the reference's at the end (prefix bitwise, written slots within the tolerance, unused slots
 *     still zero).
 *  4. x, (batch, d), is read-only; it is fresh at every call, except in the throughput phase, where
 *     it is the previous call's out. out, (batch, d) bf16, is written in full. pos advances by one
 *     per call within a phase; each phase (correctness, timed, throughput) starts again at the same
 *     first position, so a slot may be written more than once (docs/task.md, "The schedule").
 *  5. Streams. `stream` is a CUstream, which is the same thing as a cudaStream_t. It may be NULL: the
 *     legacy default stream, a valid stream, not "no stream". All work of a call goes on it, or on
 *     streams the submission joins back into it, and nothing of a step may still run on a side
 *     stream when pl_layer_step returns unless the stream waits on it. The grader times each
 *     pl_layer_step between two device-wide synchronisations, so work hidden on other streams is
 *     timed anyway; pl_layer_step need not synchronise.
 *  6. The gates (docs/task.md). Correct: ||out - ref|| / ||ref|| (fp32) at most 1.5e-2 at every
 *     call, no NaN or Inf. At most 2 kernels in every call (counted by CUPTI from before the library
 *     is loaded until after teardown; a CUDA graph's nodes count as kernels; no kernel may be
 *     launched from the device), the largest with at least 0.95 of the call's kernel time. Every
 *     call reads at least 0.98x its byte model from DRAM (hardware counters). No other process may
 *     use the GPU, no process may be started after pl_build_layer returns, no persisting L2.
 *  7. pl_build_layer is untimed: repack weights, build tables, allocate scratch (cudaMalloc), load
 *     modules. pl_layer_step should not allocate. pl_teardown frees everything pl_build_layer made.
 *  8. Errors. Every int-returning function returns PL_OK (0) on success and one of the PL_ERR_ codes
 *     otherwise; pl_last_error() then returns one sentence saying what failed (a NUL-terminated
 *     string owned by the library, valid until the next call into the library on the same thread).
 *     A nonzero return stops the run: the grader reports the message. No function may throw a C++
 *     exception, abort or exit.
 *  9. Threads and contexts. The grader calls from one host thread with its context current. A
 *     submission must not create, destroy or switch contexts, nor reset the device.
 * 10. The config is batch 1 in the task; a submission may refuse anything it does not support with
 *     PL_ERR_UNSUPPORTED from pl_build_layer, pl_last_error() naming the limit the config is over.
 *     That is an honest answer, not a crash: the run ends with the verdict `unsupported` (exit code
 *     1, a fail), quoting the message, e.g. `VERDICT: UNSUPPORTED  hd = 256 is over this kernel's
 *     128`. Any other code from pl_build_layer, and any nonzero code (PL_ERR_UNSUPPORTED included)
 *     from pl_layer_step, ends the run as `crashed`. For example:
 *
 *         static _Thread_local char last_error[256];
 *
 *         const char* pl_last_error(void) { return last_error; }
 *
 *         int pl_build_layer(const pl_config* cfg, const pl_weights* w, const pl_kv_cache* cache,
 *                            void* stream, void** handle) {
 *             last_error[0] = '\0';
 *             if (cfg->hd > 128) {
 *                 snprintf(last_error, sizeof last_error, "hd = %d is over this kernel's 128", cfg->hd);
 *                 return PL_ERR_UNSUPPORTED;
 *             }
 *             ...                            (build, store the handle, return PL_OK)
 *         }
 *
 * 11. Stacks (version 2). A stack is n_layers layers of cfg's shape, each with its own weights and
 *     cache: w[l] and caches[l] of pl_build_stack are layer l's (the arrays live only for the call;
 *     the pointers in them may be kept). Layer 0 reads x, layer l > 0 reads row l - 1 of hidden;
 *     layer l < n_layers - 1 writes its output into row l of hidden, and the last layer writes out.
 *     hidden, (n_layers - 1, batch, d) bf16, is written in full at every call, so that each layer can
 *     be judged on its own input (docs/stack.md: the grader does not run stacks yet). Rules 1 to 10
 *     hold as for one layer, pl_build_stack and pl_stack_step in the place of pl_build_layer and
 *     pl_layer_step, and for every layer: the weights of every layer are read-only, x is read-only,
 *     and pl_stack_step writes slot pos of every layer's cache, hidden and out, and no other memory of
 *     the grader. A stack of one is a layer: the grader builds it with pl_build_layer and steps it
 *     with pl_layer_step, exactly as in version 1, so pl_build_stack always gets n_layers >= 2. A
 *     handle of pl_build_stack goes only to pl_stack_step, one of pl_build_layer only to
 *     pl_layer_step; pl_teardown takes either. A library that runs one layer, or not this many,
 *     declines with PL_ERR_UNSUPPORTED from pl_build_stack naming its limit (`a stack of 80 layers:
 *     this kernel runs one`), as in rule 10.
 *
 * Versioning: any change to these structs, functions or rules increments PL_ABI_VERSION. Version 2
 * added pl_build_stack and pl_stack_step (rule 11) and changed nothing of version 1, so the grader
 * loads a library of either: a version-1 library exports the five functions of one layer, runs one
 * layer, and is declined a stack as unsupported; a version-2 library exports all seven. The grader
 * refuses any other version.
 */
#ifndef PERSISTENT_LAYER_H
#define PERSISTENT_LAYER_H

#include <stdint.h>

#define PL_ABI_VERSION 2

/* Return codes. */
#define PL_OK 0
#define PL_ERR_INVALID_ARGUMENT 1 /* a NULL pointer, a bad size, a misaligned buffer, an unknown handle */
#define PL_ERR_UNSUPPORTED 2      /* a config or stack the submission does not implement (rules 10, 11) */
#define PL_ERR_CUDA 3             /* a CUDA call failed (allocation, launch, ...) */
#define PL_ERR_INTERNAL 4         /* anything else */

#ifdef __cplusplus
extern "C" {
#endif

/* One layer's dimensions (spec::Config of the grader). */
typedef struct {
    int32_t d;           /* hidden size */
    int32_t ffn;         /* MLP intermediate size */
    int32_t n_q;         /* query heads */
    int32_t n_kv;        /* key/value heads; n_q is a multiple of n_kv */
    int32_t hd;          /* head size, even */
    int32_t max_seq_len; /* cache capacity in positions */
    int32_t batch;       /* 1 in the task */
    float eps;           /* RMSNorm epsilon, inside the square root */
    double theta;        /* RoPE base */
} pl_config;

/* One layer's weights: device pointers, bf16, row-major (out, in), read-only (rule 2). */
typedef struct {
    const void* in_norm;   /* (d) */
    const void* post_norm; /* (d) */
    const void* q;         /* (n_q * hd, d) */
    const void* k;         /* (n_kv * hd, d) */
    const void* v;         /* (n_kv * hd, d) */
    const void* o;         /* (d, n_q * hd) */
    const void* gate;      /* (ffn, d) */
    const void* up;        /* (ffn, d) */
    const void* down;      /* (d, ffn) */
} pl_weights;

/* The KV cache: device pointers, bf16, (batch, n_kv, max_seq_len, hd) each; written at slot pos only. */
typedef struct {
    void* k;
    void* v;
} pl_kv_cache;

/* PL_ABI_VERSION of the header the library was built with. */
uint32_t pl_abi_version(void);

/* Untimed. Builds whatever the steps need and stores an opaque handle in *handle. The pointers in
 * cfg, w and cache may be kept: the structs themselves need not be (they live only for the call). */
int pl_build_layer(const pl_config* cfg, const pl_weights* w, const pl_kv_cache* cache, void* stream,
                   void** handle);

/* Timed: one decoded token at pos. Reads x (batch, d) bf16, writes out (batch, d) bf16 and slot pos
 * of the cache given to pl_build_layer; all work on stream (rule 5). */
int pl_layer_step(void* handle, const void* x, int32_t pos, void* out, void* stream);

/* Version 2, untimed: a stack of n_layers >= 2 layers (rule 11), w and caches n_layers entries each,
 * layer 0's first. Stores an opaque handle in *handle, as pl_build_layer; PL_ERR_UNSUPPORTED declines
 * the stack. */
int pl_build_stack(const pl_config* cfg, uint32_t n_layers, const pl_weights* w, const pl_kv_cache* caches,
                   void* stream, void** handle);

/* Version 2, timed: one decoded token at pos through every layer of the stack. Reads x (batch, d)
 * bf16; writes hidden (n_layers - 1, batch, d) bf16, row l the output of layer l, out (batch, d) bf16,
 * the last layer's output, and slot pos of every layer's cache; all work on stream (rules 5, 11). */
int pl_stack_step(void* handle, const void* x, uint32_t pos, void* hidden, void* out, void* stream);

/* Frees everything pl_build_layer or pl_build_stack made. Called once per handle; NULL is ignored. May
 * synchronise. */
void pl_teardown(void* handle);

/* The message of the last failure on this thread (rule 8); "" when none. Never NULL. */
const char* pl_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* PERSISTENT_LAYER_H */
