"""Side-by-side benchmark: loopkern against the loops users would write instead.

    python bench.py              # every workload and variant on this machine's GPU
    python bench.py --quick      # small sizes, CPU backend vs JAX on the CPU (a CI smoke test)
    python bench.py --workloads heat --sizes 4096,65536

Every variant is checked against a float64 NumPy reference (a short run) before it is timed.
Timing: a warm-up call, then the median of --reps calls; GPU variants are timed with CUDA
events (loopkern, Numba) or by blocking on the result (JAX). Compile time (first call) is
reported separately. Results go to bench-results/<device>-<date>.json and .md (and .png when
matplotlib is available).
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
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = Path(__file__).resolve().parent
SWEEP = False


# ------------------------------------------------------------------------------- helpers
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


class Timer:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up."""

    def __init__(self, gpu: bool, reps: int):
        self.gpu, self.reps = gpu, reps

    def __call__(self, fn, sync=None):
        fn()
        if sync:
            sync()
        ts = []
        for _ in range(self.reps):
            if self.gpu and sync is None:
                from numba import cuda
                e0, e1 = cuda.event(), cuda.event()
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                ts.append(cuda.event_elapsed_time(e0, e1) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                if sync:
                    sync()
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts), ts


def have_jax():
    try:
        import jax  # noqa: F401
        return True
    except Exception:
        return False


# ------------------------------------------------------------------------------- workload: 1D heat
ALPHA = 0.25


def heat_ref(u0, steps):
    u = u0.astype(np.float64).copy()
    for _ in range(steps):
        v = u.copy()
        v[1:-1] = u[1:-1] + ALPHA * (u[:-2] - 2 * u[1:-1] + u[2:])
        u = v
    return u


def heat_kernel():
    import loopkern as lk

    @lk.megakernel(swap=[("u", "v")])
    def heat(t, u, v, alpha):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    return heat


def heat_variants(gpu: bool, n: int):
    """(name, make) pairs; make(u0) -> (run(steps) -> None, result() -> array, sync or None)."""
    out = []
    a32 = np.float32(ALPHA)
    heat = heat_kernel()

    def loopkern_variant(scope, **opts):
        def make(u0):
            if gpu:
                from numba import cuda
                du, dv = cuda.to_device(u0), cuda.to_device(u0)
            else:
                du, dv = u0.copy(), u0.copy()
            info = {}

            def run(steps):
                info["run"] = heat(du, dv, a32, steps=steps, scope=scope, **opts)

            def result():
                return du.copy_to_host() if gpu else du.copy()
            return run, result, None, info
        return make

    scopes = ["auto", "grid"] + (["block"] if n <= 65536 else []) if gpu else ["auto"]
    for s in scopes:
        out.append((f"loopkern[{s}]", loopkern_variant(s)))
    if gpu and SWEEP:
        for b in (16, 32, 64, 132, 264, 528):
            if b * 256 <= 4 * n:
                out.append((f"loopkern[grid,blocks={b}]", loopkern_variant("grid", blocks=b, threads=256)))

    if have_jax():
        import jax
        import jax.numpy as jnp

        def jax_step(u):
            return u.at[1:-1].set(u[1:-1] + a32 * (u[:-2] - 2 * u[1:-1] + u[2:]))

        def fori_make(u0):
            ju = jnp.asarray(u0)
            box = {}
            fs = {}

            def run(steps):
                if steps not in fs:
                    fs[steps] = jax.jit(lambda u: jax.lax.fori_loop(0, steps, lambda i, x: jax_step(x), u))
                box["r"] = fs[steps](ju)

            return run, lambda: np.asarray(box["r"]), lambda: box["r"].block_until_ready(), {}
        out.append(("jax.lax.fori_loop", fori_make))

        def scan_make(u0):
            ju = jnp.asarray(u0)
            box, fs = {}, {}

            def run(steps):
                if steps not in fs:
                    fs[steps] = jax.jit(lambda u: jax.lax.scan(lambda x, _: (jax_step(x), None), u, None,
                                                               length=steps, unroll=16)[0])
                box["r"] = fs[steps](ju)
            return run, lambda: np.asarray(box["r"]), lambda: box["r"].block_until_ready(), {}
        out.append(("jax.lax.scan(unroll=16)", scan_make))

    if gpu:
        from numba import cuda

        @cuda.jit
        def heat_once(u, v, a):
            i = cuda.grid(1)
            n = u.shape[0]
            if 0 < i < n - 1:
                v[i] = u[i] + a * (u[i - 1] - np.float32(2.0) * u[i] + u[i + 1])
            elif i < n:
                v[i] = u[i]

        def per_step_make(u0):
            du, dv = cuda.to_device(u0), cuda.to_device(u0)
            tpb = 256
            bpg = (n + tpb - 1) // tpb
            box = {}

            def run(steps):
                a, b = du, dv
                for _ in range(steps):
                    heat_once[bpg, tpb](a, b, a32)
                    a, b = b, a
                box["r"] = a
            return run, lambda: box["r"].copy_to_host(), None, {}
        out.append(("numba launch per step", per_step_make))
    return out


def cpp_heat(sizes, steps_for, reps):
    """Run the hand-written CUDA C++ cooperative kernel (bench/heat_coop.cu); {n: us_per_step}."""
    src = HERE / "bench" / "heat_coop.cu"
    exe = Path("/tmp") / "loopkern_heat_coop"
    try:
        subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", str(exe), str(src)], check=True,
                       capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"error": f"nvcc failed: {getattr(exc, 'stderr', exc)}"[:500]}
    res = {}
    for n in sizes:
        p = subprocess.run([str(exe), str(n), str(steps_for(n)), str(reps)], capture_output=True, text=True)
        if p.returncode != 0:
            res[n] = {"error": p.stderr[-300:]}
            continue
        res[n] = json.loads(p.stdout.strip().splitlines()[-1])
    return res


def bench_heat(args, gpu, timer, results):
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
        [4096, 65536] if args.quick else [4096, 65536, 1 << 20, 1 << 24])

    def steps_for(n):
        if args.quick:
            return 200
        return 20000 if n <= 65536 else 5000 if n <= 1 << 20 else 500

    rng = np.random.default_rng(0)
    for n in sizes:
        u0 = rng.random(n).astype(np.float32)
        check_steps = 101
        ref = heat_ref(u0, check_steps) if n <= 1 << 20 else None
        steps = steps_for(n)
        for name, make in heat_variants(gpu, n):
            row = dict(workload="heat1d", n=n, variant=name, steps=steps)
            try:
                run, result, sync, info = make(u0)
                t0 = time.perf_counter()
                run(check_steps)
                if sync:
                    sync()
                row["first_call_s"] = time.perf_counter() - t0
                if ref is not None:
                    row["rel_err"] = rel_err(result(), ref)
                    if not row["rel_err"] < 1e-4:
                        row["error"] = f"wrong result: rel_err={row['rel_err']:.3g}"
                        results.append(row)
                        print(json.dumps(row), flush=True)
                        continue
                med, ts = timer(lambda: run(steps), sync)
                row.update(us_per_step=med / steps * 1e6, runs_s=ts,
                           GBps=8 * n / (med / steps) / 1e9)
                if "run" in info:
                    r = info["run"]
                    row.update(scope=r.scope, blocks=r.blocks, threads=r.threads)
            except Exception as exc:   # one broken variant must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs_s"}), flush=True)
    if gpu and not args.quick:
        cpp = cpp_heat(sizes, steps_for, args.reps)
        for n in sizes:
            row = dict(workload="heat1d", n=n, variant="CUDA C++ cooperative", steps=steps_for(n))
            r = cpp.get(n, cpp)
            if "error" in r:
                row["error"] = r["error"]
            else:
                row.update(us_per_step=r["us_per_step"], rel_err=r.get("rel_err"), blocks=r.get("blocks"),
                           threads=r.get("threads"), GBps=8 * n / (r["us_per_step"] * 1e-6) / 1e9)
            results.append(row)
            print(json.dumps(row), flush=True)


# ------------------------------------------------------------------------------- output
def write_outputs(results, meta, outdir: Path):
    outdir.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['device']}-{meta['date']}"
    (outdir / f"{stem}.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# loopkern bench: {meta['device']}, {meta['date']}", "",
             f"µs per step, median of {meta['reps']} runs (warm-up excluded); ratio = variant / loopkern[auto].", ""]
    for wl in dict.fromkeys(r["workload"] for r in results):
        rows = [r for r in results if r["workload"] == wl]
        sizes = list(dict.fromkeys(r["n"] for r in rows))
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        lines += [f"## {wl}", "", "| variant | " + " | ".join(f"n={s}" for s in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        base = {r["n"]: r.get("us_per_step") for r in rows if r["variant"] == "loopkern[auto]"}
        for v in variants:
            cells = []
            for s in sizes:
                r = next((r for r in rows if r["variant"] == v and r["n"] == s), None)
                if r is None:
                    cells.append("")
                elif "error" in r:
                    cells.append("error")
                else:
                    b = base.get(s)
                    ratio = f" ({r['us_per_step'] / b:.2f}x)" if b else ""
                    cells.append(f"{r['us_per_step']:.3g}{ratio}")
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        lines.append("")
    (outdir / f"{stem}.md").write_text("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        wls = list(dict.fromkeys(r["workload"] for r in results))
        fig, axes = plt.subplots(1, len(wls), figsize=(6 * len(wls), 4.5), squeeze=False)
        for ax, wl in zip(axes[0], wls):
            rows = [r for r in results if r["workload"] == wl and "us_per_step" in r]
            for v in dict.fromkeys(r["variant"] for r in rows):
                pts = sorted((r["n"], r["us_per_step"]) for r in rows if r["variant"] == v)
                ax.plot(*zip(*pts), marker="o", label=v)
            ax.set(xscale="log", yscale="log", xlabel="elements", ylabel="µs per step", title=wl)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{meta['device']} {meta['date']}")
        fig.tight_layout()
        fig.savefig(outdir / f"{stem}.png", dpi=110)
    except Exception as exc:
        print(f"(no plot: {exc})")
    return outdir / f"{stem}.md"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, CPU (CI smoke test)")
    p.add_argument("--workloads", default="heat", help="comma-separated: heat")
    p.add_argument("--sizes", default="", help="comma-separated problem sizes (heat)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "bench-results"))
    p.add_argument("--sweep", action="store_true", help="also time fixed block counts (tuning scope='auto')")
    args = p.parse_args(argv)
    global SWEEP
    SWEEP = args.sweep
    gpu = gpu_available() and not args.quick
    timer = Timer(gpu, args.reps)
    results = []
    meta = dict(device=device_name(gpu), date=_dt.date.today().isoformat(), reps=args.reps,
                python=sys.version.split()[0], quick=args.quick)
    for wl in args.workloads.split(","):
        {"heat": bench_heat}[wl](args, gpu, timer, results)
    md = write_outputs(results, meta, Path(args.out))
    print(md.read_text())
    return 0 if not any("wrong result" in r.get("error", "") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
