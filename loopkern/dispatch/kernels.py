"""The compiled kernels of one step: rendered and loaded once per variant (backend, scope,
scalars by reference, debug, staged arrays, run control, float type, element access lowering,
tile mode, cluster launch, steps per halo exchange, streamed tiles, launch bounds),
compiled by Numba once per argument-type signature."""

from __future__ import annotations

import threading

from .. import codegen
from ..errors import ArgumentError
from .checks import describe_array

#: (threads per block, blocks per SM) compiled into CUDA grid-scope kernels (not tile mode or
#: debug, not under Numba's simulator, whose ``cuda.jit`` has no bounds) whose launch loopkern
#: sizes itself, the call naming neither ``threads`` nor ``blocks`` (``codegen.render_kernel``'s
#: ``launch_bounds``): ptxas then knows the registers each thread may have (65536 / (256 * 2))
#: and issues a stencil loop's loads together instead of in waits (``bench/sass_loops.py ...
#: bounds=256/2``). Such a kernel runs at most 256 threads per block, which is what loopkern
#: picks for the grid scope (``config.DEFAULT_THREADS``); a call that names ``threads`` or
#: ``blocks`` gets the kernel without bounds, so any size it could ask before still launches.
#: H100, bench.py in one interleaved run (2026-12-07, bench-results/session42/), µs/step
#: without / with: 2-D heat grid scope 512² 3.09 / 2.73, 1024² 6.35 / 4.55, 2048² 16.6 / 14.7;
#: Jacobi 2048² 16.4 / 16.0 (256²: 2.50 / 2.52); kernel.jax Jacobi 256² 3.12 / 2.93; the
#: ``lk.while_loop`` Jacobi body 256² 3.11 / 3.06. None for no bounds (bench.py
#: ``--launch-bounds off`` times that as a variant of its own).
LAUNCH_BOUNDS: tuple | None = (256, 2)


#: An experiment, off by default: tile-mode kernels with one step per exchange split the
#: exchange's grid barrier and compute the rows that read no halo between its halves
#: (``codegen.render_kernel``'s ``split``), for the steps ``stencil.split_exchange_refusal``
#: allows. Set before the first call (bench.py ``--split-exchange``).
SPLIT_EXCHANGE: bool = False


def _bounds(backend, scope, tile, debug, sized, simulated):
    """The launch bounds a variant's kernel carries (``LAUNCH_BOUNDS``), or None."""
    if backend == "cuda" and scope == "grid" and tile is None and not debug and sized and not simulated:
        return LAUNCH_BOUNDS
    return None


def _splits(spec, backend, tile, debug, cluster, depth, tiles, control) -> bool:
    """Whether a variant's kernel splits its exchange's barrier (``SPLIT_EXCHANGE``; not for
    the measurement-only kernels without run control, whose template polls anyway)."""
    if not (SPLIT_EXCHANGE and backend == "cuda" and tile is not None and depth == 1 and not tiles
            and not cluster and not debug and control):
        return False
    from ..stencil import split_exchange_refusal
    return split_exchange_refusal(spec, tile) is None


class KernelCache:
    """The variants of one step's kernel that calls have needed so far."""

    def __init__(self, spec):
        self.spec = spec
        self.variants: dict = {}
        self.sources: dict = {}
        self._lock = threading.Lock()

    def _key(self, backend, scope, by_ref, debug, staged, control, float_type, index_bits, tile, cluster, depth,
             tiles, sized, simulated) -> tuple:
        """A variant's key in ``sources`` and ``variants``: the options as given, then the launch
        bounds and the split that the switches give it (one source, one compiled kernel)."""
        return (backend, scope, by_ref, debug, staged, control, float_type, index_bits, tile, cluster, depth, tiles,
                _bounds(backend, scope, tile, debug, sized, simulated),
                _splits(self.spec, backend, tile, debug, cluster, depth, tiles, control))

    def source(self, backend, scope, by_ref=None, debug=False, staged=(), control=True, float_type=None,
               index_bits=None, tile=None, cluster=False, depth=1, tiles=0, sized=False):
        """The :class:`~loopkern.codegen.KernelSource` of one variant (rendered once), without
        compiling it: ``kernel.jax`` looks its cubin up on disk by it first
        (``interop/ffi_kernels.py``). ``sized``: loopkern picks the launch's threads and blocks
        (the call named neither), so a grid-scope kernel may carry ``LAUNCH_BOUNDS``."""
        from ..compile import runtime_fingerprint, simulator_enabled
        simulated = backend == "cuda" and simulator_enabled()
        key = self._key(backend, scope, by_ref, debug, staged, control, float_type, index_bits, tile, cluster, depth,
                        tiles, sized, simulated)
        bounds, split = key[-2:]
        src = self.sources.get(key)
        if src is None:
            with self._lock:
                src = self.sources.get(key)
                if src is None:
                    src = self.sources[key] = codegen.render_kernel(
                        self.spec, backend, scope, cache=not simulated,
                        fingerprint=f"runtime {runtime_fingerprint()}", by_ref=by_ref, debug=debug, staged=staged,
                        control=control, float_type=float_type, index_bits=index_bits, tile=tile, cluster=cluster,
                        depth=depth, tiles=tiles, launch_bounds=bounds, split=split)
        return src

    def get(self, backend, scope, by_ref=None, debug=False, staged=(), control=True, float_type=None,
            index_bits=None, tile=None, cluster=False, depth=1, tiles=0, sized=False):
        """The :class:`~loopkern.compile.CompiledKernel` of one variant (rendered and loaded on
        first use; Numba compiles it per argument types in ``specialize``)."""
        from ..compile import compile_kernel, simulator_enabled
        key = self._key(backend, scope, by_ref, debug, staged, control, float_type, index_bits, tile, cluster, depth,
                        tiles, sized, backend == "cuda" and simulator_enabled())
        k = self.variants.get(key)
        if k is None:
            src = self.source(backend, scope, by_ref=by_ref, debug=debug, staged=staged, control=control,
                              float_type=float_type, index_bits=index_bits, tile=tile, cluster=cluster,
                              depth=depth, tiles=tiles, sized=sized)
            with self._lock:
                k = self.variants.get(key)
                if k is None:
                    k = self.variants[key] = compile_kernel(src)
        return k


def check_types(spec, compiled, types, kargs):
    """ArgumentError unless the two arrays of each swap pair have the same compiled type (in
    ``types``, those of the values ``kargs``): the kernel exchanges them, so they must agree in
    layout too, not only in shape and dtype."""
    for i, j in spec.swap:
        ta, tb = types[i], types[j]
        if ta != tb:
            a, b = spec.params[i].name, spec.params[j].name
            raise ArgumentError(f"swap pair ('{a}', '{b}'): the two arrays must have the same memory layout, "
                                f"got '{a}': {describe_array(kargs[i], ta)} and '{b}': "
                                f"{describe_array(kargs[j], tb)}; make both C-contiguous, e.g. with "
                                f"numpy.ascontiguousarray")


#: arrays with fewer elements than this get kernels whose element offsets are 32-bit
INDEX32_LIMIT = 2 ** 31


def index_bits_for(sizes, debug: bool, staged) -> int | None:
    """The ``index_bits`` of a CUDA kernel for arrays of these element counts (see
    ``codegen.render_kernel``): None for debug kernels and kernels with staged arrays, 32 when
    every array has fewer than 2**31 elements, else 64."""
    if debug or staged:
        return None
    return 32 if all(n < INDEX32_LIMIT for n in sizes) else 64
