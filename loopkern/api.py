"""The public entry point: ``@megakernel``, the :class:`MegaKernel` it returns, and :class:`Run`.

A MegaKernel binds a call and hands it to its :class:`~loopkern.dispatch.Dispatcher`, which
owns the call path (checks, plans, launching, waiting).
"""

from __future__ import annotations

import dataclasses
import functools
import types

from . import codegen
from .dispatch import Dispatcher
from .dispatch.checks import BACKENDS, SCOPES, check_choice, check_count, check_thread_scope
from .errors import ArgumentError, StepSyntaxError
from .frontend import parse_step
from .runs import Run, RunHandle
from .validate import validate_step

#: default ``watchdog=`` of blocking calls: seconds without a new step before a run is reported
DEFAULT_WATCHDOG_S = 60.0

__all__ = ["MegaKernel", "megakernel", "Run", "RunHandle", "DEFAULT_WATCHDOG_S"]


class MegaKernel:
    """A step function compiled into one kernel that runs the whole loop.

    Create it with :func:`megakernel`. Call it like the step function without the step index,
    plus ``steps=`` (or ``max_steps=`` for a step that returns a condition).
    """

    def __init__(self, fn, *, swap=(), backend="auto", scope="auto", threads=None, blocks=None):
        #: the step as parsed when the decorator ran (its free names read then, see
        #: ParsedFunction.read): what the derived kernels (tangent, adjoint) are generated from
        self.parsed = parse_step(fn)
        self.spec = validate_step(self.parsed, swap)
        self.fn = fn
        defaults = dict(backend=check_choice("backend", backend, BACKENDS),
                        scope=check_choice("scope", scope, SCOPES),
                        threads=check_count("threads", threads, minimum=1),
                        blocks=check_count("blocks", blocks, minimum=1))
        #: the call path: checks, launch plans per call signature, launching and waiting
        self.dispatcher = Dispatcher(self.spec, defaults)
        if isinstance(fn, types.FunctionType):
            functools.update_wrapper(self, fn)
        else:
            # a generated step (tangent, adjoint): update_wrapper would copy its fields over
            # this kernel's, ``fn`` (the user's function) included
            self.__name__ = self.__qualname__ = self.spec.name

    def __repr__(self):
        return f"<loopkern.MegaKernel {self.spec.name}{self.dispatcher.signature}>"

    # -- inspection ------------------------------------------------------------------------
    def source(self, backend: str = "cuda", scope: str = "grid", *, steps_per_exchange: int = 1,
               tiles_per_block: int = 0) -> str:
        """The generated kernel source for ``backend`` ("cuda" or "cpu") and ``scope`` ("grid",
        "block", "thread", or "tile" / "cluster" for the CUDA backend: ArgumentError if the
        step is not a stencil that tile mode can keep on chip).

        For ``scope="tile"``, ``steps_per_exchange`` above 1 shows the kernel that runs that
        many steps on chip per exchange of edge cells, and ``tiles_per_block`` above 0 the one
        that streams a field too large for the chip (a call picks both from the field's size:
        ``run.steps_per_exchange``); ArgumentError if the step cannot run that way."""
        check_choice("backend", backend, ("cuda", "cpu"))
        check_choice("scope", scope, ("grid", "block", "thread", "tile", "cluster"))
        for name, value, least in (("steps_per_exchange", steps_per_exchange, 1),
                                   ("tiles_per_block", tiles_per_block, 0)):
            if type(value) is not int or value < least:
                raise ArgumentError(f"{name} must be an integer of at least {least}, got {value!r}")
        if (steps_per_exchange > 1 or tiles_per_block) and scope != "tile":
            raise ArgumentError(f"steps_per_exchange and tiles_per_block are for scope='tile', not {scope!r}")
        if scope in ("tile", "cluster"):
            if backend != "cuda":
                raise ArgumentError(f"scope='{scope}' exists for the CUDA backend only")
            tile = self.dispatcher.tile_stencil(scope)
            if (steps_per_exchange > 1 or tiles_per_block) and not self.dispatcher.fused_steps:
                from .stencil import fused_steps_refusal
                why = fused_steps_refusal(self.spec, tile)
                raise ArgumentError(f"step '{self.spec.name}' runs one step per exchange in tile mode and cannot "
                                    f"stream its field: {why.reason} ({self.spec.filename}:{why.line})")
            return codegen.render_kernel(self.spec, "cuda", "grid", fingerprint="", tile=tile,
                                         cluster=scope == "cluster", depth=steps_per_exchange,
                                         tiles=tiles_per_block).text
        check_thread_scope(self.spec, scope)
        return codegen.render_kernel(self.spec, backend, scope, fingerprint="").text

    # -- derivatives ----------------------------------------------------------------------
    def tangent(self, *wrt: str) -> "MegaKernel":
        """The forward-mode (tangent) kernel of this step with respect to the parameters named
        in ``wrt`` (float arrays and float scalars).

        Its step takes a tangent right after each of those parameters (``u``, ``u_dot``, ...;
        ``_dot`` gets more underscores if the step already uses the name) and updates them
        with the derivative of every update of the primal state, in the same kernel: after a
        run, ``u_dot`` holds the directional derivative of ``u`` along the tangents given at
        the start. Swap pairs of differentiated arrays swap with their tangents. The rules
        are in ``loopkern/tangent.py``; a construct without one raises
        :class:`~loopkern.errors.StepSyntaxError` naming its line. Cached per ``wrt``.
        """
        from .tangent import tangent_function

        def build(parsed, params):
            parsed, dots = tangent_function(parsed, set(wrt))
            pairs = [(params[a], params[b]) for a, b in self.spec.swap]
            return parsed, pairs + [(dots[a], dots[b]) for a, b in pairs if a in dots and b in dots]
        return self._derived("tangent", wrt, build)

    def adjoint(self, *wrt: str, form: str = "gather") -> "MegaKernel":
        """The reverse-mode (adjoint) kernel of one step with respect to the parameters named in
        ``wrt``: its step takes ``u, u_bar, ...`` (a float scalar's adjoint is a 1-element
        array) and turns the adjoints of the state after the step into those of the state
        before it (``loopkern/adjoint.py`` says what it covers). The ``jax.grad`` driver of
        ``kernel.jax`` runs it backwards over segments of the run, as one megakernel per
        segment. ``form`` is ``kernel.jax``'s ``adjoint_form``: "gather" (the default) gives
        each element of a stencil's adjoint the sum of its terms in one thread, "scatter" adds
        them with atomics. Cached per ``wrt`` and ``form``."""
        from .adjoint import ADJOINT_FORMS, adjoint_function
        from .dispatch import checks
        checks.check_choice("form", form, ADJOINT_FORMS)
        return self._derived("adjoint" if form == "gather" else f"adjoint-{form}", wrt,
                             lambda parsed, params: (adjoint_function(parsed, set(wrt), form)[0], ()))

    def _derived(self, kind: str, wrt, build) -> "MegaKernel":
        """The megakernel of a step generated from this one (``build(parsed step, parameter
        names)`` -> (parsed step, swap pairs)), with this kernel's defaults; cached per
        ``kind`` and ``wrt``. ArgumentError unless ``wrt`` names parameters of the step."""
        cache = self.__dict__.setdefault("_derived_kernels", {})
        key = (kind, tuple(wrt))
        if key not in cache:
            params = list(self.spec.param_names)
            if not wrt or any(w not in params for w in wrt):
                raise ArgumentError(f"{self.spec.name}.{kind}(): expected names of the step's parameters, got "
                                    f"{list(wrt)}; the parameters are {params}")
            parsed, swap = build(self.parsed, params)
            d = self.dispatcher.defaults
            what = "forward mode (kernel.tangent, jax.jvp)" if kind == "tangent" else \
                "reverse mode (kernel.adjoint, jax.grad)"
            cache[key] = derived_kernel(parsed, self.spec.name, what, swap=swap, backend=d["backend"],
                                        scope=d["scope"], threads=d["threads"], blocks=d["blocks"])
        return cache[key]

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args, steps=None, max_steps=None, start=0, backend=None, scope=None, threads=None,
                 blocks=None, seed=0, progress=False, timeout=None, debug=False, watchdog=DEFAULT_WATCHDOG_S,
                 _control=True, **kwargs) -> Run:
        """Run the loop and wait for it; arrays are updated in place.

        The first call with a given argument signature (kinds, dtypes, shapes, strides and
        writability of the arguments, and the launch options) checks everything, compiles and
        keeps a launch plan; later calls with that signature only check what depends on the
        values (swap pairs sharing memory, integers beyond int64) and launch. On the CPU
        backend the kernel runs in the calling thread (with ``progress=`` on a worker thread).

        Ctrl-C during the call cancels the kernel at a step boundary, waits until it has
        stopped (the arrays are then consistent, NumPy inputs copied back) and re-raises
        ``KeyboardInterrupt`` (on the CPU backend within about half a second: a long run is
        paused at a step boundary and continued so that Python can see the signal).

        Args:
            *args, **kwargs: the step's parameters after the step index.
            steps: number of steps to run (an upper bound if the step returns a condition).
            max_steps: upper bound on steps for a step that returns a condition.
            start: the step index ``t`` of the first step (default 0), to continue a run:
                N steps in one call equal any split of N into calls that each start where
                the last stopped (``run.next_start``), bit for bit, ``lk.random`` draws
                and swap pairs included.
            backend: "auto", "cuda" or "cpu" (default: the decorator's).
            scope: "auto", "grid", "block", "thread" or "tile" (CUDA only; "thread" is one thread
                with no barrier, for a step without parallel constructs, which "auto" picks for
                it; "tile" is a grid whose blocks keep their tiles of the swap pairs' arrays
                in shared memory for the whole run, for 1-D and 2-D stencils that do not wrap
                around along the first dimension: ArgumentError says why a step does not
                qualify. A step whose effect is a function of the cells it reads (no
                returned condition, lk.sync, reduction, lk.atomic or lk.thread_id, and no
                array written but the swap pairs') runs several steps on chip per exchange of
                edge cells (``run.steps_per_exchange``), and a field too large for the chip
                streams through it, a few tiles per block each round; any other step runs one
                step per exchange, and LaunchError says when its tiles do not fit. "auto"
                picks it for 1-D stencils: at any size for the first kind, from
                ``AUTO_TILE_MIN_ELEMENTS`` elements for the other when they fit;
                "cluster" is tile mode in one thread-block cluster of up to 16 blocks, whose
                barrier is the cluster's hardware barrier: compute capability 9.0+, for
                fields whose tiles fit in 16 blocks' shared memory).
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
        return self.dispatcher.call(args, kwargs, steps, max_steps, start, backend, scope, threads, blocks, seed,
                                    progress, timeout, debug, watchdog, _control)

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
        return self.dispatcher.start(args, kwargs, monitor=_monitor, steps=steps, max_steps=max_steps, start=start,
                                     backend=backend, scope=scope, threads=threads, blocks=blocks, seed=seed,
                                     progress=progress, timeout=timeout, debug=debug, watchdog=watchdog,
                                     control=_control)

    def jax(self, *args, steps=None, max_steps=None, start=0, backend=None, scope=None, threads=None,
            blocks=None, seed=0, timeout=None, checkpoint_every=None, adjoint_form="gather", **kwargs):
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
            scope, threads, blocks: as for calling the kernel (CUDA only; ``scope="tile"``
                and ``"auto"``'s choice of tile mode included, ``"cluster"`` not).
            seed: the seed of ``lk.random`` draws (a Python int).
            timeout: seconds (a Python number) after which the kernel stops itself at a step
                boundary, measured by the GPU's clock from the kernel's start.
            checkpoint_every: reverse mode only: the steps between the states the reverse
                sweep keeps (an int >= 1); None: ceil(sqrt(steps)), which keeps about
                2 sqrt(steps) states and recomputes each step once. Larger values keep fewer
                checkpoints and record more states per segment.
            adjoint_form: reverse mode only. "gather" (the default) gives each element of a
                stencil's adjoint (reads at the loop's index plus constant offsets that never
                wrap around) the sum of its terms in one thread, in a fixed order, so the
                gradient with respect to the arrays is the same in every run and launch
                shape; it costs one more grid barrier per step (about 1% of the gradient's
                time for 64K-element 1-D heat on an H200). "scatter" adds every term into its
                element with an atomic addition instead (the order, and so the last bits,
                can change from run to run). Either way, terms that are not in stencil form
                (``a[i - 1]`` at ``i = 0``, ``a[idx[i]]``) and float scalars' adjoints
                (summed per block, then across blocks with one atomic per block) use atomics.

        Returns:
            A tuple with one new array per array parameter, in parameter order, and, when the
            step returns a condition or ``timeout`` is given, the number of steps executed
            (int32) last. With ``swap`` the first array of each pair holds the newest state.

        Raises:
            ArgumentError: at trace time, for non-JAX arrays, mismatched swap pairs, arrays on
                different platforms or a platform the backend cannot run on.
            LoopkernError: when differentiated with ``timeout=``, or in reverse mode with a
                step count (``steps``/``max_steps``) known only at run time (traced).
            StepSyntaxError: in reverse mode, for a construct the adjoint step does not cover
                yet (``loopkern/adjoint.py``). Forward mode (``jax.jvp``, ``jax.jacfwd``) runs
                the tangent kernel (:meth:`tangent`) for every float parameter; reverse mode
                (``jax.grad``, ``jax.vjp``) the adjoint step (:meth:`adjoint`) backwards over
                the steps, with checkpoints every ``checkpoint_every`` steps. A step that
                returns a condition is differentiated with the executed step count held fixed.
        """
        from .interop.jax_bridge import jax_call
        return jax_call(self, args, kwargs, steps=steps, max_steps=max_steps, start=start, backend=backend,
                        scope=scope, threads=threads, blocks=blocks, seed=seed, timeout=timeout,
                        checkpoint_every=checkpoint_every, adjoint_form=adjoint_form)

    def sharded(self, mesh, in_specs, *, exchange_every=None, radius=None):
        """This stencil step over fields split across the devices of a JAX mesh.

        Each shard runs the step as a ``kernel.jax`` megakernel on its block plus a halo of
        K*r cells (r: how far the step reads, inferred from its constant index offsets), K
        steps per launch; then neighbouring shards exchange halos with ``lax.ppermute``,
        inside ``jax.shard_map`` (``loopkern/interop/sharded.py``). Dimensions along which the
        step wraps around (``(i + 1) % n``) are periodic; the others keep the step's own
        treatment of the field's edges. Reductions in a returned condition are combined
        across shards (``psum``/``pmax``/``pmin``) after each launch. Results equal the
        single-device run bit for bit (a sum in the condition is added in another order).

        Args:
            mesh: a ``jax.sharding.Mesh``.
            in_specs: a ``PartitionSpec`` for every array parameter (``P("x")``,
                ``P("x", "y")``), or one per parameter after ``t`` (a tuple, or a dict by
                name; ``None``/``P()`` for replicated arrays, which the step may only read,
                and for scalars). Every split array is split alike.
            exchange_every: K, the steps between halo exchanges; None: the K with the least
                modelled time per step (``loopkern.sharding.choose_exchange_every``).
            radius: the halo per step (an int, or one per dimension); None: what the step
                reads. A step that returns a condition stops at a multiple of K.

        Returns:
            A :class:`~loopkern.interop.sharded.ShardedKernel`, called like :meth:`jax`.

        Raises:
            StepSyntaxError: for a step that cannot run split (``loopkern/sharding.py`` lists
                the rules: a stencil whose cells are all treated alike along split dimensions,
                reductions only in the returned condition, ...), at its line.
            ArgumentError: for a bad mesh, in_specs, exchange_every or radius.
        """
        from .interop.sharded import ShardedKernel
        return ShardedKernel(self, mesh, in_specs, exchange_every=exchange_every, radius=radius)


def derived_kernel(parsed, of: str, what: str, **kwargs) -> MegaKernel:
    """The MegaKernel of a step loopkern generated from step ``of`` (a derivative: ``what``).

    Raises:
        StepSyntaxError: the generated step fails a check a step must pass; reported at the
            user's line as a limit of ``what``, not as a fault of a step the user never wrote.
    """
    try:
        return MegaKernel(parsed, **kwargs)
    except StepSyntaxError as exc:
        raise StepSyntaxError([dataclasses.replace(
            d, step=of, message=f"{what} is not available for this step: the step loopkern generates for it "
                                f"('{d.step}') fails a check there: {d.message}",
            hint=f"this is a limit of loopkern's {what}, not an error in the step; the other mode may cover it, "
                 f"or differentiating with respect to fewer parameters (the check's own advice: {d.hint})")
            for d in exc.diagnostics]) from None


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
