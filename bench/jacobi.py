"""2D Jacobi to a tolerance: a while loop with a grid reduction."""

from __future__ import annotations

import numpy as np

from .harness import Bench, Case, Impl, have
from .variants import bounds_variant, jax_impl, loopkern_jax_variant, loopkern_variants


JACOBI_TOL = np.float32(1e-5)


def jacobi_problem(n, rng):
    """A Laplace problem that Jacobi iteration solves to JACOBI_TOL in about a thousand steps at
    every size. The boundary values and the exact solution are h = x^2 - y^2, which the
    five-point average maps to itself; the interior starts as h plus four sine modes with random
    amplitudes (up to 0.1) and frequencies from n/40 to n/20, so that each mode loses the same
    fraction per step at every n (random noise would need ~n^2 steps: Jacobi barely damps its
    smoothest and its checkerboard modes)."""
    x = np.arange(n) / (n - 1)
    h = x[:, None] ** 2 - x[None, :] ** 2
    kmin = max(1, n // 40)
    u0 = h.copy()
    for _ in range(4):
        k, m = rng.integers(kmin, 2 * kmin + 1, 2)
        u0 += rng.uniform(-0.1, 0.1) * np.outer(np.sin(np.pi * k * x), np.sin(np.pi * m * x))
    u0[0, :], u0[-1, :], u0[:, 0], u0[:, -1] = h[0, :], h[-1, :], h[:, 0], h[:, -1]
    return u0.astype(np.float32)


def jacobi_ref(u0, tol, max_steps):
    """Float64 Jacobi to tolerance: (state, steps, max update of each step)."""
    u = u0.astype(np.float64)
    v = u.copy()
    new = np.empty((u.shape[0] - 2, u.shape[1] - 2))
    errs = []
    for k in range(max_steps):
        np.add(u[:-2, 1:-1], u[2:, 1:-1], out=new)      # the kernel's order of additions
        new += u[1:-1, :-2]
        new += u[1:-1, 2:]
        new *= 0.25
        v[1:-1, 1:-1] = new
        new -= u[1:-1, 1:-1]
        errs.append(float(np.abs(new, out=new).max()))
        u, v = v, u
        if not errs[-1] > tol:
            break
    return u, len(errs), errs


def jacobi_kernel():
    import loopkern as lk

    @lk.megakernel(swap=[("u", "v")])
    def jacobi(t, u, v, tol):
        n = u.shape[0]
        m = u.shape[1]
        err = np.float32(0.0)
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            new = np.float32(0.25) * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
            v[i, j] = new
            err = max(err, abs(new - u[i, j]))
        return lk.max(err) > tol
    return jacobi


def timed_direct_call(k, u, v, u0, tol, steps):
    """One blocking direct call of the Jacobi kernel ``k`` for ``steps`` steps on the device
    arrays ``u`` and ``v``, both reset to ``u0`` first (the probes' timing): (host wall seconds
    of the call alone, ``u`` after it, (scope, blocks, threads))."""
    import time

    from numba import cuda
    u.copy_to_device(u0)
    v.copy_to_device(u0)
    cuda.synchronize()
    t = time.perf_counter()
    r = k(u, v, tol, max_steps=steps)
    dt = time.perf_counter() - t
    return dt, u.copy_to_host(), (r.scope, r.blocks, r.threads)


def jax_jacobi_while(u0, tol):
    import jax
    import jax.numpy as jnp

    def fn(u, steps):
        def body(c):
            x, _, k = c
            new = x.at[1:-1, 1:-1].set(0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
            return new, jnp.max(jnp.abs(new - x)), k + 1
        return jax.lax.while_loop(lambda c: (c[1] > tol) & (c[2] < steps), body,
                                  (u, jnp.float32(jnp.inf), jnp.int32(0)))
    return jax_impl(fn, [u0], result_index=0, steps_index=2)


def numba_jacobi_per_step(u0, tol):
    """The naive GPU loop: a step kernel, a reduction, and the error read on the host."""
    from numba import cuda

    @cuda.jit
    def step(u, v, err):
        i, j = cuda.grid(2)
        n, m = u.shape
        if 0 < i < n - 1 and 0 < j < m - 1:
            new = np.float32(0.25) * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
            v[i, j] = new
            cuda.atomic.max(err, 0, abs(new - u[i, j]))

    du, dv = cuda.to_device(u0), cuda.to_device(u0)
    err = cuda.device_array(1, np.float32)
    n, m = u0.shape
    tpb = (16, 16)
    bpg = ((n + 15) // 16, (m + 15) // 16)
    box = {}
    zero = np.zeros(1, np.float32)

    def run(steps):
        a, b, k = du, dv, 0
        while k < steps:
            err.copy_to_device(zero)
            step[bpg, tpb](a, b, err)
            a, b, k = b, a, k + 1
            if not err.copy_to_host()[0] > tol:
                break
        box["r"] = a
        return k

    def reset():
        du.copy_to_device(u0)
        dv.copy_to_device(u0)
    return Impl(run, lambda: box["r"].copy_to_host(), reset, sync=cuda.synchronize)


def bench_jacobi(b: Bench):
    args, gpu = b.args, b.gpu
    sizes = [64] if args.quick else [256, 2048]
    tol = JACOBI_TOL
    rng = np.random.default_rng(1)
    for n in sizes:
        u0 = jacobi_problem(n, rng)
        max_steps = 20000
        ref, ref_steps, errs = jacobi_ref(u0, float(tol), max_steps)
        if ref_steps >= max_steps:
            raise RuntimeError(f"jacobi2d n={n}: the float64 reference did not converge in {max_steps} steps")
        # float32 rounding (a few units of 2**-24 in each update) moves the step where the update
        # falls below tol by at most this many steps, at the reference's final decay rate
        rate = errs[-1] / errs[-2]
        slack = int(np.ceil(np.log1p(8 * 2.0 ** -24 * float(np.abs(u0).max()) / float(tol)) / -np.log(rate))) + 1
        print(f"jacobi2d n={n}: float64 reference converges in {ref_steps} steps (float32 variants: "
              f"+-{slack})", flush=True)

        def check(res, done, ref=ref, ref_steps=ref_steps, slack=slack):
            # every step changes the state by at most its update (about tol near the end)
            e = float(np.abs(np.asarray(res, np.float64) - ref).max())
            ok = done < max_steps and abs(done - ref_steps) <= slack and e <= 1e-5 + 1.1 * float(tol) * abs(
                done - ref_steps)
            return ok, (f"converged in {done} steps (float64 reference {ref_steps}, +-{slack}), "
                        f"max |u - ref|={e:.1e}")
        case = Case("jacobi2d", n * n, max_steps, max_steps, check, dict(u0=u0), bytes_per_step=8 * n * n,
                    converged=lambda done: done < max_steps)
        scopes = (["auto", "grid"] + (["block", "tile", "cluster"] if n <= 256 else [])) if gpu else ["auto"]
        variants = loopkern_variants(gpu, jacobi_kernel, lambda c: dict(u=c.data["u0"], v=c.data["u0"]),
                                     lambda c: (tol,), ["u", "v"], scopes)
        if have("jax") and not args.no_jax:
            if not args.jax_only:
                variants.append(loopkern_jax_variant(jacobi_kernel, lambda c: [c.data["u0"], c.data["u0"]],
                                                     lambda c: (tol,)))
                bounded = bounds_variant(*variants[-1])
                if gpu and bounded:
                    variants.append(bounded)
            variants.append(("jax.lax.while_loop", lambda c: jax_jacobi_while(c.data["u0"], tol)))
        if gpu and not args.jax_only:
            variants.append(("numba launch per step (+ host check)", lambda c: numba_jacobi_per_step(c.data["u0"], tol)))
        if args.jax_only:
            variants = [v for v in variants if v[0].startswith("jax")]
        b.measure(case, variants)

