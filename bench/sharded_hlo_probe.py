"""Which copies XLA puts around one shard's launches (bench/sharded.py's local work, P=2, on one
GPU): prints the copy instructions of the compiled program and their shapes."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

sys.path.insert(0, ".")
from bench.sharded import heat2d_step  # noqa: E402
from loopkern import sharding  # noqa: E402
from loopkern.interop.sharded import Windows, _chunk_kernel  # noqa: E402

n, k = 1024, 16
kernel = heat2d_step()
sk = kernel.sharded(jax.make_mesh((1, 1), ("x", "y"), devices=jax.devices()[:1]), P("x", "y"))
plan = sk.plan
parts = (2, 1)
halo = sharding.halo_widths(plan, k, parts)
win = Windows(plan, (n, n), halo, parts, ("x", "y"), permute=lambda x, a, p: x, index=lambda a: jnp.int32(1))
ck = _chunk_kernel(kernel, sk.parsed, plan, ())


def local(u):
    lo = win.offsets()
    bounds = [x for d in range(2) for x in (lo[d], lo[d] + n)]
    wu, wv = win.to_window(u, lo), win.to_window(u, lo)

    def body(_, c):
        a, b = c
        a, b = win.exchange(a, lo), win.exchange(b, lo)
        return tuple(ck.jax(a, b, 0.2, *bounds, steps=k))
    wu, wv = lax.fori_loop(0, 4, body, (wu, wv))
    return win.from_window(wu, lo)


u = jnp.asarray(np.random.default_rng(0).random((n, n)).astype(np.float32))
text = jax.jit(local).lower(u).compile().as_text()
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(text)     # the whole compiled program
for line in text.splitlines():
    if re.search(r"\bcopy(-start)?\(|custom-call|dynamic-update-slice|while\(", line):
        print(line.strip()[:220])
print("copies:", len(re.findall(r"= \S+ copy\(", text)))
