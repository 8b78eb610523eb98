"""A hang of JAX's CPU backend that limits kernel.sharded (and kernel.jax under shard_map) on
host devices: a jax.pure_callback and a lax.ppermute in a loop, inside shard_map over 4 CPU
devices, never finish once each shard holds about 40K elements or more (JAX 0.10.2, on the
2-core development machine: 10K per shard finishes, 40K hangs with XLA's "waiting for
collective permute RendezvousKey ... may be stuck"). No loopkern code is involved.

    python bench/jax_cpu_callback_hang.py 10000     # finishes
    python bench/jax_cpu_callback_hang.py 40000     # hangs (stopped after 40 s here)

kernel.jax runs a CPU kernel through jax.pure_callback, so kernel.sharded on host devices
works for small blocks only (the tests and examples/sharded_heat2d.py's default); GPUs use
the XLA FFI custom call and are not affected.
"""

import faulthandler
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def main():
    per_shard = int(sys.argv[1]) if len(sys.argv) > 1 else 40000
    faulthandler.dump_traceback_later(40, exit=True)     # report the hang instead of waiting
    mesh = jax.make_mesh((4,), ("x",))

    def host(x):
        return np.asarray(x) + 1

    def local(u):
        def body(_, u):
            u = jax.pure_callback(host, jax.ShapeDtypeStruct(u.shape, u.dtype), u)
            return u + jax.lax.ppermute(u, "x", [(i, (i + 1) % 4) for i in range(4)])
        return jax.lax.fori_loop(0, 3, body, u)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.zeros(4 * per_shard), NamedSharding(mesh, P("x")))
    print("finished:", np.asarray(f(x))[:3])


if __name__ == "__main__":
    main()
