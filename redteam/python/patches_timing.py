"""Patches what a grader written in Python might time or read with (torch.cuda.synchronize, CUDA
events, Tensor.data_ptr, the time module) so that steps would look instant, then spends 20 ms per
step. The judge's clock is its own and the runner reads x_out through torch's C-level descriptors,
so the 20 ms are measured and the output is read right."""
import time

import torch

from _honest import build_layer as honest_build, layer_step as honest_step

_clock = time.perf_counter
WAIT_S = 0.02


def build_layer(weights, kv_cache, cfg, max_seq_len):
    state = honest_build(weights, kv_cache, cfg, max_seq_len)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Event.elapsed_time = lambda self, end: 0.001
    torch.Tensor.data_ptr = lambda self: 0
    for name in ("perf_counter", "monotonic", "time"):
        setattr(time, name, lambda: 0.0)
        setattr(time, name + "_ns", lambda: 0)
    return state


def layer_step(state, x, pos):
    out = honest_step(state, x, pos)
    start = _clock()
    while _clock() - start < WAIT_S:
        pass
    return out
