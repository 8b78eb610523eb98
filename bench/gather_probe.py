"""Scatter (atomics) against gather form for the adjoint of the 1-D heat step, hand-written
as megakernel steps over a swap pair of adjoints (64K float32, 1,000 steps), each checked
against the float64 transpose of the step on the host. Sizes the gather-form adjoint.

    python bench/gather_probe.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import loopkern as lk  # noqa: E402
from bench.jax_timing import timed  # noqa: E402

ALPHA = np.float32(0.25)


@lk.megakernel(swap=[("u_bar", "v_bar")])
def scatter(t, u_bar, v_bar, alpha):
    n = u_bar.shape[0]
    for i in lk.range(1, n - 1):
        g = v_bar[i]
        v_bar[i] = 0.0
        lk.atomic.add(u_bar, i, g)
        lk.atomic.add(u_bar, i - 1, alpha * g)
        lk.atomic.add(u_bar, i, -2.0 * alpha * g)
        lk.atomic.add(u_bar, i + 1, alpha * g)


@lk.megakernel(swap=[("u_bar", "v_bar")])
def gather_sync(t, u_bar, v_bar, alpha):
    n = u_bar.shape[0]
    for j in lk.range(n):
        acc = 0.0
        if j >= 1 and j < n - 1:
            acc += v_bar[j] - 2.0 * alpha * v_bar[j]
        if j + 1 >= 1 and j + 1 < n - 1:
            acc += alpha * v_bar[j + 1]
        if j - 1 >= 1 and j - 1 < n - 1:
            acc += alpha * v_bar[j - 1]
        u_bar[j] += acc
    lk.sync()
    for i in lk.range(1, n - 1):
        v_bar[i] = 0.0


@lk.megakernel(swap=[("u_bar", "v_bar")])
def gather_nozero(t, u_bar, v_bar, alpha):
    # wrong in general (v_bar is not zeroed): the floor of a gather form without a second barrier
    n = u_bar.shape[0]
    for j in lk.range(n):
        acc = 0.0
        if j >= 1 and j < n - 1:
            acc += v_bar[j] - 2.0 * alpha * v_bar[j]
        if j + 1 >= 1 and j + 1 < n - 1:
            acc += alpha * v_bar[j + 1]
        if j - 1 >= 1 and j - 1 < n - 1:
            acc += alpha * v_bar[j - 1]
        u_bar[j] += acc


def reference(ub, vb, steps):
    ub, vb = ub.astype(np.float64), vb.astype(np.float64)
    for _ in range(steps):
        g = vb[1:-1].copy()
        vb[1:-1] = 0.0
        ub[1:-1] += g * (1 - 2 * ALPHA)
        ub[:-2] += ALPHA * g
        ub[2:] += ALPHA * g
        ub, vb = vb, ub
    return ub, vb


n, L = 65536, 1000
rng = np.random.default_rng(0)
ub0, vb0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
ref_u, ref_v = reference(ub0, vb0, 10)
for k in (scatter, gather_sync, gather_nozero):
    out = k.jax(jnp.asarray(ub0), jnp.asarray(vb0), ALPHA, steps=10)
    err = max(np.abs(np.asarray(out[0]) - ref_u).max() / np.abs(ref_u).max(),
              np.abs(np.asarray(out[1]) - ref_v).max() / (np.abs(ref_v).max() + 1e-30))
    f = jax.jit(lambda a, b: k.jax(a, b, ALPHA, steps=L))
    us = timed(f, jnp.asarray(ub0), jnp.asarray(vb0)) * 1e6 / L
    print(f"{k.fn.__name__:14s} {us:.2f} us/step   rel err after 10 steps {err:.1e}")
