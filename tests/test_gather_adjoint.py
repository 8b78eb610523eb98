"""The gather form of adjoint steps (the default; ``kernel.jax(adjoint_form=...)``,
``kernel.adjoint(..., form=...)``, ``loopkern/adjoint.py``): gradients against float64
``jax.grad`` of the same loop written in jnp, which terms become gathers and which keep their
atomics, and the adjoint step alone on the CUDA simulator against float64 ``jax.vjp``."""

import ast

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern.errors import ArgumentError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from test_adjoint import (_deposit_jnp, _heat2d_jnp, _heat_jnp, _jacobi_jnp, _leapfrog_jnp,  # noqa: E402
                          _smooth_then_flux_jnp, deposit, deposit_losses, heat2d, heat_if, leapfrog,
                          smooth_then_flux, upwind)
from refs import jax_x64  # noqa: E402


def _upwind_jnp(u, c, steps):
    def body(i, x):
        return x - c * (x - jnp.roll(x, 1)) + 0.01 * jnp.cos(jnp.roll(x, -1))
    return jax.lax.fori_loop(0, steps, body, u)


def box5(t, u, v, a):
    # a radius-2 stencil along both dimensions of a 2-D field, a local used by several terms,
    # and a nonlinear term (its adjoint reads the recorded field at the neighbour's index)
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((2, n - 2), (1, m - 1)):
        s = u[i - 2, j] + u[i + 2, j] + u[i, j - 1] + u[i, j + 1]
        v[i, j] = u[i, j] + a * (s - 4.0 * u[i, j]) + 0.1 * u[i - 1, j] * u[i + 1, j]


def _box5_jnp(u, a, steps):
    def body(k, st):
        x, y = st
        c = x[2:-2, 1:-1]
        s = x[:-4, 1:-1] + x[4:, 1:-1] + x[2:-2, :-2] + x[2:-2, 2:]
        new = c + a * (s - 4.0 * c) + 0.1 * x[1:-3, 1:-1] * x[3:-1, 1:-1]
        return y.at[2:-2, 1:-1].set(new), x
    return jax.lax.fori_loop(0, steps, body, (u, u))[0]


def branchy(t, u, v, a):
    # which neighbour is read depends on the value at the cell
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + a * (u[i + 1] if u[i] > 0.0 else 0.5 * u[i - 1] * u[i - 1])


def strided(t, u, v, a):
    # every other element, from a start that a step's argument decides: the gather must count
    # only the iterations the loop runs
    n = u.shape[0]
    for i in lk.range(1, n - 1, 2):
        v[i] = u[i] + a * (u[i - 1] + u[i + 1])
    for i in lk.range(2, n - 1, 2):
        v[i] = u[i] * (1.0 - a)
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]


def _strided_jnp(u, a, steps):
    def body(k, x):
        y = x.at[1:-1:2].set(x[1:-1:2] + a * (x[0:-2:2] + x[2::2]))
        return y.at[2:-1:2].set(x[2:-1:2] * (1.0 - a))
    return jax.lax.fori_loop(0, steps, body, u)


def _field(rng, shape):
    return jnp.asarray(rng.random(shape))


def _case_heat(rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u, w = _field(rng, 45), _field(rng, 45)
    return (lambda form: lambda u, a: (k.jax(u, u, a, steps=31, adjoint_form=form)[0] ** 2 * w).sum(),
            lambda u, a: (_heat_jnp(u, a, 31) ** 2 * w).sum(), (u, 0.2))


def _case_leapfrog(rng):
    k = lk.megakernel(leapfrog, swap=[("u", "v")])
    w = _field(rng, 40)

    def ours(form):
        def f(u, v, c):
            a, b = k.jax(u, v, c, steps=37, adjoint_form=form)
            return (a * w).sum() + (b ** 2).sum()
        return f

    def ref(u, v, c):
        a, b = _leapfrog_jnp(u, v, c, 37)
        return (a * w).sum() + (b ** 2).sum()
    return ours, ref, (_field(rng, 40), _field(rng, 40), 0.1)


def _case_heat2d(rng):
    k = lk.megakernel(heat2d, swap=[("u", "v")])
    w = _field(rng, (9, 7))
    return (lambda form: lambda u, a: (k.jax(u, u, a, steps=17, adjoint_form=form)[0] * w).sum() ** 2,
            lambda u, a: (_heat2d_jnp(u, a, 17) * w).sum() ** 2, (_field(rng, (9, 7)), 0.15))


def _case_box5(rng):
    k = lk.megakernel(box5, swap=[("u", "v")])
    w = _field(rng, (11, 8))
    return (lambda form: lambda u, a: (k.jax(u, u, a, steps=9, adjoint_form=form)[0] * w).sum(),
            lambda u, a: (_box5_jnp(u, a, 9) * w).sum(), (_field(rng, (11, 8)), 0.05))


def _case_strided(rng):
    k = lk.megakernel(strided, swap=[("u", "v")])
    w = _field(rng, 24)
    return (lambda form: lambda u, a: ((k.jax(u, u, a, steps=13, adjoint_form=form)[0] - w) ** 2).sum(),
            lambda u, a: ((_strided_jnp(u, a, 13) - w) ** 2).sum(), (_field(rng, 24), 0.3))


def _case_upwind(rng):
    k = lk.megakernel(upwind, swap=[("u", "v")])
    w = _field(rng, 21)
    return (lambda form: lambda u, c: (k.jax(u, u, c, steps=13, adjoint_form=form)[0] * w).sum(),
            lambda u, c: (_upwind_jnp(u, c, 13) * w).sum(), (_field(rng, 21), 0.4))


def _case_heat_if(rng):
    k = lk.megakernel(heat_if, swap=[("u", "v")])
    w = _field(rng, 40)
    return (lambda form: lambda u, a: (k.jax(u, u, a, steps=25, adjoint_form=form)[0] ** 2 * w).sum(),
            lambda u, a: (_heat_jnp(u, a, 25) ** 2 * w).sum(), (_field(rng, 40), 0.2))


def _case_phases(rng):
    k = lk.megakernel(smooth_then_flux)
    w1, w2 = _field(rng, 30), _field(rng, 30)

    def loss(run):
        def f(u, v, ff, c):
            a, b, d = run(u, v, ff, c)
            return (a * w1).sum() + (b ** 2).sum() + (d * w2).sum()
        return f
    return (lambda form: loss(lambda u, v, ff, c: k.jax(u, v, ff, c, steps=6, adjoint_form=form)),
            loss(lambda u, v, ff, c: _smooth_then_flux_jnp(u, v, ff, c, 6)),
            (_field(rng, 30), _field(rng, 30), _field(rng, 30), 0.2))


def _case_deposit(rng):
    k = lk.megakernel(deposit)
    cell = jnp.asarray(rng.integers(0, 7, 40).astype(np.int32))
    u = _field(rng, 40)
    return (lambda form: deposit_losses(k, _deposit_jnp, cell, u, adjoint_form=form)[0],
            deposit_losses(k, _deposit_jnp, cell, u)[1], (_field(rng, 40), _field(rng, 7), 0.3))


def _case_jacobi(rng):
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0, w = _field(rng, (8, 9)), _field(rng, (8, 9))
    steps = int(k.jax(u0, u0, 1e-3, max_steps=400)[-1])
    assert 10 < steps < 400
    return (lambda form: lambda u: (k.jax(u, u, 1e-3, max_steps=400, adjoint_form=form)[0] * w).sum(),
            lambda u: (_jacobi_jnp(u, steps) * w).sum(), (u0,))


CASES = {"heat": _case_heat, "leapfrog": _case_leapfrog, "heat2d": _case_heat2d, "box5": _case_box5,
         "strided": _case_strided, "upwind": _case_upwind, "heat_if": _case_heat_if, "phases": _case_phases,
         "deposit": _case_deposit, "jacobi": _case_jacobi}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gather_form_gradients_equal_float64_jax_grad(case, rng):
    with jax_x64():
        ours, ref, args = CASES[case](rng)
        argnums = tuple(range(len(args)))
        want = jax.grad(ref, argnums=argnums)(*args)
        for fn in (jax.grad(ours("gather"), argnums=argnums), jax.jit(jax.grad(ours("gather"), argnums=argnums))):
            got = fn(*args)
            for g, r in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-10, atol=1e-12)


def _atomic_targets(kernel):
    """The arrays that the generated step updates with lk.atomic.add."""
    return {ast.unparse(n.args[0]) for st in kernel.spec.step.body for n in ast.walk(st)
            if isinstance(n, ast.Call) and "atomic_add" in ast.unparse(n.func)}


@pytest.mark.parametrize("step, swap, wrt, scatter, gather", [
    (W.heat_step, [("u", "v")], ("u", "v"), {"u_bar"}, set()),
    # a scalar's adjoint: summed per thread, one atomic per block, in either form
    (W.heat_step, [("u", "v")], ("u", "v", "alpha"), {"u_bar", "alpha_bar"}, {"alpha_bar"}),
    (heat2d, [("u", "v")], ("u", "v", "a"), {"u_bar", "a_bar"}, {"a_bar"}),
    (box5, [("u", "v")], ("u", "v"), {"u_bar"}, set()),
    # neighbours read under a branch: each term gathered under the branch's test
    (branchy, [("u", "v")], ("u", "v", "a"), {"u_bar", "a_bar"}, {"a_bar"}),
    # the boundary by an if over lk.range(n): u[i - 1] is read only where i > 0, but nothing
    # proves that the index never wraps around, so its terms keep their atomics
    (heat_if, [("u", "v")], ("u", "v", "a"), {"u_bar", "a_bar"}, {"u_bar", "a_bar"}),
    (W.jacobi_step, [("u", "v")], ("u", "v"), {"u_bar"}, set()),
    (strided, [("u", "v")], ("u", "v"), {"u_bar"}, set()),
    # u[i - 1] at i = 0 is u[n - 1] and (i + 1) % n is no constant offset: both stay atomic
    (upwind, [("u", "v")], ("u", "v"), {"u_bar"}, {"u_bar"}),
    # a scatter into grid at cell[i] (the recomputed version, and its adjoint): no offsets
    (deposit, [], ("w", "grid"), {"grid_after_1", "grid_bar"}, {"grid_after_1", "grid_bar"}),
])
def test_which_terms_become_gathers(step, swap, wrt, scatter, gather):
    k = lk.megakernel(step, swap=swap)
    assert _atomic_targets(k.adjoint(*wrt, form="scatter")) == scatter
    assert _atomic_targets(k.adjoint(*wrt)) == gather            # the default form


def test_an_unknown_adjoint_form_is_an_argument_error(rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u = jnp.asarray(rng.random(8).astype(np.float32))
    with pytest.raises(ArgumentError, match="adjoint_form='gathered': expected one of 'gather', 'scatter'"):
        k.jax(u, u, 0.1, steps=3, adjoint_form="gathered")
    with pytest.raises(ArgumentError, match="form='fast'"):
        k.adjoint("u", "v", form="fast")


def _one_box5(u, v, a):
    c = u[2:-2, 1:-1]
    s = u[:-4, 1:-1] + u[4:, 1:-1] + u[2:-2, :-2] + u[2:-2, 2:]
    return v.at[2:-2, 1:-1].set(c + a * (s - 4.0 * c) + 0.1 * u[1:-3, 1:-1] * u[3:-1, 1:-1])


def _one_branchy(u, v, a):
    c = u[1:-1]
    return v.at[1:-1].set(c + a * jnp.where(c > 0.0, u[2:], 0.5 * u[:-2] * u[:-2]))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
@pytest.mark.parametrize("step, shape, one", [(box5, (13, 10), _one_box5), (branchy, (130,), _one_branchy)],
                         ids=["box5", "branchy"])
def test_the_gather_form_adjoint_step_alone(backend, step, shape, one, rng):
    # one reverse step in gather form, run on the simulator by 64 threads for 130 elements:
    # each element's sum in one thread, the adjoint of v zeroed after the barrier that follows
    # the gathers; against jax.vjp of one jnp step in float64. box5: a radius-2 2-D stencil;
    # branchy: neighbours read under a conditional expression, so each neighbour's term is
    # gathered under the test taken at the iteration it belongs to
    adj = lk.megakernel(step, swap=[("u", "v")]).adjoint("u", "v", "a", form="gather")
    assert list(adj.spec.param_names) == ["u", "u_bar", "v", "v_bar", "a", "a_bar"]
    u, v, bu, bv = (rng.standard_normal(shape) for _ in range(4))
    a = 0.07
    dev = [u.copy(), bu.copy(), v.copy(), bv.copy(), np.zeros(1)]
    if backend == "cuda":
        from numba import cuda
        dev = [cuda.to_device(x) for x in dev]
    adj(dev[0], dev[1], dev[2], dev[3], a, dev[4], steps=1, backend=backend,
        **({"scope": "grid", "blocks": 1, "threads": 64} if backend == "cuda" else {}))
    got = [np.asarray(x.copy_to_host() if backend == "cuda" else x) for x in dev]
    with jax_x64():
        _, vjp = jax.vjp(one, jnp.asarray(u), jnp.asarray(v), jnp.float64(a))
        # the step's output v is a new state whose adjoint is bv; u passes through as itself
        ru, rv, ra = vjp(jnp.asarray(bv))
    np.testing.assert_allclose(got[1], bu + np.asarray(ru), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[3], np.asarray(rv), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[4][0], float(ra), rtol=1e-10)
    np.testing.assert_array_equal(got[0], u)
