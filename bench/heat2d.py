"""2D heat (5-point stencil, fixed boundary, float32) on an N x N field: the float64 reference,
the loopkern kernel and its variants: JAX loops and the hand-written CUDA C++ cooperative
kernel (heat2d_coop.cu)."""

from __future__ import annotations

import numpy as np

from .harness import Bench, Case, have, rel_err
from .heat import emit_cpp_row
from .variants import jax_loop_variants, loopkern_jax_variant, loopkern_variants

ALPHA2 = np.float32(0.2)


def heat2d_ref(u0, steps):
    """The 5-point heat stencil with a fixed boundary in float64, step by step."""
    u = u0.astype(np.float64)
    v = u.copy()
    for _ in range(steps):
        c = u[1:-1, 1:-1]
        v[1:-1, 1:-1] = c + float(ALPHA2) * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4.0 * c)
        u, v = v, u
    return u


def heat2d_kernel():
    import loopkern as lk

    @lk.megakernel(swap=[("u", "v")])
    def heat2d(t, u, v, alpha):
        n = u.shape[0]
        m = u.shape[1]
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            v[i, j] = u[i, j] + alpha * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1] - 4.0 * u[i, j])
    return heat2d


def jax_heat2d_step(u):
    c = u[1:-1, 1:-1]
    new = c + ALPHA2 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4.0 * c)
    return u.at[1:-1, 1:-1].set(new)


def bench_heat2d(b: Bench):
    args, gpu = b.args, b.gpu
    sides = [64] if args.quick else [512, 1024, 2048]
    rng = np.random.default_rng(3)
    for side in sides:
        u0 = rng.random((side, side)).astype(np.float32)
        n = side * side
        steps = 200 if args.quick else 5000 if side <= 512 else 2000 if side <= 1024 else 1000
        check_steps = 100
        ref = heat2d_ref(u0, check_steps)

        def check(res, done, ref=ref, check_steps=check_steps):
            e = rel_err(res, ref)
            return e < 1e-4 and done == check_steps, f"rel_err={e:.2e} after {done} steps"
        # both buffers start as u0: the boundary, never written, stays u0 in both
        case = Case("heat2d", n, steps, check_steps, check, dict(u0=u0, side=side), bytes_per_step=8 * n)
        # tile mode: while both float32 buffers fit in the SMs' shared memory (not at 2048²); in
        # one cluster while they fit in 16 SMs' (512²)
        scopes = (["auto", "grid", "tile"] + (["cluster"] if side <= 512 else [])) \
            if gpu else ["auto"]
        variants = loopkern_variants(gpu, heat2d_kernel, lambda c: dict(u=c.data["u0"], v=c.data["u0"]),
                                     lambda c: (ALPHA2,), ["u", "v"], scopes)
        if have("jax") and not args.no_jax:
            if not args.jax_only:
                variants.append(loopkern_jax_variant(heat2d_kernel, lambda c: [c.data["u0"], c.data["u0"]],
                                                     lambda c: (ALPHA2,)))
            variants += jax_loop_variants(jax_heat2d_step)
        if args.jax_only:
            variants = [v for v in variants if v[0].startswith("jax")]
        b.measure(case, variants)
        if gpu and not args.jax_only:
            emit_cpp_row(b, case, "heat2d_coop.cu")
