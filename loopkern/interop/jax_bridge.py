"""``kernel.jax(...)``: a megakernel as a functional JAX operation, eager or inside ``jax.jit``.

On a GPU the call lowers to an XLA FFI custom call (``xla_ffi.py``) that launches the
Numba-compiled kernel on XLA's own stream. The call names the kernel by the id of its registered
cubin, not by a device's handle: the handler loads the image into the context of the stream XLA
hands it, once per device, so the same call runs on whichever device XLA runs it on (each
device of the mesh inside ``jax.shard_map``). Array parameters are aliased to the outputs, so
under ``donate_argnums`` no buffer is copied; scalars and the step count travel as 1-element
device buffers, so they may be traced values (numbers known at trace time are constants). The
custom call is the only operation XLA runs for it: its handler zeroes the control block and the
grid barrier's counter and writes the timeout on XLA's stream before the launch, and copies the
step count out after it (``ffi_shim.c``). On JAX's CPU backend the same call runs the
CPU-compiled kernel through ``jax.pure_callback`` (Python once per call, not per step).

Every call checks its arguments (cheap: types, shapes, dtypes), then looks its *signature* up
in a small cache on the kernel (:class:`CallCache`, on ``mk.dispatcher``): the platform and the
kind of device (its compute capability), each parameter's shape and dtype (arrays) or dtype
(scalars), the dtypes of the step count and start, the resolved scope, threads and blocks, the
seed, the timeout, whether the step returns a condition and whether block scope stages its
arrays in shared memory (not for a short run: ``STAGE_MIN_STEPS``). An entry (:class:`JaxCall`) holds
what was built for that signature: the compiled kernel and its launch configuration, the result
shapes, aliases and ``layout`` attribute, the ``ffi_call`` (or the ``pure_callback`` host
function), the ``custom_jvp`` wrapper, and a ``jax.jit`` of all of it for eager calls. So a
second trace (a new jitted function with the same shapes) or an eager call does no occupancy
query, no cubin load and no custom-call construction; an eager call with a signature seen
before is one dispatch of an already compiled executable.

The cubin is built for, and the launch configuration (the plan) sized by an occupancy query on,
Numba's current device, so an entry is per kind of device, not per device; at its first launch
on a device the handler loads the kernel there and checks that the grid can be co-resident.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import threading

import numpy as np

from ..adjoint import ADJOINT_FORMS
from ..dispatch import checks
from ..dispatch.args import ArrayArg, check_dtype, weak_float_type
from ..dispatch.dispatcher import JAX_OPTIONS
from ..dispatch.plan import LRUCache
from ..errors import ArgumentError, LaunchError, LoopkernError
from ..runtime.layout import HOST_SIZE, STEPS, TIMEOUT_NS

log = logging.getLogger("loopkern")
_SCRATCH_VIEW = 8   # redf, redi and info are 8-byte elements, passed to XLA as bytes
CALLS_PER_KERNEL = 64   # signatures kept per kernel (least recently used dropped beyond)
_NUMERIC_KINDS = "biuf"
_F64, _I64, _BOOL = np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.bool_)
_PY_KINDS = {float: "f", int: "i", bool: "b"}   # Python numbers and the dtype kinds _number gives them
_INT_BOUNDS = {np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in (np.int32, np.int64)}


def _is_jax_array(x) -> bool:
    import jax
    return isinstance(x, jax.Array)


def _canonical(dtype):
    """The dtype JAX gives a value of NumPy dtype ``dtype`` (64-bit types are 32-bit without x64)."""
    import jax
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _number(v):
    """(the value to hand to JAX, its dtype as ``jnp.asarray(v)`` would give it) for a number or
    a 0-d JAX array. The common Python and NumPy numbers are passed as they are (JAX converts
    them, to the same dtype and value as ``jnp.asarray``); anything else goes through
    ``jnp.asarray`` here, so its errors (an out-of-range Python int, ...) are those of JAX."""
    t = type(v)
    if t is float:
        return v, _canonical(_F64)
    if t is bool:
        return v, _BOOL
    if t is int:
        dt = _canonical(_I64)
        lo, hi = _INT_BOUNDS[dt]
        if lo <= v <= hi:
            return v, dt
    elif isinstance(v, np.generic) and v.dtype.kind in _NUMERIC_KINDS:
        return v, _canonical(v.dtype)
    elif _is_jax_array(v):
        return v, np.dtype(v.dtype)
    import jax.numpy as jnp
    s = jnp.asarray(v)
    return s, np.dtype(s.dtype)


def _step_count(label, value):
    """``steps``/``max_steps``/``start``: an int >= 0 or a 0-d integer JAX array; returns
    (the value, its JAX dtype); the call makes it a 1-element array."""
    import jax
    import jax.numpy as jnp
    if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or (
            _is_jax_array(value) and value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.integer))):
        raise ArgumentError(f"{label}={value!r}: expected an int or a 0-d integer JAX array")
    # (a traced count's value is not known here: a negative one runs no step)
    if not isinstance(value, jax.core.Tracer) and int(value) < 0:
        raise ArgumentError(f"{label}={int(value)}: must be >= 0")
    if isinstance(value, numbers.Integral) and value > _INT_BOUNDS[_canonical(_I64)][1]:
        raise ArgumentError(f"{label}={value}: more than JAX's {_canonical(_I64)} holds (jax_enable_x64 is off); "
                            f"split the run into calls with start=, or enable x64")
    return _number(value)


def _prepare(mk, args, kwargs, steps, max_steps):
    """Check the call. Returns (arrays: index -> JAX array, the values in parameter order,
    the parameters' signature: (shape, dtype) per array, (None, dtype) per number, the step
    count and its dtype)."""
    import jax
    import jax.numpy as jnp

    spec = mk.spec
    if (steps is None) == (max_steps is None):
        raise ArgumentError(f"{spec.name}.jax(): pass exactly one of steps= or max_steps=")
    nsteps = _step_count("steps" if steps is not None else "max_steps", steps if steps is not None else max_steps)
    d = mk.dispatcher
    if kwargs or len(args) != len(spec.params):
        bound = d.bind_names(args, kwargs, call=".jax", options=JAX_OPTIONS)
        args = [bound[p.name] for p in spec.params]
    check_array_use, check_atomic_dtype, check_kind, check_swap_pair = (
        checks.check_array_use, checks.check_atomic_dtype, checks.check_kind, checks.check_swap_pair)
    arrays, values, sig, weak_scalars = {}, [], [], []
    for i, p in enumerate(spec.params):
        v = args[i]
        if _is_jax_array(v) and v.ndim > 0:
            dtype = np.dtype(v.dtype)
            check_kind(p, True, f"an array of shape {v.shape}")
            check_dtype(p.name, dtype)
            check_array_use(p, v.shape, spec.filename)
            check_atomic_dtype(p, dtype)
            arrays[i] = v
            sig.append((tuple(v.shape), dtype))
        elif not _is_jax_array(v) and (isinstance(v, np.ndarray) and v.ndim > 0
                                       or hasattr(v, "__cuda_array_interface__")):
            # (a 0-d JAX array on a GPU has a CUDA array interface too: it is a number here)
            raise ArgumentError(f"argument '{p.name}': kernel.jax takes JAX arrays, got {type(v).__name__}; "
                                f"convert it with jnp.asarray, or call the kernel itself to update it in place")
        else:
            check_kind(p, False, type(v).__name__)
            if isinstance(v, complex) or (_is_jax_array(v) and jnp.issubdtype(v.dtype, jnp.complexfloating)):
                raise ArgumentError(f"argument '{p.name}': complex numbers are not supported yet")
            if not (isinstance(v, (numbers.Real, np.generic)) or _is_jax_array(v)):
                raise ArgumentError(f"argument '{p.name}': expected a JAX array or a number, got {type(v).__name__}")
            weak = type(v) is float or (_is_jax_array(v) and bool(getattr(jax.typeof(v), "weak_type", False))
                                        and jnp.issubdtype(v.dtype, jnp.floating))
            try:
                v, dtype = _number(v)
            except OverflowError as exc:
                # (jnp.asarray's own error names no argument)
                raise ArgumentError(f"argument '{p.name}': the integer {v} does not fit in JAX's default integer "
                                    f"type ({exc}); pass a JAX array of the dtype you mean, or enable x64") from None
            check_dtype(p.name, dtype, "scalar")
            checks.check_integer(p, dtype, f"a {np.dtype(dtype)} number", spec.filename)
            if weak:
                weak_scalars.append(i)
            sig.append((None, dtype))
        values.append(v)
    # a Python float (or a weakly typed JAX float) takes the float arrays' precision, as in a
    # direct call (dispatch/args.apply_weak_floats): with x64 on it would be float64 here
    if weak_float_type(d for shape, d in sig if shape is not None) == "float32":
        for i in weak_scalars:
            values[i] = np.float32(values[i]) if type(values[i]) is float else jnp.asarray(values[i], jnp.float32)
            sig[i] = (None, np.dtype(np.float32))
    for a, b in spec.swap:
        x, y = arrays.get(a), arrays.get(b)
        names = (spec.params[a].name, spec.params[b].name)
        if x is None or y is None:
            raise ArgumentError(f"swap pair {names}: both must be JAX arrays")
        check_swap_pair(names, x.shape, x.dtype, y.shape, y.dtype)
    return arrays, values, tuple(sig), nsteps


def _platform(mk, arrays, backend):
    import jax
    devices = set()
    for a in arrays.values():
        try:
            devices |= {d.platform for d in a.devices()}
        except Exception:   # a tracer: it lives where the computation runs
            pass
    if len(devices) > 1:
        raise ArgumentError(f"kernel.jax(): the arrays are on different platforms: {sorted(devices)}")
    platform = devices.pop() if devices else jax.default_backend()
    platform = "cuda" if platform in ("gpu", "cuda") else platform
    backend = backend or mk.dispatcher.defaults["backend"]
    if backend == "cuda" and platform != "cuda":
        raise ArgumentError(f"backend='cuda' but the JAX arrays are on '{platform}'; put them on a GPU "
                            f"(jax.device_put) or use backend='cpu'/'auto'")
    if backend == "cpu" and platform != "cpu":
        raise ArgumentError(f"backend='cpu' but the JAX arrays are on '{platform}'")
    if platform not in ("cuda", "cpu"):
        raise ArgumentError(f"kernel.jax() runs on JAX's CUDA and CPU platforms, not '{platform}'")
    return platform


def _largest_array(sig) -> int:
    """Elements of the largest array of the signature (1 without arrays): what ``scope="auto"``
    resolves by, as for a direct call."""
    return max([math.prod(shape) for shape, _ in sig if shape is not None] or [1])


def _device_argv(spec, sig) -> list:
    """The signature's arrays as the dispatcher's :class:`ArrayArg` descriptions (device
    arrays; None for scalars), for the staging and tile planners."""
    return [ArrayArg(spec.params[i].name, None, "device", tuple(sig[i][0]), np.dtype(sig[i][1]), None, 0)
            if sig[i][0] is not None else None for i in range(len(spec.params))]


def _launch_work(mk, sig) -> int:
    """The elements a launch of ``mk`` covers: its largest array, where a stack of recorded states
    (the ``S_a`` of the reverse sweep's recorder and segment kernels, one state per step of a
    segment) counts as one state. Its leading axis is steps, not parallel work: counted, it took
    the grid to every co-resident block (660 and 1056 for 64K heat on an H200, where 132-264
    blocks ran the same kernels 1.4-1.7x faster; bench/grad_probe.py)."""
    stacked = mk.__dict__.get("_stacked_params", frozenset())
    sizes = [math.prod(shape[1:] if i in stacked else shape) for i, (shape, _) in enumerate(sig)
             if shape is not None]
    return max(sizes or [1])


def _cuda_options(mk, sig, scope, threads, blocks):
    """(resolved scope, threads, blocks, the kind of CUDA device the call is built for) of a CUDA call.

    The scope is ``"auto-tile"`` where ``scope="auto"`` picks tile mode as a direct call does
    (``Dispatcher.auto_tile``): :func:`_cuda_core` then keeps the grid scope if tile mode
    refuses the arguments."""
    from ..dispatch.config import resolve_scope
    from . import xla_ffi
    spec = mk.spec
    defaults = mk.dispatcher.defaults
    # the scope as before the stacks were discounted (that is what ran on the GPU); the block
    # count of a grid launch comes from _launch_work (in _cuda_core)
    work = _largest_array(sig)
    asked = scope or defaults["scope"]
    scope = resolve_scope(asked, work, spec.parallel, spec.light_elements)
    checks.check_thread_scope(spec, scope)
    if scope == "cluster":
        raise ArgumentError(f"{spec.name}.jax(): scope='cluster' is not available under kernel.jax; "
                            f"use scope='tile' or 'grid'")
    if scope == "tile":
        mk.dispatcher.tile_stencil()        # a step tile mode cannot run: ArgumentError now
    elif asked == "auto" and mk.dispatcher.auto_tile(work, False, False, [shape for shape, _ in sig]):
        scope = "auto-tile"
    # Not the device itself: the custom call runs on whichever device XLA gives it (every one of
    # a mesh under shard_map), and the handler loads the kernel there. But the cubin is built for
    # the current device's compute capability and the grid sized by an occupancy query on it
    # (CompiledKernel.load_for_ffi, cuda_config), so the entry is for that kind of device.
    kind = xla_ffi.current_device()[1]
    return scope, threads or defaults["threads"], blocks or defaults["blocks"], kind


#: kernel.jax at block scope stages its arrays in shared memory (as a direct call does) unless
#: the step count is a Python int below this. Inside XLA a launch with 32 KiB of dynamic shared
#: memory cost about 16 µs more per call than one without (H200, 2026-12-04, 4K heat, one step,
#: bench/jax_call_probe.py: 106 against 90 µs per jitted call), while staging saves about
#: 0.5 µs per step (4K heat: 0.61 against 1.1 µs per step): it pays from about 32 steps. A
#: traced step count is taken to be a long run.
STAGE_MIN_STEPS = 32


# ------------------------------------------------------------------------------ the cache
class JaxCall:
    """What ``kernel.jax`` built for one signature.

    ``fn(nsteps, start, *params)`` takes the step count, the start and the parameters as the
    caller gave them (arrays, and numbers or 0-d arrays, traced or not), makes the numbers
    1-element arrays and runs the custom call (``custom_jvp``-wrapped: no derivative rule);
    it returns the new arrays and, for a step that returns a condition or a call with a
    timeout, the number of steps done. ``eager`` is ``jax.jit(fn)``, for calls outside a trace.
    """

    __slots__ = ("key", "fn", "eager", "config", "__weakref__")

    def __init__(self, key, fn, config=None):
        import jax
        self.key = key
        self.fn = fn
        self.eager = jax.jit(fn)
        self.config = config      # the CUDA LaunchConfig (None on the CPU)


class CallCache(LRUCache):
    """A kernel's :class:`JaxCall` entries by signature."""

    def __init__(self, size: int = CALLS_PER_KERNEL):
        super().__init__(size)


_create_lock = threading.Lock()


def call_cache(mk) -> CallCache:
    """The kernel's cache of ``kernel.jax`` calls (created on first use, kept on its dispatcher)."""
    d = mk.dispatcher
    cache = getattr(d, "_jax_calls", None)
    if cache is None:
        with _create_lock:
            cache = getattr(d, "_jax_calls", None)
            if cache is None:
                cache = d._jax_calls = CallCache()
    return cache


def jax_call(mk, args, kwargs, *, steps=None, max_steps=None, start=0, backend=None, scope=None, threads=None,
             blocks=None, seed=0, timeout=None, checkpoint_every=None, adjoint_form="gather"):
    """Implementation of :meth:`loopkern.MegaKernel.jax` (see there)."""
    import jax

    seed = checks.check_seed(seed)
    if backend is not None:
        checks.check_choice("backend", backend, checks.BACKENDS)
    if scope is not None:
        # (cluster scope is refused later, with its reason, on a GPU)
        checks.check_choice("scope", scope, checks.SCOPES)
    checkpoint_every = checks.check_count("checkpoint_every", checkpoint_every, minimum=1)
    adjoint_form = checks.check_choice("adjoint_form", adjoint_form, ADJOINT_FORMS)
    timeout = checks.check_seconds("timeout", timeout)
    arrays, values, sig, (nsteps, n_dtype) = _prepare(mk, args, kwargs, steps, max_steps)
    if (mk.spec.returns_condition or timeout is not None) and isinstance(nsteps, numbers.Integral) \
            and nsteps >= 2 ** 31:
        label = "steps" if steps is not None else "max_steps"
        raise ArgumentError(f"{label}={nsteps}: the call returns the steps it ran as an int32, which holds at most "
                            f"2**31 - 1; split the run into calls with start=")
    t0, t0_dtype = _step_count("start", start)
    platform = _platform(mk, arrays, backend)
    if platform == "cuda":
        scope, threads, blocks, kind = _cuda_options(mk, sig, scope, threads, blocks)
    else:
        scope = threads = blocks = kind = None
    count = steps if steps is not None else max_steps
    stage = scope != "block" or not (isinstance(count, numbers.Integral) and count < STAGE_MIN_STEPS)
    key = (platform, kind, sig, n_dtype, t0_dtype, scope, threads, blocks, seed, timeout,
           bool(mk.spec.returns_condition), stage, checkpoint_every, adjoint_form)
    cache = call_cache(mk)
    try:
        entry = cache.get(key)
    except TypeError:           # an unhashable option (threads=[...]): no caching
        entry, cache = None, None
    if entry is None:
        entry = _build(mk, key)
        if cache is not None:
            cache.put(key, entry)
    inputs = (nsteps, t0, *values)
    if any(isinstance(x, jax.core.Tracer) for x in inputs):
        return entry.fn(*inputs)       # inside a trace (jit, vmap, grad, ...): trace the call inline
    return entry.eager(*inputs)


# ------------------------------------------------------------------------------ building
def _build(mk, key) -> JaxCall:
    """Build the call of one signature (see :class:`JaxCall`)."""
    import jax
    import jax.numpy as jnp

    platform, kind, sig, n_dtype, t0_dtype, scope, threads, blocks, seed, timeout, returns_condition, stage, every, form = key
    arr_set = frozenset(i for i, (shape, _) in enumerate(sig) if shape is not None)
    na = len(arr_set)
    with_count = returns_condition or timeout is not None
    if platform == "cuda":
        core, config = _cuda_core(mk, sig, n_dtype, t0_dtype, scope, threads, blocks, seed, timeout, with_count,
                                  stage)
    else:
        core, config = _cpu_core(mk, sig, seed, timeout), None

    # ``static_n``: the step count when the caller gave a number (None when traced), kept out of
    # the operands: an operand that is a constant here arrives traced when JAX traces the call
    # again (jax.jit, jax.checkpoint, lax.scan and lax.cond around it), where reverse mode
    # needs the count known
    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def call(static_n, *xs):
        outs = core(*xs)
        return tuple(outs[:na]) + ((outs[-1],) if with_count else ())

    def _tangent_rule(static_n, primals, tangents):
        return _jvp(mk, key, primals, tangents, arr_set, with_count, call, static_n)
    # symbolic zeros: the tangents of constants arrive as SymbolicZero, so _jvp differentiates
    # only the parameters that have a tangent
    call.defjvp(_tangent_rule, symbolic_zeros=True)

    dtypes = [dt for _, dt in sig]

    def as_buffer(v, dtype):
        t = type(v)
        if (t in _PY_KINDS and dtype.kind == _PY_KINDS[t]) or (isinstance(v, np.generic) and v.dtype == dtype):
            # a number known at trace time (checked by _number: it fits 'dtype'): a constant
            # operand of the custom call, not a constant reshaped by an XLA op
            return np.array([v], dtype)
        x = jnp.asarray(v)
        if np.dtype(x.dtype) != dtype:      # the kernel was built for 'dtype': never run it on another
            raise LoopkernError(f"kernel.jax: internal error: a {x.dtype} value where the call was built "
                                f"for {dtype}")
        return x.reshape(1)

    def fn(nsteps, t0, *vals):
        n_buf = as_buffer(nsteps, n_dtype)
        bufs = [v if i in arr_set else as_buffer(v, dtypes[i]) for i, v in enumerate(vals)]
        static_n = int(nsteps) if isinstance(nsteps, numbers.Integral) else None
        return call(static_n, n_buf, as_buffer(t0, t0_dtype), *bufs)

    return JaxCall(key, fn, config)


def _jvp(mk, key, primals, tangents, arr_set, with_count, call, static_n=None):
    """The forward-mode rule of a kernel.jax call: the tangents from one run of the tangent
    kernel (``MegaKernel.tangent`` with respect to every float parameter), the primal outputs
    from ``call``. A step that returns a condition runs the same number of steps in both (its
    condition is computed from primal values only)."""
    import jax
    import jax.numpy as jnp

    platform, kind, sig, n_dtype, t0_dtype, scope, threads, blocks, seed, timeout, returns_condition, stage, every, form = key
    name = mk.spec.name
    if timeout is not None:
        raise LoopkernError(f"kernel.jax: differentiating megakernel '{name}' with timeout= is not supported "
                            f"(the primal and tangent runs could stop at different steps); leave timeout out")
    params = [p.name for p in mk.spec.params]
    n_buf, t0_buf, *bufs = primals
    tans = tangents[2:]
    floats = [i for i, (_, dt) in enumerate(sig) if np.dtype(dt).kind == "f"]
    if not floats:
        raise LoopkernError(f"kernel.jax: megakernel '{name}' has no float parameter to differentiate")
    # differentiated: the parameters with a tangent and, when there is one, every float array
    # the step writes (its tangent grows from the others'). A constant that the step only reads
    # (a symbolic zero tangent) is left out: its adjoint would be computed and thrown away, and
    # a scalar's adjoint gathers every element's contribution into one number
    given = {i for i in floats if not isinstance(tans[i], jax.custom_derivatives.SymbolicZero)}
    swapped = {i for pair in mk.spec.swap for i in pair}
    written = {i for i in floats if i in arr_set and (mk.spec.params[i].written or i in swapped)}
    active = sorted(given | written) if given else []
    def zero_tangent(i):
        shape, dt = sig[i]
        return jnp.zeros(shape, dt) if np.dtype(dt).kind == "f" else np.zeros(shape, jax.dtypes.float0)
    if not active:
        return call(static_n, *primals), tuple(zero_tangent(i) for i in sorted(arr_set)) + (
            (np.zeros((), jax.dtypes.float0),) if with_count else ())
    tk = mk.tangent(*[params[i] for i in active])

    def scalar(x):
        # a 1-element buffer: traced, a 0-d JAX array; known at trace time, a Python number
        if isinstance(x, jax.core.Tracer) or isinstance(x, jax.Array):
            return jnp.asarray(x).reshape(())
        return np.asarray(x).reshape(())[()].item()

    args = []
    for i, b in enumerate(bufs):
        args.append(b if i in arr_set else scalar(b))
        if i in active:
            tg = tans[i]
            if isinstance(tg, jax.custom_derivatives.SymbolicZero):     # not instantiated: zeros
                tg = jnp.zeros(np.shape(b), sig[i][1])
            args.append(jnp.asarray(tg, sig[i][1]) if i in arr_set else scalar(tg))
    count_kw = "max_steps" if returns_condition else "steps"
    options = dict(backend=platform, scope="auto" if scope == "auto-tile" else scope, threads=threads, blocks=blocks,
                   seed=seed)

    nsteps = static_n if static_n is not None else (
        None if isinstance(n_buf, jax.core.Tracer) else int(np.asarray(n_buf).reshape(())[()]))
    primal_out, checkpoints = _checkpointed_primal(mk, params, active, arr_set, sig, returns_condition, nsteps,
                                                   every, form, call, primals, static_n)
    n_args = len(args)

    def run(n, t0, *a):
        # (the checkpoints after the tangent run's own operands are for the reverse sweep; a
        # tangent may come as a NumPy array: the function jax.linearize returns takes one)
        a = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in a[:n_args]]
        return tk.jax(*a, start=t0, **options, **{count_kw: n})
    # the step count and start are operands: the primitive's function closes over no traced value
    ctx = _ReverseContext(mk, params, active, arr_set, sig, options, returns_condition, nsteps,
                          len(checkpoints), every, form)
    res = _tangent_primitive().bind(jnp.asarray(n_buf).reshape(()), jnp.asarray(t0_buf).reshape(()), *args,
                                    *checkpoints, fn=run, name=name, reverse=ctx)
    res = list(res) if isinstance(res, (tuple, list)) else [res]
    tangent_out, k = [], 0
    for i in sorted(arr_set):
        k += 1
        if i in active:
            tangent_out.append(res[k])
            k += 1
        else:
            tangent_out.append(zero_tangent(i))
    if with_count:
        tangent_out.append(np.zeros((), jax.dtypes.float0))
    # the primal outputs from the primal kernel, not from the tangent run: under jacfwd the
    # tangents are batched (vmap) and the tangent run with them, while the primal outputs must
    # not be (one extra primal run per call)
    return primal_out, tuple(tangent_out)


def _segments(nsteps: int, every: int | None = None) -> tuple:
    """(k, the lengths of the reverse sweep's segments) for a run of ``nsteps`` steps:
    k = ``every`` (kernel.jax's checkpoint_every) or ceil(sqrt(nsteps)) steps each, the last
    one shorter."""
    k = every if every is not None else max(1, math.isqrt(max(nsteps, 1) - 1) + 1)
    return k, [min(k, nsteps - s) for s in range(0, nsteps, k)]


def _state_arrays(mk, arr_set) -> list:
    """The array parameters whose contents change from step to step: written ones and swap
    pairs' (what a checkpoint of the run holds)."""
    swapped = {i for pair in mk.spec.swap for i in pair}
    return [i for i in sorted(arr_set) if mk.spec.params[i].written or i in swapped]


def _checkpointed_primal(mk, params, active, arr_set, sig, returns_condition, nsteps, every, form, call, primals,
                         static_n=None):
    """(the primal outputs, the checkpoints of the reverse sweep) for the forward-mode rule.

    When reverse mode may follow and its sweep will recompute states (the adjoint step reads
    the values of a state array), the primal run is made in the sweep's segments, and the
    state at the start of each segment but the first is kept: passed on as operands of the
    tangent primitive, the transpose finds them there instead of running the forward pass a
    second time (its checkpoints become residuals of the linearization). Otherwise (a step
    count known only at run time, a step that returns a condition, a step the
    adjoint does not cover or that needs no recomputation, a single segment) one run, no
    checkpoints."""
    import jax.numpy as jnp
    if nsteps is None or returns_condition or not active:
        return call(static_n, *primals), []
    state = _state_arrays(mk, arr_set)
    try:
        recorded = _segment_kernels(mk, [params[i] for i in active], [params[i] for i in state],
                                    {params[i]: len(sig[i][0]) for i in state}, form)[3]
    except (LoopkernError, ValueError):
        recorded = []       # reverse mode will raise its error if it is asked for
    k, lengths = _segments(nsteps, every)
    if not recorded or len(lengths) < 2:
        return call(static_n, *primals), []
    n_buf, t0_buf, *bufs = primals
    n_dtype = np.dtype(n_buf.dtype)             # (its value is nsteps; the buffer may be traced)
    t0 = jnp.asarray(t0_buf)
    arrays = sorted(arr_set)
    cur, checkpoints = list(bufs), []
    for s, length in enumerate(lengths):
        if s:
            checkpoints += [cur[i] for i in state]
        out = call(length, np.array([length], n_dtype), t0 + s * k, *cur)
        for slot, i in enumerate(arrays):
            cur[i] = out[slot]
    return out, checkpoints


class _ReverseContext:
    """What the transpose of a tangent run needs to run the reverse sweep (compared by identity)."""

    def __init__(self, mk, params, active, arr_set, sig, options, returns_condition, nsteps, n_checkpoints=0,
                 checkpoint_every=None, form="gather"):
        self.mk, self.params, self.active, self.arr_set = mk, params, active, arr_set
        self.sig, self.options, self.returns_condition = sig, options, returns_condition
        self.nsteps = nsteps            # the step count when known at trace time, else None
        # the primal run's checkpoints (_checkpointed_primal), the primitive's last operands
        self.n_checkpoints = n_checkpoints
        self.checkpoint_every = checkpoint_every
        self.form = form                # the adjoint step's form: "gather" or "scatter"


def _segment_kernels(mk, active_names, state, ndims, form="gather"):
    """(the recorder, the segment's adjoint sweep, its scratch arrays, the recorded arrays)
    for ``mk``: see ``loopkern/adjoint.py``. Of the state arrays (``state``: those whose
    contents change from step to step) only those whose elements the adjoint step reads are
    recorded. The adjoint step is generated first: it raises StepSyntaxError for what it
    cannot cover yet. Cached on ``mk``."""
    from ..adjoint import adjoint_function, arrays_read, recorder_function, segment_adjoint_function
    from ..api import derived_kernel
    key = (tuple(active_names), tuple(state), tuple(sorted(ndims.items())), form)
    cache = mk.__dict__.setdefault("_segment_kernels", {})
    if key not in cache:
        parsed = mk.parsed
        adj, bars, scratch = adjoint_function(parsed, set(active_names), form)
        recorded = arrays_read(adj, state)
        pairs = [(mk.spec.param_names[a], mk.spec.param_names[b]) for a, b in mk.spec.swap]
        d = mk.dispatcher.defaults
        rec, rec_stacks, _ = recorder_function(parsed, recorded, ndims)
        seg, seg_stacks, _ = segment_adjoint_function(adj, recorded)
        opts = dict(backend=d["backend"], scope=d["scope"], threads=d["threads"], blocks=d["blocks"])
        what = "reverse mode (jax.grad)"
        kernels = (derived_kernel(rec, mk.spec.name, what, swap=pairs, **opts),
                   derived_kernel(seg, mk.spec.name, what,
                                  swap=[(bars[a], bars[b]) for a, b in pairs if a in bars and b in bars], **opts))
        for k, stacks in zip(kernels, (rec_stacks, seg_stacks)):
            names = k.spec.param_names
            k.__dict__["_stacked_params"] = frozenset(names.index(v) for v in stacks.values())
            # (reverse mode over these is reverse over reverse: refused by _reverse_sweep)
            k.__dict__["_adjoint_of"] = mk.__dict__.get("_adjoint_of", mk.spec.name)
        cache[key] = kernels + (scratch, recorded)
    return cache[key]


def _reverse_sweep(ctx, name, cts, n, t0, args) -> list:
    """The cotangents of a tangent run's tangent inputs (``args`` interleaves each parameter's
    value with its tangent, an ``UndefinedPrimal``, for the active ones): the reverse sweep.

    The forward run is repeated in segments of k = ceil(sqrt(N)) steps, keeping the state at
    the start of each; then, segment by segment from the last, one kernel (the recorder)
    recomputes the segment recording every step's state, and one kernel (the segment's
    adjoint sweep) runs the adjoint step backwards over those states, the swap pairs'
    adjoints renamed as the forward run renamed the arrays. Only the state arrays whose values
    the adjoint step reads are recorded (none for a step linear in what is differentiated: then
    neither the forward segments nor the recorder run). Extra memory: about 2 sqrt(N) states
    of the recorded arrays; kernel calls: about 3 sqrt(N).
    """

    import jax.numpy as jnp
    from jax.interpreters import ad

    mk = ctx.mk
    if "_adjoint_of" in mk.__dict__:
        raise LoopkernError(f"kernel.jax: megakernel '{mk.__dict__['_adjoint_of']}': reverse mode over reverse "
                            f"mode (jax.grad of jax.grad, jacrev of jacrev) is not supported; second derivatives "
                            f"work as jax.hessian or jax.jacfwd(jax.jacrev(f)) (forward over reverse)")
    nsteps = ctx.nsteps
    if nsteps is None:
        which = "max_steps" if ctx.returns_condition else "the step count"
        raise LoopkernError(f"kernel.jax: reverse-mode differentiation of megakernel '{name}' needs {which} "
                            f"known at trace time (a Python int), not a traced value")
    params, nparams = ctx.params, len(ctx.params)
    active_names = [params[i] for i in ctx.active]
    values, pos = [], 0
    for i in range(nparams):
        values.append(args[pos])
        pos += 1 + (i in ctx.active)
    arr_idx = sorted(ctx.arr_set)
    state = _state_arrays(mk, ctx.arr_set)
    checkpoints = list(args[len(args) - ctx.n_checkpoints:]) if ctx.n_checkpoints else []
    checkpoint_of = {}          # segment -> {state array: its value at the segment's start}
    for j, v in enumerate(checkpoints):
        checkpoint_of.setdefault(1 + j // len(state), {})[state[j % len(state)]] = v
    ndims = {params[i]: len(ctx.sig[i][0]) for i in state}
    rec, seg, scratch, recorded_names = _segment_kernels(mk, active_names, [params[i] for i in state], ndims,
                                                         ctx.form)
    state = [i for i in state if params[i] in recorded_names]
    # the adjoint step's scratch arrays (versions of arrays that its loops recompute): shaped
    # as the arrays they hold versions of; what they hold on entry does not matter
    scratch_arrays = [jnp.zeros(ctx.sig[params.index(like)][0], ctx.sig[params.index(like)][1])
                      for _, like in scratch]
    # the cotangents of the tangent run's outputs: per array parameter its value, then (active)
    # its tangent; only the tangents' matter
    bars, k_out = {}, 0
    for i in arr_idx:
        k_out += 1
        if i in ctx.active:
            ct = cts[k_out]
            # (a cotangent may come as a NumPy array: jax.vjp's pullback takes one)
            bars[i] = jnp.zeros(ctx.sig[i][0], ctx.sig[i][1]) if isinstance(ct, ad.Zero) else \
                jnp.asarray(ad.instantiate_zeros(ct))
            k_out += 1
    sbars = {i: jnp.zeros((1,), ctx.sig[i][1]) for i in ctx.active if i not in ctx.arr_set}
    swap = [(a, b) for a, b in mk.spec.swap if a in bars and b in bars]
    opts = ctx.options
    if nsteps == 0:         # no step ran: every output is its input, and the scalars did nothing
        return [x for i in range(nparams) for x in
                ([None] + ([bars[i] if i in ctx.arr_set else sbars[i].reshape(())] if i in ctx.active else []))]
    k = _segments(nsteps, ctx.checkpoint_every)[0]
    if not state:           # nothing to record: one segment, one launch of the adjoint sweep
        k = max(1, nsteps)
    t0 = jnp.asarray(t0).reshape(())
    if ctx.returns_condition:
        # differentiated with the executed step count held: one more forward run finds it (the
        # condition stopped it), and the segments cover max_steps, those past it running no
        # step; checkpoint memory is bounded by max_steps
        count = mk.jax(*values, max_steps=nsteps, start=t0, **opts)[-1]
        lengths = [jnp.clip(count - s, 0, min(k, nsteps - s)) for s in range(0, nsteps, k)]
        rows = k
    else:
        lengths = [min(k, nsteps - s) for s in range(0, nsteps, k)]
        rows = max(lengths)

    def exchange(bar_d):
        out = dict(bar_d)
        for a, b in swap:
            out[a], out[b] = bar_d[b], bar_d[a]
        return out

    # forward, keeping the state at the start of each segment; not needed when the adjoint step
    # reads no state array (a step linear in what is differentiated): the segment kernels then
    # see the arrays only for their shapes
    cur = list(values)
    starts = []
    for s, length in enumerate(lengths):
        if s in checkpoint_of:          # kept by the primal run
            for i, v in checkpoint_of[s].items():
                cur[i] = v
        starts.append(list(cur))
        if state and s + 1 < len(lengths) and s + 1 not in checkpoint_of:
            out = mk.jax(*cur, steps=length, start=t0 + s * k, **opts)
            for slot, i in enumerate(arr_idx):
                cur[i] = out[slot]
    # backward, a segment at a time. One set of state stacks serves every segment: each segment's
    # recorder writes into the stacks the previous segment's sweep returned (kernel.jax aliases
    # them), so XLA keeps one segment of states alive, not all of them (fresh stacks per segment
    # were all live at once in XLA's buffer assignment: about 2N states for N steps)
    stacks = [jnp.zeros((rows,) + tuple(ctx.sig[i][0]), ctx.sig[i][1]) for i in state]
    for s in reversed(range(len(lengths))):
        length, base = lengths[s], t0 + s * k
        if state:
            out = rec.jax(*starts[s], *stacks, base, steps=length, start=base, **opts)
            recorded = dict(zip(state, out[len(arr_idx):len(arr_idx) + len(state)]))
        else:       # the adjoint step reads no state array: nothing to record
            recorded = {}
        bars = exchange(bars)
        # the segment kernel's parameters: each one (its recorded states for the state arrays),
        # then its adjoint for the active ones; kernel.jax returns its arrays in that order
        argv, arr_slots = [], []
        for i in range(nparams):
            if i in ctx.arr_set:
                arr_slots.append(("value", i))
            argv.append(recorded[i] if i in recorded else starts[s][i])
            if i in ctx.active:
                arr_slots.append(("bar" if i in ctx.arr_set else "sbar", i))
                argv.append(bars[i] if i in ctx.arr_set else sbars[i])
        out = seg.jax(*argv, *scratch_arrays, length - 1, base, steps=length, start=0, **opts)
        for (kind, i), o in zip(arr_slots, out):
            if kind == "bar":
                bars[i] = o
            elif kind == "sbar":
                sbars[i] = o
            elif i in recorded:         # the stacks, handed on to the next segment's recorder
                stacks[state.index(i)] = o
        bars = exchange(bars)
    result = []
    for i in range(nparams):
        result.append(None)
        if i in ctx.active:
            result.append(bars[i] if i in ctx.arr_set else sbars[i].reshape(()))
    return result


_TANGENT_P: list = []


def _tangent_primitive():
    """``loopkern_tangent``: a run of a tangent kernel as one JAX primitive. Evaluated, jitted
    and vmapped (jacfwd) as the function it carries; reverse mode transposes it with the
    reverse sweep of adjoint steps (:func:`_reverse_sweep`)."""
    if _TANGENT_P:
        return _TANGENT_P[0]
    import jax
    import jax.numpy as jnp
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    p = Primitive("loopkern_tangent")
    p.multiple_results = True
    p.def_impl(lambda *a, fn, name, reverse: list(fn(*a)))

    def abstract(*avals, fn, name, reverse):
        outs = jax.eval_shape(fn, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
        return [jax.core.ShapedArray(o.shape, o.dtype) for o in jax.tree_util.tree_leaves(outs)]
    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, mlir.lower_fun(lambda *a, fn, name, reverse: list(fn(*a)), multiple_results=True))

    def batch(args, dims, fn, name, reverse):
        # still this primitive (of the vmapped run), so that differentiating it again meets
        # the rules below, not the kernel's raw callback
        dims = tuple(dims)

        def batched(*a):
            return list(jax.vmap(lambda *x: list(fn(*x)), in_axes=dims)(*a))
        outs = p.bind(*args, fn=batched, name=name, reverse=_Batched(fn, reverse, dims))
        return outs, [0] * len(outs)
    batching.primitive_batchers[p] = batch

    def transpose(cts, *args, fn, name, reverse):
        if isinstance(reverse, _Batched):
            return _transpose_batched(p, cts, args, name, reverse)
        n, t0, args = args[0], args[1], args[2:]
        # no cotangent for the primal run's checkpoints (the last operands)
        return [None, None] + _reverse_sweep(reverse, name, cts, n, t0, args) + [None] * reverse.n_checkpoints
    ad.primitive_transposes[p] = transpose

    def second_order(primals, tangents, fn, name, reverse):
        # forward over forward (jvp of a jvp, jacfwd of jacfwd): the tangent run's own tangent,
        # through its tangent kernel (fn's kernel.jax), as a primitive of its own whose
        # transpose refuses reverse mode over it
        outs = p.bind(*primals, fn=fn, name=name, reverse=reverse)
        which = tuple(k for k, (x, t) in enumerate(zip(primals, tangents))
                      if type(t) is not ad.Zero and jnp.issubdtype(jnp.result_type(x), jnp.inexact))
        if not which:
            return outs, [ad.Zero(o.aval.to_tangent_aval()) for o in outs]
        inexact = tuple(k for k, o in enumerate(outs) if jnp.issubdtype(o.dtype, jnp.inexact))
        lin = _forward_tangent_primitive().bind(*primals, *[tangents[k] for k in which], fn=fn, name=name,
                                                which=which, inexact=inexact)
        t_outs = [ad.Zero(o.aval.to_tangent_aval()) for o in outs]
        for k, t in zip(inexact, lin):
            t_outs[k] = t
        return outs, t_outs
    ad.primitive_jvps[p] = second_order
    _TANGENT_P.append(p)
    return p


class _Batched:
    """The ``reverse`` of a vmapped tangent run: the unbatched run's function and reverse
    context, and each operand's batch dimension (None: not batched)."""

    def __init__(self, fn, inner, dims):
        self.fn, self.inner, self.dims = fn, inner, dims


def _transpose_batched(p, cts, args, name, b: _Batched):
    """The transpose of a vmapped tangent run (reverse mode over ``jax.vmap`` of a call): the
    unbatched run's transpose, vmapped over the batch; a tangent operand without a batch
    dimension gets the sum of its cotangents over the batch."""
    import jax
    import jax.numpy as jnp
    from jax.interpreters import ad

    lin = [k for k, a in enumerate(args) if ad.is_undefined_primal(a)]
    known = [k for k in range(len(args)) if k not in lin]

    def shape_dtype(a):
        return (a.aval.shape, a.aval.dtype) if ad.is_undefined_primal(a) else (np.shape(a), jnp.result_type(a))

    def unbatched_aval(k):
        (shape, dtype), d = shape_dtype(args[k]), b.dims[k]
        return jax.ShapeDtypeStruct(shape if d is None else shape[:d] + shape[d + 1:], dtype)
    lin_avals = [unbatched_aval(k) for k in lin]
    outs = jax.eval_shape(lambda *a: list(b.fn(*a)), *[unbatched_aval(k) for k in range(len(args))])
    size = next(shape_dtype(a)[0][d] for a, d in zip(args, b.dims) if d is not None)
    # only float outputs carry cotangents (an integer array or step count has none, and
    # linear_transpose takes floats only)
    inexact = [k for k, o in enumerate(outs) if jnp.issubdtype(o.dtype, jnp.inexact)]
    cts = [jnp.zeros((size,) + tuple(outs[k].shape), outs[k].dtype) if type(cts[k]) is ad.Zero
           else jnp.asarray(cts[k]) for k in inexact]

    def one(known_vals, ct_vals):
        def linear(*tans):
            full, it_k, it_t = [], iter(known_vals), iter(tans)
            for k in range(len(args)):
                full.append(next(it_t) if k in lin else next(it_k))
            res = p.bind(*full, fn=b.fn, name=name, reverse=b.inner)
            return [res[k] for k in inexact]
        return jax.linear_transpose(linear, *lin_avals)(list(ct_vals))
    res = jax.vmap(one, in_axes=([b.dims[k] for k in known], 0))([args[k] for k in known], cts)
    result = [None] * len(args)
    for k, r in zip(lin, res):
        d = b.dims[k]
        result[k] = r.sum(0) if d is None else jnp.moveaxis(r, 0, d)
    return result


def _reverse_over_forward(name) -> str:
    return (f"kernel.jax: megakernel '{name}': reverse mode (jax.grad, jax.vjp, jacrev) over a forward-mode "
            f"derivative (jax.jvp, jacfwd) is not supported; second derivatives work as jax.hessian or "
            f"jax.jacfwd(jax.jacrev(f)) (forward over reverse), and forward over forward (jacfwd of jacfwd) works")


_FORWARD_P: list = []


def _forward_tangent_primitive():
    """``loopkern_tangent_jvp``: the tangent of a tangent run (forward over forward), evaluated
    as ``jax.jvp`` of the run's function (its tangent kernel's own tangent kernel). Linear in
    its tangent operands; its transpose (reverse over forward) and its own derivatives
    (third order) are refused with a LoopkernError."""
    if _FORWARD_P:
        return _FORWARD_P[0]
    import jax
    import jax.numpy as jnp
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    q = Primitive("loopkern_tangent_jvp")
    q.multiple_results = True

    def evaluate(*a, fn, name, which, inexact):
        primals = a[:len(a) - len(which)]
        seeds = dict(zip(which, a[len(primals):]))
        tangents = [seeds[k] if k in seeds else
                    (jnp.zeros_like(x) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
                     else np.zeros(np.shape(x), jax.dtypes.float0)) for k, x in enumerate(primals)]
        _, t_out = jax.jvp(lambda *x: list(fn(*x)), list(primals), tangents)
        return [t_out[k] for k in inexact]
    q.def_impl(evaluate)

    def abstract(*avals, fn, name, which, inexact):
        outs = jax.eval_shape(lambda *x: evaluate(*x, fn=fn, name=name, which=which, inexact=inexact),
                              *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
        return [jax.core.ShapedArray(o.shape, o.dtype) for o in outs]
    q.def_abstract_eval(abstract)
    mlir.register_lowering(q, mlir.lower_fun(evaluate, multiple_results=True))

    def batch(args, dims, fn, name, which, inexact):
        outs = jax.vmap(lambda *a: evaluate(*a, fn=fn, name=name, which=which, inexact=inexact), in_axes=dims)(*args)
        return outs, [0] * len(outs)
    batching.primitive_batchers[q] = batch

    def transpose(cts, *args, fn, name, which, inexact):
        raise LoopkernError(_reverse_over_forward(name))
    ad.primitive_transposes[q] = transpose

    def third_order(primals, tangents, fn, name, which, inexact):
        raise LoopkernError(f"kernel.jax: megakernel '{name}': derivatives of third order (a forward-mode "
                            f"derivative of a second one) are not supported")
    ad.primitive_jvps[q] = third_order
    _FORWARD_P.append(q)
    return q


def _cpu_core(mk, sig, seed, timeout):
    import jax
    import jax.numpy as jnp

    arr_set = frozenset(i for i, (shape, _) in enumerate(sig) if shape is not None)
    arr_idx = sorted(arr_set)
    shapes = [jax.ShapeDtypeStruct(sig[i][0], sig[i][1]) for i in arr_idx]
    shapes.append(jax.ShapeDtypeStruct((), jnp.int32))
    shapes = tuple(shapes)
    # compiled now, while JAX traces the call: a compile error is then the loopkern error it is,
    # not a failure buried inside the callback when XLA runs it (a run of no step, on arrays of
    # the parameters' types: compiling depends on types, not sizes)
    mk(*[np.zeros((1,) * len(shape), dt) if shape is not None else np.dtype(dt).type(0) for shape, dt in sig],
       steps=0, backend="cpu", seed=seed)

    def host(n, t0, *vals):
        call_args = []
        for i, v in enumerate(vals):
            call_args.append(np.array(v) if i in arr_set else np.asarray(v).reshape(())[()])
        # a traced negative start runs no step (as a traced negative step count does)
        t0 = int(np.asarray(t0).reshape(()))
        n = int(np.asarray(n).reshape(())) if t0 >= 0 else 0
        run = mk(*call_args, steps=max(n, 0), start=max(t0, 0), backend="cpu", seed=seed, timeout=timeout)
        # (kernel.jax refuses a count beyond int32 where the call returns it; where it does
        # not, the value is not used)
        return tuple(call_args[i] for i in arr_idx) + (np.int32(min(run.steps, 2 ** 31 - 1)),)

    def core(n, t0, *vals):
        return jax.pure_callback(host, shapes, n, t0, *vals, vmap_method="sequential")
    return core


class _ShimKernel:
    """What the grid sizing (``dispatch/config.py``'s ``cuda_config`` and ``tile_config``) asks
    of a kernel, for a cubin from the disk cache: answered by the driver through the FFI shim,
    which loads the image into the device's primary context (so that a cubin it cannot run is
    reported now) and allows it dynamic shared memory beyond 48 KiB before each query."""

    via_ffi_shim = True

    def __init__(self, device, image_id, max_threads_per_block, shared):
        from . import xla_ffi
        self._limits = functools.partial(xla_ffi.function_limits, device, image_id)
        self._shared = shared
        most, _, self.shared_mem_per_block = self._limits()
        self.max_threads_per_block = min(max_threads_per_block, most)

    def max_cooperative_grid_blocks(self, threads: int, shared: int | None = None) -> int:
        return self._limits(threads, self._shared if shared is None else shared)[1]


def _compile_for_ffi(compiled, n_dtype, t0_dtype, sig, types_key, xla_ffi, halo=()):
    """Compile with Numba for the custom call's parameter types (``halo``: the dtype of a tile
    kernel's halo scratch, its last parameter) and register the cubin (and store it on disk
    under ``types_key``): (the Numba kernel, the image id)."""
    from numba import types
    from numba.np.numpy_support import from_dtype

    def nb(dtype, ndim):
        return types.Array(from_dtype(np.dtype(dtype)), ndim, "C")

    nbsig = [nb(n_dtype, 1), nb(t0_dtype, 1)]
    for shape, dtype in sig:
        nbsig.append(nb(dtype, len(shape)) if shape is not None else nb(dtype, 1))
    nbsig += [types.float64[:, ::1], types.int64[:, ::1], types.uint32[::1], types.uint32[::1], types.int64[::1],
              types.int64[::1]]
    nbsig += [nb(dtype, 1) for dtype in halo]
    return compiled.load_for_ffi(tuple(nbsig), xla_ffi, disk_key=types_key)


def _ffi_kernel(mk, variant, n_dtype, t0_dtype, sig, types_key, device, cc, shared=0, halo=()):
    """The kernel of ``variant`` for the custom call: (what the grid sizing asks, the image id).
    A cubin from the disk cache is registered with the shim as it is, without Numba; else
    Numba compiles it (and stores it there)."""
    from ..compile import cubin_key, load_cubin
    from . import xla_ffi
    variant = dict(variant)
    scope = variant.pop("scope")
    source = mk.dispatcher.kernels.source("cuda", scope, **variant)
    cached = load_cubin(cubin_key(source.text, types_key, cc))
    if cached is not None:
        # compiled by an earlier process: registered with the shim as it is, without Numba
        image_id = xla_ffi.register_image(cached.image, cached.entry)
        return _ShimKernel(device, image_id, cached.max_threads_per_block, shared), image_id
    return _compile_for_ffi(mk.dispatcher.kernels.get("cuda", scope, **variant), n_dtype, t0_dtype, sig,
                            types_key, xla_ffi, halo)


def _cuda_tile_kernel(mk, sig, n_dtype, t0_dtype, threads, blocks, types_key, by_ref, float_type):
    """Tile mode's kernel and grid for the custom call (``Dispatcher.fit_tiles``, sized for the
    current device through the shim): (LaunchConfig, image id, the halo scratch's dtype or None).
    ``by_ref``, ``float_type``: the kernel variant's, as for the other scopes."""
    from ..dispatch.config import Chip
    from . import xla_ffi
    spec = mk.spec
    device, cc, sms = xla_ffi.current_device()
    chip = Chip(sms, *xla_ffi.device_shared(device))
    halo_dtype = np.dtype(sig[spec.swap[0][0]][1]) if spec.swap else None

    def build(st, depth, tiles, with_halo):
        variant = dict(scope="grid", by_ref=by_ref, float_type=float_type, tile=st, depth=depth, tiles=tiles)
        halo = (halo_dtype,) if with_halo else ()
        key = types_key + tuple(("halo", dt.str) for dt in halo)
        kernel, image_id = _ffi_kernel(mk, variant, n_dtype, t0_dtype, sig, key, device, cc, halo=halo)
        return (image_id, halo_dtype if with_halo else None), kernel
    (image_id, halo), config = mk.dispatcher.fit_tiles(_device_argv(spec, sig), threads, blocks, False, build,
                                                       chip=chip)
    return config, image_id, halo


def _cuda_core(mk, sig, n_dtype, t0_dtype, scope, threads, blocks, seed, timeout, with_count, stage=True):
    import jax
    import jax.numpy as jnp

    from ..dispatch.config import cuda_config, plan_staging, resolve_scope
    from ..dispatch.kernels import index_bits_for
    from ..warpsplit import WARP
    from . import xla_ffi

    spec = mk.spec
    n = len(spec.params)
    arr_idx = [i for i in range(n) if sig[i][0] is not None]
    work = _launch_work(mk, sig)
    by_ref = frozenset(i for i in range(n) if sig[i][0] is None)
    float_type = weak_float_type(sig[i][1] for i in arr_idx)
    # the kernel's parameters without Numba: the step count, the start, each parameter (an
    # array, or a number as a 1-element array), then the scratch, seed, info and control
    # buffers, always of the same types (and a tile kernel's halo scratch)
    types_key = ("ffi-v1", np.dtype(n_dtype).str, np.dtype(t0_dtype).str,
                 tuple((np.dtype(dtype).str, len(shape) if shape is not None else 1) for shape, dtype in sig))
    plan = halo = None
    if scope in ("tile", "auto-tile"):
        try:
            plan, image_id, halo = _cuda_tile_kernel(mk, sig, n_dtype, t0_dtype, threads, blocks, types_key, by_ref,
                                                     float_type)
        except (LaunchError, ArgumentError) as exc:
            if scope == "tile":
                raise
            # as a direct call: the tiles do not fit on this device (or the swap pairs' arrays
            # differ in shape or dtype), so the scope that "auto" resolves to
            log.debug("loopkern: kernel.jax with scope='auto' for step '%s' keeps the grid scope: %s", spec.name, exc)
            scope = resolve_scope("auto", _largest_array(sig), spec.parallel, spec.light_elements)
    if plan is None:
        # block scope holds its arrays in shared memory as the direct call does (plan_staging),
        # unless ``stage`` is False (a short run, see STAGE_MIN_STEPS). The arrays the kernel
        # writes are results of the custom call, each a buffer of its own (an aliased input is
        # copied by XLA unless donated), so no staged array shares memory with another argument
        # that the kernel writes
        staged, stage_bytes = (), 0
        if scope == "block" and stage:
            staged, stage_bytes = plan_staging(spec, _device_argv(spec, sig), check_overlap=False)
        variant = dict(scope=scope, by_ref=by_ref, staged=staged, float_type=float_type,
                       index_bits=index_bits_for([math.prod(sig[i][0]) for i in arr_idx], False, staged),
                       sized=threads is None and blocks is None)
        device, cc, sms = xla_ffi.current_device()
        kernel, image_id = _ffi_kernel(mk, variant, n_dtype, t0_dtype, sig, types_key, device, cc, stage_bytes)
        if mk.dispatcher.warp_split:
            work *= WARP            # a warp per iteration of its few-iteration loop (see warpsplit.py)
        plan = cuda_config(kernel, scope, work, threads, blocks, simulator=False, shared=stage_bytes, sms=sms)
    xla_ffi.register_cuda_target()

    # The custom call is the only operation XLA runs for the call: every input is a parameter
    # of the jitted function, a constant, or a reshape of a parameter (a bitcast); nothing is
    # aliased but the arrays, so XLA fills or copies no buffer for it.
    # inputs: nsteps, start, the parameters (arrays and 1-element scalars) in order, the seed
    # (two uint32 words, and a third that differs from the first: XLA turns a constant whose
    # elements are all equal, such as the default seed's [0, 0], into a broadcast, an op that
    # would run every call; the kernel sees the first two)
    # results: the arrays (aliased to their inputs), redf, redi, info (bytes, viewed as 8-byte
    # elements), the control block, a tile kernel's halo scratch (whose cells each round
    # publishes before it reads any), and the steps done (an int32 scalar) if the call returns them.
    # The control block is uint32 words: the HOST_SIZE int64 slots, then the grid barrier's
    # counter (which must start with its low 31 bits clear) and the count of finished blocks
    # (which must start at zero); the handler zeroes it all and
    # writes the timeout on XLA's stream before the launch, and copies the low word of the
    # STEPS slot to the step count after it (ffi_shim.c), so both come without XLA ops.
    na = len(arr_idx)
    ctl, count = na + 3, na + 4 + (halo is not None)
    results = [jax.ShapeDtypeStruct(sig[i][0], sig[i][1]) for i in arr_idx]
    results += [jax.ShapeDtypeStruct((2, plan.blocks * _SCRATCH_VIEW), jnp.uint8),
                jax.ShapeDtypeStruct((2, plan.blocks * _SCRATCH_VIEW), jnp.uint8),
                jax.ShapeDtypeStruct((2 * _SCRATCH_VIEW,), jnp.uint8),
                jax.ShapeDtypeStruct((2 * HOST_SIZE + 2,), jnp.uint32)]
    if halo is not None:
        results.append(jax.ShapeDtypeStruct((plan.halo,), halo))
    if with_count:
        results.append(jax.ShapeDtypeStruct((), jnp.int32))
    aliases = {2 + i: arr_idx.index(i) for i in arr_idx}
    # five numbers per kernel parameter: (0: argument / 1: result, index, view as elements of
    # this many bytes (0: as it is), byte offset, elements (0: all)); see ffi_shim.c
    layout = [0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    for i in range(n):
        layout += [1, arr_idx.index(i), 0, 0, 0] if i in arr_idx else [0, 2 + i, 0, 0, 0]
    layout += [1, na, _SCRATCH_VIEW, 0, 0,                  # redf
               1, na + 1, _SCRATCH_VIEW, 0, 0,              # redi
               1, ctl, 4, 8 * HOST_SIZE, 2,                 # the barrier's and the finish's counters
               0, n + 2, 0, 0, 2,                           # the seed: the first two words
               1, na + 2, _SCRATCH_VIEW, 0, 0,              # info
               1, ctl, 8, 0, HOST_SIZE]                     # the control block
    if halo is not None:
        layout += [1, na + 4, 0, 0, 0]                      # the halo scratch
    seed_words = np.array([seed & 0xFFFFFFFF, seed >> 32, (seed & 0xFFFFFFFF) ^ 1], np.uint32)
    call = jax.ffi.ffi_call(xla_ffi.TARGET, tuple(results), input_output_aliases=aliases,
                            vmap_method="sequential")
    # the kernel by its image id: the handler loads it into the context of the stream XLA runs
    # the call on (each device of a mesh under shard_map), and checks that the grid fits there
    attrs = dict(kernel=np.int64(image_id), blocks=np.int64(plan.blocks), threads=np.int64(plan.threads),
                 cooperative=np.int64(1 if plan.scope in ("grid", "tile") else 0), layout=np.array(layout, np.int64),
                 control=np.int64(ctl), timeout_ns=np.int64(int(timeout * 1e9) if timeout is not None else 0),
                 timeout_slot=np.int64(TIMEOUT_NS), count=np.int64(count if with_count else -1),
                 steps_slot=np.int64(STEPS), shared=np.int64(plan.shared),
                 aliases=np.array([x for kv in sorted(aliases.items()) for x in kv] or [-1, -1], np.int64))

    def core(nsteps_buf, t0_buf, *vals):
        outs = call(nsteps_buf, t0_buf, *vals, seed_words, **attrs)
        # the step count (when there is none, the control block stands in: nobody reads it)
        return tuple(outs[:na]) + (outs[-1],)
    return core, plan
