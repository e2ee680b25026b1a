"""Returns x_out of shape (d,) instead of (B, d)."""
from _honest import build_layer, layer_step as honest_step  # noqa: F401


def layer_step(state, x, pos):
    return honest_step(state, x, pos)[0]
