"""Reverse mode: the gradient of a loss after N heat steps with respect to the initial field
(1-D, float32), and to the field and alpha, through kernel.jax under jax.grad, against
jax.grad of the same loop written with lax.scan, and the forward run alone (for the ratio);
loopkern's default adjoint form (gather) and the scatter form (atomics) side by side.
The loss, 0.5 * sum((u_N - target)**2), needs the final field (a loss linear in it would let
XLA drop the forward run). Checked against a hand-written float64 NumPy adjoint of the loop."""

from __future__ import annotations

import numpy as np

from .harness import Bench, Case, Impl, have, rel_err
from .heat import ALPHA, heat_kernel, heat_ref


def grad_ref(w, steps, alpha):
    """d/du0 of sum(w * u_N) where u and v both start as u0, in float64: the loop's adjoint,
    step by step backwards (swap the names' adjoints, then the stencil's transpose)."""
    a = float(alpha)
    ub, vb = np.asarray(w, np.float64).copy(), np.zeros(len(w))
    for _ in range(steps):
        ub, vb = vb, ub                      # before the step's rename: the new state was v
        g = vb[1:-1].copy()
        vb[1:-1] = 0.0
        ub[1:-1] += (1.0 - 2.0 * a) * g
        ub[:-2] += a * g
        ub[2:] += a * g
    return ub + vb                           # u0 fed both buffers


def alpha_grad_ref(u0, w, steps, alpha):
    """d/dalpha of sum(w * u_N) in float64, by forward mode: the tangent of the field with
    respect to alpha, carried along the loop."""
    a = float(alpha)
    u, v = np.asarray(u0, np.float64).copy(), np.asarray(u0, np.float64).copy()
    ud, vd = np.zeros(len(u)), np.zeros(len(u))
    for _ in range(steps):
        lap = u[:-2] - 2 * u[1:-1] + u[2:]
        lapd = ud[:-2] - 2 * ud[1:-1] + ud[2:]
        v[1:-1] = u[1:-1] + a * lap
        vd[1:-1] = ud[1:-1] + lap + a * lapd
        u, v, ud, vd = v, u, vd, ud
    return float(np.dot(np.asarray(w, np.float64), ud))


def _impl(fn, args):
    import jax
    cache, box = {}, {}

    def run(steps):
        if steps not in cache:
            cache[steps] = jax.jit(fn(steps))
        box["r"] = cache[steps](*args)
        return None
    return Impl(run, lambda: np.asarray(box["r"]), sync=lambda: jax.block_until_ready(box["r"]))


def bench_grad(b: Bench):
    if not have("jax") or b.args.no_jax:
        return
    import jax
    import jax.numpy as jnp
    n = 1024 if b.args.quick else 65536
    steps = 50 if b.args.quick else 10000
    check_steps = 50 if b.args.quick else 200
    rng = np.random.default_rng(5)
    u0 = rng.random(n).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)       # the target field
    seed = heat_ref(u0, check_steps) - w.astype(np.float64)     # d loss / d u_N
    ref = grad_ref(seed, check_steps, ALPHA)

    def check(res, done, ref=ref):
        e = rel_err(res, ref)
        return e < 1e-4, f"rel_err={e:.2e} of the gradient after {check_steps} steps"
    case = Case("heat_grad", n, steps, check_steps, check, dict(), bytes_per_step=0)
    k = heat_kernel()
    uj, wj = jnp.asarray(u0), jnp.asarray(w)

    def loss_of(field):
        return 0.5 * jnp.sum((field - wj) ** 2)

    def lk_grad(steps, form="gather"):
        return jax.grad(lambda u: loss_of(k.jax(u, u, ALPHA, steps=steps, adjoint_form=form)[0]))

    def scan_field(u, a, steps):
        """The field after ``steps`` heat steps written with lax.scan (u and v both start as u)."""
        def body(s, _):
            x, y = s
            new = y.at[1:-1].set(x[1:-1] + a * (x[:-2] - 2 * x[1:-1] + x[2:]))
            return (new, x), None
        return jax.lax.scan(body, (u, u), None, length=steps)[0][0]

    def scan_grad(steps):
        return jax.grad(lambda u: loss_of(scan_field(u, ALPHA, steps)))

    def lk_forward(steps):
        return lambda u: k.jax(u, u, ALPHA, steps=steps)[0]

    variants = [("loopkern jax.grad through kernel.jax", lambda c: _impl(lk_grad, [uj])),
                ("loopkern jax.grad through kernel.jax, adjoint_form='scatter'",
                 lambda c: _impl(lambda steps: lk_grad(steps, "scatter"), [uj])),
                ("jax.grad of lax.scan", lambda c: _impl(scan_grad, [uj]))]
    b.measure(case, variants)

    # with respect to alpha too: the adjoint step then reads the field (alpha's adjoint is a
    # sum of laplacians times adjoints), so the reverse sweep records and recomputes states;
    # with respect to u alone the loop is linear and nothing is recorded
    ref_a = alpha_grad_ref(u0, seed, check_steps, ALPHA)

    def check_a(res, done):
        e_u, e_a = rel_err(res[:-1], ref), abs(float(res[-1]) - ref_a) / abs(ref_a)
        return e_u < 1e-4 and e_a < 1e-3, f"rel_err={e_u:.2e} (u), {e_a:.2e} (alpha) after {check_steps} steps"
    case_a = Case("heat_grad_u_alpha", n, steps, check_steps, check_a, dict(), bytes_per_step=0)

    def both(g):
        def f(u, a):
            gu, ga = g(u, a)
            return jnp.concatenate([gu, jnp.reshape(ga, (1,))])
        return f

    def lk_grad_a(steps, form="gather"):
        return both(jax.grad(lambda u, a: loss_of(k.jax(u, u, a, steps=steps, adjoint_form=form)[0]),
                             argnums=(0, 1)))

    def scan_grad_a(steps):
        return both(jax.grad(lambda u, a: loss_of(scan_field(u, a, steps)), argnums=(0, 1)))
    aj = jnp.float32(ALPHA)
    b.measure(case_a, [("loopkern jax.grad through kernel.jax", lambda c: _impl(lk_grad_a, [uj, aj])),
                       ("loopkern jax.grad through kernel.jax, adjoint_form='scatter'",
                        lambda c: _impl(lambda steps: lk_grad_a(steps, "scatter"), [uj, aj])),
                       ("jax.grad of lax.scan", lambda c: _impl(scan_grad_a, [uj, aj]))])
    # the forward run alone: its result is the field, checked against the heat reference
    fwd_ref = heat_ref(u0, check_steps)
    fwd_case = Case("heat_grad_forward", n, steps, check_steps,
                    lambda res, done: (rel_err(res, fwd_ref) < 1e-4, "forward field"), dict())
    b.measure(fwd_case, [("loopkern kernel.jax forward", lambda c: _impl(lk_forward, [uj]))])
    # device memory: the temporary buffers XLA assigns the compiled gradient, in field states
    for label, make, args, wrt in (("loopkern jax.grad through kernel.jax", lk_grad, (uj,), "u"),
                                   ("jax.grad of lax.scan", scan_grad, (uj,), "u"),
                                   ("loopkern jax.grad through kernel.jax", lk_grad_a, (uj, aj), "u, alpha"),
                                   ("jax.grad of lax.scan", scan_grad_a, (uj, aj), "u, alpha")):
        row = dict(workload="heat_grad_memory", n=n, steps=steps, variant=f"{label} (d/d {wrt})")
        try:
            m = jax.jit(make(steps)).lower(*args).compile().memory_analysis()
            row.update(temp_bytes=int(m.temp_size_in_bytes), states=m.temp_size_in_bytes / (4 * n),
                       check=f"{m.temp_size_in_bytes / (4 * n):.1f} field states of temporaries "
                             f"(sqrt(N) = {np.sqrt(steps):.1f})")
        except Exception as exc:     # a backend without memory_analysis: say so, no figure
            row["error"] = f"memory_analysis: {type(exc).__name__}: {exc}"[:300]
        b.emit(row)
