"""Side-by-side benchmark: loopkern against the loops users would write instead.

    python bench.py              # every workload and variant on this machine's GPU
    python bench.py --quick      # small sizes, CPU backend vs JAX on the CPU (a CI smoke test)
    python bench.py --workloads heat,jacobi --sizes 4096,65536

Workloads: 1D heat (4K..16M float32), 2D Jacobi to tolerance (a while loop with a grid
reduction), Game of Life (int32, periodic), all-pairs N-body (two phases per step), and the
quadratic map x <- 4x(1-x) for 10M steps with its trajectory recorded (a sequential
recursion). Variants: loopkern in each scope that applies, jax.lax.fori_loop / while_loop /
scan(unroll=16), the same JAX loops with XLA's WHILE command buffers (a subprocess), one Numba
kernel launch per step, a CUDA graph of per-step kernels, a hand-written CUDA C++ cooperative
kernel (heat), and Numba on the CPU (quadratic map).

Every variant is checked against a float64 NumPy reference at every size before it is timed
(heat: 100 steps, also at 16M; Jacobi: the whole run to convergence, whose step count every
timed call must repeat); a wrong result is listed at the end and makes the exit status 1.
Timing: one warm-up call, then the median of --reps calls, each on freshly reset inputs; GPU
variants without their own synchronisation are timed with CUDA events, the others by
blocking on the result. Compile time is measured in fresh processes: first call with an empty
cache, then first call with the cache on disk. Results go to bench-results/<device>-<date>.json,
.md and .png.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = Path(__file__).resolve().parent
CMDBUF_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


# =============================================================================== plumbing
def gpu_available() -> bool:
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:
        return False


def device_name(gpu: bool) -> str:
    if gpu:
        from numba import cuda
        n = cuda.get_current_device().name
        return (n.decode() if isinstance(n, bytes) else n).replace(" ", "-")
    return f"cpu-{platform.machine()}"


def rel_err(a, ref) -> float:
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-300))


def have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:
        return False


@dataclass
class Impl:
    """One variant set up on one input.

    run(steps) runs the loop (returns the steps executed, or None for exactly ``steps``);
    result() returns the state as NumPy; reset() restores the inputs (not timed); sync blocks
    until the device is done (None: time with CUDA events); info: extra fields for the row.
    """

    run: Callable
    result: Callable
    reset: Callable = lambda: None
    sync: Callable | None = None
    info: dict = field(default_factory=dict)


@dataclass
class Case:
    """One workload at one size: inputs, the check, and how many steps to time.

    The check run uses check_steps (steps, or max_steps for a loop to a condition). When it
    equals steps (a loop run to convergence), every timed call must stop at the step count
    of the checked one, and converged(steps_done) says whether it got there before max_steps.
    """

    workload: str
    n: int
    steps: int                      # steps (or max_steps) per timed call
    check_steps: int
    check: Callable                 # check(impl_result, steps_done) -> (ok, detail)
    data: dict
    bytes_per_step: int = 0
    converged: Callable | None = None


class Bench:
    def __init__(self, args, gpu):
        self.args, self.gpu = args, gpu
        self.results: list[dict] = []

    def emit(self, row):
        self.results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs_s"}), flush=True)

    def time_calls(self, impl: Impl, steps: int):
        """Median seconds and steps per call over --reps calls after a warm-up."""
        def once():
            impl.reset()
            if impl.sync is None and self.gpu:
                from numba import cuda
                cuda.synchronize()
                e0, e1 = cuda.event(), cuda.event()
                e0.record()
                done = impl.run(steps)
                e1.record()
                e1.synchronize()
                return cuda.event_elapsed_time(e0, e1) / 1e3, done
            if self.gpu:
                from numba import cuda
                cuda.synchronize()
            t0 = time.perf_counter()
            done = impl.run(steps)
            if impl.sync:
                impl.sync()
            return time.perf_counter() - t0, done
        once()
        samples = [once() for _ in range(self.args.reps)]
        ts = [s for s, _ in samples]
        dones = [steps if d is None else int(d) for _, d in samples]
        return statistics.median(ts), ts, dones

    def measure(self, case: Case, variants):
        for name, make in variants:
            row = dict(workload=case.workload, n=case.n, variant=name)
            try:
                impl = make(case)
                impl.reset()
                t0 = time.perf_counter()
                done = impl.run(case.check_steps)
                if impl.sync:
                    impl.sync()
                row["first_call_s"] = round(time.perf_counter() - t0, 4)
                checked = case.check_steps if done is None else int(done)
                ok, detail = case.check(impl.result(), checked)
                row["check"] = detail
                if not ok:
                    row["error"] = f"wrong result: {detail}"
                    self.emit(row)
                    continue
                med, ts, dones = self.time_calls(impl, case.steps)
                done = dones[0]
                row.update(steps=done, us_per_step=med / max(done, 1) * 1e6, call_s=med, runs_s=ts)
                if case.converged is not None:
                    row["converged"] = bool(case.converged(done))
                expect = checked if case.check_steps == case.steps else case.steps
                if any(d != expect for d in dones) or not row.get("converged", True):
                    row["error"] = (f"wrong result: timed calls ran {sorted(set(dones))} steps, the checked "
                                    f"run {expect}" + ("" if row.get("converged", True) else
                                                       f" (did not converge within {case.steps})"))
                if case.bytes_per_step:
                    row["GBps"] = case.bytes_per_step / (med / max(done, 1)) / 1e9
                row.update(impl.info)
            except Exception as exc:   # one broken variant must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            self.emit(row)


def on_device(gpu, host):
    """A device copy of ``host`` (GPU) or a host copy (CPU)."""
    if gpu:
        from numba import cuda
        return cuda.to_device(host)
    return host.copy()


def to_host(gpu, a):
    return a.copy_to_host() if gpu else np.array(a)


def loopkern_impl(gpu, kernel, arrays: dict, scalars: tuple, order, swap_first=None, **opts):
    """An Impl that calls ``kernel`` on device copies of ``arrays`` (in ``order``)."""
    init = {k: np.array(v) for k, v in arrays.items()}
    dev = {k: on_device(gpu, v) for k, v in init.items()}
    info = {}

    def run(steps):
        args = [dev[k] for k in order] + list(scalars)
        kw = dict(opts)
        if kernel.spec.returns_condition:
            r = kernel(*args, max_steps=steps, **kw)
        else:
            r = kernel(*args, steps=steps, **kw)
        info.update(scope=r.scope, blocks=r.blocks, threads=r.threads)
        return r.steps

    def reset():
        for k, v in init.items():
            if gpu:
                dev[k].copy_to_device(v)
            else:
                dev[k][...] = v

    return Impl(run, lambda: to_host(gpu, dev[swap_first or order[0]]), reset, None, info)


def loopkern_variants(gpu, make_kernel, arrays, scalars, order, scopes, sweep_blocks=(), sweep_threads=()):
    out = []
    for scope in scopes:
        out.append((f"loopkern[{scope}]" if gpu else "loopkern[cpu]",
                    lambda case, s=scope: loopkern_impl(gpu, make_kernel(), arrays(case), scalars(case), order,
                                                        scope=s if gpu else None,
                                                        backend="cuda" if gpu else "cpu")))
    for b in sweep_blocks:
        out.append((f"loopkern[grid,blocks={b}]",
                    lambda case, b=b: loopkern_impl(gpu, make_kernel(), arrays(case), scalars(case), order,
                                                    scope="grid", blocks=b, threads=256)))
    for t in sweep_threads:
        out.append((f"loopkern[block,threads={t}]",
                    lambda case, t=t: loopkern_impl(gpu, make_kernel(), arrays(case), scalars(case), order,
                                                    scope="block", threads=t)))
    return out


def jax_impl(fn, init, result_index=0, steps_index=None):
    """An Impl for a jitted JAX function of (state..., steps) built per step count."""
    import jax
    import jax.numpy as jnp
    state = tuple(jnp.asarray(x) for x in init)
    cache, box = {}, {}

    def run(steps):
        if steps not in cache:
            cache[steps] = jax.jit(lambda *s: fn(*s, steps))
        box["r"] = cache[steps](*state)
        if steps_index is not None:
            return int(box["r"][steps_index])
        return None

    def sync():
        jax.block_until_ready(box["r"])

    def result():
        r = box["r"]
        return np.asarray(r[result_index] if isinstance(r, tuple) else r)
    return Impl(run, result, sync=sync)


def loopkern_jax_variant(make_kernel, inputs, scalars, result_index=0):
    """loopkern through kernel.jax inside jax.jit (the XLA FFI custom call on a GPU)."""
    def make(case):
        import jax
        import jax.numpy as jnp
        k = make_kernel()
        state = [jnp.asarray(x) for x in inputs(case)]
        cache, box = {}, {}

        def run(steps):
            if steps not in cache:
                kw = "max_steps" if k.spec.returns_condition else "steps"
                cache[steps] = jax.jit(lambda *xs: k.jax(*xs, *scalars(case), **{kw: steps}))
            box["r"] = cache[steps](*state)
            return int(box["r"][-1]) if k.spec.returns_condition else None
        return Impl(run, lambda: np.asarray(box["r"][result_index]), sync=lambda: jax.block_until_ready(box["r"]))
    return ("loopkern kernel.jax in jax.jit", make)


# =============================================================================== 1D heat
ALPHA = np.float32(0.25)


def heat_ref(u0, steps):
    """The heat stencil with fixed ends in float64, step by step (in place: fast enough at 16M)."""
    u = u0.astype(np.float64)
    v = u.copy()
    lap = np.empty(max(u.size - 2, 0))
    for _ in range(steps):
        np.subtract(u[:-2], 2 * u[1:-1], out=lap)
        lap += u[2:]
        lap *= float(ALPHA)
        np.add(u[1:-1], lap, out=v[1:-1])
        u, v = v, u
    return u


def heat_exact(u0, steps, alpha=float(ALPHA)):
    """The same after any number of steps, from the stencil's eigen-decomposition: the ends'
    straight line is a fixed point and sine mode k is multiplied by 1 - 4 alpha sin^2(pi k / 2(n-1))
    per step (a DST-I through the FFT), in O(n log n) whatever the step count."""
    u0 = np.asarray(u0, np.float64)
    n = u0.size
    line = u0[0] + (u0[-1] - u0[0]) * np.arange(n) / (n - 1)
    m = n - 2

    def dst1(x):
        y = np.zeros(2 * (m + 1))
        y[1:m + 1], y[m + 2:] = x, -x[::-1]
        return -np.fft.fft(y)[1:m + 1].imag / 2.0
    mu = 1.0 - 4.0 * alpha * np.sin(np.pi * np.arange(1, m + 1) / (2.0 * (m + 1))) ** 2
    out = line.copy()
    out[1:-1] += dst1(dst1(u0[1:-1] - line[1:-1]) * mu ** float(steps)) * 2.0 / (m + 1)
    return out


def heat_kernel():
    import loopkern as lk

    @lk.megakernel(swap=[("u", "v")])
    def heat(t, u, v, alpha):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    return heat


def jax_heat_step(u):
    return u.at[1:-1].set(u[1:-1] + ALPHA * (u[:-2] - 2 * u[1:-1] + u[2:]))


def jax_loop_variants(step, unpack=lambda s: s):
    import jax
    return [
        ("jax.lax.fori_loop", lambda case: jax_impl(
            lambda u, steps: jax.lax.fori_loop(0, steps, lambda i, x: step(x), u), [case.data["u0"]])),
        ("jax.lax.scan(unroll=16)", lambda case: jax_impl(
            lambda u, steps: jax.lax.scan(lambda x, _: (step(x), None), u, None, length=steps, unroll=16)[0],
            [case.data["u0"]])),
    ]


def numba_heat_variants():
    from numba import cuda

    @cuda.jit
    def heat_once(u, v, a):
        i = cuda.grid(1)
        n = u.shape[0]
        if 0 < i < n - 1:
            v[i] = u[i] + a * (u[i - 1] - np.float32(2.0) * u[i] + u[i + 1])
        elif i < n:
            v[i] = u[i]

    def per_step(case):
        u0 = case.data["u0"]
        du, dv = cuda.to_device(u0), cuda.to_device(u0)
        tpb, n = 256, u0.size
        bpg = (n + tpb - 1) // tpb
        box = {}

        def run(steps):
            a, b = du, dv
            for _ in range(steps):
                heat_once[bpg, tpb](a, b, ALPHA)
                a, b = b, a
            box["r"] = a

        def reset():
            du.copy_to_device(u0)
            dv.copy_to_device(u0)
        return Impl(run, lambda: box["r"].copy_to_host(), reset)

    def graph(case):
        import cupy as cp
        u0 = case.data["u0"]
        du, dv = cuda.to_device(u0), cuda.to_device(u0)
        tpb, n = 256, u0.size
        bpg = (n + tpb - 1) // tpb
        stream = cp.cuda.Stream(non_blocking=True)
        nstream = cuda.external_stream(stream.ptr)
        chunk = 100   # an even number of per-step kernels per graph: the state ends in du
        heat_once[bpg, tpb, nstream](du, dv, ALPHA)   # compile outside the capture
        stream.synchronize()
        stream.begin_capture()
        a, b = du, dv
        for _ in range(chunk):
            heat_once[bpg, tpb, nstream](a, b, ALPHA)
            a, b = b, a
        g = stream.end_capture()

        def run(steps):
            for _ in range(steps // chunk):
                g.launch(stream)
            a, b = du, dv                 # the rest (none in timed runs) one launch at a time
            for _ in range(steps % chunk):
                heat_once[bpg, tpb, nstream](a, b, ALPHA)
                a, b = b, a
            box["r"] = a

        def reset():
            du.copy_to_device(u0)
            dv.copy_to_device(u0)
        box = {"r": du}
        return Impl(run, lambda: box["r"].copy_to_host(), reset, sync=stream.synchronize)

    out = [("numba launch per step", per_step)]
    if have("cupy"):
        out.append(("CUDA graph of per-step kernels", graph))
    return out


def cpp_heat_variant(args):
    src = HERE / "bench" / "heat_coop.cu"
    exe = Path(tempfile.gettempdir()) / "loopkern_heat_coop"

    def make(case):
        if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
            subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", str(exe), str(src)], check=True,
                           capture_output=True, text=True)
        # the binary checks every block count it times: check_steps steps against a float64 host loop
        p = subprocess.run([str(exe), str(case.n), str(case.steps), str(args.reps), str(case.check_steps)],
                           capture_output=True, text=True, check=True)
        res = json.loads(p.stdout.strip().splitlines()[-1])
        return res
    return make


def bench_heat(b: Bench):
    args, gpu = b.args, b.gpu
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
        [4096, 65536] if args.quick else [4096, 65536, 1 << 20, 1 << 24])
    rng = np.random.default_rng(0)
    for n in sizes:
        u0 = rng.random(n).astype(np.float32)
        steps = 200 if args.quick else 20000 if n <= 65536 else 5000 if n <= 1 << 20 else 500
        check_steps = 100                 # at every size (a whole number of graph chunks)
        ref = heat_ref(u0, check_steps)

        def check(res, done, ref=ref, check_steps=check_steps):
            e = rel_err(res, ref)
            return e < 1e-4 and done == check_steps, f"rel_err={e:.2e} after {done} steps"
        case = Case("heat1d", n, steps, check_steps, check, dict(u0=u0), bytes_per_step=8 * n)
        scopes = (["auto", "grid"] + (["block"] if n <= 65536 else [])) if gpu else ["auto"]
        variants = loopkern_variants(gpu, heat_kernel, lambda c: dict(u=c.data["u0"], v=c.data["u0"]),
                                     lambda c: (ALPHA,), ["u", "v"], scopes,
                                     sweep_blocks=[x for x in (16, 64, 132, 264, 528) if x * 256 <= 2 * n]
                                     if gpu and args.sweep else (),
                                     sweep_threads=(128, 256, 512, 1024) if gpu and args.sweep and n <= 16384 else ())
        if have("jax") and not args.no_jax:
            if not args.jax_only:
                variants.append(loopkern_jax_variant(heat_kernel, lambda c: [c.data["u0"], c.data["u0"]],
                                                     lambda c: (ALPHA,)))
            variants += jax_loop_variants(jax_heat_step)
        if gpu and not args.jax_only:
            variants += numba_heat_variants()
        if args.jax_only:
            variants = [v for v in variants if v[0].startswith("jax")]
        b.measure(case, variants)
        if gpu and not args.jax_only:
            row = dict(workload="heat1d", n=n, variant="CUDA C++ cooperative")
            try:
                r = cpp_heat_variant(args)(case)
                checked = r.get("checked_blocks", 0)
                row.update(check=f"rel_err={r['rel_err']:.2e} (worst of {checked} block counts, "
                                 f"{case.check_steps} steps)")
                if not 0 <= r["rel_err"] < 1e-4 or checked < 1:
                    row["error"] = f"wrong result: {row['check']}"
                else:
                    row.update(steps=steps, us_per_step=r["us_per_step"], blocks=r["blocks"], threads=r["threads"],
                               GBps=8 * n / (r["us_per_step"] * 1e-6) / 1e9)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            b.emit(row)


# =============================================================================== 2D Jacobi
JACOBI_TOL = np.float32(1e-5)


def jacobi_problem(n, rng):
    """A Laplace problem that Jacobi iteration solves to JACOBI_TOL in about a thousand steps at
    every size. The boundary values and the exact solution are h = x^2 - y^2, which the
    five-point average maps to itself; the interior starts as h plus four sine modes with random
    amplitudes (up to 0.1) and frequencies from n/40 to n/20, so that each mode loses the same
    fraction per step at every n (random noise would need ~n^2 steps: Jacobi barely damps its
    smoothest and its checkerboard modes)."""
    x = np.arange(n) / (n - 1)
    h = x[:, None] ** 2 - x[None, :] ** 2
    kmin = max(1, n // 40)
    u0 = h.copy()
    for _ in range(4):
        k, m = rng.integers(kmin, 2 * kmin + 1, 2)
        u0 += rng.uniform(-0.1, 0.1) * np.outer(np.sin(np.pi * k * x), np.sin(np.pi * m * x))
    u0[0, :], u0[-1, :], u0[:, 0], u0[:, -1] = h[0, :], h[-1, :], h[:, 0], h[:, -1]
    return u0.astype(np.float32)


def jacobi_ref(u0, tol, max_steps):
    """Float64 Jacobi to tolerance: (state, steps, max update of each step)."""
    u = u0.astype(np.float64)
    v = u.copy()
    new = np.empty((u.shape[0] - 2, u.shape[1] - 2))
    errs = []
    for k in range(max_steps):
        np.add(u[:-2, 1:-1], u[2:, 1:-1], out=new)      # the kernel's order of additions
        new += u[1:-1, :-2]
        new += u[1:-1, 2:]
        new *= 0.25
        v[1:-1, 1:-1] = new
        new -= u[1:-1, 1:-1]
        errs.append(float(np.abs(new, out=new).max()))
        u, v = v, u
        if not errs[-1] > tol:
            break
    return u, len(errs), errs


def jacobi_kernel():
    import loopkern as lk

    @lk.megakernel(swap=[("u", "v")])
    def jacobi(t, u, v, tol):
        n = u.shape[0]
        m = u.shape[1]
        err = np.float32(0.0)
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            new = np.float32(0.25) * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
            v[i, j] = new
            err = max(err, abs(new - u[i, j]))
        return lk.max(err) > tol
    return jacobi


def jax_jacobi_while(u0, tol):
    import jax
    import jax.numpy as jnp

    def fn(u, steps):
        def body(c):
            x, _, k = c
            new = x.at[1:-1, 1:-1].set(0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
            return new, jnp.max(jnp.abs(new - x)), k + 1
        return jax.lax.while_loop(lambda c: (c[1] > tol) & (c[2] < steps), body,
                                  (u, jnp.float32(jnp.inf), jnp.int32(0)))
    return jax_impl(fn, [u0], result_index=0, steps_index=2)


def numba_jacobi_per_step(u0, tol):
    """The naive GPU loop: a step kernel, a reduction, and the error read on the host."""
    from numba import cuda

    @cuda.jit
    def step(u, v, err):
        i, j = cuda.grid(2)
        n, m = u.shape
        if 0 < i < n - 1 and 0 < j < m - 1:
            new = np.float32(0.25) * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
            v[i, j] = new
            cuda.atomic.max(err, 0, abs(new - u[i, j]))

    du, dv = cuda.to_device(u0), cuda.to_device(u0)
    err = cuda.device_array(1, np.float32)
    n, m = u0.shape
    tpb = (16, 16)
    bpg = ((n + 15) // 16, (m + 15) // 16)
    box = {}
    zero = np.zeros(1, np.float32)

    def run(steps):
        a, b, k = du, dv, 0
        while k < steps:
            err.copy_to_device(zero)
            step[bpg, tpb](a, b, err)
            a, b, k = b, a, k + 1
            if not err.copy_to_host()[0] > tol:
                break
        box["r"] = a
        return k

    def reset():
        du.copy_to_device(u0)
        dv.copy_to_device(u0)
    return Impl(run, lambda: box["r"].copy_to_host(), reset, sync=cuda.synchronize)


def bench_jacobi(b: Bench):
    args, gpu = b.args, b.gpu
    sizes = [64] if args.quick else [256, 2048]
    tol = JACOBI_TOL
    rng = np.random.default_rng(1)
    for n in sizes:
        u0 = jacobi_problem(n, rng)
        max_steps = 20000
        ref, ref_steps, errs = jacobi_ref(u0, float(tol), max_steps)
        if ref_steps >= max_steps:
            raise RuntimeError(f"jacobi2d n={n}: the float64 reference did not converge in {max_steps} steps")
        # float32 rounding (a few units of 2**-24 in each update) moves the step where the update
        # falls below tol by at most this many steps, at the reference's final decay rate
        rate = errs[-1] / errs[-2]
        slack = int(np.ceil(np.log1p(8 * 2.0 ** -24 * float(np.abs(u0).max()) / float(tol)) / -np.log(rate))) + 1
        print(f"jacobi2d n={n}: float64 reference converges in {ref_steps} steps (float32 variants: "
              f"+-{slack})", flush=True)

        def check(res, done, ref=ref, ref_steps=ref_steps, slack=slack):
            # every step changes the state by at most its update (about tol near the end)
            e = float(np.abs(np.asarray(res, np.float64) - ref).max())
            ok = done < max_steps and abs(done - ref_steps) <= slack and e <= 1e-5 + 1.1 * float(tol) * abs(
                done - ref_steps)
            return ok, (f"converged in {done} steps (float64 reference {ref_steps}, +-{slack}), "
                        f"max |u - ref|={e:.1e}")
        case = Case("jacobi2d", n * n, max_steps, max_steps, check, dict(u0=u0), bytes_per_step=8 * n * n,
                    converged=lambda done: done < max_steps)
        scopes = (["auto", "grid"] + (["block"] if n <= 256 else [])) if gpu else ["auto"]
        variants = loopkern_variants(gpu, jacobi_kernel, lambda c: dict(u=c.data["u0"], v=c.data["u0"]),
                                     lambda c: (tol,), ["u", "v"], scopes)
        if have("jax") and not args.no_jax:
            if not args.jax_only:
                variants.append(loopkern_jax_variant(jacobi_kernel, lambda c: [c.data["u0"], c.data["u0"]],
                                                     lambda c: (tol,)))
            variants.append(("jax.lax.while_loop", lambda c: jax_jacobi_while(c.data["u0"], tol)))
        if gpu and not args.jax_only:
            variants.append(("numba launch per step (+ host check)", lambda c: numba_jacobi_per_step(c.data["u0"], tol)))
        if args.jax_only:
            variants = [v for v in variants if v[0].startswith("jax")]
        b.measure(case, variants)


# =============================================================================== Game of Life
def life_ref(a0, steps):
    a = a0.copy()
    for _ in range(steps):
        s = sum(np.roll(np.roll(a, di, 0), dj, 1) for di in (-1, 0, 1) for dj in (-1, 0, 1) if di or dj)
        a = ((s == 3) | ((a == 1) & (s == 2))).astype(a.dtype)
    return a


def life_kernel():
    import loopkern as lk

    @lk.megakernel(swap=[("a", "b")])
    def life(t, a, b):
        n = a.shape[0]
        m = a.shape[1]
        for i, j in lk.grid(n, m):
            up = i - 1 if i > 0 else n - 1      # periodic neighbours
            dn = i + 1 if i < n - 1 else 0
            lf = j - 1 if j > 0 else m - 1
            rt = j + 1 if j < m - 1 else 0
            s = (a[up, lf] + a[up, j] + a[up, rt] + a[i, lf] + a[i, rt] + a[dn, lf] + a[dn, j] + a[dn, rt])
            b[i, j] = 1 if (s == 3 or (s == 2 and a[i, j] == 1)) else 0
    return life


def jax_life_step(a):
    import jax.numpy as jnp
    s = sum(jnp.roll(jnp.roll(a, di, 0), dj, 1) for di in (-1, 0, 1) for dj in (-1, 0, 1) if di or dj)
    return ((s == 3) | ((a == 1) & (s == 2))).astype(a.dtype)


def numba_life_per_step(a0):
    from numba import cuda

    @cuda.jit
    def step(a, b):
        i, j = cuda.grid(2)
        n, m = a.shape
        if i < n and j < m:
            s = 0
            for di in range(-1, 2):
                for dj in range(-1, 2):
                    if di != 0 or dj != 0:
                        s += a[(i + di + n) % n, (j + dj + m) % m]
            b[i, j] = 1 if (s == 3 or (s == 2 and a[i, j] == 1)) else 0

    da, db = cuda.to_device(a0), cuda.to_device(a0)
    n, m = a0.shape
    bpg = ((n + 15) // 16, (m + 15) // 16)
    box = {}

    def run(steps):
        x, y = da, db
        for _ in range(steps):
            step[bpg, (16, 16)](x, y)
            x, y = y, x
        box["r"] = x

    def reset():
        da.copy_to_device(a0)
    return Impl(run, lambda: box["r"].copy_to_host(), reset)


def bench_life(b: Bench):
    args, gpu = b.args, b.gpu
    n = 128 if args.quick else 1024
    a0 = (np.random.default_rng(2).random((n, n)) < 0.3).astype(np.int32)
    ref = life_ref(a0, 20)

    def check(res, done):
        bad = int((res != ref).sum())
        return bad == 0, f"{bad} cells differ"
    case = Case("life", n * n, 50 if args.quick else 2000, 20, check, dict(a0=a0))
    variants = loopkern_variants(gpu, life_kernel, lambda c: dict(a=c.data["a0"], b=c.data["a0"]), lambda c: (),
                                 ["a", "b"], ["auto"] if gpu else ["auto"])
    if have("jax") and not args.no_jax:
        import jax
        variants.append(("jax.lax.fori_loop", lambda c: jax_impl(
            lambda a, steps: jax.lax.fori_loop(0, steps, lambda i, x: jax_life_step(x), a), [c.data["a0"]])))
    if gpu and not args.jax_only:
        variants.append(("numba launch per step", lambda c: numba_life_per_step(c.data["a0"])))
    b.measure(case, variants)


# =============================================================================== N-body
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
                                 ["auto"], sweep_blocks=[4, 8, 16] if gpu else ())
    if have("jax") and not args.no_jax:
        variants.append(("jax.lax.fori_loop", lambda c: jax_nbody(pos, vel, dt, eps2)))
    b.measure(case, variants)


# =============================================================================== quadratic map
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
            import contextlib

            @contextlib.contextmanager
            def enable_x64():
                old = bool(jax.config.read("jax_enable_x64"))
                jax.config.update("jax_enable_x64", True)
                try:
                    yield
                finally:
                    jax.config.update("jax_enable_x64", old)
            steps = min(total, 20000)

            def fn(x0_, n):
                def body(x, _):
                    y = 4.0 * x * (1.0 - x)
                    return y, y
                return jax.lax.scan(body, x0_[0], None, length=n)[1]
            with enable_x64():
                impl = jax_impl(lambda x0_, n: fn(x0_, steps), [c.data["x"][:1]])
            run, res = impl.run, impl.result

            def run64(n):
                with enable_x64():
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


# =============================================================================== call overhead
def bench_overhead(b: Bench):
    """Cost of one call with a single step: a direct launch against kernel.jax in jax.jit."""
    if not have("jax") or b.args.no_jax:
        return
    import jax
    import jax.numpy as jnp
    k = heat_kernel()
    u0 = np.random.default_rng(4).random(4096).astype(np.float32)
    du, dv = on_device(b.gpu, u0), on_device(b.gpu, u0)
    backend = "cuda" if b.gpu else "cpu"
    f = jax.jit(lambda u, v: k.jax(u, v, ALPHA, steps=1))
    ju, jv = jnp.asarray(u0), jnp.asarray(u0)
    calls = {
        "loopkern direct call (launch, wait, read the step count)":
            lambda: k(du, dv, ALPHA, steps=1, backend=backend),
        "loopkern kernel.jax in jax.jit (FFI custom call), blocking": lambda: jax.block_until_ready(f(ju, jv)),
        "jax.jit of one heat step, blocking": None,
    }
    g = jax.jit(jax_heat_step)
    calls["jax.jit of one heat step, blocking"] = lambda: jax.block_until_ready(g(ju))
    results = {  # the state after the first call of each, from fresh inputs
        "loopkern direct call (launch, wait, read the step count)": lambda: to_host(b.gpu, du),
        "loopkern kernel.jax in jax.jit (FFI custom call), blocking": lambda: np.asarray(f(ju, jv)[0]),
        "jax.jit of one heat step, blocking": lambda: np.asarray(g(ju)),
    }
    ref = heat_ref(u0, 1)
    for name, fn in calls.items():
        fn()
        e = rel_err(results[name](), ref)
        if not e < 1e-5:
            b.emit(dict(workload="call_overhead", n=4096, variant=name, check=f"rel_err={e:.2e} after one step",
                        error=f"wrong result: rel_err={e:.2e} after one step"))
            continue
        for _ in range(20):
            fn()
        ts = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        b.emit(dict(workload="call_overhead", n=4096, variant=name, us_per_step=statistics.median(ts) * 1e6,
                    steps=1, check=f"rel_err={e:.2e} after one step"))


# =============================================================================== run control
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


# =============================================================================== compile time
COMPILE_SCRIPT = textwrap.dedent("""
    import sys, time, json
    sys.path.insert(0, {here!r})
    t0 = time.perf_counter()
    import numpy as np, loopkern as lk, bench
    t1 = time.perf_counter()
    k = bench.heat_kernel()
    u = np.random.rand(4096).astype(np.float32); v = u.copy()
    t2 = time.perf_counter()
    if {backend!r} == "cuda":   # what every CUDA program pays once, before its first kernel
        from numba import cuda
        cuda.current_context()
    t3 = time.perf_counter()
    u0 = u.copy()
    r = k(u, v, np.float32(0.25), steps=10, backend={backend!r})
    t4 = time.perf_counter()
    print(json.dumps(dict(import_s=t1 - t0, context_s=t3 - t2, first_call_s=t4 - t3, backend=r.backend,
                          rel_err=bench.rel_err(u, bench.heat_ref(u0, 10)), steps=r.steps)))
""")


def bench_compile(b: Bench):
    backend = "cuda" if b.gpu else "cpu"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, LOOPKERN_CACHE_DIR=cache, NUMBA_CACHE_DIR=cache)
        for label in ("first call, empty cache", "first call, new process, cache on disk"):
            row = dict(workload="compile", n=4096, variant=f"loopkern[{backend}] heat: {label}")
            try:
                p = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT.format(here=str(HERE), backend=backend)],
                                   env=env, capture_output=True, text=True, check=True, timeout=300)
                row.update(json.loads(p.stdout.strip().splitlines()[-1]))
                row["check"] = f"rel_err={row['rel_err']:.2e} after {row['steps']} steps"
                if not (row["rel_err"] < 1e-5 and row["steps"] == 10):
                    row["error"] = f"wrong result: {row['check']}"
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {getattr(exc, 'stderr', exc)}"[-400:]
            b.emit(row)


# =============================================================================== output
def write_outputs(results, meta, outdir: Path):
    outdir.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['device']}-{meta['date']}"
    (outdir / f"{stem}.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# loopkern bench: {meta['device']}, {meta['date']}", "",
             f"µs per step, median of {meta['reps']} calls after a warm-up; (ratio) = variant time / "
             f"loopkern[auto] time at the same size. Every variant was checked against a float64 NumPy "
             f"reference at every size first; for loops to a tolerance, the steps to convergence follow "
             f"the time.", ""]
    for wl in dict.fromkeys(r["workload"] for r in results):
        rows = [r for r in results if r["workload"] == wl]
        if wl == "compile":
            lines += ["## compile time (seconds; the CUDA context is created before the first call)", "",
                      "| what | first call | context creation | import loopkern |", "|---|---|---|---|"]
            lines += [f"| {r['variant']} | {r['first_call_s']:.2f} | {r.get('context_s', 0):.2f} | "
                      f"{r['import_s']:.2f} |" if "error" not in r else f"| {r['variant']} | error | | |"
                      for r in rows]
            lines.append("")
            continue
        sizes = list(dict.fromkeys(r["n"] for r in rows))
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        lines += [f"## {wl}", "", "| variant | " + " | ".join(f"n={s}" for s in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        base = {r["n"]: r.get("us_per_step") for r in rows if r["variant"].startswith("loopkern[auto")
                or r["variant"] == "loopkern[cpu]"}
        for v in variants:
            cells = []
            for s in sizes:
                r = next((r for r in rows if r["variant"] == v and r["n"] == s), None)
                if r is None:
                    cells.append("")
                elif "error" in r:
                    cells.append("error")
                else:
                    bb = base.get(s)
                    ratio = f" ({r['us_per_step'] / bb:.2f}x)" if bb else ""
                    extra = f", {r['seconds_for_all_steps']:.3g} s total" if "seconds_for_all_steps" in r else ""
                    if "numbers_per_s" in r:
                        extra += f", {r['numbers_per_s'] / 1e9:.3g}e9 numbers/s"
                    if "latency_ms" in r:
                        extra += f" (runs: {', '.join(f'{x:.2f}' for x in r['latency_ms'])})"
                    if "converged" in r:      # a loop to tolerance: how many steps it took
                        extra += f", {r['steps']} steps" + ("" if r["converged"] else " (NOT converged)")
                    cells.append(f"{r['us_per_step']:.3g}{ratio}{extra}")
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        lines.append("")
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["## errors", ""] + [f"- {r['workload']} n={r['n']} {r['variant']}: {r['error']}" for r in errors]
    (outdir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        wls = [w for w in dict.fromkeys(r["workload"] for r in results) if w != "compile"]
        fig, axes = plt.subplots(1, len(wls), figsize=(5.5 * len(wls), 4.5), squeeze=False)
        for ax, wl in zip(axes[0], wls):
            rows = [r for r in results if r["workload"] == wl and "us_per_step" in r]
            for v in dict.fromkeys(r["variant"] for r in rows):
                pts = sorted((r["n"], r["us_per_step"]) for r in rows if r["variant"] == v)
                ax.plot(*zip(*pts), marker="o", label=v)
            ax.set(xscale="log", yscale="log", xlabel="problem size (elements)", ylabel="µs per step", title=wl)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        fig.suptitle(f"loopkern bench, {meta['device']}, {meta['date']}")
        fig.tight_layout()
        fig.savefig(outdir / f"{stem}.png", dpi=110)
    except Exception as exc:
        print(f"(no plot: {exc})")
    return outdir / f"{stem}.md"


WORKLOADS = {"heat": bench_heat, "jacobi": bench_jacobi, "life": bench_life, "nbody": bench_nbody,
             "quadratic": bench_quadratic, "overhead": bench_overhead, "control": bench_control,
             "compile": bench_compile}


def run_cmdbuf_subprocess(args) -> list[dict]:
    """The JAX variants again, in a child process with XLA's WHILE command buffers on."""
    out = Path(tempfile.mkdtemp()) / "cmdbuf.json"
    wl = ",".join(w for w in args.workloads.split(",") if w in ("heat", "jacobi"))
    if not wl:
        return []
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + CMDBUF_FLAGS).strip())
    cmd = [sys.executable, __file__, "--jax-only", "--workloads", wl, "--reps", str(args.reps), "--json", str(out)]
    if args.sizes:
        cmd += ["--sizes", args.sizes]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = json.loads(out.read_text())["results"] if out.exists() else []
    for r in rows:
        r["variant"] += " [WHILE cmd buffers]"
    if not out.exists() or (p.returncode != 0 and not any(wrong_result(r) for r in rows)):
        rows.append(dict(workload="heat1d", n=0, variant="jax [WHILE command buffers]",
                         error=f"exit status {p.returncode}: {p.stderr[-400:]}"))
    return rows


def wrong_result(row) -> bool:
    return row.get("error", "").startswith("wrong result")


def report_wrong_results(results) -> int:
    """Name every variant and size whose result was wrong, on stderr; 1 if there was one."""
    bad = [r for r in results if wrong_result(r)]
    for r in bad:
        print(f"bench.py: WRONG RESULT: {r['workload']} n={r['n']} variant {r['variant']!r}: "
              f"{r['error'][len('wrong result: '):] or r.get('check', '')}", file=sys.stderr, flush=True)
    if bad:
        print(f"bench.py: {len(bad)} variant(s) failed their check against the float64 NumPy reference "
              f"(their times are not reported)", file=sys.stderr, flush=True)
    return 1 if bad else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes on the CPU backend (CI smoke test)")
    p.add_argument("--workloads", default="heat,jacobi,life,nbody,quadratic,overhead,control,compile")
    p.add_argument("--sizes", default="", help="comma-separated sizes for heat")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "bench-results"))
    p.add_argument("--sweep", action="store_true", help="also time fixed block counts (to tune scope='auto')")
    p.add_argument("--no-jax", action="store_true", help="leave out the JAX variants")
    p.add_argument("--no-cmdbuf", action="store_true", help="leave out the command-buffer subprocess")
    p.add_argument("--jax-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", help=argparse.SUPPRESS)
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="write one table from the JSON files of several runs (same device and date)")
    args = p.parse_args(argv)
    if args.merge:
        docs = [json.loads(Path(f).read_text()) for f in args.merge]
        meta = dict(docs[0]["meta"], merged=args.merge)
        results = [r for d in docs for r in d["results"]]
        md = write_outputs(results, meta, Path(args.out))
        print(md.read_text())
        return report_wrong_results(results)
    gpu = gpu_available() and not args.quick
    b = Bench(args, gpu)
    meta = dict(device=device_name(gpu), date=_dt.date.today().isoformat(), reps=args.reps,
                python=sys.version.split()[0], quick=args.quick, argv=sys.argv[1:])
    for wl in args.workloads.split(","):
        if args.jax_only and wl not in ("heat", "jacobi"):
            continue
        WORKLOADS[wl](b)
    if gpu and not args.jax_only and not args.no_cmdbuf and not args.no_jax and have("jax"):
        for row in run_cmdbuf_subprocess(args):
            b.emit(row)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, results=b.results)))
        return report_wrong_results(b.results)
    md = write_outputs(b.results, meta, Path(args.out))
    print(md.read_text())
    return report_wrong_results(b.results)


if __name__ == "__main__":
    sys.exit(main())
