"""The recorder and segment-adjoint kernels of jax.grad (heat 64K f32, 100-step segments) at
several block counts: does the grid's size (660 and 1056 blocks by default) set their cost?

    python bench/grad_blocks_probe.py
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.heat import ALPHA, heat_kernel  # noqa: E402
from loopkern.interop.jax_bridge import _segment_kernels  # noqa: E402


def timed(f, *a, reps=5):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


n, L = 65536, 100
k = heat_kernel()
rec, seg = _segment_kernels(k, ["u", "v"], ["u", "v"], {"u": 1, "v": 1})
u = jnp.asarray(np.random.default_rng(0).random(n).astype(np.float32))
st = jnp.zeros((L, n), jnp.float32)
for blocks in (None, 132, 264, 528):
    f_rec = jax.jit(lambda u, v, a, b, B=blocks: rec.jax(u, v, ALPHA, a, b, 0, steps=L, start=0, blocks=B))
    f_seg = jax.jit(lambda us, ub, vs, vb, B=blocks: seg.jax(us, ub, vs, vb, ALPHA, L - 1, 0, steps=L, start=0,
                                                              blocks=B))
    r = timed(f_rec, u, u, st, st) * 1e6 / L
    s = timed(f_seg, st, u, st, u) * 1e6 / L
    print(f"blocks={blocks}: recorder {r:.2f} us/step, segment adjoint {s:.2f} us/step", flush=True)
