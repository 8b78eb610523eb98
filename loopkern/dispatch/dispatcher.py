"""The call path of one kernel: options, arguments, the plan cache, and running a plan.

``MegaKernel.__call__`` and ``MegaKernel.start`` bind their arguments and hand them to a
:class:`Dispatcher`. A call:

1. checks the per-call values (``steps``, ``start``, ``seed``, ``timeout``, ...) with cheap
   type tests, falling back to the full checks (``checks.py``) for anything unusual;
2. computes the call's signature (``signature.call_key``) and looks its plan up;
3. on a miss (or for arguments without a cheap key), takes the full path: classifies and
   checks every argument (``args.py``, ``checks.py``), picks the backend, scope, staging and
   grid (``config.py``), compiles (``kernels.py``) and makes a plan (``plan.py``), cached
   under the signature;
4. runs the plan: per-call value checks (int64 range, pointers of swap pairs), then the
   launch and the wait.

Every bad-input error of the full path is raised before anything is written or launched; a
cached plan is only used for arguments whose signature equals the one that passed them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

import numpy as np

from ..compile import simulator_enabled
from ..errors import ArgumentError, BoundsError, HangError, LaunchError, LoopkernError, StepError
from ..progress import check_progress
from ..runs import (SLICE_START, Run, RunHandle, EventWaiter, ThreadWaiter, _Stalled, holding_runs, note_cancelled,
                    run_inline,
                    slow_step_message, wait_cuda)
from ..runtime.layout import CANCEL, DBG_SIZE, HOST_SIZE, REQUEST, STEPS, STOPPED, WHY
from ..warpsplit import WARP, step_has_warp_split
from . import checks, driver
from .args import ArrayArg, apply_weak_floats, classify, overlaps, weak_float_type
from .config import (AUTO_TILE_2D_MIN_ELEMENTS, AUTO_TILE_HALO_SHARE, AUTO_TILE_MIN_ELEMENTS, LaunchConfig,
                     choose_backend, cuda_config, first_tile_blocks, numba_chip, plan_staging, resolve_scope,
                     tile_config, tile_layout)
from .kernels import KernelCache, check_types, index_bits_for
from .plan import PlanCache, make_plan, refused_pairs
from .signature import LastCall, call_key

log = logging.getLogger("loopkern")

CPU_CONFIG = LaunchConfig("cpu", 1, 1)


def _simulator() -> bool:
    return simulator_enabled()


class Options:
    """One call's options, checked. ``key`` is the part a plan depends on."""

    __slots__ = ("label", "nsteps", "start", "seed", "timeout", "watchdog", "backend", "scope", "threads",
                 "blocks", "debug", "control", "progress", "key")

    def __init__(self, nsteps=0, start=0, seed=0, timeout=None, watchdog=None):
        self.label, self.nsteps, self.start, self.seed, self.timeout, self.watchdog = \
            "steps", nsteps, start, seed, timeout, watchdog
        self.progress = False


_START_LIMIT, _SEED_LIMIT = 2 ** 62, 2 ** 64


def _options_key(opts: tuple) -> tuple:
    """The launch options as a dict key that tells ``True`` from ``1`` and ``256`` from
    ``256.0`` (equal as keys, but only the first of each passes the checks)."""
    return opts + tuple(map(type, opts))


#: the keywords of ``kernel(...)`` and ``kernel.start(...)``, and of ``kernel.jax(...)``, besides
#: the step's parameters (named in the error for a keyword that is neither)
CALL_OPTIONS = ("steps", "max_steps", "start", "backend", "scope", "threads", "blocks", "seed", "progress",
                "timeout", "debug", "watchdog")
JAX_OPTIONS = ("steps", "max_steps", "start", "backend", "scope", "threads", "blocks", "seed", "timeout",
               "checkpoint_every", "adjoint_form")


class Dispatcher:
    """Everything between a :class:`~loopkern.api.MegaKernel` call and its kernel."""

    def __init__(self, spec, defaults: dict):
        self.spec = spec
        self.defaults = defaults
        self.kernels = KernelCache(spec)
        self.plans = PlanCache()
        self.nparams = len(spec.params)
        self.signature = inspect.Signature(
            [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in spec.params])
        self._swapped = {i for pair in spec.swap for i in pair}
        self._launch_options: dict = {}
        self._last: LastCall | None = None      # the last common call's plan (signature.LastCall)

    # -- binding -------------------------------------------------------------------------------
    def bind_names(self, args, kwargs, call="", options=CALL_OPTIONS) -> dict:
        """Parameter name -> value, or an ArgumentError naming what is missing or extra.

        ``call``: how the user called (``".jax"``); ``options``: the keywords that call takes
        besides the step's parameters, named in the error."""
        try:
            return dict(self.signature.bind(*args, **kwargs).arguments)
        except TypeError as exc:
            names = ", ".join(p.name for p in self.spec.params)
            extra = next((k for k in kwargs if k in CALL_OPTIONS + JAX_OPTIONS and k not in options), None)
            if extra is not None:
                raise ArgumentError(f"{self.spec.name}{call}(): takes no {extra}= (an option of "
                                    f"{'kernel.jax' if extra in JAX_OPTIONS else 'calling the kernel directly'}); "
                                    f"its options are {', '.join(o + '=' for o in options)}") from None
            known = {p.name for p in self.spec.params}
            unknown = [k for k in kwargs if k not in known]
            if unknown:
                # a misspelt name: say so, not only that the real one is missing
                import difflib
                near = difflib.get_close_matches(unknown[0], sorted(known) + list(options), n=1)
                raise ArgumentError(f"{self.spec.name}{call}(): got an unexpected keyword argument '{unknown[0]}'"
                                    + (f" (did you mean '{near[0]}'?)" if near else "")
                                    + f"; the step takes ({names}) after the step index '{self.spec.index_param}', "
                                      f"plus the options {', '.join(o + '=' for o in options)}") from None
            raise ArgumentError(f"{self.spec.name}{call}(): {exc}; the step takes ({names}) after the step index "
                                f"'{self.spec.index_param}', plus the options {', '.join(o + '=' for o in options)}"
                                ) from None

    def values(self, args, kwargs):
        """The arguments in parameter order."""
        if not kwargs and len(args) == self.nparams:
            return args
        bound = self.bind_names(args, kwargs)
        return [bound[p.name] for p in self.spec.params]

    def classify(self, values) -> list:
        """Full classification and checks of every argument (ArgumentError on the first problem)."""
        spec = self.spec
        out = []
        for k, p in enumerate(spec.params):
            a = classify(p.name, values[k])
            is_array = isinstance(a, ArrayArg)
            checks.check_kind(p, is_array, f"an array of shape {a.shape}" if is_array
                              else f"a scalar {type(a.value).__name__}")
            if is_array:
                checks.check_array_use(p, a.shape, spec.filename)
                checks.check_atomic_dtype(p, a.dtype)
                checks.check_writable(p, a, k in self._swapped)
                checks.check_distinct_elements(p, a, k in self._swapped)
            else:
                checks.check_integer(p, np.asarray(a.value).dtype, f"the {np.asarray(a.value).dtype} {a.value}",
                                     spec.filename)
            out.append(a)
        for i, j in spec.swap:
            a, b = out[i], out[j]
            pair = f"swap pair ('{a.name}', '{b.name}')"
            if not isinstance(a, ArrayArg) or not isinstance(b, ArrayArg):
                raise ArgumentError(f"{pair}: both must be arrays")
            checks.check_swap_pair((a.name, b.name), a.shape, a.dtype, b.shape, b.dtype)
            if a.where != b.where:
                raise ArgumentError(f"{pair}: one array is on the GPU and the other on the host")
        for i, j, message in refused_pairs(spec):
            a, b = out[i], out[j]
            if isinstance(a, ArrayArg) and isinstance(b, ArrayArg) and (a.value is b.value or overlaps(a, b)):
                raise ArgumentError(message)
        return out

    # -- options -------------------------------------------------------------------------------
    def options(self, steps, max_steps, start, backend, scope, threads, blocks, seed, progress, timeout, debug,
                watchdog, control) -> Options:
        """The call's options, checked (ArgumentError naming the option otherwise). The common
        values pass plain type tests; the launch options are checked once per combination."""
        o = Options()
        if max_steps is None and type(steps) is int and 0 <= steps < 2 ** 63:
            o.label, o.nsteps = "steps", steps
        else:
            if steps is not None and max_steps is not None:
                raise ArgumentError("pass either steps= or max_steps=, not both")
            if steps is None and max_steps is None:
                raise ArgumentError(f"{self.spec.name}(): pass steps=N (or max_steps=N for a step that returns a "
                                    f"condition)")
            o.label = "steps" if steps is not None else "max_steps"
            o.nsteps = checks.check_count(o.label, steps if steps is not None else max_steps, allow_none=False,
                                          maximum=2 ** 63 - 1)
        o.start = start if type(start) is int and 0 <= start < 2 ** 62 else checks.check_start(start)
        o.seed = seed if type(seed) is int and 0 <= seed < 2 ** 64 else checks.check_seed(seed)
        o.progress = progress if progress is False else check_progress(progress)
        o.timeout = None if timeout is None else checks.check_seconds("timeout", timeout)
        o.watchdog = watchdog if type(watchdog) is float and watchdog > 0 else checks.check_seconds(
            "watchdog", watchdog)
        try:
            launch = self._launch_options[_options_key((backend, scope, threads, blocks, debug, control))]
        except (KeyError, TypeError):
            launch = self._check_launch_options(backend, scope, threads, blocks, debug, control)
        o.backend, o.scope, o.threads, o.blocks, o.debug, o.control = launch
        ctx = 0
        if o.backend == "cuda" and not _simulator():
            driver.ensure_context()
            ctx = driver.current_context()
        o.key = launch + (ctx,)
        return o

    def _check_launch_options(self, backend, scope, threads, blocks, debug, control) -> tuple:
        d = self.defaults
        b = checks.check_choice("backend", backend if backend is not None else d["backend"], checks.BACKENDS)
        s = checks.check_choice("scope", scope if scope is not None else d["scope"], checks.SCOPES)
        t = checks.check_count("threads", threads if threads is not None else d["threads"], minimum=1)
        n = checks.check_count("blocks", blocks if blocks is not None else d["blocks"], minimum=1)
        if debug is not True and debug is not False:
            raise ArgumentError(f"debug={debug!r}: expected True or False")
        launch = (choose_backend(b), s, t, n, debug, bool(control))
        try:
            # "auto" is resolved once per process, so the resolved backend may be remembered
            self._launch_options[_options_key((backend, scope, threads, blocks, debug, control))] = launch
        except TypeError:
            pass
        return launch

    # -- plans ---------------------------------------------------------------------------------
    def plan(self, values, o: Options):
        """(the plan for this call, the values to run it with, the GPU arrays' pointers). A cached
        plan if the signature matches one seen before and the values pass its per-call checks;
        else the full path (whose plan is cached when its values pass the same checks)."""
        self.refuse_held(values)
        try:
            sig = call_key(values)
        except TypeError:         # an unhashable attribute somewhere: no cheap key
            sig = None
        key = None if sig is None else o.key + sig
        if key is not None:
            plan = self.plans.get(key)
            if plan is not None:
                ptrs = plan.check_values(values)
                if ptrs is not None:
                    return plan, values, ptrs
        plan, run_values = self._make_plan(values, o)
        ptrs = plan.check_values(run_values)
        if ptrs is None:          # staging was planned for these very values: cannot happen
            raise AssertionError("a new plan refused the values it was made for")
        if key is not None:
            self.plans.put(key, plan)
        return plan, run_values, ptrs

    def _make_plan(self, values, o: Options):
        spec = self.spec
        argv = self.classify(values)
        float_type = weak_float_type(a.dtype for a in argv if isinstance(a, ArrayArg))
        if float_type is None and o.backend == "cuda" and _simulator():
            # Numba types a Python float (a literal, an argument) as float64 beside any array;
            # the simulator runs the kernel as Python, where NumPy 2 makes it float32 beside a
            # float32 element: written float64 there, mixed-precision steps compute as on a GPU
            float_type = "float64"
        argv = apply_weak_floats(argv, float_type)
        run_values = [a.value for a in argv]
        # on both backends, so that a call the CPU runs is one a GPU runs too
        checks.check_thread_scope(spec, o.scope)
        if o.backend == "cpu":
            for a in argv:
                if isinstance(a, ArrayArg) and a.where != "host":
                    raise ArgumentError(f"argument '{a.name}' is on the GPU, but backend='cpu' needs NumPy arrays; "
                                        f"copy it to the host or use backend='cuda'")
            compiled = self.kernels.get("cpu", "grid", debug=o.debug, control=o.control, float_type=float_type)
            check_types(spec, compiled, compiled.types_of(run_values), run_values)
            host = np.zeros(HOST_SIZE, np.int64)
            full = (np.int64(0), np.int64(0), *run_values, np.uint64(0), host) + \
                ((np.zeros(DBG_SIZE, np.int64),) if o.debug else ())
            entry = compiled.specialize(full)
            return make_plan(spec, "cpu", argv, compiled, entry, CPU_CONFIG, debug=o.debug, staged=(),
                             simulator=False), run_values
        from ..compile import simulator_enabled
        sim = simulator_enabled()
        work = max([a.size for a in argv if isinstance(a, ArrayArg)] or [1])
        scope = resolve_scope(o.scope, work, spec.parallel, spec.light_elements)
        if scope in ("tile", "cluster") and any(isinstance(argv[i], ArrayArg) and argv[i].size == 0
                                                for pair in spec.swap for i in pair):
            # nothing to keep on chip (a tile of no cells): the grid scope runs the steps,
            # once the step is known to be one tile mode covers
            self.tile_stencil(scope)
            scope = "grid"
        if scope in ("tile", "cluster"):
            return self._make_tile_plan(argv, run_values, float_type, o, sim, cluster=scope == "cluster")
        if o.scope == "auto" and scope in ("grid", "block") and self.auto_tile(
                work, o.debug, sim, [a.shape if isinstance(a, ArrayArg) else None for a in argv]):
            try:
                return self._make_tile_plan(argv, run_values, float_type, o, sim)
            except (LaunchError, ArgumentError) as exc:
                # the tiles do not fit on this device, or the swap pairs' arrays differ in shape
                # or dtype (tile mode keeps them in one shared array): the grid scope, whose own
                # checks report any argument that is wrong for every scope
                log.debug("loopkern: scope='auto' for step '%s' keeps the grid scope: %s", spec.name, exc)
        if self.warp_split:
            work *= WARP            # a warp per iteration of its few-iteration loop (see warpsplit.py)
        staged, stage_bytes = plan_staging(spec, argv) if scope == "block" else ((), 0)
        bits = index_bits_for([a.size for a in argv if isinstance(a, ArrayArg)], o.debug, staged)
        compiled = self.kernels.get("cuda", scope, debug=o.debug, staged=staged, control=o.control,
                                    float_type=float_type, index_bits=bits,
                                    sized=o.threads is None and o.blocks is None)
        types = _cuda_param_types(compiled, argv)
        check_types(spec, compiled, types, run_values)
        kernel = compiled.specialize_types(_cuda_kernel_types(types, o.debug))
        config = cuda_config(kernel, scope, work, o.threads, o.blocks, sim, shared=stage_bytes)
        return make_plan(spec, "cuda", argv, compiled, kernel, config, debug=o.debug, staged=staged,
                         simulator=sim), run_values

    def _make_tile_plan(self, argv, run_values, float_type, o: Options, sim: bool, cluster: bool = False):
        """The plan of a ``scope="tile"`` (or ``"cluster"``) call (see :meth:`fit_tiles`)."""
        spec = self.spec
        if o.debug:
            name = "cluster" if cluster else "tile"
            raise ArgumentError(f"scope='{name}' has no bounds-checked kernel yet: run debug=True with scope='grid'")

        def build(st, depth, tiles, with_halo):
            compiled = self.kernels.get("cuda", "grid", control=o.control, float_type=float_type, tile=st,
                                        cluster=cluster, depth=depth, tiles=tiles)
            types = _cuda_param_types(compiled, argv)
            check_types(spec, compiled, types, run_values)
            halo = (types[spec.swap[0][0]].dtype,) if with_halo else ()
            kernel = compiled.specialize_types(_cuda_kernel_types(types, False, halo))
            return (compiled, kernel), kernel
        (compiled, kernel), config = self.fit_tiles(argv, o.threads, o.blocks, sim, build, cluster=cluster)
        return make_plan(spec, "cuda", argv, compiled, kernel, config, debug=False, staged=(),
                         simulator=sim), run_values

    def fit_tiles(self, argv, threads, blocks, sim: bool, build, cluster: bool = False, chip=None):
        """Tile mode's kernel and grid for the arguments ``argv``: the step must be a 1-D or 2-D
        stencil whose swap pairs' arrays (kept on chip) share one shape and dtype (ArgumentError
        otherwise).

        ``build(stencil, depth, tiles, with_halo)`` compiles the kernel for ``depth`` steps per
        halo exchange and ``tiles`` tiles per block (``with_halo``: it takes the halo scratch
        array last) and returns (what the caller keeps, the kernel for the occupancy query). When
        the block count chosen for a depth cannot be co-resident, the depth halves, down to one.
        ``chip``: the device's :class:`~loopkern.dispatch.config.Chip` (Numba's current device's
        when not given). No argument shares memory with an array kept on chip: those are swap
        pairs' arrays, which the step writes, and ``classify`` refuses an argument sharing memory
        with a written one before a plan is made (``kernel.jax``'s arguments are separate
        buffers).

        Returns:
            (what ``build`` returned to keep, the LaunchConfig).
        """
        spec = self.spec
        name = "cluster" if cluster else "tile"
        if chip is None and not sim:
            chip = numba_chip()         # asked once for the layout, the first block count and the grid
        st = self.tile_stencil(name)
        resident = sorted(i for pair in spec.swap for i in pair)
        arrays = [argv[i] for i in resident]
        first = arrays[0]
        for a in arrays:
            if len(a.shape) != st.ndim or a.shape != first.shape or a.dtype != first.dtype:
                raise ArgumentError(f"scope='{name}': the arrays kept on chip must all be {st.ndim}-D of one shape and "
                                    f"dtype; '{first.name}' is {first.dtype}{list(first.shape)} and '{a.name}' is "
                                    f"{a.dtype}{list(a.shape)}")
        if first.shape[0] < st.min_rows:
            raise ArgumentError(f"scope='{name}': a parallel loop of step '{spec.name}' that touches the arrays kept "
                                f"on chip runs up to index {st.min_rows - 1} of their first dimension, but "
                                f"'{first.name}' has {first.shape[0]} there (tile mode runs a loop's indices "
                                f"inside the tiles only); use scope='grid'")
        # tiles are ranges of the first dimension: a "cell" is one element (1-D) or one row (2-D)
        row = math.prod(first.shape[1:])
        fused = not cluster and self.fused_steps
        cell_bytes = row * sum(a.dtype.itemsize for a in arrays)
        blocks0 = first_tile_blocks(first.shape[0], st.halo[0], blocks, sim, fused, chip)
        depth, tiles = tile_layout(first.shape[0], st.halo[0], cell_bytes, blocks, sim, fused, chip,
                                   rows=st.ndim > 1)
        while True:
            kept, kernel = build(st, depth, tiles, depth > 1 or tiles > 0)
            try:
                return kept, tile_config(kernel, first.shape[0], cell_bytes, st.halo[0], threads, blocks, sim,
                                         cluster=cluster, depth=depth, halo_cell=row * len(arrays), first=blocks0,
                                         tiles=tiles, chip=chip, row=row)
            except LaunchError:
                # the block count chosen for this depth cannot be co-resident (tile_layout
                # checked shared memory, not occupancy): fewer steps per exchange, down to one
                if depth == 1:
                    raise
                depth = max(1, depth // 2)

    @functools.cached_property
    def stencil(self):
        """The step's :class:`~loopkern.stencil.Stencil`, or the
        :class:`~loopkern.stencil.NotStencil` saying why it is not one (analysed once)."""
        from ..stencil import find_stencil
        return find_stencil(self.spec)

    @functools.cached_property
    def fused_steps(self) -> bool:
        """Whether tile mode may run several steps per halo exchange (see
        ``stencil.fused_steps_refusal``)."""
        from ..stencil import Stencil, fused_steps_refusal
        st = self.stencil
        return isinstance(st, Stencil) and fused_steps_refusal(self.spec, st) is None

    @functools.cached_property
    def warp_split(self) -> bool:
        """Whether a parallel loop of the step can run warp-split (``loopkern/warpsplit.py``):
        the automatic grid then has a warp's worth of threads per element."""
        return step_has_warp_split(self.spec.step)

    def auto_tile(self, work: int, debug: bool, sim: bool, shapes=None) -> bool:
        """Whether ``scope="auto"`` tries tile mode: a stencil, on a GPU, without debug. A 1-D
        stencil of any size when tile mode can run several steps per halo exchange
        (``fused_steps``: H200, 2026-12-05, heat 4K 0.26 µs/step against 0.61 in the block
        scope, 64K 0.30 against 1.47 in the grid scope),
        else from ``config.AUTO_TILE_MIN_ELEMENTS`` elements; a 2-D one (wrapping around or not)
        from ``config.AUTO_TILE_2D_MIN_ELEMENTS`` (the measurements are there).

        ``shapes``: the arguments' shapes by parameter (None for a scalar), when known. A stencil
        whose halo is wider than 1/``config.AUTO_TILE_HALO_SHARE`` of the kept arrays' first
        extent is left on the grid scope: its tiles, each at least a halo long, would be too few
        to use the GPU (``jnp.roll`` read by a drop-in loop's body is a halo of n - 1)."""
        if sim or debug:
            return False
        try:
            st = self.tile_stencil()
        except ArgumentError:
            return False
        if shapes is not None:
            rows = [shapes[i][0] for pair in self.spec.swap for i in pair if shapes[i]]
            if rows and (max(st.halo[0]) * AUTO_TILE_HALO_SHARE > min(rows) or min(rows) < st.min_rows):
                return False
        if st.ndim == 2:
            return work >= AUTO_TILE_2D_MIN_ELEMENTS
        # (a 1-D stencil that wraps around along its first dimension runs in tile mode when
        # asked for: not yet measured on a GPU, auto keeps the grid scope for it)
        if st.periodic[0]:
            return False
        return self.fused_steps or work >= AUTO_TILE_MIN_ELEMENTS

    def tile_stencil(self, scope: str = "tile"):
        """The step's stencil for ``scope="tile"`` or ``"cluster"`` (ArgumentError, naming
        ``scope``, when tile mode cannot run it)."""
        from ..stencil import Stencil
        spec = self.spec
        st = self.stencil
        where = f"{spec.filename}:{getattr(st, 'line', spec.lineno)}"
        if not isinstance(st, Stencil):
            raise ArgumentError(f"scope='{scope}': step '{spec.name}' is not a stencil ({where}: {st.reason}); "
                                f"use scope='grid'")
        if st.ndim > 2:
            raise ArgumentError(f"scope='{scope}': step '{spec.name}' is a {st.ndim}-D stencil; tile mode covers 1-D "
                                f"and 2-D stencils: use scope='grid'")
        if st.periodic[0] and scope == "cluster":
            raise ArgumentError(f"scope='cluster': step '{spec.name}' wraps around along its first dimension, which "
                                f"a cluster's tiles do not cover: use scope='tile' or 'grid'")
        if not spec.swap:
            raise ArgumentError(f"scope='{scope}' keeps the swap pairs' arrays on chip; step '{spec.name}' has no "
                                f"swap pair: use scope='grid'")
        return st

    # -- running -------------------------------------------------------------------------------
    def call(self, args, kwargs, steps, max_steps, start, backend, scope, threads, blocks, seed, progress, timeout,
             debug, watchdog, control) -> Run:
        """A blocking call (see ``MegaKernel.__call__``).

        The common call (positional arguments, ``steps=`` or ``max_steps=``, no progress) with a
        signature seen before goes straight to its plan; anything else takes :meth:`options` and
        :meth:`plan`.
        """
        # steps= and max_steps= both only bound the count (a step returning a condition may end
        # sooner either way); exactly one of them is given in the common call
        count = steps if max_steps is None else max_steps if steps is None else None
        common = (progress is False and type(count) is int and 0 <= count < 2 ** 63
                  and type(start) is int and 0 <= start < _START_LIMIT and type(seed) is int
                  and 0 <= seed < _SEED_LIMIT and (watchdog is None or type(watchdog) is float and watchdog > 0)
                  and (timeout is None or type(timeout) is float and timeout > 0)
                  and not kwargs and len(args) == self.nparams and not holding_runs())
        if common:
            opts = (backend, scope, threads, blocks, debug, control)
            last = self._last
            if last is not None and last.match(opts, args) and (last.ctx == 0 or driver.current_context() == last.ctx):
                return self._run(last.plan, args, last.ptrs, Options(count, start, seed, timeout, watchdog))
            try:
                launch = self._launch_options[_options_key(opts)]
                sig = call_key(args)
            except (KeyError, TypeError):
                sig = None
            if sig is not None:
                ctx = 0
                if launch[0] == "cuda" and not _simulator():
                    driver.ensure_context()
                    ctx = driver.current_context()
                plan = self.plans.get(launch + (ctx,) + sig)
                if plan is not None:
                    ptrs = plan.check_values(args)
                    if ptrs is not None:
                        self._last = LastCall.remember(opts, ctx, args, plan, ptrs)
                        return self._run(plan, args, ptrs, Options(count, start, seed, timeout, watchdog))
        o = self.options(steps, max_steps, start, backend, scope, threads, blocks, seed, progress, timeout, debug,
                         watchdog, control)
        if o.progress is not False:
            return self._start(self.values(args, kwargs), o, monitor=False).wait()
        plan, values, ptrs = self.plan(self.values(args, kwargs), o)
        if common:
            self._last = LastCall.remember(opts, o.key[-1], args, plan, ptrs)
        return self._run(plan, values, ptrs, o)

    def _run(self, plan, values, ptrs, o: Options) -> Run:
        if plan.backend == "cpu":
            return self._run_cpu(plan, values, o)
        if plan.simulator:
            return self._launch_simulator(plan, values, o).wait()
        return self._run_cuda(plan, values, ptrs, o)

    def start(self, args, kwargs, monitor=True, **opts) -> RunHandle:
        """A run started in the background (see ``MegaKernel.start``)."""
        return self._start(self.values(args, kwargs), self.options(**opts), monitor)

    def refuse_held(self, values):
        """ArgumentError if an array argument shares memory with one that a run started with
        ``kernel.start()`` still holds (the two runs would race on it, silently)."""
        held = holding_runs()
        if not held:
            return
        for p, v in zip(self.spec.params, values):
            a = classify(p.name, v)
            if not isinstance(a, ArrayArg):
                continue
            for handle in held:
                for h in handle.held:
                    if overlaps(a, h):
                        raise ArgumentError(
                            f"argument '{a.name}' shares memory with argument '{h.name}' of a run of '{handle.name}' "
                            f"started with kernel.start() that has not been waited for: the two runs would race on "
                            f"it. Call wait() on that run's handle first (cancel() and wait() to stop it early)")

    def _start(self, values, o: Options, monitor) -> RunHandle:
        from ..progress import make_reporter
        given = values
        plan, values, ptrs = self.plan(values, o)
        reporter = make_reporter(o.progress, None if self.spec.returns_condition else o.nsteps, self.spec.name)
        if plan.backend == "cpu":
            handle = self._start_cpu(plan, values, o, reporter)
        elif plan.simulator:
            handle = self._launch_simulator(plan, values, o, reporter)
        else:
            handle = self._start_cuda(plan, values, ptrs, o, reporter)
        handle.hold([a for a in (classify(p.name, v) for p, v in zip(self.spec.params, given)) if isinstance(a, ArrayArg)])
        if monitor:
            handle.monitor()
        return handle

    def _finish_run(self, plan, slot, steps, why, o) -> Run:
        """The Run of a finished blocking call (the slot goes back to the plan), or BoundsError."""
        message = plan.bounds_error(slot, steps, o.start) if plan.debug else None
        if message is not None:
            plan.slots.give(slot)
            raise BoundsError(message)
        plan.slots.give(slot)
        c = plan.config
        return Run._make(steps, STOPPED[why], plan.backend, c.scope, c.blocks, c.threads, o.start, c.depth)

    def _run_cpu(self, plan, values, o: Options) -> Run:
        slot = plan.slots.take()
        plan.prepare_slot(slot, None)
        args = plan.cpu_args(values, slot, o.seed)
        entry = plan.kernel

        def call(n, t0):
            args[0] = n
            args[1] = t0
            entry(*args)
        try:
            steps, why = run_inline(call, slot.view, o.nsteps, o.start, name=self.spec.name, timeout=o.timeout,
                                    watchdog=o.watchdog)
        except KeyboardInterrupt as exc:
            steps, why = exc._lk_result
            note_cancelled(exc, self.spec.name, self._finish_run(plan, slot, steps, why, o))
            raise
        except _Stalled as st:
            run = self._finish_run(plan, slot, *st.result, o)
            raise HangError(slow_step_message(self.spec.name, st.idle, o.watchdog, st.steps, run), run=run) from None
        except Exception as exc:
            # (the kernel was called in slices: the ones before the failing one completed)
            failed = self._step_failed(plan, slot, values, exc, o, int(slot.view[SLICE_START]) - o.start)
            if failed is None:
                raise
            raise failed from exc
        return self._finish_run(plan, slot, steps, why, o)

    def _step_failed(self, plan, slot, values, exc, o, before):
        """A CPU kernel raised ``exc``: give the slot back and return the :class:`StepError`
        to raise, with the arrays in the rename rule's order (None: not an exception from
        inside a step, e.g. one from Numba before the kernel ran)."""
        done = int(slot.view[STEPS])       # steps this call of the kernel completed (polled)
        plan.slots.give(slot)
        if done < 0 or not _raised_by_the_step(exc):
            return None
        if done % 2 == 1:
            # the kernel renames a swap pair's arrays after every step and exchanges their
            # contents when its call ends; the exception skipped that exchange
            for a, b in self.spec.swap:
                x, y = values[a], values[b]
                newest = np.array(y, copy=True)
                y[...] = x
                x[...] = newest
        steps = before + done
        c = plan.config
        run = Run._make(steps, "error", plan.backend, c.scope, c.blocks, c.threads, o.start, c.depth)
        t = o.start + steps
        hint = ("a debug=True kernel keeps Python's error model (a zero divisor raises); without debug=True the "
                "CPU backend computes what the GPU does" if plan.debug else "")
        return StepError(f"{self.spec.name}: the step raised {type(exc).__name__} ({exc}) at step t={t}; the run "
                         f"stopped there after {steps} complete steps. The first array of each swap pair holds the "
                         f"state after those steps; arrays the step writes in place may hold part of step t={t}"
                         + (f". Note: {hint}" if hint else ""), run)

    def _run_cuda(self, plan, values, ptrs, o: Options) -> Run:
        # no event: the done flag proves the run complete (cuda_rt.finish); wait_cuda asks the
        # stream now and then whether the kernel ended without writing it (it faulted)
        slot = self._launch_cuda(plan, values, ptrs, o, record=False)
        view = slot.view
        try:
            wait_cuda(view, None, self.spec.name, o.watchdog)
        except KeyboardInterrupt as exc:
            view[REQUEST] = CANCEL
            wait_cuda(view, None, self.spec.name, None, interruptible=False)
            plan.copy_out(values, slot)
            note_cancelled(exc, self.spec.name, self._finish_run(plan, slot, int(view[STEPS]), int(view[WHY]), o))
            raise
        except _Stalled as st:
            wait_cuda(view, None, self.spec.name, None, interruptible=False)
            plan.copy_out(values, slot)
            run = self._finish_run(plan, slot, int(view[STEPS]), int(view[WHY]), o)
            raise HangError(slow_step_message(self.spec.name, st.idle, o.watchdog, st.steps, run), run=run) from None
        plan.copy_out(values, slot)
        return self._finish_run(plan, slot, int(view[STEPS]), int(view[WHY]), o)

    def _launch_cuda(self, plan, values, ptrs, o: Options, record=True):
        """Fill a slot and launch through the driver (recording the slot's event after the
        kernel if ``record``); returns the slot (the kernel is running)."""
        slot = plan.slots.take()
        try:
            plan.prepare_slot(slot, o.timeout)
            if plan.hosts:
                plan.copy_in(values, slot)
            plan.fill_words(values, ptrs, slot, o.nsteps, o.start, o.seed)
            plan.launch(slot, record)
        except BaseException:
            plan.slots.give(slot)
            raise
        return slot

    def _handle(self, plan, slot, values, o, waiter, reporter, deadline=None, on_error=None) -> RunHandle:
        """The RunHandle of a run started on ``slot``: when it finishes, NumPy inputs are copied
        back (CUDA) and the slot goes back to the plan."""
        def on_finish():
            try:
                plan.copy_out(values, slot)
            finally:
                plan.slots.give(slot)
        return RunHandle(name=self.spec.name, host=slot.view, waiter=waiter, backend=plan.backend, plan=plan.config,
                         deadline=deadline, on_finish=on_finish, reporter=reporter, watchdog=o.watchdog,
                         start=o.start, on_error=on_error,
                         describe_error=(lambda steps: plan.bounds_error(slot, steps, o.start))
                         if plan.debug else None)

    def _start_cuda(self, plan, values, ptrs, o, reporter) -> RunHandle:
        slot = self._launch_cuda(plan, values, ptrs, o)
        return self._handle(plan, slot, values, o, EventWaiter(slot.event, slot.view), reporter)

    def _start_cpu(self, plan, values, o, reporter) -> RunHandle:
        import time
        slot = plan.slots.take()
        plan.prepare_slot(slot, None)
        args = plan.kernel_args(values, slot, o.nsteps, o.start, o.seed)
        entry = plan.kernel
        return self._handle(plan, slot, values, o, ThreadWaiter(lambda: entry(*args)), reporter,
                            deadline=time.monotonic() + o.timeout if o.timeout is not None else None,
                            on_error=lambda exc: self._step_failed(plan, slot, values, exc, o, 0))

    def _launch_simulator(self, plan, values, o, reporter=None) -> RunHandle:
        """Numba's CUDA simulator: the launch runs the kernel in Python, on a worker thread."""
        slot = plan.slots.take()
        plan.prepare_slot(slot, o.timeout)
        plan.copy_in(values, slot)
        args = plan.kernel_args(values, slot, o.nsteps, o.start, o.seed)
        c = plan.config
        launcher = plan.kernel[c.blocks, c.threads, 0, c.shared]
        return self._handle(plan, slot, values, o, ThreadWaiter(lambda: launcher(*args)), reporter,
                            on_error=lambda exc: self._simulated_step_failed(plan, slot, exc, o))

    def _simulated_step_failed(self, plan, slot, exc, o):
        """A kernel run by Numba's CUDA simulator raised ``exc``: give the slot back and return
        the :class:`StepError` to raise (None: Numba's own error, or loopkern's). The simulator
        follows NumPy's scalar rules, so a step can raise there (``int(nan)``, ``k ** -1``)
        where the GPU computes a value; NumPy arguments are not copied back."""
        done = max(0, int(slot.view[STEPS]))
        plan.slots.give(slot)
        if not _raised_by_the_step(exc):
            return None
        c = plan.config
        run = Run._make(done, "error", plan.backend, c.scope, c.blocks, c.threads, o.start, c.depth)
        last = o.start + max(o.nsteps, 1) - 1
        return StepError(f"{self.spec.name}: the step raised {type(exc).__name__} ({exc}) in Numba's CUDA simulator, "
                         f"in the run of steps t={o.start} to {last} (its threads run unevenly, so which step is not "
                         f"known); NumPy arrays passed in were left as they were, "
                         f"device arrays may hold part of the run. The simulator follows NumPy's scalar rules "
                         f"(int(nan), an integer to a negative power raise there); the GPU computes a value", run)


def _raised_by_the_step(exc) -> bool:
    """Whether a kernel's exception came from the step's own code (a StepError to report), not
    from loopkern or from Numba before or around the kernel."""
    return not isinstance(exc, LoopkernError) and not type(exc).__module__.startswith("numba")


def _cuda_param_types(compiled, argv) -> tuple:
    """The Numba types the CUDA kernel sees for the step's parameters: a NumPy argument becomes a
    C-contiguous device copy; GPU arrays and numbers are typed as they are."""
    from numba import types
    from numba.np.numpy_support import from_dtype
    out = []
    for a in argv:
        if isinstance(a, ArrayArg) and a.where == "host":
            out.append(types.Array(from_dtype(a.dtype), len(a.shape), "C"))
        else:
            out.append(compiled.type_of(a.value))
    return tuple(out)


def _cuda_kernel_types(param_types, debug, halo=()) -> tuple:
    """The CUDA kernel's whole signature: step count and start, the parameters, the scratch
    (redf, redi, bar), the seed, the stop slots, the control block, and the debug buffer or
    (``halo``: its element type) a tile-mode kernel's halo scratch."""
    from numba import types
    i64 = types.Array(types.int64, 1, "C")
    return ((types.int64, types.int64) + tuple(param_types)
            + (types.Array(types.float64, 2, "C"), types.Array(types.int64, 2, "C"), types.Array(types.uint32, 1, "C"),
               types.uint64, i64, i64) + ((i64,) if debug else ()) + tuple(types.Array(t, 1, "C") for t in halo))
