"""1D heat (fixed ends, float32): the reference (step by step and exact), the loopkern kernel,
and its variants: JAX loops, a Numba launch per step, a CUDA graph, the CUDA C++ kernel."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .harness import Bench, Case, Impl, have, rel_err
from .variants import jax_loop_variants, loopkern_jax_variant, loopkern_variants


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

def numba_heat_once():
    """One heat step as a plain Numba CUDA kernel, one thread per element (the anchor that
    launches a kernel per step)."""
    from numba import cuda

    @cuda.jit
    def heat_once(u, v, a):
        i = cuda.grid(1)
        n = u.shape[0]
        if 0 < i < n - 1:
            v[i] = u[i] + a * (u[i - 1] - np.float32(2.0) * u[i] + u[i + 1])
        elif i < n:
            v[i] = u[i]
    return heat_once


def numba_heat_variants():
    from numba import cuda

    heat_once = numba_heat_once()

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


def cpp_heat_variant(args, source="heat_coop.cu"):
    """A runner of a hand-written CUDA C++ kernel in bench/ (built once with nvcc): given a Case,
    its JSON line (us_per_step, blocks, threads, rel_err, checked_blocks)."""
    src = Path(__file__).resolve().parent / source
    exe = Path(tempfile.gettempdir()) / f"loopkern_{Path(source).stem}"

    def make(case):
        if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
            subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", str(exe), str(src)], check=True,
                           capture_output=True, text=True)
        # the binary checks every block count it times: check_steps steps against a float64 host loop
        size = case.data.get("side", case.n)       # 2-D: the side of the square field
        p = subprocess.run([str(exe), str(size), str(case.steps), str(args.reps), str(case.check_steps)],
                           capture_output=True, text=True, check=True)
        res = json.loads(p.stdout.strip().splitlines()[-1])
        return res
    return make


def emit_cpp_row(b: Bench, case, source="heat_coop.cu"):
    """Run the C++ kernel of ``source`` on ``case`` and emit its row (an error row if its own
    float64 check failed)."""
    row = dict(workload=case.workload, n=case.n, variant="CUDA C++ cooperative")
    try:
        r = cpp_heat_variant(b.args, source)(case)
        checked = r.get("checked_blocks", 0)
        row.update(check=f"rel_err={r['rel_err']:.2e} (worst of {checked} block counts, "
                         f"{case.check_steps} steps)")
        if not 0 <= r["rel_err"] < 1e-4 or checked < 1:
            row["error"] = f"wrong result: {row['check']}"
        else:
            row.update(steps=case.steps, us_per_step=r["us_per_step"], blocks=r["blocks"], threads=r["threads"],
                       GBps=case.bytes_per_step / (r["us_per_step"] * 1e-6) / 1e9)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    b.emit(row)


def bench_heat(b: Bench):
    args, gpu = b.args, b.gpu
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
        [4096, 65536] if args.quick else [4096, 65536, 1 << 20, 1 << 22, 1 << 24])
    rng = np.random.default_rng(0)
    for n in sizes:
        u0 = rng.random(n).astype(np.float32)
        steps = 200 if args.quick else 20000 if n <= 65536 else 5000 if n <= 1 << 20 else 2000 if n <= 1 << 22 \
            else 500
        check_steps = 100                 # at every size (a whole number of graph chunks)
        ref = heat_ref(u0, check_steps)

        def check(res, done, ref=ref, check_steps=check_steps):
            e = rel_err(res, ref)
            return e < 1e-4 and done == check_steps, f"rel_err={e:.2e} after {done} steps"
        case = Case("heat1d", n, steps, check_steps, check, dict(u0=u0), bytes_per_step=8 * n)
        # tile mode at every size (a field too large for the SMs' shared memory streams through
        # it), in one cluster while both buffers fit in 16 SMs' (up to about 400K)
        scopes = (["auto", "grid", "tile"] + (["cluster"] if n <= 1 << 18 else [])
                  + (["block"] if n <= 65536 else [])) if gpu else ["auto"]
        variants = loopkern_variants(gpu, heat_kernel, lambda c: dict(u=c.data["u0"], v=c.data["u0"]),
                                     lambda c: (ALPHA,), ["u", "v"], scopes,
                                     sweep_blocks=[x for x in (16, 64, 132, 264, 528) if x * 256 <= 2 * n]
                                     if gpu and args.sweep else (),
                                     sweep_threads=(128, 256, 512, 1024) if gpu and args.sweep and n <= 16384 else (),
                                     # (its tile mode runs several steps per exchange: nothing to split)
                                     experiments=("bounds",))
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
            emit_cpp_row(b, case)
