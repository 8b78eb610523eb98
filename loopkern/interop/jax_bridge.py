"""``kernel.jax(...)``: a megakernel as a functional JAX operation, eager or inside ``jax.jit``.

On a GPU the call lowers to an XLA FFI custom call (``xla_ffi.py``) that launches the
Numba-compiled kernel on XLA's own stream. Array parameters are aliased to the outputs, so
under ``donate_argnums`` no buffer is copied; scalars and the step count travel as 1-element
device buffers, so they may be traced values. On JAX's CPU backend the same call runs the
CPU-compiled kernel through ``jax.pure_callback`` (Python once per call, not per step).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..dispatch import checks
from ..dispatch.args import check_dtype, weak_float_type
from ..errors import ArgumentError, LoopkernError
from ..runtime.layout import HOST_SIZE, TIMEOUT_NS

_SCRATCH_VIEW = 8   # redf, redi and info are 8-byte elements, passed to XLA as bytes


def _is_jax_array(x) -> bool:
    import jax
    return isinstance(x, jax.Array)


def _step_count(label, value):
    """``steps``/``max_steps``/``start``: an int >= 0 or a 0-d integer JAX array, as a 1-element array."""
    import jax.numpy as jnp
    if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or (
            _is_jax_array(value) and value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.integer))):
        raise ArgumentError(f"{label}={value!r}: expected an int or a 0-d integer JAX array")
    if isinstance(value, numbers.Integral) and value < 0:
        raise ArgumentError(f"{label}={value}: must be >= 0")
    return jnp.asarray(value).reshape(1)


def _prepare(mk, args, kwargs, steps, max_steps):
    """Check the call and split it into arrays, scalars and the step count (all JAX values)."""
    import jax.numpy as jnp

    spec = mk.spec
    if (steps is None) == (max_steps is None):
        raise ArgumentError(f"{spec.name}.jax(): pass exactly one of steps= or max_steps=")
    nsteps = _step_count("steps" if steps is not None else "max_steps", steps if steps is not None else max_steps)
    bound = mk.dispatcher.bind_names(args, kwargs)
    check_array_use, check_atomic_dtype, check_kind, check_swap_pair = (
        checks.check_array_use, checks.check_atomic_dtype, checks.check_kind, checks.check_swap_pair)
    arrays, scalars = {}, {}
    for i, p in enumerate(spec.params):
        v = bound[p.name]
        if _is_jax_array(v) and v.ndim > 0:
            check_kind(p, True, f"an array of shape {v.shape}")
            check_dtype(p.name, np.dtype(v.dtype))
            check_array_use(p, v.shape, spec.filename)
            check_atomic_dtype(p, np.dtype(v.dtype))
            arrays[i] = v
        elif isinstance(v, np.ndarray) and v.ndim > 0 or hasattr(v, "__cuda_array_interface__"):
            raise ArgumentError(f"argument '{p.name}': kernel.jax takes JAX arrays, got {type(v).__name__}; "
                                f"convert it with jnp.asarray, or call the kernel itself to update it in place")
        else:
            check_kind(p, False, type(v).__name__)
            if isinstance(v, complex) or (_is_jax_array(v) and jnp.issubdtype(v.dtype, jnp.complexfloating)):
                raise ArgumentError(f"argument '{p.name}': complex numbers are not supported yet")
            if not (isinstance(v, (numbers.Real, np.generic)) or _is_jax_array(v)):
                raise ArgumentError(f"argument '{p.name}': expected a JAX array or a number, got {type(v).__name__}")
            s = jnp.asarray(v)
            check_dtype(p.name, np.dtype(s.dtype), "scalar")
            scalars[i] = s.reshape(1)
    for a, b in spec.swap:
        x, y = arrays.get(a), arrays.get(b)
        names = (spec.params[a].name, spec.params[b].name)
        if x is None or y is None:
            raise ArgumentError(f"swap pair {names}: both must be JAX arrays")
        check_swap_pair(names, x.shape, x.dtype, y.shape, y.dtype)
    return arrays, scalars, nsteps


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


def jax_call(mk, args, kwargs, *, steps=None, max_steps=None, start=0, backend=None, scope=None, threads=None,
             blocks=None, seed=0, timeout=None):
    """Implementation of :meth:`loopkern.MegaKernel.jax` (see there)."""
    import jax

    seed = checks.check_seed(seed)
    timeout = checks.check_seconds("timeout", timeout)
    arrays, scalars, nsteps = _prepare(mk, args, kwargs, steps, max_steps)
    t0 = _step_count("start", start)
    platform = _platform(mk, arrays, backend)
    order = [i for i in range(len(mk.spec.params))]
    arr_idx = [i for i in order if i in arrays]
    inputs = [nsteps, t0] + [arrays[i] if i in arrays else scalars[i] for i in order]

    if platform == "cuda":
        core = _cuda_core(mk, arrays, scalars, nsteps, t0, scope, threads, blocks, seed, timeout)
    else:
        core = _cpu_core(mk, arrays, scalars, nsteps, seed, timeout)

    @jax.custom_jvp
    def call(*xs):
        return core(*xs)

    @call.defjvp
    def _no_derivative(primals, tangents):
        raise LoopkernError(f"kernel.jax: differentiating through megakernel '{mk.spec.name}' is not "
                            f"supported yet (no derivative rule); use jax.lax.stop_gradient on its inputs "
                            f"or differentiate a JAX version of the loop")

    outs = call(*inputs)
    result = tuple(outs[: len(arr_idx)])
    if mk.spec.returns_condition or timeout is not None:
        result = result + (outs[-1],)
    return result


def _cpu_core(mk, arrays, scalars, nsteps, seed, timeout):
    import jax
    import jax.numpy as jnp

    arr_idx = [i for i in range(len(mk.spec.params)) if i in arrays]
    shapes = [jax.ShapeDtypeStruct(arrays[i].shape, arrays[i].dtype) for i in arr_idx]
    shapes.append(jax.ShapeDtypeStruct((), jnp.int32))

    def host(n, t0, *vals):
        call_args = []
        for i, v in enumerate(vals):
            call_args.append(np.array(v) if i in arrays else np.asarray(v).reshape(())[()])
        # a traced negative start runs no step (as a traced negative step count does)
        t0 = int(np.asarray(t0).reshape(()))
        n = int(np.asarray(n).reshape(())) if t0 >= 0 else 0
        run = mk(*call_args, steps=max(n, 0), start=max(t0, 0), backend="cpu", seed=seed, timeout=timeout)
        return tuple(call_args[i] for i in arr_idx) + (np.int32(run.steps),)

    def core(n, t0, *vals):
        return jax.pure_callback(host, tuple(shapes), n, t0, *vals, vmap_method="sequential")
    return core


def _cuda_core(mk, arrays, scalars, nsteps, t0, scope, threads, blocks, seed, timeout):
    import jax
    import jax.numpy as jnp
    from numba import types

    from ..dispatch.config import cuda_config, resolve_scope
    from . import xla_ffi

    spec = mk.spec
    n = len(spec.params)
    arr_idx = [i for i in range(n) if i in arrays]
    work = max([math.prod(arrays[i].shape) for i in arr_idx] or [1])
    defaults = mk.dispatcher.defaults
    scope = resolve_scope(scope or defaults["scope"], work, spec.parallel, spec.light_elements)
    checks.check_thread_scope(spec, scope)
    by_ref = frozenset(scalars)
    compiled = mk.dispatcher.kernels.get("cuda", scope, by_ref=by_ref,
                          float_type=weak_float_type(a.dtype for a in arrays.values()))

    def nb(dtype, ndim):
        from numba.np.numpy_support import from_dtype
        return types.Array(from_dtype(np.dtype(dtype)), ndim, "C")

    sig = [nb(nsteps.dtype, 1), nb(t0.dtype, 1)]
    for i in range(n):
        sig.append(nb(arrays[i].dtype, arrays[i].ndim) if i in arrays else nb(scalars[i].dtype, 1))
    sig += [types.float64[:, ::1], types.int64[:, ::1], types.uint32[::1], types.uint32[::1], types.int64[::1],
            types.int64[::1]]
    kernel, func = compiled.load_for_ffi(tuple(sig), xla_ffi)
    plan = cuda_config(kernel, scope, work, threads or defaults["threads"], blocks or defaults["blocks"],
                       simulator=False)
    xla_ffi.register_cuda_target()

    # inputs: nsteps, start, params (arrays and 1-element scalars) in order, zeroed barrier counter, seed,
    # the control block (uint32 words of int64 slots: the timeout in, the step count out)
    # results: arrays (aliased), barrier (aliased), redf, redi, info (bytes, viewed as 8-byte),
    # the control block (aliased)
    na = len(arr_idx)
    results = [jax.ShapeDtypeStruct(arrays[i].shape, arrays[i].dtype) for i in arr_idx]
    results += [jax.ShapeDtypeStruct((1,), jnp.uint32),
                jax.ShapeDtypeStruct((2, plan.blocks * _SCRATCH_VIEW), jnp.uint8),
                jax.ShapeDtypeStruct((2, plan.blocks * _SCRATCH_VIEW), jnp.uint8),
                jax.ShapeDtypeStruct((2 * _SCRATCH_VIEW,), jnp.uint8),
                jax.ShapeDtypeStruct((2 * HOST_SIZE,), jnp.uint32)]
    aliases = {2 + i: arr_idx.index(i) for i in arr_idx}
    aliases[2 + n] = na
    aliases[4 + n] = na + 4
    layout = [0, 0, 0, 0, 1, 0]
    for i in range(n):
        layout += [1, arr_idx.index(i), 0] if i in arrays else [0, 2 + i, 0]
    layout += [1, na + 1, _SCRATCH_VIEW, 1, na + 2, _SCRATCH_VIEW, 1, na, 0, 0, n + 3, 0, 1, na + 3, _SCRATCH_VIEW,
               1, na + 4, _SCRATCH_VIEW]
    seed_words = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)
    control = np.zeros(HOST_SIZE, np.int64)
    control[TIMEOUT_NS] = int(timeout * 1e9) if timeout is not None else 0
    call = jax.ffi.ffi_call(xla_ffi.TARGET, tuple(results), input_output_aliases=aliases,
                            vmap_method="sequential")
    attrs = dict(func=np.int64(func), blocks=np.int64(plan.blocks), threads=np.int64(plan.threads),
                 cooperative=np.int64(1 if plan.scope == "grid" else 0), layout=np.array(layout, np.int64))

    def core(nsteps_buf, t0_buf, *vals):
        outs = call(nsteps_buf, t0_buf, *vals, jnp.zeros((1,), jnp.uint32), jnp.asarray(seed_words),
                    jnp.asarray(control.view(np.uint32)), **attrs)
        # slot 0 of the control block is the int64 step count; its low 32 bits (little-endian)
        steps_done = jax.lax.bitcast_convert_type(outs[-1][0], jnp.int32)
        return tuple(outs[:na]) + (steps_done,)
    return core
