"""Buffers a run needs besides the user's arrays, and the free lists that recycle them.

A run takes its buffers when it starts and gives them back when it has finished, so calls one
after another reuse the same ones (no allocation per call) and runs in flight at the same time
never share (the barrier counter and the control block belong to one run).
"""

from __future__ import annotations

import threading

import numpy as np

from ..runtime.layout import HOST_SIZE


class FreeList:
    """Objects for runs in flight: ``take`` one (made on demand), ``give`` it back when done."""

    def __init__(self, make):
        self._make = make
        self._free: list = []
        self._lock = threading.Lock()

    def take(self):
        try:
            return self._free.pop()     # list.pop is atomic under the GIL
        except IndexError:
            return self._make()

    def give(self, item):
        self._free.append(item)


def cuda_scratch(blocks: int) -> tuple:
    """A grid-scope run's device scratch: the reductions' per-block partial results
    (float64[2, blocks], int64[2, blocks]), the grid barrier's counter and the count of
    finished blocks (uint32[2], zeroed once: a completed barrier leaves the first one's low 31
    bits at zero, which the next barrier needs, and the last finished block zeroes the second)
    and the stop decision's two slots (int64[2])."""
    from numba import cuda
    n = max(blocks, 1)
    return (cuda.device_array((2, n), np.float64), cuda.device_array((2, n), np.int64),
            cuda.to_device(np.zeros(2, np.uint32)), cuda.device_array(2, np.int64))


def control_block(backend: str) -> tuple:
    """A run's control block (slots in ``runtime/layout.py``): (what the kernel gets, a NumPy
    view the host reads and writes while the kernel runs).

    CUDA: mapped pinned host memory (the simulator's stand-in under NUMBA_ENABLE_CUDASIM).
    CPU: a NumPy array.
    """
    if backend == "cpu":
        block = np.zeros(HOST_SIZE, np.int64)
    else:
        from numba import cuda
        block = cuda.mapped_array(HOST_SIZE, np.int64)
    view = block._ary if hasattr(block, "_ary") else block   # the simulator's array wraps NumPy
    return block, view
