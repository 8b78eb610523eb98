"""What one kernel.jax launch costs beyond its steps at 16K x 16K float32 (2-D heat): the same
jitted call for 1, 2, 10 and 100 steps, inputs donated, median of 5 (bench/sharded.py saw about
3.5 ms per launch at this size). Prints seconds per call and the fit time = a + b * steps."""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from bench.sharded import heat2d_step  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
kernel = heat2d_step()
rows = []
for steps in (1, 2, 10, 100):
    f = jax.jit(lambda u, v, s=steps: kernel.jax(u, v, 0.2, steps=s), donate_argnums=(0, 1))
    u = jnp.asarray(np.random.default_rng(0).random((n, n)).astype(np.float32))
    v = u + 0
    u, v = f(u, v)
    ts = []
    for _ in range(5):
        jax.block_until_ready((u, v))
        t0 = time.perf_counter()
        u, v = f(u, v)
        jax.block_until_ready((u, v))
        ts.append(time.perf_counter() - t0)
    rows.append((steps, statistics.median(ts)))
    print(f"steps={steps}: {statistics.median(ts) * 1e3:.3f} ms per call", flush=True)
s = np.array([r[0] for r in rows], float)
t = np.array([r[1] for r in rows])
b, a = np.polyfit(s, t, 1)
print(f"fit: {a * 1e3:.3f} ms per launch + {b * 1e6:.1f} us per step")
