"""Reverse mode through inner ``range`` loops whose bounds are not constants (sums over
neighbours, bodies, a radius given as an argument): ``jax.grad`` through ``kernel.jax`` in
float64 against ``jax.grad`` of the same loop written in jnp, and the forms that still raise a
clear error at their line."""

import math

import numpy as np
import pytest

import loopkern as lk
from loopkern.errors import StepSyntaxError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from refs import jax_x64  # noqa: E402


def attract(t, x, y, w, c):
    # all pairs, the natural way: one parallel iteration per body, a plain range loop over the
    # others adding into two sums (one with -=), locals of the inner iteration, a math call
    n = x.shape[0]
    m = w.shape[0]
    for i in lk.range(n):
        xi = x[i]
        f = 0.0
        g = 1.0
        for j in range(m):
            d = xi - w[j]
            e = d * math.exp(-d * d)
            e = e * (1.0 + 0.1 * d)         # reassigned within the iteration
            f += c * e
            g -= 0.01 * e * e
        y[i] = xi + 0.1 * f * g


def _attract_jnp(x, y, w, c, steps):
    def body(t, s):
        x, y = s
        d = x[:, None] - w[None, :]
        e = d * jnp.exp(-d * d)
        e = e * (1.0 + 0.1 * d)
        f = (c * e).sum(axis=1)
        g = 1.0 - (0.01 * e * e).sum(axis=1)
        return x + 0.1 * f * g, x           # swapped: the newest state first
    return jax.lax.fori_loop(0, steps, body, (x, y))


def box_blur(t, u, v, r, a):
    # a stencil whose radius is an argument: the inner loop's bounds are computed
    n = u.shape[0]
    for i in lk.range(r, n - r):
        s = 0.0
        for k in range(-r, r + 1):
            s += u[i + k]
        v[i] = u[i] + a * (s / (2 * r + 1) - u[i])
    for i in lk.range(0, r):
        v[i] = u[i]
    for i in lk.range(n - r, n):
        v[i] = u[i]


def _box_blur_jnp(u, r, a, steps):
    n = u.shape[0]

    def body(t, x):
        s = sum(x[r + k:n - r + k] for k in range(-r, r + 1))
        return x.at[r:n - r].set(x[r:n - r] + a * (s / (2 * r + 1) - x[r:n - r]))
    return jax.lax.fori_loop(0, steps, body, u)


def test_grad_through_an_all_pairs_inner_loop(rng):
    k = lk.megakernel(attract, swap=[("x", "y")])
    with jax_x64():
        x0, w, wt = (jnp.asarray(rng.standard_normal(s)) for s in (33, 17, 33))

        def ours(x, ww, c):
            a, b, _ = k.jax(x, x, ww, c, steps=5)
            return (a * wt).sum() + (b ** 2).sum()

        def ref(x, ww, c):
            a, b = _attract_jnp(x, x, ww, c, 5)
            return (a * wt).sum() + (b ** 2).sum()
        args = (x0, w, 0.7)
        want = jax.grad(ref, argnums=(0, 1, 2))(*args)
        for fn in (jax.grad(ours, argnums=(0, 1, 2)), jax.jit(jax.grad(ours, argnums=(0, 1, 2)))):
            for g, r in zip(fn(*args), want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("r", [1, 3])
def test_grad_through_an_inner_loop_of_a_radius_given_as_an_argument(r, rng):
    k = lk.megakernel(box_blur, swap=[("u", "v")])
    with jax_x64():
        u0, w = (jnp.asarray(rng.random(40)) for _ in range(2))

        def ours(u, a):
            return ((k.jax(u, u, r, a, steps=21)[0] - w) ** 2).sum()

        def ref(u, a):
            return ((_box_blur_jnp(u, r, a, 21) - w) ** 2).sum()
        got = jax.grad(ours, argnums=(0, 1))(u0, 0.4)
        want = jax.grad(ref, argnums=(0, 1))(u0, 0.4)
        for g, rr in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(rr), rtol=1e-10, atol=1e-12)
        # the adjoint of the loop's additions lands on the neighbours with atomics (no gather:
        # the offsets come from the inner loop, not constants)
        src = k.adjoint("u", "v", "a").source("cpu")
        assert "atomic_add" in src


def carried(t, x, y, m, q):
    # a recurrence over an inner loop whose step is not a constant
    n = x.shape[0]
    for i in lk.range(n):
        p = 1.0
        for j in range(0, m, q):
            p = p * 0.5 + x[i]
        y[i] = p


def stores_inside(t, x, y, m):
    n = x.shape[0]
    for i in lk.range(n):
        for j in range(m):
            y[i] = x[i] * j


def local_after(t, x, y, m):
    n = x.shape[0]
    for i in lk.range(n):
        s = 0.0
        for j in range(m):
            d = x[i] * j
            s += d
        y[i] = s + d


def under_if(t, x, y, m):
    n = x.shape[0]
    for i in lk.range(n):
        s = 0.0
        if x[i] > 0.0:
            for j in range(m):
                s += x[i]
        y[i] = s


def product(t, x, y, m):
    n = x.shape[0]
    for i in lk.range(n):
        s = 1.0
        for j in range(m):
            s *= x[i]
        y[i] = s


@pytest.mark.parametrize("step, line, what", [
    (carried, "for j in range(0, m, q):", "when its step is 1 or a positive constant"),
    (stores_inside, "y[i] = x[i] * j", r"assigns locals \(x = e, x \+= e\); this statement is neither"),
    # (refused by the front end since session 29: 'd' is unassigned after a loop that runs no
    # iteration; with 'd = 0.0' before the loop reverse mode covers it)
    (local_after, "y[i] = s + d", "local 'd' may be read before it is assigned"),
    (under_if, "for j in range(m):", "an inner loop inside an 'if'"),
])
def test_inner_loops_reverse_mode_cannot_follow_are_refused_at_their_line(step, line, what):
    with pytest.raises(StepSyntaxError, match=what) as err:
        lk.megakernel(step).adjoint("x", "y")
    assert line in str(err.value)


def substeps(t, x, y, h, m, every):
    # sub-stepping: a recurrence (z = z + h * f(z)) over an inner loop of a count given as an
    # argument, a sum carried beside it, a local of the iteration, a step of 2 in a second loop
    n = x.shape[0]
    for i in lk.range(n):
        z = x[i]
        e = 0.0
        for s in range(m):
            f = -z * z * z + math.sin(z)
            z = z + h * f
            e += f * f
        for s in range(0, m, 2):
            z *= 1.0 - 0.1 * h
        y[i] = z + 0.01 * e * every


def _substeps_jnp(x, h, m, every, steps):
    def body(t, st):
        x, _ = st
        z, e = x, jnp.zeros_like(x)
        for _ in range(m):
            f = -z * z * z + jnp.sin(z)
            z = z + h * f
            e = e + f * f
        for _ in range(0, m, 2):
            z = z * (1.0 - 0.1 * h)
        return z + 0.01 * e * every, x
    return jax.lax.fori_loop(0, steps, body, (x, x))


@pytest.mark.parametrize("m", [0, 1, 5])
def test_grad_through_a_recurrence_over_an_inner_loop_of_computed_bounds(m, rng):
    k = lk.megakernel(substeps, swap=[("x", "y")])
    with jax_x64():
        x0, w = jnp.asarray(rng.uniform(-1, 1, 29)), jnp.asarray(rng.standard_normal(29))

        def ours(x, h, every):
            a, b = k.jax(x, x, h, m, every, steps=4)
            return (a * w).sum() + 0.5 * (b ** 2).sum()

        def ref(x, h, every):
            a, b = _substeps_jnp(x, h, m, every, 4)
            return (a * w).sum() + 0.5 * (b ** 2).sum()
        args = (x0, 0.2, 0.7)
        got = jax.grad(ours, argnums=(0, 1, 2))(*args)
        want = jax.grad(ref, argnums=(0, 1, 2))(*args)
        for g, r in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-10, atol=1e-12)


def test_grad_through_a_product_over_an_inner_loop(rng):
    # s *= x[i], m times: x[i] ** m, a recurrence the adjoint walks backwards
    k = lk.megakernel(product)
    with jax_x64():
        x0 = jnp.asarray(rng.uniform(0.5, 1.5, 17))
        got = jax.grad(lambda x: k.jax(x, jnp.zeros(17), 6, steps=1)[1].sum())(x0)
        np.testing.assert_allclose(np.asarray(got), 6 * np.asarray(x0) ** 5, rtol=1e-12)
