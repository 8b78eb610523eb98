"""Spike for on-chip residency (issue 12): how much a 1-D heat megakernel gains when each block
keeps its tile of both buffers in shared memory for the whole run and exchanges only its edge
cells through global memory, against the same kernel reading and writing global memory.

    python bench/residency_spike.py [N ...] [--steps S] [--blocks B] [--threads T]

Both kernels are hand-written Numba with loopkern's grid barrier (``cuda_rt.grid_sync``), one
barrier per step, the same arithmetic (float32) and the same block count, so the difference is
the memory traffic. Each result is checked against the exact solution (``bench.heat_exact``).
This measures the design before the code generator learns it; it is not part of the library.

Resident kernel, per block b owning cells [lo, hi) (T = ceil(N / B) each):
- load u[lo - 1 .. hi + 1) and v[lo .. hi) (the tile and its one-cell halo) into shared memory;
- each step: compute the tile's cells from the shared "old" tile into the shared "new" tile;
  publish the new tile's first and last cell to the global buffer of this step's parity; grid
  barrier; read the neighbours' published cells into the new tile's halo; syncthreads; swap;
- at the end, write both tiles back so that each global buffer holds what its name refers to
  (the library's rename semantics: after an odd count u holds the newest state).
"""
import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402
from numba import cuda, float32, int64  # noqa: E402

from loopkern.runtime import cuda_rt  # noqa: E402

ALPHA = float32(bench.ALPHA)


@cuda.jit
def heat_global(u, v, n, steps, bar):
    tid = cuda.grid(1)
    nt = cuda.gridsize(1)
    a, b = u, v
    for _ in range(steps):
        i = tid
        while i < n:
            if i == 0 or i == n - 1:
                b[i] = a[i]
            else:
                b[i] = a[i] + ALPHA * (a[i - 1] - float32(2.0) * a[i] + a[i + 1])
            i += nt
        cuda_rt.grid_sync(bar)
        a, b = b, a
    # the rename: after an odd count the newest state must end in u
    if steps % 2 == 1:
        i = tid
        while i < n:
            x = u[i]
            u[i] = v[i]
            v[i] = x
            i += nt


@cuda.jit
def heat_resident(u, v, gu, gv, n, steps, tile, bar):
    sh = cuda.shared.array(0, float32)
    w = tile + 2                               # the tile and one halo cell each side
    lo = cuda.blockIdx.x * tile
    hi = min(n, lo + tile)
    tx = cuda.threadIdx.x
    bt = cuda.blockDim.x
    # shared: [0, w) the tile of u, [w, 2w) the tile of v; local index k <-> cell lo - 1 + k
    k = tx
    while k < w:
        c = lo - 1 + k
        if 0 <= c < n and c < hi + 1:
            sh[k] = u[c]
            sh[w + k] = v[c]
        k += bt
    cuda.syncthreads()
    old = int64(0)
    new = int64(w)
    ga, gb = gu, gv                            # the global buffers of the two parities
    for _ in range(steps):
        c = lo + tx
        while c < hi:
            k = c - lo + 1
            if c == 0 or c == n - 1:
                sh[new + k] = sh[old + k]
            else:
                sh[new + k] = sh[old + k] + ALPHA * (sh[old + k - 1] - float32(2.0) * sh[old + k]
                                                     + sh[old + k + 1])
            c += bt
        cuda.syncthreads()
        # publish this tile's edge cells of the new state, then read the neighbours' after the barrier
        if tx == 0 and hi > lo:
            gb[lo] = sh[new + 1]
            gb[hi - 1] = sh[new + hi - lo]
        cuda_rt.grid_sync(bar)
        if tx == 0:
            if lo > 0:
                sh[new] = gb[lo - 1]
            if hi < n:
                sh[new + hi - lo + 1] = gb[hi]
        cuda.syncthreads()
        old, new = new, old
        ga, gb = gb, ga
    # write back: u gets the tile its name refers to now (old after the loop's last swap)
    c = lo + tx
    while c < hi:
        k = c - lo + 1
        u[c] = sh[old + k]
        v[c] = sh[new + k]
        c += bt


def time_it(run, steps, reps=5):
    run(steps)
    cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(steps)
        cuda.synchronize()
        ts.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sizes", nargs="*", type=int, default=[1 << 16, 1 << 20, 1 << 22])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--blocks", type=int, nargs="*", default=[132, 264, 528])
    p.add_argument("--threads", type=int, default=256)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    for n in args.sizes:
        u0 = rng.random(n).astype(np.float32)
        for blocks in args.blocks:
            tile = math.ceil(n / blocks)
            shared = 2 * (tile + 2) * 4
            results = {}
            for name in ("global", "resident"):
                if name == "resident" and shared > 48 * 1024:
                    print(f"n={n} blocks={blocks}: resident needs {shared} B of shared memory per block "
                          f"(over 48 KiB; this spike does not opt in)")
                    continue
                u, v = cuda.to_device(u0), cuda.to_device(u0)
                bar = cuda.to_device(np.zeros(2, np.uint32))
                if name == "global":
                    def run(s, u=u, v=v, bar=bar):
                        heat_global[blocks, args.threads](u, v, n, s, bar)
                else:
                    gu, gv = cuda.to_device(u0), cuda.to_device(u0)

                    def run(s, u=u, v=v, gu=gu, gv=gv, bar=bar):
                        heat_resident[blocks, args.threads, 0, shared](u, v, gu, gv, n, s, tile, bar)
                # check: 101 steps from u0 (odd: the rename) against the exact solution
                u.copy_to_device(u0)
                v.copy_to_device(u0)
                run(101)
                e = bench.rel_err(u.copy_to_host(), bench.heat_exact(u0, 101))
                ok = e < 1e-4
                us = time_it(run, args.steps)
                results[name] = us
                print(f"n={n} blocks={blocks} {name:8s}: {us:8.3f} us/step  (rel_err {e:.1e} after 101 steps"
                      f"{'' if ok else ' WRONG'})", flush=True)
            if len(results) == 2:
                print(f"n={n} blocks={blocks}: resident / global = {results['resident'] / results['global']:.2f}")


if __name__ == "__main__":
    main()
