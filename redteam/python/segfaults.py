"""Reads address 0 through ctypes in its third call of layer_step: a segfault, the verdict is crashed."""
import ctypes

from _honest import build_layer, on_third_call  # noqa: F401

layer_step = on_third_call(lambda: ctypes.string_at(0))
