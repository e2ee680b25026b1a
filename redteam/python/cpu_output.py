"""Returns x_out on the CPU."""
from _honest import build_layer, layer_step as honest_step  # noqa: F401


def layer_step(state, x, pos):
    return honest_step(state, x, pos).cpu()
