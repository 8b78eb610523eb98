"""Where the first lk.fori_loop call of a new process with an EMPTY cache goes (the "first
call, new process, empty cache" row of bench.py's compile workload): profiled with cProfile
from the call on, JAX's own start-up done before.

    python bench/profile_cold_call.py [top entries] [scope]
"""
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
tmp = tempfile.mkdtemp()
os.environ["LOOPKERN_CACHE_DIR"] = tmp
os.environ["NUMBA_CACHE_DIR"] = os.path.join(tmp, "numba")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import loopkern as lk  # noqa: E402

top = int(sys.argv[1]) if len(sys.argv) > 1 else 40
u = jnp.asarray(np.random.rand(4096).astype(np.float32))


def body(i, x):
    return x.at[1:-1].set(x[1:-1] + np.float32(0.25) * (x[:-2] - 2 * x[1:-1] + x[2:]))


jax.block_until_ready(u * 2)
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
out = jax.block_until_ready(lk.fori_loop(0, 100, body, u))
prof.disable()
print(f"first call, empty cache: {time.perf_counter() - t0:.3f} s")
pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
