"""Why bench.py's JAX rows of the Jacobi loop vary from call to call (session 26, H100: the
lk.while_loop row's calls alternated between 5.0 and 6.1 ms at 64², kernel.jax's between 4.5
and 6.2 ms at 256², where the direct call's varied by 0.1%): the variants exactly as bench.py
builds them, beside the same calls without reading the step count, with the arrays closed over
instead of passed, and with jax.lax.while_loop left out of the rounds. Host wall time of each
blocking call (the direct call: also CUDA events, as bench.py times it), interleaved rounds,
every sample printed.

    python bench/jax_variance_probe.py [rounds]
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
from bench.jaxloops import jacobi_body, jacobi_loop  # noqa: E402
from bench.harness import Impl, time_call  # noqa: E402
from bench.variants import jax_impl, loopkern_impl, loopkern_jax_variant  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
MAX = 20000


def wall(impl):
    def once():
        impl.reset()
        cuda.synchronize()
        t = time.perf_counter()
        done = impl.run(MAX)
        if impl.sync:
            impl.sync()
        else:
            cuda.synchronize()
        return time.perf_counter() - t, done
    return once


def events(impl):
    return lambda: time_call(impl, MAX, True)       # as bench.py times it


def closed_over(make_call, u0):
    """jit of a function of no arguments (the arrays constants), step count read."""
    u = jnp.asarray(u0)
    f = jax.jit(lambda: make_call(u))
    box = {}

    def run(steps):
        box["r"] = f()
        return int(box["r"][2])
    return lk_impl(run, box)


def lk_impl(run, box):
    return Impl(run, lambda: np.asarray(box["r"][0]), sync=lambda: jax.block_until_ready(box["r"]))


tol = JACOBI_TOL
for side in (64, 256):
    u0 = jacobi_problem(side, np.random.default_rng(0))
    direct = loopkern_impl(True, jacobi_kernel(), dict(u=u0, v=u0), (tol,), ["u", "v"], scope="auto")
    kj = loopkern_jax_variant(jacobi_kernel, lambda c: [u0, u0], lambda c: (tol,))[1](None)
    lkw = jax_impl(jacobi_loop(lk.while_loop, tol), [u0], result_index=0, steps_index=2)
    lkw_nc = jax_impl(jacobi_loop(lk.while_loop, tol), [u0], result_index=0)   # the count not read
    lkw_c = closed_over(lambda u: lk.while_loop(lambda c: (c[1] > tol) & (c[2] < MAX), jacobi_body,
                                                (u, jnp.float32(jnp.inf), jnp.int32(0)), fallback="error"), u0)
    lax = jax_impl(jacobi_loop(jax.lax.while_loop, tol), [u0], result_index=0, steps_index=2)
    variants = [("direct (events)", events(direct)), ("direct (wall)", wall(direct)),
                ("kernel.jax (bench form)", wall(kj)), ("lk.while (bench form)", wall(lkw)),
                ("lk.while, count not read", wall(lkw_nc)), ("lk.while, arrays closed over", wall(lkw_c)),
                ("lax.while (bench form)", wall(lax))]
    for with_lax in (True, False):
        use = [v for v in variants if with_lax or not v[0].startswith("lax")]
        samples = {name: [] for name, _ in use}
        steps = {}
        for rnd in range(rounds + 1):
            for name, once in use:
                t, done = once()
                if rnd:
                    samples[name].append(t)
                    steps[name] = done
        print(f"jacobi {side}x{side}, {'with' if with_lax else 'without'} lax.while in the rounds "
              f"(direct: {direct.info})", flush=True)
        for name, ts in samples.items():
            n = steps["direct (events)"]        # every variant stops at the same step (bench.py checks that)
            print(f"  {name:30s} {n:5d} steps  median {statistics.median(ts) * 1e3:7.3f} ms "
                  f"({statistics.median(ts) / n * 1e6:6.3f} µs/step)  calls: "
                  + " ".join(f"{t * 1e3:.2f}" for t in ts), flush=True)
