"""Where a Jacobi step's time goes in the grid scope (issue 12's Jacobi 256² miss): the bench's
Jacobi step beside variants that each leave one part out, at the automatic launch
configuration, ``python bench/step_cost_probe.py [SIDE] [STEPS]``.

  jacobi         the bench's step: 2-D stencil, lk.max of the update, a condition
  no_reduction   the same stencil and stores, no reduction (the condition is a constant)
  flat           the same update over a 1-D index (interior columns by a test), with lk.max
  reduce_only    lk.max of one value per thread and the grid barrier, no field access
  copy_only      one 2-D loop that copies u to v (one read, one write per cell)

Every variant that updates the field is checked against a float64 NumPy reference after the
timed steps (the tolerance is -1: every step runs and reduces). Prints µs per step, the
median of five calls of STEPS steps after a warm-up call.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# appended, not prepended: a PYTHONPATH naming another loopkern tree (a baseline) wins
sys.path.append(str(Path(__file__).resolve().parent.parent))
import loopkern as lk  # noqa: E402
from bench.jacobi import jacobi_kernel, jacobi_problem  # noqa: E402
from numba import cuda  # noqa: E402


def steps_of():
    @lk.megakernel(swap=[("u", "v")])
    def no_reduction(t, u, v, tol):
        n = u.shape[0]
        m = u.shape[1]
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            v[i, j] = np.float32(0.25) * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
        return tol < np.float32(0.0)

    @lk.megakernel(swap=[("u", "v")])
    def flat(t, u, v, tol):
        m = u.shape[1]
        err = np.float32(0.0)
        for k in lk.range(m + 1, u.size - m - 1):
            i = k // m
            j = k - i * m
            if j != 0 and j != m - 1:
                new = np.float32(0.25) * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
                v[i, j] = new
                err = max(err, abs(new - u[i, j]))
        return lk.max(err) > tol

    @lk.megakernel(swap=[("u", "v")])
    def reduce_only(t, u, v, tol):
        return lk.max(np.float32(t)) > tol

    @lk.megakernel(swap=[("u", "v")])
    def copy_only(t, u, v, tol):
        n = u.shape[0]
        m = u.shape[1]
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            v[i, j] = u[i, j]
        return tol < np.float32(0.0)

    return dict(jacobi=jacobi_kernel(), no_reduction=no_reduction, flat=flat, reduce_only=reduce_only,
                copy_only=copy_only)


def jacobi_ref(u0, steps):
    u = u0.astype(np.float64)
    v = u.copy()
    for _ in range(steps):
        v[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        u, v = v, u
    return u


def main():
    side = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    u0 = jacobi_problem(side, np.random.default_rng(0))
    ref = jacobi_ref(u0, steps)
    tol = np.float32(-1.0)
    for name, k in steps_of().items():
        u, v = cuda.to_device(u0), cuda.to_device(u0)
        r = k(u, v, tol, steps=steps, backend="cuda", scope="grid")
        out = u.copy_to_host()
        check = ""
        if name in ("jacobi", "no_reduction", "flat"):
            err = float(np.abs(out - ref).max() / np.abs(ref).max())
            check = f" max|u - ref|/max|ref|={err:.1e}" + ("" if err < 1e-4 else " WRONG RESULT")
        elif name == "copy_only":
            check = " copy " + ("exact" if np.array_equal(out, u0) else "WRONG RESULT")
        times = []
        for _ in range(5):
            u, v = cuda.to_device(u0), cuda.to_device(u0)
            cuda.synchronize()
            t0 = time.perf_counter()
            k(u, v, tol, steps=steps, backend="cuda", scope="grid")
            times.append((time.perf_counter() - t0) / steps * 1e6)
        print(f"{name:14s} {side}x{side}: {statistics.median(times):.3f} us/step (scope={r.scope} "
              f"blocks={r.blocks} threads={r.threads} steps={r.steps}){check}", flush=True)


if __name__ == "__main__":
    main()
