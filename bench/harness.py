"""The bench's harness: variants (Impl), workloads at one size (Case), the check-then-time loop
(Bench), host/device plumbing, the command-buffer subprocess, the output files and the report of
wrong results. The method is described in bench.py's docstring."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = Path(__file__).resolve().parent.parent          # the repository: bench.py, bench-results/
BENCH_SCRIPT = ROOT / "bench.py"
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


@contextlib.contextmanager
def jax_x64():
    """JAX with 64-bit types for the duration (the float64 workloads), restored afterwards."""
    import jax
    old = bool(jax.config.read("jax_enable_x64"))
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


@dataclass
class Impl:
    """One variant set up on one input.

    run(steps) runs the loop (returns the steps executed, or None for exactly ``steps``);
    result() returns the state as NumPy; reset() restores the inputs (not timed); sync blocks
    until the device is done (None: time with CUDA events); count() (if given) returns the
    steps the last call executed, read after its timing; info: extra fields for the row.

    A JAX variant's step count is a device scalar: reading it back inside the timing cost
    0.4-0.8 ms per call on an H100 (bench/jax_variance_probe.py, session 26; more than a whole
    4K Jacobi loop's dispatch), a host transfer that is no part of the loop and that the
    direct calls, whose count comes from mapped host memory, do not pay. So it is read by
    count(), after the time is taken.
    """

    run: Callable
    result: Callable
    reset: Callable = lambda: None
    sync: Callable | None = None
    info: dict = field(default_factory=dict)
    count: Callable | None = None


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

    def timer(self, impl: Impl, steps: int):
        """A function that times one call of ``impl`` on freshly reset inputs: (seconds, steps
        done); see :func:`time_call`."""
        return lambda: time_call(impl, steps, self.gpu)

    def measure(self, case: Case, variants):
        """Check every variant against the case's reference, then time the ones that passed in
        interleaved rounds: a warm-up call of each, then --reps rounds of one call of each.
        Timed one variant after another, drift of the machine (the host's clock, the GPU's
        state) between variants showed up as differences of 10-20% between variants that ran
        the same kernel (bench/jax_path_probe.py, session 25); interleaved, each variant's
        median comes from the same stretch of time as the others'. Each round starts one
        variant later than the one before, so that no variant always holds the same place: in
        each of the seven Jacobi 256² runs of sessions 26-39 the first variant of every round
        (loopkern's ``auto``, which followed the per-step launch loop that ended the round
        before) ran 0.07-0.3 µs/step slower than the second (``grid``: the same kernel on the
        same grid)."""
        rows, timed = [], []
        for name, make in variants:
            row = dict(workload=case.workload, n=case.n, variant=name)
            rows.append(row)
            try:
                impl = make(case)
                impl.reset()
                t0 = time.perf_counter()
                done = impl.run(case.check_steps)
                if impl.sync:
                    impl.sync()
                row["first_call_s"] = round(time.perf_counter() - t0, 4)
                if impl.count:
                    done = impl.count()
                checked = case.check_steps if done is None else int(done)
                ok, detail = case.check(impl.result(), checked)
                row["check"] = detail
                if not ok:
                    row["error"] = f"wrong result: {detail}"
                    continue
                timed.append((row, impl, self.timer(impl, case.steps), checked, []))
            except Exception as exc:   # one broken variant must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        for rnd in range(self.args.reps + 1):          # round 0 is the warm-up
            shift = rnd % max(len(timed), 1)
            for row, _, once, _, samples in timed[shift:] + timed[:shift]:
                if "error" in row:
                    continue
                try:
                    t, done = once()
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                    continue
                if rnd:
                    samples.append((t, case.steps if done is None else int(done)))
        for row, impl, _, checked, samples in timed:
            if "error" in row:
                continue
            ts = [t for t, _ in samples]
            dones = [d for _, d in samples]
            med, done = statistics.median(ts), dones[0]
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
        for row in rows:
            self.emit(row)


def time_call(impl: Impl, steps: int, gpu: bool):
    """Time one call of ``impl`` on freshly reset inputs: (seconds, steps done). GPU variants
    without their own synchronisation are timed with CUDA events; the others by the host's
    clock up to their ``sync``, the step count read after (``Impl.count``)."""
    impl.reset()
    if impl.sync is None and gpu:
        from numba import cuda
        cuda.synchronize()
        e0, e1 = cuda.event(), cuda.event()
        e0.record()
        done = impl.run(steps)
        e1.record()
        e1.synchronize()
        return cuda.event_elapsed_time(e0, e1) / 1e3, done
    if gpu:
        from numba import cuda
        cuda.synchronize()
    t0 = time.perf_counter()
    done = impl.run(steps)
    if impl.sync:
        impl.sync()
    t = time.perf_counter() - t0
    return t, impl.count() if impl.count else done


def on_device(gpu, host):
    """A device copy of ``host`` (GPU) or a host copy (CPU)."""
    if gpu:
        from numba import cuda
        return cuda.to_device(host)
    return host.copy()


def to_host(gpu, a):
    return a.copy_to_host() if gpu else np.array(a)


# =============================================================================== output
def call_overhead_lines(rows):
    """The call_overhead rows: host µs per blocking call of one step, and the ratio to loopkern."""
    r0 = next((r for r in rows if "ratio_to" in r), None)
    counts = sorted({r["calls"] for r in rows if "calls" in r})
    head = (f"median of {'/'.join(map(str, counts))} calls after {r0.get('warmup', 20)} untimed ones, each "
            f"timed on its own" if r0 and counts else "median of the calls after a warm-up")
    out = [f"## call overhead (host µs per blocking call of one heat step, n={rows[0]['n']}; {head})", "",
           f"| variant | µs per call (median) | mean | p10-p90 | ratio to {r0['ratio_to'] if r0 else 'loopkern'} |",
           "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | error | | | |")
            continue
        us = r.get("us_per_call", r.get("us_per_step"))
        mean = f"{r['us_mean']:.3g}" if "us_mean" in r else ""
        spread = f"{r['us_p10']:.3g}-{r['us_p90']:.3g}" if "us_p10" in r else ""
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ""
        out.append(f"| {r['variant']} | {us:.3g} | {mean} | {spread} | {ratio} |")
    return out


def chunked_calls_lines(rows):
    """The chunked_calls rows: one run split into more and more calls continued with start=."""
    r0 = next((r for r in rows if "steps" in r), rows[0])
    out = [f"## one heat run split into calls (n={r0['n']}, {r0.get('steps', '?')} steps in all, each call "
           f"continuing with start=run.next_start; {r0.get('backend', '?')} backend, the arrays stay in place "
           f"between calls)", "",
           "| variant | µs per step (whole run) | µs per call | total ms | ratio to one call |",
           "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | error | | | |")
            continue
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ""
        out.append(f"| {r['variant']} | {r['us_per_step']:.3g} | {r['us_per_call']:.4g} | {r['call_s'] * 1e3:.4g} "
                   f"| {ratio} |")
    return out


def memory_lines(rows):
    """The heat_grad_memory rows: temporaries of the compiled gradient, in field states."""
    lines = ["## heat_grad_memory (temporary buffers of the compiled gradient, in field states)", "",
             "| variant | n | steps N | states | bytes |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['n']} | {r['steps']} | error | |")
        else:
            lines.append(f"| {r['variant']} | {r['n']} | {r['steps']} | {r['states']:.1f} | {r['temp_bytes']} |")
    return lines


TABLES = {"call_overhead": call_overhead_lines, "chunked_calls": chunked_calls_lines,
          "heat_grad_memory": memory_lines}


def write_outputs(results, meta, outdir: Path):
    outdir.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['device']}-{meta['date']}"
    (outdir / f"{stem}.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# loopkern bench: {meta['device']}, {meta['date']}", "",
             f"µs per step, median of {meta['reps']} calls after a warm-up, the variants of a size timed in "
             f"interleaved rounds (JAX rows: from the call to its results ready, a loop's step count read "
             f"after the timing); (ratio) = variant time / "
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
        if wl in TABLES:
            lines += TABLES[wl](rows) + [""]
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
        wls = [w for w in dict.fromkeys(r["workload"] for r in results)
               if any("us_per_step" in r for r in results if r["workload"] == w)]
        fig, axes = plt.subplots(1, len(wls), figsize=(5.5 * len(wls), 4.5), squeeze=False)
        for ax, wl in zip(axes[0], wls):
            rows = [r for r in results if r["workload"] == wl and "us_per_step" in r]
            if wl == "call_overhead":       # one size: a bar per variant
                ax.barh([r["variant"] for r in rows][::-1], [r["us_per_step"] for r in rows][::-1])
                ax.set(xscale="log", xlabel="host µs per call (one step)", title=wl)
                ax.tick_params(axis="y", labelsize=6)
                ax.grid(True, which="both", axis="x", alpha=0.3)
                continue
            if wl == "chunked_calls":       # one size: against the number of calls
                ax.plot([r["calls"] for r in rows], [r["us_per_step"] for r in rows], marker="o")
                ax.set(xscale="log", yscale="log", xlabel="calls (same steps in all)", ylabel="µs per step",
                       title=f"{wl}, n={rows[0]['n'] if rows else ''}")
                ax.grid(True, which="both", alpha=0.3)
                continue
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


def run_cmdbuf_subprocess(args, script=BENCH_SCRIPT) -> list[dict]:
    """The JAX variants again, in a child process with XLA's WHILE command buffers on."""
    out = Path(tempfile.mkdtemp()) / "cmdbuf.json"
    wl = ",".join(w for w in args.workloads.split(",") if w in ("heat", "jacobi"))
    if not wl:
        return []
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + CMDBUF_FLAGS).strip())
    cmd = [sys.executable, str(script), "--jax-only", "--workloads", wl, "--reps", str(args.reps), "--json", str(out)]
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

