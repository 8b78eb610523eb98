"""A/B of the drop-in loops' loop split (jaxloops Lowering.split_loop) on the GPU: bench.py's
jnp Jacobi body through ``lk.while_loop`` in ``jax.jit``, lowered with and without the split,
called alternately in one process (medians of µs/step over fixed step counts).

    python bench/split_probe.py [sides...]       (default 64 256)
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    import jax
    import jax.numpy as jnp

    import loopkern as lk
    from bench.jaxloops import jacobi_body
    from bench.jacobi import jacobi_problem
    from loopkern.jaxloops.lower import Lowering
    sides = [int(a) for a in sys.argv[1:]] or [64, 256]
    steps = 2000
    for side in sides:
        u0 = jnp.asarray(jacobi_problem(side, np.random.default_rng(0)))
        fns = {}
        for split in (True, False):
            Lowering.splits = split

            def fn(u, split=split):
                # tol -1: runs every step (the condition is evaluated on the device each step)
                return lk.while_loop(lambda c: (c[1] > -1.0) & (c[2] < steps), jacobi_body,
                                     (u, jnp.float32(jnp.inf), jnp.int32(0)), fallback="error")
            f = jax.jit(fn)
            jax.block_until_ready(f(u0))        # trace and compile with this setting
            from loopkern.jaxloops import loops
            assert ("lk.num_threads()" in loops._last_source) == split, loops._last_source
            fns[split] = f
        Lowering.splits = True
        times = {True: [], False: []}
        for _ in range(9):
            for split, f in fns.items():
                t0 = time.perf_counter()
                r = f(u0)
                jax.block_until_ready(r)
                times[split].append((time.perf_counter() - t0) / steps * 1e6)
                assert int(r[2]) == steps
        a, b = (statistics.median(times[s]) for s in (True, False))
        same = np.array_equal(np.asarray(fns[True](u0)[0]), np.asarray(fns[False](u0)[0]))
        print(f"jacobi {side}x{side}: split {a:.3f} us/step, plain {b:.3f} (split/plain {a / b:.3f}); "
              f"fields equal: {same}; all split {[round(x, 3) for x in times[True]]} "
              f"plain {[round(x, 3) for x in times[False]]}", flush=True)


if __name__ == "__main__":
    main()
