"""The quadratic map x <- 4x(1-x) with its trajectory recorded: a sequential recursion."""

from __future__ import annotations

import numpy as np

from .harness import Bench, Case, Impl, have, jax_x64
from .variants import jax_impl, loopkern_variants


def logistic_kernel():
    import loopkern as lk

    @lk.megakernel
    def quadratic_map(t, x):
        x[t + 1] = 4.0 * x[t] * (1.0 - x[t])
    return quadratic_map


def quadratic_ref(x0, steps):
    x = np.empty(steps + 1)
    x[0] = x0
    for t in range(steps):
        x[t + 1] = 4.0 * x[t] * (1.0 - x[t])
    return x


def bench_quadratic(b: Bench):
    args, gpu = b.args, b.gpu
    total = 100_000 if args.quick else 10_000_000
    x0 = 0.3141592653589793
    head = quadratic_ref(x0, 20)

    def check(res, done):
        # chaotic: compare the first 20 steps, then the invariant density's mean (1/2)
        e = float(np.abs(res[:21] - head).max())
        m = float(np.mean(res[: done + 1]))
        ok = e < 1e-9 and np.all((res[: done + 1] >= 0) & (res[: done + 1] <= 1))
        return bool(ok), f"max |x - ref| over 20 steps={e:.1e}, mean={m:.4f}"
    x = np.zeros(total + 1)
    x[0] = x0
    case = Case("quadratic_map", total, total, total, check, dict(x=x))
    variants = loopkern_variants(gpu, logistic_kernel, lambda c: dict(x=c.data["x"]), lambda c: (), ["x"],
                                 ["auto"])

    def numba_cpu(c):
        import numba

        @numba.njit
        def run_map(x, steps):
            for t in range(steps):
                x[t + 1] = 4.0 * x[t] * (1.0 - x[t])
        xs = c.data["x"].copy()
        return Impl(lambda steps: run_map(xs, steps), lambda: xs)
    variants.append(("numba njit on the CPU", numba_cpu))
    if have("jax") and not args.no_jax:
        import jax

        def scan(c):
            # lax.scan records the trajectory (float64, as the others); timed on a prefix (it
            # costs ~13 µs/step on a GPU, over two minutes for all 10M steps)
            steps = min(total, 20000)

            def fn(x0_, n):
                def body(x, _):
                    y = 4.0 * x * (1.0 - x)
                    return y, y
                return jax.lax.scan(body, x0_[0], None, length=n)[1]
            with jax_x64():
                impl = jax_impl(lambda x0_, n: fn(x0_, steps), [c.data["x"][:1]])
            run, res = impl.run, impl.result

            def run64(n):
                with jax_x64():
                    run(steps)
                return steps
            impl.run = run64
            impl.result = lambda: np.concatenate([[x0], res()])
            return impl
        variants.append(("jax.lax.scan (prefix of 20000 steps)", scan))
    b.measure(case, variants)
    for r in b.results:
        if r["workload"] == "quadratic_map" and "us_per_step" in r:
            r["seconds_for_all_steps"] = r["us_per_step"] * total / 1e6

