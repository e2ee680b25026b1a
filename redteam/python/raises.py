"""Raises ZeroDivisionError in its third call of layer_step: the verdict shows the traceback."""
from _honest import build_layer, on_third_call  # noqa: F401

layer_step = on_third_call(lambda: 1 / 0)
