"""A long simulation you can watch, stop and time-limit: progress, start/cancel, timeout, debug.

    python examples/long_run.py [--n 4096] [--backend auto]

1. runs a 1-D heat equation with a live progress bar (tqdm if installed, else a text line);
2. starts a run that would take hours, watches it for a moment, then cancels it: every
   thread stops after the same step, and the state is exactly that of a run of that many steps;
3. runs with timeout=0.5 s: the kernel stops itself;
4. plants an out-of-bounds write and catches it with debug=True.
Press Ctrl-C during step 1 to see a blocking call cancel cleanly. Exits non-zero on a mismatch.
"""

import argparse
import sys
import time

import numpy as np

import loopkern as lk


@lk.megakernel(swap=[("u", "v")])
def heat(t, u, v, alpha):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    if lk.thread_id() == 0:
        v[0] = u[0]
        v[n - 1] = u[n - 1]


@lk.megakernel(swap=[("u", "v")])
def shifted(t, u, v, alpha):
    n = u.shape[0]
    for i in lk.range(n):
        v[i + 1] = u[i] * alpha        # bug: i + 1 == n for the last i


def reference(u0, steps, alpha):
    u = u0.astype(np.float64).copy()
    for _ in range(steps):
        u[1:-1] = u[1:-1] + alpha * (u[:-2] - 2 * u[1:-1] + u[2:])
    return u


def to_device(a, backend):
    if backend == "cuda":
        from numba import cuda
        return cuda.to_device(a)
    return a.copy()


def to_host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--backend", default="auto")
    args = p.parse_args()
    from loopkern.dispatch import config as launch
    backend = launch.choose_backend(args.backend)
    rng = np.random.default_rng(1)
    u0 = rng.random(args.n)
    ok = True

    u, v = to_device(u0, backend), to_device(u0, backend)
    run = heat(u, v, 0.25, steps=args.steps, backend=backend, progress=True)
    print(f"1. {run.steps} steps on {run.backend} ({run.scope}, {run.blocks}x{run.threads}), stopped: {run.stopped}")

    u, v = to_device(u0, backend), to_device(u0, backend)
    handle = heat.start(u, v, 0.25, steps=10 ** 12, backend=backend)
    time.sleep(0.5)
    seen = handle.steps_done
    t0 = time.perf_counter()
    handle.cancel()
    run = handle.wait()
    latency = (time.perf_counter() - t0) * 1e3
    err = float(np.abs(to_host(u) - reference(u0, run.steps, 0.25)).max()) if run.steps <= 2_000_000 else 0.0
    print(f"2. cancelled after {run.steps} steps ({seen} seen before cancel(); stopped {latency:.2f} ms "
          f"after it); max |u - reference| = {err:.1e}")
    ok &= run.stopped == "cancelled" and err < 1e-9

    u, v = to_device(u0, backend), to_device(u0, backend)
    t0 = time.perf_counter()
    run = heat(u, v, 0.25, steps=10 ** 12, backend=backend, timeout=0.5)
    print(f"3. timeout=0.5: returned after {time.perf_counter() - t0:.3f} s, {run.steps} steps, "
          f"stopped: {run.stopped}")
    ok &= run.stopped == "timeout"

    u, v = to_device(u0, backend), to_device(u0, backend)
    try:
        shifted(u, v, 0.5, steps=10, backend=backend, debug=True)
        print("4. debug=True did not catch the planted bug")
        ok = False
    except lk.BoundsError as exc:
        print(f"4. debug=True caught it:\n{exc}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
