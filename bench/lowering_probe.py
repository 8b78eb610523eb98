"""The element-access lowering forced three ways in one process, timed side by side:
Numba's own indexing, loopkern's global-space accesses with 64-bit offsets, and with 32-bit
offsets (``index_bits`` of ``codegen.render_kernel``; normally the dispatcher picks 32 for
arrays of fewer than 2**31 elements).

    python bench/lowering_probe.py [REPS]

Prints the median µs per step of REPS runs for heat 1M (4000 steps), Jacobi 2048² (1000
steps, tolerance 0: never converges) and Life 1024² (2000 steps), each variant checked
against the Numba-indexing variant's state (bit for bit: same kernel, same order of
operations).
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402
from bench.jacobi import jacobi_kernel, jacobi_problem  # noqa: E402
from bench.life import life_kernel  # noqa: E402
from loopkern.dispatch import dispatcher  # noqa: E402

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
rng = np.random.default_rng(0)
cases = [("heat 1M", bench.heat_kernel, [rng.random(1 << 20).astype(np.float32)] * 2, (bench.ALPHA,),
          dict(steps=4000)),
         ("jacobi 2048^2", jacobi_kernel, [jacobi_problem(2048, rng)] * 2, (np.float32(0.0),), dict(max_steps=1000)),
         ("life 1024^2", life_kernel, [rng.integers(0, 2, (1024, 1024)).astype(np.int32)] * 2, (), dict(steps=2000))]
from numba import cuda  # noqa: E402
for name, make, arrays, scalars, count in cases:
    first = None
    for bits in ("numba", 64, 32):
        dispatcher.index_bits_for = lambda sizes, debug, staged, b=bits: None if b == "numba" else b
        k = make()
        dev = [cuda.to_device(a) for a in arrays]
        k(*dev, *scalars, backend="cuda", **count)      # compile, warm
        times = []
        for _ in range(reps):
            dev = [cuda.to_device(a) for a in arrays]
            cuda.synchronize()
            t0 = time.perf_counter()
            run = k(*dev, *scalars, backend="cuda", **count)
            times.append((time.perf_counter() - t0) / run.steps * 1e6)
        state = dev[0].copy_to_host()
        same = "reference" if first is None else ("same state" if np.array_equal(state, first) else "DIFFERENT STATE")
        first = state if first is None else first
        print(f"{name:14s} {str(bits):6s} {statistics.median(times):8.3f} us/step  ({run.scope}, {run.blocks} blocks; "
              f"{same})", flush=True)
