"""Host µs per blocking kernel.jax call inside jax.jit (one 4K heat step, state donated), next to
jax.jit(lambda x: x + 1.0) donated, in interleaved rounds (the host's speed drifts between
bench runs by more than the differences looked for): block scope with the arrays staged in
shared memory (what scope="auto" picks at 4K), block scope without staging, and grid scope.

    python bench/jax_call_probe.py [rounds] [calls per round]
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from bench.heat import ALPHA, heat_kernel  # noqa: E402
from loopkern.interop import jax_bridge  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
calls = int(sys.argv[2]) if len(sys.argv) > 2 else 300
u0 = np.random.default_rng(0).random(4096).astype(np.float32)


def kernel_jax(scope, staged=True):
    k = heat_kernel()
    f = jax.jit(lambda u, v: k.jax(u, v, ALPHA, steps=1, scope=scope), donate_argnums=(0, 1))
    state = [jnp.asarray(u0), jnp.asarray(u0)]
    if not staged:              # the build reads config.plan_staging when it runs
        from loopkern.dispatch import config
        keep = config.plan_staging
        config.plan_staging = lambda *a, **kw: ((), 0)
    try:
        state[:] = f(*state)
        jax.block_until_ready(state)
    finally:
        if not staged:
            config.plan_staging = keep
    shared = [e.config.shared for e in jax_bridge.call_cache(k).values() if e.config is not None]

    def call():
        state[:] = f(*state)
        jax.block_until_ready(state[0])
    return call, shared


def one_op():
    f = jax.jit(lambda x: x + 1.0, donate_argnums=(0,))
    state = [jnp.asarray(u0)]

    def call():
        state[0] = f(state[0])
        jax.block_until_ready(state[0])
    return call, None


variants = {"jax.jit(x + 1), donated": one_op(), "kernel.jax block, staged": kernel_jax("block"),
            "kernel.jax block, not staged": kernel_jax("block", staged=False), "kernel.jax grid": kernel_jax("grid")}
times = {name: [] for name in variants}
for r in range(rounds):
    for name, (call, _) in variants.items():
        for _ in range(20):
            call()
        for _ in range(calls):
            t0 = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t0) * 1e6)
for name, (call, shared) in variants.items():
    xs = times[name]
    print(f"{name:32s} median {statistics.median(xs):7.2f} us  p10 {np.percentile(xs, 10):7.2f}  "
          f"p90 {np.percentile(xs, 90):7.2f}  shared={shared}")
