"""The timing helper of the probe scripts that time JAX calls (bench/grad_probe.py,
bench/gather_probe.py, bench/alpha_probe.py)."""

import time

import numpy as np


def timed(f, *a, reps=5):
    """Median seconds of ``reps`` calls of ``f(*a)`` (JAX: each waited for), after one call
    that compiles."""
    import jax
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))
