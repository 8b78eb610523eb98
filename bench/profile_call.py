"""Where the host time of one kernel(...) call goes (cProfile over many one-step calls).

    python bench/profile_call.py [--backend cuda|cpu]
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--backend", default="cuda")
args = p.parse_args()
k = bench.heat_kernel()
u0 = np.random.default_rng(0).random(4096).astype(np.float32)
u, v = bench.on_device(args.backend == "cuda", u0), bench.on_device(args.backend == "cuda", u0)
for _ in range(20):
    k(u, v, bench.ALPHA, steps=1, backend=args.backend)
t0 = time.perf_counter()
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    k(u, v, bench.ALPHA, steps=1, backend=args.backend)
prof.disable()
print(f"{(time.perf_counter() - t0) / 200 * 1e6:.1f} us per call (profiled)")
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
