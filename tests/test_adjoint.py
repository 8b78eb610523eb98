"""Reverse mode (loopkern/adjoint.py, jax.grad through kernel.jax on JAX's CPU backend): the
gradient of a loss after many steps against jax.grad of the same loop written in jnp, and the
constructs that still raise a clear error."""

import math

import re

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from refs import jax_x64
from loopkern.errors import LoopkernError, StepSyntaxError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _heat_jnp(u, a, steps):
    def body(i, x):
        return x.at[1:-1].set(x[1:-1] + a * (x[:-2] - 2 * x[1:-1] + x[2:]))
    return jax.lax.fori_loop(0, steps, body, u)


def leapfrog(t, u, v, c2):
    # two levels: v is read and overwritten at the same cell
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 2.0 * u[i] - v[i] + c2 * (u[i - 1] - 2.0 * u[i] + u[i + 1])


def _leapfrog_jnp(u, v, c2, steps):
    def body(i, s):
        u, v = s
        new = v.at[1:-1].set(2.0 * u[1:-1] - v[1:-1] + c2 * (u[:-2] - 2.0 * u[1:-1] + u[2:]))
        return new, u
    return jax.lax.fori_loop(0, steps, body, (u, v))


def nonlinear_inplace(t, x, k):
    # an in-place update (no swap), math, a conditional expression, a local used twice
    n = x.shape[0]
    for i in lk.range(n):
        y = x[i] * k
        z = math.tanh(y) if y > 0.0 else 0.5 * y
        x[i] = x[i] + 0.1 * z * z + 0.05 * math.sin(t + y)


def _nonlinear_jnp(x, k, steps):
    def body(t, x):
        y = x * k
        z = jnp.where(y > 0.0, jnp.tanh(y), 0.5 * y)
        return x + 0.1 * z * z + 0.05 * jnp.sin(t + y)
    return jax.lax.fori_loop(0, steps, body, x)


@pytest.mark.parametrize("steps", [1, 23, 100])
def test_grad_of_heat_equals_jax_grad_of_the_jnp_loop(steps, rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(50).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(50).astype(np.float32))

    def loss(u, a):
        return (k.jax(u, u, a, steps=steps)[0] * w).sum()

    def ref(u, a):
        return (_heat_jnp(u, a, steps) * w).sum()
    a = np.float32(0.2)
    for fn in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss, argnums=(0, 1)))):
        gu, ga = fn(u0, a)
        ru, ra = jax.grad(ref, argnums=(0, 1))(u0, a)
        np.testing.assert_allclose(np.asarray(gu), np.asarray(ru), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(ga), float(ra), rtol=1e-4, atol=1e-4)


def test_grad_through_jit_checkpoint_scan_and_cond_around_the_call(rng):
    """A Python-int step count stays known when JAX traces the call again: jax.grad of a loss
    that is jitted, checkpointed, or calls kernel.jax inside lax.scan or lax.cond equals the jnp
    loop's (it raised "needs the step count known at trace time"); steps=0 is the identity."""
    k = lk.megakernel(nonlinear_inplace)
    x0, w = rng.uniform(-1, 1, 30), rng.standard_normal(30)
    with jax_x64():
        x0, w = jnp.asarray(x0), jnp.asarray(w)
        assert x0.dtype == jnp.float64

        def variants(step):
            return [lambda x: (step(x) * w).sum(),
                    jax.jit(lambda x: (step(x) * w).sum()),
                    jax.checkpoint(lambda x: (step(x) * w).sum()),
                    lambda x: (jax.lax.scan(lambda c, _: (step(c), None), x, None, length=3)[0] * w).sum(),
                    lambda x: (jax.lax.cond(x[0] < 5.0, step, lambda y: y, x) * w).sum()]
        for steps in (7, 0):
            got = variants(lambda x: k.jax(x, 0.8, steps=steps)[0])
            ref = variants(lambda x: _nonlinear_jnp(x, 0.8, steps))
            for g, r in zip(got, ref):
                np.testing.assert_allclose(np.asarray(jax.grad(g)(x0)), np.asarray(jax.grad(r)(x0)), rtol=1e-10,
                                           atol=1e-12)


def test_second_derivatives_as_hessian_forward_over_forward_and_a_clear_error_otherwise(rng):
    k = lk.megakernel(nonlinear_inplace)
    x0 = rng.uniform(-1, 1, 6)
    with jax_x64():
        x0 = jnp.asarray(x0)
        h = jax.hessian(lambda x: (k.jax(x, 0.8, steps=3)[0] ** 2).sum())(x0)
        r = jax.hessian(lambda x: (_nonlinear_jnp(x, 0.8, 3) ** 2).sum())(x0)
        np.testing.assert_allclose(np.asarray(h), np.asarray(r), rtol=1e-9, atol=1e-11)
        f = lambda x: k.jax(x, 0.8, steps=3)[0]         # noqa: E731
        g = lambda x: _nonlinear_jnp(x, 0.8, 3)         # noqa: E731
        # forward over forward (since session 28: jax.jvp of a jvp raised)
        for d in (lambda h: jax.jacfwd(jax.jacfwd(h)),
                  lambda h: lambda x: jax.jvp(lambda y: jax.jvp(h, (y,), (x,))[1], (x,), (x * 0.5,))[1]):
            np.testing.assert_allclose(np.asarray(d(f)(x0)), np.asarray(d(g)(x0)), rtol=1e-9, atol=1e-11)
        # reverse over forward and reverse over reverse: a clear error (raw JAX ValueErrors and a
        # StepSyntaxError about a generated step before session 28)
        for d, what in ((lambda h: jax.grad(lambda x: jax.jvp(h, (x,), (x,))[1].sum()), "over a forward-mode"),
                        (lambda h: jax.jacrev(jax.jacfwd(h)), "over a forward-mode"),
                        (lambda h: jax.grad(lambda x: (jax.grad(lambda y: (h(y) ** 2).sum())(x) ** 2).sum()),
                         "reverse mode over reverse mode"),
                        (lambda h: jax.jacrev(jax.jacrev(h)), "reverse mode over reverse mode")):
            with pytest.raises(LoopkernError, match=what):
                d(f)(x0)


def test_grad_through_vmap_of_the_call(rng):
    """jax.grad of a function that vmaps kernel.jax (over either axis, nested, some operands
    unbatched) equals the jnp loop's: the batched tangent run's transpose is the unbatched
    reverse sweep, vmapped (before session 28 it raised JAX's 'Pure callbacks do not support
    transpose')."""
    k = lk.megakernel(nonlinear_inplace)
    xs = rng.uniform(-1, 1, (3, 7))
    c = rng.uniform(0.5, 0.9, (2, 3))
    with jax_x64():
        xs, c = jnp.asarray(xs), jnp.asarray(c)
        ours = [lambda s: jax.vmap(lambda x: k.jax(x * s, 0.8, steps=4)[0])(xs).sum(),
                lambda s: jax.vmap(lambda x: k.jax(x, s, steps=4)[0], in_axes=1)(xs).sum(),
                lambda s: jax.vmap(jax.vmap(lambda a: k.jax(xs[0] * s, a, steps=3)[0].sum()))(c * s).sum()]
        refs = [lambda s: jax.vmap(lambda x: _nonlinear_jnp(x * s, 0.8, 4))(xs).sum(),
                lambda s: jax.vmap(lambda x: _nonlinear_jnp(x, s, 4), in_axes=1)(xs).sum(),
                lambda s: jax.vmap(jax.vmap(lambda a: _nonlinear_jnp(xs[0] * s, a, 3).sum()))(c * s).sum()]
        for o, r in zip(ours, refs):
            np.testing.assert_allclose(float(jax.grad(o)(0.7)), float(jax.grad(r)(0.7)), rtol=1e-9)



def _gather_step(t, u, v, idx, k):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = 0.5 * u[i] + k * u[idx[i]] ** 2


def _gather_jnp(u, idx, k, steps):
    return jax.lax.fori_loop(0, steps, lambda i, x: 0.5 * x + k * x[idx] ** 2, u)


def test_grad_through_vmap_with_an_integer_array_and_numpy_cotangents(rng):
    """jax.grad of a vmapped call whose step has an integer array parameter (an output without
    a cotangent: a raw TypeError from linear_transpose before session 29), and a NumPy
    cotangent given to jax.vjp's pullback or a NumPy tangent to jax.linearize's function (an
    ArgumentError naming 'v_bar' or 'u_dot' before), against the jnp loop's."""
    k = lk.megakernel(_gather_step, swap=[("u", "v")])
    with jax_x64():
        idx = jnp.asarray(rng.permutation(8), jnp.int32)
        U = jnp.asarray(rng.uniform(0.1, 0.9, (3, 8)))
        ours = jax.grad(lambda U, a: jnp.sum(jax.vmap(lambda u: k.jax(u, u, idx, a, steps=3)[0])(U) ** 2),
                        argnums=(0, 1))(U, 0.3)
        want = jax.grad(lambda U, a: jnp.sum(jax.vmap(lambda u: _gather_jnp(u, idx, a, 3))(U) ** 2),
                        argnums=(0, 1))(U, 0.3)
        for o, w in zip(ours, want):
            np.testing.assert_allclose(np.asarray(o), np.asarray(w), rtol=1e-10)
        ct = rng.standard_normal(8)
        _, pullback = jax.vjp(lambda u: k.jax(u, u, idx, 0.3, steps=3)[0], U[0])
        _, pullback_ref = jax.vjp(lambda u: _gather_jnp(u, idx, 0.3, 3), U[0])
        np.testing.assert_allclose(np.asarray(pullback(ct)[0]), np.asarray(pullback_ref(jnp.asarray(ct))[0]),
                                   rtol=1e-10)
        _, lin = jax.linearize(lambda u: k.jax(u, u, idx, 0.3, steps=3)[0], U[0])
        _, lin_ref = jax.linearize(lambda u: _gather_jnp(u, idx, 0.3, 3), U[0])
        np.testing.assert_allclose(np.asarray(lin(ct)), np.asarray(lin_ref(jnp.asarray(ct))), rtol=1e-10)


_SCALE = 0.5


def _scaled_step(t, x, a):
    for i in lk.range(x.shape[0]):
        x[i] = x[i] + a * _SCALE * x[i] * x[i]


def test_derivatives_use_the_globals_the_decorator_saw(rng):
    """A global read by the step is read once, when the decorator runs; the tangent and adjoint
    kernels, generated later, used the value at differentiation time (session 29: a gradient
    for another function, silently)."""
    global _SCALE
    k = lk.megakernel(_scaled_step)
    _SCALE = 2.0
    try:
        with jax_x64():
            x0 = jnp.asarray(rng.uniform(0.1, 0.5, 6))

            def ref(a):
                x = x0
                for _ in range(2):
                    x = x + a * 0.5 * x * x
                return jnp.sum(x)
            f = lambda a: jnp.sum(k.jax(x0, a, steps=2)[0])
            np.testing.assert_allclose(float(f(0.3)), float(ref(0.3)), rtol=1e-14)
            np.testing.assert_allclose(float(jax.grad(f)(0.3)), float(jax.grad(ref)(0.3)), rtol=1e-12)
            np.testing.assert_allclose(float(jax.jvp(f, (0.3,), (1.0,))[1]), float(jax.grad(ref)(0.3)), rtol=1e-12)
    finally:
        _SCALE = 0.5


_FLUX = 0.3


def _flux(a, b):
    d = b - a
    return _FLUX * d * abs(d)


def _flux_step(t, u, w, a):
    for i in lk.range(u.shape[0]):
        w[i] = a * _flux(u[i], 1.0) + u[i]


def test_derivatives_use_the_globals_a_helper_read_at_the_decorator(rng):
    """A global read by a helper (inlined into the derivative steps) keeps the value the
    decorator saw too: the helper is parsed once per step and its names resolved once. Before
    session 36 the tangent and the reverse sweep read it again when they were generated, so
    jax.jvp and jax.grad differentiated another function than the primal computed (found by
    an adversarial run: a swap-pair run's gradient matched no consistent set of globals)."""
    global _FLUX
    k = lk.megakernel(_flux_step, swap=[("u", "w")])
    _FLUX = 0.7
    try:
        with jax_x64():
            u0 = jnp.asarray(rng.uniform(0.1, 0.9, 6))

            def ref(u, a):
                for _ in range(3):
                    d = 1.0 - u
                    u = a * 0.3 * d * jnp.abs(d) + u
                return jnp.sum(u ** 2)
            f = lambda u, a: jnp.sum(k.jax(u, u, a, steps=3)[0] ** 2)
            np.testing.assert_allclose(float(f(u0, 0.4)), float(ref(u0, 0.4)), rtol=1e-14)
            for o, w in zip(jax.grad(f, argnums=(0, 1))(u0, 0.4), jax.grad(ref, argnums=(0, 1))(u0, 0.4)):
                np.testing.assert_allclose(np.asarray(o), np.asarray(w), rtol=1e-12)
            tan = jax.jvp(lambda a: f(u0, a), (0.4,), (1.0,))[1]
            np.testing.assert_allclose(float(tan), float(jax.grad(ref, argnums=1)(u0, 0.4)), rtol=1e-12)
    finally:
        _FLUX = 0.3


def test_only_what_has_a_tangent_is_differentiated(rng):
    # a constant scalar (a symbolic zero tangent) gets no adjoint: with one, every element of
    # every step would add into a single number; the state arrays, written by the step, are
    # differentiated whenever anything is (with respect to alpha alone, u's tangent grows)
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(40).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(40).astype(np.float32))
    a = np.float32(0.2)
    gu = jax.grad(lambda u: (k.jax(u, u, a, steps=17)[0] * w).sum())(u0)
    ru = jax.grad(lambda u: (_heat_jnp(u, a, 17) * w).sum())(u0)
    np.testing.assert_allclose(np.asarray(gu), np.asarray(ru), rtol=1e-4, atol=1e-5)
    assert set(k._derived_kernels) == {("tangent", ("u", "v"))}
    ga = jax.grad(lambda a: (k.jax(u0, u0, a, steps=17)[0] * w).sum())(a)
    ra = jax.grad(lambda a: (_heat_jnp(u0, a, 17) * w).sum())(a)
    np.testing.assert_allclose(float(ga), float(ra), rtol=1e-4, atol=1e-4)
    assert ("tangent", ("u", "v", "alpha")) in k._derived_kernels


def test_grad_of_a_two_level_scheme(rng):
    k = lk.megakernel(leapfrog, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(40).astype(np.float32))
    v0 = jnp.asarray(rng.random(40).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(40).astype(np.float32))

    def loss(u, v, c):
        out = k.jax(u, v, c, steps=37)
        return (out[0] * w).sum() + (out[1] ** 2).sum()

    def ref(u, v, c):
        a, b = _leapfrog_jnp(u, v, c, 37)
        return (a * w).sum() + (b ** 2).sum()
    got = jax.grad(loss, argnums=(0, 1, 2))(u0, v0, np.float32(0.1))
    want = jax.grad(ref, argnums=(0, 1, 2))(u0, v0, np.float32(0.1))
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-3, atol=1e-3)


def test_grad_of_a_nonlinear_in_place_update(rng):
    k = lk.megakernel(nonlinear_inplace)
    x0 = jnp.asarray(rng.standard_normal(30).astype(np.float32))

    def loss(x, kk):
        return (k.jax(x, kk, steps=12)[0] ** 2).sum()

    def ref(x, kk):
        return (_nonlinear_jnp(x, kk, 12) ** 2).sum()
    got = jax.grad(loss, argnums=(0, 1))(x0, np.float32(1.3))
    want = jax.grad(ref, argnums=(0, 1))(x0, np.float32(1.3))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4, atol=1e-4)


def test_what_reverse_mode_does_not_cover_yet_is_a_clear_error(rng):
    u = jnp.asarray(rng.random(16).astype(np.float32))
    jacobi = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    with pytest.raises(LoopkernError, match="needs max_steps known at trace time"):
        jax.jit(jax.grad(lambda a, m: jacobi.jax(a.reshape(4, 4), a.reshape(4, 4), 1e-3, max_steps=m)[0].sum()))(
            u, 5)
    def scaled_by_max(t, x):
        # lk.max of a value that is not a running max (m = max(m, e) only)
        n = x.shape[0]
        m = 0.0
        for i in lk.range(n):
            m = max(m, abs(x[i])) * 0.5
        top = lk.max(m)
        for i in lk.range(n):
            x[i] = x[i] / (1.0 + top)

    def two_reductions(t, x):
        n = x.shape[0]
        s = 0.0
        for i in lk.range(n):
            s += x[i]
        top = lk.max(s) + lk.sum(s)
        for i in lk.range(n):
            x[i] = x[i] / (1.0 + top)

    with pytest.raises(StepSyntaxError, match=r"reverse mode: lk.max has an adjoint only of a running max"):
        lk.megakernel(scaled_by_max).adjoint("x")
    with pytest.raises(StepSyntaxError, match=r"reverse mode: .*only as r = f\(lk.sum\(acc\)\)"):
        lk.megakernel(two_reductions).adjoint("x")


def test_a_read_after_a_store_in_the_same_loop_is_refused():
    def store_then_read(t, x, y):
        n = x.shape[0]
        for i in lk.range(n):
            x[i] = x[i] * 0.5
            y[i] = x[i] + 1.0

    with pytest.raises(StepSyntaxError, match="read after this loop stored into it"):
        lk.megakernel(store_then_read).adjoint("x", "y")


def test_a_read_at_another_index_of_a_stored_array_is_refused():
    def shifted(t, x):
        # (without the parity test, an in-place stencil: refused at the def as a race)
        n = x.shape[0]
        for i in lk.range(1, n):
            if i % 2 == 0:
                x[i] = x[i - 1] * 0.5

    with pytest.raises(StepSyntaxError, match="read at another index"):
        lk.megakernel(shifted).adjoint("x")


def heat2d(t, u, v, a):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), (1, m - 1)):
        v[i, j] = u[i, j] + a * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1] - 4.0 * u[i, j])


def _heat2d_jnp(u, a, steps):
    def body(k, s):
        x, y = s
        c = x[1:-1, 1:-1]
        new = y.at[1:-1, 1:-1].set(c + a * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:] - 4.0 * c))
        return new, x
    return jax.lax.fori_loop(0, steps, body, (u, u))[0]


def test_grad_and_jvp_of_a_two_dimensional_stencil(rng):
    k = lk.megakernel(heat2d, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random((9, 7)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((9, 7)).astype(np.float32))

    def loss(u, a):
        return (k.jax(u, u, a, steps=17)[0] * w).sum()

    def ref(u, a):
        return (_heat2d_jnp(u, a, 17) * w).sum()
    got = jax.grad(loss, argnums=(0, 1))(u0, np.float32(0.15))
    want = jax.grad(ref, argnums=(0, 1))(u0, np.float32(0.15))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4, atol=1e-4)
    du = jnp.asarray(rng.standard_normal((9, 7)).astype(np.float32))
    _, t = jax.jvp(loss, (u0, np.float32(0.15)), (du, np.float32(0.2)))
    _, t_ref = jax.jvp(ref, (u0, np.float32(0.15)), (du, np.float32(0.2)))
    assert float(t) == pytest.approx(float(t_ref), rel=1e-4, abs=1e-4)


def upwind(t, u, v, c):
    # periodic: u[i - 1] at i = 0 reads the last element (Python's negative index)
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i] - c * (u[i] - u[i - 1]) + 0.01 * math.cos(u[(i + 1) % n])


def test_grad_with_wrapped_and_negative_indices(rng):
    k = lk.megakernel(upwind, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(21).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(21).astype(np.float32))

    def ref(u, c):
        def body(i, x):
            return x - c * (x - jnp.roll(x, 1)) + 0.01 * jnp.cos(jnp.roll(x, -1))
        return (jax.lax.fori_loop(0, 13, body, u) * w).sum()
    got = jax.grad(lambda u, c: (k.jax(u, u, c, steps=13)[0] * w).sum(), argnums=(0, 1))(u0, np.float32(0.4))
    want = jax.grad(ref, argnums=(0, 1))(u0, np.float32(0.4))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4, atol=1e-4)


def test_vmap_of_grad_and_jacrev(rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random((3, 20)).astype(np.float32))

    def loss(u, a):
        return (k.jax(u, u, a, steps=5)[0] ** 2).sum()

    def ref(u, a):
        return (_heat_jnp(u, a, 5) ** 2).sum()
    got = jax.vmap(jax.grad(loss), in_axes=(0, None))(u0, np.float32(0.2))
    want = jax.vmap(jax.grad(ref), in_axes=(0, None))(u0, np.float32(0.2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    jac = jax.jacrev(lambda u: k.jax(u, u, np.float32(0.2), steps=5)[0])(u0[0])
    jac_ref = jax.jacrev(lambda u: _heat_jnp(u, np.float32(0.2), 5))(u0[0])
    np.testing.assert_allclose(np.asarray(jac), np.asarray(jac_ref), rtol=1e-5, atol=1e-6)


def branchy(t, x, k):
    # if statements assigning locals (nested, with else), then one store
    n = x.shape[0]
    for i in lk.range(n):
        y = x[i] * k
        z = 0.5 * y
        if y > 0.0:
            z = math.tanh(y)
            if y > 1.0:
                z = z + 0.1 * y * y
            else:
                z = z - 0.05 * y
        elif y < -0.5:
            z = math.sin(y)
        x[i] = x[i] + 0.1 * z


def _branchy_jnp(x, k, steps):
    def body(t, x):
        y = x * k
        z_pos = jnp.tanh(y) + jnp.where(y > 1.0, 0.1 * y * y, -0.05 * y)
        z = jnp.where(y > 0.0, z_pos, jnp.where(y < -0.5, jnp.sin(y), 0.5 * y))
        return x + 0.1 * z
    return jax.lax.fori_loop(0, steps, body, x)


def test_grad_through_if_statements_on_locals(rng):
    k = lk.megakernel(branchy)
    x0 = jnp.asarray((3 * rng.standard_normal(40)).astype(np.float32))

    def loss(x, kk):
        return (k.jax(x, kk, steps=7)[0] ** 2).sum()

    def ref(x, kk):
        return (_branchy_jnp(x, kk, 7) ** 2).sum()
    got = jax.grad(loss, argnums=(0, 1))(x0, np.float32(0.8))
    want = jax.grad(ref, argnums=(0, 1))(x0, np.float32(0.8))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4, atol=1e-3)


def heat_if(t, u, v, a):
    # the boundary by an if statement: each branch stores the element
    n = u.shape[0]
    for i in lk.range(n):
        if i == 0 or i == n - 1:
            v[i] = u[i]
        else:
            v[i] = u[i] + a * (u[i - 1] - 2.0 * u[i] + u[i + 1])


def shrink_positive(t, x, k):
    # one branch stores, in place: where it is not taken the element keeps its value
    n = x.shape[0]
    for i in lk.range(n):
        if x[i] > 0.0:
            x[i] = x[i] * 0.5 + k * x[i] * x[i]


def clipped(t, x, y, k):
    # if / elif / else storing y, a local changed in one branch after its store, then a store
    # after the if that uses it; y is written, never read
    n = x.shape[0]
    for i in lk.range(n):
        z = x[i] * k
        if z > 1.0:
            y[i] = 1.0 + 0.1 * z
        elif z < -1.0:
            y[i] = -1.0 + 0.1 * z
            z = z * 0.5
        else:
            if z > 0.0:
                y[i] = z * z
            else:
                y[i] = z
        x[i] = x[i] + 0.01 * z


def _clipped_jnp(x, y, k, steps):
    def body(t, s):
        x, y = s
        z = x * k
        y = jnp.where(z > 1.0, 1.0 + 0.1 * z, jnp.where(z < -1.0, -1.0 + 0.1 * z, jnp.where(z > 0.0, z * z, z)))
        z = jnp.where((z <= 1.0) & (z < -1.0), z * 0.5, z)
        return x + 0.01 * z, y
    return jax.lax.fori_loop(0, steps, body, (x, y))


def test_grad_through_stores_inside_if_statements(rng):
    k = lk.megakernel(heat_if, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(40).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(40).astype(np.float32))
    got = jax.grad(lambda u, a: (k.jax(u, u, a, steps=25)[0] * w).sum(), argnums=(0, 1))(u0, np.float32(0.2))
    want = jax.grad(lambda u, a: (_heat_jnp(u, a, 25) * w).sum(), argnums=(0, 1))(u0, np.float32(0.2))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4, atol=1e-4)

    s = lk.megakernel(shrink_positive)
    x0 = jnp.asarray(rng.standard_normal(30).astype(np.float32))

    def shrink_ref(x, kk):
        return jax.lax.fori_loop(0, 6, lambda t, x: jnp.where(x > 0.0, x * 0.5 + kk * x * x, x), x)
    got = jax.grad(lambda x, kk: (s.jax(x, kk, steps=6)[0] ** 2).sum(), argnums=(0, 1))(x0, np.float32(0.3))
    want = jax.grad(lambda x, kk: (shrink_ref(x, kk) ** 2).sum(), argnums=(0, 1))(x0, np.float32(0.3))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4, atol=1e-4)

    c = lk.megakernel(clipped)
    x0 = jnp.asarray((2 * rng.standard_normal(50)).astype(np.float32))
    y0 = jnp.asarray(rng.standard_normal(50).astype(np.float32))
    wy = jnp.asarray(rng.standard_normal(50).astype(np.float32))

    def loss(x, y, kk):
        a, b = c.jax(x, y, kk, steps=9)
        return (a ** 2).sum() + (b * wy).sum()

    def ref(x, y, kk):
        a, b = _clipped_jnp(x, y, kk, 9)
        return (a ** 2).sum() + (b * wy).sum()
    got = jax.grad(loss, argnums=(0, 1, 2))(x0, y0, np.float32(0.9))
    want = jax.grad(ref, argnums=(0, 1, 2))(x0, y0, np.float32(0.9))
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
    assert float(np.abs(np.asarray(got[1])).max()) == 0.0        # y is overwritten before it is read


def edge_read(t, u, v):
    # u[i + 1] exists only where the conditional expression reads it
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = 0.5 * (u[i] + (u[i + 1] if i < n - 1 else u[i]))


def test_an_adjoint_touches_only_the_elements_the_step_read(rng):
    # u[n] does not exist: the adjoint adds into u_bar[i + 1] only where i < n - 1, so a
    # bounds-checked run of the adjoint step stops nowhere
    adj = lk.megakernel(edge_read, swap=[("u", "v")]).adjoint("u", "v")
    u0 = rng.random(33)
    u, ub, v, vb = u0.copy(), np.zeros(33), u0.copy(), rng.standard_normal(33)
    run = adj(u, ub, v, vb.copy(), steps=1, backend="cpu", debug=True)
    assert run.steps == 1 and run.stopped == "steps"
    want = 0.5 * vb
    want[1:] += 0.5 * vb[:-1]
    want[-1] += 0.5 * vb[-1]
    np.testing.assert_allclose(ub, want, rtol=1e-12)
    k = lk.megakernel(edge_read, swap=[("u", "v")])
    x0 = jnp.asarray(rng.random(20).astype(np.float32))

    def ref(x):
        return jax.lax.fori_loop(0, 4, lambda t, s: (0.5 * (s[0] + jnp.append(s[0][1:], s[0][-1])), s[0]),
                                 (x, x))[0]
    got = jax.grad(lambda x: (k.jax(x, x, steps=4)[0] ** 2).sum())(x0)
    want = jax.grad(lambda x: (ref(x) ** 2).sum())(x0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_stores_inside_an_if_that_reverse_mode_cannot_reorder_are_refused():
    def read_after_store(t, x, y):
        n = x.shape[0]
        for i in lk.range(n):
            if x[i] > 0.0:
                y[i] = x[i] * 0.5
                x[i] = y[i] + 1.0

    def twice(t, x):
        n = x.shape[0]
        for i in lk.range(n):
            if x[i] > 0.0:
                x[i] = x[i] * 0.5
                x[i] = x[i] * 0.5

    def moving_index(t, x, y):
        n = x.shape[0]
        for i in lk.range(n):
            j = i
            if x[i] > 0.0:
                y[j] = x[i] * 0.5
                j = j + 1

    with pytest.raises(StepSyntaxError, match="'y' is read after a store into it in the same branch"):
        lk.megakernel(read_after_store).adjoint("x", "y")
    with pytest.raises(StepSyntaxError, match="'x' is read after a store into it in the same branch"):
        lk.megakernel(twice).adjoint("x")
    with pytest.raises(StepSyntaxError, match="the index of a store inside an 'if' uses 'j'"):
        lk.megakernel(moving_index).adjoint("x", "y")


def precomputed(t, u, v, alpha, dt):
    # coefficients computed once at the top of the step from differentiated scalars
    n = u.shape[0]
    c = alpha * dt
    c2 = c * c + 0.5 * dt
    for i in lk.range(1, n - 1):
        v[i] = u[i] + c * (u[i - 1] - 2.0 * u[i] + u[i + 1]) - c2 * u[i]
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]


def test_grad_through_top_level_coefficients(rng):
    k = lk.megakernel(precomputed, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(30).astype(np.float32))

    def ref(u, a, dt):
        def body(i, x):
            c = a * dt
            c2 = c * c + 0.5 * dt
            return x.at[1:-1].set(x[1:-1] + c * (x[:-2] - 2 * x[1:-1] + x[2:]) - c2 * x[1:-1])
        return (jax.lax.fori_loop(0, 11, body, u) ** 2).sum()

    def loss(u, a, dt):
        return (k.jax(u, u, a, dt, steps=11)[0] ** 2).sum()
    got = jax.grad(loss, argnums=(0, 1, 2))(u0, np.float32(0.8), np.float32(0.25))
    want = jax.grad(ref, argnums=(0, 1, 2))(u0, np.float32(0.8), np.float32(0.25))
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


def test_recorded_state_stacks_do_not_size_the_grid():
    # the recorder's and segment kernel's S_a hold one state per step: a launch covers one state
    from loopkern.interop.jax_bridge import _launch_work, _segment_kernels
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    rec, seg, _, recorded = _segment_kernels(k, ["u", "v", "alpha"], ["u", "v"], {"u": 1, "v": 1})
    assert recorded == ["u"]        # v's values are never read by the adjoint step
    n, steps = 5000, 71
    for mk in (rec, seg):
        sig = [((steps, n), "float32") if p.name.endswith("_states") else
               ((n,), "float32") if p.name in ("u", "v", "u_bar", "v_bar") else
               ((1,), "float32") if p.name == "alpha_bar" else (None, "float64")
               for p in mk.spec.params]
        assert sum(1 for p in mk.spec.params if p.name.endswith("_states")) == 1
        assert _launch_work(mk, sig) == n
    assert _launch_work(k, [((n,), "float32"), ((n,), "float32"), (None, "float64")]) == n


def reads_then_overwrites(t, x, y, c):
    # the second loop stores into x, which the first loop read: its adjoint comes first
    n = x.shape[0]
    for i in lk.range(n):
        y[i] = x[i] * x[i] + c * y[i]
    for i in lk.range(n):
        x[i] = 0.5 * x[i] + math.sin(x[i]) * c


def test_loops_of_one_step_take_their_adjoints_in_reverse_order(rng):
    k = lk.megakernel(reads_then_overwrites)
    x0 = jnp.asarray(rng.standard_normal(24).astype(np.float32))
    y0 = jnp.asarray(rng.standard_normal(24).astype(np.float32))

    def ref(x, y, c):
        def body(t, s):
            x, y = s
            return 0.5 * x + jnp.sin(x) * c, x * x + c * y
        return jax.lax.fori_loop(0, 5, body, (x, y))

    def loss(run):
        def f(x, y, c):
            a, b = run(x, y, c)
            return (a ** 2).sum() + (b * jnp.arange(24.0)).sum()
        return f
    got = jax.grad(loss(lambda x, y, c: k.jax(x, y, c, steps=5)), argnums=(0, 1, 2))(x0, y0, np.float32(0.7))
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(x0, y0, np.float32(0.7))
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


def test_a_loop_reading_what_an_earlier_loop_stored(rng):
    # the validator allows it without lk.sync() (each thread reads the elements it stored
    # itself); the adjoint recomputes tmp into a scratch array before the second loop's
    # adjoint reads it (recomputing from the state before the step would be wrong)
    def two_loops(t, x, tmp):
        n = x.shape[0]
        for i in lk.range(n):
            tmp[i] = x[i] * x[i]
        for i in lk.range(n):
            x[i] = x[i] + 0.1 * tmp[i]

    def ref(x):
        return jax.lax.fori_loop(0, 3, lambda t, x: x + 0.1 * x * x, x)
    k = lk.megakernel(two_loops)
    x0 = jnp.asarray(rng.random(16).astype(np.float32))
    got = jax.grad(lambda x: (k.jax(x, jnp.zeros(16, jnp.float32), steps=3)[0] ** 2).sum())(x0)
    want = jax.grad(lambda x: (ref(x) ** 2).sum())(x0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _two_phase_jnp(x, steps):
    def body(t, s):
        x, _, _ = s
        tmp = 0.5 * (x + jnp.roll(x, -1))
        x = x + 0.1 * jnp.roll(tmp, 1)
        return x, tmp, tmp - x
    return jax.lax.fori_loop(0, steps, body, (x, x, x))


@pytest.mark.parametrize("steps", [1, 7])
def test_grad_of_a_step_in_phases(steps, rng):
    # three phases separated by lk.sync(): each reads what the one before stored, at other
    # threads' elements (wrapping around); the adjoint recomputes tmp and x, then runs the
    # phases' adjoints backwards with the barriers between them
    k = lk.megakernel(W.two_phase_step)
    n = 24
    x0 = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    z = jnp.zeros(n, jnp.float32)

    def loss(x):
        xo, tmp, out = k.jax(x, z, z, steps=steps)
        return (xo * w).sum() + (out ** 2).sum() + (tmp * xo).sum()

    def ref(x):
        xo, tmp, out = _two_phase_jnp(x, steps)
        return (xo * w).sum() + (out ** 2).sum() + (tmp * xo).sum()
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(x0)), np.asarray(jax.grad(ref)(x0)), rtol=1e-4, atol=1e-5)


def smooth_then_flux(t, u, v, f, c):
    # v stored by two loops (interior, ends), then read everywhere after lk.sync(); f stored
    # except its last element; u stored in the last phase after the first phase read it
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + c * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    for i in lk.range(0, n, n - 1):
        v[i] = u[i] * (1.0 - c)
    lk.sync()
    for i in lk.range(n - 1):
        f[i] = v[i + 1] * v[i + 1] - v[i]
    lk.sync()
    for i in lk.range(1, n - 1):
        u[i] = v[i] + 0.1 * c * (f[i] - f[i - 1])


def _smooth_then_flux_jnp(u, v, f, c, steps):
    def body(t, s):
        u, v, f = s
        v = v.at[1:-1].set(u[1:-1] + c * (u[:-2] - 2.0 * u[1:-1] + u[2:]))
        v = v.at[0].set(u[0] * (1.0 - c)).at[-1].set(u[-1] * (1.0 - c))
        f = f.at[:-1].set(v[1:] * v[1:] - v[:-1])
        u = u.at[1:-1].set(v[1:-1] + 0.1 * c * (f[1:-1] - f[:-2]))
        return u, v, f
    return jax.lax.fori_loop(0, steps, body, (u, v, f))


def test_grad_of_phases_whose_arrays_several_loops_store(rng):
    k = lk.megakernel(smooth_then_flux)
    n = 30
    u0, v0, f0 = (jnp.asarray(rng.standard_normal(n).astype(np.float32)) for _ in range(3))
    w1, w2 = (jnp.asarray(rng.standard_normal(n).astype(np.float32)) for _ in range(2))

    def loss(run):
        def f(u, v, ff, c):
            a, b, d = run(u, v, ff, c)
            return (a * w1).sum() + (b ** 2).sum() + (d * w2).sum()
        return f
    args = (u0, v0, f0, np.float32(0.2))
    got = jax.grad(loss(lambda u, v, ff, c: k.jax(u, v, ff, c, steps=6)), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(loss(lambda u, v, ff, c: _smooth_then_flux_jnp(u, v, ff, c, 6)), argnums=(0, 1, 2, 3))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-4)
    assert float(np.abs(np.asarray(got[2])[-1] - np.asarray(w2)[-1])) < 1e-6   # f's last element: never stored


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_the_adjoint_step_of_a_step_in_phases_alone(backend, rng):
    # kernel.adjoint(): one step of the reverse sweep, its scratch arrays (versions of v and f
    # that later phases read) passed after the adjoints; against jax.vjp of one jnp step
    adj = lk.megakernel(smooth_then_flux).adjoint("u", "v", "f", "c")
    names = adj.spec.param_names
    assert list(names[:8]) == ["u", "u_bar", "v", "v_bar", "f", "f_bar", "c", "c_bar"]
    assert len(names) > 8 and all(n.startswith(("v_after", "f_after")) for n in names[8:])
    n = 12
    u, v, f = (rng.standard_normal(n) for _ in range(3))
    bu, bv, bf = (rng.standard_normal(n) for _ in range(3))
    c = 0.3
    arrays = [u.copy(), bu.copy(), v.copy(), bv.copy(), f.copy(), bf.copy()]
    cbar = np.zeros(1)
    scratch = [np.full(n, np.nan) for _ in names[8:]]          # what they hold on entry must not matter
    dev = arrays + [cbar] + scratch
    if backend == "cuda":
        from numba import cuda
        dev = [cuda.to_device(a) for a in dev]
    args = dev[:6] + [c, dev[6]] + dev[7:]
    adj(*args, steps=1, backend=backend)
    got = [np.asarray(a.copy_to_host() if backend == "cuda" else a) for a in dev]
    from refs import jax_x64
    with jax_x64():
        one = lambda u, v, f, c: _smooth_then_flux_jnp(u, v, f, c, 1)   # noqa: E731
        _, vjp = jax.vjp(one, jnp.asarray(u), jnp.asarray(v), jnp.asarray(f), jnp.float64(c))
        ru, rv, rf, rc = vjp((jnp.asarray(bu), jnp.asarray(bv), jnp.asarray(bf)))
    np.testing.assert_allclose(got[1], np.asarray(ru), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[3], np.asarray(rv), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[5], np.asarray(rf), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[6][0], float(rc), rtol=1e-10)
    np.testing.assert_array_equal(got[0], u)                     # the primal state is not touched


def test_a_local_carried_from_one_iteration_to_the_next_is_refused():
    # s keeps what this thread's previous iteration left: the adjoint, recomputing one
    # iteration at a time, would see the value before the loop (a wrong gradient, not an error)
    def carried(t, x, y):
        n = x.shape[0]
        s = 0.0
        for i in lk.range(n):
            s = s * 0.5 + x[i]
            y[i] = s * s

    with pytest.raises(StepSyntaxError, match="'s' carries a value from one iteration of the loop to the next"):
        lk.megakernel(carried).adjoint("x", "y")


def noisy_heat(t, u, v, a, s):
    # two draws per cell (sites 1 and 2), one scaling the other's contribution
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        kick = s * lk.random.normal(i)
        v[i] = u[i] + a * (u[i - 1] - 2.0 * u[i] + u[i + 1]) + kick * (1.0 + 0.5 * lk.random.uniform(i, 3))
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]


def _noisy_heat_jnp(u, a, s, steps, seed):
    # the draws of the step's two call sites, from the reference interpreter's Philox
    import interp
    n = u.shape[0]
    normal = np.array([[interp.ref_normal(seed, t, i, 0, 1) for i in range(n)] for t in range(steps)])
    unif = np.array([[interp.ref_uniform(seed, t, i, 3, 2) for i in range(n)] for t in range(steps)])
    factor = jnp.asarray((1.0 + 0.5 * unif).astype(np.float32))
    normal = jnp.asarray(normal.astype(np.float32))

    def body(t, x):
        new = x[1:-1] + a * (x[:-2] - 2 * x[1:-1] + x[2:]) + s * normal[t, 1:-1] * factor[t, 1:-1]
        return x.at[1:-1].set(new)
    return jax.lax.fori_loop(0, steps, body, u)


def test_grad_and_jvp_through_lk_random_draws(rng):
    # a draw has no derivative; the tangent and adjoint steps copy draws around, and each copy
    # must draw what the step's draw drew (same site), or the gradient is of another function
    k = lk.megakernel(noisy_heat, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(30).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(30).astype(np.float32))
    seed = 12345
    out = k.jax(u0, u0, np.float32(0.2), np.float32(0.05), steps=9, seed=seed)[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(_noisy_heat_jnp(u0, 0.2, 0.05, 9, seed)),
                               rtol=1e-5, atol=1e-6)

    def loss(u, a, s):
        return (k.jax(u, u, a, s, steps=9, seed=seed)[0] ** 2 * w).sum()

    def ref(u, a, s):
        return (_noisy_heat_jnp(u, a, s, 9, seed) ** 2 * w).sum()
    args = (u0, np.float32(0.2), np.float32(0.05))
    got = jax.grad(loss, argnums=(0, 1, 2))(*args)
    want = jax.grad(ref, argnums=(0, 1, 2))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
    _, tan = jax.jvp(lambda s: k.jax(u0, u0, np.float32(0.2), s, steps=9, seed=seed)[0], (np.float32(0.05),),
                     (np.float32(1.0),))
    _, rtan = jax.jvp(lambda s: _noisy_heat_jnp(u0, 0.2, s, 9, seed), (np.float32(0.05),), (np.float32(1.0),))
    np.testing.assert_allclose(np.asarray(tan), np.asarray(rtan), rtol=1e-4, atol=1e-5)


def normalized(t, x, c):
    # a nonlinear function of a sum, used by the next loop; c enters both
    n = x.shape[0]
    s = 0.0
    for i in lk.range(n):
        s += x[i] * x[i]
    norm = math.sqrt(lk.sum(s) / n) + c
    for i in lk.range(n):
        x[i] = x[i] / norm


def clipped_mean(t, x, y, a):
    # a conditional accumulation, a reduction after a two-loop phase, and a second reduction
    n = x.shape[0]
    s = 0.0
    for i in lk.range(n):
        yi = a * x[i]
        y[i] = yi
        if x[i] > 0.0:
            s += yi * x[i]
        s -= 0.1 * x[i]
    m = lk.sum(s) / n
    q = 0.0
    for i in lk.range(n):
        nx = x[i] - 0.5 * m * y[i]
        x[i] = nx
        q += nx * nx
    e = lk.sum(q)
    for i in lk.range(n):
        y[i] = y[i] + 0.01 * e


def _clipped_mean_jnp(x, y, a, steps):
    def body(t, st):
        x, y = st
        y = a * x
        s = jnp.where(x > 0.0, y * x, 0.0).sum() - 0.1 * x.sum()
        m = s / x.shape[0]
        x = x - 0.5 * m * y
        e = (x * x).sum()
        return x, y + 0.01 * e
    return jax.lax.fori_loop(0, steps, body, (x, y))


def test_grad_through_lk_sum_reductions(rng):
    k = lk.megakernel(normalized)
    x0 = jnp.asarray(rng.standard_normal(20).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(20).astype(np.float32))

    def ref(x, c):
        return jax.lax.fori_loop(0, 3, lambda t, x: x / (jnp.sqrt(jnp.mean(x * x)) + c), x)
    got = jax.grad(lambda x, c: (k.jax(x, c, steps=3)[0] * w).sum(), argnums=(0, 1))(x0, np.float32(0.3))
    want = jax.grad(lambda x, c: (ref(x, c) * w).sum(), argnums=(0, 1))(x0, np.float32(0.3))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4)

    k2 = lk.megakernel(clipped_mean)
    y0 = jnp.asarray(rng.standard_normal(20).astype(np.float32))

    def loss(run):
        def f(x, y, a):
            xo, yo = run(x, y, a)
            return (xo * w).sum() + (yo ** 2).sum()
        return f
    args = (x0, y0, np.float32(0.7))
    got = jax.grad(loss(lambda x, y, a: k2.jax(x, y, a, steps=4)), argnums=(0, 1, 2))(*args)
    want = jax.grad(loss(lambda x, y, a: _clipped_mean_jnp(x, y, a, 4)), argnums=(0, 1, 2))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-4)


def test_accumulators_reverse_mode_cannot_follow_are_refused():
    def read_inside(t, x, y):
        n = x.shape[0]
        s = 0.0
        for i in lk.range(n):
            s += x[i]
            y[i] = s
        m = lk.sum(s)
        for i in lk.range(n):
            x[i] = x[i] - m

    def product(t, x):
        n = x.shape[0]
        s = 1.0
        for i in lk.range(n):
            s = s * x[i]
        m = lk.sum(s)
        for i in lk.range(n):
            x[i] = x[i] - m

    def active_start(t, x, c):
        n = x.shape[0]
        s = c
        for i in lk.range(n):
            s += x[i]
        m = lk.sum(s)
        for i in lk.range(n):
            x[i] = x[i] - m

    with pytest.raises(StepSyntaxError, match="'s' adds up values for lk.sum: it may only be added into here"):
        lk.megakernel(read_inside).adjoint("x", "y")
    with pytest.raises(StepSyntaxError, match="update it only as s \\+= e or s -= e"):
        lk.megakernel(product).adjoint("x")
    with pytest.raises(StepSyntaxError, match="must be set before the loops to a value that does not depend"):
        lk.megakernel(active_start).adjoint("x", "c")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_the_adjoint_step_of_a_reduction_alone(backend, rng):
    # kernel.adjoint() of clipped_mean: two lk.sum reductions, their totals formed with lk.sum
    # in the adjoint step; against jax.vjp of one jnp step in float64
    from refs import jax_x64
    adj = lk.megakernel(clipped_mean).adjoint("x", "y", "a")
    names = list(adj.spec.param_names)
    assert names[:6] == ["x", "x_bar", "y", "y_bar", "a", "a_bar"]
    n = 12
    x, y, bx, by = (rng.standard_normal(n) for _ in range(4))
    a = 0.7
    dev = [x.copy(), bx.copy(), y.copy(), by.copy(), np.zeros(1)] + [np.full(n, np.nan) for _ in names[6:]]
    if backend == "cuda":
        from numba import cuda
        dev = [cuda.to_device(d) for d in dev]
    adj(*dev[:4], a, *dev[4:], steps=1, backend=backend, threads=32 if backend == "cuda" else None)
    got = [d.copy_to_host() if backend == "cuda" else d for d in dev]
    with jax_x64():
        _, vjp = jax.vjp(lambda x, y, a: _clipped_mean_jnp(x, y, a, 1), jnp.asarray(x), jnp.asarray(y),
                         jnp.float64(a))
        rx, ry, ra = vjp((jnp.asarray(bx), jnp.asarray(by)))
    np.testing.assert_allclose(got[1], np.asarray(rx), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[3], np.asarray(ry), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[4][0], float(ra), rtol=1e-10)


def deposit(t, w, cell, grid, c):
    # particles add into grid cells (several per cell), the grid decays, then each particle
    # reads its cell back: a scatter with lk.atomic.add between phases
    n = w.shape[0]
    for i in lk.range(n):
        lk.atomic.add(grid, cell[i], w[i] * w[i] * c)
    lk.sync()
    for k in lk.range(grid.shape[0]):
        grid[k] = 0.9 * grid[k]
    lk.sync()
    for i in lk.range(n):
        w[i] = w[i] + 0.01 * grid[cell[i]]


def _deposit_jnp(w, cell, grid, c, steps):
    def body(t, s):
        w, grid = s
        grid = 0.9 * grid.at[cell].add(w * w * c)
        return w + 0.01 * grid[cell], grid
    return jax.lax.fori_loop(0, steps, body, (w, grid))


def deposit_losses(k, ref, cell, u, steps=5, **options):
    """(loss of the megakernel ``k`` of a deposit step, loss of its jnp loop ``ref``), each a
    function of (w, grid, c): the particles' final weights against ``u`` plus the final grid's
    squared norm. ``options`` go to ``k.jax``."""
    def loss(run):
        def f(w, g, c):
            wo, go = run(w, g, c)
            return (wo * u).sum() + (go ** 2).sum()
        return f

    def ours(w, g, c):
        wo, _, go = k.jax(w, cell, g, c, steps=steps, **options)
        return wo, go
    return loss(ours), loss(lambda w, g, c: ref(w, cell, g, c, steps))


def test_grad_through_an_atomic_scatter(rng):
    k = lk.megakernel(deposit)
    n, m = 40, 7
    w0 = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    cell = jnp.asarray(rng.integers(0, m, n).astype(np.int32))
    g0 = jnp.asarray(rng.standard_normal(m).astype(np.float32))
    u = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    ours, ref = deposit_losses(k, _deposit_jnp, cell, u)
    args = (w0, g0, np.float32(0.3))
    got = jax.grad(ours, argnums=(0, 1, 2))(*args)
    want = jax.grad(ref, argnums=(0, 1, 2))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


def deposit_if(t, w, cell, grid, c):
    # particles inside the grid add into their cell, those outside (a cell < 0 or >= m) do
    # not: the scatter under an if, its index out of range where the branch is not taken
    n = w.shape[0]
    m = grid.shape[0]
    for i in lk.range(n):
        k = cell[i]
        if k >= 0 and k < m:
            lk.atomic.add(grid, k, w[i] * w[i] * c)
    lk.sync()
    for k in lk.range(m):
        grid[k] = 0.9 * grid[k]
    lk.sync()
    for i in lk.range(n):
        k = cell[i]
        w[i] = w[i] + (0.01 * grid[k] if k >= 0 and k < m else 0.0)


def _deposit_if_jnp(w, cell, grid, c, steps):
    m = grid.shape[0]
    inside = (cell >= 0) & (cell < m)
    safe = jnp.where(inside, cell, 0)

    def body(t, s):
        w, grid = s
        grid = 0.9 * grid.at[safe].add(jnp.where(inside, w * w * c, 0.0))
        return w + jnp.where(inside, 0.01 * grid[safe], 0.0), grid
    return jax.lax.fori_loop(0, steps, body, (w, grid))


def test_grad_through_an_atomic_scatter_under_an_if(rng):
    from refs import jax_x64
    k = lk.megakernel(deposit_if)
    with jax_x64():
        n, m = 40, 7
        w0, g0, u = (jnp.asarray(rng.standard_normal(s)) for s in (n, m, n))
        cell = jnp.asarray(rng.integers(-3, m + 3, n).astype(np.int32))      # some outside the grid
        ours, ref = deposit_losses(k, _deposit_if_jnp, cell, u)
        args = (w0, g0, 0.3)
        got = jax.grad(ours, argnums=(0, 1, 2))(*args)
        want = jax.grad(ref, argnums=(0, 1, 2))(*args)
        for g, r in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-10, atol=1e-12)
        tangents = (jnp.asarray(rng.standard_normal(n)), jnp.asarray(rng.standard_normal(m)), 0.5)
        _, t = jax.jvp(ours, args, tangents)
        _, t_ref = jax.jvp(ref, args, tangents)
        assert float(t) == pytest.approx(float(t_ref), rel=1e-10)


def test_atomics_reverse_mode_cannot_follow_are_refused():
    def maxed(t, x, h):
        n = x.shape[0]
        for i in lk.range(n):
            lk.atomic.max(h, 0, x[i])

    def used_old(t, x, h):
        n = x.shape[0]
        for i in lk.range(n):
            old = lk.atomic.add(h, 0, x[i])
            x[i] = x[i] + 0.0 * old

    with pytest.raises(StepSyntaxError, match="lk.atomic.max has no adjoint yet"):
        lk.megakernel(maxed).adjoint("x", "h")
    with pytest.raises(StepSyntaxError, match="the old value an lk.atomic update returns has no adjoint yet"):
        lk.megakernel(used_old).adjoint("x", "h")


def _jacobi_jnp(u, steps):
    def body(t, s):
        x, y = s
        return y.at[1:-1, 1:-1].set(0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:])), x
    return jax.lax.fori_loop(0, steps, body, (u, u))[0]


def test_grad_of_a_while_loop_holds_its_step_count(rng):
    # Jacobi to a tolerance: the condition (an lk.max of a carried local) has no derivative and
    # is left out of the adjoint step; the gradient is that of the steps the run executed
    # (JAX's own while_loop cannot be differentiated in reverse mode: the reference is a
    # fori_loop of that many steps)
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random((8, 9)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((8, 9)).astype(np.float32))
    tol = np.float32(1e-3)
    out = k.jax(u0, u0, tol, max_steps=400)
    steps = int(out[-1])
    assert 10 < steps < 400
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(_jacobi_jnp(u0, steps)), rtol=1e-6, atol=1e-6)

    def loss(u):
        return (k.jax(u, u, tol, max_steps=400)[0] * w).sum()
    want = jax.grad(lambda u: (_jacobi_jnp(u, steps) * w).sum())(u0)
    for fn in (jax.grad(loss), jax.jit(jax.grad(loss))):
        np.testing.assert_allclose(np.asarray(fn(u0)), np.asarray(want), rtol=1e-5, atol=1e-6)
    # the adjoint step has no trace of the condition
    src = k.adjoint("u", "v").source("cpu")
    assert "reduce_max" not in src and not re.search(r"\berr\b", src)


def test_the_gradient_of_a_chunked_run_equals_that_of_one_run(rng):
    # the step depends on t (sin(t + y)), so each chunk must differentiate its own steps:
    # start= reaches the reverse sweep's recorded and recomputed steps
    k = lk.megakernel(nonlinear_inplace)
    x0 = jnp.asarray(rng.standard_normal(30).astype(np.float32))

    def one(x, kk):
        return (k.jax(x, kk, steps=17)[0] ** 2).sum()

    def chunked(x, kk):
        y = k.jax(x, kk, steps=10)[0]
        y = k.jax(y, kk, steps=4, start=10)[0]
        return (k.jax(y, kk, steps=3, start=14)[0] ** 2).sum()
    a = jax.grad(one, argnums=(0, 1))(x0, np.float32(1.3))
    b = jax.grad(chunked, argnums=(0, 1))(x0, np.float32(1.3))
    np.testing.assert_allclose(np.asarray(b[0]), np.asarray(a[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(b[1]), float(a[1]), rtol=1e-5)
    want = jax.grad(lambda x, kk: (_nonlinear_jnp(x, kk, 17) ** 2).sum(), argnums=(0, 1))(x0, np.float32(1.3))
    np.testing.assert_allclose(np.asarray(b[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)


def windowed(t, u, v, c):
    # an inner loop of constant bounds (unrolled by reverse mode) accumulating into a local,
    # with its index in the arithmetic
    n = u.shape[0]
    for i in lk.range(n):
        acc = 0.0
        for k in range(3):
            acc += u[(i + k) % n] * (k + c)
        v[i] = acc / 3.0 + math.exp(-u[i] * u[i])


def test_grad_through_an_inner_loop_of_constant_bounds(rng):
    k = lk.megakernel(windowed, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(16).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(16).astype(np.float32))

    def ref(u, c):
        def body(t, s):
            x, _ = s
            acc = sum(jnp.roll(x, -j) * (j + c) for j in range(3))
            return acc / 3.0 + jnp.exp(-x * x), x
        return jax.lax.fori_loop(0, 4, body, (u, u))[0]
    got = jax.grad(lambda u, c: (k.jax(u, u, c, steps=4)[0] * w).sum(), argnums=(0, 1))(u0, np.float32(0.5))
    want = jax.grad(lambda u, c: (ref(u, c) * w).sum(), argnums=(0, 1))(u0, np.float32(0.5))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4)

    def with_break(t, u, v):
        n = u.shape[0]
        for i in lk.range(n):
            acc = 0.0
            for j in range(3):
                if u[(i + j) % n] > 0.5:
                    break
                acc += u[(i + j) % n]
            v[i] = acc

    with pytest.raises(StepSyntaxError, match="a 'break' or 'continue' in an inner loop has no adjoint yet"):
        lk.megakernel(with_break, swap=[("u", "v")]).adjoint("u", "v")


def test_the_reverse_sweep_starts_from_the_primal_runs_checkpoints(rng, monkeypatch):
    # the primal run is made in the sweep's segments and keeps their starts: the transpose runs
    # no forward pass of its own (no kernel.jax call of the step itself), and the gradient is
    # jax.grad's of the jnp loop. A step whose adjoint reads no state keeps none
    k = lk.megakernel(nonlinear_inplace)
    x0 = jnp.asarray(rng.standard_normal(30).astype(np.float32))
    calls = []
    original = lk.MegaKernel.jax

    def counting(self, *a, **kw):
        calls.append(self.spec.name)
        return original(self, *a, **kw)
    monkeypatch.setattr(lk.MegaKernel, "jax", counting)
    for steps in (17, 4, 1):
        calls.clear()
        got = jax.grad(lambda x, kk: (k.jax(x, kk, steps=steps)[0] ** 2).sum(), argnums=(0, 1))(x0, np.float32(1.3))
        assert calls.count("nonlinear_inplace") == 1          # the user's call alone
        want = jax.grad(lambda x, kk: (_nonlinear_jnp(x, kk, steps) ** 2).sum(), argnums=(0, 1))(x0, np.float32(1.3))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4)
    from loopkern.interop.jax_bridge import _segment_kernels
    h = lk.megakernel(W.heat_step, swap=[("u", "v")])
    assert _segment_kernels(h, ["u", "v"], ["u", "v"], {"u": 1, "v": 1})[3] == []


def test_checkpoint_every_sets_the_segments(rng):
    k = lk.megakernel(nonlinear_inplace)
    x0 = jnp.asarray(rng.standard_normal(30).astype(np.float32))
    want = jax.grad(lambda x, kk: (_nonlinear_jnp(x, kk, 17) ** 2).sum(), argnums=(0, 1))(x0, np.float32(1.3))
    for every in (1, 3, 16, 17, 500):
        got = jax.grad(lambda x, kk: (k.jax(x, kk, steps=17, checkpoint_every=every)[0] ** 2).sum(),
                       argnums=(0, 1))(x0, np.float32(1.3))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4)
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(lk.ArgumentError, match="checkpoint_every="):
            k.jax(x0, np.float32(1.3), steps=3, checkpoint_every=bad)


def peak_scaled(t, x, c):
    # lk.max of a running max (one update inside an if), lk.min of a running min
    n = x.shape[0]
    m = -1.0e30
    for i in lk.range(n):
        y = x[i] * x[i] + c
        if x[i] > -10.0:
            m = max(m, y)
    top = lk.max(m)
    lo = 1.0e30
    for i in lk.range(n):
        lo = min(x[i], lo)
    bot = lk.min(lo)
    for i in lk.range(n):
        x[i] = x[i] / math.sqrt(top) + 0.1 * bot


def _peak_scaled_jnp(x, c, steps):
    def body(t, x):
        top = jnp.max(jnp.where(x > -10.0, x * x + c, -1.0e30))
        return x / jnp.sqrt(top) + 0.1 * jnp.min(x)
    return jax.lax.fori_loop(0, steps, body, x)


@pytest.mark.parametrize("ties", [False, True])
def test_grad_and_jvp_through_lk_max_and_min(ties, rng):
    # the derivative of a max/min is the mean of the tangents of the values equal to it, as
    # JAX defines it for jnp.max/jnp.min: with ties (x*x equal at +-2, the min at -2 twice)
    # loopkern's split must be JAX's, whichever threads hold the tied values
    k = lk.megakernel(peak_scaled)
    x0 = np.tile(np.array([1.0, -2.0, 2.0, 0.5, -2.0, 2.0], np.float32), 7) if ties else \
        rng.standard_normal(42).astype(np.float32)
    x0, w = jnp.asarray(x0), jnp.asarray(rng.standard_normal(42).astype(np.float32))
    c = np.float32(0.3)
    got = jax.grad(lambda x, c: (k.jax(x, c, steps=3)[0] * w).sum(), argnums=(0, 1))(x0, c)
    want = jax.grad(lambda x, c: (_peak_scaled_jnp(x, c, 3) * w).sum(), argnums=(0, 1))(x0, c)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-5)
    dx = jnp.asarray(rng.standard_normal(42).astype(np.float32))
    _, tan = jax.jvp(lambda x, c: k.jax(x, c, steps=3)[0], (x0, c), (dx, np.float32(0.7)))
    _, rtan = jax.jvp(lambda x, c: _peak_scaled_jnp(x, c, 3), (x0, c), (dx, np.float32(0.7)))
    np.testing.assert_allclose(np.asarray(tan), np.asarray(rtan), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_the_adjoint_and_tangent_steps_of_a_max_alone(backend, rng):
    # one step of kernel.adjoint() and kernel.tangent() of peak_scaled (two threads' worth of
    # ties on the simulator's grid) against jax.vjp / jax.jvp of one jnp step in float64
    from refs import jax_x64
    n = 24
    x = np.tile(np.array([1.0, -2.0, 2.0, 0.5]), n // 4)
    bx, dx = rng.standard_normal(n), rng.standard_normal(n)
    c = 0.3
    adj = lk.megakernel(peak_scaled).adjoint("x", "c")
    tan = lk.megakernel(peak_scaled).tangent("x", "c")
    dev = [x.copy(), bx.copy(), np.zeros(1)]
    tdev = [x.copy(), dx.copy()]
    if backend == "cuda":
        from numba import cuda
        dev = [cuda.to_device(d) for d in dev]
        tdev = [cuda.to_device(d) for d in tdev]
    kw = dict(threads=32) if backend == "cuda" else {}
    adj(dev[0], dev[1], c, dev[2], steps=1, backend=backend, **kw)
    tan(tdev[0], tdev[1], c, 0.5, steps=1, backend=backend, **kw)
    got = [d.copy_to_host() if backend == "cuda" else d for d in dev]
    tgot = [d.copy_to_host() if backend == "cuda" else d for d in tdev]
    with jax_x64():
        _, vjp = jax.vjp(lambda x, c: _peak_scaled_jnp(x, c, 1), jnp.asarray(x), jnp.float64(c))
        rx, rc = vjp(jnp.asarray(bx))
        _, rt = jax.jvp(lambda x, c: _peak_scaled_jnp(x, c, 1), (jnp.asarray(x), jnp.float64(c)),
                        (jnp.asarray(dx), jnp.float64(0.5)))
    np.testing.assert_allclose(got[1], np.asarray(rx), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[2][0], float(rc), rtol=1e-10)
    np.testing.assert_allclose(tgot[1], np.asarray(rt), rtol=1e-10, atol=1e-12)


def test_transformations_compose_with_the_primal_runs_checkpoints(rng):
    # 17 steps: five segments, the primal's checkpoints operands of the tangent run; jacfwd
    # (the tangent run batched), jacrev and a jitted vmap of grad against the jnp loop's
    k = lk.megakernel(nonlinear_inplace)
    x0 = jnp.asarray(rng.standard_normal(6).astype(np.float32))

    def ours(x):
        return k.jax(x, np.float32(1.3), steps=17)[0]

    def ref(x):
        return _nonlinear_jnp(x, np.float32(1.3), 17)
    want = np.asarray(jax.jacfwd(ref)(x0))
    np.testing.assert_allclose(np.asarray(jax.jacfwd(ours)(x0)), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jacrev(ours)(x0)), want, rtol=1e-4, atol=1e-5)
    xs = jnp.stack([x0, 2 * x0])
    got = jax.jit(jax.vmap(jax.grad(lambda x: (ours(x) ** 2).sum())))(xs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.vmap(jax.grad(lambda x: (ref(x) ** 2).sum()))(xs)),
                               rtol=1e-4, atol=1e-5)


def damped(t, x, y, tol):
    # nonlinear, to a tolerance: the reverse sweep records states over traced segment lengths
    n = x.shape[0]
    err = 0.0
    for i in lk.range(n):
        new = x[i] - 0.1 * x[i] * x[i] * x[i]
        y[i] = new
        err = max(err, abs(new - x[i]))
    return lk.max(err) > tol


def test_grad_of_a_nonlinear_while_loop_at_several_checkpoint_spacings(rng):
    k = lk.megakernel(damped, swap=[("x", "y")])
    x0 = jnp.asarray(rng.random(20).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(20).astype(np.float32))
    tol = np.float32(1e-3)
    steps = int(k.jax(x0, x0, tol, max_steps=500)[-1])
    assert 10 < steps < 500
    want = jax.grad(lambda x: (jax.lax.fori_loop(0, steps, lambda t, x: x - 0.1 * x ** 3, x) * w).sum())(x0)
    for every in (None, 3, 50, 1000):
        got = jax.grad(lambda x: (k.jax(x, x, tol, max_steps=500, checkpoint_every=every)[0] * w).sum())(x0)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_adjoints_of_elements_a_thread_owns_are_plain_updates():
    # within a phase of the adjoint step, an adjoint array that one loop touches, only at its
    # own index, is updated without atomics; any other use keeps them (in the scatter form: the
    # gather form replaces the neighbour terms too, test_gather_adjoint.py)
    src = adjoint_text(nonlinear_inplace, "x", "k")
    assert "x_bar[i] += " in src and "lk.atomic.add(x_bar" not in src
    assert "lk.atomic.add(k_bar, 0, " in src                     # a scalar's, at the top level
    heat = adjoint_text(W.heat_step, "u", "v")
    assert "lk.atomic.add(u_bar, i - 1, " in heat and "lk.atomic.add(u_bar, i, " in heat   # two loops, offsets
    phases = adjoint_text(W.two_phase_step, "x", "tmp", "out")
    assert "tmp_bar[i] += 1.0 * g" in phases and "x_bar[i] += -1.0 * g" in phases
    assert "lk.atomic.add(tmp_bar, (i + n - 1) % n, " in phases and "lk.atomic.add(x_bar, (i + 1) % n, " in phases


def adjoint_text(step, *wrt, form="scatter"):
    """The adjoint step of ``step`` with respect to ``wrt`` in ``form``, as Python source."""
    import ast as _ast

    from loopkern.adjoint import adjoint_function
    from loopkern.frontend import parse_step
    return _ast.unparse(adjoint_function(parse_step(step), set(wrt), form)[0].tree)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_the_adjoint_step_of_a_pointwise_update_alone(backend, rng):
    # kernel.adjoint() of nonlinear_inplace (plain updates of x_bar) on several threads
    # against jax.vjp of one jnp step in float64
    from refs import jax_x64
    n = 40
    x, bx = rng.standard_normal(n), rng.standard_normal(n)
    adj = lk.megakernel(nonlinear_inplace).adjoint("x", "k")
    dev = [x.copy(), bx.copy(), np.zeros(1)]
    if backend == "cuda":
        from numba import cuda
        dev = [cuda.to_device(d) for d in dev]
    adj(dev[0], dev[1], 1.3, dev[2], steps=1, start=4, backend=backend, **(dict(threads=32) if backend == "cuda"
                                                                             else {}))
    got = [d.copy_to_host() if backend == "cuda" else d for d in dev]
    with jax_x64():
        def one(x, kk):
            y = x * kk
            z = jnp.where(y > 0.0, jnp.tanh(y), 0.5 * y)
            return x + 0.1 * z * z + 0.05 * jnp.sin(4 + y)
        _, vjp = jax.vjp(one, jnp.asarray(x), jnp.float64(1.3))
        rx, rk = vjp(jnp.asarray(bx))
    np.testing.assert_allclose(got[1], np.asarray(rx), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[2][0], float(rk), rtol=1e-10)


def test_a_tuple_of_extents_at_the_top_of_the_step(rng):
    # n, m = u.shape[0], u.shape[1] (the README's Jacobi idiom) had no adjoint
    def smooth(t, u, v):
        n, m = u.shape[0], u.shape[1]
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            v[i, j] = 0.25 * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])

    u0, ubar0 = rng.random((5, 6)), rng.standard_normal((5, 6))
    u, v = u0.copy(), np.zeros((5, 6))
    vbar = rng.standard_normal((5, 6))
    ubar = ubar0.copy()
    lk.megakernel(smooth).adjoint("u", "v")(u, ubar, v, vbar.copy(), steps=1, backend="cpu")
    want = ubar0.copy()
    inner = vbar[1:-1, 1:-1] * 0.25
    want[:-2, 1:-1] += inner
    want[2:, 1:-1] += inner
    want[1:-1, :-2] += inner
    want[1:-1, 2:] += inner
    np.testing.assert_allclose(ubar, want, rtol=1e-12, atol=1e-12)


def _permuted_store(t, u, v, p, a):
    for i in lk.range(u.shape[0]):
        v[p[i]] = u[i] * a + u[i] * u[i]


def test_a_generated_step_that_fails_a_check_is_reported_at_the_users_step(rng):
    """Reverse mode with respect to a scalar of a step that stores through a permutation: the
    adjoint step loopkern generates fails the ownership check. The error names the user's step
    and says it is a limit of reverse mode (before session 36 it named 'sp_vjp_seg', a step the
    user never wrote, and advised lk.atomic); forward mode still works."""
    k = lk.megakernel(_permuted_store, swap=[("u", "v")])
    with jax_x64():
        u0 = jnp.asarray(rng.uniform(0.1, 0.9, 6))
        perm = jnp.asarray(rng.permutation(6))
        f = lambda u, a: jnp.sum(k.jax(u, u, perm, a, steps=3)[0] ** 2)
        with pytest.raises(lk.StepSyntaxError, match=r"in step '_permuted_store': reverse mode \(jax.grad\) is not "
                                                     r"available for this step: the step loopkern generates"):
            jax.grad(f, argnums=1)(u0, 0.5)
        with pytest.raises(lk.StepSyntaxError, match=r"in step '_permuted_store': reverse mode \(kernel.adjoint"):
            k.adjoint("u", "v", "a")

        def ref(u, a):
            for _ in range(3):
                u = u.at[perm].set(u * a + u * u)
            return jnp.sum(u ** 2)
        tan = jax.jvp(lambda a: f(u0, a), (0.5,), (1.0,))[1]
        np.testing.assert_allclose(float(tan), float(jax.grad(ref, argnums=1)(u0, 0.5)), rtol=1e-12)
