"""The honest eager layer (submission/examples/python/eager_layer.py) that the adversaries wrap."""
import os
import sys

# The examples' folder, from this one (redteam/python/).
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "submission", "examples", "python")
sys.path.insert(0, EXAMPLES)

import eager_layer as eager  # noqa: E402

build_layer = eager.build_layer
layer_step = eager.layer_step


class Calls:
    """Counts the calls of layer_step."""

    def __init__(self):
        self.made = 0

    def next(self):
        self.made += 1
        return self.made - 1


def on_third_call(action):
    """The honest layer_step, except that its third call runs action() first."""
    calls = Calls()

    def layer_step(state, x, pos):
        if calls.next() == 2:
            action()
        return eager.layer_step(state, x, pos)

    return layer_step
