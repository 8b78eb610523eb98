"""Launch configuration: backend choice, scope, occupancy, grid size, shared-memory staging.

Grid scope runs at most as many blocks as the device can hold at once (a grid barrier with a
block that is not resident would wait forever), sized to the problem. Block scope runs one
block whose barrier is ``syncthreads``; thread scope one thread with no barrier, for steps
with no parallel construct.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from dataclasses import dataclass


from ..errors import BackendError, LaunchError

log = logging.getLogger("loopkern")

DEFAULT_THREADS = 256
BLOCK_SCOPE_THREADS = 1024
#: block scope: about this many elements per thread, up to BLOCK_SCOPE_THREADS (H200 heat 4K,
#: arrays in shared memory, 2026-12-02: 128 threads 1.02 µs/step, 256 0.80, 512 0.72, 1024 0.92)
BLOCK_ELEMENTS_PER_THREAD = 8
#: scope="auto" picks one block for problems of at most this many elements (H200 heat, bench.py
#: 2026-12-02: 4K, one block 0.72 µs/step with the arrays in shared memory, 0.95 without, 1.25
#: for the best grid; 8K, one block 1.55 (too big for shared memory), a grid of 64 blocks 1.34)
AUTO_BLOCK_SCOPE_MAX_ELEMENTS = 4096
#: grid scope, small problems: one element per thread while that takes at most one block per
#: SM, then one block per SM up to this many elements per thread (H200 heat: 16K, 64 blocks
#: 1.35 µs/step, 32 blocks 1.59, 16 blocks 2.18; 64K, 132 blocks 1.56, 264 blocks 1.67, 64
#: blocks 2.08)...
SMALL_ELEMENTS_PER_THREAD = 2
#: grid scope, large problems: every co-resident block once each thread would have this many
#: elements at two blocks per SM (bandwidth needs occupancy: heat 16M, 660 blocks 50.7 µs,
#: 528 blocks 61.9 µs, 264 blocks 96 µs); in between, two blocks per SM (heat 1M: 264 blocks
#: 4.66 µs, 528 blocks 4.62, 132 blocks 6.70)
LARGE_ELEMENTS_PER_THREAD = 32
#: scope="auto" keeps a one-dimensional stencil's swap pairs on chip (scope="tile") from this
#: many elements per array, where their tiles fit (H200 heat f32, bench/tile_probe.py and
#: bench.py, 2026-12-03: 64K, tile 2.0 µs/step against 1.5 for the grid scope; 1M, 3.2 against
#: 3.7; 2M, 3.5-4.3 against 5.9).
AUTO_TILE_MIN_ELEMENTS = 1 << 20
#: scope="auto" keeps a two-dimensional stencil on chip from this many elements (tiles of whole
#: rows, each thread a column; at these sizes one step per exchange): bench/tile_probe.py on an
#: H100, 2026-12-05, µs/step tile against grid: heat 128² 2.62 / 2.09, 256² 2.35 / 2.65, 512²
#: 2.60 / 3.75, 1024² 3.71 / 7.46; Life (wrapping around) 256² 2.63 / 2.38, 512² 3.75 / 4.13;
#: Jacobi (a reduction every step) 512² 5.06 / 5.30, 1024² 6.20 / 8.47; on the H200
#: (bench.py) heat 1024² 3.60 / 6.91, Life 1024² 7.53 / 10.50, Jacobi 256² 4.86 / 3.78. With
#: Jacobi's exchange passing its reduction's barrier (codegen._fused_exchange_at; H100,
#: 2026-12-07, bench-results/session37): 256² 3.71 / 2.93 at 132 blocks (3.17 at 66), 512²
#: 4.31 / 4.06 (4.05 at 66): the grid scope still wins below 512², about even at 512².
AUTO_TILE_2D_MIN_ELEMENTS = 1 << 18
#: scope="auto" leaves a stencil on the grid scope when its halo along the first dimension is
#: longer than this share of that dimension (1/32): tiles at least a halo long would then be
#: fewer than 32 (a drop-in loop reading jnp.roll's wrap-around has a halo of n - 1)
AUTO_TILE_HALO_SHARE = 32
_auto_logged = False
_lock = threading.Lock()


_usable: list = []


def cuda_usable() -> bool:
    """True if Numba can use a CUDA GPU here (or its simulator is on); asked once per process."""
    if not _usable:
        try:
            from numba import cuda
            ok = bool(cuda.is_available())
        except Exception:  # no driver, broken install: the CPU backend still works
            ok = False
        _usable.append(ok)
    return _usable[0]


def choose_backend(backend: str) -> str:
    """Resolve ``"auto"`` to ``"cuda"`` or ``"cpu"``; check that the named backend is usable.

    Whether a GPU is usable is decided once per process (by the first call that asks).
    """
    global _auto_logged
    if backend == "auto":
        chosen = "cuda" if cuda_usable() else "cpu"
        if not _auto_logged:
            with _lock:
                if not _auto_logged:
                    _auto_logged = True
                    log.info("loopkern: backend='auto' chose '%s'%s", chosen,
                             "" if chosen == "cuda" else " (no usable CUDA GPU)")
        return chosen
    if backend == "cuda" and not cuda_usable():
        raise BackendError("backend='cuda' but no usable CUDA GPU was found (numba.cuda.is_available() is "
                           "False); use backend='cpu' or backend='auto'")
    return backend


@dataclass(frozen=True)
class LaunchConfig:
    """The grid a run is launched with.

    Attributes:
        scope: ``"grid"``, ``"block"``, ``"tile"`` (a grid keeping tiles on chip), ``"cluster"``
            (tiles on chip in one thread-block cluster) or ``"cpu"``.
        blocks: blocks in the grid (1 for block scope).
        threads: threads per block.
        shared: bytes of dynamic shared memory per block.
        depth: (tile mode) steps run on chip between halo exchanges.
        halo: (tile mode, ``depth`` above 1) elements of the halo scratch array the kernel
            takes last, of the tiles' dtype.
        tiles: (tile mode) 0: each block keeps one tile on chip for the whole run; above 0,
            each block streams this many tiles through its shared memory every round.
    """

    scope: str
    blocks: int
    threads: int
    shared: int = 0
    depth: int = 1
    halo: int = 0
    tiles: int = 0


#: bytes of dynamic shared memory block scope may use for the arrays: the 48 KiB every kernel
#: gets without opting in, less room for the reductions' static shared memory
STAGE_MAX_BYTES = 48 * 1024 - 2048


def plan_staging(spec, argv, check_overlap: bool = True) -> tuple[tuple, int]:
    """Which array arguments block scope holds in shared memory: (indices, bytes).

    Every array of the swap pairs' dtype (of the first array's, without swap) joins, swap
    pairs together and in parameter order, while the total fits in STAGE_MAX_BYTES; nothing is
    staged if a swap pair does not fit or if a staged array shares memory with another
    argument (the copies would then diverge). ``check_overlap=False`` leaves that test out,
    for arrays known to be separate buffers (``kernel.jax``: every array the kernel writes is
    a result buffer of its own).
    """
    from .args import ArrayArg, first_overlap
    arrays = {i: a for i, a in enumerate(argv) if isinstance(a, ArrayArg)}
    if not arrays:
        return (), 0
    first = spec.swap[0][0] if spec.swap else min(arrays)
    dtype = arrays[first].dtype
    pairs = {i: pair for pair in spec.swap for i in pair}
    chosen, total = [], 0
    for i, a in arrays.items():
        if i in chosen or a.dtype != dtype:
            continue
        group = pairs.get(i, (i,))     # a swap pair joins (or fails) as one
        same = all(j in arrays and arrays[j].dtype == dtype for j in group)
        need = sum(arrays[j].size * dtype.itemsize for j in group) if same else 0
        if not same or total + need > STAGE_MAX_BYTES:
            if i in pairs:
                return (), 0
            continue
        chosen += group
        total += need
    if check_overlap and first_overlap(argv, chosen) is not None:
        return (), 0
    return tuple(sorted(chosen)), total


def resolve_scope(scope: str, work: int, parallel: bool = True, light: bool = True) -> str:
    """``"auto"``: ``"thread"`` for a step with no parallel construct (nothing to share, so no
    barrier to pay), ``"block"`` up to AUTO_BLOCK_SCOPE_MAX_ELEMENTS when the work per element
    is ``light`` (``StepSpec.light_elements``), else ``"grid"``. A heavy step on one SM loses
    to a grid: H200 N-body, 1024 bodies, one block 381 µs/step, 4 blocks 182."""
    if scope != "auto":
        return scope
    if not parallel:
        return "thread"
    return "block" if light and work <= AUTO_BLOCK_SCOPE_MAX_ELEMENTS else "grid"


def cuda_config(kernel, scope: str, work: int, threads: int | None, blocks: int | None,
              simulator: bool, shared: int = 0, sms: int | None = None) -> LaunchConfig:
    """Pick blocks and threads for a CUDA launch and check that they can run.

    Args:
        kernel: the compiled kernel (for occupancy); unused under the simulator.
        scope: ``"grid"`` or ``"block"``.
        work: elements in the largest array argument (the problem size).
        threads: threads per block asked for, or None.
        blocks: blocks asked for, or None.
        simulator: running under Numba's CUDA simulator (one block only).
        shared: bytes of dynamic shared memory the kernel needs (block scope's staged arrays).
        sms: the device's SM count, if the caller knows it (else Numba's current device's).

    Raises:
        LaunchError: the request cannot be co-resident or is malformed.
    """
    if scope == "thread":
        if threads not in (None, 1) or blocks not in (None, 1):
            raise LaunchError(f"threads={threads}, blocks={blocks}: scope='thread' runs one thread")
        return LaunchConfig("thread", 1, 1)
    max_tpb = 1024 if simulator else int(kernel.max_threads_per_block)
    if threads is None:
        if simulator:
            want = 64
        elif scope == "block":
            want = min(BLOCK_SCOPE_THREADS, -(-work // (32 * BLOCK_ELEMENTS_PER_THREAD)) * 32)
        else:
            want = DEFAULT_THREADS
        threads = max(32, min(want, max_tpb) // 32 * 32)
    if threads % 32 or not 32 <= threads <= 1024:
        raise LaunchError(f"threads={threads}: threads per block must be a multiple of 32 between 32 and 1024 "
                          f"(reductions work warp by warp)")
    if threads > max_tpb:
        raise LaunchError(f"threads={threads}: this kernel can run at most {max_tpb} threads per block "
                          f"(it uses {getattr(kernel, 'regs_per_thread', '?')} registers per thread); "
                          f"pass threads<={max_tpb // 32 * 32}")
    if scope == "block":
        if blocks not in (None, 1):
            raise LaunchError(f"blocks={blocks}: scope='block' runs exactly one block; use scope='grid' for more")
        return LaunchConfig("block", 1, threads, shared)
    if simulator:
        if blocks not in (None, 1):
            raise LaunchError(f"blocks={blocks}: Numba's CUDA simulator can run only one cooperative block; "
                              f"pass blocks=1 (or leave it out)")
        return LaunchConfig("grid", 1, threads)
    limit = _coresident_limit(kernel, threads)
    if limit < 1:
        raise LaunchError(f"threads={threads}: not even one block of this kernel fits on the device")
    if blocks is None:
        blocks = auto_blocks(work, threads, limit, sms if sms is not None else _sm_count())
    if blocks < 1:
        raise LaunchError(f"blocks={blocks}: must be at least 1")
    if blocks > limit:
        raise LaunchError(f"blocks={blocks}: at most {limit} blocks of {threads} threads of this kernel can be "
                          f"resident on the device at once, and a grid barrier needs every block resident; "
                          f"pass blocks<={limit} (or fewer threads)")
    return LaunchConfig("grid", blocks, threads)


def auto_blocks(work: int, threads: int, limit: int, sms: int) -> int:
    """Blocks for a grid-scope run of ``work`` elements (see the constants above)."""
    one_each = math.ceil(work / threads)
    if one_each <= sms:
        return max(1, min(one_each, limit))
    if work <= SMALL_ELEMENTS_PER_THREAD * threads * sms:
        return min(sms, limit)
    two_per_sm = min(limit, 2 * sms)
    if work >= LARGE_ELEMENTS_PER_THREAD * threads * two_per_sm:
        return limit
    return two_per_sm


_LIMITS: dict = {}


def _coresident_limit(kernel, threads: int) -> int:
    """Blocks of ``kernel`` that fit on the device at once (an occupancy query, memoized)."""
    key = (id(kernel), threads)
    hit = _LIMITS.get(key)
    if hit is None or hit[0] is not kernel:
        hit = _LIMITS[key] = (kernel, int(kernel.max_cooperative_grid_blocks(threads)))
    return hit[1]


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    from numba import cuda
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


@dataclass(frozen=True)
class Chip:
    """What tile mode sizes its tiles by: the device's SMs and shared memory.

    Attributes:
        sms: streaming multiprocessors.
        block_shared: bytes of shared memory a block may opt in to.
        sm_shared: bytes of shared memory an SM holds for its blocks.
    """

    sms: int
    block_shared: int
    sm_shared: int


def numba_chip() -> Chip:
    """The :class:`Chip` of Numba's current device."""
    from numba import cuda
    dev = cuda.get_current_device()
    block = int(getattr(dev, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", 48 * 1024))
    return Chip(_sm_count(), block, int(getattr(dev, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", block)))


#: tile mode: threads per block (one block per SM holds few warps; H200, bench/tile_probe.py
#: 2026-12-03, 132 blocks: heat 1M 2.80 µs/step at 512 threads, 3.23 at 256; 2M 3.63 and 4.34;
#: 2-D heat 1024² 7.19 and 8.17; 4K and 64K within 0.07 µs)
TILE_THREADS = 512
#: tile mode: the block counts tried, as multiples of the SM count, smallest first (the first
#: whose tiles fit in shared memory and whose blocks can all be resident is taken)
TILE_BLOCKS_PER_SM = (1, 2, 4, 8)


#: tile mode: most steps run on chip between two halo exchanges when the step allows it
#: (``stencil.fused_steps_refusal``); each round of steps ends with one grid barrier. H200
#: heat f32, µs/step with 16 / 32 / 64: 4K 0.26 / 0.24 / 0.24, 64K 0.32 / 0.26 / 0.23, 1M
#: 0.97 / 0.91 / 0.89 (bench-results/session16/tile-depth-probe2-1442.log); a stop request is
#: seen once per round, so longer rounds gain little and answer later
TILE_DEPTH_MAX = 32
#: tile mode with several steps per exchange: threads per block by tile length (cells or
#: rows): up to the first bound 256, up to the second 512, else 1024 (H200 heat f32, 32 steps
#: per exchange: 64K, 497-cell tiles, 0.26 µs/step at 256 threads, 0.29 at 512; 256K, 1986
#: cells, 0.43 and 0.39; 1M, 7944 cells, 1.34 / 0.91 / 0.94 at 256 / 512 / 1024; 2M, 15888
#: cells, 1.58 at 512, 1.47 at 1024)
TILE_FUSED_THREADS = ((1024, 256), (12288, 512))
#: tile mode: a tile is at least this many times its widened halo (both sides) long, so the
#: cells recomputed in the halo stay a small part of a step's work
TILE_DEPTH_SPAN = 4
#: the same for 2-D tiles (ranges of rows), kept apart because a halo row is a whole row of the
#: field. H100 2-D heat 1024² f32, 132 tiles of 8 rows, one step per exchange against two (a
#: span of 2): 3.48 against 3.26 µs/step in one run (bench-results/session30/tile-probe-heat2d-
#: 1024-depth.log), 3.48 against 3.71 in another (session31/4-tile-probe-span-rows-512threads.log),
#: so the rule is the 1-D one
TILE_DEPTH_SPAN_ROWS = 4


def tile_depth(n: int, halo: tuple, blocks: int, span: int = TILE_DEPTH_SPAN) -> int:
    """Steps per halo exchange for ``n`` cells (rows) over ``blocks`` tiles and a stencil of
    ``halo`` = (cells below, above): as many as keep each tile ``span`` times its widened halo
    long, from 1 to ``TILE_DEPTH_MAX`` (the most, for a stencil without a halo)."""
    width = sum(halo)
    if width == 0:
        return TILE_DEPTH_MAX
    tile = -(-n // max(blocks, 1))
    return max(1, min(TILE_DEPTH_MAX, tile // (span * width)))


def first_tile_blocks(n: int, halo: tuple, blocks: int | None, simulator: bool, fused: bool,
                      chip: Chip | None = None) -> int:
    """The block count tile mode tries first for ``n`` cells (rows): the one asked for; else
    one block per SM, or, when several steps may run per halo exchange (``fused``), fewer
    for a small field, each tile long enough for ``TILE_DEPTH_MAX`` steps per exchange (H200
    heat 4K, 16 steps per exchange: 33 blocks 0.26 µs/step, 132 blocks 0.26; 64K: 132 blocks
    0.32, 33 blocks 0.49; bench-results/session16). The simulator runs one. ``chip``: the
    device's (Numba's current device's when not given)."""
    if blocks is not None:
        return blocks
    if simulator:
        return 1
    most = (chip or numba_chip()).sms * TILE_BLOCKS_PER_SM[0]
    if not fused:
        return most
    return max(1, min(most, n // (TILE_DEPTH_MAX * TILE_DEPTH_SPAN * max(sum(halo), 1))))


#: bytes of a block's shared memory kept for what a tile-mode kernel declares itself (the
#: reductions' slots) when choosing its steps per exchange before it is compiled
TILE_STATIC_SHARED = 2048


#: the shared memory the simulator is taken to have per block (it has no limit of its own;
#: tests lower it to make small fields stream)
SIMULATOR_SHARED_BYTES = 48 * 1024
#: tile mode, a field too large to stay on chip: blocks per SM, and the most shared memory
#: each gives one tile (two blocks per SM: one block's tile loads while the other computes)
STREAM_BLOCKS_PER_SM = 2
STREAM_TILE_BYTES = 96 * 1024
#: a field streams only when its tiles hold this many steps per round: each round reads and
#: writes both buffers of every tile, twice the grid scope's traffic per step, and shallow
#: tiles lose to it (H200 2-D heat 2048² float32, rows of 16 KiB, one step per round: 111.5
#: µs/step against 14.2 for the grid scope; bench-results/session16/bench-1510-main.log)
STREAM_MIN_DEPTH = 4


def _resident_candidates(first: int | None, chip: Chip) -> list[int]:
    """The block counts a tile-mode grid whose tiles stay on chip tries, in order: ``first``
    (``first_tile_blocks``) when it is below one block per SM, then one, two, four and eight
    per SM."""
    per_sm = [chip.sms * k for k in TILE_BLOCKS_PER_SM]
    return ([first] if first is not None and first < per_sm[0] else []) + per_sm


def _shared_room(simulator: bool, chip: Chip | None) -> tuple[int, int]:
    """(bytes of dynamic shared memory a block may have, bytes an SM holds for its blocks)."""
    if simulator:
        return SIMULATOR_SHARED_BYTES, SIMULATOR_SHARED_BYTES
    return chip.block_shared - TILE_STATIC_SHARED, chip.sm_shared


def _fits(shared: int, blocks: int, room: tuple[int, int], simulator: bool, chip: Chip | None) -> bool:
    """Whether ``blocks`` blocks of ``shared`` bytes each fit in a block's and, spread evenly
    over the SMs, in an SM's shared memory (with each block's static part and the 1 KiB the
    hardware keeps per block)."""
    if shared > room[0]:
        return False
    if simulator:
        return True
    per_sm = -(-blocks // chip.sms)
    return per_sm * (shared + TILE_STATIC_SHARED + 1024) <= room[1]


def tile_layout(n: int, halo: tuple, cell_bytes: int, blocks: int | None, simulator: bool,
                fused: bool, chip: Chip | None = None, rows: bool = False) -> tuple[int, int]:
    """(steps per halo exchange, tiles per block) of a tile-mode launch, chosen before its
    kernel is compiled (the kernel is specialised to both).

    Tiles per block 0 (each block keeps one tile on chip for the whole run) when the tiles fit:
    the steps per exchange are :func:`tile_depth` at the first block count that
    :func:`tile_config` will try (``first_tile_blocks``, then one, two, four and eight blocks per
    SM; or ``blocks``) whose tiles, widened for that many steps, fit in a block's shared
    memory. Otherwise, when several steps may run per exchange (``fused``), the field streams:
    ``STREAM_BLOCKS_PER_SM`` blocks per SM (or ``blocks``) each own the fewest tiles that fit
    in ``STREAM_TILE_BYTES``, if those tiles hold ``STREAM_MIN_DEPTH`` steps per round. (1, 0)
    when neither holds (``tile_config`` then says why the tiles do not fit). ``chip``: the
    device's (Numba's current device's when not given). ``rows``: the cells are rows of a 2-D
    field (``TILE_DEPTH_SPAN_ROWS``).
    """
    if not fused:
        return 1, 0
    span = TILE_DEPTH_SPAN_ROWS if rows else TILE_DEPTH_SPAN
    if not simulator:
        chip = chip or numba_chip()
    room = _shared_room(simulator, chip)
    first = first_tile_blocks(n, halo, blocks, simulator, fused, chip)
    if simulator:
        candidates = [first]
    else:
        candidates = [blocks] if blocks is not None else _resident_candidates(first, chip)
    for b in candidates:
        depth = tile_depth(n, halo, b, span)
        if _fits(cell_bytes * (-(-n // b) + depth * sum(halo)), b, room, simulator, chip):
            return depth, 0
    nb = blocks if blocks is not None else 1 if simulator else chip.sms * STREAM_BLOCKS_PER_SM
    budget = min(room[0], STREAM_TILE_BYTES)
    tiles = max(1, -(-n * cell_bytes // (nb * budget)))
    while True:
        rows = -(-n // (nb * tiles))
        depth = tile_depth(n, halo, nb * tiles, span)
        if cell_bytes * (rows + depth * sum(halo)) <= budget:
            return (depth, tiles) if depth >= STREAM_MIN_DEPTH or not sum(halo) else (1, 0)
        if rows == 1:
            return 1, 0
        tiles += 1


def tile_config(kernel, n: int, cell_bytes: int, halo: tuple, threads: int | None, blocks: int | None,
                simulator: bool, cluster: bool = False, depth: int = 1, halo_cell: int = 0,
                first: int | None = None, tiles: int = 0, chip: Chip | None = None, row: int = 1) -> LaunchConfig:
    """Blocks, threads and dynamic shared memory of a tile-mode launch (``scope="tile"``, or
    ``scope="cluster"`` with ``cluster``: the grid is one thread-block cluster).

    Each block keeps ``T = ceil(n / blocks)`` cells plus the halo (``halo`` = cells below,
    above) of every resident array in shared memory: ``cell_bytes`` bytes per cell (the
    resident arrays' itemsizes summed). A tile must be at least as long as the halo on either
    side (a block's halo then comes from its two neighbours only). A grid takes the fewest
    blocks per SM that fit; a cluster the most blocks (up to 16) that the device schedules
    together, since more blocks share the work and its barrier costs about the same.

    With ``depth`` steps per halo exchange the halo is ``depth`` times wider, a tile must be
    that much longer, and the launch carries a halo scratch array of ``2 * blocks *
    depth * (below + above) * halo_cell`` elements (``halo_cell``: elements of one cell of
    every resident array together). ``first``: a block count below one per SM to try first
    (``first_tile_blocks``). ``tiles`` above 0: each block streams that many tiles of
    ``ceil(n / (blocks * tiles))`` rows through its shared memory (``tile_layout`` chose the
    block count: ``blocks``, else ``STREAM_BLOCKS_PER_SM`` per SM). ``chip``: the device's
    (Numba's current device's when not given). ``row``: elements of a cell (a 2-D field's row
    length), for the threads of a tile of several steps per exchange (``TILE_FUSED_THREADS``
    counts elements).

    ``kernel`` is a Numba kernel, or one that kernel.jax runs through the XLA FFI shim
    (``via_ffi_shim`` true: the shim allows it its dynamic shared memory before each occupancy
    query and launch, and no cluster launch goes that way).

    Raises:
        LaunchError: no block count fits (or the one asked for does not).
    """
    name = "cluster" if cluster else "tile"
    lo, hi = depth * halo[0], depth * halo[1]
    wide = max(lo, hi, 1)

    def threads_for(b):
        if threads is not None:
            return threads
        if simulator:
            return 64
        want = TILE_THREADS
        if depth > 1 or tiles:
            want = next((k for bound, k in TILE_FUSED_THREADS if -(-n // (b * per)) * row <= bound), 1024)
        return max(32, min(want, int(kernel.max_threads_per_block)) // 32 * 32)

    per = max(tiles, 1)

    def made(b, shared, threads_=None):
        # (a stencil without a halo still gets a scratch array: the kernel takes one)
        return LaunchConfig(name, b, threads_ or threads_for(b), shared, depth,
                            max(1, 2 * b * per * (lo + hi) * halo_cell) if depth > 1 or tiles else 0, tiles)
    if threads is not None and (threads % 32 or not 32 <= threads <= 1024):
        raise LaunchError(f"threads={threads}: threads per block must be a multiple of 32 between 32 and 1024")

    def shared_for(b):
        return cell_bytes * (-(-n // (b * per)) + lo + hi)
    if simulator:
        if blocks not in (None, 1):
            raise LaunchError(f"blocks={blocks}: Numba's CUDA simulator can run only one cooperative block; "
                              f"pass blocks=1 (or leave it out)")
        if shared_for(1) > SIMULATOR_SHARED_BYTES:
            raise LaunchError(f"scope='{name}' cannot keep this field on chip: it needs {shared_for(1)} bytes of "
                              f"shared memory (the simulator is taken to have {SIMULATOR_SHARED_BYTES}); "
                              f"use scope='grid'")
        return made(1, shared_for(1))
    chip = chip or numba_chip()
    shim = getattr(kernel, "via_ffi_shim", False)
    if cluster:
        from numba import cuda

        from . import driver
        dev = cuda.get_current_device()
        func = driver.kernel_handle(kernel)
        if tuple(dev.compute_capability) < (9, 0):
            raise LaunchError(f"scope='cluster' needs thread-block clusters (compute capability 9.0 or newer); "
                              f"this GPU has {dev.compute_capability[0]}.{dev.compute_capability[1]}: "
                              f"use scope='tile' or 'grid'")
        if blocks is not None and not 1 <= blocks <= driver.CLUSTER_MAX:
            raise LaunchError(f"blocks={blocks}: scope='cluster' runs one cluster of 1 to {driver.CLUSTER_MAX} "
                              f"blocks")
        driver.allow_large_clusters(func, int(dev.id))
    max_shared = chip.block_shared - int(getattr(kernel, "shared_mem_per_block", 0))
    if not shim:
        from numba import cuda

        from . import driver
        # above 48 KiB a kernel must opt in, before the occupancy query and the launch
        driver.allow_dynamic_shared(driver.kernel_handle(kernel), max_shared, int(cuda.get_current_device().id))
    if blocks is not None:
        candidates = [blocks]
    elif tiles:
        candidates = [chip.sms * STREAM_BLOCKS_PER_SM]
    elif cluster:
        candidates = [driver.CLUSTER_MAX, driver.CLUSTER_PORTABLE_MAX, 4, 2, 1]
    else:
        candidates = _resident_candidates(first, chip)
    why = []
    for b in candidates:
        if b < 1:
            raise LaunchError(f"blocks={b}: must be at least 1")
        if -(-n // (b * per)) < wide and b * per > 1:
            why.append(f"{b * per} tiles of {-(-n // (b * per))} cells, shorter than the halo ({wide}"
                       + (f": {depth} steps per exchange" if depth > 1 else "") + ")")
            continue
        shared = shared_for(b)
        if shared > max_shared:
            why.append(f"{b} blocks need {shared} bytes of shared memory per block (at most {max_shared})")
            continue
        if cluster:
            if driver.max_active_clusters(func, b, threads_for(b), shared) < 1:
                why.append(f"a cluster of {b} blocks of {threads_for(b)} threads with {shared} bytes each cannot be "
                           f"scheduled on this device")
                continue
        else:
            # a streamed field's blocks may hold fewer threads for two to fit on an SM
            # (registers): 512, then 256 and 128 when the thread count is not given
            options = [threads_for(b)]
            if tiles and threads is None:
                options += [t for t in (options[0] // 2, options[0] // 4) if t >= 128]
            fit = next((t for t in options if b <= int(kernel.max_cooperative_grid_blocks(t, shared))), None)
            if fit is None:
                limit = int(kernel.max_cooperative_grid_blocks(options[-1], shared))
                why.append(f"{b} blocks of {options[-1]} threads with {shared} bytes each: at most {limit} fit "
                           f"at once")
                continue
            return made(b, shared, fit)
        return made(b, shared)
    raise LaunchError(f"scope='{name}' cannot keep this field on chip: " + "; ".join(why)
                      + ("; use scope='tile' or 'grid'" if cluster else "; use scope='grid'"))
