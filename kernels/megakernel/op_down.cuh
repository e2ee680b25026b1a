// Task kind Down: out = x1 + Wd act, through the residual GEMV (op_oproj.cuh).
#pragma once
#include "op_oproj.cuh"

// out = x1 + Wd act over the columns of act the row names: all of them; or a part of them (f32 products
// to PartOut, added to PartIn's where the row names them; the last part rounds). Every part runs on the
// same blocks with the same rows, so a block adds the partials it wrote itself: program order, no wait.
template <bool SLICED, bool TRACED = false, uint32_t CODES = BF16_ROWS>
__device__ __forceinline__ void phase_down(const OpRow& op, bf16* out, Ring& ring, Partials part) {
    residual_gemv<SLICED, TRACED, CODES>(op, act_ptr<const bf16>(op, down::Act), (uint32_t)op[down::Cols], act_ptr<const bf16>(op, down::X1), out,
                  part_ptr<const float>(op, down::PartIn), part_ptr<float>(op, down::PartOut), ring, part);
}
