"""Bounds checks for ``debug=True`` kernels, the same on the CPU, the GPU and the simulator.

Generated debug kernels index arrays through ``checked(a, idx, ...)`` (loads) and guard stores
with ``in_bounds(a, idx, ...)``. An index outside ``a.shape`` (Python semantics: ``-n <= i < n``)
is never used: a load reads element 0 instead, a store is skipped, and the first offence is
recorded in the ``dbg`` buffer (int64[DBG_SIZE], slots named in ``layout``: the flag, step,
thread, site, number of indices, the index and the array's shape).

The kernel's leader sees the flag at a step boundary and stops every thread there.
"""

import numpy as np

from .layout import DBG_INDEX, DBG_NDIM, DBG_SHAPE, DBG_SITE, DBG_SIZE, DBG_STEP, DBG_THREAD, MAX_DIMS  # noqa: F401


def build_python(claim):
    """Plain-Python ``checked`` and ``in_bounds`` (the simulator runs them as they are);
    ``claim(dbg)`` returns True for the one thread that records the first offence."""
    def _bad(a, idx):
        ix = idx if isinstance(idx, tuple) else (idx,)
        for k, i in enumerate(ix):
            if isinstance(i, (int, np.integer)) and k < a.ndim and not -a.shape[k] <= i < a.shape[k]:
                return True
        return False

    def _record(a, idx, dbg, site, t, tid):
        if claim(dbg):
            ix = idx if isinstance(idx, tuple) else (idx,)
            dbg[DBG_STEP], dbg[DBG_THREAD], dbg[DBG_SITE], dbg[DBG_NDIM] = t, tid, site, min(len(ix), MAX_DIMS)
            for k in range(min(len(ix), MAX_DIMS)):
                dbg[DBG_INDEX + k] = int(ix[k]) if isinstance(ix[k], (int, np.integer)) else 0
                dbg[DBG_SHAPE + k] = a.shape[k] if k < a.ndim else 0

    def checked(a, idx, dbg, site, t, tid):
        if not _bad(a, idx):
            return idx
        _record(a, idx, dbg, site, t, tid)
        if isinstance(idx, tuple):
            return tuple(0 if isinstance(i, (int, np.integer)) else i for i in idx)
        return 0

    def in_bounds(a, idx, dbg, site, t, tid):
        if not _bad(a, idx):
            return True
        _record(a, idx, dbg, site, t, tid)
        return False
    return checked, in_bounds


def build_numba(overload, target, claim):
    """``checked`` and ``in_bounds`` as Numba overloads for ``target`` ("cpu" or "cuda").

    ``claim`` is a compiled ``claim(dbg) -> bool``.
    Each overload is generated for the index's type (an integer or a tuple of indices).
    """
    from numba import types

    def checked(a, idx, dbg, site, t, tid):
        raise NotImplementedError("only callable from a loopkern kernel")

    def in_bounds(a, idx, dbg, site, t, tid):
        raise NotImplementedError("only callable from a loopkern kernel")

    def _source(idx, want_index, ndim):
        is_tuple = isinstance(idx, types.BaseTuple)
        kinds = list(idx.types) if is_tuple else [idx]
        items = [f"idx[{k}]" for k in range(len(kinds))] if is_tuple else ["idx"]
        # dimensions past a.ndim are left to Numba, which rejects them when it compiles
        checks = [k for k, ty in enumerate(kinds) if isinstance(ty, types.Integer) and k < ndim]
        lines = ["def impl(a, idx, dbg, site, t, tid):", "    ok = True"]
        for k in checks:
            lines.append(f"    if not (-a.shape[{k}] <= {items[k]} < a.shape[{k}]):")
            lines.append("        ok = False")
        ok_value = "idx" if want_index else "True"
        lines += ["    if ok:", f"        return {ok_value}", "    if claim(dbg):",
                  f"        dbg[{DBG_STEP}] = t", f"        dbg[{DBG_THREAD}] = tid", f"        dbg[{DBG_SITE}] = site",
                  f"        dbg[{DBG_NDIM}] = {min(len(kinds), MAX_DIMS)}"]
        for k in range(min(len(kinds), MAX_DIMS)):
            value = items[k] if k in checks else "0"
            lines.append(f"        dbg[{DBG_INDEX + k}] = {value}")
            lines.append(f"        dbg[{DBG_SHAPE + k}] = {f'a.shape[{k}]' if k < ndim else '0'}")
        if not want_index:
            lines.append("    return False")
        elif is_tuple:
            zero = [f"{items[k]} - {items[k]}" if k in checks else items[k] for k in range(len(kinds))]
            lines.append(f"    return ({', '.join(zero)},)")
        else:
            lines.append("    return idx - idx")
        return "\n".join(lines)

    def _make(want_index):
        def typer(a, idx, dbg, site, t, tid):
            if not isinstance(a, types.Array):
                return (lambda a, idx, dbg, site, t, tid: idx) if want_index else (
                    lambda a, idx, dbg, site, t, tid: True)
            env = {"claim": claim}
            exec(compile(_source(idx, want_index, a.ndim), "<loopkern bounds check>", "exec"), env)
            return env["impl"]
        return typer

    overload(checked, target=target)(_make(True))
    overload(in_bounds, target=target)(_make(False))
    return checked, in_bounds
