"""``lk.fori_loop``, ``lk.while_loop`` and ``lk.scan``: JAX's loops, each compiled into one
megakernel.

The body is traced to a jaxpr on abstract values of the carry (``trace.py``), lowered to the
source of a restricted-Python step (``lower.py``), and built into a :class:`~loopkern.MegaKernel`
(cached by that source: a second call with the same body, shapes and dtypes traces again,
which takes milliseconds, and reuses the kernel). The kernel runs through ``kernel.jax``, so
the loop works eagerly and inside ``jax.jit``, with traced bounds.

A body outside the supported subset runs as the corresponding ``jax.lax`` loop, with one
warning naming the first unsupported primitive and its source line (``fallback="error"``
raises :class:`~loopkern.StepSyntaxError` instead). Derivatives (``jax.jvp``, ``jax.grad``) are routed
through the ``jax.lax`` loop: they are exactly lax's (and so is what lax does not support,
e.g. reverse mode through a ``while_loop``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import linecache
import math
import threading
import warnings

import numpy as np

from ..errors import ArgumentError, Diagnostic, LoopkernError, StepSyntaxError
from .lower import HELPERS, Lowering
from .trace import Lit, Unsupported, flatten

__all__ = ["fori_loop", "while_loop", "scan", "JaxLoopWarning", "DEFAULT_CHUNK"]

#: steps per launch of a while_loop's kernel; the loop itself is unbounded (see while_loop)
DEFAULT_CHUNK = 2 ** 31 - 1
_FALLBACKS = ("warn", "error", "silent")


class JaxLoopWarning(UserWarning):
    """A loop body ran as the jax.lax loop because it is outside the compiled subset."""


_kernels: dict = {}
_lock = threading.Lock()
# how deep this thread is inside the tracing of an lk loop's body (or its lax fallback): an lk
# loop called there is a plain lax loop, which the enclosing loop lowers as a nested loop (or
# its fallback runs), instead of a kernel call of its own (lowered, it would reach the outer
# body as a callback it cannot compile, and warn again each time its body is traced)
_body = threading.local()


class _AsLax:
    def __enter__(self):
        _body.depth = getattr(_body, "depth", 0) + 1

    def __exit__(self, *exc):
        _body.depth -= 1


def _in_body() -> bool:
    return getattr(_body, "depth", 0) > 0
_last_source = ""       # the step source of the latest loop (for tests and debugging)
split_rejected = 0      # split steps (lower.Lowering.split_loop) loopkern's checks refused


def _kernel(plan):
    """The MegaKernel of a generated step (cached by its source). A step with split loops
    (lower.Lowering.split_loop) is used only when its plain form is not a stencil: tile mode
    keeps a stencil on chip, and needs every parallel loop over one index space."""
    global _last_source, split_rejected
    _last_source = plan.source
    key = (plan.source, tuple(plan.swap))
    mk = _kernels.get(key)
    if mk is None:
        with _lock:
            mk = _kernels.get(key)
            if mk is None:
                if plan.plain_source is None:
                    mk = _make_kernel(plan.source, plan)
                else:
                    from ..stencil import Stencil, find_stencil
                    mk = plain = _make_kernel(plan.plain_source, plan)
                    if not isinstance(find_stencil(plain.spec), Stencil):
                        try:
                            mk = _make_kernel(plan.source, plan)
                        except GeneratedStepRejected:
                            # the split form is only faster: where loopkern's own checks cannot
                            # prove it race-free the plain step runs (counted for the tests)
                            split_rejected += 1
                _kernels[key] = _kernels[(mk.step_source, key[1])] = mk
    _last_source = mk.step_source
    return mk


def _make_kernel(step_source, plan):
    from ..api import MegaKernel
    from ..frontend import parse_step
    source = "import math\nimport numpy as np\nimport loopkern as lk\n" + HELPERS + "\n\n" + step_source
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    filename = f"<loopkern-jaxloops-{digest}>"
    lines = source.splitlines(True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace = {"__name__": f"loopkern_jaxloops_{digest}"}
    exec(compile(source, filename, "exec"), namespace)
    # (uniform_loads: a carry's element read in a condition is the same on every thread; the
    # arrays of a drop-in loop's step never share memory)
    parsed = dataclasses.replace(parse_step(namespace[plan.name]), uniform_loads=True)
    try:
        mk = MegaKernel(parsed, swap=plan.swap)
    except LoopkernError as exc:
        raise GeneratedStepRejected(exc) from exc
    mk.step_source = step_source
    return mk


def _check_fallback(fallback):
    if fallback not in _FALLBACKS:
        raise ArgumentError(f"fallback={fallback!r}: expected one of {', '.join(map(repr, _FALLBACKS))}")


class GeneratedStepRejected(Unsupported):
    """loopkern's own validation rejected the step it generated from a body: a loopkern bug. With
    fallback="warn" the jax.lax loop runs (with a warning saying so); with fallback="error" the
    validation error itself is raised."""

    def __init__(self, error):
        self.error = error
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__("the generated step", "<loopkern>", f"loopkern rejected the step it generated from this body, "
                                                            f"a loopkern bug; please report it: {first}")


def _fallback(name, fallback, exc: Unsupported, fn=None):
    """Warn (or raise, for fallback="error") about a body outside the subset."""
    if fallback == "error" and isinstance(exc, GeneratedStepRejected):
        raise exc.error
    reason = f" ({exc.reason})" if exc.reason else ""
    w = exc.where           # a Where, or a string where there is no source line
    file, line, col = getattr(w, "file", "<unknown>"), getattr(w, "line", 0), getattr(w, "col", 0)
    if fallback == "error":
        text = linecache.getline(file, line) if line else ""
        step = getattr(fn, "__name__", name)
        raise StepSyntaxError([Diagnostic(file, line, col + 1, step,
                                          f"lk.{name}: '{exc.prim}'{reason} is outside the subset that loopkern "
                                          f"compiles", f"use jax.lax.{name}, or fallback='warn' to run it "
                                          f"automatically", text)]) from None
    if fallback == "warn":
        # (columns counted from 1, as in the StepSyntaxError above)
        where = f"{file}:{line}:{col + 1} ({w.function})" if line else str(w)
        warnings.warn(f"lk.{name}: '{exc.prim}'{reason} at {where} is outside what loopkern compiles yet (in the "
                      f"body or the condition); running jax.lax.{name} instead", JaxLoopWarning, stacklevel=3)


def _aval(x):
    import jax
    a = jax.typeof(x)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=bool(getattr(a, "weak_type", False)))


def _as_type(x, aval):
    """``x`` with the dtype and weak type of ``aval`` (as the lax loop returns it)."""
    import jax.numpy as jnp
    x = jnp.asarray(x)
    if x.dtype != aval.dtype:
        x = x.astype(aval.dtype)
    if x.shape != aval.shape:
        x = x.reshape(aval.shape)
    if getattr(aval, "weak_type", False) and not getattr(x, "weak_type", False):
        try:
            from jax._src.lax.lax import _convert_element_type
            x = _convert_element_type(x, aval.dtype, weak_type=True)
        except Exception:   # pragma: no cover - a JAX without it: strong type
            pass
    elif not getattr(aval, "weak_type", False) and getattr(x, "weak_type", False):
        from jax import lax
        x = lax.convert_element_type(x, aval.dtype)
    return x


def _concrete_int(x):
    """A Python int for a concrete integer (int, NumPy or non-traced 0-d JAX integer), else None."""
    import jax
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.ndim == 0 \
            and np.issubdtype(x.dtype, np.integer):
        return int(x)
    return None


def _any_size_zero(avals):
    return any(math.prod(a.shape) == 0 for a in avals)


def _const_args(prog):
    return [val for _, val in prog.consts]


def _key_impls(leaves) -> list:
    """Per leaf: the jax.random implementation of a PRNG key array, else None. The kernel
    carries a key as its uint32 words (``jax.random.key_data``); the body sees keys."""
    import jax
    return [jax.random.key_impl(x) if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
            else None for x in leaves]


def _as_key_data(leaves, impls) -> list:
    """The leaves with each key array (``impls[k]`` not None) as its uint32 words."""
    import jax
    return [jax.random.key_data(x) if impl is not None else x for x, impl in zip(leaves, impls)]


def _as_keys(leaves, impls) -> list:
    """The inverse of :func:`_as_key_data`."""
    import jax
    return [jax.random.wrap_key_data(x, impl=impl) if impl is not None else x for x, impl in zip(leaves, impls)]


def _same_keys(out_leaves, impls) -> bool:
    """Whether the body's results are keys (of the same implementation) exactly where its carry is."""
    return [str(i) if i is not None else None for i in _key_impls(out_leaves)] == \
        [str(i) if i is not None else None for i in impls]


def _scalar_const(val):
    """A 0-d constant as kernel.jax takes it: a NumPy scalar if concrete, else the (traced) array."""
    import jax
    if isinstance(val, jax.core.Tracer):
        return val
    return np.asarray(val)[()]


def _launch(plan, mk, leaves, consts, *, steps=None, max_steps=None, lo=0, xs=(), ys_avals=(), length=0):
    """Run the kernel of ``plan`` through kernel.jax; returns (new leaves, ys, steps done or None)."""
    import jax
    import jax.numpy as jnp
    args, arr_roles = [], []
    for name, role, k in plan.params:
        if role in ("carry", "carry_next"):
            v = jnp.asarray(leaves[k])
            args.append(v.reshape(1) if v.ndim == 0 else v)
            arr_roles.append((role, k))
        elif role == "count":
            args.append(jnp.asarray(leaves[k]))
        elif role == "x":
            args.append(xs[k])
            arr_roles.append((role, k))
        elif role == "y":
            a = ys_avals[k]
            args.append(jnp.zeros((length,) + tuple(a.shape), a.dtype))
            arr_roles.append((role, k))
        elif role == "const":
            c = consts[k]
            if _key_impls([c])[0] is not None:      # a closed-over PRNG key: its words
                c = jax.random.key_data(c)
            args.append(jnp.asarray(c))
            arr_roles.append((role, k))
        elif role == "const_scalar":
            args.append(_scalar_const(consts[k]))
        elif role == "lo":
            args.append(lo)
        elif role == "scratch":     # a scatter's buffer: every element is written before it is read
            shape, dtype = k
            args.append(jnp.empty(shape, dtype))
            arr_roles.append((role, None))
        else:   # pragma: no cover
            raise AssertionError(role)
    if plan.returns_condition:
        outs = mk.jax(*args, max_steps=max_steps)
        done, outs = outs[-1], outs[:-1]
    else:
        outs = mk.jax(*args, steps=steps)
        done = None
    new = list(leaves)
    ys = {}
    for (role, k), o in zip(arr_roles, outs):
        if role == "carry" and plan.carries[k].kind in ("pair", "inplace"):
            new[k] = o.reshape(()) if jnp.ndim(leaves[k]) == 0 else o
        elif role == "y":
            ys[k] = o
    return new, ys, done


def _counted(plan, leaves, new, n):
    """The integer counter carries ("count": k0 + c per step) after ``n`` steps."""
    import jax.numpy as jnp
    out = list(new)
    for k, p in enumerate(plan.carries):
        if p.kind == "count":
            x = jnp.asarray(leaves[k])
            # (the increment in the carry's type, modulo its range: -1 of a uint32 is 2**32 - 1)
            out[k] = x + jnp.asarray(np.asarray(p.step, np.int64).astype(x.dtype)) * jnp.asarray(n).astype(x.dtype)
    return out


def _lower(prog, roles, out_roles, carry_idx, cond_atom=None, ys_idx=(), xs_idx=(), length=None, reverse=False):
    carry_in = {k: prog.invars[i] for k, i in carry_idx.items()}
    carry_out = {k: prog.outs[j] for k, j in out_roles.items()}
    xs_in = {k: prog.invars[i] for k, i in xs_idx}
    ys_out = {k: prog.outs[j] for k, j in ys_idx}
    L = Lowering(prog, roles, [], scan_length=length, reverse=reverse)
    return L.build(carry_in, carry_out, xs_in, ys_out, cond_atom, prog.consts)


def _same_types(init_avals, out_avals):
    return all(tuple(a.shape) == tuple(o.shape) and a.dtype == o.dtype
               for a, o in zip(init_avals, out_avals))


def _trace_body(step, avals, lead=(), tail=()):
    """(the closed jaxpr of ``step(*lead, *carry, *tail)``, the carry's avals, the carry's avals
    as the body returns them), or None when lax should run the loop (and say what is wrong):
    the body changes the carry's pytree, shapes or dtypes. As in lax, a weakly typed carry
    stays weak inside the body when its output is strongly typed (lax compares the two with
    ``core.typematch``, which ignores weak types, and traces once), and the loop returns the
    output's weak types."""
    import jax
    try:
        with _AsLax():
            closed = jax.make_jaxpr(step)(*lead, *avals, *tail)
        out_avals = closed.out_avals[:len(avals)]
        if not _same_types(avals, out_avals):
            return None
        return closed, avals, out_avals
    except _TreeMismatch:
        return None


# ==================================================================================== fori_loop
def fori_loop(lower, upper, body_fun, init_val, *, unroll=None, fallback="warn"):
    """``jax.lax.fori_loop`` compiled into one megakernel.

    Same signature and result as ``jax.lax.fori_loop(lower, upper, body_fun, init_val)``
    (the result's pytree, dtypes and weak types), eagerly or inside ``jax.jit``; ``lower`` and
    ``upper`` may be traced. ``body_fun(i, carry)`` is traced once on abstract values of the
    carry and lowered to a megakernel step (the supported operations are listed in the
    README's "Drop-in JAX loops"). Derivatives (``jax.jvp``, ``jax.grad``) run through
    ``jax.lax.fori_loop``.

    Args:
        lower: the first loop index (int or 0-d integer array, traced values too).
        upper: the loop stops before this index.
        body_fun: ``body_fun(i, carry) -> carry`` with the same pytree, shapes and dtypes.
        init_val: the initial carry (a pytree of arrays and numbers).
        unroll: accepted for compatibility with ``jax.lax.fori_loop``; ignored.
        fallback: what to do with a body outside the supported subset: "warn" (run
            ``jax.lax.fori_loop`` with one :class:`JaxLoopWarning` naming the first unsupported
            primitive and its source line), "error" (raise :class:`~loopkern.StepSyntaxError` pointing at its line) or "silent".

    Returns:
        The final carry, as ``jax.lax.fori_loop`` returns it.

    Raises:
        StepSyntaxError: with ``fallback="error"``, for a body outside the subset.
        ArgumentError: a bad ``fallback``.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    _check_fallback(fallback)
    if _in_body():
        return lax.fori_loop(lower, upper, body_fun, init_val)
    leaves, tree = jax.tree_util.tree_flatten(init_val)
    impls = _key_impls(leaves)
    leaves = _as_key_data(leaves, impls)
    lo_c, hi_c = _concrete_int(lower), _concrete_int(upper)

    def lax_loop(lo, hi, init):
        with _AsLax():
            return lax.fori_loop(lo, hi, body_fun, init)
    if lo_c is not None and hi_c is not None and hi_c <= lo_c:
        return lax_loop(lower, upper, init_val)
    index = _index_type(lower, upper, lo_c is not None and hi_c is not None)
    if index is None:
        return lax_loop(lower, upper, init_val)      # lax says what is wrong with the bounds
    idx_dtype = np.dtype(index.dtype)
    avals = [_aval(x) for x in leaves]
    if _any_size_zero(avals):
        return lax_loop(lower, upper, init_val)

    def step(i, *ls):
        out = body_fun(i, jax.tree_util.tree_unflatten(tree, _as_keys(ls, impls)))
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        if out_tree != tree or not _same_keys(out_leaves, impls):
            raise _TreeMismatch()
        return _as_key_data(out_leaves, impls)
    traced = _trace_body(step, avals, lead=(index,))
    if traced is None:
        return lax_loop(lower, upper, init_val)          # lax says what is wrong
    closed, avals, out_avals = traced
    n = len(leaves)
    roles = [("index",)] + [("carry", k) for k in range(n)]
    try:
        prog = flatten(closed)
        plan = _lower(prog, roles, {k: k for k in range(n)}, {k: k + 1 for k in range(n)})
        mk = _kernel(plan)
    except Unsupported as exc:
        _fallback("fori_loop", fallback, exc, body_fun)
        return lax_loop(lower, upper, init_val)
    consts = _const_args(prog)

    def run(consts, leaves, lo, hi):
        nsteps = _trip_count(lo, hi, idx_dtype) if lo_c is None or hi_c is None else max(hi_c - lo_c, 0)
        new, _, _ = _launch(plan, mk, leaves, consts, steps=nsteps, lo=jnp.asarray(lo, idx_dtype) if lo_c is None
                            else np.asarray(lo_c, idx_dtype)[()])
        return _counted(plan, leaves, new, nsteps)

    def lax_run(consts, leaves, lo, hi):
        def body(i, c):
            return tuple(jax.core.eval_jaxpr(closed.jaxpr, consts, i, *c))
        return list(lax.fori_loop(lo if lo_c is None else lo_c, hi if hi_c is None else hi_c, body, tuple(leaves)))

    out = _with_lax_derivatives(run, lax_run, consts, [jnp.asarray(x) if not isinstance(x, jax.Array) else x
                                                       for x in leaves],
                                lower if lo_c is None else lo_c, upper if hi_c is None else hi_c,
                                loop=("fori_loop", fallback, body_fun))
    out = [_as_type(o, a) for o, a in zip(out, out_avals)]
    return jax.tree_util.tree_unflatten(tree, _as_keys(out, impls))


def _weak(x) -> bool:
    import jax
    return bool(getattr(jax.typeof(x), "weak_type", False))


def _index_type(lower, upper, concrete: bool):
    """The aval of the loop index that ``jax.lax.fori_loop`` gives its body, or None where lax
    rejects the bounds. Concrete bounds (of any integer type) make lax scan with a Python int
    index: a weakly typed int of the default width. Otherwise the bounds' common type (equal
    types, or a weakly typed signed bound taking the other's), weak when ``lower`` is and
    needs no conversion."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    try:
        ld, ud = np.dtype(lax.dtype(lower)), np.dtype(lax.dtype(upper))
    except Exception:
        return None
    if np.ndim(lower) or np.ndim(upper):
        return None
    if concrete:
        # (lax checks the bounds' types before it looks at their values: int8 beside int32
        # is its TypeError either way)
        if ld != ud and not (ld.kind == "i" and ud.kind == "i" and _weak(lower) != _weak(upper)):
            return None
        return jax.ShapeDtypeStruct((), jnp.asarray(0).dtype, weak_type=True)
    if ld == ud:
        dtype = ld
    elif ld.kind == "i" and ud.kind == "i" and _weak(lower) != _weak(upper):
        dtype = ud if _weak(lower) else ld
    else:
        return None
    if dtype.kind not in "iu":
        return None
    return jax.ShapeDtypeStruct((), dtype, weak_type=_weak(lower) and ld == dtype)


def _trip_count(lo, hi, dtype):
    """``max(hi - lo, 0)`` for traced bounds of ``dtype``, without the wrap-around of the
    subtraction in that type (lax's loop counts from ``lo`` while below ``hi``): narrow types
    subtract in int32, 32- and 64-bit ones take the difference's bits as unsigned (exact
    whenever ``hi > lo``)."""
    import jax.numpy as jnp
    from jax import lax
    lo, hi = jnp.asarray(lo).astype(dtype), jnp.asarray(hi).astype(dtype)
    if dtype.itemsize < 4:
        diff = hi.astype(jnp.int32) - lo.astype(jnp.int32)
    else:
        diff = lax.bitcast_convert_type(hi - lo, np.dtype(f"uint{8 * dtype.itemsize}"))
    return jnp.where(hi > lo, diff, jnp.zeros((), diff.dtype))


class _TreeMismatch(Exception):
    pass


def _with_lax_derivatives(run, lax_run, consts, leaves, *bounds, loop: tuple):
    """``run(consts, leaves, *bounds)``, differentiated as ``lax_run`` (the jax.lax loop).

    ``loop``: (the lk function's name, its ``fallback``, the user's body). Should Numba fail
    to compile the step generated from the body (a loopkern bug: the step passed loopkern's
    own validation), the jax.lax loop runs instead, with a warning saying so, as for a step
    that validation rejects; ``fallback="error"`` raises the CompileError."""
    import jax

    from ..errors import CompileError

    @jax.custom_jvp
    def f(consts, leaves, *bounds):
        return run(consts, leaves, *bounds)

    @f.defjvp
    def f_jvp(primals, tangents):
        return jax.jvp(lambda c, l, *b: lax_run(c, l, *b), primals, tangents)

    try:
        return f(list(consts), list(leaves), *bounds)
    except CompileError as exc:
        name, fallback, fn = loop
        _fallback(name, fallback, GeneratedStepRejected(exc), fn)
        return lax_run(list(consts), list(leaves), *bounds)


# ==================================================================================== while_loop
def while_loop(cond_fun, body_fun, init_val, *, max_steps=DEFAULT_CHUNK, fallback="warn"):
    """``jax.lax.while_loop`` compiled into one megakernel; the condition is evaluated on the
    device after every step.

    Same signature and result as ``jax.lax.while_loop(cond_fun, body_fun, init_val)``: the
    condition is checked before every call of the body, so the body may run zero times, and the
    loop runs until the condition is false, however many steps that takes. ``max_steps`` is
    not a bound on the loop: it is the number of steps one launch of the kernel may run (the
    kernel's ``max_steps``); when a launch ends with the condition still true, another launch
    continues from there (a ``jax.lax.while_loop`` over launches, checking the condition once
    per launch). Derivatives run through ``jax.lax.while_loop`` (reverse mode is then refused by
    JAX, as for lax).

    Args:
        cond_fun: ``cond_fun(carry) -> bool scalar``.
        body_fun: ``body_fun(carry) -> carry`` with the same pytree, shapes and dtypes.
        init_val: the initial carry.
        max_steps: steps per kernel launch (an int >= 1; default 2**31 - 1).
        fallback: "warn", "error" or "silent", as for :func:`fori_loop`.

    Returns:
        The final carry, as ``jax.lax.while_loop`` returns it.

    Raises:
        StepSyntaxError: with ``fallback="error"``, for a body or condition outside the subset.
        ArgumentError: a bad ``fallback`` or ``max_steps``.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    _check_fallback(fallback)
    if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or not 1 <= max_steps < 2 ** 31:
        raise ArgumentError(f"max_steps={max_steps!r}: expected an int from 1 to 2**31 - 1 (steps per launch)")
    max_steps = int(max_steps)
    if _in_body():
        return lax.while_loop(cond_fun, body_fun, init_val)
    leaves, tree = jax.tree_util.tree_flatten(init_val)
    impls = _key_impls(leaves)
    leaves = _as_key_data(leaves, impls)

    def lax_loop():
        with _AsLax():
            return lax.while_loop(cond_fun, body_fun, init_val)
    avals = [_aval(x) for x in leaves]
    if _any_size_zero(avals):
        return lax_loop()

    def step(*ls):
        out = body_fun(jax.tree_util.tree_unflatten(tree, _as_keys(ls, impls)))
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        if out_tree != tree or not _same_keys(out_leaves, impls):
            raise _TreeMismatch()
        c = cond_fun(out)
        return _as_key_data(out_leaves, impls) + [c]

    def cond_only(*ls):
        return cond_fun(jax.tree_util.tree_unflatten(tree, _as_keys(ls, impls)))
    traced = _trace_body(step, avals)
    if traced is None:
        return lax_loop()
    closed, avals, out_avals = traced
    c_aval = closed.out_avals[-1]
    if c_aval.shape != () or np.dtype(c_aval.dtype) != np.bool_:
        return lax_loop()
    with _AsLax():
        cond_closed = jax.make_jaxpr(cond_only)(*avals)
    n = len(leaves)
    roles = [("carry", k) for k in range(n)]
    try:
        prog = flatten(closed)
        plan = _lower(prog, roles, {k: k for k in range(n)}, {k: k for k in range(n)}, cond_atom=prog.outs[-1])
        mk = _kernel(plan)
    except Unsupported as exc:
        _fallback("while_loop", fallback, exc, body_fun)
        return lax_loop()
    consts = _const_args(prog)
    cconsts = list(cond_closed.consts)

    def run(all_consts, leaves):
        bconsts, cc = all_consts[:len(consts)], all_consts[len(consts):]

        def cond(ls):
            return jax.core.eval_jaxpr(cond_closed.jaxpr, cc, *ls)[0]

        def chunk(ls):
            new, _, done = _launch(plan, mk, list(ls), bconsts, max_steps=max_steps)
            return tuple(_counted(plan, list(ls), new, done))
        return list(lax.while_loop(cond, chunk, tuple(leaves)))

    def lax_run(all_consts, leaves):
        bconsts, cc = all_consts[:len(consts)], all_consts[len(consts):]
        body_closed = closed

        def cond(ls):
            return jax.core.eval_jaxpr(cond_closed.jaxpr, cc, *ls)[0]

        def body(ls):
            return tuple(jax.core.eval_jaxpr(body_closed.jaxpr, bconsts, *ls)[:-1])
        return list(lax.while_loop(cond, body, tuple(leaves)))

    out = _with_lax_derivatives(run, lax_run, consts + cconsts,
                                [jnp.asarray(x) if not isinstance(x, jax.Array) else x for x in leaves],
                                loop=("while_loop", fallback, body_fun))
    out = [_as_type(o, a) for o, a in zip(out, out_avals)]
    return jax.tree_util.tree_unflatten(tree, _as_keys(out, impls))


# ==================================================================================== scan
def scan(f, init, xs=None, length=None, reverse=False, unroll=1, _split_transpose=False, *, fallback="warn"):
    """``jax.lax.scan`` compiled into one megakernel.

    Same signature and result as ``jax.lax.scan(f, init, xs, length, reverse)``: ``f(carry, x)
    -> (carry, y)``, ``x`` the slices of ``xs`` along its first axis (or None), the ``y``\\ s
    stacked into ``ys``, which the kernel writes at the scan position of each step. Derivatives
    run through ``jax.lax.scan``.

    Args:
        f: ``f(carry, x) -> (carry, y)``.
        init: the initial carry.
        xs: a pytree of arrays scanned along their first axis, or None.
        length: the number of steps (needed when ``xs`` is None; else it must match).
        reverse: scan from the end.
        unroll, _split_transpose: accepted for compatibility; ignored.
        fallback: "warn", "error" or "silent", as for :func:`fori_loop`.

    Returns:
        ``(final carry, ys)`` as ``jax.lax.scan`` returns them.

    Raises:
        StepSyntaxError: with ``fallback="error"``, for a body outside the subset.
        ArgumentError: a bad ``fallback``.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    _check_fallback(fallback)

    def lax_loop():
        with _AsLax():
            return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)
    if _in_body():
        return lax_loop()
    leaves, tree = jax.tree_util.tree_flatten(init)
    x_leaves, x_tree = jax.tree_util.tree_flatten(xs)
    impls, x_impls = _key_impls(leaves), _key_impls(x_leaves)
    leaves, x_leaves = _as_key_data(leaves, impls), _as_key_data(x_leaves, x_impls)
    lengths = {int(np.shape(x)[0]) for x in x_leaves if np.ndim(x) >= 1}
    if any(np.ndim(x) == 0 for x in x_leaves) or len(lengths) > 1 or (length is not None and lengths and
                                                                      lengths != {int(length)}):
        return lax_loop()                   # lax raises its error
    n_steps = int(length) if length is not None else (lengths.pop() if lengths else None)
    if n_steps is None or n_steps == 0:
        return lax_loop()
    avals = [_aval(x) for x in leaves]
    x_avals = [jax.ShapeDtypeStruct(np.shape(x)[1:], _aval(x).dtype, weak_type=_aval(x).weak_type) for x in x_leaves]
    if _any_size_zero(avals) or _any_size_zero(x_avals):
        return lax_loop()
    state = {}

    def step(*ls):
        c = jax.tree_util.tree_unflatten(tree, _as_keys(ls[:len(leaves)], impls))
        x = jax.tree_util.tree_unflatten(x_tree, _as_keys(ls[len(leaves):], x_impls))
        new, y = f(c, x)
        out_leaves, out_tree = jax.tree_util.tree_flatten(new)
        if out_tree != tree or not _same_keys(out_leaves, impls):
            raise _TreeMismatch()
        y_leaves, y_tree = jax.tree_util.tree_flatten(y)
        state["y_tree"] = y_tree
        state["ny"] = len(y_leaves)
        state["y_impls"] = _key_impls(y_leaves)
        return _as_key_data(out_leaves, impls) + _as_key_data(y_leaves, state["y_impls"])
    traced = _trace_body(step, avals, tail=x_avals)
    if traced is None:
        return lax_loop()
    closed, avals, out_avals = traced
    nc = len(leaves)
    y_avals = closed.out_avals[nc:]
    if _any_size_zero(y_avals):
        return lax_loop()
    nx = len(x_leaves)
    roles = [("carry", k) for k in range(nc)] + [("x", k) for k in range(nx)]
    try:
        prog = flatten(closed)
        plan = _lower(prog, roles, {k: k for k in range(nc)}, {k: k for k in range(nc)},
                      ys_idx=[(k, nc + k) for k in range(len(y_avals))], xs_idx=[(k, nc + k) for k in range(nx)],
                      length=n_steps, reverse=reverse)
        mk = _kernel(plan)
    except Unsupported as exc:
        _fallback("scan", fallback, exc, f)
        return lax_loop()
    consts = _const_args(prog)
    y_tree = state["y_tree"]

    def run(consts, leaves, xs_l):
        new, ys, _ = _launch(plan, mk, leaves, consts, steps=n_steps, xs=xs_l, ys_avals=y_avals, length=n_steps)
        new = _counted(plan, leaves, new, n_steps)
        ys_l = [ys[k] if k in ys else _const_ys(prog.outs[nc + k], y_avals[k], n_steps) for k in range(len(y_avals))]
        return new + ys_l

    def lax_run(consts, leaves, xs_l):
        def body(c, x):
            out = jax.core.eval_jaxpr(closed.jaxpr, consts, *c, *x)
            return tuple(out[:nc]), tuple(out[nc:])
        c, ys = lax.scan(body, tuple(leaves), tuple(xs_l), length=n_steps, reverse=reverse)
        return list(c) + list(ys)

    out = _with_lax_derivatives(run, lax_run, consts, [jnp.asarray(x) if not isinstance(x, jax.Array) else x
                                                       for x in leaves], [jnp.asarray(x) for x in x_leaves],
                                loop=("scan", fallback, f))
    carry = [_as_type(o, a) for o, a in zip(out[:nc], out_avals)]
    ys = [_as_type(o, jax.ShapeDtypeStruct((n_steps,) + tuple(a.shape), a.dtype,
                                           weak_type=getattr(a, "weak_type", False)))
          for o, a in zip(out[nc:], y_avals)]
    # (a key y's ys: the stacked words, one key per step)
    return (jax.tree_util.tree_unflatten(tree, _as_keys(carry, impls)),
            jax.tree_util.tree_unflatten(y_tree, _as_keys(ys, state["y_impls"])))


def _const_ys(atom, aval, n):
    """ys of a y that is a literal (the kernel has nothing to store)."""
    import jax.numpy as jnp
    if isinstance(atom, Lit):
        return jnp.full((n,) + tuple(aval.shape), atom.value, aval.dtype)
    raise Unsupported("internal", "", "a y without a store")   # pragma: no cover
