"""Where the time of jax.grad through kernel.jax goes (heat 64K f32): the recorder and the
segment adjoint kernels timed alone (at their own and at fixed block counts), their launch
configurations, the whole gradient at several step counts, and what XLA's compiled program
contains (custom calls, copies, memsets).

    python bench/grad_probe.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.heat import ALPHA, heat_kernel  # noqa: E402
from bench.jax_timing import timed  # noqa: E402
from loopkern.interop.jax_bridge import _segment_kernels, call_cache  # noqa: E402


n, L = 65536, 1000
k = heat_kernel()
u = jnp.asarray(np.random.default_rng(0).random(n).astype(np.float32))
w = jnp.asarray(np.random.default_rng(1).standard_normal(n).astype(np.float32))
f_fwd = jax.jit(lambda u: k.jax(u, u, ALPHA, steps=L)[0])
print(f"forward, {L} steps: {timed(f_fwd, u) * 1e6 / L:.2f} us/step")
for key, entry in call_cache(k)._entries.items():
    print("  forward config", entry.config)
# the segment kernels with respect to u (nothing recorded) and to u and alpha (u recorded)
for active in (["u", "v"], ["u", "v", "alpha"]):
    rec, seg, _, recorded = _segment_kernels(k, active, ["u", "v"], {"u": 1, "v": 1})
    print(f"d/d {active}: recorded {recorded}")
    st = jnp.zeros((L, n), jnp.float32)
    stacks = [st] * len(recorded)
    if recorded:
        f_rec = jax.jit(lambda u, *S: rec.jax(u, u, ALPHA, *S, 0, steps=L, start=0))
        print(f"  recorder, {L} steps: {timed(f_rec, u, *stacks) * 1e6 / L:.2f} us/step")
    ab = jnp.zeros((1,), jnp.float32)
    if "alpha" in active:
        f_seg = jax.jit(lambda us, ub, vb: seg.jax(us, ub, u, vb, ALPHA, ab, L - 1, 0, steps=L, start=0))
    else:
        f_seg = jax.jit(lambda us, ub, vb: seg.jax(u, ub, u, vb, ALPHA, L - 1, 0, steps=L, start=0))
    print(f"  segment adjoint, {L} steps: {timed(f_seg, st, u, u) * 1e6 / L:.2f} us/step")
    for key, entry in call_cache(seg)._entries.items():
        print("  segment config", entry.config)
for steps in (1000, 10000):
    g = jax.jit(jax.grad(lambda u: jnp.sum(k.jax(u, u, ALPHA, steps=steps)[0] * w)))
    print(f"grad d/du, {steps} steps: {timed(g, u, reps=3) * 1e6 / steps:.2f} us/step")
    g2 = jax.jit(jax.grad(lambda u, a: jnp.sum(k.jax(u, u, a, steps=steps)[0] * w), argnums=(0, 1)))
    print(f"grad d/du,dalpha, {steps} steps: {timed(g2, u, jnp.float32(ALPHA), reps=3) * 1e6 / steps:.2f} us/step")
    if steps == 1000:
        text = g2.lower(u, jnp.float32(ALPHA)).compile().as_text()
        for op in ("custom-call(", "copy(", "broadcast(", "fusion(", "dynamic-update-slice", "while("):
            print(f"  compiled program (d/du,dalpha): {text.count(op)} x {op}")
