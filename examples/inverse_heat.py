"""An inverse problem: recover the initial temperature from the field after many steps, by
gradient descent with jax.grad through a megakernel, inside jax.jit.

    python examples/inverse_heat.py                       # n=256, 100 steps, 60 iterations

Other sizes take --n, --steps and --iters; gradient descent with a fixed step (--lr, 0.5) can
overshoot on longer runs (n=4096 with 2000 steps diverges at 0.5, as the same loop written with
jax.lax.fori_loop does), so pass a smaller --lr there.

The forward model is a heat megakernel called with ``kernel.jax``; ``jax.grad`` of the misfit
runs its adjoint step backwards over the steps (with checkpoints every sqrt(steps) steps), so
each iteration costs a few forward runs. Diffusion erases fine detail, so the truth here is
smooth; the recovered field is checked against it, and the misfit against its start.
"""

import argparse
import sys
import time

import numpy as np

import loopkern as lk


@lk.megakernel(swap=[("u", "v")])
def heat(t, u, v, alpha):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.5, help="gradient descent's step (1.0 overshoots at the default size)")
    args = p.parse_args(argv)
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("inverse_heat: needs JAX (pip install -e '.[jax]')")
        return 1

    x = np.linspace(0.0, 1.0, args.n, dtype=np.float32)
    truth = (np.exp(-((x - 0.35) / 0.12) ** 2) + 0.6 * np.exp(-((x - 0.7) / 0.08) ** 2)).astype(np.float32)
    truth[0] = truth[-1] = 0.0
    alpha = np.float32(0.24)

    def forward(u0):
        return heat.jax(u0, u0, alpha, steps=args.steps)[0]

    observed = forward(jnp.asarray(truth))

    def misfit(u0):
        return 0.5 * jnp.sum((forward(u0) - observed) ** 2)

    step = jax.jit(jax.value_and_grad(misfit))
    u = jnp.zeros(args.n, jnp.float32)
    lr = args.lr
    t0 = time.perf_counter()
    first = None
    for _ in range(args.iters):
        f, g = step(u)
        first = float(f) if first is None else first
        u = u - lr * g
    f = float(misfit(u))
    elapsed = time.perf_counter() - t0
    err = float(np.linalg.norm(np.asarray(u) - truth) / np.linalg.norm(truth))
    print(f"inverse_heat: n={args.n} steps={args.steps} iterations={args.iters} ({elapsed:.2f} s, "
          f"JAX on {jax.devices()[0].platform})")
    print(f"  misfit {first:.3e} -> {f:.3e}; recovered initial field vs truth: relative error {err:.3f}")
    ok = f < 1e-3 * first and err < 0.25
    print("  OK" if ok else "  NOT RECOVERED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
