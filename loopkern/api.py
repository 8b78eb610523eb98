"""The public entry point: ``@megakernel``, the :class:`MegaKernel` it returns, and :class:`Run`."""

from __future__ import annotations

import functools
import inspect
import linecache
import numbers
import threading
import time

from . import codegen
from .dsl import ATOMIC_DTYPES
from .errors import ArgumentError, Diagnostic
from .interop.arrays import ArrayArg, apply_weak_floats, classify, overlaps, weak_float_type
from .progress import check_progress, make_reporter
from .runs import TIMEOUT_NS, Run, RunHandle, ThreadWaiter, EventWaiter
from .spec import ARRAY, SCALAR
from .validate import validate_step

#: default ``watchdog=`` of blocking calls: seconds without a new step before a run is reported
DEFAULT_WATCHDOG_S = 60.0

BACKENDS = ("auto", "cuda", "cpu")
SCOPES = ("auto", "grid", "block", "thread")


def check_array_use(p, shape, filename):
    """ArgumentError if an array has fewer dimensions than the step indexes it with."""
    if len(shape) < p.min_ndim:
        raise ArgumentError(f"argument '{p.name}': the step indexes it with {p.min_ndim} indices "
                            f"({filename}:{p.min_ndim_line}), got a {len(shape)}-D array of shape {tuple(shape)}")


def check_kind(p, is_array: bool, got: str):
    """ArgumentError if an array parameter got a number or a number parameter got an array."""
    if p.kind == ARRAY and not is_array:
        raise ArgumentError(f"argument '{p.name}': the step indexes it as an array, got {got}")
    if p.kind == SCALAR and is_array:
        raise ArgumentError(f"argument '{p.name}': the step uses it as a number, got {got}")


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
    """ArgumentError for scope='thread' on a step that shares work between threads."""
    if scope == "thread" and spec.parallel:
        raise ArgumentError(f"scope='thread' runs one thread with no barrier, but step '{spec.name}' uses "
                            f"parallel loops, lk.thread_id/num_threads, lk.sync or reductions; use scope='grid', "
                            f"'block' or 'auto'")


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


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ArgumentError(f"{name}={value!r}: expected one of {', '.join(repr(a) for a in allowed)}")
    return value


def _check_count(name, value, allow_none=True, minimum=0):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{name}={value!r}: expected an integer")
    if int(value) < minimum:
        raise ArgumentError(f"{name}={value!r}: must be >= {minimum}")
    return int(value)


class MegaKernel:
    """A step function compiled into one kernel that runs the whole loop.

    Create it with :func:`megakernel`. Call it like the step function without the step index,
    plus ``steps=`` (or ``max_steps=`` for a step that returns a condition).
    """

    def __init__(self, fn, *, swap=(), backend="auto", scope="auto", threads=None, blocks=None):
        self.spec = validate_step(fn, swap)
        self.fn = fn
        self._defaults = dict(backend=_check_choice("backend", backend, BACKENDS),
                              scope=_check_choice("scope", scope, SCOPES),
                              threads=_check_count("threads", threads, minimum=1),
                              blocks=_check_count("blocks", blocks, minimum=1))
        self._signature = inspect.Signature(
            [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in self.spec.params])
        self._compiled: dict = {}
        self._lock = threading.Lock()
        self._scratch = None   # a launch.FreeList of launch.Scratch, made on the first CUDA run
        functools.update_wrapper(self, fn)

    def __repr__(self):
        return f"<loopkern.MegaKernel {self.spec.name}{self._signature}>"

    # -- inspection ------------------------------------------------------------------------
    def source(self, backend: str = "cuda", scope: str = "grid") -> str:
        """The generated kernel source for ``backend`` ("cuda" or "cpu") and ``scope``."""
        _check_choice("backend", backend, ("cuda", "cpu"))
        _check_choice("scope", scope, ("grid", "block", "thread"))
        check_thread_scope(self.spec, scope)
        return codegen.render_kernel(self.spec, backend, scope, fingerprint="").text

    # -- calling ---------------------------------------------------------------------------
    def _bind_names(self, args, kwargs) -> dict:
        """Parameter name -> value, or an ArgumentError naming what is missing or extra."""
        try:
            return dict(self._signature.bind(*args, **kwargs).arguments)
        except TypeError as exc:
            names = ", ".join(p.name for p in self.spec.params)
            raise ArgumentError(f"{self.spec.name}(): {exc}; the step takes ({names}) after the step index "
                                f"'{self.spec.index_param}', plus steps= or max_steps=") from None

    def _bind(self, args, kwargs) -> list:
        bound = self._bind_names(args, kwargs)
        swapped = {i for pair in self.spec.swap for i in pair}
        out = []
        for k, p in enumerate(self.spec.params):
            a = classify(p.name, bound[p.name])
            is_array = isinstance(a, ArrayArg)
            check_kind(p, is_array, f"an array of shape {a.shape}" if is_array
                       else f"a scalar {type(a.value).__name__}")
            if is_array:
                check_array_use(p, a.shape, self.spec.filename)
                check_atomic_dtype(p, a.dtype)
                check_writable(p, a, k in swapped)
            out.append(a)
        for i, j in self.spec.swap:
            a, b = out[i], out[j]
            pair = f"swap pair ('{a.name}', '{b.name}')"
            if not isinstance(a, ArrayArg) or not isinstance(b, ArrayArg):
                raise ArgumentError(f"{pair}: both must be arrays")
            check_swap_pair((a.name, b.name), a.shape, a.dtype, b.shape, b.dtype)
            if a.where != b.where:
                raise ArgumentError(f"{pair}: one array is on the GPU and the other on the host")
            if a.value is b.value or overlaps(a, b):
                raise ArgumentError(f"{pair}: the two arrays share memory; pass two separate buffers")
        return out

    def __call__(self, *args, steps=None, max_steps=None, start=0, backend=None, scope=None, threads=None,
                 blocks=None, seed=0, progress=False, timeout=None, debug=False, watchdog=DEFAULT_WATCHDOG_S,
                 _control=True, **kwargs) -> Run:
        """Run the loop and wait for it; arrays are updated in place.

        Ctrl-C during the call cancels the kernel at a step boundary, waits until it has
        stopped (the arrays are then consistent, NumPy inputs copied back) and re-raises
        ``KeyboardInterrupt``.

        Args:
            *args, **kwargs: the step's parameters after the step index.
            steps: number of steps to run (an upper bound if the step returns a condition).
            max_steps: upper bound on steps for a step that returns a condition.
            start: the step index ``t`` of the first step (default 0), to continue a run:
                N steps in one call equal any split of N into calls that each start where
                the last stopped (``run.next_start``), bit for bit, ``lk.random`` draws
                and swap pairs included.
            backend: "auto", "cuda" or "cpu" (default: the decorator's).
            scope: "auto", "grid", "block" or "thread" (CUDA only; "thread" is one thread with no
                barrier, for a step without parallel constructs, which "auto" picks for it).
            threads: threads per block (CUDA only; a multiple of 32).
            blocks: blocks in the grid (CUDA grid scope; must all fit on the device at once).
            seed: the seed of ``lk.random`` draws (an integer from 0 to 2**64 - 1).
            progress: True for a live progress bar (tqdm if installed, else a line on stderr),
                or a callable receiving ``(steps_done, total)`` (total is None for a step that
                returns a condition), called at most 10 times a second and once at the end.
            timeout: seconds after which the kernel stops itself at a step boundary
                (``Run.stopped == "timeout"``). On CUDA it is measured by the GPU's clock from
                the kernel's start; on the CPU from the call.
            debug: bounds-check every array access (slower): an out-of-bounds index is never
                used and raises :class:`~loopkern.errors.BoundsError` naming the line, step,
                thread and index.
            watchdog: seconds without a new step after which the call cancels the run and raises
                :class:`~loopkern.errors.HangError` (None: wait forever).

        Returns:
            A :class:`Run`.

        Raises:
            ArgumentError: a bad argument; nothing was copied or launched.
            LaunchError: the launch configuration cannot run.
            CompileError: Numba could not compile the step.
            BoundsError: with ``debug=True``, an array was indexed out of bounds.
            HangError: the watchdog fired.
        """
        handle = self.start(*args, steps=steps, max_steps=max_steps, start=start, backend=backend, scope=scope,
                            threads=threads, blocks=blocks, seed=seed, progress=progress, timeout=timeout,
                            debug=debug, watchdog=watchdog, _monitor=False, _control=_control, **kwargs)
        return handle.wait()

    def start(self, *args, steps=None, max_steps=None, start=0, backend=None, scope=None, threads=None,
              blocks=None, seed=0, progress=False, timeout=None, debug=False, watchdog=DEFAULT_WATCHDOG_S,
              _monitor=True, _control=True, **kwargs) -> RunHandle:
        """Start the loop and return at once with a :class:`~loopkern.runs.RunHandle`.

        Takes the same arguments as calling the kernel. ``handle.wait()`` returns the
        :class:`Run`; ``handle.cancel()`` stops the run at the next step boundary (every thread
        at the same step); ``handle.steps_done`` and ``handle.done()`` tell how far it is.
        Device arrays are being updated while it runs; NumPy inputs are copied back by
        ``wait()``. Runs of one kernel started one after another run one after another.

        Raises:
            The errors of calling the kernel that are found before launching.
        """
        if steps is not None and max_steps is not None:
            raise ArgumentError("pass either steps= or max_steps=, not both")
        if steps is None and max_steps is None:
            raise ArgumentError(f"{self.spec.name}(): pass steps=N (or max_steps=N for a step that returns a "
                                f"condition)")
        label = "steps" if steps is not None else "max_steps"
        nsteps = _check_count(label, steps if steps is not None else max_steps, allow_none=False)
        start = check_start(start)
        backend = _check_choice("backend", backend if backend is not None else self._defaults["backend"], BACKENDS)
        scope = _check_choice("scope", scope if scope is not None else self._defaults["scope"], SCOPES)
        threads = _check_count("threads", threads if threads is not None else self._defaults["threads"], minimum=1)
        blocks = _check_count("blocks", blocks if blocks is not None else self._defaults["blocks"], minimum=1)
        seed = check_seed(seed)
        progress = check_progress(progress)
        timeout = check_seconds("timeout", timeout)
        watchdog = check_seconds("watchdog", watchdog)
        if not isinstance(debug, bool):
            raise ArgumentError(f"debug={debug!r}: expected True or False")
        argv = self._bind(args, kwargs)
        float_type = weak_float_type(a.dtype for a in argv if isinstance(a, ArrayArg))
        argv = apply_weak_floats(argv, float_type)

        from . import launch
        backend = launch.choose_backend(backend)
        total = None if self.spec.returns_condition else nsteps
        opts = dict(reporter=make_reporter(progress, total, self.spec.name), watchdog=watchdog, start=start)
        if backend == "cpu":
            handle = self._start_cpu(argv, nsteps, start, seed, timeout, debug, opts, _control, float_type)
        else:
            handle = self._start_cuda(argv, nsteps, start, scope, threads, blocks, seed, timeout, debug, opts,
                                      _control, float_type)
        if _monitor:
            handle.monitor()
        return handle

    def _kernel(self, backend, scope, by_ref=None, debug=False, staged=(), control=True, float_type=None):
        from .compile import compile_kernel, runtime_fingerprint, simulator_enabled
        key = (backend, scope, by_ref, debug, staged, control, float_type)
        with self._lock:
            k = self._compiled.get(key)
            if k is None:
                cache = not (backend == "cuda" and simulator_enabled())
                src = codegen.render_kernel(self.spec, backend, scope, cache=cache,
                                            fingerprint=f"runtime {runtime_fingerprint()}", by_ref=by_ref,
                                            debug=debug, staged=staged, control=control,
                                            float_type=float_type)
                k = self._compiled[key] = compile_kernel(src)
        return k

    def jax(self, *args, steps=None, max_steps=None, start=0, backend=None, scope=None, threads=None,
            blocks=None, seed=0, timeout=None, **kwargs):
        """Run the loop as a functional JAX operation: JAX arrays in, new JAX arrays out.

        Works eagerly and inside ``jax.jit``. On a GPU it is an XLA FFI custom call on XLA's
        stream whose array arguments are aliased to its results (donate them with
        ``donate_argnums`` and nothing is copied); on JAX's CPU backend it runs the CPU kernel.

        Args:
            *args, **kwargs: the step's parameters after the step index: JAX arrays for array
                parameters; Python numbers or 0-d JAX arrays (traced values too) for scalars.
            steps: number of steps (an int or a 0-d integer JAX array, traced values too).
            max_steps: the same, as an upper bound, for a step that returns a condition.
            start: the step index of the first step (an int >= 0 or a 0-d integer JAX array,
                traced values too; a traced negative value runs no step), to continue a run.
            backend: "auto" (the platform of the arrays), "cuda" or "cpu".
            scope, threads, blocks: as for calling the kernel (CUDA only).
            seed: the seed of ``lk.random`` draws (a Python int).
            timeout: seconds (a Python number) after which the kernel stops itself at a step
                boundary, measured by the GPU's clock from the kernel's start.

        Returns:
            A tuple with one new array per array parameter, in parameter order, and, when the
            step returns a condition or ``timeout`` is given, the number of steps executed
            (int32) last. With ``swap`` the first array of each pair holds the newest state.

        Raises:
            ArgumentError: at trace time, for non-JAX arrays, mismatched swap pairs, arrays on
                different platforms or a platform the backend cannot run on.
            LoopkernError: when differentiated (no derivative rule yet).
        """
        from .interop.jax_bridge import jax_call
        return jax_call(self, args, kwargs, steps=steps, max_steps=max_steps, start=start, backend=backend,
                        scope=scope, threads=threads, blocks=blocks, seed=seed, timeout=timeout)

    def _check_types(self, compiled, kargs):
        """ArgumentError unless the two arrays of each swap pair have the same compiled type: the
        kernel exchanges them, so they must agree in layout too, not only in shape and dtype."""
        types = compiled.types_of(kargs)
        for i, j in self.spec.swap:
            ta, tb = types[i], types[j]
            if ta != tb:
                a, b = self.spec.params[i].name, self.spec.params[j].name
                raise ArgumentError(f"swap pair ('{a}', '{b}'): the two arrays must have the same memory layout, "
                                    f"got '{a}': {describe_array(kargs[i], ta)} and '{b}': "
                                    f"{describe_array(kargs[j], tb)}; make both C-contiguous, e.g. with "
                                    f"numpy.ascontiguousarray")

    def _start_cpu(self, argv, nsteps, start, seed, timeout, debug, opts, control=True,
                   float_type=None) -> RunHandle:
        import numpy as np

        from . import launch
        from .runtime.bounds import DBG_SIZE
        for a in argv:
            if isinstance(a, ArrayArg) and a.where != "host":
                raise ArgumentError(f"argument '{a.name}' is on the GPU, but backend='cpu' needs NumPy arrays; "
                                    f"copy it to the host or use backend='cuda'")
        compiled = self._kernel("cpu", "grid", debug=debug, control=control, float_type=float_type)
        kargs = [a.value for a in argv]
        self._check_types(compiled, kargs)
        host, view = launch.take_control_block("cpu")
        dbg = np.zeros(DBG_SIZE, np.int64) if debug else None
        full = (np.int64(nsteps), np.int64(start), *kargs, np.uint64(seed), host) + ((dbg,) if debug else ())
        entry = compiled.specialize(full)
        deadline = time.monotonic() + timeout if timeout is not None else None
        waiter = ThreadWaiter(lambda: entry(*full))
        return RunHandle(name=self.spec.name, host=view, waiter=waiter, backend="cpu",
                         plan=launch.LaunchPlan("cpu", 1, 1), deadline=deadline,
                         on_finish=lambda: launch.give_control_block("cpu", host),
                         describe_error=(lambda steps: self._describe_bounds(compiled, dbg, argv, steps, start))
                         if debug else None, **opts)

    def _start_cuda(self, argv, nsteps, start, scope, threads, blocks, seed, timeout, debug, opts,
                    control=True, float_type=None) -> RunHandle:
        import numpy as np

        from . import launch
        from .compile import simulator_enabled
        from .interop.arrays import to_cuda
        from .runtime.bounds import DBG_SIZE

        sim = simulator_enabled()
        work = max([a.size for a in argv if isinstance(a, ArrayArg)] or [1])
        check_thread_scope(self.spec, scope)
        scope = launch.resolve_scope(scope, work, self.spec.parallel, self.spec.light_elements)
        staged, stage_bytes = launch.plan_staging(self.spec, argv) if scope == "block" else ((), 0)
        compiled = self._kernel("cuda", scope, debug=debug, staged=staged, control=control, float_type=float_type)
        with self._lock:
            if self._scratch is None:
                self._scratch = launch.FreeList(launch.Scratch)
        # Nothing the user owns is written before the launch: NumPy inputs are copied to new
        # device buffers, GPU inputs only wrapped.
        kargs, copy_back = to_cuda(argv)
        self._check_types(compiled, kargs)
        from numba import cuda
        dbg = cuda.to_device(np.zeros(DBG_SIZE, np.int64)) if debug else None
        scratch = self._scratch.take()
        host, view = launch.take_control_block("cuda")
        released = []

        def release():
            if not released:
                released.append(True)
                self._scratch.give(scratch)
                launch.give_control_block("cuda", host)
        try:
            def full_args(blocks_):
                redf, redi, bar, info = scratch.cuda(blocks_)
                return (np.int64(nsteps), np.int64(start), *kargs, redf, redi, bar, np.uint64(seed), info, host) + \
                    ((dbg,) if debug else ())
            kernel = compiled.specialize(full_args(1))
            plan = launch.plan_cuda(kernel, scope, work, threads, blocks, sim, shared=stage_bytes)
            full = full_args(plan.blocks)
            view[TIMEOUT_NS] = int(timeout * 1e9) if timeout is not None else 0
            if sim:
                waiter = ThreadWaiter(lambda: launch.launch_cuda(compiled.dispatcher, kernel, plan, full))
            else:
                launch.launch_cuda(compiled.dispatcher, kernel, plan, full)
                waiter = EventWaiter(launch.record_event(), view)
        except BaseException:
            release()
            raise

        def on_finish():
            try:
                copy_back()
            finally:
                release()
        return RunHandle(name=self.spec.name, host=view, waiter=waiter, backend="cuda", plan=plan,
                         on_finish=on_finish, describe_error=(
                             lambda steps: self._describe_bounds(compiled, dbg.copy_to_host(), argv, steps, start))
                         if debug else None, **opts)

    def _describe_bounds(self, compiled, dbg, argv, steps, start) -> str:
        """The BoundsError message for the offence recorded in ``dbg`` by a debug kernel."""
        site = compiled.source.sites[int(dbg[3])]
        n = int(dbg[4])
        index = tuple(int(v) for v in dbg[5:5 + n])
        shape = tuple(int(v) for v in dbg[13:13 + n])
        shape_text = f"{shape}"
        for a in argv:
            if isinstance(a, ArrayArg) and a.name == site.array:
                shape_text = f"{tuple(a.shape)}"
        verb = "load from" if site.kind == "load" else "store to"
        what = "the load read element 0 instead" if site.kind == "load" else "the store was skipped"
        d = Diagnostic(site.filename, site.line, site.col, self.spec.name,
                       f"out-of-bounds {verb} '{site.array}' at step t={int(dbg[1])} by thread {int(dbg[2])}: "
                       f"index {index} is outside shape {shape_text}",
                       hint=f"valid indices of a dimension of length n are -n to n - 1. {what.capitalize()}, and "
                            f"debug=True stopped the run at the first step boundary where every thread could "
                            f"stop together (up to two steps after the bad access): this call ran {steps} "
                            f"step(s), t={start} to t={start + steps - 1}, and the arrays hold the state after "
                            f"them",
                       source_line=linecache.getline(site.filename, site.line),
                       where="" if site.function == self.spec.name else f"in helper '{site.function}'")
        return d.format()


def megakernel(fn=None, *, swap=(), backend="auto", scope="auto", threads=None, blocks=None):
    """Compile a step function into a megakernel that runs every step inside one launch.

    Use as ``@lk.megakernel`` or ``@lk.megakernel(swap=[("u", "v")], ...)``. The step is
    validated immediately (a :class:`~loopkern.errors.StepSyntaxError` lists every problem);
    it is compiled on first call, once per argument-type signature, and cached on disk.

    Args:
        fn: the step function ``step(t, *params)``.
        swap: pairs of array parameters whose buffers exchange roles after every step; after the
            run the first of each pair holds the newest state.
        backend: "auto" (CUDA if a GPU is usable, else CPU), "cuda" or "cpu".
        scope: "auto", "grid" (every co-resident block, grid barrier), "block" (one block) or
            "thread" (one thread, no barrier: sequential steps such as a scalar recursion).
        threads: default threads per block.
        blocks: default number of blocks.

    Returns:
        A :class:`MegaKernel`.
    """
    def wrap(f):
        return MegaKernel(f, swap=swap, backend=backend, scope=scope, threads=threads, blocks=blocks)
    return wrap(fn) if fn is not None else wrap
