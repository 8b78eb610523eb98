"""Device memory of jax.grad through kernel.jax against jax.grad of lax.scan (heat, f32): the
temporary buffers XLA's buffer assignment gives the compiled gradient (``memory_analysis()`` of
the jitted function), in states of the field, at several step counts. Runs on any JAX backend.

    python bench/grad_memory.py [n]
"""
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.heat import ALPHA, heat_kernel, jax_heat_step  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
k = heat_kernel()
u = jnp.asarray(np.random.default_rng(0).random(n).astype(np.float32))
w = jnp.asarray(np.random.default_rng(1).standard_normal(n).astype(np.float32))
state = 4 * n
print(f"backend {jax.default_backend()}, n={n}: temporary buffers of the compiled gradient, in states of {state} bytes")
for steps in (100, 1000, 10000):
    g = jax.jit(jax.grad(lambda u: jnp.sum(k.jax(u, u, ALPHA, steps=steps)[0] * w)))
    m = g.lower(u).compile().memory_analysis()

    def scan_loss(u, steps=steps):
        x, _ = jax.lax.scan(lambda x, _: (jax_heat_step(x), None), u, None, length=steps)
        return jnp.sum(x * w)

    def scan_loss_nonlinear(u, steps=steps):    # a step whose derivative needs its input: lax stores N states
        x, _ = jax.lax.scan(lambda x, _: (jax_heat_step(x) - 1e-3 * x * x, None), u, None, length=steps)
        return jnp.sum(x * w)
    ms = jax.jit(jax.grad(scan_loss)).lower(u).compile().memory_analysis()
    mn = jax.jit(jax.grad(scan_loss_nonlinear)).lower(u).compile().memory_analysis()
    print(f"N={steps}: loopkern {m.temp_size_in_bytes / state:.1f} (2 sqrt(N) = {2 * math.sqrt(steps):.1f}; "
          f"two arrays u, v: 4 sqrt(N) = {4 * math.sqrt(steps):.1f}); lax.scan of the linear heat step "
          f"{ms.temp_size_in_bytes / state:.1f}; lax.scan of a nonlinear step {mn.temp_size_in_bytes / state:.1f}")
