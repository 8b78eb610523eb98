"""2-D heat equation split across every device JAX sees: kernel.sharded.

    python examples/sharded_heat2d.py                          # 128 x 128, 400 steps
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/sharded_heat2d.py
    python examples/sharded_heat2d.py --n 16384 --steps 2000 --no-check    # on GPUs

The field is split into blocks over a mesh of the devices (rows, and columns too when the
device count allows a square-ish grid). Each device runs K steps of the same megakernel step
on its block plus a halo, then neighbours exchange halos (lax.ppermute); K comes from a cost
model unless --every is given. The result is checked against the single-device run (bit for
bit) and a float64 NumPy reference.

On JAX's CPU backend keep the blocks small (the default): JAX 0.10 hangs when host callbacks
(kernel.jax's CPU path) and collectives share a loop on blocks of about 40K elements or more
(bench/jax_cpu_callback_hang.py reproduces it without loopkern). GPUs are not affected.
"""

import argparse
import math
import sys
import time

import numpy as np

import loopkern as lk


@lk.megakernel(swap=[("u", "v")])
def heat2d(t, u, v, alpha):
    n, m = u.shape[0], u.shape[1]
    for i, j in lk.grid((1, n - 1), (1, m - 1)):      # interior cells; the edges stay fixed
        v[i, j] = u[i, j] + alpha * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1] - 4.0 * u[i, j])


def reference(u0, alpha, steps):
    u = u0.astype(np.float64)
    v = u.copy()
    for _ in range(steps):
        v[1:-1, 1:-1] = u[1:-1, 1:-1] + alpha * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:]
                                                 - 4.0 * u[1:-1, 1:-1])
        u, v = v, u
    return u


def mesh_shape(count):
    """(rows, columns) of devices: as square as the count allows."""
    rows = int(math.isqrt(count))
    while count % rows:
        rows -= 1
    return count // rows, rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=128, help="grid size n x n (default 128)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=None, help="steps between halo exchanges (default: cost model)")
    p.add_argument("--no-check", action="store_true", help="skip the single-device and NumPy checks")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    shape = mesh_shape(len(devices))
    mesh = jax.make_mesh(shape, ("x", "y"))
    kernel = heat2d.sharded(mesh, P("x", "y"), exchange_every=args.every)

    rng = np.random.default_rng(0)
    u0 = rng.random((args.n, args.n)).astype(np.float32)
    run = jax.jit(lambda u, v: kernel(u, v, 0.2, steps=args.steps))
    u, v = run(jnp.asarray(u0), jnp.asarray(u0))
    u.block_until_ready()
    t0 = time.perf_counter()
    u, v = run(jnp.asarray(u0), jnp.asarray(u0))
    u.block_until_ready()
    secs = time.perf_counter() - t0
    plan = kernel.last_plan
    print(f"sharded_heat2d: {args.n}x{args.n} float32, {args.steps} steps on {len(devices)} "
          f"{devices[0].platform} device(s), mesh {shape[0]}x{shape[1]}, blocks {plan['block']}, "
          f"K={plan['exchange_every']} steps between exchanges, halo {plan['halo']}: "
          f"{secs / args.steps * 1e6:.2f} us/step")
    if args.no_check:
        return 0
    single, _ = heat2d.jax(jnp.asarray(u0), jnp.asarray(u0), 0.2, steps=args.steps)
    same = bool(np.array_equal(np.asarray(u), np.asarray(single)))
    diff = float(np.abs(np.asarray(u) - reference(u0, 0.2, args.steps)).max())
    print(f"  bit for bit equal to the single-device run: {same}; max |sharded - NumPy float64| = {diff:.2e}")
    if not same or diff > 1e-4:
        print("FAIL sharded_heat2d: expected the single-device result and agreement with NumPy to 1e-4")
        return 1
    print("OK sharded_heat2d")
    return 0


if __name__ == "__main__":
    sys.exit(main())
