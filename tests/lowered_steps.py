"""Run a jnp loop body as the step loopkern lowers it (``loopkern.jaxloops``), directly through
its MegaKernel on NumPy arrays: the simulator and GPU tests of the drop-in loops' lowering."""

import jax
import numpy as np

from loopkern.jaxloops import loops


def lowered(body, carry):
    """The MegaKernel of ``body(i, carry)`` (a single array carry), its plan and program."""
    traced = loops._trace_body(lambda i, x: [body(i, x)], [loops._aval(carry)],
                               lead=(jax.ShapeDtypeStruct((), np.int32),))
    prog = loops.flatten(traced[0])
    plan = loops._lower(prog, [("index",), ("carry", 0)], {0: 0}, {0: 1})
    return loops._kernel(plan), plan, prog


def run_lowered(body, carry, steps, backend, threads=64, blocks=1, **kw):
    """Run the lowered step ``steps`` times on NumPy arrays (loop index from 0): the new carry,
    the plan and the Run. The arguments follow the plan's parameters (a body that never reads its index
    takes none). ``kw``: more options of the call (``scope=``)."""
    mk, plan, prog = lowered(body, carry)
    args, first = [], None
    for name, role, k in plan.params:
        if role in ("carry", "carry_next"):
            args.append(np.array(carry, copy=True))
            first = args[-1] if role == "carry" else first
        elif role == "lo":
            args.append(np.int32(0))
        elif role == "scratch":
            shape, dtype = k
            args.append(np.full(shape, 77, dtype))       # never read before it is written
        elif role == "const":         # an array the body closed over
            args.append(np.asarray(prog.consts[k][1]))
        else:
            raise AssertionError(role)
    run = mk(*args, steps=steps, backend=backend, threads=threads, blocks=blocks, **kw)
    assert run.steps == steps and run.scope == kw.get("scope", run.scope), run
    return first, plan, run
