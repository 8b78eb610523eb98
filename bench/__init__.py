"""The workloads and the harness of bench.py (run ``python bench.py --help``; its docstring
describes the method).

    harness.py    Impl, Case, Bench (check, then time), plumbing, output files, the
                  command-buffer subprocess, the report of wrong results
    variants.py   variants shared by the workloads (loopkern in each scope, kernel.jax in
                  jax.jit, jitted JAX loops)
    heat.py, heat2d.py, jacobi.py, life.py, nbody.py, quadratic.py, grad.py   one workload each
    jaxloops.py   lk.fori_loop / while_loop / scan of jnp bodies against @megakernel and jax.lax
    sharded.py    kernel.sharded: one shard's work on one device and the weak-scaling model
    calls.py      the host cost of one call, and one run split into 1..1000 calls
    control.py    progress, cancellation, lk.random
    compile.py    compile time in fresh processes

The scripts next to them (ncu_heat.py, profile_call.py, profile_first_call.py) and the compile
measurement's child processes use ``bench.heat_kernel``, ``bench.on_device``, ``bench.ALPHA``,
``bench.heat_ref`` and ``bench.rel_err`` from here.
"""

from .harness import (
    BENCH_SCRIPT, CMDBUF_FLAGS, ROOT, Bench, Case, Impl, device_name, gpu_available, have, on_device,
    rel_err, report_wrong_results, run_cmdbuf_subprocess, to_host, write_outputs, wrong_result,
)
from .heat import ALPHA, bench_heat, heat_exact, heat_kernel, heat_ref, jax_heat_step
from .heat2d import bench_heat2d
from .jacobi import bench_jacobi
from .life import bench_life
from .nbody import bench_nbody
from .quadratic import bench_quadratic
from .calls import bench_calls
from .control import bench_control
from .compile import bench_compile
from .grad import bench_grad
from .jaxloops import bench_jaxloops
from .sharded import bench_sharded

#: --workloads names, in the default order; "overhead" is the old name of "calls"
WORKLOADS = {"heat": bench_heat, "heat2d": bench_heat2d, "jacobi": bench_jacobi, "life": bench_life, "nbody": bench_nbody,
             "quadratic": bench_quadratic, "calls": bench_calls, "control": bench_control,
             "compile": bench_compile, "grad": bench_grad, "jaxloops": bench_jaxloops,
             "sharded": bench_sharded}
ALIASES = {"overhead": "calls"}
DEFAULT_WORKLOADS = ",".join(WORKLOADS)

__all__ = [
    "ALIASES", "ALPHA", "BENCH_SCRIPT", "CMDBUF_FLAGS", "DEFAULT_WORKLOADS", "ROOT", "WORKLOADS", "Bench", "Case",
    "Impl", "bench_calls", "bench_compile", "bench_control", "bench_grad", "bench_heat", "bench_heat2d", "bench_jacobi", "bench_jaxloops", "bench_life",
    "bench_nbody", "bench_quadratic", "bench_sharded", "device_name", "gpu_available", "have", "heat_exact", "heat_kernel",
    "heat_ref", "jax_heat_step", "on_device", "rel_err", "report_wrong_results", "run_cmdbuf_subprocess",
    "to_host", "write_outputs", "wrong_result",
]
