"""All-pairs N-body: two phases per step, with a grid barrier between them."""

from __future__ import annotations

import numpy as np

from .harness import Bench, Case, have, rel_err
from .variants import jax_impl, loopkern_impl, loopkern_variants


def nbody_ref(pos, vel, steps, dt, eps2):
    p, v = pos.astype(np.float64).copy(), vel.astype(np.float64).copy()
    for _ in range(steps):
        d = p[None, :, :] - p[:, None, :]
        r2 = (d ** 2).sum(-1) + eps2
        acc = (d / (r2 * np.sqrt(r2))[..., None]).sum(1)
        v += dt * acc
        p += dt * v
    return p


def nbody_kernel():
    import math

    import loopkern as lk

    @lk.megakernel
    def nbody(t, pos, vel, acc, dt, eps2):
        n = pos.shape[0]
        for i in lk.range(n):                 # phase 1: accelerations from the current positions
            xi = pos[i, 0]
            yi = pos[i, 1]
            zi = pos[i, 2]
            ax = np.float32(0.0)
            ay = np.float32(0.0)
            az = np.float32(0.0)
            for j in range(n):
                dx = pos[j, 0] - xi
                dy = pos[j, 1] - yi
                dz = pos[j, 2] - zi
                r2 = dx * dx + dy * dy + dz * dz + eps2
                inv = np.float32(1.0) / (r2 * math.sqrt(r2))
                ax += dx * inv
                ay += dy * inv
                az += dz * inv
            acc[i, 0] = ax
            acc[i, 1] = ay
            acc[i, 2] = az
        lk.sync()                             # every acceleration before any position moves
        for i in lk.range(n):                 # phase 2: kick and drift
            for c in range(3):
                vel[i, c] += dt * acc[i, c]
                pos[i, c] += dt * vel[i, c]
    return nbody


def jax_nbody(pos, vel, dt, eps2):
    import jax
    import jax.numpy as jnp

    def fn(p, v, steps):
        def body(i, s):
            p, v = s
            d = p[None, :, :] - p[:, None, :]
            r2 = (d ** 2).sum(-1) + eps2
            acc = (d / (r2 * jnp.sqrt(r2))[..., None]).sum(1)
            v = v + dt * acc
            return p + dt * v, v
        return jax.lax.fori_loop(0, steps, body, (p, v))
    return jax_impl(fn, [pos, vel], result_index=0)


def bench_nbody(b: Bench):
    args, gpu = b.args, b.gpu
    n = 256 if args.quick else 1024
    rng = np.random.default_rng(3)
    pos = rng.standard_normal((n, 3)).astype(np.float32)
    vel = (0.1 * rng.standard_normal((n, 3))).astype(np.float32)
    dt, eps2 = np.float32(1e-3), np.float32(1e-2)
    ref = nbody_ref(pos, vel, 10, float(dt), float(eps2))

    def check(res, done):
        e = rel_err(res, ref)
        return e < 1e-4, f"rel_err={e:.2e}"
    case = Case("nbody", n, 20 if args.quick else 500, 10, check, dict(pos=pos, vel=vel))
    arrays = lambda c: dict(pos=pos, vel=vel, acc=np.zeros_like(pos))  # noqa: E731
    variants = loopkern_variants(gpu, nbody_kernel, arrays, lambda c: (dt, eps2), ["pos", "vel", "acc"],
                                 ["auto"], sweep_blocks=[16] if gpu else ())
    if gpu:
        # the warp-split loop gives each body a group of 1-8 warps, as many as the grid has
        # lanes for: auto (264x256) gives groups of 2, 132x256 groups of 1. Groups of 4 or 8
        # warps need more co-resident threads than the step's 92 registers per thread allow on
        # an H200 (528x256, 264x512 and 132x1024 were refused with a LaunchError, session 9)
        for blocks, threads in ((132, 256),):
            variants.append((f"loopkern[grid,blocks={blocks},threads={threads}]",
                             lambda c, b_=blocks, t_=threads: loopkern_impl(gpu, nbody_kernel(), arrays(c),
                                                                            (dt, eps2), ["pos", "vel", "acc"],
                                                                            scope="grid", blocks=b_, threads=t_)))
    if have("jax") and not args.no_jax:
        variants.append(("jax.lax.fori_loop", lambda c: jax_nbody(pos, vel, dt, eps2)))
    b.measure(case, variants)

