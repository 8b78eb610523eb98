"""Where a drop-in loop's first kernel compile goes on a machine without a GPU: in one fresh
process, ``import`` of JAX and loopkern, then for two bodies (the 1-D heat body of bench.py's
compile row and a second, different one) tracing + lowering, rendering the kernel.jax form of
its tile-mode kernel (by reference, several steps per exchange, as ``jax_bridge`` builds it
for 4K elements on an H200), and Numba's compile of it to PTX (a stand-in device of compute
capability 9.0; no cubin link, no module load). Prints seconds per stage as JSON.

    LOOPKERN_CACHE_DIR=$(mktemp -d) NUMBA_CACHE_DIR=$LOOPKERN_CACHE_DIR python bench/cold_lowered_probe.py [--profile N]
"""
import json
import os
import sys
import time

t_start = time.perf_counter()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")]
from bench.standin import use_stand_in_device  # noqa: E402

use_stand_in_device()
import numpy as np  # noqa: E402
import jax  # noqa: E402
from numba import types  # noqa: E402

import loopkern  # noqa: E402,F401
from numba import cuda  # noqa: E402
t_import = time.perf_counter()

from lowered_steps import lowered  # noqa: E402
from loopkern import codegen  # noqa: E402
from loopkern.compile import compile_kernel  # noqa: E402
from loopkern.dispatch.config import Chip, tile_layout  # noqa: E402
from loopkern.stencil import find_stencil  # noqa: E402

H200 = Chip(132, 232448, 233472)
SCRATCH = (types.float64[:, ::1], types.int64[:, ::1], types.uint32[::1], types.uint32[::1], types.int64[::1],
           types.int64[::1])


def heat(i, x):
    return x.at[1:-1].set(x[1:-1] + np.float32(0.25) * (x[:-2] - 2 * x[1:-1] + x[2:]))


def other(i, x):
    return x.at[1:-1].set(np.float32(0.5) * (x[:-2] + x[2:]) - np.float32(0.01) * x[1:-1])


def stages(body, n=4096):
    x = np.zeros(n, np.float32)
    t0 = time.perf_counter()
    mk, plan, prog = lowered(body, x)
    t1 = time.perf_counter()
    st = find_stencil(mk.spec)
    depth, tiles = tile_layout(n, st.halo[0], 8, None, False, True, H200)
    src = codegen.render_kernel(mk.spec, "cuda", "grid", cache=False, tile=st, depth=depth, tiles=tiles,
                                by_ref=frozenset(), index_bits=None)
    d = compile_kernel(src).dispatcher
    arr = types.float32[::1]
    sig = (types.int64[::1], types.int64[::1], *[arr for _ in plan.params], *SCRATCH, arr)
    t2 = time.perf_counter()
    ptx, _ = cuda.compile_ptx(d.py_func, sig, cc=(9, 0))
    t3 = time.perf_counter()
    return dict(trace_lower_s=round(t1 - t0, 3), render_s=round(t2 - t1, 3), ptx_s=round(t3 - t2, 3),
                depth=depth, tiles=tiles, ptx_chars=len(ptx))


prof = None
if "--profile" in sys.argv:
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
out = dict(import_s=round(t_import - t_start, 3), first=stages(heat), second=stages(other))
if prof is not None:
    prof.disable()
    top = int(sys.argv[sys.argv.index("--profile") + 1])
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top // 2)
print(json.dumps(out))
