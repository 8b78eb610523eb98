"""2-D Laplace equation by Jacobi iteration, run to a tolerance inside ONE kernel.

    python examples/jacobi2d.py                   # 128 x 128, float64, tol 1e-5

The step returns ``lk.max(err) > tol``: the loop runs on the device until it is false (or
max_steps is reached), with no round trip to the host per step.
"""

import argparse
import sys

import numpy as np

import loopkern as lk


@lk.megakernel(swap=[("u", "v")])
def jacobi(t, u, v, tol):
    n, m = u.shape[0], u.shape[1]
    err = 0.0
    for i, j in lk.grid((1, n - 1), (1, m - 1)):  # interior points; the boundary stays fixed
        new = 0.25 * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
        v[i, j] = new
        err = max(err, abs(new - u[i, j]))
    return lk.max(err) > tol                       # the same on every thread: continue?


def reference(u0, tol, max_steps):
    """The same iteration in NumPy; returns (final grid, steps run)."""
    u = u0.copy()
    v = u0.copy()
    for k in range(max_steps):
        v[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        err = np.abs(v[1:-1, 1:-1] - u[1:-1, 1:-1]).max()
        u, v = v, u
        if not err > tol:
            return u, k + 1
    return u, max_steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=128, help="grid size n x n (default 128)")
    p.add_argument("--tol", type=float, default=1e-5, help="stop when max |change| <= tol")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--scope", choices=["auto", "grid", "block"], default="auto")
    args = p.parse_args(argv)

    rng = np.random.default_rng(1)
    u0 = np.zeros((args.n, args.n))
    u0[0, :], u0[-1, :], u0[:, 0], u0[:, -1] = (rng.random(args.n) for _ in range(4))
    u, v = u0.copy(), u0.copy()                    # both buffers carry the boundary

    run = jacobi(u, v, args.tol, max_steps=args.max_steps, backend=args.backend, scope=args.scope)
    print(f"jacobi2d: n={args.n} tol={args.tol:g} steps={run.steps} stopped={run.stopped!r} "
          f"backend={run.backend} scope={run.scope} blocks={run.blocks} threads={run.threads}")

    ref, ref_steps = reference(u0, args.tol, args.max_steps)
    diff = float(np.abs(u - ref).max())
    print(f"  NumPy reference: steps={ref_steps}, max |loopkern - NumPy| = {diff:.2e}")
    ok = run.stopped == "condition" and run.steps == ref_steps and diff < 1e-12
    if not ok:
        print("FAIL jacobi2d: expected stopped='condition', the same step count as NumPy and diff < 1e-12")
        return 1
    print(f"OK jacobi2d: converged in {run.steps} steps on {run.backend}, same as NumPy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
