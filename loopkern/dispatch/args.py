"""Classify call arguments: arrays (where they live, shape, dtype, strides, pointer) and numbers.

Every check runs before anything is copied or launched; moving arrays to where a backend
needs them is ``buffers.to_cuda``, after every argument has passed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..errors import ArgumentError

HOST, DEVICE = "host", "device"
_OK_KINDS = {"b", "i", "u", "f"}


@dataclass
class ArrayArg:
    """An array argument as given, with what the checks need to know about it."""

    name: str
    value: object
    where: str            # HOST (NumPy) or DEVICE (__cuda_array_interface__)
    shape: tuple
    dtype: np.dtype
    strides: tuple | None
    ptr: int
    readonly: bool = False   # the kernel must not write it (a NumPy array's flags.writeable is False)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class ScalarArg:
    name: str
    value: object         # a NumPy scalar of the type the kernel sees
    weak: bool = False    # a Python float: it takes the precision of the float arrays


def _is_jax_array(x) -> bool:
    mod = type(x).__module__ or ""
    return mod.startswith(("jax", "jaxlib"))


def check_dtype(name: str, dtype: np.dtype, what: str = "array"):
    """Raise ArgumentError unless ``dtype`` is bool, an integer, float32 or float64."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        raise ArgumentError(f"argument '{name}': {what} has dtype {dtype}; complex numbers are not supported "
                            f"yet (store real and imaginary parts in two float arrays)")
    if dtype.kind not in _OK_KINDS or (dtype.kind == "f" and dtype.itemsize not in (4, 8)):
        raise ArgumentError(f"argument '{name}': {what} has dtype {dtype}; expected bool, an integer type, "
                            f"float32 or float64")
    if not dtype.isnative:
        raise ArgumentError(f"argument '{name}': {what} has dtype {dtype.str}, in the other byte order than this "
                            f"machine's; pass {name}.astype({name}.dtype.newbyteorder('='))")


def classify(name: str, value):
    """Return an :class:`ArrayArg` or :class:`ScalarArg` for one argument, or raise ArgumentError."""
    if _is_jax_array(value):
        raise ArgumentError(f"argument '{name}' is a JAX array; JAX arrays are immutable, so kernel(...) cannot "
                            f"update it in place: call kernel.jax(...) instead (functional: JAX arrays in, new JAX "
                            f"arrays out, eagerly or inside jax.jit), or pass a NumPy array or a writable GPU array "
                            f"(CuPy, PyTorch, Numba)")
    if isinstance(value, (list, tuple)):
        kind = type(value).__name__
        raise ArgumentError(f"argument '{name}': got a Python {kind}; kernel(...) takes arrays and numbers, and "
                            f"updates arrays in place: pass a NumPy array, e.g. np.asarray({name}) (with the dtype "
                            f"you want, e.g. np.asarray({name}, dtype=np.float32)), and read the results from it")
    if isinstance(value, (np.ma.MaskedArray, np.matrix)):
        # (ndarray subclasses whose elements or indexing mean something else; Numba refuses them)
        kind, fix = (("a masked array", f"{name}.filled(fill_value) (or np.asarray({name}) for its data, mask "
                      f"ignored)") if isinstance(value, np.ma.MaskedArray) else ("an np.matrix", f"np.asarray({name})"))
        raise ArgumentError(f"argument '{name}': got {kind}, which a kernel cannot take; pass a plain array: {fix}")
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ArgumentError(f"argument '{name}': got a 0-d array; pass a Python or NumPy scalar instead")
        check_dtype(name, value.dtype)
        return ArrayArg(name, value, HOST, value.shape, value.dtype, value.strides,
                        value.__array_interface__["data"][0], readonly=not value.flags.writeable)
    if type(value).__name__ == "FakeCUDAArray" and hasattr(value, "_ary"):
        # Numba's CUDA simulator: its "device" arrays wrap a NumPy array and have no CAI
        host = value._ary
        check_dtype(name, host.dtype)
        return ArrayArg(name, value, DEVICE, host.shape, host.dtype, host.strides,
                        host.__array_interface__["data"][0], readonly=not host.flags.writeable)
    cai = getattr(value, "__cuda_array_interface__", None) if not isinstance(value, type) else None
    if cai is not None:
        shape = tuple(cai["shape"])
        if not shape:
            raise ArgumentError(f"argument '{name}': got a 0-d GPU array; pass a Python or NumPy scalar instead")
        dtype = np.dtype(cai["typestr"])
        check_dtype(name, dtype)
        strides = tuple(cai["strides"]) if cai.get("strides") else None
        return ArrayArg(name, value, DEVICE, shape, dtype, strides, int(cai["data"][0]),
                        readonly=bool(cai["data"][1]))
    if isinstance(value, (bool, np.bool_)):
        return ScalarArg(name, np.bool_(value))
    if isinstance(value, np.generic):
        check_dtype(name, value.dtype, "scalar")
        return ScalarArg(name, value)
    if isinstance(value, numbers.Integral):
        v = int(value)
        if not -(2 ** 63) <= v < 2 ** 63:
            raise ArgumentError(f"argument '{name}': integer {v} does not fit in int64")
        return ScalarArg(name, np.int64(v))
    if isinstance(value, numbers.Real):
        return ScalarArg(name, np.float64(value), weak=True)
    if isinstance(value, numbers.Complex):
        raise ArgumentError(f"argument '{name}': complex numbers are not supported yet")
    if hasattr(value, "__dlpack__"):
        from ..interop.dlpack import import_dlpack
        return classify(name, import_dlpack(name, value))
    raise ArgumentError(f"argument '{name}': expected an array or a number, got {type(value).__name__}")


def c_strides(shape, itemsize) -> tuple:
    """Byte strides of a C-contiguous array of ``shape``."""
    return tuple(math.prod(shape[i + 1:]) * itemsize for i in range(len(shape)))


def byte_extent(shape, strides, itemsize) -> tuple[int, int]:
    """[lo, hi) byte range the elements occupy, relative to the pointer of element 0."""
    if math.prod(shape) == 0:
        return 0, 0
    lo = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) + itemsize
    return lo, hi


def _extent(a: ArrayArg) -> tuple[int, int]:
    """[lo, hi) byte range an array's elements occupy."""
    lo, hi = byte_extent(a.shape, a.strides or c_strides(a.shape, a.dtype.itemsize), a.dtype.itemsize)
    return a.ptr + lo, a.ptr + hi


def overlaps(a: ArrayArg, b: ArrayArg) -> bool:
    """True if two arrays on the same side may share memory."""
    if a.where != b.where:
        return False
    (alo, ahi), (blo, bhi) = _extent(a), _extent(b)
    return alo < bhi and blo < ahi


def self_overlapping(a: ArrayArg) -> bool:
    """True if two elements of ``a`` may share memory (a stride of 0, as ``np.broadcast_to``
    or ``as_strided`` make, or strides that interleave): with the dimensions of more than one
    element ordered by stride, each stride must step over everything the smaller ones span."""
    if a.strides is None:
        return False            # C-contiguous
    dims = sorted((abs(st), n) for st, n in zip(a.strides, a.shape) if n > 1)
    span = a.dtype.itemsize
    for st, n in dims:
        if st < span:
            return True
        span = st * (n - 1) + span
    return False


def first_overlap(argv, kept) -> tuple[int, int] | None:
    """(i, j): the first array argument ``argv[j]`` that shares memory with a kept one
    ``argv[i]`` (``i`` in ``kept``, the arrays a scope keeps in a copy of its own), or None."""
    for i in kept:
        for j, b in enumerate(argv):
            if j != i and isinstance(b, ArrayArg) and overlaps(argv[i], b):
                return i, j
    return None


def weak_float_type(dtypes) -> str | None:
    """``"float32"`` when every floating-point dtype among the array arguments' ``dtypes`` is
    float32 (and there is one).

    Then Python floats, as arguments and as literals in the step, are float32 too, as in
    NumPy 2 and JAX (a Python scalar takes the precision of the arrays it meets): ``2.0 * u[i]``
    stays float32 arithmetic instead of promoting the whole expression to float64.
    """
    floats = {np.dtype(d) for d in dtypes if np.dtype(d).kind == "f"}
    return "float32" if floats == {np.dtype(np.float32)} else None


def apply_weak_floats(argv, float_type):
    """``argv`` with Python-float scalars converted to ``float_type`` (None: unchanged)."""
    if float_type is None:
        return argv
    return [ScalarArg(a.name, np.dtype(float_type).type(a.value)) if isinstance(a, ScalarArg) and a.weak else a
            for a in argv]
