"""Returns a torch.Tensor subclass holding nothing yet: its accessors and __torch_function__ are
where it would compute the layer, when the grader touched it after the timed window. The grader
must refuse it by its type alone: if any of its code ran, the process would abort and the verdict
would not name the type."""
import os

import torch

from _honest import build_layer  # noqa: F401


class Deferred(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        os.abort()

    def data_ptr(self):
        os.abort()


def layer_step(state, x, pos):
    return torch.empty_like(x).as_subclass(Deferred)
