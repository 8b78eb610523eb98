"""A/B of how a 2-D tile's halo rows are read after the grid barrier (session 30): every load
of a pass over the columns issued before the first store (``_TileText.fetch``, the default)
against one row and column at a time (``_TileText.cells``, as before). Both kernels in one
process, each with its own buffers, timed in interleaved rounds; each checked bit for bit
against the grid scope after the same steps.

    python bench/halo_fetch_probe.py [rounds]
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.heat2d import ALPHA2, heat2d_kernel  # noqa: E402
from bench.life import life_kernel  # noqa: E402
from numba import cuda  # noqa: E402

from loopkern import codegen  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
fetch = codegen._TileText.fetch


def one_at_a_time(self, depth, count, first, guard, body, prepare, moves):
    return self.cells(depth, count, first, guard, body)


def make(variant, maker):
    codegen._TileText.fetch = fetch if variant == "fetch" else one_at_a_time
    k = maker()
    return k


def run(k, u, v, scalars, steps, scope="tile"):
    return k(u, v, *scalars, steps=steps, backend="cuda", scope=scope)


rng = np.random.default_rng(0)
cases = [("heat2d 1024^2", heat2d_kernel, rng.random((1024, 1024)).astype(np.float32), (ALPHA2,)),
         ("heat2d 512^2", heat2d_kernel, rng.random((512, 512)).astype(np.float32), (ALPHA2,)),
         ("life 1024^2", life_kernel, (rng.random((1024, 1024)) < 0.3).astype(np.int32), ())]
steps = 2000
for name, maker, u0, scalars in cases:
    ref_k = maker()
    ru, rv = cuda.to_device(u0), cuda.to_device(u0)
    run(ref_k, ru, rv, scalars, steps, scope="grid")
    ref = ru.copy_to_host()
    inst = {}
    for variant in ("fetch", "one-at-a-time"):
        k = make(variant, maker)          # compiled on its first call, with the variant in place
        u, v = cuda.to_device(u0), cuda.to_device(u0)
        r = run(k, u, v, scalars, steps)
        same = "bitwise equal to grid" if np.array_equal(u.copy_to_host(), ref) else "DIFFERS from grid"
        print(f"{name} {variant}: scope={r.scope} blocks={r.blocks} threads={r.threads} "
              f"depth={r.steps_per_exchange}, {same}", flush=True)
        inst[variant] = (k, u, v, [])
    codegen._TileText.fetch = fetch
    for _ in range(rounds):
        for variant, (k, u, v, times) in inst.items():
            cuda.synchronize()
            t0 = time.perf_counter()
            run(k, u, v, scalars, steps)
            times.append((time.perf_counter() - t0) / steps * 1e6)
    for variant, (_, _, _, times) in inst.items():
        print(f"{name} {variant}: median {statistics.median(times):.3f} us/step "
              f"(min {min(times):.3f}, max {max(times):.3f}, {rounds} rounds)", flush=True)
