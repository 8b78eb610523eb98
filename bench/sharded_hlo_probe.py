"""Which copies XLA puts around one shard's launches (bench/sharded.py's local work, P=2, on one
GPU): prints the copy instructions of the compiled program and their shapes."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, ".")
from bench.sharded import heat2d_step, shard_work  # noqa: E402

n, k = 1024, 16
kernel = heat2d_step()
sk = kernel.sharded(jax.make_mesh((1, 1), ("x", "y"), devices=jax.devices()[:1]), P("x", "y"))
local = shard_work(kernel, sk, n, (2, 1), k, 4, 0.2)


u = jnp.asarray(np.random.default_rng(0).random((n, n)).astype(np.float32))
text = jax.jit(local).lower(u).compile().as_text()
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(text)     # the whole compiled program
for line in text.splitlines():
    if re.search(r"\bcopy(-start)?\(|custom-call|dynamic-update-slice|while\(", line):
        print(line.strip()[:220])
print("copies:", len(re.findall(r"= \S+ copy\(", text)))
