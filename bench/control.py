"""Run control: progress reporting overhead, cancellation latency, lk.random throughput."""

from __future__ import annotations

import statistics
import time

import numpy as np

from .harness import Bench, Case, have, on_device, rel_err, to_host
from .heat import ALPHA, heat_exact, heat_kernel, heat_ref
from .variants import loopkern_impl


def philox_draws(kind, seed, step, keys, site, subkey=0):
    """lk.random's draws from an independent Philox4x32-10 (Salmon et al. 2011; Random123's
    constants): counter (key low, key high, subkey, step low), key (seed low, seed high XOR the
    low word of site * 0x85EBCA6B); uniform from 53 bits of words 0-1, normal by Box-Muller on 2-3."""
    m32 = np.uint64(0xFFFFFFFF)
    keys = np.asarray(keys, np.uint64)
    c = [keys & m32, keys >> np.uint64(32), np.full_like(keys, subkey), np.full_like(keys, step & 0xFFFFFFFF)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(((seed >> 32) ^ (site * 0x85EBCA6B)) & 0xFFFFFFFF)
    for r in range(10):
        if r:
            k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & m32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & m32]
    if kind == "uniform":
        return ((c[0] >> np.uint64(5)).astype(np.float64) * 2.0 ** 26 + (c[1] >> np.uint64(6))) / 2.0 ** 53
    u1 = (c[2].astype(np.float64) + 1.0) / 2.0 ** 32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * c[3].astype(np.float64) / 2.0 ** 32)


def rng_kernel(kind):
    import loopkern as lk
    if kind == "normal":
        @lk.megakernel
        def rng_normal(t, x):
            for i in lk.range(x.shape[0]):
                x[i] = np.float32(lk.random.normal(i))
        return rng_normal

    @lk.megakernel
    def rng_uniform(t, x):
        for i in lk.range(x.shape[0]):
            x[i] = np.float32(lk.random.uniform(i))
    return rng_uniform


def bench_control(b: Bench):
    """Issue-5 numbers: progress reporting overhead, cancellation latency, RNG throughput."""
    args, gpu = b.args, b.gpu
    backend = "cuda" if gpu else "cpu"
    n = 65536 if not args.quick else 4096
    u0 = np.random.default_rng(5).random(n).astype(np.float32)
    steps = 20000 if not args.quick else 2000

    def check(res, done):
        e = rel_err(res, heat_ref(u0, done))
        return e < 1e-4, f"rel_err={e:.2e}"
    case = Case("progress", n, steps, 100, check, dict(u0=u0), bytes_per_step=8 * n)
    arrays = lambda c: dict(u=c.data["u0"], v=c.data["u0"])  # noqa: E731
    variants = [(f"loopkern[auto] progress={p}", lambda c, p=p: loopkern_impl(
        gpu, heat_kernel(), arrays(c), (ALPHA,), ["u", "v"], backend=backend,
        progress={"off": False, "callback": (lambda done, total: None)}[p])) for p in ("callback", "off")]
    # what the per-step poll (cancel, timeout, progress, watchdog) costs: a kernel without it
    variants.insert(0, ("loopkern[auto] no per-step poll (internal baseline)", lambda c: loopkern_impl(
        gpu, heat_kernel(), arrays(c), (ALPHA,), ["u", "v"], backend=backend, _control=False)))
    b.measure(case, variants)

    # cancellation latency: from cancel() to wait() returning, on a run that would last minutes;
    # float64, so that each cancelled state can be checked against the exact solution after the
    # steps it reports (heat_exact: any step count)
    k = heat_kernel()
    x0 = u0.astype(np.float64)
    du, dv = on_device(gpu, x0), on_device(gpu, x0)
    lat, steps_done, worst = [], [], 0.0
    for _ in range(args.reps):
        for a in (du, dv):
            if gpu:
                a.copy_to_device(x0)
            else:
                a[...] = x0
        h = k.start(du, dv, ALPHA, steps=10 ** 9, backend=backend)
        time.sleep(0.3)
        t0 = time.perf_counter()
        h.cancel()
        run = h.wait()
        lat.append(time.perf_counter() - t0)
        steps_done.append(run.steps)
        worst = max(worst, rel_err(to_host(gpu, du), heat_exact(x0, run.steps)))
        if run.stopped != "cancelled":
            worst = float("inf")
    row = dict(workload="cancel", n=n, variant="loopkern[auto] cancel() -> wait() latency (ms), float64 heat",
               us_per_step=statistics.median(lat) * 1e3, latency_ms=[round(x * 1e3, 3) for x in lat],
               steps=int(statistics.median(steps_done)), stopped=run.stopped,
               check=f"cancelled states against the exact solution: rel_err <= {worst:.1e}")
    if not worst < 1e-9:
        row["error"] = f"wrong result: {row['check']}"
    b.emit(row)

    # random numbers: one float32 draw per element per step, written out
    m = (1 << 24) if gpu else (1 << 16)
    rsteps = 50 if gpu else 5
    for kind in ("uniform", "normal"):
        rk = rng_kernel(kind)
        x = on_device(gpu, np.zeros(m, np.float32))
        rk(x, steps=1, backend=backend, seed=1)
        vals = to_host(gpu, x).astype(np.float64)
        # the first 65536 draws against an independent Philox4x32-10 (step 0, key i, call site 1),
        # all of them against the moments (5 standard errors)
        ref = philox_draws(kind, seed=1, step=0, keys=np.arange(min(m, 65536)), site=1).astype(np.float32)
        mismatch = int(np.sum(np.abs(vals[:ref.size] - ref) > 2e-7 * np.maximum(1.0, np.abs(ref))))
        mean, var = (0.5, 1 / 12) if kind == "uniform" else (0.0, 1.0)
        var_sd = np.sqrt((1 / 80 - 1 / 144) / m) if kind == "uniform" else np.sqrt(2 / m)
        ok = (mismatch == 0 and abs(vals.mean() - mean) < 5 * np.sqrt(var / m)
              and abs(vals.var() - var) < 5 * var_sd)
        ts = []
        for _ in range(args.reps):
            if gpu:
                from numba import cuda
                cuda.synchronize()
            t0 = time.perf_counter()
            rk(x, steps=rsteps, backend=backend, seed=2)
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        row = dict(workload="rng", n=m, variant=f"loopkern lk.random.{kind} (float32 out)",
                   us_per_step=med / rsteps * 1e6, numbers_per_s=m * rsteps / med, steps=rsteps,
                   check=f"{mismatch} of {ref.size} differ from Philox4x32-10; mean {vals.mean():.4f} "
                         f"var {vals.var():.4f}")
        if not ok:
            row["error"] = f"wrong result: {row['check']}"
        b.emit(row)
    if have("jax") and not args.no_jax:
        import jax
        import jax.numpy as jnp

        @jax.jit
        def draws(key):
            def body(i, acc):
                return acc + jax.random.normal(jax.random.fold_in(key, i), (m,), jnp.float32)
            return jax.lax.fori_loop(0, rsteps, body, jnp.zeros((m,), jnp.float32))
        key = jax.random.PRNGKey(0)
        vals = np.asarray(draws(key), np.float64) / np.sqrt(rsteps)   # a sum of rsteps normals, scaled
        ok = abs(vals.mean()) < 5 / np.sqrt(m) and abs(vals.var() - 1.0) < 5 * np.sqrt(2 / m)
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(draws(key))
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        row = dict(workload="rng", n=m, variant="jax.random.normal in fori_loop (float32, added to a carry)",
                   us_per_step=med / rsteps * 1e6, numbers_per_s=m * rsteps / med, steps=rsteps,
                   check=f"mean {vals.mean():.4f} var {vals.var():.4f}")
        if not ok:
            row["error"] = f"wrong result: {row['check']}"
        b.emit(row)

