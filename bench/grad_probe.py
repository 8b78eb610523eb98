"""Where the time of jax.grad through kernel.jax goes (heat 64K f32): the recorder and the
segment adjoint kernels timed alone (at their own and at fixed block counts), their launch
configurations, the whole gradient at several step counts, and what XLA's compiled program
contains (custom calls, copies, memsets).

    python bench/grad_probe.py
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.heat import ALPHA, heat_kernel  # noqa: E402
from loopkern.interop.jax_bridge import _segment_kernels, call_cache  # noqa: E402


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
rec, seg, _, _ = _segment_kernels(k, ["u", "v"], ["u", "v"], {"u": 1, "v": 1})
u = jnp.asarray(np.random.default_rng(0).random(n).astype(np.float32))
st = jnp.zeros((L, n), jnp.float32)
f_rec = jax.jit(lambda u, v, a, b: rec.jax(u, v, ALPHA, a, b, 0, steps=L, start=0))
print(f"recorder, {L} steps: {timed(f_rec, u, u, st, st) * 1e6 / L:.2f} us/step")
for key, entry in call_cache(rec)._entries.items():
    print("  recorder config", entry.config)
f_seg = jax.jit(lambda us, ub, vs, vb: seg.jax(us, ub, vs, vb, ALPHA, L - 1, 0, steps=L, start=0))
print(f"segment adjoint, {L} steps: {timed(f_seg, st, u, st, u) * 1e6 / L:.2f} us/step")
for key, entry in call_cache(seg)._entries.items():
    print("  segment config", entry.config)
# the same two kernels at fixed block counts: does the grid's size set their cost?
for blocks in (132, 264, 528):
    f_rec_b = jax.jit(lambda u, v, a, b, B=blocks: rec.jax(u, v, ALPHA, a, b, 0, steps=L, start=0, blocks=B))
    f_seg_b = jax.jit(lambda us, ub, vs, vb, B=blocks: seg.jax(us, ub, vs, vb, ALPHA, L - 1, 0, steps=L, start=0,
                                                                blocks=B))
    print(f"blocks={blocks}: recorder {timed(f_rec_b, u, u, st, st) * 1e6 / L:.2f} us/step, "
          f"segment adjoint {timed(f_seg_b, st, u, st, u) * 1e6 / L:.2f} us/step")
f_fwd = jax.jit(lambda u: k.jax(u, u, ALPHA, steps=L)[0])
print(f"forward, {L} steps: {timed(f_fwd, u) * 1e6 / L:.2f} us/step")
for key, entry in call_cache(k)._entries.items():
    print("  forward config", entry.config)
w = jnp.asarray(np.random.default_rng(1).standard_normal(n).astype(np.float32))
for steps in (100, 1000, 10000):
    g = jax.jit(jax.grad(lambda u: jnp.sum(k.jax(u, u, ALPHA, steps=steps)[0] * w)))
    print(f"grad, {steps} steps: {timed(g, u, reps=3) * 1e6 / steps:.2f} us/step")
    if steps == 1000:
        text = g.lower(u).compile().as_text()
        for op in ("custom-call(", "copy(", "broadcast(", "fusion(", "dynamic-update-slice", "while("):
            print(f"  compiled program: {text.count(op)} x {op}")
        Path("/tmp/grad1000.hlo").write_text(text)
