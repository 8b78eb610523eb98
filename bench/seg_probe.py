"""The segment adjoint kernel of heat 64K (10 steps) timed alone with different inputs: which
input makes it slow inside jax.grad (ncu: 1.17 ms per 10-step call there)."""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.heat import ALPHA, heat_kernel  # noqa: E402
from loopkern.interop.jax_bridge import _segment_kernels  # noqa: E402

k = heat_kernel()
rec, seg, _, _ = _segment_kernels(k, ["u", "v"], ["u", "v"], {"u": 1, "v": 1})
n, L = 65536, 10


def med(f, reps=7):
    jax.block_until_ready(f())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f())
        ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e6


rng = np.random.default_rng(0)
normal = jnp.asarray(rng.standard_normal(n).astype(np.float32))
unif = jnp.asarray(rng.random(n).astype(np.float32))
zeros = jnp.zeros(n, jnp.float32)
st = jnp.zeros((L, n), jnp.float32)
f = jax.jit(lambda a, b, c, d, top, base: seg.jax(a, b, c, d, ALPHA, top, base, steps=L, start=0))
for name, ub, vb in (("uniform, uniform", unif, unif), ("normal, zeros", normal, zeros),
                     ("zeros, normal", zeros, normal), ("zeros, zeros", zeros, zeros)):
    for top, base in ((L - 1, 0), (L - 1, 90)):
        print(f"seg {name} top={top} base={base}: {med(lambda: f(st, ub, st, vb, top, base)):.1f} us")
g = jax.jit(lambda ub, vb: seg.jax(st, ub, st, vb, ALPHA, L - 1, 0, steps=L, start=0)[1])
print(f"seg normal/zeros, states constant: {med(lambda: g(normal, zeros)):.1f} us")
