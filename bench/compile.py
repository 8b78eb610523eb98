"""Compile time, in fresh processes: the first call with an empty cache, then with the cache on
disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

from .harness import ROOT, Bench


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
                p = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT.format(here=str(ROOT), backend=backend)],
                                   env=env, capture_output=True, text=True, check=True, timeout=300)
                row.update(json.loads(p.stdout.strip().splitlines()[-1]))
                row["check"] = f"rel_err={row['rel_err']:.2e} after {row['steps']} steps"
                if not (row["rel_err"] < 1e-5 and row["steps"] == 10):
                    row["error"] = f"wrong result: {row['check']}"
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {getattr(exc, 'stderr', exc)}"[-400:]
            b.emit(row)

