"""CPU-backend runtime: one thread covers the whole grid, so a reduction is its own value and an
``lk.atomic`` update a plain read-modify-write."""

import math

import numba
import numpy as np
from numba import types
from numba.extending import overload

from .layout import BOUNDS, DBG_FLAG, DONE, REQUEST, STEPS, WHY
from .philox import build


def _reduce_value(x):
    """A reduction over one thread: floats keep their type, integers and bools become int64."""
    return x


@overload(_reduce_value)
def _reduce_value_impl(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if isinstance(x, (types.Integer, types.Boolean)):
        return lambda x: np.int64(x)
    return None


def _reduce_extreme(x):
    """``lk.max``/``lk.min`` over one thread: as ``_reduce_value``, but a uint64 stays uint64
    (as int64, values from 2**63 on would be negative and order below the others)."""
    return x


@overload(_reduce_extreme)
def _reduce_extreme_impl(x):
    if isinstance(x, types.Integer) and not x.signed and x.bitwidth == 64:
        return lambda x: x
    return _reduce_value_impl(x)


reduce_sum = _reduce_value
reduce_max = reduce_min = _reduce_extreme

_, random_uniform, random_normal = build(numba.njit)


# -- run control (the control block's layout is in layout.py) ---------------------------------
# One thread runs every step, so the kernel publishes its step count and reads the host's
# request at every step; a timeout (and, for a run in the calling thread, a pause) arrives as a
# request from the host.
from numba.extending import intrinsic  # noqa: E402

from .lowering import element_ptr  # noqa: E402


@intrinsic
def _load_relaxed(typingctx, arr, idx):
    """An atomic (monotonic) load of ``arr[idx]`` (int64): the compiler may not hoist it out of
    the step loop, so a write by another thread is seen."""
    sig = types.int64(arr, idx)

    def codegen(context, builder, sig, args):
        ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.load_atomic(ptr, "monotonic", 8)
    return sig, codegen


@intrinsic
def _store_relaxed(typingctx, arr, idx, val):
    """An atomic (monotonic) store of ``val`` into ``arr[idx]`` (int64)."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, sig, args):
        ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), ptr, "monotonic", 8)
        return context.get_dummy_value()
    return sig, codegen


@numba.njit
def poll(t, host, last, publish, deadline, code):
    """Publish the steps done before step ``t``; the host's request is the decision (the GPU
    leader's other state is unused here)."""
    _store_relaxed(host, STEPS, t)
    return _load_relaxed(host, REQUEST), last, publish, deadline


@numba.njit
def poll_debug(t, host, last, publish, deadline, code, dbg):
    code, last, publish, deadline = poll(t, host, last, publish, deadline, code)
    return (BOUNDS if dbg[DBG_FLAG] != 0 else code), last, publish, deadline


@numba.njit
def finish(host, t, why):
    _store_relaxed(host, STEPS, t)
    _store_relaxed(host, WHY, why)
    _store_relaxed(host, DONE, 1)


@numba.njit
def _claim(dbg):
    if dbg[DBG_FLAG] != 0:
        return False
    dbg[DBG_FLAG] = 1
    return True


from . import bounds as _bounds  # noqa: E402

checked, in_bounds = _bounds.build_numba(overload, "cpu", _claim)


# -- lk.atomic: one thread runs the whole step, so a plain read-modify-write is atomic ---------
@numba.njit
def _rmw_add(a, idx, v):
    old = a[idx]
    a[idx] = old + v
    return old


@numba.njit
def _rmw_max(a, idx, v):
    old = a[idx]
    if v > old:
        a[idx] = v
    return old


@numba.njit
def _rmw_min(a, idx, v):
    old = a[idx]
    if v < old:
        a[idx] = v
    return old


from . import atomics as _atomics  # noqa: E402

_ATOMIC = _atomics.build_numba(overload, "cpu", lambda op: f"_rmw_{op}(a, idx, w)",
                               dict(_rmw_add=_rmw_add, _rmw_max=_rmw_max, _rmw_min=_rmw_min), in_bounds)
atomic_add, atomic_max, atomic_min = _ATOMIC["atomic_add"], _ATOMIC["atomic_max"], _ATOMIC["atomic_min"]
atomic_add_checked, atomic_max_checked, atomic_min_checked = (
    _ATOMIC["atomic_add_checked"], _ATOMIC["atomic_max_checked"], _ATOMIC["atomic_min_checked"])


# -- x ** n: a float to a negative integer power of zero is an infinity, as on the GPU ---------
def power(x, n):
    """``x ** n`` as the GPU computes it (the CPU template's ``**`` outside ``debug=True``)."""
    return x ** n


@overload(power)
def _power_impl(x, n):
    if isinstance(x, types.Float) and isinstance(n, types.Integer) and n.signed:
        # Numba's float ** int raises ZeroDivisionError for 0.0 ** -n whatever the error model;
        # IEEE pow (the GPU, NumPy) gives +-inf: -inf for -0.0 to an odd power
        inf = np.dtype(str(x)).type(np.inf)

        def impl(x, n):
            if x == 0 and n < 0:
                return -inf if (n & 1) != 0 and math.copysign(1.0, x) < 0 else inf
            return x ** n
        return impl
    return lambda x, n: x ** n


# -- x << n, x >> n: a count outside 0..63, as NumPy and the simulator give it ---------------
from . import shifts as _shifts  # noqa: E402

lshift, rshift = _shifts.build_numba(overload, "cpu")
