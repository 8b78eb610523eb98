"""Does kernel.jax's Jacobi 2048² lose to the direct call (22.5 against 16.2 µs/step on an H100,
session 39) because of its block count? Its kernel fits 3 blocks per SM where the direct call's
fits 2, and auto_blocks takes every co-resident block at this size. Times the hand-written
Jacobi step for a fixed number of steps (tolerance -1) through kernel.jax inside jax.jit at the
automatic block count and at fixed ones, and called directly, in interleaved rounds; medians of
host wall time per blocking call, and whether every variant ends bit for bit where the direct
call does.

    python bench/jax_blocks_probe.py [side] [steps] [rounds] [blocks, comma-separated]
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

from bench.jacobi import jacobi_kernel, jacobi_problem, timed_direct_call  # noqa: E402
from loopkern.interop.jax_bridge import call_cache  # noqa: E402

side = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 600
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
block_counts = [int(b) for b in sys.argv[4].split(",")] if len(sys.argv) > 4 else [132, 264, 396]
tol = np.float32(-1.0)
u0 = jacobi_problem(side, np.random.default_rng(0))

k = jacobi_kernel()
du, dv = cuda.to_device(u0), cuda.to_device(u0)


def direct_on(u, v):
    """The direct call on the device arrays ``u`` and ``v``, reset to the problem first."""
    return lambda: timed_direct_call(k, u, v, u0, tol, steps)


def direct_on_jax_buffers():
    # the direct call on memory XLA allocated (Numba views of two JAX arrays' buffers): if this
    # is as slow as kernel.jax, the memory is the cause; if as fast as direct, the launch path
    ju, jv = jnp.asarray(u0), jnp.asarray(u0)
    if not hasattr(ju, "__cuda_array_interface__"):     # JAX on the CPU (a smoke test)
        return None
    nu = cuda.from_cuda_array_interface(ju.__cuda_array_interface__, owner=ju)
    nv = cuda.from_cuda_array_interface(jv.__cuda_array_interface__, owner=jv)
    print(f"JAX buffers at {ju.__cuda_array_interface__['data'][0]:#x}, {jv.__cuda_array_interface__['data'][0]:#x}; "
          f"Numba's at {du.__cuda_array_interface__['data'][0]:#x}, {dv.__cuda_array_interface__['data'][0]:#x}")
    return direct_on(nu, nv)


def through_jax(blocks):
    kj = jacobi_kernel()
    f = jax.jit(lambda u, v: kj.jax(u, v, tol, max_steps=steps, blocks=blocks))
    ju, jv = jnp.asarray(u0), jnp.asarray(u0)

    def run():
        t = time.perf_counter()
        r = jax.block_until_ready(f(ju, jv))
        dt = time.perf_counter() - t
        cfg = [(c.config.scope, c.config.blocks, c.config.threads) for c in call_cache(kj).values() if c.config]
        return dt, np.asarray(r[0]), cfg
    return run


variants = {"direct": direct_on(du, dv), "direct on JAX's buffers": direct_on_jax_buffers(),
            "kernel.jax auto": through_jax(None)}
variants = {name: run for name, run in variants.items() if run is not None}
for b in block_counts:
    variants[f"kernel.jax blocks={b}"] = through_jax(b)
times = {name: [] for name in variants}
out, cfg = {}, {}
for name, run in list(variants.items()):
    try:
        run()
    except Exception as exc:                          # a block count that does not fit
        print(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")
        del variants[name], times[name]
for _ in range(rounds):
    for name, run in variants.items():
        dt, out[name], cfg[name] = run()
        times[name].append(dt)
for name, ts in times.items():
    same = "bitwise equal to direct" if np.array_equal(out[name], out["direct"]) else "DIFFERS from direct"
    print(f"jacobi {side}^2, {steps} steps, {name:24s} {cfg[name]}: {statistics.median(ts) / steps * 1e6:7.3f} "
          f"µs/step (min {min(ts) / steps * 1e6:.3f}), {same}")
