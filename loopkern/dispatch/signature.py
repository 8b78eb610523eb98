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

import weakref

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


#: key functions of array types whose key and pointer cannot change while the object lives:
#: Numba's device arrays set shape, strides, dtype and memory once, in their constructor (the
#: simulator's stand-in likewise). NumPy, CuPy and PyTorch arrays can be reshaped, resized or
#: made read-only in place, so their keys are read on every call.
_STABLE_ARRAYS = (_numba_device_key, _simulator_key)
_NUMBERS = (_int_key, _float_key, _bool_key, _generic_key)


class LastCall:
    """A kernel's last plan, for the commonest call of all: the same array objects again.

    A loop that calls ``k(u, v, alpha, steps=n)`` over and over passes the very same arrays
    each time. For arrays whose key cannot change (``_STABLE_ARRAYS``) the object's identity
    then stands for its key and pointer, so such a call skips ``call_key`` and the plan's
    pointer checks: it checks the arrays by identity (through weak references, so a dead array
    whose id is reused never matches), the numbers by exact type and, for Python ints, the
    int64 range, and the call options by identity. Anything else returns None: the call takes
    the full lookup, which gives every error it would have given.
    """

    __slots__ = ("opts", "ctx", "arrays", "numbers", "plan", "ptrs")

    def __init__(self, opts, ctx, arrays, numbers, plan, ptrs):
        self.opts, self.ctx, self.arrays, self.numbers, self.plan, self.ptrs = opts, ctx, arrays, numbers, plan, ptrs

    @classmethod
    def remember(cls, opts: tuple, ctx: int, values, plan, ptrs) -> "LastCall | None":
        """The memo of a call that ran ``plan`` with ``values`` (None if one of them is not a
        stable array or a number)."""
        arrays, numbers = [], []
        for i, v in enumerate(values):
            t = type(v)
            key = probe(t)[0]
            if key in _STABLE_ARRAYS:
                try:
                    arrays.append((i, weakref.ref(v)))
                except TypeError:
                    return None
            elif key in _NUMBERS:
                numbers.append((i, t))
            else:
                return None
        return cls(opts, ctx, tuple(arrays), tuple(numbers), plan, ptrs)

    def match(self, opts: tuple, values) -> bool:
        """Whether a call with these options and values may run this plan with these pointers
        (the caller compares the CUDA context)."""
        for a, b in zip(opts, self.opts):
            if a is not b:
                return False
        for i, ref in self.arrays:
            if ref() is not values[i]:
                return False
        for i, t in self.numbers:
            v = values[i]
            if type(v) is not t or (t is int and not INT64_MIN <= v <= INT64_MAX):
                return False
        return True
