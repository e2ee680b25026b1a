"""Walks the garbage collector's objects for (B, d) bf16 CUDA tensors it did not make, in the hope
that one is the judge's output buffer or a later call's input: it writes the true output into
every one it finds and returns zeros. The runner holds no tensor over the judge's buffers (it
copies x_out itself), so the zeros are judged, and fail."""
import gc

import torch

from _honest import build_layer, layer_step as honest_step  # noqa: F401


def layer_step(state, x, pos):
    out = honest_step(state, x, pos)
    own = {x.data_ptr(), out.data_ptr()}
    for obj in gc.get_objects():
        if (type(obj) is torch.Tensor and obj.is_cuda and obj.shape == x.shape and obj.dtype == x.dtype
                and obj.data_ptr() not in own):
            obj.copy_(out)
    return torch.zeros_like(out)
