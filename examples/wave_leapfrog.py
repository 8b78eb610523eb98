"""1-D wave equation by leapfrog, run in chunks with snapshots between them.

    python examples/wave_leapfrog.py                       # n=4096, 2000 steps in 8 chunks
    python examples/wave_leapfrog.py --chunks 7 --backend cpu

A two-level scheme: u holds the newest time level and v the one before, and each step writes
the next level over v (swap=[("u", "v")] then renames them). After every call u is the newest
level and v the level before it, whatever the chunk length, so the run continues exactly in
the next call (start=run.next_start keeps the step index, and with it the per-step energy
record). Checks the chunked run against the same run as one call and against float64 NumPy.
"""

import argparse
import sys

import numpy as np

import loopkern as lk


@lk.megakernel(swap=[("u", "v")])
def wave(t, u, v, c2, energy):
    n = u.shape[0]
    e = 0.0
    for i in lk.range(1, n - 1):
        v[i] = 2.0 * u[i] - v[i] + c2 * (u[i - 1] - 2.0 * u[i] + u[i + 1])
        e += u[i] * u[i]
    total = lk.sum(e)                     # every thread gets the grid-wide sum
    if lk.thread_id() == 0:
        energy[t] = total                 # one record per step index t


def reference(u0, v0, c2, steps):
    """The same scheme in float64 NumPy: (newest level, level before, sum of u^2 per step)."""
    u, v = u0.astype(np.float64), v0.astype(np.float64)
    energy = np.zeros(steps)
    for t in range(steps):
        energy[t] = np.sum(u[1:-1] ** 2)
        w = v.copy()
        w[1:-1] = 2.0 * u[1:-1] - v[1:-1] + c2 * (u[:-2] - 2.0 * u[1:-1] + u[2:])
        u, v = w, u
    return u, v, energy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--chunks", type=int, default=8, help="calls to split the run into (default 8)")
    p.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    args = p.parse_args(argv)

    x = np.linspace(0.0, 1.0, args.n)
    u0 = np.exp(-((x - 0.5) / 0.05) ** 2)          # a Gaussian pulse at rest: v = u
    v0 = u0.copy()
    c2 = 0.25                                       # (c dt / dx)^2, stable below 1

    # the whole run as one call
    u1, v1, e1 = u0.copy(), v0.copy(), np.zeros(args.steps)
    run = wave(u1, v1, c2, e1, steps=args.steps, backend=args.backend)

    # the same run in chunks of uneven (also odd) lengths, with a snapshot after each
    bounds = np.linspace(0, args.steps, args.chunks + 1).round().astype(int)
    u2, v2, e2 = u0.copy(), v0.copy(), np.zeros(args.steps)
    snapshots, start = [], 0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        r = wave(u2, v2, c2, e2, steps=int(hi - lo), start=start, backend=args.backend)
        start = r.next_start
        snapshots.append((start, float(np.abs(u2).max())))
    ref_u, ref_v, ref_e = reference(u0, v0, c2, args.steps)

    print(f"wave_leapfrog: n={args.n} steps={args.steps} in {args.chunks} calls, backend={run.backend} "
          f"scope={run.scope}")
    for t, peak in snapshots:
        print(f"  after t={t:5d}: max |u| = {peak:.6f}")
    same = np.array_equal(u1, u2) and np.array_equal(v1, v2) and np.array_equal(e1, e2)
    err = max(float(np.abs(u2 - ref_u).max()), float(np.abs(v2 - ref_v).max()))
    err_e = float(np.abs(e2 - ref_e).max() / np.abs(ref_e).max())
    print(f"  chunked run == one call, bit for bit: {same}")
    print(f"  max error vs float64 NumPy: levels {err:.1e}, energy record {err_e:.1e}")
    if not (same and err < 1e-9 and err_e < 1e-9):
        print("FAIL: the chunked run differs")
        return 1
    print("OK wave_leapfrog")
    return 0


if __name__ == "__main__":
    sys.exit(main())
