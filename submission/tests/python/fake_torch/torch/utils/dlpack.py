"""from_dlpack over the runner's capsules, decoded with ctypes as dlpack.h lays them out."""
import ctypes

from .._C import Tensor, bfloat16


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]

KDL_CUDA, KDL_BFLOAT = 2, 4


def from_dlpack(capsule):
    t = DLManagedTensor.from_address(_get_pointer(capsule, b"dltensor")).dl_tensor
    assert (t.device.device_type, t.dtype.code, t.dtype.bits, t.dtype.lanes) == (KDL_CUDA, KDL_BFLOAT, 16, 1)
    assert t.byte_offset == 0
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] for i in range(t.ndim)]
    expected, stride = [], 1
    for n in reversed(shape):
        expected.insert(0, stride)
        stride *= n
    assert strides == expected, f"strides {strides} for shape {shape}"
    _set_name(capsule, b"used_dltensor")  # consumed once, as torch does
    return Tensor(t.data, shape, bfloat16, t.device.device_id)
