"""Arrays that offer only ``__dlpack__`` (PyTorch, JAX-free frameworks): imported zero copy.

A GPU array is seen through ``__cuda_array_interface__`` via ``cuda.core``'s StridedMemoryView;
a host array becomes a NumPy array.
"""

from __future__ import annotations

import numpy as np

from ..errors import ArgumentError


class _DLPackDeviceArray:
    """A GPU array imported through DLPack, seen through __cuda_array_interface__ (zero copy).

    Holds the exporter and the view so the memory stays alive while loopkern uses it.
    """

    def __init__(self, owner, view, cai):
        self.owner, self.view = owner, view
        self.__cuda_array_interface__ = cai


def _strided_memory_view():
    try:
        from cuda.core.utils import StridedMemoryView
    except ImportError:   # older cuda-core
        from cuda.core.experimental.utils import StridedMemoryView
    return StridedMemoryView


#: the stream loopkern launches on, as DLPack names it: 1 is CUDA's legacy default stream
#: (never -1, which JAX passes to cuStreamWaitEvent as a handle)
LAUNCH_STREAM_DLPACK = 1


def import_dlpack(name: str, value):
    """What an object that offers only ``__dlpack__`` holds, zero copy: a NumPy array for a host
    array, or an object with ``__cuda_array_interface__`` for a GPU array (the caller classifies
    either like any other array)."""
    try:
        kind, _ = value.__dlpack_device__()
    except Exception:
        kind = None
    if kind == 1:   # kDLCPU
        return np.from_dlpack(value)
    if kind not in (2, 13):   # kDLCUDA, kDLCUDAManaged
        raise ArgumentError(f"argument '{name}': {type(value).__name__} is a DLPack array on device type "
                            f"{kind}; expected a CUDA GPU array or a host array")
    try:
        view = _strided_memory_view().from_dlpack(value, stream_ptr=LAUNCH_STREAM_DLPACK)
    except Exception as exc:
        raise ArgumentError(f"argument '{name}': could not import {type(value).__name__} through DLPack: {exc}") from exc
    if getattr(view, "readonly", False):
        raise ArgumentError(f"argument '{name}': the DLPack array is read-only; kernel(...) updates arrays in place")
    dtype = np.dtype(view.dtype)
    shape = tuple(int(x) for x in view.shape)
    strides = None if view.strides is None else tuple(int(s) * dtype.itemsize for s in view.strides)
    cai = dict(shape=shape, typestr=dtype.str, data=(int(view.ptr), False), strides=strides, version=3)
    return _DLPackDeviceArray(value, view, cai)
