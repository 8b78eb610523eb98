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


def run_lowered(body, carry, steps, backend, threads=64, blocks=1, split=None, **kw):
    """Run the lowered step ``steps`` times on NumPy arrays (loop index from 0): the new carry,
    the plan and the Run. The arguments follow the plan's parameters (a body that never reads its index
    takes none). ``split``: None runs the kernel the drop-in loops pick; True the step with its
    loops split into interior and rim (the plan must have split some), False the one without.
    ``kw``: more options of the call (``scope=``)."""
    mk, plan, prog = lowered(body, carry)
    if split is not None:
        assert plan.plain_source is not None, "the lowering split no loop of this body"
        mk = loops._make_kernel(plan.source if split else plan.plain_source, plan)
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


# Periodic bodies written with jnp.roll as a JAX user would, and their float64 NumPy references
# (the coefficients are exact in float32, in which JAX traces the literals)
def roll_heat_body(i, x):
    """1-D heat on a ring: neighbours one cell away."""
    import jax.numpy as jnp
    return x + 0.25 * (jnp.roll(x, 1) - 2 * x + jnp.roll(x, -1))


def roll_heat_ref(u0, steps):
    u = np.asarray(u0, np.float64).copy()
    for _ in range(steps):
        u = u + 0.25 * (np.roll(u, 1) - 2 * u + np.roll(u, -1))
    return u


def wide_roll_body(i, x):
    """A 2-D torus stencil of halo (2, 3) rows and (3, 2) columns: rolls by 2 and 3 cells both
    ways, one of them past the extent."""
    import jax.numpy as jnp
    return (0.375 * x + 0.125 * (jnp.roll(x, 2, axis=0) + jnp.roll(x, -3, axis=0))
            + 0.1875 * (jnp.roll(x, 3, axis=1) + jnp.roll(x, -2 - x.shape[1], axis=1)))


def wide_roll_ref(a0, steps):
    a = np.asarray(a0, np.float64).copy()
    for _ in range(steps):
        a = (0.375 * a + 0.125 * (np.roll(a, 2, axis=0) + np.roll(a, -3, axis=0))
             + 0.1875 * (np.roll(a, 3, axis=1) + np.roll(a, -2, axis=1)))
    return a
