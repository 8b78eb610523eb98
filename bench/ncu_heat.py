"""One heat (or Life, or Jacobi) run for Nsight Compute:
``ncu --clock-control none python bench/ncu_heat.py N STEPS SCOPE [nopoll] [blocks=B] [threads=T] [bits=numba|64|32] [time=1]``
(``N``: elements of 1-D heat, or ``ROWSxCOLS`` for 2-D heat, ``lifeSIDE`` for the bench's Game
of Life on SIDE x SIDE int32 cells, ``jacobiSIDE`` for its Jacobi step on SIDE x SIDE float32
cells with the tolerance -1, so that every step reduces its update and none stops the run,
``jaxjacobiSIDE`` for that step through kernel.jax inside jax.jit)
(``bits``: force the element-access lowering, see ``codegen.render_kernel``'s ``index_bits``).

Runs the bench's heat kernel once (compile) and once more (the profiled launch) on N float32
elements, so that ``ncu --launch-skip 1 --launch-count 1`` captures a warm megakernel.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

steps, scope = int(sys.argv[2]), sys.argv[3]
extra = sys.argv[4:]
control = "nopoll" not in extra                # nopoll: without the per-step poll
opts = dict(a.split("=", 1) for a in extra if "=" in a)
blocks = int(opts["blocks"]) if "blocks" in opts else None
threads = int(opts["threads"]) if "threads" in opts else None
if "bits" in opts:
    # element-access lowering forced for this measurement (index_bits of codegen.render_kernel)
    from loopkern.dispatch import dispatcher
    forced = None if opts["bits"] == "numba" else int(opts["bits"])
    dispatcher.index_bits_for = lambda sizes, debug, staged: forced
what = sys.argv[1]
if what.startswith("jaxjacobi"):
    # the same Jacobi step through kernel.jax inside jax.jit (the custom call's launch)
    import jax
    import jax.numpy as jnp

    from bench.jacobi import jacobi_kernel, jacobi_problem
    k = jacobi_kernel()
    u0 = jacobi_problem(int(what[9:]), np.random.default_rng(0))
    f = jax.jit(lambda u, v: k.jax(u, v, np.float32(-1.0), steps=steps, scope=scope, blocks=blocks,
                                   threads=threads))
    ju, jv = jnp.asarray(u0), jnp.asarray(u0)
    call = lambda: jax.block_until_ready(f(ju, jv))  # noqa: E731
elif what.startswith("life"):
    from bench.life import life_kernel
    side = int(what[4:])
    k = life_kernel()
    a0 = (np.random.default_rng(0).random((side, side)) < 0.3).astype(np.int32)
    a, b = bench.on_device(True, a0), bench.on_device(True, a0)
    call = lambda: k(a, b, steps=steps, backend="cuda", scope=scope, blocks=blocks, threads=threads,  # noqa: E731
                     _control=control)
elif what.startswith("jacobi"):
    from bench.jacobi import jacobi_kernel, jacobi_problem
    k = jacobi_kernel()
    u0 = jacobi_problem(int(what[6:]), np.random.default_rng(0))
    u, v = bench.on_device(True, u0), bench.on_device(True, u0)
    call = lambda: k(u, v, np.float32(-1.0), steps=steps, backend="cuda", scope=scope, blocks=blocks,  # noqa: E731
                     threads=threads, _control=control)
elif "x" in what:
    # a 2-D field: N is ROWSxCOLS (bench/heat2d.py's kernel)
    from bench.heat2d import ALPHA2 as alpha
    from bench.heat2d import heat2d_kernel
    shape = tuple(int(x) for x in sys.argv[1].split("x"))
    k = heat2d_kernel()
else:
    shape, k, alpha = (int(what),), bench.heat_kernel(), bench.ALPHA
if not what.startswith(("life", "jacobi", "jaxjacobi")):
    u0 = np.random.default_rng(0).random(shape).astype(np.float32)
    u, v = bench.on_device(True, u0), bench.on_device(True, u0)
    call = lambda: k(u, v, alpha, steps=steps, backend="cuda", scope=scope, blocks=blocks,  # noqa: E731
                     threads=threads, _control=control)
for _ in range(2):
    r = call()
print(r)
if opts.get("time") == "1":
    # outside ncu: the median µs per step of five more runs of this kernel
    import statistics
    import time
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) / steps * 1e6)
    shown = f"blocks={getattr(r, 'blocks', blocks)} threads={getattr(r, 'threads', threads)}"
    print(f"n={sys.argv[1]} scope={scope} {shown} bits={opts.get('bits', 'auto')}: "
          f"{statistics.median(times):.3f} us/step (median of 5 runs of {steps} steps)")
