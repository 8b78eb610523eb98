"""What a call costs on the host, and what splitting a run into calls costs.

call_overhead: host microseconds per blocking call of one 1D heat step on 4096 float32 elements
(``heat_kernel()``, ``ALPHA``): the median of many calls after a warm-up, each timed on its own
with time.perf_counter. Variants: loopkern with device arrays (Numba device arrays on a GPU;
NumPy arrays on the CPU backend in a CPU run), loopkern with NumPy arrays on a GPU (copied in
and back by every call), ``kernel.jax`` inside ``jax.jit``; and anchors on the same data: a bare
Numba CUDA launch + synchronize, a CuPy RawKernel launch + synchronize (GPU only), jitted JAX
functions (one op, one heat step), and a ``numba.njit`` heat step (CPU runs only). Each one is
checked once against the float64 reference of one step before it is timed.

chunked_calls: heat on 65536 elements, 10,000 steps run as 1, 10, 100 and 1000 calls of
10000/calls steps, each continuing the step index with ``start=run.next_start`` (device arrays
on a GPU); µs per step of the whole run and its ratio to the one-call time; every final state is
checked against the exact solution after 10,000 steps.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from .harness import Bench, have, on_device, rel_err, to_host
from .heat import ALPHA, heat_exact, heat_kernel, heat_ref, jax_heat_step, numba_heat_once

CALL_N = 4096
CALL_WARMUP = 20
CALL_TIMED = {False: 1000, True: 200}                   # timed calls, by --quick
CHUNKED_RUN = {False: (65536, 10000), True: (4096, 1000)}   # (elements, steps in all), by --quick
CHUNKED_CALLS = (1, 10, 100, 1000)

CUPY_HEAT_SRC = r"""
extern "C" __global__ void heat_step(const float* u, float* v, float a, int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i > 0 && i < n - 1) {
        v[i] = u[i] + a * (u[i - 1] - 2.0f * u[i] + u[i + 1]);
    } else if (i < n) {
        v[i] = u[i];
    }
}
"""


def per_call_seconds(call, warmup, calls):
    """Seconds of each of ``calls`` blocking calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return ts


def call_variants(b: Bench, u0):
    """(name, setup) pairs; setup() -> (call, result, ref): call() makes one blocking call of one
    step, result() is the state after it as NumPy, ref the float64 reference for result()."""
    gpu, args = b.gpu, b.args
    ref = heat_ref(u0, 1)
    use_jax = have("jax") and not args.no_jax
    out = []

    def loopkern_call(arrays, backend):
        def setup():
            k = heat_kernel()
            u, v = arrays()
            return (lambda: k(u, v, ALPHA, steps=1, backend=backend),
                    lambda: to_host(not isinstance(u, np.ndarray), u), ref)
        return setup

    if gpu:
        out.append(("loopkern k(u, v, alpha, steps=1), Numba device arrays",
                    loopkern_call(lambda: (on_device(True, u0), on_device(True, u0)), "cuda")))
        out.append(("loopkern k(u, v, alpha, steps=1), NumPy arrays (copied in and back)",
                    loopkern_call(lambda: (u0.copy(), u0.copy()), "cuda")))
    # the CPU backend, also in a GPU run (its target is measured on the same machine)
    out.append(("loopkern k(u, v, alpha, steps=1), CPU backend, NumPy arrays",
                loopkern_call(lambda: (u0.copy(), u0.copy()), "cpu")))

    if use_jax:
        def kernel_jax():
            import jax
            import jax.numpy as jnp
            k = heat_kernel()
            f = jax.jit(lambda u, v: k.jax(u, v, ALPHA, steps=1))
            ju, jv = jnp.asarray(u0), jnp.asarray(u0)
            box = {}

            def call():
                box["r"] = jax.block_until_ready(f(ju, jv))
            return call, lambda: np.asarray(box["r"][0]), ref
        out.append(("loopkern kernel.jax in jax.jit, blocking", kernel_jax))

        def kernel_jax_donated():
            # the way a loop over calls is written: the state is donated and carried, so XLA
            # copies nothing to keep the inputs alive
            import jax
            import jax.numpy as jnp
            k = heat_kernel()
            f = jax.jit(lambda u, v: k.jax(u, v, ALPHA, steps=1), donate_argnums=(0, 1))
            state = [jnp.asarray(u0), jnp.asarray(u0)]
            first = {}

            def call():
                u, v = f(*state)
                jax.block_until_ready(u)
                state[:] = [u, v]
                if not first:            # the state after the first call only (a copy to the host)
                    first["u"] = np.asarray(u)
            return call, lambda: first["u"], ref
        out.append(("loopkern kernel.jax in jax.jit, donated state, blocking", kernel_jax_donated))

    if gpu:
        def numba_cuda():
            from numba import cuda

            heat_once = numba_heat_once()
            du, dv = cuda.to_device(u0), cuda.to_device(u0)
            tpb = 256
            bpg = (u0.size + tpb - 1) // tpb

            def call():
                heat_once[bpg, tpb](du, dv, ALPHA)
                cuda.synchronize()
            return call, dv.copy_to_host, ref
        out.append(("anchor: Numba CUDA kernel launch + cuda.synchronize()", numba_cuda))

        if have("cupy"):
            def cupy_raw():
                import cupy as cp
                kern = cp.RawKernel(CUPY_HEAT_SRC, "heat_step")
                du, dv = cp.asarray(u0), cp.asarray(u0)
                tpb = 256
                grid = ((u0.size + tpb - 1) // tpb,)
                n = np.int32(u0.size)
                dev = cp.cuda.Device()

                def call():
                    kern(grid, (tpb,), (du, dv, ALPHA, n))
                    dev.synchronize()
                return call, lambda: cp.asnumpy(dv), ref
            out.append(("anchor: CuPy RawKernel launch + synchronize", cupy_raw))
    # the CPU anchor, also in a GPU run
    def numba_cpu():
        import numba

        @numba.njit
        def heat_once(u, v, a):
            n = u.shape[0]
            for i in range(1, n - 1):
                v[i] = u[i] + a * (u[i - 1] - np.float32(2.0) * u[i] + u[i + 1])
        u, v = u0.copy(), u0.copy()
        return lambda: heat_once(u, v, ALPHA), lambda: v, ref
    out.append(("anchor: numba.njit heat step on NumPy arrays", numba_cpu))

    if use_jax:
        def jax_fn(fn, ref_):
            def setup():
                import jax
                import jax.numpy as jnp
                f = jax.jit(fn)
                ju = jnp.asarray(u0)
                box = {}

                def call():
                    box["r"] = jax.block_until_ready(f(ju))
                return call, lambda: np.asarray(box["r"]), ref_
            return setup
        out.append(("anchor: jax.jit(lambda x: x + 1.0), blocking",
                    jax_fn(lambda x: x + 1.0, u0.astype(np.float64) + 1.0)))

        def one_op_donated():
            import jax
            import jax.numpy as jnp
            f = jax.jit(lambda x: x + 1.0, donate_argnums=0)
            state = [jnp.asarray(u0)]
            first = {}

            def call():
                state[0] = jax.block_until_ready(f(state[0]))
                if not first:
                    first["x"] = np.asarray(state[0])
            return call, lambda: first["x"], u0.astype(np.float64) + 1.0
        out.append(("anchor: jax.jit(lambda x: x + 1.0), donated, blocking", one_op_donated))
        out.append(("anchor: jax.jit of one heat step, blocking", jax_fn(jax_heat_step, ref)))
    return out


def bench_call_overhead(b: Bench):
    """Host µs per blocking call of one heat step at 4096 elements."""
    calls = CALL_TIMED[bool(b.args.quick)]
    u0 = np.random.default_rng(4).random(CALL_N).astype(np.float32)
    base = None
    for name, setup in call_variants(b, u0):
        row = dict(workload="call_overhead", n=CALL_N, variant=name)
        try:
            call, result, ref = setup()
            t0 = time.perf_counter()
            call()                          # from the fresh inputs: the one checked
            row["first_call_s"] = round(time.perf_counter() - t0, 4)
            e = rel_err(result(), ref)
            row["check"] = f"rel_err={e:.2e} after one step"
            if not e < 1e-5:
                row["error"] = f"wrong result: {row['check']}"
            else:
                ts = per_call_seconds(call, CALL_WARMUP, calls)
                med = statistics.median(ts) * 1e6
                q = np.percentile(ts, [10, 90]) * 1e6
                if base is None and name.startswith("loopkern k("):
                    base = (name, med)
                row.update(steps=1, us_per_call=med, us_per_step=med, us_mean=statistics.fmean(ts) * 1e6,
                           us_p10=float(q[0]), us_p90=float(q[1]),
                           calls=calls, warmup=CALL_WARMUP)
                if base:
                    row.update(ratio=med / base[1], ratio_to=base[0])
        except Exception as exc:   # one broken variant must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        b.emit(row)


def bench_chunked(b: Bench):
    """The same heat run split into 1, 10, 100 and 1000 calls continued with start=."""
    args, gpu = b.args, b.gpu
    backend = "cuda" if gpu else "cpu"
    n, total = CHUNKED_RUN[bool(args.quick)]
    u0 = np.random.default_rng(6).random(n).astype(np.float32)
    ref = heat_exact(u0, total)
    k = heat_kernel()
    du, dv = on_device(gpu, u0), on_device(gpu, u0)

    def reset():
        for a in (du, dv):
            if gpu:
                a.copy_to_device(u0)
            else:
                a[...] = u0

    def run_split(calls):
        m, t0 = total // calls, 0
        for _ in range(calls):
            run = k(du, dv, ALPHA, steps=m, start=t0, backend=backend)
            t0 = run.next_start
        if gpu:
            from numba import cuda
            cuda.synchronize()
        return t0

    one_call = first_state = None
    for calls in CHUNKED_CALLS:
        m = total // calls
        name = f"{calls} call{'s' if calls > 1 else ''} of {m} step{'s' if m > 1 else ''}"
        row = dict(workload="chunked_calls", n=n, variant=name, calls=calls, steps_per_call=m, backend=backend)
        try:
            reset()
            end = run_split(calls)          # checked, and the warm-up
            state = to_host(gpu, du)
            e = rel_err(state, ref)
            row["check"] = f"rel_err={e:.2e} against the exact solution after {end} steps"
            if first_state is None:
                first_state = state
            else:                           # a split run is the same run, bit for bit (README)
                row["same_as_one_call"] = bool(np.array_equal(state, first_state))
                row["check"] += ", bit for bit the one-call state" if row["same_as_one_call"] else (
                    f", differs from the one-call state (max {np.abs(state - first_state).max():.1e})")
            if not (e < 1e-4 and end == total):
                row["error"] = f"wrong result: {row['check']}"
                b.emit(row)
                continue
            ts = []
            for _ in range(args.reps):
                reset()
                if gpu:
                    from numba import cuda
                    cuda.synchronize()
                t0 = time.perf_counter()
                run_split(calls)
                ts.append(time.perf_counter() - t0)
            med = statistics.median(ts)
            if calls == 1:
                one_call = med
            row.update(steps=total, us_per_step=med / total * 1e6, us_per_call=med / calls * 1e6, call_s=med,
                       runs_s=ts)
            if one_call:
                row["ratio"] = med / one_call
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        b.emit(row)


def bench_calls(b: Bench):
    bench_call_overhead(b)
    bench_chunked(b)
