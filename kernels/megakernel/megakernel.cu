// The megakernel's kernels that the judge launches: one layer and a stack of layers (run_program),
// with the batched GEMV probe and the packing gather. The device code they run is megakernel.cuh.
// The model's kernels are model/model.cu, a translation unit of their own: the grader never launches
// them, and its build does not wait the three minutes they take to compile (docs/perf.md, "The
// build"). Each kernel's machine code is the same as when all of them shared one file (the cubins'
// code sections compared, kernel by kernel).
#include "megakernel.cuh"

// ---------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------

// The kernels: one layer (the rows carry its addresses), and a stack of up to PROGRAM_MAX_LAYERS
// layers (the rows name each layer's addresses through its table). Two instances of one program
// runner, so that a one-layer launch carries no tables in its parameter block (their parameters:
// MEGAKERNEL_PARAMS, vm_run.cuh).
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_bf16(MEGAKERNEL_PARAMS(1)) { run_program<1, false>(MEGAKERNEL_ARGS); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_stack_bf16(MEGAKERNEL_PARAMS(PROGRAM_MAX_LAYERS)) {
    run_program<PROGRAM_MAX_LAYERS, false>(MEGAKERNEL_ARGS);
}
// The same for layers with rows of at most 2048 columns somewhere (has_narrow_rows in
// megakernel/src/kernels.rs): those rows stream as groups of one in full stages, as the model kernel's
// sliced instance streams them. Instances of their own, so that the wide layers' kernels keep their
// machine code (sliced code beside it moved ptxas's allocation of the rest, docs/perf.md).
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_sliced_bf16(MEGAKERNEL_PARAMS(1)) { run_program<1, true>(MEGAKERNEL_ARGS); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_stack_sliced_bf16(MEGAKERNEL_PARAMS(PROGRAM_MAX_LAYERS)) {
    run_program<PROGRAM_MAX_LAYERS, true>(MEGAKERNEL_ARGS);
}
// ---------------------------------------------------------------------------------------------------
// Several vectors through one stream (the first piece of batched decode and chunked prefill)
// ---------------------------------------------------------------------------------------------------


// y[b][r] for this block's rows [c0, c1) of the stream's matrix, from the partials of `live` vectors.
__device__ inline void store_rows(float* y, uint32_t rows, uint32_t b0, uint32_t live, uint32_t c0, uint32_t c1, const Partials& part) {
    const uint32_t n = c1 - c0;
    for (uint32_t i = threadIdx.x; i < live * n; i += THREADS) y[(size_t)(b0 + i / n) * rows + c0 + i % n] = row_sum(part.red, i);
}

// Vectors x[b0, b0 + live) against this block's rows [r0, r1) of w through run_group<G>:
// each thread's inputs loaded in the lanes' order, the rows in chunks whose partials fit, each chunk
// streamed once.
template <uint32_t VPT, uint32_t G>
__device__ void grouped_chunks(const bf16* w, uint32_t rows, uint32_t cols, const bf16* x, uint32_t b0, uint32_t live, float* y,
                               uint32_t r0, uint32_t r1, Ring& ring, Partials part) {
    const uint32_t vecs = cols / VEC;
    float h[G][VPT][VEC];
    group_inputs<VPT, G>(h, live, column_thread(cols), [&](uint32_t g, uint32_t t) { return load_slice(x + (size_t)(b0 + g) * cols, cols, t); });
    const uint32_t chunk = part.rows / G;
    for (uint32_t c0 = r0; c0 < r1; c0 += chunk) {
        const uint32_t c1 = min(c0 + chunk, r1);
        const RowStream<VPT> stream = group_stream<VPT>(w, vecs, c0, c1, false);
        stream.prime(ring);
        stream.template run_group<G>(h, live, ring, part);
        store_rows(y, rows, b0, live, c0, c1, part);  // the next run's first __syncthreads follows these reads
    }
}

// Vectors x[b0, b0 + live) against this block's rows [r0, r1) of w, G = group_of<VPT>() at a time.
template <uint32_t VPT>
__device__ void batch_pass_grouped(const bf16* w, uint32_t rows, uint32_t cols, const bf16* x, uint32_t b0, uint32_t live, float* y,
                                   uint32_t r0, uint32_t r1, Ring& ring, Partials part) {
    __syncthreads();  // every read of the partials before is done
    if (row_slices(cols / VEC) > 1) zero_partials(part);
    grouped_chunks<VPT, group_of<VPT>()>(w, rows, cols, x, b0, live, y, r0, r1, ring, part);
}

// Vector x[b] alone against this block's rows [r0, r1) of w, through run() as every phase streams.
template <uint32_t VPT>
__device__ void batch_pass_solo(const bf16* w, uint32_t rows, uint32_t cols, const bf16* x, uint32_t b, float* y, uint32_t r0, uint32_t r1,
                                Ring& ring, Partials part) {
    const Slice s = load_slice(x + (size_t)b * cols, cols);
    for (uint32_t c0 = r0; c0 < r1; c0 += part.rows) {
        const uint32_t c1 = min(c0 + part.rows, r1);
        const RowStream<VPT> stream(w, cols / VEC, c0, c1, false);
        stream.prime(ring);
        stream.run(s, ring, part);
        store_rows(y, rows, b, 1, c0, c1, part);
    }
}

// y (vectors, rows) = x (vectors, cols) against w (rows, cols), f32: grouped, the weights streamed once
// per group of vectors (batch_pass_grouped); else once per vector (batch_pass_solo). Each vector's y is
// bitwise the same either way (run_group); `megakernel batch-gemv` checks it and times both.
extern "C" __global__ void __launch_bounds__(THREADS, 1) megakernel_batch_gemv_bf16(const bf16* __restrict__ w, uint32_t rows, uint32_t cols,
                                                                                    const bf16* __restrict__ x, uint32_t vectors, uint32_t grouped,
                                                                                    float* __restrict__ y, uint32_t red_rows) {
    __shared__ uint64_t full[STAGES];
    Ring ring = start_ring(full);
    const Partials part = row_partials(red_rows);
    // The launcher checks these.
    if (cols % VEC != 0 || vectors == 0 || vectors > MAX_BATCH) __trap();
    const uint32_t r0 = (uint32_t)((uint64_t)rows * blockIdx.x / gridDim.x), r1 = (uint32_t)((uint64_t)rows * (blockIdx.x + 1) / gridDim.x);
    with_stream(w, cols, r0, r1, false, [&](auto all) {
        constexpr uint32_t VPT = decltype(all)::VECS_PER_THREAD;
        if (grouped) {
            for (uint32_t b0 = 0; b0 < vectors; b0 += group_of<VPT>()) {
                batch_pass_grouped<VPT>(w, rows, cols, x, b0, min(group_of<VPT>(), vectors - b0), y, r0, r1, ring, part);
            }
        } else {
            for (uint32_t b = 0; b < vectors; ++b) batch_pass_solo<VPT>(w, rows, cols, x, b, y, r0, r1, ring, part);
        }
    });
}

// dst row r = the row at src_rows[r]: packs weights into the layouts the phases stream.
extern "C" __global__ void gather_rows_u4(uint4* __restrict__ dst,  // (rows, vecs)
                                          const uint64_t* __restrict__ src_rows,  // (rows) addresses
                                          uint32_t rows, uint32_t vecs) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (uint64_t)rows * vecs; i += (uint64_t)gridDim.x * blockDim.x) {
        dst[i] = reinterpret_cast<const uint4*>(src_rows[i / vecs])[i % vecs];
    }
}
