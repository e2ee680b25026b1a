"""Loops forever in its third call of layer_step: the watchdog ends it as a timeout."""
import itertools

from _honest import build_layer, on_third_call  # noqa: F401

layer_step = on_third_call(lambda: all(itertools.repeat(True)))
