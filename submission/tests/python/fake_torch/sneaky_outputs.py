"""Outputs whose reading would run the submission's code: a subclass whose every accessor records
that it ran, and plain tensors after torch.Tensor's accessors were patched to lie. The grader must
refuse the first without touching it and read the second through torch's own descriptors."""
import torch

ran = []


class Lazy(torch.Tensor):
    def data_ptr(self):
        ran.append("data_ptr")
        return 0

    @property
    def shape(self):
        ran.append("shape")
        return torch.Size((1, 1))

    @classmethod
    def __torch_function__(cls, *args, **kwargs):
        ran.append("__torch_function__")


def build_layer(weights, kv_cache, cfg, max_seq_len):
    return None


def layer_step(handle, x, pos):
    if pos == 0:
        return Lazy(x.data_ptr(), tuple(x.shape))
    if pos == 1:
        if ran:
            raise RuntimeError(f"the grader ran the subclass's {ran}")
        at, shape = x.data_ptr(), tuple(x.shape)
        torch.Tensor.data_ptr = lambda self: 0xBAD
        torch.Tensor.shape = property(lambda self: torch.Size((1, 1)))
        return torch.Tensor(at, shape)
    # The patches undone, for the other tests in this interpreter.
    del torch.Tensor.data_ptr, torch.Tensor.shape
    return x
