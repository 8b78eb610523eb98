"""Drop-in JAX loops: lk.fori_loop, lk.while_loop and lk.scan compile an ordinary JAX loop body into
one megakernel. Each loop below is written the way JAX code is written, run with loopkern and
with jax.lax, and checked against it; the script exits with status 1 on any mismatch.

    python examples/jax_loops.py            # JAX's default backend (a GPU if JAX has one)
"""

import sys
import time
import warnings

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

import loopkern as lk

jax.config.update("jax_enable_x64", True)      # the quadratic map runs in float64, as in QuantEcon
failures = []


def check(name, got, ref, rtol=0.0, atol=0.0):
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        g, r = np.asarray(g), np.asarray(r)
        ok = g.shape == r.shape and g.dtype == r.dtype and np.allclose(g, r, rtol=rtol, atol=atol)
        if not ok:
            failures.append(name)
            print(f"  MISMATCH in {name}: max |diff| = {np.abs(g.astype(np.float64) - r).max():.3g}")
            return
    print(f"  {name}: matches jax.lax" + (" bit for bit" if rtol == atol == 0.0 else f" (rtol={rtol:g})"))


def timed(fn, *args):
    out = jax.block_until_ready(fn(*args))          # compile (and trace) first
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


rng = np.random.default_rng(0)
print(f"JAX backend: {jax.default_backend()}")

# 1. 1-D heat with fixed ends: fori_loop, inside jax.jit, a traced step count
ALPHA = np.float32(0.25)


def heat(i, u):
    return u.at[1:-1].set(u[1:-1] + ALPHA * (u[:-2] - 2 * u[1:-1] + u[2:]))


u0 = jnp.asarray(rng.random(4096).astype(np.float32))
mine = jax.jit(lambda u, n: lk.fori_loop(0, n, heat, u, fallback="error"))
theirs = jax.jit(lambda u, n: lax.fori_loop(0, n, heat, u))
got, t_lk = timed(mine, u0, 2000)
ref, t_lax = timed(theirs, u0, 2000)
check("heat 1-D, 2000 steps (fori_loop)", got, ref)
print(f"    {t_lk * 1e6 / 2000:.2f} µs/step with loopkern, {t_lax * 1e6 / 2000:.2f} µs/step with jax.lax")

# 2. Jacobi iteration to a tolerance: while_loop with a reduction in the condition
TOL = np.float32(1e-4)


def jacobi_body(c):
    x, _, k = c
    new = x.at[1:-1, 1:-1].set(0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
    return new, jnp.max(jnp.abs(new - x)), k + 1


def jacobi_cond(c):
    return (c[1] > TOL) & (c[2] < 100_000)


g0 = np.zeros((64, 64), np.float32)
g0[0, :] = 1.0
init = (jnp.asarray(g0), jnp.float32(jnp.inf), 0)
got = jax.jit(lambda c: lk.while_loop(jacobi_cond, jacobi_body, c, fallback="error"))(init)
ref = jax.jit(lambda c: lax.while_loop(jacobi_cond, jacobi_body, c))(init)
check(f"Jacobi 64x64 to {TOL:g} (while_loop, {int(got[2])} steps)", got, ref)

# 3. QuantEcon's quadratic map, its trajectory recorded by scan
def qmap(x, _):
    y = 4.0 * x * (1.0 - x)
    return y, y


x0 = jnp.float64(0.1)
(xn, traj), t_lk = timed(jax.jit(lambda x: lk.scan(qmap, x, None, length=100_000, fallback="error")), x0)
ref, t_lax = timed(jax.jit(lambda x: lax.scan(qmap, x, None, length=100_000)), x0)
check("quadratic map, 100000 steps (scan)", (xn, traj), ref)
print(f"    {t_lk * 1e3:.1f} ms with loopkern, {t_lax * 1e3:.1f} ms with jax.lax")

# 4. value iteration with a 25x25 transition matrix per action (a small matvec per step)
S, A = 25, 4
P = rng.random((S, A, S))
P /= P.sum(-1, keepdims=True)
R = rng.random((S, A))
P, R = jnp.asarray(P), jnp.asarray(R)


def bellman(c):
    v, _ = c
    v_new = jnp.max(R + 0.95 * P @ v, axis=1)
    return v_new, jnp.max(jnp.abs(v_new - v))


init = (jnp.zeros(S), jnp.float64(1.0))
got = lk.while_loop(lambda c: c[1] > 1e-10, bellman, init, fallback="error")
ref = lax.while_loop(lambda c: c[1] > 1e-10, bellman, init)
check("value iteration (while_loop, matvec)", got, ref, rtol=1e-12, atol=1e-12)

# 5. backward Euler for 1-D heat, each step solved by conjugate gradients to a tolerance: a
#    while_loop inside the fori_loop body, run in phases inside the one kernel
A_IMPL = np.float32(0.3)


def apply(v):                                      # (I - a * Laplacian), zero ends
    nb = jnp.pad(v, 1)
    return (1 + 2 * A_IMPL) * v - A_IMPL * (nb[:-2] + nb[2:])


def implicit_step(i, u):
    def cg(c):
        x, r, p, rs, k = c
        ap = apply(p)
        alpha = rs / jnp.dot(p, ap)
        x, r = x + alpha * p, r - alpha * ap
        rs_new = jnp.dot(r, r)
        return x, r, r + (rs_new / rs) * p, rs_new, k + 1
    r0 = u - apply(u)
    return lax.while_loop(lambda c: (c[3] > 1e-10) & (c[4] < 100), cg, (u, r0, r0, jnp.dot(r0, r0), 0))[0]


h0 = jnp.asarray(rng.random(2048).astype(np.float32))
got = jax.jit(lambda u: lk.fori_loop(0, 20, implicit_step, u, fallback="error"))(h0)
ref = jax.jit(lambda u: lax.fori_loop(0, 20, implicit_step, u))(h0)
check("implicit heat, CG per step (a while_loop inside the body)", got, ref, rtol=1e-4, atol=1e-5)

# 6. a sparse matrix in COO form: jax.ops.segment_sum (atomic adds into a buffer, a barrier)
NNZ = 8192
rows = jnp.asarray(rng.integers(0, 2048, NNZ).astype(np.int32))
cols = jnp.asarray(rng.integers(0, 2048, NNZ).astype(np.int32))
vals = jnp.asarray(rng.uniform(-0.1, 0.1, NNZ).astype(np.float32))


def sparse_step(i, x):
    return 0.5 * x + jax.ops.segment_sum(vals * x[cols], rows, num_segments=2048)


got = jax.jit(lambda x: lk.fori_loop(0, 50, sparse_step, x, fallback="error"))(h0)
ref = jax.jit(lambda x: lax.fori_loop(0, 50, sparse_step, x))(h0)
check("COO matrix-vector iteration (segment_sum)", got, ref, rtol=1e-4, atol=1e-6)

# 7. a wider stencil on a torus, written with jnp.roll: fourth-order diffusion reads the
#    neighbours one and two cells away along both axes (a periodic stencil of halo two)
def diffuse4(i, u):
    def lap4(axis):
        return (-(jnp.roll(u, 2, axis) + jnp.roll(u, -2, axis)) + 16 * (jnp.roll(u, 1, axis) + jnp.roll(u, -1, axis))
                - 30 * u) / 12
    return u + np.float32(0.05) * (lap4(0) + lap4(1))


t0 = jnp.asarray(rng.random((128, 96)).astype(np.float32))
got = jax.jit(lambda u: lk.fori_loop(0, 100, diffuse4, u, fallback="error"))(t0)
ref = jax.jit(lambda u: lax.fori_loop(0, 100, diffuse4, u))(t0)
check("4th-order diffusion on a torus (jnp.roll by 1 and 2)", got, ref, rtol=1e-5)

# 8. outside the subset (eigenvalues, eigh): the lax loop runs, with one warning naming the
#    line
def factorising(i, x):
    return (jnp.linalg.eigh(jnp.outer(x, x) + jnp.eye(64))[0] * 0.5).astype(x.dtype)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = lk.fori_loop(0, 3, factorising, u0[:64])
ref = lax.fori_loop(0, 3, factorising, u0[:64])
check("a body with jnp.linalg.eigh (falls back to jax.lax)", got, ref)
if not any("'eigh'" in str(w.message) for w in caught):
    failures.append("fallback warning")
    print("  MISMATCH: no fallback warning")
else:
    print(f"    warning: {caught[0].message}")

if failures:
    print(f"FAILED: {', '.join(failures)}")
    sys.exit(1)
print("all loops match jax.lax")
