"""Why a Jacobi step costs more through JAX: µs per step of the hand-written Jacobi step called
directly (Numba device arrays), through kernel.jax inside jax.jit (default grid, and the direct
call's blocks and threads), and of the jnp body through lk.while_loop, with each one's launch
configuration; interleaved rounds, medians of host wall time per blocking call. Each runs to
the tolerance (as bench.py does) and, with a tolerance of 0, for the same number of steps
(stopping at the step count instead of by the condition), and for twice that many: the slope
between the two is the cost of a step without the fixed cost of a call. The direct call's
arrays are reset before each call (outside the timing). A call of one step is timed too (the
call's fixed cost measured, not extrapolated).

The direct call is also timed with the blocking wait of before session 39 (`old wait`: a
geometric back-off of sleeps up to 0.5 ms), spinning on the done flag throughout (`spin`), and
as GPU time between events right after 2 ms of other GPU work queued before it (`warm`): if the
fixed cost is the GPU's clock rising from idle, or the host's part of the call, it is gone there.

    python bench/jax_path_probe.py [rounds] [sides, comma-separated; default 64,256]
"""

import os
import statistics
import sys
import time

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from numba import cuda  # noqa: E402

import loopkern as lk  # noqa: E402
from loopkern import runs  # noqa: E402
from bench.jacobi import JACOBI_TOL, jacobi_kernel, jacobi_problem  # noqa: E402
from bench.jaxloops import jacobi_body  # noqa: E402
from loopkern.interop.jax_bridge import call_cache  # noqa: E402
from loopkern.jaxloops import loops  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
sides = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 256]


@cuda.jit
def _busy(out, n):
    # about n * 2 ns of one thread's work per block: keeps the GPU busy before a timed call
    acc = 0.0
    for i in range(n):
        acc = acc * 0.999 + i
    out[cuda.blockIdx.x] = acc


def configs(mk):
    return [(c.config.scope, c.config.blocks, c.config.threads) for c in call_cache(mk).values() if c.config]


TOL = float(JACOBI_TOL)
busy_out = cuda.device_array(132, np.float64)
for side in sides:
    u0 = jacobi_problem(side, np.random.default_rng(0))
    k = jacobi_kernel()
    du, dv = cuda.to_device(u0), cuda.to_device(u0)
    info = {}

    def direct(tol, n, warm=False, wait=None):
        # wall time of the blocking call; `warm`: the GPU time between events around the call,
        # with 2 ms of other work queued first (so the host's part of the call is hidden too)
        du.copy_to_device(u0)
        dv.copy_to_device(u0)
        cuda.synchronize()
        e0, e1 = cuda.event(), cuda.event()
        if warm:
            _busy[132, 1](busy_out, 1000000)
        saved = (runs.SPIN_S, runs.SLEEP_FRACTION)
        if wait is not None:
            runs.SPIN_S, runs.SLEEP_FRACTION = wait
        t = time.perf_counter()
        e0.record()
        try:
            r = k(du, dv, tol, max_steps=n)
        finally:
            runs.SPIN_S, runs.SLEEP_FRACTION = saved
        e1.record()
        e1.synchronize()
        dt = time.perf_counter() - t
        info.update(scope=r.scope, blocks=r.blocks, threads=r.threads)
        return (e0.elapsed_time(e1) * 1e-3 if warm else dt), r.steps
    _, converged = direct(TOL, 20000)
    kj = jacobi_kernel()
    ju, jv = jnp.asarray(u0), jnp.asarray(u0)
    jitted = {}

    def timed(make, key):
        def run(tol, n):
            f = jitted.get((key, tol, n))
            if f is None:
                f = jitted[(key, tol, n)] = make(tol, n)
                jax.block_until_ready(f())
            t = time.perf_counter()
            r = jax.block_until_ready(f())
            return time.perf_counter() - t, int(r[-1] if key != "while" else r[2])
        return run
    variants = {
        "direct": direct,
        "direct, warm": lambda tol, n: direct(tol, n, warm=True),
        # the blocking wait before SLEEP_FRACTION (a geometric back-off alone), and spinning throughout
        "direct, old wait": lambda tol, n: direct(tol, n, wait=(2e-3, 1e9)),
        "direct, spin": lambda tol, n: direct(tol, n, wait=(100.0, 1e9)),
        "kernel.jax": timed(lambda tol, n: jax.jit(lambda: kj.jax(ju, jv, tol, max_steps=n)), "kj"),
        "lk.while_loop": timed(lambda tol, n: jax.jit(lambda: lk.while_loop(
            lambda c: (c[1] > tol) & (c[2] < n), jacobi_body, (ju, jnp.float32(jnp.inf), jnp.int32(0)),
            fallback="error")), "while"),
    }
    # to the tolerance (max 20000 steps), and the same number of steps with a tolerance of 0
    cases = [(name, tol, n) for name in variants for tol, n in ((TOL, 20000), (0.0, 1), (0.0, converged),
                                                                (0.0, 2 * converged))]
    for name, tol, n in cases:
        variants[name](tol, n)
    times = {r: [] for r in cases}
    done = {}
    for _ in range(rounds):
        for r in cases:
            dt, done[r] = variants[r[0]](r[1], r[2])
            times[r].append(dt)
    wmk = list(loops._kernels.values())[-1]
    print(f"jacobi {side}x{side}: direct {info}, converges in {converged} steps")
    print(f"  kernel.jax configs: {configs(kj)}; lk.while_loop's: {configs(wmk)}")
    for r, ts in times.items():
        med = statistics.median(ts)
        print(f"  {r[0]:16s} tol={r[1]:g} max_steps={r[2]:5d}: {done[r]:5d} steps, {med * 1e3:7.3f} ms/call, "
              f"{med / max(done[r], 1) * 1e6:6.3f} µs/step (min {min(ts) / max(done[r], 1) * 1e6:.3f})")
    # the cost of a step without the call's fixed costs: the slope between n and 2n steps
    for name in variants:
        t1, t2 = (statistics.median(times[(name, 0.0, m)]) for m in (converged, 2 * converged))
        print(f"  {name:16s} slope between {converged} and {2 * converged} steps: "
              f"{(t2 - t1) / converged * 1e6:6.3f} µs/step, fixed {(2 * t1 - t2) * 1e3:6.3f} ms/call")
