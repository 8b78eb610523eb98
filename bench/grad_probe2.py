"""jax.grad through kernel.jax (heat 64K f32, 1000 steps) under a profiler: run under
``nsys profile`` to see each kernel and copy on the GPU timeline."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.heat import ALPHA, heat_kernel  # noqa: E402

n, steps = 65536, int(sys.argv[1]) if len(sys.argv) > 1 else 1000
k = heat_kernel()
u = jnp.asarray(np.random.default_rng(0).random(n).astype(np.float32))
w = jnp.asarray(np.random.default_rng(1).standard_normal(n).astype(np.float32))
g = jax.jit(jax.grad(lambda u: jnp.sum(k.jax(u, u, ALPHA, steps=steps)[0] * w)))
for _ in range(3):
    jax.block_until_ready(g(u))
