"""Variants shared by the workloads: loopkern in its scopes, kernel.jax inside jax.jit, and
jitted JAX loops."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .harness import Impl, on_device, to_host


#: Experiments that bench.py times as variants of their own, in the same interleaved rounds as
#: the rest (an A/B that separate runs cannot give: those moved untouched rows by 1-4% in
#: session 41): ``bounds`` (threads, blocks per SM), or "off", adds ``loopkern[grid,bounds=T/B]``
#: or ``loopkern[grid,bounds=off]`` (``dispatch.kernels.LAUNCH_BOUNDS``), ``split`` adds
#: ``loopkern[tile,split]`` (``dispatch.kernels.SPLIT_EXCHANGE``), ``prefetch_rim`` False adds
#: the drop-in Jacobi body without its rim's early loads (``jaxloops.lower.PREFETCH_RIM``). Set
#: by bench.py's --launch-bounds, --split-exchange and --prefetch-rim off.
EXPERIMENTS: dict = {}

#: the module that holds each switch an experiment sets
_KNOB_MODULES = {"LAUNCH_BOUNDS": "loopkern.dispatch.kernels", "SPLIT_EXCHANGE": "loopkern.dispatch.kernels",
                 "PREFETCH_RIM": "loopkern.jaxloops.lower"}


@contextmanager
def _knobs(values: dict):
    """The switches named in ``values`` (keys of ``_KNOB_MODULES``) set for the duration: a
    kernel's source is rendered with them when a call of a new kernel instance first needs it,
    and a drop-in loop body is lowered with them when it is first traced."""
    import importlib
    mods = {k: importlib.import_module(_KNOB_MODULES[k]) for k in values}
    old = {k: getattr(mods[k], k) for k in values}
    for k, v in values.items():
        setattr(mods[k], k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mods[k], k, v)


def with_knobs(impl: Impl, knobs: dict) -> Impl:
    """``impl`` with the experiment switches ``knobs`` (see :func:`_knobs`) set during each of
    its runs: for a JAX variant, the trace that builds its kernel happens in the first."""
    run = impl.run

    def knobbed(steps):
        with _knobs(knobs):
            return run(steps)
    impl.run = knobbed
    return impl


def _bounds_knob():
    """(label, switches) of ``EXPERIMENTS["bounds"]`` ((threads, blocks per SM), or "off" for
    kernels without launch bounds), or None when it is not set."""
    bounds = EXPERIMENTS.get("bounds")
    if not bounds:
        return None
    if bounds == "off":
        return "bounds=off", {"LAUNCH_BOUNDS": None}
    return f"bounds={bounds[0]}/{bounds[1]}", {"LAUNCH_BOUNDS": tuple(bounds)}


def bounds_variant(name: str, make):
    """With ``EXPERIMENTS["bounds"]`` set: the variant ``make`` (case -> Impl) again under
    those launch bounds, as (name, make); else None."""
    knob = _bounds_knob()
    if knob is None:
        return None
    label, switches = knob
    return f"{name} [{label}]", lambda case: with_knobs(make(case), switches)


def prefetch_rim_variant(name: str, make):
    """With ``EXPERIMENTS["prefetch_rim"]`` False: the drop-in variant ``make`` (case -> Impl)
    again with its body lowered without the rim's early loads, as (name, make); else None. (The
    lowered kernels are cached by their source, so the two variants get kernels of their own.)"""
    if EXPERIMENTS.get("prefetch_rim", True):
        return None
    return f"{name} [prefetch-rim=off]", lambda case: with_knobs(make(case), {"PREFETCH_RIM": False})


def _experiments(scope: str, experiments) -> list:
    """(label, switches) of the ``EXPERIMENTS`` set, of those in ``experiments``, that change
    ``scope``'s kernels."""
    out = []
    knob = _bounds_knob()
    if scope == "grid" and knob and "bounds" in experiments:
        out.append((f"grid,{knob[0]}", knob[1]))
    if scope == "tile" and EXPERIMENTS.get("split") and "split" in experiments:
        out.append(("tile,split", {"SPLIT_EXCHANGE": True}))
    return out


def loopkern_impl(gpu, kernel, arrays: dict, scalars: tuple, order, swap_first=None, **opts):
    """An Impl that calls ``kernel`` on device copies of ``arrays`` (in ``order``)."""
    init = {k: np.array(v) for k, v in arrays.items()}
    dev = {k: on_device(gpu, v) for k, v in init.items()}
    info = {}

    def run(steps):
        args = [dev[k] for k in order] + list(scalars)
        kw = dict(opts)
        if kernel.spec.returns_condition:
            r = kernel(*args, max_steps=steps, **kw)
        else:
            r = kernel(*args, steps=steps, **kw)
        if not info and gpu:
            # (once, in the untimed check run) a kernel that split its exchange's barrier
            # (bench.py --split-exchange, one step per exchange only) says so in its row
            if any("barrier split in two" in src.text for src in kernel.dispatcher.kernels.sources.values()):
                info["split"] = True
        info.update(scope=r.scope, blocks=r.blocks, threads=r.threads)
        return r.steps

    def reset():
        for k, v in init.items():
            if gpu:
                dev[k].copy_to_device(v)
            else:
                dev[k][...] = v

    return Impl(run, lambda: to_host(gpu, dev[swap_first or order[0]]), reset, None, info)


def loopkern_variants(gpu, make_kernel, arrays, scalars, order, scopes, sweep_blocks=(), sweep_threads=(),
                      experiments=("bounds", "split")):
    """loopkern's variants of a workload: one per scope, the block and thread sweeps, and the
    ``EXPERIMENTS`` set (of those in ``experiments``) beside the scope they change."""
    out = []
    for scope in scopes:
        out.append((f"loopkern[{scope}]" if gpu else "loopkern[cpu]",
                    lambda case, s=scope: loopkern_impl(gpu, make_kernel(), arrays(case), scalars(case), order,
                                                        scope=s if gpu else None,
                                                        backend="cuda" if gpu else "cpu")))
        for label, switches in (_experiments(scope, experiments) if gpu else ()):
            out.append((f"loopkern[{label}]",
                        lambda case, s=scope, sw=switches: with_knobs(
                            loopkern_impl(gpu, make_kernel(), arrays(case), scalars(case), order, scope=s,
                                          backend="cuda"), sw)))
    for b in sweep_blocks:
        out.append((f"loopkern[grid,blocks={b}]",
                    lambda case, b=b: loopkern_impl(gpu, make_kernel(), arrays(case), scalars(case), order,
                                                    scope="grid", blocks=b, threads=256)))
    for t in sweep_threads:
        out.append((f"loopkern[block,threads={t}]",
                    lambda case, t=t: loopkern_impl(gpu, make_kernel(), arrays(case), scalars(case), order,
                                                    scope="block", threads=t)))
    return out


def jax_impl(fn, init, result_index=0, steps_index=None):
    """An Impl for a jitted JAX function of (state..., steps) built per step count."""
    import jax
    import jax.numpy as jnp
    state = tuple(jnp.asarray(x) for x in init)
    cache, box = {}, {}

    def run(steps):
        if steps not in cache:
            cache[steps] = jax.jit(lambda *s: fn(*s, steps))
        box["r"] = cache[steps](*state)

    def sync():
        jax.block_until_ready(box["r"])

    def result():
        r = box["r"]
        return np.asarray(r[result_index] if isinstance(r, tuple) else r)
    count = None if steps_index is None else (lambda: int(box["r"][steps_index]))
    return Impl(run, result, sync=sync, count=count)


def loopkern_jax_variant(make_kernel, inputs, scalars, result_index=0):
    """loopkern through kernel.jax inside jax.jit (the XLA FFI custom call on a GPU)."""
    def make(case):
        import jax
        import jax.numpy as jnp
        k = make_kernel()
        state = [jnp.asarray(x) for x in inputs(case)]
        cache, box = {}, {}

        def run(steps):
            if steps not in cache:
                kw = "max_steps" if k.spec.returns_condition else "steps"
                cache[steps] = jax.jit(lambda *xs: k.jax(*xs, *scalars(case), **{kw: steps}))
            box["r"] = cache[steps](*state)
        count = (lambda: int(box["r"][-1])) if k.spec.returns_condition else None
        return Impl(run, lambda: np.asarray(box["r"][result_index]), sync=lambda: jax.block_until_ready(box["r"]),
                    count=count)
    return ("loopkern kernel.jax in jax.jit", make)

def jax_loop_variants(step, unpack=lambda s: s):
    import jax
    return [
        ("jax.lax.fori_loop", lambda case: jax_impl(
            lambda u, steps: jax.lax.fori_loop(0, steps, lambda i, x: step(x), u), [case.data["u0"]])),
        ("jax.lax.scan(unroll=16)", lambda case: jax_impl(
            lambda u, steps: jax.lax.scan(lambda x, _: (step(x), None), u, None, length=steps, unroll=16)[0],
            [case.data["u0"]])),
    ]

