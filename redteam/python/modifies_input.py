"""Computes correctly, then adds 1 to x[0, 0]: x is read-only."""
from _honest import build_layer, layer_step as honest_step  # noqa: F401


def layer_step(state, x, pos):
    out = honest_step(state, x, pos)
    x[0, 0] += 1
    return out
