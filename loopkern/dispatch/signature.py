"""A call's signature: the facts about its arguments that a launch plan depends on, read cheaply.

For every argument ``arg_key`` returns a hashable key that determines everything the first
call with such an argument decided: its kind (NumPy, a GPU array type, a Python or NumPy
number), dtype, shape, strides (so layout and contiguity) and writability. Two calls whose
keys are equal get the same checks, the same compiled kernel and the same grid, so the second
one reuses the first one's plan. What depends on the values themselves (pointers: aliasing of
swap pairs, memory shared with a staged array; integers outside int64) is checked per call.

``None`` means "no cheap key for this object": such calls take the full path every time.
"""

from __future__ import annotations

import numpy as np

_PROBES: dict = {}


def _numpy_key(v):
    f = v.flags
    return (np.ndarray, v.dtype, v.shape, v.strides, f.writeable, f.aligned)


def _numba_device_key(v):
    return (type(v), v.dtype, v.shape, v.strides)


def _numba_device_ptr(v) -> int:
    data = v.gpu_data
    return (data.device_pointer_value or 0) if data is not None else 0


def _simulator_key(v):
    a = v._ary
    return (type(v), a.dtype, a.shape, a.strides, a.flags.writeable)


def _simulator_ptr(v) -> int:
    return v._ary.__array_interface__["data"][0]


def _cupy_key(v):
    return (type(v), v.dtype, v.shape, v.strides, v.device.id)


def _cupy_ptr(v) -> int:
    return v.data.ptr


def _torch_key(v):
    if not v.is_cuda or v.requires_grad:
        return None                       # host tensors go through DLPack; grads are refused there
    return (type(v), v.dtype, tuple(v.shape), v.stride(), v.device.index)


def _torch_ptr(v) -> int:
    return v.data_ptr()


def _cai_key(v):
    cai = v.__cuda_array_interface__
    strides = cai.get("strides")
    return (type(v), cai["typestr"], tuple(cai["shape"]), tuple(strides) if strides else None,
            bool(cai["data"][1]))


def _cai_ptr(v) -> int:
    return int(v.__cuda_array_interface__["data"][0])


def _int_key(v):
    return (int,)


def _float_key(v):
    return (float,)


def _bool_key(v):
    return (bool,)


def _generic_key(v):
    return (type(v),)


def _no_key(v):
    return None


#: type -> (key function, pointer function or None for host arrays and numbers)
def _probe_for(t):
    if t is np.ndarray:
        return _numpy_key, None
    if t is int:
        return _int_key, None
    if t is float:
        return _float_key, None
    if t is bool or t is np.bool_:
        return _bool_key, None
    if issubclass(t, np.generic) and np.dtype(t).kind in "iuf":
        return _generic_key, None
    name, mod = t.__name__, t.__module__ or ""
    if name == "DeviceNDArray" and mod.startswith(("numba", "numba_cuda")):
        return _numba_device_key, _numba_device_ptr
    if name == "FakeCUDAArray":
        return _simulator_key, _simulator_ptr
    if name == "ndarray" and mod.startswith("cupy"):
        return _cupy_key, _cupy_ptr
    if name == "Tensor" and mod.startswith("torch"):
        return _torch_key, _torch_ptr
    if mod.startswith(("jax", "jaxlib")) or issubclass(t, (list, tuple, complex)):
        return _no_key, None              # refused by the full path, with its message
    if "__cuda_array_interface__" in dir(t):
        return _cai_key, _cai_ptr
    return _no_key, None


def probe(t):
    """(key function, pointer function) for arguments of type ``t`` (memoized per type)."""
    hit = _PROBES.get(t)
    if hit is None:
        hit = _PROBES[t] = _probe_for(t)
    return hit


def arg_key(v):
    """The signature key of one argument value, or None."""
    t = type(v)
    hit = _PROBES.get(t)
    if hit is None:
        hit = probe(t)
    return hit[0](v)


def call_key(values) -> tuple | None:
    """The keys of all arguments, with which of them are the same object (a NumPy array passed
    twice is copied to the GPU once, so the plan depends on it); None if any has no key."""
    keys = []
    ids = None
    probes = _PROBES
    for v in values:
        t = type(v)
        hit = probes.get(t)
        key = (hit or probe(t))[0](v)
        if key is None:
            return None
        if t is np.ndarray:
            if ids is None:
                ids = {}
            first = ids.setdefault(id(v), len(keys))
            if first != len(keys):
                key = key + (first,)
        keys.append(key)
    return tuple(keys)


INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
