"""Compile drop-in loop kernels and a tile-mode kernel to PTX for sm_90 on a machine without a
GPU (a stand-in device of compute capability 9.0; no cubin link, no module load): checks that
the CUDA path of the generated code types and lowers, which the CPU backend and the simulator
do not show. Needs a libnvvm: set $NVVM_SO (e.g. from ``pip download nvidia-nvvm==13.0.88``,
unzipped: nvidia/cu13/lib/libnvvm.so.4).

    NVVM_SO=/path/libnvvm.so.4 JAX_PLATFORMS=cpu python bench/ptx_compile_check.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from bench.standin import use_stand_in_device  # noqa: E402

use_stand_in_device()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from numba import types, typeof  # noqa: E402

import loopkern as lk  # noqa: E402
import workloads as W  # noqa: E402
from lowered_steps import lowered  # noqa: E402
from loopkern import codegen  # noqa: E402
from loopkern.compile import compile_kernel  # noqa: E402
from loopkern.stencil import find_stencil  # noqa: E402
from numba import cuda  # noqa: E402

#: the grid-scope kernel's arguments after the step's (reduction scratch, control words)
TAIL = (types.float64[:, ::1], types.int64[:, ::1], types.uint32[::1], types.uint64, types.int64[::1],
        types.int64[::1])
KEY = jax.random.PRNGKey(3)
ALPHA = jnp.asarray(np.linspace(0.2, 4, 1000, dtype=np.float32))


def _collatz(i, x):
    def steps(n):
        return lax.while_loop(lambda c: c[0] != 1,
                              lambda c: (jnp.where(c[0] % 2 == 0, c[0] // 2, 3 * c[0] + 1), c[1] + 1),
                              (n, jnp.int32(0)))[1]
    return x + jax.vmap(steps)(x % 100 + 1)


BODIES = {
    "uniform": (lambda i, x: x + jax.random.uniform(jax.random.fold_in(KEY, i), x.shape), np.float32),
    "truncated_normal": (lambda i, x: x + jax.random.truncated_normal(jax.random.fold_in(KEY, i), -1.0, 2.0,
                                                                      x.shape), np.float32),
    "vmapped_while": (_collatz, np.int32),
    "nextafter": (lambda i, x: lax.nextafter(x, x - 1.0), np.float32),
    "gamma": (lambda i, x: x + jax.random.gamma(jax.random.fold_in(KEY, i), ALPHA), np.float32),
}


def dropin_ptx(body, dtype) -> str:
    mk, plan, prog = lowered(body, np.zeros(1000, dtype))
    src = codegen.render_kernel(mk.spec, "cuda", "grid", cache=False)

    def param_type(p):
        _, role, k = p
        if role == "lo":
            return types.int32
        if role == "const":
            c = np.asarray(prog.consts[k][1])
            return types.Array(numba.from_dtype(c.dtype), c.ndim, "C")
        return types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C")
    sig = (types.int64, types.int64, *[param_type(p) for p in plan.params], *TAIL)
    return cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))[0]


def life_tile_ptx() -> str:
    k = lk.megakernel(W.life_tuple_step, swap=[("a", "b")])
    src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=find_stencil(k.spec), depth=1)
    a = np.zeros((4, 4), np.int32)
    sig = (types.int64, types.int64, typeof(a), typeof(a), types.int64[::1], *TAIL)
    return cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))[0]


if __name__ == "__main__":
    failed = 0
    for name, (body, dtype) in BODIES.items():
        try:
            print(f"{name}: PTX of {len(dropin_ptx(body, dtype))} characters", flush=True)
        except Exception as exc:      # report each kernel, then fail
            failed += 1
            print(f"{name}: FAILED {str(exc).splitlines()[0]}", flush=True)
    print(f"life (examples/life.py's step), tile mode: PTX of {len(life_tile_ptx())} characters")
    sys.exit(1 if failed else 0)
