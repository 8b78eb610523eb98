"""Game of Life (int32, periodic)."""

from __future__ import annotations

import numpy as np

from .harness import Bench, Case, Impl, have
from .variants import jax_impl, loopkern_variants


def life_ref(a0, steps):
    a = a0.copy()
    for _ in range(steps):
        s = sum(np.roll(np.roll(a, di, 0), dj, 1) for di in (-1, 0, 1) for dj in (-1, 0, 1) if di or dj)
        a = ((s == 3) | ((a == 1) & (s == 2))).astype(a.dtype)
    return a


def life_kernel():
    import loopkern as lk

    @lk.megakernel(swap=[("a", "b")])
    def life(t, a, b):
        n = a.shape[0]
        m = a.shape[1]
        for i, j in lk.grid(n, m):
            up = i - 1 if i > 0 else n - 1      # periodic neighbours
            dn = i + 1 if i < n - 1 else 0
            lf = j - 1 if j > 0 else m - 1
            rt = j + 1 if j < m - 1 else 0
            s = (a[up, lf] + a[up, j] + a[up, rt] + a[i, lf] + a[i, rt] + a[dn, lf] + a[dn, j] + a[dn, rt])
            b[i, j] = 1 if (s == 3 or (s == 2 and a[i, j] == 1)) else 0
    return life


def jax_life_step(a):
    import jax.numpy as jnp
    s = sum(jnp.roll(jnp.roll(a, di, 0), dj, 1) for di in (-1, 0, 1) for dj in (-1, 0, 1) if di or dj)
    return ((s == 3) | ((a == 1) & (s == 2))).astype(a.dtype)


def numba_life_per_step(a0):
    from numba import cuda

    @cuda.jit
    def step(a, b):
        i, j = cuda.grid(2)
        n, m = a.shape
        if i < n and j < m:
            s = 0
            for di in range(-1, 2):
                for dj in range(-1, 2):
                    if di != 0 or dj != 0:
                        s += a[(i + di + n) % n, (j + dj + m) % m]
            b[i, j] = 1 if (s == 3 or (s == 2 and a[i, j] == 1)) else 0

    da, db = cuda.to_device(a0), cuda.to_device(a0)
    n, m = a0.shape
    bpg = ((n + 15) // 16, (m + 15) // 16)
    box = {}

    def run(steps):
        x, y = da, db
        for _ in range(steps):
            step[bpg, (16, 16)](x, y)
            x, y = y, x
        box["r"] = x

    def reset():
        da.copy_to_device(a0)
    return Impl(run, lambda: box["r"].copy_to_host(), reset)


def bench_life(b: Bench):
    args, gpu = b.args, b.gpu
    n = 128 if args.quick else 1024
    a0 = (np.random.default_rng(2).random((n, n)) < 0.3).astype(np.int32)
    ref = life_ref(a0, 20)

    def check(res, done):
        bad = int((res != ref).sum())
        return bad == 0, f"{bad} cells differ"
    case = Case("life", n * n, 50 if args.quick else 2000, 20, check, dict(a0=a0))
    variants = loopkern_variants(gpu, life_kernel, lambda c: dict(a=c.data["a0"], b=c.data["a0"]), lambda c: (),
                                 ["a", "b"], ["auto", "tile"] if gpu else ["auto"])
    if have("jax") and not args.no_jax:
        import jax
        variants.append(("jax.lax.fori_loop", lambda c: jax_impl(
            lambda a, steps: jax.lax.fori_loop(0, steps, lambda i, x: jax_life_step(x), a), [c.data["a0"]])))
    if gpu and not args.jax_only:
        variants.append(("numba launch per step", lambda c: numba_life_per_step(c.data["a0"])))
    b.measure(case, variants)

