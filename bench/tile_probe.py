"""Time the bench's heat and Jacobi kernels over scopes, block and thread counts (tuning
scope="tile" and scope="cluster"): ``python bench/tile_probe.py [heat:N[,N...]]
[heat2d:SIDE[,SIDE...]] [jacobi:SIDE[,SIDE...]] [life:SIDE[,SIDE...]] [threads=T,T] [blocks=B,B]
[scope=tile,cluster] [depth=D,D] [span=S] [fuse=1,0]``.

Jacobi runs a fixed number of steps (its tolerance is -1, so the condition never stops it)
and reduces its update every step, as the bench's Jacobi does.

``depth`` caps the steps tile mode runs per halo exchange (``config.TILE_DEPTH_MAX``; 1: one
step per exchange), ``span`` sets ``config.TILE_DEPTH_SPAN`` and ``TILE_DEPTH_SPAN_ROWS`` (how
many widened halos a tile of cells or of rows must be long). ``fuse=1,0`` runs each tile
configuration with a step that ends in a reduction publishing its edge cells before it (one
grid barrier per step, ``codegen.FUSE_EXCHANGE_WITH_REDUCTION``) and without (two), alternately.

Each configuration runs once to compile, then five times; prints the median µs per step and
whether the field equals the grid scope's bit for bit after the same steps.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.heat import ALPHA, heat_kernel  # noqa: E402
from bench.heat2d import ALPHA2, heat2d_kernel  # noqa: E402
from bench.jacobi import jacobi_kernel, jacobi_problem  # noqa: E402
from bench.life import life_kernel  # noqa: E402
from numba import cuda  # noqa: E402

from loopkern import codegen  # noqa: E402
from loopkern.dispatch import config  # noqa: E402

opts = dict(a.split(":", 1) if ":" in a else a.split("=", 1) for a in sys.argv[1:])
threads_list = [None if x == "auto" else int(x) for x in opts.get("threads", "256,512,1024").split(",")]
blocks_list = [None if x == "auto" else int(x) for x in opts.get("blocks", "auto,132,264").split(",")]
scopes = opts.get("scope", "tile").split(",")
depths = [int(x) for x in opts.get("depth", str(config.TILE_DEPTH_MAX)).split(",")]
fuses = [bool(int(x)) for x in opts.get("fuse", "1").split(",")]
if "span" in opts:
    config.TILE_DEPTH_SPAN = config.TILE_DEPTH_SPAN_ROWS = int(opts["span"])


def timed(k, u0, alpha, steps, scope, blocks, threads):
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    scalars = () if alpha is None else (alpha,)     # (Life has none)
    r = k(u, v, *scalars, steps=steps, backend="cuda", scope=scope, blocks=blocks, threads=threads)
    out = u.copy_to_host()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        k(u, v, *scalars, steps=steps, backend="cuda", scope=scope, blocks=blocks, threads=threads)
        times.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(times), out, r


def probe(name, make, u0, alpha, steps):
    base, ref, r = timed(make(), u0, alpha, steps, "grid", None, None)
    print(f"{name} grid auto: {base:.3f} us/step (blocks={r.blocks} threads={r.threads})", flush=True)
    for depth in depths:
        config.TILE_DEPTH_MAX = depth
        # new kernels: plans are kept per kernel, and depend on the cap and the fusion
        kernels = {}
        for fuse in fuses:
            codegen.FUSE_EXCHANGE_WITH_REDUCTION = fuse
            kernels[fuse] = make()
        for scope in scopes:
            for threads in threads_list:
                for blocks in blocks_list:
                    for fuse in fuses:
                        codegen.FUSE_EXCHANGE_WITH_REDUCTION = fuse
                        try:
                            us, out, r = timed(kernels[fuse], u0, alpha, steps, scope, blocks, threads)
                        except Exception as exc:                      # a configuration that does not fit
                            print(f"{name} {scope} blocks={blocks} threads={threads}: {type(exc).__name__}: "
                                  f"{str(exc)[:150]}")
                            continue
                        same = "bitwise equal" if np.array_equal(out, ref) else "DIFFERS from grid"
                        print(f"{name} {scope} ({r.scope}) blocks={r.blocks} threads={r.threads} "
                              f"depth={r.steps_per_exchange}{' fused' if fuse and len(fuses) > 1 else ''}"
                              f"{' unfused' if not fuse else ''}: "
                              f"{us:.3f} us/step ({us / base:.2f}x grid), {same}", flush=True)
        codegen.FUSE_EXCHANGE_WITH_REDUCTION = True


rng = np.random.default_rng(0)
for n in [int(x) for x in opts.get("heat", "").split(",") if x]:
    probe(f"heat n={n}", heat_kernel, rng.random(n).astype(np.float32), ALPHA, 20000 if n <= 65536 else 4000)
for side in [int(x) for x in opts.get("heat2d", "").split(",") if x]:
    probe(f"heat2d {side}^2", heat2d_kernel, rng.random((side, side)).astype(np.float32), ALPHA2, 2000)
for side in [int(x) for x in opts.get("jacobi", "").split(",") if x]:
    probe(f"jacobi {side}^2", jacobi_kernel, jacobi_problem(side, rng), np.float32(-1.0), 2000)
for side in [int(x) for x in opts.get("life", "").split(",") if x]:
    probe(f"life {side}^2", life_kernel, (rng.random((side, side)) < 0.3).astype(np.int32), None, 2000)
