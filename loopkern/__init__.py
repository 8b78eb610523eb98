"""loopkern: a loop's step function, in restricted Python, compiled into ONE GPU kernel.

Example::

    import loopkern as lk

    @lk.megakernel(swap=[("u", "v")])
    def heat(t, u, v, alpha):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])

    run = heat(u, v, 0.25, steps=10_000)   # one launch; u holds the final state
"""

__version__ = "0.1.0"

from .dsl import atomic, grid, max, min, num_threads, range, sum, sync, thread_id
from .errors import (ArgumentError, BackendError, BoundsError, CompileError, HangError, LaunchError,
                     LoopkernError, StepError, StepSyntaxError)
from .runs import Run, RunHandle
from .api import MegaKernel, megakernel
from . import random

__all__ = [
    "megakernel", "MegaKernel", "Run", "RunHandle",
    "range", "grid", "sync", "sum", "max", "min", "thread_id", "num_threads", "random", "atomic",
    "LoopkernError", "StepSyntaxError", "CompileError", "ArgumentError", "LaunchError", "BackendError",
    "BoundsError", "HangError", "StepError",
]

_JAX_LOOPS = ("fori_loop", "while_loop", "scan", "JaxLoopWarning")


def __getattr__(name):
    # lk.fori_loop, lk.while_loop, lk.scan need JAX (an optional extra): imported on first use
    if name in _JAX_LOOPS:
        try:
            import jax  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"loopkern.{name} needs JAX, an optional extra: pip install 'loopkern[jax]' "
                              f"(or jax itself)") from exc
        from . import jaxloops
        return getattr(jaxloops, name)
    raise AttributeError(f"module 'loopkern' has no attribute {name!r}")
