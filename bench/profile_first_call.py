"""Where the first call of a new process goes when the kernel is in the disk cache.

    python bench/profile_first_call.py [--backend cuda|cpu]

Runs the bench's heat kernel once in a child process (to fill a fresh cache), then profiles the
first call of a second child process with cProfile (the CUDA context is created before it, as
in bench.py's compile row) and prints the top entries by cumulative time.
"""
import argparse
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
    import numpy as np, loopkern as lk, bench
    k = bench.heat_kernel()
    u = np.random.rand(4096).astype(np.float32); v = u.copy()
    if {backend!r} == "cuda":
        from numba import cuda
        cuda.current_context()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    k(u, v, np.float32(0.25), steps=10, backend={backend!r})
    prof.disable()
    print(f"first call: {{time.perf_counter() - t0:.3f}} s")
    if {show}:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
""")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cuda")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, LOOPKERN_CACHE_DIR=cache, NUMBA_CACHE_DIR=cache)
        for show in (False, True):
            src = CHILD.format(here=str(HERE), backend=args.backend, show=show)
            out = subprocess.run([sys.executable, "-c", src], env=env, capture_output=True, text=True)
            print(out.stdout[-12000:], out.stderr[-2000:], sep="\n")


if __name__ == "__main__":
    main()
