"""Derivatives through helper calls (``loopkern/inline.py``): a helper in expression form is
inlined into the tangent and adjoint steps; gradients and tangents against float64 JAX of the
same loop; helpers that are not in that form are still refused at their line."""

import math

import numpy as np
import pytest

import loopkern as lk
from helper_defs import scaled
from loopkern.errors import StepSyntaxError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from refs import jax_x64  # noqa: E402

C = 0.3
K = 5.0         # not the K of helper_defs: its helper is not inlined here


def flux(a, b):
    """A flux with a local and a module constant."""
    d = b - a
    return 0.5 * (a + b) - C * d * abs(d)


def bump(x):
    return x * math.exp(-x * x)


def both(a, b, c):
    # a helper calling helpers
    return flux(a, b) + bump(c)


def burgers(t, u, v, a):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + a * (flux(u[i - 1], u[i]) - flux(u[i], u[i + 1])) + 0.01 * both(u[i], u[i + 1], u[i - 1])
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]


def _flux_jnp(a, b):
    d = b - a
    return 0.5 * (a + b) - C * d * jnp.abs(d)


def _burgers_jnp(u, a, steps):
    def body(t, x):
        left, mid, right = x[:-2], x[1:-1], x[2:]
        both = _flux_jnp(mid, right) + left * jnp.exp(-left * left)
        new = mid + a * (_flux_jnp(left, mid) - _flux_jnp(mid, right)) + 0.01 * both
        return x.at[1:-1].set(new)
    return jax.lax.fori_loop(0, steps, body, u)


def test_grad_and_jvp_through_helpers_in_expression_form(rng):
    k = lk.megakernel(burgers, swap=[("u", "v")])
    with jax_x64():
        u0, w, du = (jnp.asarray(rng.standard_normal(37)) for _ in range(3))

        def ours(u, a):
            return ((k.jax(u, u, a, steps=19)[0] - w) ** 2).sum()

        def ref(u, a):
            return ((_burgers_jnp(u, a, 19) - w) ** 2).sum()
        got = jax.grad(ours, argnums=(0, 1))(u0, 0.2)
        want = jax.grad(ref, argnums=(0, 1))(u0, 0.2)
        for g, r in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-10, atol=1e-12)
        _, t = jax.jvp(ours, (u0, 0.2), (du, 0.5))
        _, t_ref = jax.jvp(ref, (u0, 0.2), (du, 0.5))
        assert float(t) == pytest.approx(float(t_ref), rel=1e-10)
    # the primal kernel still calls the helpers; the generated steps have them inlined
    assert "flux(" not in lk.megakernel(burgers, swap=[("u", "v")]).adjoint("u", "v", "a").source("cpu").replace(
        "_flux_", "")


def looped(a):
    s = 0.0
    for j in range(3):
        s += a * j
    return s


def with_loop(t, x, y):
    n = x.shape[0]
    for i in lk.range(n):
        y[i] = looped(x[i])


def from_elsewhere(t, x, y):
    n = x.shape[0]
    for i in lk.range(n):
        y[i] = scaled(x[i])


def shadowing(t, x, y):
    # the step's own C is not the module's C that flux reads
    n = x.shape[0]
    C = 2.0
    for i in lk.range(1, n):
        y[i] = flux(x[i - 1], x[i]) * C


@pytest.mark.parametrize("step, call", [(with_loop, "looped(x[i])"), (from_elsewhere, "scaled(x[i])"),
                                        (shadowing, "flux(x[i - 1], x[i])")])
def test_helpers_not_in_expression_form_are_refused_at_their_line(step, call):
    # a helper with a loop, one whose module's K is not the K of the step's module, and one
    # whose global C the step shadows with a local (inlined, they would read the wrong K, C)
    k = lk.megakernel(step)
    for derive in (k.adjoint, k.tangent):
        with pytest.raises(StepSyntaxError, match="only helpers in expression form are differentiated") as err:
            derive("x", "y")
        assert call in str(err.value)
