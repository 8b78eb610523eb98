"""The in-step API: names a step function calls, such as ``lk.range`` and ``lk.sync``.

These objects are markers. The front end recognises them by identity in the step's globals and
the code generator replaces each call; calling one from ordinary Python is a mistake, so each
raises a :class:`~loopkern.errors.LoopkernError` that says so.
"""

from __future__ import annotations

from .errors import LoopkernError


class Intrinsic:
    """A function that only means something inside a step function."""

    def __init__(self, name: str, doc: str, display: str = ""):
        self.name = name
        self.display = display or f"lk.{name}"
        self.__name__ = name
        self.__qualname__ = name
        self.__doc__ = doc

    def __call__(self, *args, **kwargs):
        raise LoopkernError(
            f"{self.display}() can only be used inside a step function decorated with "
            f"@lk.megakernel; it was called from ordinary Python"
        )

    def __repr__(self) -> str:
        return f"<loopkern in-step function {self.display}>"


range = Intrinsic("range", """This thread's share of a 1-D index range (grid-stride).

Use as ``for i in lk.range(stop)`` or ``lk.range(start, stop[, step])``. Over all threads of the
launch every index is visited exactly once.
""")
grid = Intrinsic("grid", """This thread's share of an n-D index space, yielding index tuples.

Each argument is ``stop`` or ``(start, stop)``: ``for i, j in lk.grid(n, (1, m - 1))``.
""")
sync = Intrinsic("sync", """Barrier across every thread of the launch, inside a step.

Must be reached by every thread: not under control flow that depends on thread-varying values.
""")
sum = Intrinsic("sum", """Grid-wide sum of each thread's value; every thread gets the result.

Floats return the input's float type (accumulated in float64); integers and bools return int64.
It is a barrier, with the same placement rules as :func:`sync`.
""")
max = Intrinsic("max", """Grid-wide maximum of each thread's value; every thread gets the result.""")
min = Intrinsic("min", """Grid-wide minimum of each thread's value; every thread gets the result.""")
thread_id = Intrinsic("thread_id", """This thread's index in ``0 .. lk.num_threads() - 1``.""")
num_threads = Intrinsic("num_threads", """Number of threads that run the step (the same on every thread).""")



class Namespace:
    """A group of in-step functions reached as attributes, such as ``lk.atomic.add``.

    The front end resolves ``lk.atomic.add`` through it as it resolves a module attribute.
    """

    def __init__(self, display: str, doc: str, **members: Intrinsic):
        self.display = display
        self.__doc__ = doc
        self._members = dict(members)
        for name, member in members.items():
            setattr(self, name, member)

    def __dir__(self):
        return sorted(self._members)

    def __repr__(self) -> str:
        return f"<loopkern in-step namespace {self.display} ({', '.join(sorted(self._members))})>"


#: dtypes an array updated with ``lk.atomic.*`` may have (what the GPU's atomics support)
ATOMIC_DTYPES = ("float32", "float64", "int32", "int64", "uint32", "uint64")

atomic = Namespace("lk.atomic", """Atomic updates of one array element, for updates that several iterations of a
parallel loop (or several threads) make to the same element: histograms, scatter-adds, counters.

``lk.atomic.add(a, index, value)``, ``lk.atomic.max(...)`` and ``lk.atomic.min(...)`` update
``a[index]`` (``index`` an integer for a 1-D array, a tuple ``(i, j)`` for n-D, with Python's
meaning of negative indices) in one indivisible step and return the element's old value. The
value is cast to the array's dtype first, which must be float32, float64, int32, int64, uint32
or uint64. Other updates of the same element in the same step see it either before or after,
never half done; the order between threads is unspecified (float sums may round differently
from run to run). A plain ``a[i] += x`` at an element that is not provably the iteration's
own is rejected, since it would lose updates. On the CPU backend, which runs one thread, each
is a plain read-modify-write.

Example, a histogram of ``data``::

    for i in lk.range(data.shape[0]):
        lk.atomic.add(hist, int(data[i] * nbins), 1)
""",
    add=Intrinsic("atomic_add", """``lk.atomic.add(a, index, value)``: ``a[index] += value`` atomically; returns
the old value.""", "lk.atomic.add"),
    max=Intrinsic("atomic_max", """``lk.atomic.max(a, index, value)``: ``a[index] = max(a[index], value)`` atomically;
returns the old value.""", "lk.atomic.max"),
    min=Intrinsic("atomic_min", """``lk.atomic.min(a, index, value)``: ``a[index] = min(a[index], value)`` atomically;
returns the old value.""", "lk.atomic.min"),
)

INTRINSICS = {f.name: f for f in (range, grid, sync, sum, max, min, thread_id, num_threads)}
