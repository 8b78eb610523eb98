"""kernel.sharded (issue 15): what one shard's work costs on one device, and the weak-scaling
model built from it.

On a machine with one GPU the exchange between devices cannot run, so this measures, for a
2-D 5-point heat step on a 16K x 16K float32 block (``--quick``: 1K x 1K):

- ``kernel.jax`` on the block alone: the single-device step, the baseline;
- ``kernel.sharded`` on a mesh of the one device (nothing is split: the ``shard_map`` path);
- one shard's local work for P = 2 (mesh 2x1) and P = 4 (2x2) at the K the cost model picks:
  the generated step on its window (block plus halo) for K steps, plus the slicing and placing
  of the halo slabs, with the collective replaced by the identity (the same bytes are moved
  on the device; the link is not used).

The modelled efficiency adds what is not measured, for each exchange: two collectives of
``GPU_COSTS.collective_s`` per split dimension and the slabs' bytes over
``GPU_COSTS.link_bytes_s`` (``loopkern/sharding.py`` says where those figures come from).
Efficiency = single-device time per step (``kernel.jax`` on the block, one launch of the same
number of steps: each call has a fixed cost, so rows are compared at equal step counts) /
modelled sharded time per step. When a machine
with several GPUs runs ``examples/sharded_heat2d.py``, that measurement replaces the model.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from .harness import Bench, have


def heat2d_step():
    import loopkern as lk

    @lk.megakernel(swap=[("u", "v")])
    def sharded_heat2d(t, u, v, alpha):
        n, m = u.shape[0], u.shape[1]
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            v[i, j] = u[i, j] + alpha * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1] - 4.0 * u[i, j])
    return sharded_heat2d


def shard_work(kernel, sk, n, parts, k, chunks, alpha, exchange=True):
    """One shard's local work on one device: ``chunks`` launches of ``k`` steps of
    ``kernel.sharded``'s generated step on the window of an n x n block split ``parts`` ways,
    each after a halo exchange (``exchange``) whose collective is the identity (the same bytes
    are moved on the device; no link is used). The shard is an inner one along every split
    dimension. Returns u -> the block after the run."""
    from jax import lax
    import jax.numpy as jnp

    from loopkern import sharding
    from loopkern.interop.sharded import Windows, _chunk_kernel

    plan = sk.plan
    win = Windows(plan, (n, n), sharding.halo_widths(plan, k, parts), parts, ("x", "y"),
                  permute=lambda x, axis, pairs: x, index=lambda axis: jnp.int32(1))
    ck = _chunk_kernel(kernel, sk.parsed, plan, ())

    def local(u):
        lo = win.offsets()
        bounds = [x for d in range(2) for x in (lo[d], lo[d] + n)]

        def body(_, c):
            if exchange:
                c = tuple(win.exchange(a, lo) for a in c)
            return tuple(ck.jax(*c, alpha, *bounds, steps=k))
        wu, _ = lax.fori_loop(0, chunks, body, (win.to_window(u, lo), win.to_window(u, lo)))
        return win.from_window(wu, lo)
    return local


def _median_time(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def bench_sharded(b: Bench):
    args, gpu = b.args, b.gpu
    if not have("jax") or args.no_jax:
        b.emit(dict(workload="sharded", n=0, variant="kernel.sharded", error="JAX is not installed (or --no-jax)"))
        return
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from loopkern import sharding

    kernel = heat2d_step()
    n = 1024 if args.quick else 16384
    steps = 20 if args.quick else 200
    alpha = 0.2
    rng = np.random.default_rng(0)
    u0 = jnp.asarray(rng.random((n, n)).astype(np.float32))
    costs = sharding.GPU_COSTS if gpu else sharding.CPU_COSTS

    single = jax.jit(lambda u, v: kernel.jax(u, v, alpha, steps=steps))

    def run_single():
        jax.block_until_ready(single(u0, u0))
    t_single, ts = _median_time(run_single, args.reps)
    base = t_single / steps
    b.emit(dict(workload="sharded", n=n * n, variant="kernel.jax, one device (baseline)", steps=steps,
                us_per_step=base * 1e6, runs_s=ts, check="baseline"))

    one = jax.make_mesh((1, 1), ("x", "y"), devices=jax.devices()[:1])
    sk = kernel.sharded(one, P("x", "y"))
    on_mesh = jax.jit(lambda u, v: sk(u, v, alpha, steps=steps))
    same = bool(np.array_equal(np.asarray(on_mesh(u0, u0)[0]), np.asarray(single(u0, u0)[0])))

    def run_mesh():
        jax.block_until_ready(on_mesh(u0, u0))
    t_mesh, ts = _median_time(run_mesh, args.reps)
    b.emit(dict(workload="sharded", n=n * n, variant="kernel.sharded, mesh of 1 device", steps=steps,
                us_per_step=t_mesh / steps * 1e6, runs_s=ts,
                check=f"bit for bit equal to kernel.jax: {same}"))

    plan = sk.plan
    for parts, label in (((2, 1), "P=2 (mesh 2x1)"), ((2, 2), "P=4 (mesh 2x2)")):
        k = sharding.choose_exchange_every(plan, (n, n), parts, 4, costs)
        halo = sharding.halo_widths(plan, k, parts)
        chunks = max(2, steps // k)
        fn = jax.jit(shard_work(kernel, sk, n, parts, k, chunks, alpha))
        # the same launches without the exchange, and the user's step on the bare block in
        # launches of K steps: where a shard's extra time per step comes from
        launches_only = shard_work(kernel, sk, n, parts, k, chunks, alpha, exchange=False)

        def block_launches(u):
            return lax.fori_loop(0, chunks, lambda _, c: tuple(kernel.jax(*c, alpha, steps=k)), (u, u))[0]
        one_launch = jax.jit(lambda u: kernel.jax(u, u, alpha, steps=chunks * k)[0])
        t_one, ts = _median_time(lambda: jax.block_until_ready(one_launch(u0)), args.reps)
        base_p = t_one / (chunks * k)      # the baseline for this row: the same steps, one launch
        b.emit(dict(workload="sharded", n=n * n, variant=f"kernel.jax on the bare block, {label}, one launch",
                    steps=chunks * k, us_per_step=base_p * 1e6, runs_s=ts, check="baseline of this row"))
        for what, g in (("the shard's step on its window, no exchange", launches_only),
                        ("kernel.jax on the bare block", block_launches)):
            gj = jax.jit(g)
            t_g, ts = _median_time(lambda: jax.block_until_ready(gj(u0)), args.reps)
            b.emit(dict(workload="sharded", n=n * n, variant=f"{what}, {label}, launches of K={k}",
                        steps=chunks * k, us_per_step=t_g / (chunks * k) * 1e6, runs_s=ts, exchange_every=k,
                        check="timing only"))

        def run_local():
            jax.block_until_ready(fn(u0))
        t_local, ts = _median_time(run_local, args.reps)
        per_step = t_local / (chunks * k)
        split_dims = sum(1 for h in halo if h)
        moved = 0
        window = [n + 2 * h for h in halo]
        for d, h in enumerate(halo):
            if h:
                face = window[0] * window[1] // window[d]
                moved += 2 * sharding.slab_width(plan, d, h) * face * 4 * len(plan.state)
        unmeasured = (2 * split_dims * costs.collective_s + moved / costs.link_bytes_s) / k
        modelled = per_step + unmeasured
        b.emit(dict(workload="sharded", n=n * n, variant=f"one shard's local work, {label}, K={k}", steps=chunks * k,
                    us_per_step=per_step * 1e6, runs_s=ts, exchange_every=k, halo=list(halo),
                    link_and_collectives_us_per_step=unmeasured * 1e6, modelled_us_per_step=modelled * 1e6,
                    modelled_efficiency=base_p / modelled,
                    model_inputs=dict(collective_s=costs.collective_s, link_bytes_s=costs.link_bytes_s,
                                      slab_bytes_per_exchange=moved),
                    check="timing only (the collective is the identity here)"))
