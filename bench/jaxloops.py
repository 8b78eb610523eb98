"""Drop-in JAX loops (issue 14): ``lk.fori_loop`` of the jnp heat body and ``lk.while_loop`` of a jnp
Jacobi body, against the hand-written ``@megakernel`` step and against ``jax.lax``, at 4K and 64K
elements; QuantEcon's quadratic map with ``lk.scan`` for 10M steps; two bodies with what
session 20 added, against ``jax.lax.fori_loop``: backward Euler for 1-D heat solved by CG to a
tolerance in every step (a nested ``while_loop``, run in phases) and a COO matrix iteration with
``jax.ops.segment_sum`` (atomic adds), at 4K and 64K; and what tracing plus
compiling a new body costs, cold (empty cache, new process; the FFI shim's one-time build
apart), from the disk cache (new process), from the in-process cache (a new closure of the same
body), and for a second body in a process that has compiled one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

from .harness import ROOT, Bench, Case, Impl, have, jax_x64, rel_err
from .heat import ALPHA, heat_kernel, heat_ref, jax_heat_step
from .jacobi import JACOBI_TOL, jacobi_kernel, jacobi_problem, jacobi_ref
from .quadratic import quadratic_ref
from .variants import bounds_variant, jax_impl, loopkern_jax_variant, loopkern_variants, prefetch_rim_variant


def lk_heat(u, steps):
    import loopkern as lk
    return lk.fori_loop(0, steps, lambda i, x: jax_heat_step(x), u, fallback="error")


def jacobi_body(c):
    import jax.numpy as jnp
    x, _, k = c
    new = x.at[1:-1, 1:-1].set(np.float32(0.25) * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
    return new, jnp.max(jnp.abs(new - x)), k + 1


def jacobi_loop(loop, tol):
    import jax.numpy as jnp

    def fn(u, steps):
        kw = dict(fallback="error") if loop.__module__.startswith("loopkern") else {}
        return loop(lambda c: (c[1] > tol) & (c[2] < steps), jacobi_body, (u, jnp.float32(jnp.inf), jnp.int32(0)),
                    **kw)
    return fn


def bench_jaxloops(b: Bench):
    args, gpu = b.args, b.gpu
    if not have("jax") or args.no_jax:
        b.emit(dict(workload="jaxloops", n=0, variant="lk.fori_loop", error="JAX is not installed (or --no-jax)"))
        return
    import jax
    import loopkern as lk

    rng = np.random.default_rng(0)
    # -- 1-D heat: lk.fori_loop vs @megakernel vs lax.fori_loop
    for n in [4096, 65536]:
        u0 = rng.random(n).astype(np.float32)
        steps = 200 if args.quick else 20000
        check_steps = 100
        ref = heat_ref(u0, check_steps)

        def check(res, done, ref=ref):
            e = rel_err(res, ref)
            return e < 1e-4 and done == check_steps, f"rel_err={e:.2e} after {done} steps"
        case = Case("jaxloops_heat1d", n, steps, check_steps, check, dict(u0=u0), bytes_per_step=8 * n)
        variants = loopkern_variants(gpu, heat_kernel, lambda c: dict(u=c.data["u0"], v=c.data["u0"]),
                                     lambda c: (ALPHA,), ["u", "v"], ["auto"])
        variants.append(loopkern_jax_variant(heat_kernel, lambda c: [c.data["u0"], c.data["u0"]], lambda c: (ALPHA,)))
        variants.append(("lk.fori_loop in jax.jit", lambda c: jax_impl(lk_heat, [c.data["u0"]])))
        variants.append(("jax.lax.fori_loop", lambda c: jax_impl(
            lambda u, s: jax.lax.fori_loop(0, s, lambda i, x: jax_heat_step(x), u), [c.data["u0"]])))
        b.measure(case, variants)

    # -- Jacobi to a tolerance: lk.while_loop vs @megakernel vs lax.while_loop (64x64 = 4K, 256x256 = 64K)
    tol = JACOBI_TOL
    for side in [64, 256]:
        u0 = jacobi_problem(side, rng)
        max_steps = 20000
        ref, ref_steps, errs = jacobi_ref(u0, float(tol), max_steps)
        rate = errs[-1] / errs[-2]
        slack = int(np.ceil(np.log1p(8 * 2.0 ** -24 * float(np.abs(u0).max()) / float(tol)) / -np.log(rate))) + 1

        def check(res, done, ref=ref, ref_steps=ref_steps, slack=slack):
            e = float(np.abs(np.asarray(res, np.float64) - ref).max())
            ok = done < max_steps and abs(done - ref_steps) <= slack and e <= 1e-5 + 1.1 * float(tol) * abs(
                done - ref_steps)
            return ok, f"converged in {done} steps (float64 reference {ref_steps}, +-{slack}), max |u - ref|={e:.1e}"
        case = Case("jaxloops_jacobi2d", side * side, max_steps, max_steps, check, dict(u0=u0),
                    bytes_per_step=8 * side * side, converged=lambda done: done < max_steps)
        variants = loopkern_variants(gpu, jacobi_kernel, lambda c: dict(u=c.data["u0"], v=c.data["u0"]),
                                     lambda c: (tol,), ["u", "v"], ["auto"])
        variants.append(("lk.while_loop in jax.jit", lambda c: jax_impl(jacobi_loop(lk.while_loop, tol), [c.data["u0"]],
                                                                          result_index=0, steps_index=2)))
        # the lowered body's grid kernel with launch bounds (bench.py --launch-bounds), and the
        # body lowered without its rim's early loads (bench.py --prefetch-rim off)
        lowered = variants[-1]
        bounded, unfetched = bounds_variant(*lowered), prefetch_rim_variant(*lowered)
        variants += [v for v in (bounded if gpu else None, unfetched) if v]
        variants.append(("jax.lax.while_loop", lambda c: jax_impl(jacobi_loop(jax.lax.while_loop, tol), [c.data["u0"]],
                                                                    result_index=0, steps_index=2)))
        b.measure(case, variants)

    # -- QuantEcon's quadratic map with lk.scan, the trajectory recorded (float64)
    total = 100_000 if args.quick else 10_000_000
    x0 = 0.3141592653589793
    head = quadratic_ref(x0, 20)

    def qcheck(res, done):
        e = float(np.abs(res[:21] - head).max())
        ok = e < 1e-9 and res.shape == (done + 1,) and np.all((res >= 0) & (res <= 1))
        return bool(ok), f"max |x - ref| over 20 steps={e:.1e}, mean={float(np.mean(res)):.4f}"
    case = Case("jaxloops_quadratic_map", total, total, total, qcheck, dict(x0=x0))

    def scan_impl(c):
        import jax.numpy as jnp

        def body(x, _):
            y = 4.0 * x * (1.0 - x)
            return y, y
        cache, box = {}, {}

        def run(steps):
            with jax_x64():
                if steps not in cache:
                    cache[steps] = jax.jit(lambda x: lk.scan(body, x, None, length=steps, fallback="error")[1])
                box["r"] = cache[steps](jnp.float64(x0))
                jax.block_until_ready(box["r"])

        def result():
            return np.concatenate([[x0], np.asarray(box["r"])])
        return Impl(run, result, sync=lambda: jax.block_until_ready(box["r"]))
    b.measure(case, [("lk.scan in jax.jit (float64)", scan_impl)])
    for r in b.results:
        if r["workload"] == "jaxloops_quadratic_map" and "us_per_step" in r:
            r["seconds_for_all_steps"] = r["us_per_step"] * total / 1e6

    # -- bodies with a nested loop and a scatter (session 20): implicit heat with CG per step,
    #    and a COO matrix iteration with segment_sum; lk.fori_loop against lax.fori_loop
    bench_jaxloops_nested_and_scatter(b, rng)

    # -- trace + compile time of a new body
    bench_jaxloops_compile(b)


IMPLICIT_A = np.float32(0.3)


def implicit_cg_step(i, u):
    """Backward Euler for 1-D heat (zero ends), each step solved by CG to a tolerance."""
    import jax.numpy as jnp
    from jax import lax

    def apply(v):
        nb = jnp.pad(v, 1)
        return (1 + 2 * IMPLICIT_A) * v - IMPLICIT_A * (nb[:-2] + nb[2:])

    def cg(c):
        x, r, p, rs, k = c
        ap = apply(p)
        alpha = rs / jnp.dot(p, ap)
        x, r = x + alpha * p, r - alpha * ap
        rs_new = jnp.dot(r, r)
        return x, r, r + (rs_new / rs) * p, rs_new, k + 1
    r0 = u - apply(u)
    return lax.while_loop(lambda c: (c[3] > np.float32(1e-8)) & (c[4] < 200), cg,
                          (u, r0, r0, jnp.dot(r0, r0), jnp.int32(0)))[0]


def implicit_ref(u0, steps):
    from scipy.linalg import solve_banded
    n = u0.shape[0]
    ab = np.zeros((3, n))
    ab[0, 1:], ab[1, :], ab[2, :-1] = -float(IMPLICIT_A), 1 + 2 * float(IMPLICIT_A), -float(IMPLICIT_A)
    u = u0.astype(np.float64)
    for _ in range(steps):
        u = solve_banded((1, 1), ab, u)
    return u


def bench_jaxloops_nested_and_scatter(b: Bench, rng):
    import jax
    import jax.numpy as jnp
    import loopkern as lk
    quick = b.args.quick
    for n in [4096, 65536]:
        u0 = rng.random(n).astype(np.float32)
        steps, check_steps = (5 if quick else 200), 5
        ref = implicit_ref(u0, check_steps)

        def check(res, done, ref=ref):
            e = float(np.abs(np.asarray(res, np.float64) - ref).max())
            return e < 1e-4, f"max |u - ref|={e:.1e} after {check_steps} steps"
        case = Case("jaxloops_implicit_cg", n, steps, check_steps, check, dict(u0=u0))
        b.measure(case, [
            ("lk.fori_loop in jax.jit", lambda c: jax_impl(
                lambda u, s: lk.fori_loop(0, s, implicit_cg_step, u, fallback="error"), [c.data["u0"]])),
            ("jax.lax.fori_loop", lambda c: jax_impl(
                lambda u, s: jax.lax.fori_loop(0, s, implicit_cg_step, u), [c.data["u0"]]))])

    for n, nnz in [(4096, 32768), (65536, 524288)]:
        rows = rng.integers(0, n, nnz).astype(np.int32)
        cols = rng.integers(0, n, nnz).astype(np.int32)
        vals = (rng.uniform(-0.5, 0.5, nnz) * n / nnz).astype(np.float32)
        x0 = rng.random(n).astype(np.float32)
        steps, check_steps = (20 if quick else 2000), 20
        ref = x0.astype(np.float64)
        for _ in range(check_steps):
            y = np.zeros(n)
            np.add.at(y, rows, vals.astype(np.float64) * ref[cols])
            ref = 0.5 * ref + y + 0.1          # forced, so x stays of order one

        def check(res, done, ref=ref):
            e = float(np.abs(np.asarray(res, np.float64) - ref).max() / np.abs(ref).max())
            return e < 1e-5, f"max |x - ref| / max |ref|={e:.1e} after {check_steps} steps"
        r, cc, v = jnp.asarray(rows), jnp.asarray(cols), jnp.asarray(vals)

        def spmv(i, x, r=r, cc=cc, v=v, n=n):
            return np.float32(0.5) * x + jax.ops.segment_sum(v * x[cc], r, num_segments=n) + np.float32(0.1)
        case = Case("jaxloops_coo_spmv", n, steps, check_steps, check, dict(x0=x0), bytes_per_step=12 * nnz + 8 * n)
        b.measure(case, [
            ("lk.fori_loop in jax.jit", lambda c, f=spmv: jax_impl(
                lambda x, s: lk.fori_loop(0, s, f, x, fallback="error"), [c.data["x0"]])),
            ("jax.lax.fori_loop", lambda c, f=spmv: jax_impl(
                lambda x, s: jax.lax.fori_loop(0, s, f, x), [c.data["x0"]]))])


COMPILE_SCRIPT = textwrap.dedent("""
    import sys, time, json
    sys.path.insert(0, {here!r})
    t0 = time.perf_counter()
    import numpy as np, jax, jax.numpy as jnp, loopkern as lk
    from loopkern.interop import xla_ffi
    t1 = time.perf_counter()
    u = jnp.asarray(np.random.rand(4096).astype(np.float32))
    def make(alpha):
        def body(i, x):
            return x.at[1:-1].set(x[1:-1] + alpha * (x[:-2] - 2 * x[1:-1] + x[2:]))
        return body
    def other(i, x):                      # a second body: another kernel
        return x.at[1:-1].set(np.float32(0.5) * (x[:-2] + x[2:]) - np.float32(0.01) * x[1:-1])
    jax.block_until_ready(u * 2)          # JAX's own start-up, not counted
    ts = time.perf_counter()
    if jax.default_backend() == "gpu":
        xla_ffi.build_shim()              # once per machine and jaxlib (cached on disk)
    t2 = time.perf_counter()
    out = jax.block_until_ready(lk.fori_loop(0, 10, make(np.float32(0.25)), u, fallback="error"))
    t3 = time.perf_counter()
    out2 = jax.block_until_ready(lk.fori_loop(0, 10, make(np.float32(0.25)), u + 0, fallback="error"))
    t4 = time.perf_counter()
    out3 = jax.block_until_ready(lk.fori_loop(0, 10, other, u, fallback="error"))
    t5 = time.perf_counter()
    ref = jax.lax.fori_loop(0, 10, make(np.float32(0.25)), u)
    ref3 = jax.lax.fori_loop(0, 10, other, u)
    err = max(float(jnp.max(jnp.abs(out - ref))), float(jnp.max(jnp.abs(out2 - ref))),
              float(jnp.max(jnp.abs(out3 - ref3))))
    print(json.dumps(dict(import_s=t1 - t0, shim_s=t2 - ts, first_call_s=t3 - t2, again_s=t4 - t3,
                          second_body_s=t5 - t4, max_err=err)))
""")


def bench_jaxloops_compile(b: Bench):
    """Fresh processes: the FFI shim's one-time build (cached on disk per machine and jaxlib), then
    the first lk.fori_loop of a body with an empty cache, and with the cache on disk; in each
    process also a new closure of the same body (trace + lowering + in-process cache) and a
    second, different body (its kernel compiled in a process that has compiled one)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, LOOPKERN_CACHE_DIR=cache, NUMBA_CACHE_DIR=cache)
        for label in ("empty cache", "cache on disk"):
            rows = [dict(workload="compile", n=4096, variant=f"XLA FFI shim build or load ({label} run)"),
                    dict(workload="compile", n=4096,
                         variant=f"lk.fori_loop heat body, first call, new process, {label}"),
                    dict(workload="compile", n=4096,
                         variant=f"lk.fori_loop heat body, a new closure of it in the same process ({label} run)"),
                    dict(workload="compile", n=4096,
                         variant=f"lk.fori_loop, a second body in the same process ({label} run)")]
            try:
                p = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT.format(here=str(ROOT))], env=env,
                                   capture_output=True, text=True, check=True, timeout=600)
                res = json.loads(p.stdout.strip().splitlines()[-1])
                check = f"max |lk - lax| = {res['max_err']:.1e}"
                for row, key in zip(rows, ("shim_s", "first_call_s", "again_s", "second_body_s")):
                    row.update(first_call_s=res[key], import_s=res["import_s"], check=check)
                    if res["max_err"] != 0.0:
                        row["error"] = f"wrong result: {check}"
            except Exception as exc:
                for row in rows:
                    row["error"] = f"{type(exc).__name__}: {getattr(exc, 'stderr', exc)}"[-400:]
            for row in rows:
                b.emit(row)
