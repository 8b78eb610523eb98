"""Where the first lk.fori_loop call of a new process goes (the compile row of bench.py's
jaxloops workload): one child process fills a fresh cache, a second one is profiled with
cProfile from the call on (JAX's own start-up done before, as in the bench row). Each child
then profiles a second, different body (its kernel compiled in a process that has compiled
one; the shim built or loaded by then).

    python bench/profile_jaxloops_first_call.py [top entries]
"""
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
CHILD = textwrap.dedent("""
    import cProfile, pstats, sys, time
    sys.path.insert(0, {here!r})
    import numpy as np, jax, jax.numpy as jnp, loopkern as lk
    u = jnp.asarray(np.random.rand(4096).astype(np.float32))

    def body(i, x):
        return x.at[1:-1].set(x[1:-1] + np.float32(0.25) * (x[:-2] - 2 * x[1:-1] + x[2:]))

    def other(i, x):
        return x.at[1:-1].set(np.float32(0.5) * (x[:-2] + x[2:]) - np.float32(0.01) * x[1:-1])

    def profiled(what, fn):
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        jax.block_until_ready(lk.fori_loop(0, 10, fn, u, fallback="error"))
        prof.disable()
        print(f"{{what}}: {{time.perf_counter() - t0:.3f}} s ({label})")
        if {show}:
            pstats.Stats(prof).sort_stats("cumulative").print_stats({top})
            pstats.Stats(prof).sort_stats("tottime").print_stats({top} // 2)
    jax.block_until_ready(u * 2)
    if jax.default_backend() == "gpu":
        from loopkern.interop import xla_ffi
        xla_ffi.build_shim()       # as bench.py's compile row: the shim's build is its own row
    profiled("first call", body)
    profiled("second body", other)
""")
top = int(sys.argv[1]) if len(sys.argv) > 1 else 45
with tempfile.TemporaryDirectory() as cache:
    env = dict(os.environ, LOOPKERN_CACHE_DIR=cache, NUMBA_CACHE_DIR=cache)
    for label, show in (("empty cache", True), ("cache on disk", True)):
        p = subprocess.run([sys.executable, "-c", CHILD.format(here=str(HERE), label=label, show=show, top=top)],
                           env=env, capture_output=True, text=True, timeout=600)
        print(p.stdout, p.stderr[-2000:] if p.returncode else "", flush=True)
