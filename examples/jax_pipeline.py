"""A jitted JAX pipeline with a megakernel in the middle, against the same pipeline written
with jax.lax.fori_loop.

    python examples/jax_pipeline.py [--n 65536] [--steps 5000]

The megakernel runs as one XLA custom call on XLA's own stream (GPU) or through the CPU
kernel (JAX's CPU backend). Both pipelines are checked against each other and against a
float64 NumPy reference; the script prints the time of each and the speedup.
"""

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # share the GPU with Numba

import jax
import jax.numpy as jnp
import numpy as np

import loopkern as lk

ALPHA = np.float32(0.25)


@lk.megakernel(swap=[("u", "v")])
def heat(t, u, v, alpha):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])


def make_pipelines(steps):
    def before(x):
        return jnp.tanh(x) * 0.5 + 0.5                 # work before the loop

    def after(u):
        return u / jnp.max(u), jnp.mean(u)              # work after the loop

    @jax.jit
    def with_megakernel(x):
        u = before(x)
        u, _ = heat.jax(u, u, ALPHA, steps=steps)       # every step in one launch
        return after(u)

    @jax.jit
    def with_fori_loop(x):
        u = before(x)

        def step(_, w):
            return w.at[1:-1].set(w[1:-1] + ALPHA * (w[:-2] - 2 * w[1:-1] + w[2:]))
        u = jax.lax.fori_loop(0, steps, step, u)       # one kernel (or more) per step
        return after(u)

    return with_megakernel, with_fori_loop


def reference(x, steps):
    u = np.tanh(x.astype(np.float64)) * 0.5 + 0.5
    for _ in range(steps):
        w = u.copy()
        w[1:-1] = u[1:-1] + float(ALPHA) * (u[:-2] - 2 * u[1:-1] + u[2:])
        u = w
    return u / u.max(), u.mean()


def median_time(f, x, reps=5):
    jax.block_until_ready(f(x))                         # compile and warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--steps", type=int, default=5000)
    args = p.parse_args()
    x = jnp.asarray(np.random.default_rng(0).standard_normal(args.n).astype(np.float32))
    mk, fori = make_pipelines(args.steps)

    (u1, m1), (u2, _) = mk(x), fori(x)
    ref_u, ref_m = reference(np.asarray(x), min(args.steps, 20000))
    err = float(np.abs(np.asarray(u1) - np.asarray(u2)).max())
    print(f"platform: {jax.default_backend()}  n={args.n} steps={args.steps}")
    print(f"  megakernel vs fori_loop: max |difference| = {err:.2e}")
    if args.steps <= 20000:
        ref_err = float(np.linalg.norm(np.asarray(u1) - ref_u) / np.linalg.norm(ref_u))
        print(f"  megakernel vs float64 NumPy: relative error {ref_err:.2e}, mean {float(m1):.6f} vs {ref_m:.6f}")
        assert ref_err < 1e-4, ref_err
    assert err < 1e-4, err

    t_mk, t_fori = median_time(mk, x), median_time(fori, x)
    print(f"  with the megakernel: {t_mk * 1e3:9.3f} ms  ({t_mk / args.steps * 1e6:.2f} us/step)")
    print(f"  with lax.fori_loop:  {t_fori * 1e3:9.3f} ms  ({t_fori / args.steps * 1e6:.2f} us/step)")
    print(f"OK jax_pipeline: speedup over lax.fori_loop {t_fori / t_mk:.1f}x (above 1: the megakernel is faster)")


if __name__ == "__main__":
    main()
