"""Host tensors that hand themselves out through ``__dlpack__`` as torch and numpy do (a DLPack 0.8
``DLManagedTensor`` in a capsule named "dltensor"), built with ctypes alone, and a stand-in for a
loaded transformers model made of them: what the tests give ``MegaModel.from_pretrained`` where no
torch is installed. Each tensor counts its exports and its deleter's calls, so a test can see that
the consumer deleted what it took, once."""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path
from typing import Dict, List, Optional

KDL_CPU = 1
KDL_INT, KDL_FLOAT, KDL_BFLOAT = 0, 2, 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The capsule keeps a pointer to its name: the bytes live as long as the module.
_NAME = b"dltensor"


class HostTensor:
    """``data`` (little-endian elements of DLPack type ``code``/``bits``) of ``shape``, with ``strides``
    in elements (None: compact row-major, exported as a null pointer)."""

    def __init__(self, data: bytes, code: int, bits: int, shape: List[int], strides: Optional[List[int]] = None):
        self._buffer = ctypes.create_string_buffer(data, len(data))
        self.code, self.bits, self.shape, self.strides = code, bits, list(shape), strides
        self.exported = 0
        self.deleted = 0
        self._alive: list = []  # what each export's C structures point at

    def _delete(self, _managed) -> None:
        self.deleted += 1

    def __dlpack_device__(self):
        return (KDL_CPU, 0)

    def __dlpack__(self, stream=None):
        n = len(self.shape)
        shape = (ctypes.c_int64 * max(n, 1))(*self.shape)
        strides = None if self.strides is None else (ctypes.c_int64 * max(n, 1))(*self.strides)
        deleter = DELETER(self._delete)
        managed = DLManagedTensor(
            DLTensor(ctypes.cast(self._buffer, ctypes.c_void_p), DLDevice(KDL_CPU, 0), n,
                     DLDataType(self.code, self.bits, 1), shape,
                     ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)) if strides is not None else None, 0),
            None, deleter)
        self._alive.append((shape, strides, deleter, managed))
        self.exported += 1
        return _capsule_new(ctypes.addressof(managed), _NAME, None)


def read_safetensors(path: Path) -> Dict[str, HostTensor]:
    """Every tensor of a bf16 safetensors file as a ``HostTensor``."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "BF16", t
        start, end = t["data_offsets"]
        out[name] = HostTensor(body[start:end], KDL_BFLOAT, 16, t["shape"])
    return out


def widened(t: HostTensor) -> HostTensor:
    """A bf16 tensor as f32 (each value exactly: bf16 is f32's upper half)."""
    data = bytes(t._buffer.raw)
    f32 = b"".join(b"\0\0" + data[i:i + 2] for i in range(0, len(data), 2))
    return HostTensor(f32, KDL_FLOAT, 32, t.shape)


class Config:
    """A transformers config's one method the loader calls."""

    def __init__(self, fields: dict, name: str):
        self._fields, self.name_or_path = fields, name

    def to_json_string(self) -> str:
        return json.dumps(self._fields)


class LoadedModel:
    """A stand-in for a loaded transformers model: ``config`` and ``state_dict()``."""

    def __init__(self, folder: Path, tensors: Optional[Dict[str, object]] = None):
        self.config = Config(json.loads((folder / "config.json").read_text()), str(folder))
        self.tensors = tensors if tensors is not None else read_safetensors(folder / "model.safetensors")

    def state_dict(self) -> Dict[str, object]:
        return self.tensors
