"""The checks every call runs before anything is copied or launched: options, and each argument
against what the step does with it. Each raises an :class:`~loopkern.errors.ArgumentError` that
names the argument and what was expected. ``kernel(...)`` and ``kernel.jax(...)`` share them.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..dsl import ATOMIC_DTYPES
from ..errors import ArgumentError
from ..spec import ARRAY, SCALAR

BACKENDS = ("auto", "cuda", "cpu")
SCOPES = ("auto", "grid", "block", "thread", "tile", "cluster")


def check_array_use(p, shape, filename):
    """ArgumentError if an array has fewer dimensions than the step indexes it with, or more
    than an element access of the step gives it (that access would be a row, not a number)."""
    if len(shape) < p.min_ndim:
        raise ArgumentError(f"argument '{p.name}': the step indexes it with {p.min_ndim} indices "
                            f"({filename}:{p.min_ndim_line}), got a {len(shape)}-D array of shape {tuple(shape)}")
    if len(shape) < p.shape_ndim:
        raise ArgumentError(f"argument '{p.name}': the step reads {p.name}.shape[{p.shape_ndim - 1}] "
                            f"({filename}:{p.shape_line}), got a {len(shape)}-D array of shape {tuple(shape)}")
    if p.max_ndim and len(shape) > p.max_ndim:
        raise ArgumentError(f"argument '{p.name}': the step indexes it with {p.max_ndim} "
                            f"ind{'ex' if p.max_ndim == 1 else 'ices'} ({filename}:{p.max_ndim_line}), an element of "
                            f"a {p.max_ndim}-D array, got a {len(shape)}-D array of shape {tuple(shape)}")


def check_kind(p, is_array: bool, got: str):
    """ArgumentError if an array parameter got a number or a number parameter got an array."""
    if p.kind == ARRAY and not is_array:
        raise ArgumentError(f"argument '{p.name}': the step indexes it as an array, got {got}")
    if p.kind == SCALAR and is_array:
        raise ArgumentError(f"argument '{p.name}': the step uses it as a number, got {got}")


def check_integer(p, dtype, got: str, filename: str):
    """ArgumentError if the step takes ``p``'s value as an integer (a loop bound, an
    ``lk.random`` key) and it is a float (``dtype``; ``got`` says what was passed): a range
    would run to some integer near it, differently on each backend, and a key would be
    truncated; or if the step indexes an array with it and it is a float or a bool."""
    kind = np.dtype(dtype).kind
    if p.integer_line and kind in "fc":
        raise ArgumentError(f"argument '{p.name}': the step uses it as an integer ({filename}:{p.integer_line}: a "
                            f"loop bound or an lk.random key), got {got}; pass an int (e.g. int({p.name}) or "
                            f"round({p.name})), or convert it inside the step with int(...)")
    if p.index_line and kind in "fcb":
        raise ArgumentError(f"argument '{p.name}': the step indexes an array with it ({filename}:{p.index_line}), "
                            f"got {got}; pass an int (e.g. int({p.name})), or convert it inside the step with "
                            f"int(...)")


def check_atomic_dtype(p, dtype):
    """ArgumentError if the step updates ``p`` with ``lk.atomic`` and ``dtype`` has no atomics."""
    if p.atomic and str(dtype) not in ATOMIC_DTYPES:
        raise ArgumentError(f"argument '{p.name}': the step updates it with lk.atomic.add/max/min, which support "
                            f"arrays of {', '.join(ATOMIC_DTYPES[:-1])} and {ATOMIC_DTYPES[-1]}; got dtype {dtype}")


def check_writable(p, a, swapped: bool):
    """ArgumentError if ``a`` is read-only but the kernel writes it: the step writes into it
    (``lk.atomic`` updates included) or it is a swap buffer, which the kernel always writes, since
    the pair's contents are exchanged (even if the step itself only writes the other one)."""
    if not a.readonly or not (p.written or swapped):
        return
    why = ("the step updates it with lk.atomic" if p.atomic else "the step writes into it" if p.written else
           "it is a swap buffer, which the kernel always writes (the two buffers of a pair exchange contents)")
    what = ("the NumPy array is read-only (flags.writeable is False)" if a.where == "host" else
            "the GPU array is read-only (its __cuda_array_interface__ says so)")
    raise ArgumentError(f"argument '{p.name}': {what}, but {why}; pass a writable array"
                        + (f", e.g. {p.name}.copy()" if a.where == "host" else ""))


def check_distinct_elements(p, a, swapped: bool):
    """ArgumentError if the kernel writes ``a`` and two of its elements share memory (a stride
    of 0 or interleaved strides, from ``as_strided``): threads writing different elements would
    race on one address, and the result would depend on their timing."""
    from .args import self_overlapping
    if (p.written or swapped) and a.size > 1 and self_overlapping(a):
        raise ArgumentError(f"argument '{p.name}': elements of this array share memory (strides {a.strides} "
                            f"for shape {a.shape}, {a.dtype.itemsize}-byte elements), and the step writes it, so "
                            f"threads writing different elements would race on one address; pass an array of its "
                            f"own, e.g. np.ascontiguousarray({p.name})")


def check_swap_pair(names, shape_a, dtype_a, shape_b, dtype_b):
    """ArgumentError unless the two arrays of a swap pair have the same shape and dtype."""
    if tuple(shape_a) != tuple(shape_b) or dtype_a != dtype_b:
        raise ArgumentError(f"swap pair {names}: arrays must have the same shape and dtype, got "
                            f"{tuple(shape_a)} {dtype_a} and {tuple(shape_b)} {dtype_b}")


def describe_array(value, numba_type) -> str:
    """An array's dtype, dimensions and layout in NumPy's words (for messages that would
    otherwise show a Numba type such as ``array(float32, 1d, A)``)."""
    ndim = getattr(numba_type, "ndim", None)
    layout = getattr(numba_type, "layout", None)
    if ndim is None or layout is None:
        return str(numba_type)
    if layout == "C":
        where = "C-contiguous"
    elif layout == "F":
        where = "Fortran-contiguous (column-major)"
    else:
        strides = getattr(value, "strides", None)
        where = "non-contiguous" + (f" (strides {tuple(strides)})" if strides is not None else "")
    readonly = "" if getattr(numba_type, "mutable", True) else ", read-only"
    return f"{getattr(value, 'dtype', numba_type.dtype)}, {ndim}-D, {where}{readonly}"


def check_thread_scope(spec, scope):
    """ArgumentError for scope='thread' on a step that shares work between threads, and for a
    scope of many threads on a step that does not (every thread would run all of it: its
    updates are unchecked because one thread makes them)."""
    if scope == "thread" and spec.parallel:
        raise ArgumentError(f"scope='thread' runs one thread with no barrier, but step '{spec.name}' uses "
                            f"parallel loops, lk.thread_id/num_threads, lk.sync or reductions; use scope='grid', "
                            f"'block' or 'auto'")
    if scope in ("grid", "block", "tile", "cluster") and not spec.parallel:
        raise ArgumentError(f"scope='{scope}': step '{spec.name}' has no parallel construct (lk.range, lk.grid, "
                            f"lk.thread_id/num_threads, lk.sync or a reduction), so it is sequential code that one "
                            f"thread runs; with scope='{scope}' every thread would run all of it. Use scope='auto' "
                            f"or 'thread', or share its work with lk.range")


def check_seed(seed) -> int:
    """The ``seed=`` argument as an int in [0, 2**64), or an ArgumentError."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2 ** 64:
        raise ArgumentError(f"seed={seed!r}: expected an integer from 0 to 2**64 - 1")
    return int(seed)


def check_seconds(name, value, allow_none=True):
    """A positive number of seconds (or None), or an ArgumentError."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0 or value != value:
        raise ArgumentError(f"{name}={value!r}: expected a positive number of seconds"
                            + (" or None" if allow_none else ""))
    return float(value)


def check_start(start) -> int:
    """The ``start=`` argument (the first step index) as an int in [0, 2**62), or an ArgumentError."""
    if isinstance(start, bool) or not isinstance(start, numbers.Integral) or not 0 <= int(start) < 2 ** 62:
        raise ArgumentError(f"start={start!r}: expected the first step index, an integer from 0 to 2**62 - 1 "
                            f"(e.g. the previous run's run.next_start)")
    return int(start)


def check_choice(name, value, allowed):
    if value not in allowed:
        raise ArgumentError(f"{name}={value!r}: expected one of {', '.join(repr(a) for a in allowed)}")
    return value


def check_count(name, value, allow_none=True, minimum=0, maximum=None):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{name}={value!r}: expected an integer")
    if int(value) < minimum:
        raise ArgumentError(f"{name}={value!r}: must be >= {minimum}")
    if maximum is not None and int(value) > maximum:
        raise ArgumentError(f"{name}={value!r}: must be at most {maximum} (the kernel counts steps in int64; "
                            f"sys.maxsize runs until a condition, a timeout or a cancel stops it)")
    return int(value)
