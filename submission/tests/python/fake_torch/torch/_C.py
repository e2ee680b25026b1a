class dtype:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


class layout:
    def __init__(self, name):
        self.name = name


bfloat16, float32, float16 = dtype("bfloat16", 2), dtype("float32", 4), dtype("float16", 2)
strided, sparse_coo = layout("strided"), layout("sparse_coo")


class Size(tuple):
    pass


class TensorBase:
    """address: device address; device: CUDA ordinal, or -1 for the CPU."""

    def __init__(self, address, shape, dtype=bfloat16, device=0, contiguous=True, layout=strided):
        self._address, self._shape, self._dtype = address, tuple(shape), dtype
        self._device, self._contiguous, self._layout = device, contiguous, layout

    def data_ptr(self):
        return self._address

    def is_contiguous(self):
        return self._contiguous

    def get_device(self):
        return self._device

    shape = property(lambda self: Size(self._shape))
    dtype = property(lambda self: self._dtype)
    layout = property(lambda self: self._layout)
    is_cuda = property(lambda self: self._device >= 0)


class Tensor(TensorBase):
    pass


class DisableTorchFunction:
    active = False

    def __enter__(self):
        DisableTorchFunction.active = True

    def __exit__(self, *exc):
        DisableTorchFunction.active = False
