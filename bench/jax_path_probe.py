"""Why a Jacobi step costs more through JAX: µs per step of the hand-written Jacobi step called
directly (Numba device arrays), through kernel.jax inside jax.jit (default grid, and the direct
call's blocks and threads), and of the jnp body through lk.while_loop, with each one's launch
configuration; interleaved rounds, medians of host wall time per blocking call. Each runs to
the tolerance (as bench.py does) and, with a tolerance of 0, for the same number of steps
(stopping at the step count instead of by the condition), and for twice that many: the slope
between the two is the cost of a step without the fixed cost of a call. The direct call's
arrays are reset before each call (outside the timing).

    python bench/jax_path_probe.py [rounds]
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
from bench.jacobi import JACOBI_TOL, jacobi_kernel, jacobi_problem  # noqa: E402
from bench.jaxloops import jacobi_body  # noqa: E402
from loopkern.interop.jax_bridge import call_cache  # noqa: E402
from loopkern.jaxloops import loops  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7


def configs(mk):
    return [(c.config.scope, c.config.blocks, c.config.threads) for c in call_cache(mk).values() if c.config]


TOL = float(JACOBI_TOL)
for side in (64, 256):
    u0 = jacobi_problem(side, np.random.default_rng(0))
    k = jacobi_kernel()
    du, dv = cuda.to_device(u0), cuda.to_device(u0)
    info = {}

    def direct(tol, n):
        du.copy_to_device(u0)
        dv.copy_to_device(u0)
        cuda.synchronize()
        t = time.perf_counter()
        r = k(du, dv, tol, max_steps=n)
        cuda.synchronize()
        dt = time.perf_counter() - t
        info.update(scope=r.scope, blocks=r.blocks, threads=r.threads)
        return dt, r.steps
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
        "kernel.jax": timed(lambda tol, n: jax.jit(lambda: kj.jax(ju, jv, tol, max_steps=n)), "kj"),
        "lk.while_loop": timed(lambda tol, n: jax.jit(lambda: lk.while_loop(
            lambda c: (c[1] > tol) & (c[2] < n), jacobi_body, (ju, jnp.float32(jnp.inf), jnp.int32(0)),
            fallback="error")), "while"),
    }
    # to the tolerance (max 20000 steps), and the same number of steps with a tolerance of 0
    runs = [(name, tol, n) for name in variants for tol, n in ((TOL, 20000), (0.0, converged), (0.0, 2 * converged))]
    for name, tol, n in runs:
        variants[name](tol, n)
    times = {r: [] for r in runs}
    done = {}
    for _ in range(rounds):
        for r in runs:
            dt, done[r] = variants[r[0]](r[1], r[2])
            times[r].append(dt)
    wmk = list(loops._kernels.values())[-1]
    print(f"jacobi {side}x{side}: direct {info}, converges in {converged} steps")
    print(f"  kernel.jax configs: {configs(kj)}; lk.while_loop's: {configs(wmk)}")
    for r, ts in times.items():
        med = statistics.median(ts)
        print(f"  {r[0]:14s} tol={r[1]:g} max_steps={r[2]:5d}: {done[r]:5d} steps, {med * 1e3:7.3f} ms/call, "
              f"{med / max(done[r], 1) * 1e6:6.3f} µs/step (min {min(ts) / max(done[r], 1) * 1e6:.3f})")
    # the cost of a step without the call's fixed costs: the slope between n and 2n steps
    for name in variants:
        t1, t2 = (statistics.median(times[(name, 0.0, m)]) for m in (converged, 2 * converged))
        print(f"  {name:14s} slope between {converged} and {2 * converged} steps: "
              f"{(t2 - t1) / converged * 1e6:6.3f} µs/step, fixed {(2 * t1 - t2) * 1e3:6.3f} ms/call")
