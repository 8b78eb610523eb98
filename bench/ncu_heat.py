"""One heat run for Nsight Compute:
``ncu --clock-control none python bench/ncu_heat.py N STEPS SCOPE [nopoll]``.

Runs the bench's heat kernel once (compile) and once more (the profiled launch) on N float32
elements, so that ``ncu --launch-skip 1 --launch-count 1`` captures a warm megakernel.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

n, steps, scope = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
control = not (len(sys.argv) > 4 and sys.argv[4] == "nopoll")   # nopoll: without the per-step poll
k = bench.heat_kernel()
u0 = np.random.default_rng(0).random(n).astype(np.float32)
u, v = bench.on_device(True, u0), bench.on_device(True, u0)
for _ in range(2):
    r = k(u, v, bench.ALPHA, steps=steps, backend="cuda", scope=scope, _control=control)
print(r)
