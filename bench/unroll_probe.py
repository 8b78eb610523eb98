"""A/B of the unrolled loop's forms (issue 12's Jacobi 256² miss): with and without
``codegen.HOIST_LOADS`` (loads of arrays the body never writes issued before its stores: a
Jacobi step's ``u[i, j]``, read after ``v[i, j] = new``, no longer waits for the store) and
``codegen.TAIL_PAIR`` (a two-copy loop after the four-copy one: a thread with two or three
indices left loads two at once).

    python bench/unroll_probe.py [jacobi:SIDE,..] [heat:N,..] [heat2d:SIDE,..] [life:SIDE,..]
                                 [scope=grid,auto] [variants=old,hoist,tail,both] [rounds=7] [steps=N]

Each variant gets its own kernel (plans are kept per kernel; the knobs apply when a plan's
kernel is rendered); the variants' calls alternate, ``rounds`` times, and the medians (µs per
step) are printed with each variant's ratio to the old form (both off), and whether its field
equals the old form's bit for bit after the same steps (the loads read the same values, so
it must).
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

opts = dict(a.split(":", 1) if ":" in a else a.split("=", 1) for a in sys.argv[1:])
scopes = opts.get("scope", "grid").split(",")
rounds = int(opts.get("rounds", "7"))
STEPS = int(opts["steps"]) if "steps" in opts else None       # (a smoke test under the simulator)
ALL = {"old": (False, False), "hoist": (False, True), "tail": (True, False), "both": (True, True)}
VARIANTS = {v: ALL[v] for v in ["old"] + [v for v in opts.get("variants", "hoist,tail,both").split(",") if v != "old"]}


def probe(name, make, u0, scalars, steps):
    steps = STEPS or steps
    for scope in scopes:
        kernels = {}
        for label, (tail, hoist) in VARIANTS.items():
            codegen.TAIL_PAIR, codegen.HOIST_LOADS = tail, hoist
            k = make()
            u, v = cuda.to_device(u0), cuda.to_device(u0)
            r = k(u, v, *scalars, steps=steps, backend="cuda", scope=scope)      # compiles
            kernels[label] = (k, u, v, u.copy_to_host(), r)
        codegen.TAIL_PAIR = codegen.HOIST_LOADS = True
        times = {label: [] for label in VARIANTS}
        for _ in range(rounds):
            for label, (k, u, v, _, _) in kernels.items():
                cuda.synchronize()
                t0 = time.perf_counter()
                k(u, v, *scalars, steps=steps, backend="cuda", scope=scope)
                times[label].append((time.perf_counter() - t0) / steps * 1e6)
        base = statistics.median(times["old"])
        ref = kernels["old"][3]
        for label, (k, u, v, first, r) in kernels.items():
            us = statistics.median(times[label])
            same = "bitwise equal" if np.array_equal(first, ref) else "DIFFERS from old"
            print(f"{name} scope={scope} ({r.scope}, {r.blocks}x{r.threads}) {label}: {us:.3f} us/step "
                  f"({us / base:.3f}x old), {same}", flush=True)


rng = np.random.default_rng(0)
for side in [int(x) for x in opts.get("jacobi", "").split(",") if x]:
    probe(f"jacobi {side}^2", jacobi_kernel, jacobi_problem(side, rng), (np.float32(-1.0),), 2000)
for n in [int(x) for x in opts.get("heat", "").split(",") if x]:
    probe(f"heat n={n}", heat_kernel, rng.random(n).astype(np.float32), (ALPHA,), 20000 if n <= 65536 else 4000)
for side in [int(x) for x in opts.get("heat2d", "").split(",") if x]:
    probe(f"heat2d {side}^2", heat2d_kernel, rng.random((side, side)).astype(np.float32), (ALPHA2,), 2000)
for side in [int(x) for x in opts.get("life", "").split(",") if x]:
    probe(f"life {side}^2", life_kernel, (rng.random((side, side)) < 0.3).astype(np.int32), (), 2000)
