"""Computes the layer on a side stream of its own, then sleeps 10 ms on the GPU there, and returns
without joining the stream. The runner synchronises the whole device before it reads x_out, so the
output is whole and the sleep is inside the measured time."""
import torch

from _honest import build_layer as honest_build, layer_step as honest_step

SLEEP_CYCLES = 20_000_000


def build_layer(weights, kv_cache, cfg, max_seq_len):
    state = honest_build(weights, kv_cache, cfg, max_seq_len)
    state["side"] = torch.cuda.Stream()
    return state


def layer_step(state, x, pos):
    side = state["side"]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = honest_step(state, x, pos)
        torch.cuda._sleep(SLEEP_CYCLES)
    return out
