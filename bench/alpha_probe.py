"""Where the reverse sweep's time for a scalar parameter's adjoint goes (heat 64K f32, the
segment adjoint step with respect to u and alpha, 1,000 steps): as generated (per-step block
sum and one atomic per block), with each thread's share kept in its own slot of a per-thread
array instead, with each element's share kept per element, and without alpha.

    python bench/alpha_probe.py
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
def block_atomic(t, S, u_bar, v_bar, alpha, alpha_bar, top):
    n = S.shape[1]
    acc = 0.0
    for i in lk.range(1, n - 1):
        g = v_bar[i]
        v_bar[i] = 0.0
        lk.atomic.add(u_bar, i, g)
        acc += (S[top - t, i - 1] - 2.0 * S[top - t, i] + S[top - t, i + 1]) * g
        lk.atomic.add(u_bar, i - 1, alpha * g)
        lk.atomic.add(u_bar, i, -2.0 * alpha * g)
        lk.atomic.add(u_bar, i + 1, alpha * g)
    lk.atomic.add(alpha_bar, 0, acc)


@lk.megakernel(swap=[("u_bar", "v_bar")])
def per_thread(t, S, u_bar, v_bar, alpha, alpha_bar, top):
    n = S.shape[1]
    acc = 0.0
    for i in lk.range(1, n - 1):
        g = v_bar[i]
        v_bar[i] = 0.0
        lk.atomic.add(u_bar, i, g)
        acc += (S[top - t, i - 1] - 2.0 * S[top - t, i] + S[top - t, i + 1]) * g
        lk.atomic.add(u_bar, i - 1, alpha * g)
        lk.atomic.add(u_bar, i, -2.0 * alpha * g)
        lk.atomic.add(u_bar, i + 1, alpha * g)
    alpha_bar[lk.thread_id()] += acc


@lk.megakernel(swap=[("u_bar", "v_bar")])
def per_element(t, S, u_bar, v_bar, alpha, alpha_bar, top):
    n = S.shape[1]
    for i in lk.range(1, n - 1):
        g = v_bar[i]
        v_bar[i] = 0.0
        lk.atomic.add(u_bar, i, g)
        alpha_bar[i] += (S[top - t, i - 1] - 2.0 * S[top - t, i] + S[top - t, i + 1]) * g
        lk.atomic.add(u_bar, i - 1, alpha * g)
        lk.atomic.add(u_bar, i, -2.0 * alpha * g)
        lk.atomic.add(u_bar, i + 1, alpha * g)


@lk.megakernel(swap=[("u_bar", "v_bar")])
def no_alpha(t, S, u_bar, v_bar, alpha, alpha_bar, top):
    n = S.shape[1]
    for i in lk.range(1, n - 1):
        g = v_bar[i]
        v_bar[i] = 0.0
        lk.atomic.add(u_bar, i, g)
        lk.atomic.add(u_bar, i - 1, alpha * g)
        lk.atomic.add(u_bar, i, -2.0 * alpha * g)
        lk.atomic.add(u_bar, i + 1, alpha * g)


n, L = 65536, 1000
rng = np.random.default_rng(0)
S = jnp.asarray(rng.random((L, n)).astype(np.float32))
ub, vb = jnp.asarray(rng.standard_normal(n).astype(np.float32)), jnp.asarray(rng.standard_normal(n).astype(np.float32))
for k, m in ((block_atomic, 1), (per_thread, 132 * 256), (per_element, n), (no_alpha, 1)):
    ab = jnp.zeros((m,), jnp.float32)
    f = jax.jit(lambda S, a, b, ab: k.jax(S, a, b, ALPHA, ab, L - 1, steps=L, threads=256, blocks=132))
    us = timed(f, S, ub, vb, ab) * 1e6 / L
    out = f(S, ub, vb, ab)
    print(f"{k.fn.__name__:14s} {us:.2f} us/step   alpha_bar total {float(jnp.sum(out[-1])):.6g}")
