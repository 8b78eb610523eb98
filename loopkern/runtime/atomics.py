"""``lk.atomic.add/max/min(a, index, value)``: the runtime functions generated kernels call.

Each updates ``a[index]`` and returns the element's old value; the value is cast to the
array's dtype first (as ``a[index] = value`` would), and a negative index counts from the end
(Numba's wraparound, the same on every backend). The CUDA backend uses the GPU's atomic
instructions (``cuda.atomic.*``; Numba's simulator has its own), the CPU backend a plain
read-modify-write, since one thread runs the whole step there.

``debug=True`` kernels call the ``*_checked`` variants, which take the bounds-check context
of :mod:`loopkern.runtime.bounds`: an index outside the array is never used (the update is
skipped and returns 0) and is recorded like an out-of-bounds store.
"""

from ..dsl import ATOMIC_DTYPES as SUPPORTED   # the GPU's atomics; the CPU accepts the same

OPS = ("add", "max", "min")


def _unsupported(op, dtype):
    from numba.core.errors import TypingError
    return TypingError(f"lk.atomic.{op}() updates arrays of {', '.join(SUPPORTED)}; got an array of {dtype}")


def build_numba(overload, target, rmw_source, env, in_bounds):
    """The ``atomic_<op>`` and ``atomic_<op>_checked`` functions as Numba overloads for
    ``target`` ("cpu" or "cuda"), each generated for the array's dtype.

    Args:
        overload: ``numba.extending.overload`` or ``numba.cuda.extending.overload``.
        target: the overloads' target.
        rmw_source: ``op -> source`` of an expression that updates ``a[idx]`` with ``w`` (the
            value, already cast to the array's dtype) and returns the old value.
        env: the names ``rmw_source`` uses.
        in_bounds: the target's bounds check (see :mod:`loopkern.runtime.bounds`).

    Returns:
        A dict of the functions, by name.
    """
    from numba import types

    def impl_for(op, a, want_check):
        if not isinstance(a, types.Array):
            return None
        if str(a.dtype) not in SUPPORTED:
            raise _unsupported(op, a.dtype)
        # the dtype is a global of the generated function: calling a Numba type casts
        scope = dict(env, _lk_dtype=a.dtype, in_bounds=in_bounds)
        if want_check:
            src = (f"def impl(a, idx, v, dbg, site, t, tid):\n"
                   f"    if in_bounds(a, idx, dbg, site, t, tid):\n"
                   f"        w = _lk_dtype(v)\n"
                   f"        return {rmw_source(op)}\n"
                   f"    return _lk_dtype(0)\n")
        else:
            src = f"def impl(a, idx, v):\n    w = _lk_dtype(v)\n    return {rmw_source(op)}\n"
        exec(compile(src, f"<loopkern lk.atomic.{op}>", "exec"), scope)
        return scope["impl"]

    def make(op):
        def plain(a, idx, v):
            raise NotImplementedError("only callable from a loopkern kernel")

        def checked(a, idx, v, dbg, site, t, tid):
            raise NotImplementedError("only callable from a loopkern kernel")

        def plain_typer(a, idx, v):
            return impl_for(op, a, False)

        def checked_typer(a, idx, v, dbg, site, t, tid):
            return impl_for(op, a, True)
        overload(plain, target=target)(plain_typer)
        overload(checked, target=target)(checked_typer)
        return plain, checked

    out = {}
    for op in OPS:
        out[f"atomic_{op}"], out[f"atomic_{op}_checked"] = make(op)
    return out


def build_python(rmw, in_bounds):
    """Plain-Python ``atomic_<op>`` and ``atomic_<op>_checked`` for Numba's CUDA simulator.

    Args:
        rmw: ``op -> f(a, idx, v)`` that updates ``a[idx]`` atomically and returns the old value.
        in_bounds: the simulator's bounds check.
    """
    import numpy as np

    out = {}
    for op in OPS:
        def plain(a, idx, v, op=op):
            dtype = np.dtype(a.dtype)
            if dtype.name not in SUPPORTED:
                raise TypeError(f"lk.atomic.{op}() updates arrays of {', '.join(SUPPORTED)}; got an array of "
                                f"{dtype}")
            # through an array: a value the dtype cannot hold wraps (as on the GPU) instead of raising
            return rmw[op](a, idx, np.asarray(v).astype(dtype)[()])

        def checked(a, idx, v, dbg, site, t, tid, plain=plain):
            if in_bounds(a, idx, dbg, site, t, tid):
                return plain(a, idx, v)
            return np.dtype(a.dtype).type(0)
        out[f"atomic_{op}"] = plain
        out[f"atomic_{op}_checked"] = checked
    return out
