"""1-D heat equation: every step of the loop inside ONE kernel.

    python examples/heat1d.py                     # n=65536, 2000 steps, backend auto
    python examples/heat1d.py --steps 1999 --backend cpu

Checks the result against a float64 NumPy reference, then times the run.
"""

import argparse
import sys
import time

import numpy as np

import loopkern as lk


@lk.megakernel(swap=[("u", "v")])
def heat(t, u, v, alpha):
    n = u.shape[0]
    for i in lk.range(1, n - 1):                  # this thread's share of 1..n-2
        v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])


def reference(u0, alpha, steps):
    """The same loop in vectorised float64 NumPy."""
    u = u0.astype(np.float64)
    v = u.copy()
    for _ in range(steps):
        v[1:-1] = u[1:-1] + alpha * (u[:-2] - 2.0 * u[1:-1] + u[2:])
        u, v = v, u
    return u


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=65536, help="number of elements (default 65536)")
    p.add_argument("--steps", type=int, default=2000, help="time steps (default 2000)")
    p.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--scope", choices=["auto", "grid", "block", "tile"], default="auto",
                   help="CUDA scope (ignored on the CPU); 'auto' picks 'tile' on a GPU for this "
                        "stencil: each block keeps its part of the field on chip and runs several "
                        "steps between exchanges of edge cells")
    args = p.parse_args(argv)
    opts = dict(backend=args.backend, scope=args.scope)

    alpha = np.float32(0.25)                      # a float32 scalar keeps the step in float32
    rng = np.random.default_rng(0)
    u0 = rng.random(args.n, dtype=np.float32) - np.float32(0.5)   # zero-mean noise

    # 1. Correctness. The first call compiles (Numba), then runs; NumPy arrays are copied in
    #    and back. v starts as a copy of u so that both buffers hold the fixed boundary values.
    u, v = u0.copy(), u0.copy()
    t0 = time.perf_counter()
    run = heat(u, v, alpha, steps=args.steps, **opts)
    first = time.perf_counter() - t0
    assert run.steps == args.steps and run.stopped == "steps", run
    ref = reference(u0, float(alpha), args.steps)
    err = float(np.linalg.norm(u - ref) / np.linalg.norm(ref))   # u holds the final state
    print(f"heat1d: n={args.n} steps={run.steps} backend={run.backend} scope={run.scope} "
          f"blocks={run.blocks} threads={run.threads} steps per exchange={run.steps_per_exchange}")
    print(f"  relative error vs float64 NumPy: {err:.2e}")
    if not err < 1e-4:
        print(f"FAIL: relative error {err:.2e} >= 1e-4")
        return 1

    # 2. Timing. On a GPU, pass device arrays (updated in place) so that no host copies are
    #    timed. (Numba's CUDA simulator has no real device arrays: keep NumPy there.)
    from numba import config, cuda
    if run.backend == "cuda" and not config.ENABLE_CUDASIM:
        u, v = cuda.to_device(u0), cuda.to_device(u0)
    heat(u, v, alpha, steps=args.steps, **opts)   # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        run = heat(u, v, alpha, steps=args.steps, **opts)
        times.append(time.perf_counter() - t0)
    median = float(np.median(times))
    per_step = median / run.steps * 1e6
    print(f"  first call: {first:.2f} s (compile about {max(first - median, 0.0):.2f} s + run)")
    print(f"  time: {per_step:.3f} us/step (median of 3 calls of {run.steps} steps; "
          f"backend={run.backend} scope={run.scope} blocks={run.blocks} threads={run.threads})")
    print(f"OK heat1d: relative error {err:.1e} < 1e-4, {per_step:.3f} us/step on {run.backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
