"""lk.fori_loop, lk.while_loop and lk.scan on JAX's CPU backend (the loopkern CPU backend runs the
kernel), each result against the same loop run by jax.lax on the same inputs: every supported
primitive on random inputs, then real bodies (1-D and 2-D heat, Jacobi to a tolerance, the
quadratic map's trajectory with scan, value iteration with a 25x25 matvec, a Thomas sweep), the
fallback to jax.lax (warning / error), jax.jit, traced bounds, derivatives and the caches.

Every compiled test passes ``fallback="error"``, so a body that silently ran as the lax loop
would fail instead of comparing lax with itself."""

import functools
import re
import warnings

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from refs import jax_x64

jax = pytest.importorskip("jax")
jnp = jax.numpy
lax = jax.lax


@pytest.fixture(autouse=True)
def cpu_only():
    if jax.default_backend() != "cpu":
        pytest.skip("these tests run on JAX's CPU backend (see tests/gpu for the GPU)")



def same(got, ref, exact=True, rtol=2e-6, atol=1e-6):
    """Same pytree, shapes, dtypes and weak types; values bitwise (exact) or to a tolerance.

    XLA's CPU code may fuse a multiply and an add into one FMA (one rounding), which the step's
    separate operations do not, so float bodies with both are compared to a tolerance of a few
    units in the last place; integer, boolean, selection and data-movement bodies bit for bit."""
    g_leaves, g_tree = jax.tree_util.tree_flatten(got)
    r_leaves, r_tree = jax.tree_util.tree_flatten(ref)
    assert g_tree == r_tree
    for g, r in zip(g_leaves, r_leaves):
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, g.dtype, r.shape, r.dtype)
        assert bool(getattr(g, "weak_type", False)) == bool(getattr(r, "weak_type", False))
        if exact:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=rtol, atol=atol)


def f32(rng, *shape, lo=0.0, hi=1.0):
    return jnp.asarray(rng.uniform(lo, hi, shape).astype(np.float32))


def assert_falls_back(body, x0, steps, prim, error_match=None):
    """lk.fori_loop of ``body`` raises naming ``prim`` with fallback="error", and otherwise runs
    jax.lax.fori_loop (same result) with a warning naming it."""
    with pytest.raises(lk.StepSyntaxError, match=error_match or prim):
        lk.fori_loop(0, steps, body, x0, fallback="error")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = lk.fori_loop(0, steps, body, x0)
    assert any(f"'{prim}'" in str(m.message) for m in w if issubclass(m.category, lk.JaxLoopWarning))
    same(got, lax.fori_loop(0, steps, body, x0))


# ------------------------------------------------------------------------------ one primitive each
# (name, body(i, x) -> x of the same shape and dtype, exact?) on a float32 vector of 40 in [0.5, 1.5)
PRIMITIVE_BODIES = [
    ("add_sub_mul", lambda i, x: (x * 0.75 + 0.125) - x * x * 0.25, True),
    ("div_by_array", lambda i, x: x / (x + 1.0) + 0.5, True),
    ("neg_abs", lambda i, x: jnp.abs(-x + 1.0) + 0.5, True),
    ("max_min", lambda i, x: jnp.minimum(jnp.maximum(x, 0.8), 1.2) + 0.01 * x, True),
    ("clip", lambda i, x: jnp.clip(x * 1.1, 0.6, 1.4), True),
    ("integer_pow", lambda i, x: x ** 3, True),
    ("integer_pow_neg_square", lambda i, x: 0.3 * x ** 2 + 0.2 * x ** -3 - 0.1 * jnp.square(x) + 0.6, False),
    ("where_compare", lambda i, x: jnp.where(x > 1.0, x * 0.9, jnp.where(x <= 0.7, x + 0.2, x)), True),
    ("rem", lambda i, x: jnp.fmod(x * 3.0, 1.0) + 0.5, True),
    ("exp_log", lambda i, x: jnp.log(jnp.exp(x) + 1.0) * 0.6, False),
    ("trig", lambda i, x: jnp.sin(x) * 0.5 + jnp.cos(x) * 0.5 + 0.3 * jnp.tanh(x), False),
    ("sqrt_rsqrt", lambda i, x: jnp.sqrt(x) * 0.5 + 0.5 * lax.rsqrt(x), False),
    ("log1p_expm1_atan2", lambda i, x: jnp.log1p(x) * 0.5 + 0.1 * jnp.expm1(x * 0.1) + 0.2 * jnp.arctan2(x, 2.0), False),
    ("sigmoid_erf", lambda i, x: jax.nn.sigmoid(x) + 0.1 * jax.scipy.special.erf(x), False),
    ("pow", lambda i, x: x ** 0.9 + 0.01, False),
    ("cast_int_roundtrip", lambda i, x: (x * 100.0).astype(jnp.int32).astype(jnp.float32) / 100.0 + 0.004, True),
    ("iota", lambda i, x: x * 0.5 + jnp.arange(40, dtype=jnp.float32) * 0.01, True),
    ("counter", lambda i, x: x * 0.9 + i.astype(jnp.float32) * 0.01, True),
    ("static_slices_at_set", lambda i, x: x.at[1:-1].set(0.5 * (x[:-2] + x[2:])), True),
    ("strided_slices", lambda i, x: x * 0.99 + 0.01 * jnp.concatenate([x[1::2], x[::2]]), True),
    ("strided_at_add", lambda i, x: x.at[::2].add(0.01 * x[1::2]), True),
    ("strided_at_set_reversed", lambda i, x: x.at[-2::-3].set(x[1::3] * 0.5 + 0.5), True),
    # a strided scatter's result read at other positions (session 29: the operand's values came out)
    ("strided_at_set_then_shift", lambda i, x: jnp.pad(x.at[0:14:3].set(-0.5)[2:], (0, 2)), True),
    ("strided_at_add_then_roll", lambda i, x: jnp.roll(x.at[::3].add(0.25), -1), True),
    ("strided_at_set_then_flip", lambda i, x: x.at[1::4].set(0.125)[::-1] * 0.5 + x * 0.5, True),
    ("strided_at_set_reversed_then_roll", lambda i, x: jnp.roll(x.at[-2::-3].set(0.5), -1), True),
    ("strided_at_add_2d_columns", lambda i, x: x.reshape(8, 5).at[:, 1::2].add(
        0.1 * x.reshape(8, 5)[:, ::2][:, :2]).reshape(40), True),
    ("at_set_one_index", lambda i, x: x.at[0].set(x[-1]).at[-1].set(x[1] * 0.5), True),
    ("pad_constant", lambda i, x: 0.25 * (jnp.pad(x, 1)[:-2] + 2 * x + jnp.pad(x, 1)[2:]) + 0.1, True),
    ("pad_edge", lambda i, x: (lambda p: (p[:-2] + p[1:-1] + p[2:]) / 3.0)(jnp.pad(x, 1, mode="edge")), True),
    ("concatenate", lambda i, x: jnp.concatenate([x[5:] * 0.5, x[:5] * 2.0]) * 0.99, True),
    ("roll", lambda i, x: 0.5 * (jnp.roll(x, 1) + jnp.roll(x, -3)), True),
    ("stack", lambda i, x: jnp.stack([x[:20] * 0.5, x[20:] + 0.25, x[::2]], axis=1)[:, ::2].T.reshape(40) * 0.9,
     True),
    ("flip", lambda i, x: 0.5 * (x + jnp.flip(x)), True),
    ("reshape_transpose", lambda i, x: x.reshape(5, 8).T.reshape(40) * 0.999, True),
    ("dynamic_slice_by_counter", lambda i, x: x * 0.9 + 0.1 * lax.dynamic_slice(x, (i % 30,), (10,)).sum(), False),
    ("dynamic_update_slice_by_counter", lambda i, x: lax.dynamic_update_slice(x, x[:3] * 0.5, (i,)), True),
    ("index_by_counter", lambda i, x: x.at[i].set(x[i - 1] * 0.5 + 0.25), True),
    ("reduce_sum", lambda i, x: x - 0.01 * jnp.sum(x) + 0.4, False),
    ("reduce_max_min", lambda i, x: (x - jnp.min(x)) / (jnp.max(x) - jnp.min(x)) + 0.5, True),
    ("reduce_mean_any_all", lambda i, x: jnp.where(jnp.any(x > 1.4) & jnp.all(x > 0.0), x * 0.95, x * 1.02)
     - 0.001 * jnp.mean(x), False),
    ("partial_reduction_axis", lambda i, x: (x.reshape(8, 5) * 0.9 + jnp.max(x.reshape(8, 5), axis=1,
                                                                                keepdims=True) * 0.1).reshape(40), True),
    ("reduction_then_use", lambda i, x: x / jnp.sqrt(jnp.sum(x * x)) * 6.0, False),
    ("matvec", lambda i, x: (jnp.eye(40, dtype=jnp.float32) * 0.5 + 0.01) @ x, False),
    ("dot_scalar", lambda i, x: x * 0.5 + 0.02 * jnp.dot(x, x) / 40.0, False),
    ("cumsum_normalised", lambda i, x: x * 0.5 + jnp.cumsum(x) / jnp.sum(x), False),
    ("cumsum_2d_axis0_reverse", lambda i, x: x * 0.5 + lax.cumsum(x.reshape(8, 5), axis=0, reverse=True).reshape(40)
     / 16.0, False),
    ("cummax_cummin_cumprod", lambda i, x: (lax.cummax(x) + lax.cummin(x.reshape(8, 5), axis=1, reverse=True).reshape(40))
     * 0.5 + 0.1 * jnp.cumprod(x * 0.1 + 0.95) - 0.05, False),
]


@pytest.mark.parametrize("name,body,exact", PRIMITIVE_BODIES, ids=[b[0] for b in PRIMITIVE_BODIES])
def test_primitive_matches_lax(name, body, exact, rng):
    x0 = f32(rng, 40, lo=0.9, hi=1.1)
    steps = int(rng.integers(3, 9))
    got = lk.fori_loop(0, steps, body, x0, fallback="error")
    ref = lax.fori_loop(0, steps, body, x0)
    same(got, ref, exact=False, rtol=(1e-6 if exact else 2e-5), atol=(1e-7 if exact else 2e-6))


def test_data_movement_is_bitwise(rng):
    def body(i, x):
        moved = jnp.where(i % 2 == 0, jnp.roll(jnp.flip(x), 3), jnp.concatenate([x[7:], jnp.pad(x, 2)[:7]]))
        return moved.reshape(5, 8).T.reshape(40).at[3:9].set(x[::2][:6]).at[0].set(-x[39])
    x0 = f32(rng, 40)
    same(lk.fori_loop(0, 7, body, x0, fallback="error"), lax.fori_loop(0, 7, body, x0))


INT_BODIES = [
    ("int_arith_wraps", lambda i, c: c * 1103515245 + 12345, True),
    ("int_floordiv_mod", lambda i, c: (c // 3) * 7 + c % 5 - i, True),
    ("int_lax_div_rem", lambda i, c: lax.div(c, 4) + lax.rem(c, 7) * 3 + 11, True),
    ("int_bitwise", lambda i, c: (c ^ (c << 1 if False else c * 2)) & 0xFFFF | 3, True),
    ("int_max_where", lambda i, c: jnp.where(c > 0, c - 1000, -c + 17), True),
    ("int_cumsum_cummax", lambda i, c: (jnp.cumsum(c % 1000) + lax.cummax(c, reverse=True)) % 100003 - i, True),
]


@pytest.mark.parametrize("name,body,exact", INT_BODIES, ids=[b[0] for b in INT_BODIES])
def test_integer_bodies_match_lax_bitwise(name, body, exact, rng):
    c0 = jnp.asarray(rng.integers(-10 ** 6, 10 ** 6, 33).astype(np.int32))
    got = lk.fori_loop(0, 6, body, c0, fallback="error")
    same(got, lax.fori_loop(0, 6, body, c0))


def test_size_one_operands_are_stretched_as_jax_does(rng):
    """JAX's binary primitives stretch a size-1 operand themselves (``c[:1] + c`` is
    ``add f32[1] f32[6]``, no broadcast_in_dim): each element reads that operand's only one
    (read at the full index before, it gave c + c and read past the end of a (1,) array)."""
    m0 = f32(rng, 5, 6, lo=-1.0, hi=1.0)
    row = f32(rng, 1, 6, lo=-1.0, hi=1.0)
    bodies = [
        lambda i, c: c[:1] + 0.5 * c,
        lambda i, c: c * c[-1:] * 0.9,
        lambda i, c: c - 0.25 * c[:, :1] + c[2:3, :],
        lambda i, c: c + row,
        lambda i, c: lax.dynamic_slice(c, (i % 5, 0), (1, 6)) * 0.5 + c,
        lambda i, c: jnp.cumsum(c, axis=1)[:, -1:] * 0.1 + c,
    ]
    for body in bodies:
        same(lk.fori_loop(0, 3, body, m0, fallback="error"), lax.fori_loop(0, 3, body, m0), exact=False)
    # a (1,) carry beside a (6,) one, and scan's xs of shape (n, 1)
    pair = (f32(rng, 1), f32(rng, 6))
    body2 = lambda i, c: (c[0] * 0.5, c[1] + c[0])
    same(lk.fori_loop(0, 4, body2, pair, fallback="error"), lax.fori_loop(0, 4, body2, pair), exact=False)
    xs = f32(rng, 7, 1)
    f = lambda c, x: (c + x, c * x)
    same(lk.scan(f, pair[1], xs, fallback="error"), lax.scan(f, pair[1], xs), exact=False)


def test_an_edge_cell_concatenated_keeps_the_body_a_stencil():
    """v[:1] in a concatenation is read at the loop's index (known to be 0 there), not at a
    literal 0: the lowered body stays a stencil, so tile mode can run it (the size-1 rule
    above made it c0[0] and tile mode refused the body on the GPU)."""
    from loopkern.jaxloops import loops
    from loopkern.stencil import Stencil, find_stencil
    a0 = np.zeros(64, np.int32)

    def body(i, v):
        return (jnp.concatenate([v[:1], v[:-1]]) * 2 + jnp.concatenate([v[1:], v[-1:]]) + i) % 1000
    traced = loops._trace_body(lambda i, x: [body(i, x)], [loops._aval(a0)], lead=(jax.ShapeDtypeStruct((), np.int32),))
    plan = loops._lower(loops.flatten(traced[0]), [("index",), ("carry", 0)], {0: 0}, {0: 1})
    assert isinstance(find_stencil(loops._kernel(plan).spec), Stencil)
    x0 = jnp.asarray(((np.arange(64) * 7) % 19).astype(np.int32))
    same(lk.fori_loop(0, 5, body, x0, fallback="error"), lax.fori_loop(0, 5, body, x0))


def test_loop_index_type_and_trip_count_are_lax_s(rng):
    """The body's index is typed as jax.lax.fori_loop types it (concrete bounds of any integer
    type: a weakly typed default int; traced ones: their common type), so integer promotion in
    the body is lax's; traced narrow or unsigned bounds count without wrapping around; an
    unsigned counter carry counts down modulo its range; bounds lax rejects are rejected."""
    c0 = f32(rng, 8)
    a8 = jnp.asarray(rng.integers(-128, 128, 8).astype(np.int8))
    bodies = [lambda i, c: c + (a8 * i).astype(jnp.float32),          # int8 * weak index: int8
              lambda i, c: c + (i * 100).astype(jnp.float32)]
    for body in bodies:
        for lo, hi in [(0, 7), (jnp.int8(0), jnp.int8(5)), (np.int16(2), np.int16(6))]:
            same(lk.fori_loop(lo, hi, body, c0, fallback="error"), lax.fori_loop(lo, hi, body, c0))
    same(lk.fori_loop(0, 3, lambda i, c: c * 3 + i, 1, fallback="error"), lax.fori_loop(0, 3, lambda i, c: c * 3 + i, 1))
    for lo, hi in [(np.uint8(9), np.uint8(2)), (np.int8(-100), np.int8(100)), (np.uint32(9), np.uint32(2)),
                   (np.int32(-5), np.int32(4)), (np.uint16(3), np.uint16(60000))]:
        def f(loop, lo, hi):
            return loop(lo, hi, lambda i, c: c + 1.0, c0, **({"fallback": "error"} if loop is lk.fori_loop else {}))
        same(jax.jit(lambda a, b: f(lk.fori_loop, a, b))(lo, hi), jax.jit(lambda a, b: f(lax.fori_loop, a, b))(lo, hi))
        if np.dtype(hi.dtype).kind == "i":        # (lax refuses a Python int beside an unsigned bound)
            same(jax.jit(lambda b: f(lk.fori_loop, 0, b))(hi), jax.jit(lambda b: f(lax.fori_loop, 0, b))(hi))
    for k0 in (jnp.uint32(10), jnp.uint8(1), jnp.uint16(0)):
        same(lk.fori_loop(0, 3, lambda i, k: k - 1, k0, fallback="error"), lax.fori_loop(0, 3, lambda i, k: k - 1, k0))
    wl = (lambda c: c[1] < 5, lambda c: (c[0] - 2, c[1] + 1, c[2] * 0.5), (jnp.uint8(3), 0, c0))
    same(lk.while_loop(*wl, fallback="error"), lax.while_loop(*wl))
    with pytest.raises(TypeError):
        jax.jit(lambda a, b: lax.fori_loop(a, b, lambda i, c: c + 1.0, c0))(jnp.int16(1), jnp.int32(5))
    with pytest.raises(TypeError):
        jax.jit(lambda a, b: lk.fori_loop(a, b, lambda i, c: c + 1.0, c0))(jnp.int16(1), jnp.int32(5))


def test_bool_carry_and_logic(rng):
    b0 = jnp.asarray(rng.random(31) > 0.5)

    def body(i, b):           # rule 90 (xor of the neighbours), with a fixed edge
        return jnp.logical_xor(jnp.roll(b, 1), jnp.roll(b, -1)).at[0].set(True) | (~b & False)
    same(lk.fori_loop(0, 9, body, b0, fallback="error"), lax.fori_loop(0, 9, body, b0))


def test_float64_and_int64_under_x64(rng):
    with jax_x64():
        x0 = jnp.asarray(rng.random(50))
        k0 = jnp.asarray(rng.integers(-2 ** 40, 2 ** 40, 50))

        def body(i, c):
            x, k = c
            x = x.at[1:-1].set(x[1:-1] + 0.1 * (x[:-2] - 2 * x[1:-1] + x[2:]))
            return x, k * 3 + i
        got = lk.fori_loop(0, 11, body, (x0, k0), fallback="error")
        assert got[0].dtype == jnp.float64 and got[1].dtype == jnp.int64
        ref = lax.fori_loop(0, 11, body, (x0, k0))
        same(got[0], ref[0], exact=False, rtol=1e-14, atol=1e-15)     # XLA may fuse into an FMA
        same(got[1], ref[1])                                           # int64 wraps the same


def test_int64_arithmetic_wraps_before_comparisons_and_orderings(rng):
    """int64 sums, differences and products that overflow wrap, as in XLA, also where a
    comparison, max, sort or division reads them: Numba marks signed arithmetic as never
    wrapping, so LLVM folded `u * 4 > 0` into `u > 0` (found by session 36's adversarial run:
    a while_loop doubling an int64 ran two iterations too many)."""
    with jax_x64():
        edge = np.array([2 ** 62, -2 ** 62, 2 ** 63 - 1, -2 ** 63, 2 ** 61 + 7, -1, 0, 5], np.int64)
        x = jnp.asarray(np.concatenate([edge, rng.integers(-2 ** 63, 2 ** 63 - 1, 24, dtype=np.int64,
                                                            endpoint=True)]))

        def body(i, c):
            u, flags, q = c
            v = u * 4
            w = u + u
            return (u, jnp.stack([v > 0, w < u, u + 1 > u, -u < 0, u - 3 > u]),
                    jnp.stack([w // 3, jnp.max(u + 10) + 0 * u, jnp.sort(u + 10), jnp.cumsum(w), v % 7]))
        c0 = (x, jnp.zeros((5, x.shape[0]), bool), jnp.zeros((5, x.shape[0]), jnp.int64))
        same(lk.fori_loop(0, 1, body, c0, fallback="error"), lax.fori_loop(0, 1, body, c0))

        def cond(c):
            return c[0] * 2 > 0

        def double(c):
            return c[0] * 2, c[1] + 1
        c0 = (jnp.int64(1), jnp.int32(0))
        same(lk.while_loop(cond, double, c0, fallback="error"), lax.while_loop(cond, double, c0))


def test_unsigned_division_and_remainder_as_xla(rng):
    """Unsigned // and %, lax.div/rem: x // 0 has every bit set and x % 0 is x (XLA); uint64
    quotients beyond 2**53 exact (the quotient went through a float64 before)."""
    def body(i, c):
        a, b = c[0], c[1]
        return jnp.stack([a // b, a % b, lax.div(a, b) ^ lax.rem(b, a), b])

    def check(dtype):
        info = np.iinfo(dtype)
        a = rng.integers(0, int(info.max), 40, dtype=np.uint64, endpoint=True).astype(dtype)
        b = rng.integers(0, 9, 40).astype(dtype)
        b[::5] = 0
        b[1::7] = info.max
        c0 = jnp.asarray(np.stack([a, b, a, b]))
        same(lk.fori_loop(0, 1, body, c0, fallback="error"), lax.fori_loop(0, 1, body, c0))
    for dtype in (np.uint8, np.uint16, np.uint32):
        check(dtype)
    with jax_x64():
        check(np.uint64)


# ------------------------------------------------------------------------------ real bodies
def heat1d_body(alpha):
    def body(i, u):
        return u.at[1:-1].set(u[1:-1] + alpha * (u[:-2] - 2 * u[1:-1] + u[2:]))
    return body


def test_heat1d_is_one_lean_parallel_loop_and_bitwise(rng):
    u0 = f32(rng, 300)
    body = heat1d_body(0.25)
    got = lk.fori_loop(0, 57, body, u0, fallback="error")
    same(got, lax.fori_loop(0, 57, body, u0))
    step = _source_of(lambda: lk.fori_loop(0, 1, body, u0, fallback="error"))
    # one parallel loop over the interior writing the new buffer: no barrier, no scratch, no branch
    assert step.count("lk.range(") == 1 and "lk.range(1, 299)" in step
    assert "lk.sync" not in step and " if " not in step and "lk.max" not in step


def _source_of(call):
    """The step source of the kernel that ``call`` runs."""
    from loopkern.jaxloops import loops
    call()
    return loops._last_source


def test_heat1d_in_jit_with_traced_bounds_and_scalar(rng):
    u0 = f32(rng, 129)

    @jax.jit
    def f(u, lo, hi, alpha):
        return lk.fori_loop(lo, hi, heat1d_body(alpha), u, fallback="error")

    @jax.jit
    def ref(u, lo, hi, alpha):
        return lax.fori_loop(lo, hi, heat1d_body(alpha), u)
    for lo, hi in [(0, 13), (5, 9), (-4, 3), (7, 2)]:
        same(f(u0, lo, hi, jnp.float32(0.2)), ref(u0, lo, hi, jnp.float32(0.2)), exact=False, rtol=1e-6)


def _jacobi_body(c):
    """Jacobi to a tolerance as JAX users write it: (field, last change, count)."""
    x, _, k = c
    new = x.at[1:-1, 1:-1].set(0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
    return new, jnp.max(jnp.abs(new - x)), k + 1


def test_heat2d_and_jacobi_to_tolerance(rng):
    g0 = f32(rng, 20, 17)

    def heat2d(i, x):
        return x.at[1:-1, 1:-1].add(0.2 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:] - 4 * x[1:-1, 1:-1]))
    same(lk.fori_loop(0, 25, heat2d, g0, fallback="error"), lax.fori_loop(0, 25, heat2d, g0), exact=False,
         rtol=1e-6, atol=1e-7)
    tol = np.float32(1e-3)

    body = _jacobi_body

    def cond(c):
        return (c[1] > tol) & (c[2] < 1000)
    init = (g0, jnp.float32(jnp.inf), 0)
    got = lk.while_loop(cond, body, init, fallback="error")
    ref = lax.while_loop(cond, body, init)
    same(got, ref)
    assert 5 < int(got[2]) < 1000
    # the counter is kept out of memory and the condition needs no extra reduction
    step = _source_of(lambda: lk.while_loop(cond, body, init, fallback="error"))
    assert step.count("lk.max(") == 1
    # the max runs over every cell, the store over the interior: the loop is split into the
    # interior, where no condition is left, and a rim loop (Lowering.split_loop)
    interior = re.match(r"((?: {8}.*\n)*)", step.split("for i8_0, i8_1 in lk.grid((1, 19), (1, 16)):\n")[1])[1]
    assert " if " not in interior and "c0n[i8_0, i8_1] = " in interior, step
    assert "while i8_v < 70:" in step, step
    # a field this small runs in one block with its arrays in shared memory (scope="auto"):
    # the rim's loads stay in the rim loop (lower.PREFETCH_RIM_MIN_CELLS)
    assert not re.findall(r"(l\d+) = c0\[", step.split("for i8_0, i8_1 in lk.grid(")[0]), step
    # past that size the loads of a thread's first rim cell are issued before the interior
    # loop, its max taken after it (Lowering._prefetch_rim): the two loops' loads are in flight
    # together
    from loopkern.jaxloops import lower
    saved = lower.PREFETCH_RIM_MIN_CELLS
    lower.PREFETCH_RIM_MIN_CELLS = 20 * 17 - 1
    try:
        early = _source_of(lambda: lk.while_loop(cond, body, init, fallback="error"))
        same(lk.while_loop(cond, body, init, fallback="error"), ref)
    finally:
        lower.PREFETCH_RIM_MIN_CELLS = saved
    head, tail = early.split("for i8_0, i8_1 in lk.grid(")
    rim_loads = re.findall(r"(l\d+) = c0\[", head)
    assert rim_loads and all(f"abs(({n} - {n}))" in tail.split("while i8_v < 70:")[0] for n in rim_loads), early
    # its neighbour reads are in the interior loop (the loop's bounds keep them inside the
    # grid) or at a literal edge row or column: index_bounds proves each index non-negative,
    # so no read keeps Python's wraparound
    from loopkern.jaxloops import loops
    kernel = next(k for (src, _), k in loops._kernels.items() if src == step)
    reads = re.findall(r"\bc0\[([^\]]*)\]", kernel.source("cuda", "grid"))
    # (the rim loop's reads at a row or column of the edge have a literal there)
    parts = [p.strip() for i in reads for p in re.split(r",\s*(?![^()]*\))", i)]
    assert len(reads) >= 5 and all(p.startswith("_lk_np.uint64(") or p.isdigit() for p in parts), reads


def test_while_loop_zero_iterations_and_chunks(rng):
    x0 = f32(rng, 16)

    def body(c):
        x, k = c
        return x * 0.5 + 0.1, k + 1
    # the condition is false at the start: no step at all (as lax)
    same(lk.while_loop(lambda c: c[1] < 0, body, (x0, 0), fallback="error"),
         lax.while_loop(lambda c: c[1] < 0, body, (x0, 0)))
    # a loop longer than one launch: max_steps is steps per launch, not a bound
    got = lk.while_loop(lambda c: c[1] < 23, body, (x0, 0), max_steps=5, fallback="error")
    same(got, lax.while_loop(lambda c: c[1] < 23, body, (x0, 0)))
    assert int(got[1]) == 23
    # a condition on a value read from memory (every thread reduces it); the sum falls to 3.2
    got = lk.while_loop(lambda c: jnp.sum(c[0]) > 4.0, body, (x0 * 4, 0), fallback="error")
    same(got, lax.while_loop(lambda c: jnp.sum(c[0]) > 4.0, body, (x0 * 4, 0)), exact=False)
    with pytest.raises(lk.ArgumentError, match="max_steps"):
        lk.while_loop(lambda c: c[1] < 3, body, (x0, 0), max_steps=0)


def test_scalar_while_loop_newton(rng):
    a = float(rng.uniform(2, 50))

    def body(c):
        x, dx = c
        nx = 0.5 * (x + a / x)
        return nx, jnp.abs(nx - x)
    init = (jnp.float32(a), jnp.float32(1.0))
    got = lk.while_loop(lambda c: c[1] > 1e-6, body, init, fallback="error")
    same(got, lax.while_loop(lambda c: c[1] > 1e-6, body, init))
    assert abs(float(got[0]) - np.sqrt(a)) < 1e-5 * np.sqrt(a)


def test_quadratic_map_scan_records_the_trajectory(rng):
    def qmap(x, _):
        y = 4.0 * x * (1.0 - x)
        return y, y
    with jax_x64():
        x0 = jnp.float64(rng.uniform(0.1, 0.9))
        got = lk.scan(qmap, x0, None, length=500, fallback="error")
        same(got, lax.scan(qmap, x0, None, length=500))
        step = _source_of(lambda: lk.scan(qmap, x0 + 0.0, None, length=501, fallback="error"))
        assert "lk." not in step.split(":", 1)[1]      # one thread, no barrier (thread scope)
        # the carry is stored after y[t], so the compiler keeps it in a register between steps
        lines = [ln.strip() for ln in step.splitlines()]
        carry_store = max(i for i, ln in enumerate(lines) if ln.startswith("c0[0] ="))
        ys_store = max(i for i, ln in enumerate(lines) if ln.startswith("y0[t] ="))
        assert ys_store < carry_store == len(lines) - 1, step
    x0 = jnp.float32(0.3)
    same(lk.scan(qmap, x0, None, length=100, fallback="error"), lax.scan(qmap, x0, None, length=100))


def test_scan_with_xs_pytrees_reverse_and_array_ys(rng):
    xs = {"a": f32(rng, 12, 5), "b": f32(rng, 12)}

    def f(c, x):
        s, v = c
        v = 0.5 * v + x["a"] * x["b"]
        s = s + jnp.sum(v)
        return (s, v), (v * 2.0, s)
    init = (jnp.float32(0.0), f32(rng, 5))
    for reverse in (False, True):
        got = lk.scan(f, init, xs, reverse=reverse, fallback="error")
        same(got, lax.scan(f, init, xs, reverse=reverse), exact=False, rtol=1e-5)


def test_value_iteration_with_small_dot(rng):
    S, A = 25, 3
    P = rng.random((S, A, S))
    P /= P.sum(-1, keepdims=True)
    P, R = jnp.asarray(P, jnp.float32), jnp.asarray(rng.random((S, A)), jnp.float32)

    def body(c):
        v, _ = c
        vn = jnp.max(R + 0.9 * P @ v, axis=1)
        return vn, jnp.max(jnp.abs(vn - v))
    init = (jnp.zeros(S, jnp.float32), jnp.float32(1.0))
    got = lk.while_loop(lambda c: c[1] > 1e-4, body, init, fallback="error")
    ref = lax.while_loop(lambda c: c[1] > 1e-4, body, init)
    same(got, ref, exact=False, rtol=1e-5, atol=2e-5)
    # against float64 value iteration in NumPy: the fixed point
    Pn, Rn, v = np.asarray(P, np.float64), np.asarray(R, np.float64), np.zeros(S)
    for _ in range(500):
        v = (Rn + 0.9 * Pn @ v).max(1)
    np.testing.assert_allclose(np.asarray(got[0]), v, atol=2e-3)


def test_thomas_sweep_with_counter_indexed_updates(rng):
    n = 16
    a, b, c, d = (f32(rng, n) for _ in range(4))
    b = b + 3.0

    def fwd(i, s):
        cp, dp = s
        m = b[i] - a[i] * cp[i - 1]
        return cp.at[i].set(c[i] / m), dp.at[i].set((d[i] - a[i] * dp[i - 1]) / m)

    def back(k, x):
        i = n - 2 - k
        return x.at[i].set(dp[i] - cp[i] * x[i + 1])
    init = (jnp.zeros(n).at[0].set(c[0] / b[0]), jnp.zeros(n).at[0].set(d[0] / b[0]))
    cp, dp = lk.fori_loop(1, n, fwd, init, fallback="error")
    same((cp, dp), lax.fori_loop(1, n, fwd, init), exact=False)       # XLA may fuse into FMAs
    x = lk.fori_loop(0, n - 1, back, dp.at[-1].set(dp[-1]), fallback="error")
    same(x, lax.fori_loop(0, n - 1, back, dp), exact=False)
    A = np.diag(np.asarray(b, np.float64)) + np.diag(np.asarray(a, np.float64)[1:], -1) + \
        np.diag(np.asarray(c, np.float64)[:-1], 1)
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(A, np.asarray(d, np.float64)), rtol=1e-4, atol=1e-5)


def test_trajectory_recording_is_in_place(rng):
    def body(i, c):
        x, hist = c
        x = x * 0.9 + 0.05 * jnp.sin(x)
        return x, hist.at[i].set(jnp.mean(x))
    init = (f32(rng, 64), jnp.zeros(30, jnp.float32))
    got = lk.fori_loop(0, 30, body, init, fallback="error")
    same(got, lax.fori_loop(0, 30, body, init), exact=False, rtol=1e-6, atol=1e-7)
    step = _source_of(lambda: lk.fori_loop(0, 30, body, (init[0], init[1] + 1), fallback="error"))
    assert "c1n" not in step          # the history is one buffer, written one element per step


# ------------------------------------------------------------------------------ pytrees and types
def test_pytree_carry_weak_types_and_passthrough(rng):
    x0 = f32(rng, 10)

    def body(i, c):
        return {"x": c["x"] * 0.5 + c["s"], "s": c["s"] * 2.0, "k": c["k"] + 2, "fixed": c["fixed"],
                "n": c["n"] - i}
    init = {"x": x0, "s": 0.25, "k": 1, "fixed": x0 * 3, "n": jnp.int32(7)}
    same(lk.fori_loop(0, 5, body, init, fallback="error"), lax.fori_loop(0, 5, body, init))


def test_a_weak_carry_stays_weak_inside_the_body_as_in_lax(rng):
    """lax traces the body once with the init's avals: a weakly typed carry (a Python number)
    stays weak inside the body even where the body returns it strongly typed, so int8 * carry
    is int8 (wrapping); the loop returns the body output's weak types. (loopkern retraced with
    a strong carry: int32 arithmetic, other values and dtypes.)"""
    d8 = jnp.asarray(rng.integers(-128, 128, 6).astype(np.int8))
    z = jnp.zeros(6, jnp.float32)
    body = lambda i, c: (c[0] + jnp.int32(5), c[1] + (d8 * c[0]).astype(jnp.float32))
    same(lk.fori_loop(0, 10, body, (1, z), fallback="error"), lax.fori_loop(0, 10, body, (1, z)))
    wl = (lambda c: c[0] < 40, lambda c: body(0, c), (1, z))
    same(lk.while_loop(*wl, fallback="error"), lax.while_loop(*wl))
    x32, x8 = jnp.arange(10, dtype=jnp.int32), jnp.asarray(rng.integers(-128, 128, 10).astype(np.int8))
    f = lambda c, x: (c + x[0], c * x[1])
    same(lk.scan(f, 0, (x32, x8), fallback="error"), lax.scan(f, 0, (x32, x8)))
    f2 = lambda c, x: (c + x, c)
    xs = f32(rng, 3)
    same(lk.scan(f2, 0.0, xs, fallback="error"), lax.scan(f2, 0.0, xs))
    weak_out = lambda i, c: jnp.where(c > 0.5, 1.0, 0.5) * c
    same(lk.fori_loop(0, 4, weak_out, z + 1, fallback="error"), lax.fori_loop(0, 4, weak_out, z + 1))


def test_closure_over_arrays_and_traced_values(rng):
    w = f32(rng, 24)
    x0 = f32(rng, 24)

    @jax.jit
    def f(x, scale):
        return lk.fori_loop(0, 6, lambda i, u: u * w * scale + 0.1, x, fallback="error")

    @jax.jit
    def g(x, scale):
        return lax.fori_loop(0, 6, lambda i, u: u * w * scale + 0.1, x)
    same(f(x0, jnp.float32(0.9)), g(x0, jnp.float32(0.9)), exact=False, rtol=1e-6)


# ------------------------------------------------------------------------------ cond and switch
def test_cond_on_a_reduction_and_switch_on_the_counter(rng):
    """lax.cond and lax.switch in a body become selects between their inlined branches."""
    x0 = f32(rng, 50)

    def halve_or_drift(i, x):
        return lax.cond(jnp.max(x) > 0.5, lambda y: y * 0.9, lambda y: y + 0.01 * i, x)
    same(lk.fori_loop(0, 30, halve_or_drift, x0, fallback="error"), lax.fori_loop(0, 30, halve_or_drift, x0))

    def three_ways(i, x):
        return lax.switch(i % 3, [lambda y: y * 0.5, lambda y: y + 1.0, lambda y: jnp.sin(y)], x)
    same(lk.fori_loop(0, 7, three_ways, x0, fallback="error"), lax.fori_loop(0, 7, three_ways, x0),
         exact=False)
    step = _source_of(lambda: lk.fori_loop(0, 7, three_ways, x0 + 0.0, fallback="error"))
    assert "cond" not in step and "sin(" in step

    # an index past the last branch is clamped, as lax.switch does
    def clamped(i, x):
        return lax.switch(i - 2, [lambda y: y - 1.0, lambda y: y * 2.0], x)
    same(lk.fori_loop(0, 6, clamped, x0, fallback="error"), lax.fori_loop(0, 6, clamped, x0))


def test_cond_with_pytree_operands_in_while_loop_and_scan(rng):
    a0, b0 = f32(rng, 8, 8), jnp.float32(0.0)

    def body(c):
        x, total, k = c
        x, total = lax.cond(k % 2 == 0, lambda p: (p[0] * 0.5, p[1] + jnp.sum(p[0])),
                            lambda p: (p[0] + 0.25, p[1] - 1.0), (x, total))
        return x, total, k + 1
    init = (a0, b0, jnp.int32(0))
    same(lk.while_loop(lambda c: c[2] < 9, body, init, fallback="error"),
         lax.while_loop(lambda c: c[2] < 9, body, init), exact=False)

    def scan_body(c, x):
        y = lax.cond(x > 0.5, lambda v: v * x, lambda v: v - x, c)
        return y, y * 2.0
    xs = f32(rng, 12)
    same(lk.scan(scan_body, jnp.float32(1.0), xs, fallback="error"), lax.scan(scan_body, jnp.float32(1.0), xs))


_UNTAKEN_WHILE = """
import sys
import jax.numpy as jnp
import numpy as np
from jax import lax
import loopkern as lk

def countdown(s):          # ends only for whole numbers >= 0
    return lax.while_loop(lambda t: t != 0.0, lambda t: t - 1.0, s)

def body(i, c):            # counts down only where c >= 0: never for the negative start below
    return lax.cond(c >= 0.0, countdown, lambda s: s + 0.5, c)

def switched(i, c):        # a while_loop two conds deep, taken on some steps only
    def inner(s):
        return lax.cond(s[0] > 1.0, lambda z: lax.while_loop(lambda t: t[0] > 0.5, lambda t: t - 1.0, z),
                        lambda z: z * 2.0, s)
    return lax.switch(i % 3, [inner, lambda s: s - 0.25, lambda s: s + 1.0], c)

for x in (-1.0, -2.5, 3.0):
    got = lk.fori_loop(0, 4, body, jnp.float32(x), fallback="error")
    want = lax.fori_loop(0, 4, body, jnp.float32(x))
    assert float(got) == float(want), (x, got, want)
c0 = jnp.asarray(np.array([-1.0, 3.5], np.float32))
got = lk.fori_loop(0, 7, switched, c0, fallback="error")
np.testing.assert_array_equal(np.asarray(got), np.asarray(lax.fori_loop(0, 7, switched, c0)))
print("ok")
"""


def test_a_while_loop_in_a_branch_not_taken_does_not_run(tmp_path):
    """lax.cond's branches are inlined and selected between; a while_loop inside one ran even
    where its branch was not taken, and one that ends only for the taken branch's operands hung
    the kernel (found in session 32). It now runs no iteration there. In a child process with
    a time limit, so that the old behaviour fails the test instead of hanging it."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu", LOOPKERN_CACHE_DIR=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path))
    try:
        out = subprocess.run([sys.executable, "-c", _UNTAKEN_WHILE], capture_output=True, text=True, timeout=300,
                             env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("lk.fori_loop did not return within 300 s: the while_loop of a branch not taken ran")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_bounds_that_lax_refuses_are_refused_with_its_error():
    # concrete bounds of two integer types (int8 beside int32) and shape-(1,) bounds: lk ran
    # the first and named an internal argument for the second (found in session 32)
    body = lambda i, c: c * 2.0 + i      # noqa: E731
    for lo, hi in ((jnp.int8(0), jnp.int32(4)), (jnp.uint32(0), 4), (True, 3), (jnp.array([0]), jnp.array([4]))):
        with pytest.raises(TypeError) as want:
            lax.fori_loop(lo, hi, body, jnp.float32(1.0))
        with pytest.raises(TypeError) as got:
            lk.fori_loop(lo, hi, body, jnp.float32(1.0), fallback="error")
        assert str(got.value) == str(want.value)
    for lo, hi in ((0, jnp.int8(4)), (np.int64(0), 4), (np.int8(1), np.int8(3))):    # what lax takes runs
        same(lk.fori_loop(lo, hi, body, jnp.float32(1.0), fallback="error"), lax.fori_loop(lo, hi, body, jnp.float32(1.0)))


def test_a_checkpointed_body_is_compiled(rng):
    # jax.checkpoint's primitive is remat2 in JAX 0.10: it fell back, with a warning pointing
    # into loopkern
    x0 = f32(rng, 33)
    body = jax.checkpoint(lambda i, x: x.at[1:-1].set(0.5 * (x[:-2] + x[2:])))
    same(lk.fori_loop(0, 6, body, x0, fallback="error"), lax.fori_loop(0, 6, body, x0))


def test_an_unsupported_primitive_inside_a_branch_falls_back_naming_it(rng):
    x0 = f32(rng, 20)

    def body(i, x):
        return lax.cond(i > 2, lambda y: jnp.linalg.eigh(jnp.outer(y, y) + jnp.eye(20))[0], lambda y: y * 0.5, x)
    assert_falls_back(body, x0, 4, "eigh")


# ------------------------------------------------------------------------------ argmax, argmin
def test_argmax_and_argmin_whole_and_along_an_axis(rng):
    x0 = f32(rng, 40)

    def halve_the_largest(i, x):
        k = jnp.argmax(x)
        return x.at[k].set(x[k] * 0.5) + 0.001 * jnp.argmin(x).astype(jnp.float32)
    same(lk.fori_loop(0, 25, halve_the_largest, x0, fallback="error"), lax.fori_loop(0, 25, halve_the_largest, x0))

    def rows(i, x):
        m = x.reshape(8, 5)
        return (m * 0.9 + 0.02 * jnp.argmax(m, axis=1, keepdims=True) - 0.01 * jnp.argmin(m, axis=0)).reshape(40)
    same(lk.fori_loop(0, 6, rows, x0, fallback="error"), lax.fori_loop(0, 6, rows, x0), exact=False)


def test_argmax_ties_nans_and_integers_as_jax(rng):
    # ties: the first index; a NaN: the first NaN's index (argmax and argmin alike)
    tied = jnp.asarray(np.array([1.0, 3.0, 0.5, 3.0, 0.5], np.float32))
    nans = jnp.asarray(np.array([1.0, np.nan, 9.0, np.nan, -2.0], np.float32))
    ints = jnp.asarray(rng.integers(-3, 3, 17).astype(np.int32))
    for x0 in (tied, nans, ints):
        def body(c):
            x, a, b, k = c
            return x, jnp.argmax(x).astype(jnp.int32), jnp.argmin(x).astype(jnp.int32), k + 1
        init = (x0, jnp.int32(-1), jnp.int32(-1), jnp.int32(0))
        got = lk.while_loop(lambda c: c[3] < 2, body, init, fallback="error")
        same(got, lax.while_loop(lambda c: c[3] < 2, body, init))
    assert int(got[1]) == int(np.argmax(np.asarray(ints)))


# ------------------------------------------------------------------------------ gathers
def test_gathers_with_computed_indices(rng):
    """x[idx], jnp.take and row/column gathers with indices computed in the body or closed
    over, out-of-range ones clamped (and filled with mode="fill"), as jax.lax does."""
    x0 = f32(rng, 40)
    perm = jnp.asarray(rng.permutation(40).astype(np.int32))

    def body(i, x):
        j = (jnp.arange(40) * 7 + i) % 40
        beyond = jnp.arange(40) * 3 - 20                      # negative and past the end
        return (0.4 * x[j] + 0.3 * x[perm] + 0.2 * x[beyond]
                + 0.1 * jnp.take(x, jnp.clip(j - 5, -3, 50), mode="fill", fill_value=0.0))
    same(lk.fori_loop(0, 6, body, x0, fallback="error"), lax.fori_loop(0, 6, body, x0), exact=False)
    m0 = f32(rng, 6, 5)
    cols = jnp.asarray(np.array([4, 0, 3, 1, 2], np.int32))

    def rows_and_columns(i, m):
        return m[(jnp.arange(6) * 5 + i) % 6] * 0.5 + m[:, cols] * 0.5
    same(lk.fori_loop(0, 4, rows_and_columns, m0, fallback="error"), lax.fori_loop(0, 4, rows_and_columns, m0),
         exact=False)
    c0 = jnp.asarray(rng.integers(0, 30, 30).astype(np.int32))

    def lookup(i, c):                                          # an integer table looked up by itself
        return (c[c] + c[(c * 7) % 30] + i) % 30
    same(lk.fori_loop(0, 5, lookup, c0, fallback="error"), lax.fori_loop(0, 5, lookup, c0))


def test_point_and_window_gathers_in_2d(rng):
    """m[i, j] at computed (row, column) pairs, windows m[i, 1:4] at computed rows, and
    mode="fill" where a window does not fit, each against lax."""
    m0 = f32(rng, 7, 6)
    r = jnp.asarray(rng.integers(-9, 9, 42).astype(np.int32))
    c = jnp.asarray(rng.integers(-8, 8, 42).astype(np.int32))

    def points(i, m):
        return 0.5 * m + 0.5 * m[(r + i) % 7, c].reshape(7, 6)
    same(lk.fori_loop(0, 5, points, m0, fallback="error"), lax.fori_loop(0, 5, points, m0))
    rows = jnp.asarray(rng.integers(-3, 12, 7).astype(np.int32))

    def windows(i, m):                                       # start rows past the end are clamped
        w = m[(rows + i) % 10, 1:4]
        return m.at[:, :3].set(w * 0.5 + m[:, 3:] * 0.5)
    same(lk.fori_loop(0, 4, windows, m0, fallback="error"), lax.fori_loop(0, 4, windows, m0), exact=False)

    def filled(i, m):
        w = jnp.take(m, (rows + i) % 12 - 2, axis=0, mode="fill", fill_value=-1.0)
        return m * 0.5 + w * 0.25
    same(lk.fori_loop(0, 4, filled, m0, fallback="error"), lax.fori_loop(0, 4, filled, m0), exact=False)

    def filled_points(i, m):
        v = m.at[r % 9, c].get(mode="fill", fill_value=2.0)
        return m * 0.5 + v.reshape(7, 6) * 0.25
    same(lk.fori_loop(0, 4, filled_points, m0, fallback="error"), lax.fori_loop(0, 4, filled_points, m0),
         exact=False)

    def patches(i, m):          # 2x3 windows at computed corners, clamped into the array as lax does
        corners = jnp.stack([(r[:7] + i) % 9, c[:7] % 6], axis=1)
        p = jax.vmap(lambda q: lax.dynamic_slice(m, (q[0], q[1]), (2, 3)))(corners)
        return m * 0.5 + p.reshape(7, 6) * 0.5
    same(lk.fori_loop(0, 4, patches, m0, fallback="error"), lax.fori_loop(0, 4, patches, m0), exact=False)


def _scatter_case(seed):
    """A random scatter to computed indices and its float64 NumPy emulation of JAX's rules:
    negative indices count from the end once, windows that do not fit are dropped."""
    r = np.random.default_rng(seed)
    two_d = bool(r.integers(0, 2))
    shape = (int(r.integers(1, 9)), int(r.integers(1, 9))) if two_d else (int(r.integers(1, 41)),)
    n = shape[0]
    dtype = [np.int32, np.float32][int(r.integers(0, 2))]
    op = ["add", "set"][int(r.integers(0, 2))]
    m = int(r.integers(1, 61))
    if op == "set":         # distinct valid positions (JAX leaves the winner of repeats open)
        m = min(m, n)
        idx = r.permutation(n)[:m] - n * r.integers(0, 2, m)      # some written as negative
    else:
        idx = r.integers(-2 * n, 2 * n, m)
    idx = idx.astype(np.int32)
    upd = r.integers(-9, 10, (m,) + shape[1:]).astype(dtype)
    x0 = r.integers(-9, 10, shape).astype(dtype)

    def body(i, x):
        u = jnp.asarray(upd) + i.astype(dtype)
        return x.at[jnp.asarray(idx)].add(u) if op == "add" else x.at[jnp.asarray(idx)].set(u)

    def ref(x, steps):
        x = x.astype(np.float64)
        norm = np.where(idx < 0, idx + n, idx)
        ok = (norm >= 0) & (norm < n)
        for i in range(steps):
            u = upd.astype(np.float64) + i
            if op == "add":
                np.add.at(x, norm[ok], u[ok])
            else:
                x[norm[ok]] = u[ok]
        return x
    return x0, body, ref


@pytest.mark.parametrize("seed", range(24))
def test_random_scatters_to_computed_indices_match_numpy(seed):
    x0, body, ref = _scatter_case(seed)
    got = np.asarray(lk.fori_loop(0, 3, body, jnp.asarray(x0), fallback="error"))
    np.testing.assert_array_equal(got, ref(x0, 3).astype(x0.dtype))
    np.testing.assert_array_equal(got, np.asarray(lax.fori_loop(0, 3, body, jnp.asarray(x0))))


def test_batched_gathers_and_scatters(rng):
    """jnp.take_along_axis / put_along_axis and vmapped x[j], x.at[j].add/set inside the body
    (gathers and scatters with operand_batching_dims): along the batched dimension each element
    reads or writes its own row."""
    m0 = f32(rng, 6, 5)
    idx = jnp.asarray(rng.integers(-6, 8, (6, 5)).astype(np.int32))

    def along(i, m):
        a = jnp.take_along_axis(m, (idx + i) % 5, axis=1)
        b = jnp.take_along_axis(m, idx % 6, axis=0)
        c = jnp.take_along_axis(m, idx, axis=1, mode="fill", fill_value=-1.0)      # some out of range
        return a * 0.4 + b * 0.3 + c * 0.3
    same(lk.fori_loop(0, 4, along, m0, fallback="error"), lax.fori_loop(0, 4, along, m0), exact=False)
    cols = idx[:, :3]

    def rows(i, m):
        picked = jax.vmap(lambda r, j: r[j])(m, cols[:, 0] % 5)
        m = jax.vmap(lambda r, j: r.at[j].add(0.5))(m, cols)                      # repeats add up
        m = jax.vmap(lambda r, j, v: r.at[j % 5].set(v))(m, cols[:, 1], picked)
        return jnp.put_along_axis(m, (cols + i) % 5, m[:, :3] * 0.5, axis=1, inplace=False) * 0.9
    same(lk.fori_loop(0, 4, rows, m0, fallback="error"), lax.fori_loop(0, 4, rows, m0), exact=False)


# ------------------------------------------------------------------------------ scatters to computed indices
def test_segment_sum_spmv_with_duplicates_and_dropped_segments(rng):
    """A sparse matrix-vector product in COO form (jax.ops.segment_sum): repeated rows add up,
    row ids outside [0, n) are dropped, as in JAX."""
    n, nnz = 30, 120
    rows = rng.integers(0, n, nnz).astype(np.int32)
    rows[:6] = [-1, n, n + 5, -7, 0, 0]
    rows, cols = jnp.asarray(rows), jnp.asarray(rng.integers(0, n, nnz).astype(np.int32))
    vals = jnp.asarray(rng.uniform(-0.04, 0.04, nnz).astype(np.float32))
    x0 = f32(rng, n)

    def body(i, x):
        return 0.5 * x + jax.ops.segment_sum(vals * x[cols], rows, num_segments=n) + 0.01 * i
    same(lk.fori_loop(0, 9, body, x0, fallback="error"), lax.fori_loop(0, 9, body, x0), exact=False)
    step = _source_of(lambda: lk.fori_loop(0, 9, body, x0 + 0.0, fallback="error"))
    assert "lk.atomic.add(" in step and step.count("lk.sync()") == 2


def test_histogram_carry_adds_in_its_own_buffer(rng):
    """h.at[b].add(1) with bins computed in the body: negative bins count from the end (JAX's
    index normalisation), bins past the end are dropped; the histogram is built in the carry's
    second buffer (a copy, a barrier, the atomic adds; nothing after them)."""
    h0 = jnp.asarray(rng.integers(0, 5, 12).astype(np.int32))
    p = jnp.asarray(rng.uniform(-3.0, 15.0, 200).astype(np.float32))

    def body(i, h):
        b = jnp.floor(p + 0.37 * i).astype(jnp.int32)
        return h.at[b].add(1 + i % 3)
    same(lk.fori_loop(0, 11, body, h0, fallback="error"), lax.fori_loop(0, 11, body, h0))
    step = _source_of(lambda: lk.fori_loop(0, 11, body, h0 + 0, fallback="error"))
    assert step.count("lk.sync()") == 1 and "lk.atomic.add(c0n," in step
    assert step.rstrip().splitlines()[-1].strip().startswith("lk.atomic.add(")


def test_scatter_windows_points_and_clip_mode(rng):
    """Row windows added at computed rows, single points set at computed (row, column) pairs,
    and mode="clip", each against lax."""
    m0 = f32(rng, 7, 5)
    r = jnp.asarray(rng.integers(-9, 9, 4).astype(np.int32))

    def rows(i, m):
        return m.at[(r + i) % 9 - 1].add(m[:4] * 0.25)           # some rows -1 (the last), some 7 (dropped)
    same(lk.fori_loop(0, 6, rows, m0, fallback="error"), lax.fori_loop(0, 6, rows, m0), exact=False)
    pi = jnp.asarray(np.array([0, 3, 6, 2, 5], np.int32))
    pj = jnp.asarray(np.array([4, 1, 0, 2, 3], np.int32))

    def points(i, m):                                            # distinct (row, column) pairs
        return m.at[(pi + i) % 7, (pj * 2 + i) % 5].set(m[pi, pj] + 1.0) * 0.5
    same(lk.fori_loop(0, 5, points, m0, fallback="error"), lax.fori_loop(0, 5, points, m0))
    x0 = f32(rng, 16)
    idx = jnp.asarray(rng.integers(-10, 30, 25).astype(np.int32))

    def clipped(i, x):
        return x.at[idx + i].add(0.1, mode="clip") * 0.9
    same(lk.fori_loop(0, 5, clipped, x0, fallback="error"), lax.fori_loop(0, 5, clipped, x0), exact=False)

    def listed(i, x):                                            # constant indices, not evenly spaced
        return x.at[jnp.array([3, 1, 7, 3])].add(0.5) * 0.75
    same(lk.fori_loop(0, 5, listed, x0, fallback="error"), lax.fori_loop(0, 5, listed, x0), exact=False)


def test_clip_mode_set_of_a_carry_at_the_loop_index_moves_the_window_in(rng):
    """x.at[i].set(v, mode="clip") (and rows, points, windows) as a carry's only update, the
    index past either end: the write lands on the nearest position, as in lax (before session
    28 the in-place store dropped it, silently)."""
    x0 = jnp.asarray(rng.integers(-5, 5, 5).astype(np.int32))
    m0 = f32(rng, 4, 6)
    row = f32(rng, 6)
    bodies = [(lambda i, c: c.at[i].set(i, mode="clip"), x0, (0, 8)),
              (lambda i, c: c.at[i - 6].set(i * 3, mode="clip"), x0, (0, 4)),
              (lambda i, c: c.at[i, :].set(row * i, mode="clip"), m0, (0, 7)),
              (lambda i, c: c.at[i, 2 * i].set(1.5 * i, mode="clip"), m0, (0, 7)),
              (lambda i, c: c.at[i, 1:4].set(row[:3] + i, mode="clip"), m0, (2, 9))]
    for body, init, (lo, hi) in bodies:
        same(lk.fori_loop(lo, hi, body, init, fallback="error"), lax.fori_loop(lo, hi, body, init))

    def counter(i, c):
        k, x = c
        return k + 2, x.at[k].set(i, mode="clip")
    init = (jnp.int32(1), x0)
    same(lk.fori_loop(0, 6, counter, init, fallback="error"), lax.fori_loop(0, 6, counter, init))


def test_scatter_results_feed_reductions_conditions_and_ys(rng):
    """A scatter that reads a reduction, a second scatter that reads the first, a reduction of
    the result, a while_loop condition on it, and scan outputs built from it."""
    x0 = f32(rng, 24)
    idx = jnp.asarray(rng.integers(0, 24, 40).astype(np.int32))

    def body(c):
        x, k = c
        h = jnp.zeros(24, jnp.float32).at[(idx + jnp.argmax(x)) % 24].add(x[idx] * 0.1)
        g = jnp.zeros(24, jnp.float32).at[idx[::-1]].add(h[idx])
        y = 0.8 * x + 0.1 * g + 0.05 * h
        return y / jnp.max(y), k + 1
    cond = lambda c: (jnp.sum(c[0]) > 3.0) & (c[1] < 40)
    same(lk.while_loop(cond, body, (x0, jnp.int32(0)), fallback="error"),
         lax.while_loop(cond, body, (x0, jnp.int32(0))), exact=False, rtol=1e-5)

    def scan_body(x, w):
        h = jax.ops.segment_sum(x[idx] * w, idx[::-1], num_segments=24)
        return 0.5 * x + 0.1 * h, h[:5] * 2.0
    ws = f32(rng, 7, 40)
    same(lk.scan(scan_body, x0, ws, fallback="error"), lax.scan(scan_body, x0, ws), exact=False, rtol=1e-5)


def test_scatter_add_float64_and_int64_under_x64(rng):
    with jax_x64():
        x0 = jnp.asarray(rng.uniform(0, 1, 20))
        k0 = jnp.asarray(rng.integers(0, 9, 20))
        idx = jnp.asarray(rng.integers(0, 20, 50))

        def body(i, c):
            x, k = c
            return 0.5 * x + jax.ops.segment_sum(x[idx], idx[::-1], num_segments=20) * 0.1, k.at[idx].add(k[::-1][idx])
        same(lk.fori_loop(0, 6, body, (x0, k0), fallback="error"), lax.fori_loop(0, 6, body, (x0, k0)),
             exact=False, rtol=1e-12, atol=1e-14)


def test_scatter_add_without_an_atomic_add_falls_back_naming_it(rng):
    """int8 and bool scatter-adds have no atomic add on the GPU: lax runs the loop and says why;
    a scatter-max (.at[].max) is not in the subset."""
    h0 = jnp.zeros(8, jnp.int8)
    idx = jnp.asarray(rng.integers(0, 8, 30).astype(np.int32))

    def small_ints(i, h):
        return h.at[(idx + i) % 8].add(jnp.int8(1))
    assert_falls_back(small_ints, h0, 3, "scatter-add", error_match="scatter-add.*int8")
    x0 = f32(rng, 8)
    with pytest.raises(lk.StepSyntaxError, match="scatter.max"):
        lk.fori_loop(0, 3, lambda i, x: x.at[idx].max(x[::-1][idx % 8] * 0.9), x0, fallback="error")


def test_while_condition_on_one_element_of_an_array_carry(rng):
    """A condition that reads one element of an array carry is the same on every thread only
    once reduced: it used to be returned as it was, which the step validator rejects (an error,
    not a fallback)."""
    x0 = jnp.arange(6.0, dtype=jnp.float32)
    body = lambda c: c + 1.0
    same(lk.while_loop(lambda c: c[0] < 5, body, x0, fallback="error"), lax.while_loop(lambda c: c[0] < 5, body, x0))
    m0 = f32(rng, 4, 3)
    cond = lambda c: (c[0][2, 1] + c[0][0, 0] * 0.5 < 6.0) & (c[1] < 30)
    step = lambda c: (c[0] * 1.1 + 0.1, c[1] + 1)
    same(lk.while_loop(cond, step, (m0, 0), fallback="error"), lax.while_loop(cond, step, (m0, 0)), exact=False)


def test_floor_ceil_and_round_of_special_values():
    """floor, ceil, round (ties to even) and lax.round (ties away from zero) bit for bit, signs of
    zeros included, on infinities, NaNs, values past 2^52 and ties, in float32 and float64:
    math.floor gives an integer, which made floor(inf) -9.2e18 and ceil(-0.3) +0.0 before."""
    vals = [np.inf, np.nan, -np.inf, 1e30, -2.5, 3e9, -0.3, 0.5, 1.5, 2.5, -0.5, -1.5, 0.49999997, -0.0, 0.0,
            4.5, 8388607.5, 1e-40, -1e-40]
    fns = [jnp.floor, jnp.ceil, jnp.round, lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO)]
    for dt in (np.float32, np.float64):
        with jax_x64():
            x0 = jnp.asarray(np.array(vals, dt))
            for f in fns:
                got = np.asarray(lk.fori_loop(0, 1, lambda i, x: f(x), x0, fallback="error"))
                ref = np.asarray(lax.fori_loop(0, 1, lambda i, x: f(x), x0))
                assert got.dtype == ref.dtype
                np.testing.assert_array_equal(got, ref)
                np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))


def test_dense_solves_of_small_matrices(rng):
    """jnp.linalg.solve / inv and jax.scipy.linalg.solve_triangular (lu with partial pivoting,
    triangular_solve: one thread, a barrier), with a matrix that changes every step, several
    right-hand sides, float32 and float64; a matrix above 64 x 64 falls back naming lu."""
    a = jnp.asarray(rng.normal(size=(7, 7)).astype(np.float32))
    x0 = f32(rng, 7, 3)

    def solves(i, x):
        m = a + jnp.diag(2.0 + x[:, 0])                         # pivoting needed: a is not dominant
        return jnp.linalg.solve(m, x) * 0.3 + x * 0.5 + 0.01 * jnp.linalg.inv(m)[:, :3]
    same(lk.fori_loop(0, 4, solves, x0, fallback="error"), lax.fori_loop(0, 4, solves, x0), exact=False,
         rtol=1e-4, atol=1e-5)

    def triangular(i, x):
        lo = jnp.tril(a) + 3.0 * jnp.eye(7)
        return x * 0.5 + 0.1 * (jax.scipy.linalg.solve_triangular(lo, x, lower=True)
                                + jax.scipy.linalg.solve_triangular(lo.T, x, lower=False, trans=1))
    same(lk.fori_loop(0, 4, triangular, x0, fallback="error"), lax.fori_loop(0, 4, triangular, x0), exact=False,
         rtol=1e-5, atol=1e-6)
    with jax_x64():
        a64, v0 = jnp.asarray(rng.normal(size=(9, 9))), jnp.asarray(rng.random(9))
        step = lambda i, v: jnp.linalg.solve(a64 + jnp.diag(3.0 + v), v) + 0.1
        same(lk.fori_loop(0, 5, step, v0, fallback="error"), lax.fori_loop(0, 5, step, v0), exact=False,
             rtol=1e-10, atol=1e-12)
    big = f32(rng, 70)
    assert_falls_back(lambda i, v: jnp.linalg.solve(jnp.eye(70) * 2.0 + 0.01, v), big, 2, "lu",
                      error_match="lu.*at most 64")


def test_cholesky_positive_definite_or_not(rng):
    """jnp.linalg.cholesky (lower factor, zeros above) and cho_solve of a matrix that changes
    every step; a matrix that is not positive definite gives NaN everywhere, as in JAX."""
    a = jnp.asarray(rng.normal(size=(6, 6)).astype(np.float32))
    x0 = f32(rng, 6)

    def spd(i, x):
        m = a @ a.T + jnp.diag(1.0 + x)
        return jnp.linalg.cholesky(m)[:, 2] * 0.3 + x * 0.5 + 0.1 * jax.scipy.linalg.cho_solve(
            jax.scipy.linalg.cho_factor(m, lower=True), x)
    same(lk.fori_loop(0, 4, spd, x0, fallback="error"), lax.fori_loop(0, 4, spd, x0), exact=False, rtol=1e-5)

    def indefinite(i, x):
        return jnp.linalg.cholesky(a + jnp.diag(x) * (i + 1.0))
    got = lk.fori_loop(0, 1, lambda i, m: indefinite(i, m[0]), jnp.zeros((6, 6)) + x0, fallback="error")
    ref = lax.fori_loop(0, 1, lambda i, m: indefinite(i, m[0]), jnp.zeros((6, 6)) + x0)
    assert np.isnan(np.asarray(ref)).any()                      # the case this checks
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_sorts_as_jax_orders_them(rng):
    """jnp.sort and argsort along either axis: NaNs (of either sign) last, -0.0 and 0.0 equal,
    ties kept in place (argsort of a vector with repeats, bit for bit), integers; rows longer
    than SORT_MAX and several keys fall back."""
    x0 = f32(rng, 30)

    def both_axes(i, x):
        m = x.reshape(5, 6)
        return (jnp.sort(m, axis=0) * 0.5 + jnp.sort(m, axis=1) * 0.5).reshape(30)
    same(lk.fori_loop(0, 3, both_axes, x0, fallback="error"), lax.fori_loop(0, 3, both_axes, x0))
    special = jnp.asarray(np.array([0.0, -0.0, np.nan, -np.nan, 1.0, -np.inf, 2.0, 0.0] * 2, np.float32))

    def by_rank(i, x):                  # the order, and where each element went
        return jnp.sort(x), jnp.argsort(x).astype(jnp.float32)
    got = lk.fori_loop(0, 1, lambda i, c: by_rank(i, c[0]), (special, special), fallback="error")
    ref = lax.fori_loop(0, 1, lambda i, c: by_rank(i, c[0]), (special, special))
    same(got, ref)
    np.testing.assert_array_equal(np.signbit(np.asarray(got[0])), np.signbit(np.asarray(ref[0])))
    k0 = jnp.asarray(rng.integers(0, 5, 40).astype(np.int32))

    def ranks(i, k):                    # repeats: argsort keeps them in place
        return (jnp.argsort(k).astype(jnp.int32) + k * 3 + i) % 7
    same(lk.fori_loop(0, 6, ranks, k0, fallback="error"), lax.fori_loop(0, 6, ranks, k0))
    big = f32(rng, 5000)
    assert_falls_back(lambda i, x: jnp.sort(x) * 0.5 + x * 0.5, big, 2, "sort", error_match="sort.*longer than 4096")
    assert_falls_back(lambda i, x: x[jnp.lexsort((x, jnp.round(x * 4)))], x0, 2, "sort",
                      error_match="sort.*several keys")


# ------------------------------------------------------------------------------ nested loops
def test_nested_fori_loop_runs_per_element(rng):
    """A fixed number of Newton iterations per element inside the body (lax.fori_loop with static
    bounds, traced as a scan): a sequential loop in each thread, no barrier."""
    x0 = f32(rng, 50, lo=1.0, hi=2.0)

    def body(i, x):
        a = x + 0.1 * i
        root = lax.fori_loop(0, 6, lambda j, y: y - (y * y - a) / (2 * y), a)
        return 0.5 * x + 0.3 * root + 0.1 * jnp.roll(x, 1)
    same(lk.fori_loop(0, 5, body, x0, fallback="error"), lax.fori_loop(0, 5, body, x0), exact=False)
    step = _source_of(lambda: lk.fori_loop(0, 5, body, x0 + 0.0, fallback="error"))
    assert "for j" in step and "in range(6)" in step and "lk.sync" not in step


def test_nested_loops_with_dynamic_trip_counts_pytrees_and_two_levels(rng):
    """A trip count from the outer counter (traced as a while), a pytree carry of two arrays and
    a counter (leapfrog substeps), a loop inside a loop, and a while_loop on a scalar."""
    x0, v0 = f32(rng, 6, 7), f32(rng, 6, 7, lo=-1.0, hi=1.0)

    def varying(i, x):
        return lax.fori_loop(0, i % 4 + 1, lambda j, z: z * 0.5 + j, x) * 0.9 + 0.05
    same(lk.fori_loop(0, 7, varying, x0, fallback="error"), lax.fori_loop(0, 7, varying, x0), exact=False)

    def leapfrog(i, c):
        x, v = c

        def sub(j, s):
            x, v, k = s
            v = v - 0.05 * x * (1.0 + 0.1 * k)
            return x + 0.05 * v, v, k + 1
        x, v, _ = lax.fori_loop(0, 3, sub, (x, v, jnp.int32(0)))
        return x, v
    same(lk.fori_loop(0, 6, leapfrog, (x0, v0), fallback="error"), lax.fori_loop(0, 6, leapfrog, (x0, v0)),
         exact=False)

    def two_levels(i, x):
        return lax.fori_loop(0, 3, lambda j, y: lax.fori_loop(0, j + 1, lambda k, z: z * 0.9 + 0.01 * k, y) + 0.1,
                             x)
    same(lk.fori_loop(0, 4, two_levels, x0, fallback="error"), lax.fori_loop(0, 4, two_levels, x0), exact=False)

    def halvings(i, x):       # a while_loop on a scalar: how many halvings bring the max below 0.1
        m = jnp.max(x)
        n = lax.while_loop(lambda c: c[0] > 0.1, lambda c: (c[0] * 0.5, c[1] + 1), (m, jnp.int32(0)))[1]
        return x * 0.8 + 0.01 * n
    same(lk.fori_loop(0, 8, halvings, x0, fallback="error"), lax.fori_loop(0, 8, halvings, x0), exact=False)


def test_nested_loops_in_while_loop_and_scan_and_under_a_condition(rng):
    x0 = f32(rng, 30, lo=0.5, hi=1.5)

    def body(c):
        x, k = c
        y = lax.fori_loop(0, 4, lambda j, y: 0.5 * (y + x / y), x)            # sqrt by Heron
        return 0.9 * x + 0.1 * y, k + 1
    cond = lambda c: (jnp.sum(c[0]) > 20.0) & (c[1] < 50)
    same(lk.while_loop(cond, body, (x0, jnp.int32(0)), fallback="error"),
         lax.while_loop(cond, body, (x0, jnp.int32(0))), exact=False)

    def scan_body(x, w):
        y = lax.fori_loop(0, 3, lambda j, y: y * w + 0.1, x)
        return jnp.pad(y[1:-1], 1) + x * 0.5, y[0]     # the loop's values under the pad's condition
    ws = f32(rng, 5)
    same(lk.scan(scan_body, x0, ws, fallback="error"), lax.scan(scan_body, x0, ws), exact=False)


def test_scan_counts_in_both_forms_of_jax():
    """A nested scan's constants and carries: JAX up to 0.10 names the counts, JAX 0.11 (on the
    H200) gives a tree per group; an unknown form is no nested loop (lax runs it)."""
    from loopkern.jaxloops.trace import _scan_counts
    assert _scan_counts({"num_consts": 2, "num_carry": 3, "jaxpr": None}) == (2, 3)
    assert _scan_counts({"ft_in": ((None,), (None, None), ()), "ft_out": ((None, None), ())}) == (1, 2)
    assert _scan_counts({"ft_in": ((), (None,), (None,))}) == (0, 1)
    assert _scan_counts({"ft_in": "something else"}) is None and _scan_counts({}) is None

    class Packed:                   # JAX 0.11's FTTuple: unpack() gives the groups
        def unpack(self):
            return ((None,), (None, None, None), (None,))
    assert _scan_counts({"ft_in": Packed()}) == (1, 3)


def test_nested_scans_over_xs_and_with_ys_run_unrolled(rng):
    """A nested scan over xs (coefficients per stage, rows of a matrix, forwards and reversed)
    with ys read afterwards runs unrolled for a static count of at most 16; a longer one falls
    back, naming it."""
    x0 = f32(rng, 20)
    coef = jnp.asarray(np.array([0.5, 0.25, 0.125, 1.0], np.float32))

    def stages(i, x):
        def stage(c, a):
            return 0.5 * c + a * jnp.roll(c, 1), jnp.sum(c) * a
        y, ys = lax.scan(stage, x, coef)
        return y + 0.01 * ys[2] + 0.001 * ys[::-1][0]
    same(lk.fori_loop(0, 3, stages, x0, fallback="error"), lax.fori_loop(0, 3, stages, x0), exact=False)
    m = f32(rng, 5, 20)

    def rows(i, x):
        y, hist = lax.scan(lambda c, r: (c * 0.5 + r, c * r), x, m, reverse=True)
        return y * 0.3 + hist.sum(0) * 0.1
    same(lk.fori_loop(0, 3, rows, x0, fallback="error"), lax.fori_loop(0, 3, rows, x0), exact=False)

    def long(i, x):
        return x * 0.5 + lax.scan(lambda c, v: (c + v, c), 0.0, x)[0]
    assert_falls_back(long, x0, 3, "scan (a nested loop)", error_match="scan.*at most 16")


def test_nested_loops_with_run_time_counts_run_in_phases(rng):
    """A nested loop that reads other elements of its carry with a count known only at run time
    (a while_loop to a tolerance, a fori_loop to the outer counter) or of more than 16
    iterations: a sequential loop at the top of the step, its body's phases in each iteration,
    the array carries in two buffers (new values, a barrier, copied back, a barrier)."""
    u0 = f32(rng, 30)

    def implicit(i, u):         # backward Euler for heat: Jacobi sweeps to a tolerance per step
        def sweep(c):
            v, err, k = c
            nb = jnp.pad(v, 1)
            w = (u + 0.3 * (nb[:-2] + nb[2:])) / 1.6
            return w, jnp.max(jnp.abs(w - v)), k + 1
        return lax.while_loop(lambda c: (c[1] > 1e-5) & (c[2] < 100), sweep, (u, jnp.float32(jnp.inf), 0))[0]
    same(lk.fori_loop(0, 3, implicit, u0, fallback="error"), lax.fori_loop(0, 3, implicit, u0), exact=False)
    step = _source_of(lambda: lk.fori_loop(0, 3, implicit, u0 + 0.0, fallback="error"))
    assert "while go" in step and "lk.max(" in step

    def growing(i, u):
        return lax.fori_loop(0, i + 1, lambda j, v: 0.5 * (jnp.roll(v, 1) + v), u)
    same(lk.fori_loop(0, 4, growing, u0, fallback="error"), lax.fori_loop(0, 4, growing, u0))

    def many(i, u):             # 40 smoothing passes: above the unrolling limit
        return lax.fori_loop(0, 40, lambda j, v: 0.25 * jnp.roll(v, 1) + 0.5 * v + 0.25 * jnp.roll(v, -1), u)
    same(lk.fori_loop(0, 3, many, u0, fallback="error"), lax.fori_loop(0, 3, many, u0), exact=False)
    step = _source_of(lambda: lk.fori_loop(0, 3, many, u0 + 0.0, fallback="error"))
    assert "in range(20)" in step and "lk.sync()" in step       # two iterations per trip

    m0 = f32(rng, 6, 5)

    def walk(i, m):             # a scalar carry from an array element: the condition is made uniform
        def inner(c):
            v, k = c
            return jnp.roll(v, 1, axis=0) + 0.5, k + 1
        v, k = lax.while_loop(lambda c: (c[0][0, 0] < 4.0) & (c[1] < 20), inner, (m, jnp.int32(0)))
        return v * 0.5 + k.astype(jnp.float32) * 0.01
    same(lk.fori_loop(0, 4, walk, m0, fallback="error"), lax.fori_loop(0, 4, walk, m0))


def test_conjugate_gradients_to_a_tolerance_in_every_step(rng):
    """An implicit step solved by CG inside the body (a while_loop with reductions, scalar and
    array carries), the way a JAX user writes it, against lax."""
    u0 = f32(rng, 40)
    step = W.implicit_heat_cg(np.float32(0.3), np.float32(1e-10), 60)
    got = lk.fori_loop(0, 4, step, u0, fallback="error")
    same(got, lax.fori_loop(0, 4, step, u0), exact=False, rtol=1e-4, atol=1e-5)


def test_nested_loops_that_read_other_elements_run_unrolled(rng):
    """A static count of at most 16 iterations of a body that is no elementwise update (Jacobi
    sweeps of an implicit step, a normalisation by the sum, a reversal) runs unrolled: one
    parallel phase per iteration, each iteration's carry in a buffer of its own behind a
    barrier; the last one written into the carry's second buffer."""
    u0 = f32(rng, 12, 10)

    def implicit(i, u):         # backward Euler for heat, four Jacobi sweeps per step
        def sweep(j, v):
            nb = jnp.pad(v, 1, mode="edge")
            return (u + 0.2 * (nb[:-2, 1:-1] + nb[2:, 1:-1] + nb[1:-1, :-2] + nb[1:-1, 2:])) / 1.8
        return lax.fori_loop(0, 4, sweep, u)
    same(lk.fori_loop(0, 5, implicit, u0, fallback="error"), lax.fori_loop(0, 5, implicit, u0), exact=False)
    step = _source_of(lambda: lk.fori_loop(0, 5, implicit, u0 + 0.0, fallback="error"))
    assert step.count("lk.sync()") == 3 and "c0n[" in step.rstrip().splitlines()[-1]

    x0 = f32(rng, 20)

    def renormalised(i, x):     # a reduction in every iteration, a scalar carry fed by it
        def inner(j, c):
            y, total = c
            s = jnp.sum(y)
            return y[::-1] * 0.5 + y / s, total + s
        y, total = lax.fori_loop(0, 3, inner, (x, jnp.float32(0.0)))
        return y * 0.9 + 0.001 * total
    same(lk.fori_loop(0, 4, renormalised, x0, fallback="error"), lax.fori_loop(0, 4, renormalised, x0),
         exact=False, rtol=1e-5)

    def mixed(i, x):            # an elementwise loop inside an unrolled one stays per element
        def inner(j, y):
            z = lax.fori_loop(0, 3, lambda k, z: z * 0.5 + 0.25, y)
            return jnp.roll(z, 1) * 0.5 + y * 0.5
        return lax.fori_loop(0, 2, inner, x)
    same(lk.fori_loop(0, 3, mixed, x0, fallback="error"), lax.fori_loop(0, 3, mixed, x0), exact=False)


# ------------------------------------------------------------------------------ fallback
def factorising_body(i, x):         # eigenvalues (eigh), outside the subset
    return jnp.linalg.eigh(jnp.outer(x, x) + jnp.eye(x.shape[0]))[0] * 0.5 + x[::-1] * 0.5


def test_fallback_warns_once_naming_the_primitive_and_line(rng):
    x0 = f32(rng, 20)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = lk.fori_loop(0, 4, factorising_body, x0)
    msgs = [str(m.message) for m in w if issubclass(m.category, lk.JaxLoopWarning)]
    assert len(msgs) == 1
    assert "'eigh'" in msgs[0] and "test_jaxloops.py:" in msgs[0] and "jax.lax.fori_loop" in msgs[0]
    same(got, lax.fori_loop(0, 4, factorising_body, x0))


def test_random_draws_outside_the_subset_fall_back_and_the_warning_names_the_error_s_place(rng):
    """jax.random compiles (tests/test_jaxloops_prng.py) except a few draws (orthogonal: a qr
    factorisation) and keys of other implementations than threefry2x32: those fall back (with
    the warning, or StepSyntaxError for fallback="error"), and the warning's file:line:col is
    the error's."""
    x0 = f32(rng, 8)

    def drawn(i, c):
        return c + jnp.sum(jax.random.orthogonal(jax.random.fold_in(jax.random.PRNGKey(0), i), 3))

    def carried(i, c):
        k, x = c
        k, sub = jax.random.split(k)
        return k, x + jax.random.normal(sub, x.shape)
    for body, init, name in [(drawn, x0, "qr"), (carried, (jax.random.key(1, impl="rbg"), x0), "rbg")]:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = lk.fori_loop(0, 3, body, init)
        msgs = [str(m.message) for m in w if issubclass(m.category, lk.JaxLoopWarning)]
        assert len(msgs) == 1 and name in msgs[0], msgs
        ref = lax.fori_loop(0, 3, body, init)
        np.testing.assert_array_equal(np.asarray(jax.tree_util.tree_leaves(got)[-1]),
                                      np.asarray(jax.tree_util.tree_leaves(ref)[-1]))
        with pytest.raises(lk.StepSyntaxError, match=name) as info:
            lk.fori_loop(0, 3, body, init, fallback="error")
        if body is drawn:
            place = re.search(r"(test_jaxloops\.py:\d+:\d+)", str(info.value)).group(1)
            assert place in msgs[0], (place, msgs[0])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_closed_over_half_precision_array_falls_back_naming_its_use(dtype, rng):
    # (an ArgumentError about a generated parameter 'g0' came out of the call before session 28,
    # with fallback="warn" too)
    h = jnp.asarray(rng.random(6)).astype(dtype)
    x0 = f32(rng, 6)

    def body(i, c):
        return c * 0.5 + h.astype(jnp.float32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = lk.fori_loop(0, 3, body, x0)
    msgs = [str(m.message) for m in w if issubclass(m.category, lk.JaxLoopWarning)]
    assert len(msgs) == 1 and f"closes over of dtype {jnp.dtype(dtype)}" in msgs[0] and "test_jaxloops.py:" in msgs[0]
    same(got, lax.fori_loop(0, 3, body, x0))
    with pytest.raises(lk.StepSyntaxError, match="closes over of dtype"):
        lk.fori_loop(0, 3, body, x0, fallback="error")


def test_lk_loops_nested_in_an_lk_loop_body_lower_as_nested_loops(rng):
    """An lk loop inside an lk loop's body is a lax loop there, which the outer lowering
    compiles as a nested loop (before session 28 the inner became a kernel call, so the outer
    always fell back naming 'pure_callback' in loopkern's own file, and an unsupported inner
    body warned three times per call)."""
    x0 = jnp.asarray(rng.integers(0, 9, 6).astype(np.int32))
    v0 = f32(rng, 5)

    def fori_in(i, c):
        return lk.fori_loop(0, 2, lambda j, d: d * 2 + j - i, c)

    def while_in(i, c):
        return lk.while_loop(lambda d: d[1] < 3, lambda d: (d[0] * 0.5 + 1.0, d[1] + 1), (c, 0))[0]

    def scan_in(c, x):
        c2, ys = lk.scan(lambda a, b: (a * 0.9 + b, a.sum()), c, jnp.stack([x, x * 2.0]))
        return c2, ys
    same(lk.fori_loop(0, 3, fori_in, x0, fallback="error"),
         lax.fori_loop(0, 3, lambda i, c: lax.fori_loop(0, 2, lambda j, d: d * 2 + j - i, c), x0))
    same(lk.fori_loop(0, 3, while_in, v0, fallback="error"),
         lax.fori_loop(0, 3, lambda i, c: lax.while_loop(lambda d: d[1] < 3, lambda d: (d[0] * 0.5 + 1.0, d[1] + 1),
                                                          (c, 0))[0], v0), exact=False)
    xs = f32(rng, 4, 5)
    same(lk.scan(scan_in, v0, xs, fallback="error"),
         lax.scan(lambda c, x: lax.scan(lambda a, b: (a * 0.9 + b, a.sum()), c, jnp.stack([x, x * 2.0])), v0, xs),
         exact=False)

    def bad_in(i, c):
        return lk.fori_loop(0, 2, lambda j, d: lax.clz(d) + j, c)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = lk.fori_loop(0, 3, bad_in, x0)
    msgs = [str(m.message) for m in w if issubclass(m.category, lk.JaxLoopWarning)]
    assert len(msgs) == 1 and "'clz'" in msgs[0] and "test_jaxloops.py:" in msgs[0], msgs
    same(got, lax.fori_loop(0, 3, lambda i, c: lax.fori_loop(0, 2, lambda j, d: lax.clz(d) + j, c), x0))


def test_fallback_error_raises_a_step_syntax_error(rng):
    x0 = f32(rng, 20)
    with pytest.raises(lk.StepSyntaxError, match="'eigh'") as info:
        lk.fori_loop(0, 4, factorising_body, x0, fallback="error")
    assert "test_jaxloops.py" in str(info.value)
    with pytest.raises(lk.StepSyntaxError, match="cumlogsumexp"):
        lk.while_loop(lambda c: c[1] < 3, lambda c: (lax.cumlogsumexp(c[0]), c[1] + 1), (x0, 0), fallback="error")
    with pytest.raises(lk.StepSyntaxError, match="scan"):          # a long nested scan over xs
        lk.fori_loop(0, 3, lambda i, x: x + lax.scan(lambda c, v: (c + v, c), 0.0, x)[0], x0, fallback="error")
    with pytest.raises(lk.ArgumentError, match="fallback"):
        lk.fori_loop(0, 4, factorising_body, x0, fallback="maybe")
    # a scatter that multiplies: not compiled (adds and stores are)
    with pytest.raises(lk.StepSyntaxError, match="scatter.mul"):
        lk.fori_loop(0, 4, lambda i, x: x.at[jnp.array([3, 1, 7])].multiply(0.5), x0, fallback="error")


def test_a_generated_step_that_does_not_validate_falls_back_or_raises(rng, monkeypatch):
    """Should the lowering ever generate a step that loopkern's own validation rejects (a
    loopkern bug), fallback="warn" runs the lax loop and says so; fallback="error" raises the
    validation error itself."""
    import dataclasses

    from loopkern.jaxloops import loops
    real = loops._lower

    def broken(*args, **kw):        # a list is no restricted Python
        plan = real(*args, **kw)
        return dataclasses.replace(plan, source=plan.source.replace("\n", "\n    junk_ = [1, 2]\n", 1))
    monkeypatch.setattr(loops, "_lower", broken)
    x0 = f32(rng, 20)
    body = lambda i, x: x * 0.5 + 0.25
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = lk.fori_loop(0, 3, body, x0)
    msgs = [str(m.message) for m in w if issubclass(m.category, lk.JaxLoopWarning)]
    assert len(msgs) == 1 and "loopkern bug" in msgs[0]
    same(got, lax.fori_loop(0, 3, body, x0))
    with pytest.raises(lk.StepSyntaxError, match="list"):
        lk.fori_loop(0, 3, body, x0, fallback="error")


def test_fallback_inside_jit_and_silent(rng):
    x0 = f32(rng, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jax.jit(lambda x: lk.fori_loop(0, 3, factorising_body, x, fallback="silent"))(x0)
    same(got, jax.jit(lambda x: lax.fori_loop(0, 3, factorising_body, x))(x0))


# ------------------------------------------------------------------------------ derivatives, vmap
def test_grad_and_jvp_run_through_lax(rng):
    u0 = f32(rng, 20)
    body = heat1d_body(0.2)

    def loss(loop):
        return lambda u: jnp.sum(loop(0, 5, body, u) ** 2)
    np.testing.assert_allclose(np.asarray(jax.grad(loss(lk.fori_loop))(u0)),
                               np.asarray(jax.grad(loss(lax.fori_loop))(u0)), rtol=1e-6)
    t = f32(rng, 20)
    p1, t1 = jax.jvp(lambda u: lk.fori_loop(0, 5, body, u), (u0,), (t,))
    p2, t2 = jax.jvp(lambda u: lax.fori_loop(0, 5, body, u), (u0,), (t,))
    np.testing.assert_allclose(np.asarray(t1), np.asarray(t2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(p1), np.asarray(p2), rtol=1e-6)


def test_vmap(rng):
    batch = f32(rng, 3, 30)
    got = jax.vmap(lambda u: lk.fori_loop(0, 7, heat1d_body(0.25), u, fallback="error"))(batch)
    same(got, jax.vmap(lambda u: lax.fori_loop(0, 7, heat1d_body(0.25), u))(batch))


def test_kernel_is_cached_per_body_and_shapes(rng):
    from loopkern.jaxloops import loops
    u0 = f32(rng, 77)
    lk.fori_loop(0, 3, heat1d_body(0.3), u0, fallback="error")
    n = len(loops._kernels)
    lk.fori_loop(0, 5, heat1d_body(0.3), u0 + 1.0, fallback="error")     # a new closure, same body
    assert len(loops._kernels) == n
    lk.fori_loop(0, 5, heat1d_body(0.3), f32(rng, 78), fallback="error")   # a new shape: a new kernel
    assert len(loops._kernels) == n + 1


def test_import_without_jax_keeps_working():
    import subprocess
    import sys
    code = ("import sys; sys.modules['jax'] = None\nimport loopkern as lk\n"
            "assert callable(lk.megakernel)\ntry:\n    lk.fori_loop\nexcept ImportError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_uint64_indices_under_x64(rng):
    # a uint64 start or gather index: Numba made uint64 + int64 a float64, which cannot index
    # (the generated step failed to compile, under fallback="warn" too)
    with jax_x64():
        u = jnp.asarray(rng.random(6))

        def sliced(i, c):
            return c[0], c[1] + lax.dynamic_slice(c[0], (c[2],), (2,)), c[2] + jnp.uint64(1)

        def gathered(i, c):
            return c[0] + c[0][c[1]], c[1] * jnp.uint64(5) % jnp.uint64(7)

        def by_counter(i, c):
            return c + lax.dynamic_slice(u, (i,), (2,))

        for body, init, n in ((sliced, (u, jnp.zeros(2), jnp.uint64(1)), 4),
                              (gathered, (u, jnp.uint64(1)), 3)):
            want = lax.fori_loop(0, n, body, init)
            got = lk.fori_loop(0, n, body, init, fallback="error")
            for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                assert g.dtype == w.dtype
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        run = jax.jit(lambda F, lo, hi: F(lo, hi, by_counter, jnp.zeros(2)), static_argnums=0)
        np.testing.assert_array_equal(np.asarray(run(functools.partial(lk.fori_loop, fallback="error"),
                                                     jnp.uint64(0), jnp.uint64(4))),
                                      np.asarray(run(lax.fori_loop, jnp.uint64(0), jnp.uint64(4))))


def test_a_generated_step_numba_cannot_compile_falls_back(monkeypatch):
    # a loopkern bug of that kind (the uint64 index above was one): the lax loop with a warning
    # saying so, or the CompileError with fallback="error"
    from loopkern.jaxloops import lower
    monkeypatch.setattr(lower, "as_index", lambda text, atom: f"float({text})")
    u = jnp.arange(6.0, dtype=jnp.float32)

    def body(i, c):
        return c + lax.dynamic_slice(u, (i,), (2,))
    want = lax.fori_loop(0, 3, body, jnp.zeros(2, jnp.float32))
    with pytest.warns(lk.JaxLoopWarning, match="loopkern rejected the step it generated"):
        got = lk.fori_loop(0, 3, body, jnp.zeros(2, jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(lk.CompileError):
        lk.fori_loop(0, 3, body, jnp.zeros(2, jnp.float32), fallback="error")


def test_trajectories_written_in_place_beside_a_split_loop(rng):
    """A history carry written in place at the loop counter (dynamic_update_slice) by the same
    loop as a padded field, 1-D and 2-D (a window of rows): the split (Lowering.split_loop) must
    not split a loop whose store is at a run-time start reaching the rim (loopkern's race check
    cannot tell start + 11 from start + j there; found by an adversarial review, the step was
    refused); results against lax, and no split step refused."""
    from loopkern.jaxloops import loops
    refused = loops.split_rejected

    def traj1(i, c):
        x, hist = c
        xn = jnp.tanh(jnp.pad(x[1:], (0, 1)) * 0.5 + 0.3 * x)
        return xn, lax.dynamic_update_slice(hist, xn[None], (i, 0))

    def traj2(i, c):
        x, hist = c
        xn = jnp.tanh(x.at[1:-1, 1:-1].set(0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
                      + 0.01 * jnp.sum(x[1:]))
        return xn, lax.dynamic_update_slice(hist, xn[1:-1, :][None], (i, 1, 0))
    for body, init in ((traj1, (f32(rng, 12), jnp.zeros((5, 12), jnp.float32))),
                       (traj2, (f32(rng, 7, 6), jnp.zeros((4, 7, 6), jnp.float32)))):
        same(lk.fori_loop(0, 4, body, init, fallback="error"), lax.fori_loop(0, 4, body, init), exact=False,
             rtol=1e-5, atol=1e-6)
    assert loops.split_rejected == refused


def test_a_split_step_refused_by_loopkern_runs_the_plain_one(monkeypatch, rng):
    """Should loopkern's own checks refuse a split step, the plain one runs (the split is only
    faster); counted in loops.split_rejected."""
    from loopkern.jaxloops import loops
    make = loops._make_kernel

    def refuse_split(source, plan):
        if source == plan.source and plan.plain_source is not None:
            raise loops.GeneratedStepRejected(lk.StepSyntaxError("refused for the test"))
        return make(source, plan)
    monkeypatch.setattr(loops, "_make_kernel", refuse_split)
    refused = loops.split_rejected
    tol = np.float32(1e-3)

    body = _jacobi_body

    def cond(c):
        return (c[1] > tol) & (c[2] < 50)
    init = (f32(rng, 13, 11), jnp.float32(jnp.inf), 0)
    same(lk.while_loop(cond, body, init, fallback="error"), lax.while_loop(cond, body, init))
    assert loops.split_rejected == refused + 1
    assert "lk.num_threads()" not in loops._last_source


def test_scan_outputs_of_a_split_loop(monkeypatch, rng):
    """A scan whose ys row is a field that a split loop computes (ys[t, j] keeps the cell's
    indices, so its rim store is split too), forward and reversed; the split step is forced
    (this body's plain step is a stencil, which the drop-in loops would keep for tile mode)."""
    import loopkern.stencil
    from loopkern.jaxloops import loops
    monkeypatch.setattr(loopkern.stencil, "find_stencil", lambda spec: None)
    refused = loops.split_rejected

    def f(c, xi):
        a, b = c
        y = jnp.tanh(jnp.pad(0.5 * (a[:-2] + a[2:]), 1) + xi) - 0.1 * jnp.max(a) + 0.01 * jnp.sum(b)
        return (y, b * 0.5 + xi), y * 2
    for reverse in (False, True):
        c0 = (f32(rng, 17, lo=-1.0), f32(rng, 5, lo=-1.0))
        xs = f32(rng, 6, lo=-1.0)
        same(lk.scan(f, c0, xs, reverse=reverse, fallback="error"), lax.scan(f, c0, xs, reverse=reverse),
             exact=False, rtol=1e-5, atol=1e-6)
        step = loops._last_source
        assert "_v_ in lk.range(" in step and re.search(r"y0\[.*, 0\] = ", step), step
    assert loops.split_rejected == refused


def test_cond_on_a_scalar_carry_around_a_nested_while_loop():
    """A scalar carry decides a lax.cond whose branch runs a while_loop over an array (a barrier
    and a reduction under the cond): compiled (fallback="error"), equal to lax for both values
    of the carry. Before, loopkern refused the step it generated (the carry's element was taken
    as different between threads) and the body ran as jax.lax.fori_loop."""
    def body(i, c):
        x, s = c

        def taken(x):
            return lax.while_loop(lambda v: jnp.max(v[0]) < 5.0, lambda v: (v[0] + v[1], v[1]), (x, s))[0]
        return lax.cond(s > 0, taken, lambda x: x * np.float32(0.5), x), s
    for s in (np.float32(0.75), np.float32(0.0)):
        init = (jnp.asarray(np.linspace(-1.0, 2.0, 64, dtype=np.float32)), jnp.float32(s))
        want = lax.fori_loop(0, 3, body, init)
        got = lk.fori_loop(0, 3, body, init, fallback="error")
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        assert float(got[1]) == float(s)


def test_a_vmapped_while_loop_runs_the_lax_loop():
    """jax.vmap of a while_loop inside a body: its condition is one bool per batch element, each
    element iterating while its own holds. Not lowered: fallback="error" raises naming 'while',
    otherwise jax.lax runs it with a warning (before, the lowering crashed with an IndexError
    that no fallback caught)."""
    def grow(v):
        return lax.while_loop(lambda v: jnp.max(v) < 5.0, lambda v: v + np.float32(0.75), v)
    x0 = jnp.asarray(np.linspace(0.0, 3.0, 64, dtype=np.float32).reshape(4, 16))
    assert_falls_back(lambda i, x: jax.vmap(grow)(x), x0, 2, "while", error_match="vmapped while_loop")


def test_rim_prefetch_threshold_is_the_auto_block_scope_size():
    """The lowering keeps a rim's loads in the rim loop up to the size that scope="auto" runs in
    one block (where its arrays are staged in shared memory); the two numbers must move together."""
    from loopkern.dispatch.config import AUTO_BLOCK_SCOPE_MAX_ELEMENTS
    from loopkern.jaxloops import lower
    assert lower.PREFETCH_RIM_MIN_CELLS == AUTO_BLOCK_SCOPE_MAX_ELEMENTS


# ------------------------------------------------------------------ convolutions (jaxloops/conv.py)
@pytest.mark.parametrize("mode", ["same", "full", "valid"])
def test_jnp_convolve_heat_body(mode, rng):
    u0 = f32(rng, 50)
    k = jnp.array([0.25, 0.5, 0.25], jnp.float32)

    def body(i, x):
        y = jnp.convolve(x, k, mode=mode)
        off = (y.shape[0] - 48) // 2
        return x.at[1:-1].set(y[off:off + 48])
    got = lk.fori_loop(0, 20, body, u0, fallback="error")
    same(got, lax.fori_loop(0, 20, body, u0), exact=False)
    # float64 NumPy: the same smoothing of the interior
    ref = np.asarray(u0, np.float64)
    for _ in range(20):
        y = np.convolve(ref, [0.25, 0.5, 0.25], mode=mode)
        off = (y.shape[0] - 48) // 2
        ref = ref.copy()
        ref[1:-1] = y[off:off + 48]
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)


def test_convolve2d_laplacian_closed_over_and_carried(rng):
    """jax.scipy.signal.convolve2d with a 5-point Laplacian kernel: closed over (its weights
    become literals) and carried (read from the kernel array), against lax and float64 NumPy."""
    from jax.scipy.signal import convolve2d
    u0 = f32(rng, 20, 17)
    lap = np.array([[0, 1, 0], [1, -4, 1], [0, 1, 0]], np.float32)
    got = lk.fori_loop(0, 30, lambda i, x: x + 0.2 * convolve2d(x, jnp.asarray(lap), mode="same"), u0,
                       fallback="error")
    ref = np.asarray(u0, np.float64)
    for _ in range(30):
        p = np.pad(ref, 1)
        ref = ref + 0.2 * (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * p[1:-1, 1:-1])
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)

    def carried(i, c):
        x, w = c
        return x + 0.1 * convolve2d(x, w, mode="same"), w * np.float32(0.99)
    init = (u0, jnp.asarray(lap))
    same(lk.fori_loop(0, 10, carried, init, fallback="error"), lax.fori_loop(0, 10, carried, init), exact=False)


def test_lax_conv_with_channels_and_kernel_dilation(rng):
    x0 = f32(rng, 2, 3, 12, 11)
    w = jnp.asarray(rng.random((4, 3, 3, 2)).astype(np.float32) * 0.1)

    def body(i, x):
        y = lax.conv_general_dilated(x, w, (1, 1), [(0, 0), (1, 0)], rhs_dilation=(2, 2))
        return x.at[:, :, :8, :8].add(0.1 * y[:, :3, :8, :8])
    same(lk.fori_loop(0, 3, body, x0, fallback="error"), lax.fori_loop(0, 3, body, x0), exact=False,
         rtol=1e-5, atol=1e-6)


def test_conv_with_a_wider_preferred_element_type(rng):
    """int8 inputs summed into int32 (preferred_element_type) must not wrap at 8 bits: the
    products and sums in the result's type, as XLA computes them; against lax and NumPy."""
    x = jnp.asarray(rng.integers(-128, 128, (1, 1, 40), dtype=np.int8))
    w = jnp.asarray(rng.integers(-128, 128, (1, 1, 5), dtype=np.int8))

    def body(i, acc):
        a = lax.conv_general_dilated(x, w, (1,), "SAME", preferred_element_type=jnp.int32)
        b = jnp.convolve(x[0, 0], w[0, 0] + i.astype(jnp.int8), mode="full", preferred_element_type=jnp.int32)
        return acc + a[0, 0] + b[2:-2]
    acc0 = jnp.zeros(40, jnp.int32)
    got = lk.fori_loop(0, 3, body, acc0, fallback="error")
    same(got, lax.fori_loop(0, 3, body, acc0))
    xs, ws = np.asarray(x[0, 0], np.int64), np.asarray(w[0, 0], np.int64)
    want = sum(np.correlate(np.pad(xs, 2), ws, "valid") + np.convolve(xs, (ws + i + 128) % 256 - 128)[2:-2]
               for i in range(3))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("what, conv", [
    ("strided", lambda x, w: lax.conv_general_dilated(x, w, (2,), [(1, 1)])),
    ("grouped", lambda x, w: lax.conv_general_dilated(jnp.concatenate([x, x], 1), jnp.concatenate([w, w], 0), (1,),
                                                      [(1, 1)], feature_group_count=2)[:, :1]),
])
def test_convolutions_outside_the_subset_fall_back(what, conv, rng):
    x0 = f32(rng, 1, 1, 16)
    w = jnp.asarray(np.array([[[0.25, 0.5, 0.25]]], np.float32))

    def body(i, x):
        y = conv(x, w)
        return x.at[:, :, :y.shape[2]].set(y)
    assert_falls_back(body, x0, 3, "conv_general_dilated", error_match=what)


def test_jnp_tile(rng):
    x0 = f32(rng, 4, 5)

    def body(i, x):
        t = jnp.tile(x, (2, 1, 3))                    # (2, 4, 15)
        return 0.5 * x + 0.25 * (t[1, :, 5:10] + t[0, :, 10:15]) + 0.01 * jnp.tile(x[0], 2)[3:8]
    same(lk.fori_loop(0, 4, body, x0, fallback="error"), lax.fori_loop(0, 4, body, x0), exact=False)
    ref = np.asarray(x0, np.float64)
    for _ in range(4):
        ref = 0.5 * ref + 0.5 * ref + 0.01 * np.tile(ref[0], 2)[3:8]
    np.testing.assert_allclose(np.asarray(lk.fori_loop(0, 4, body, x0, fallback="error")), ref, rtol=1e-5)


def test_jnp_prod(rng):
    """jnp.prod along axes and of a whole array (floats to rounding, integers bit for bit with
    their wraparound); more than lower.PROD_WHOLE_MAX elements into one value falls back."""
    x0 = jnp.asarray(rng.uniform(0.9, 1.1, (6, 7)).astype(np.float32))

    def body(i, x):
        y = x * 1.001
        return y * 0.5 + 0.5 * jnp.prod(y, axis=1, keepdims=True) ** (1 / 7) + 0.001 * jnp.prod(y)
    same(lk.fori_loop(0, 5, body, x0, fallback="error"), lax.fori_loop(0, 5, body, x0), exact=False, rtol=1e-5)
    i0 = jnp.asarray(rng.integers(-9, 10, (5, 4)).astype(np.int32))

    def ints(i, x):
        return x.at[0].set(jnp.prod(x, axis=0) % 1000 + 1).at[1, 0].set(jnp.prod(x[2:] * 7919) % 977)
    same(lk.fori_loop(0, 3, ints, i0, fallback="error"), lax.fori_loop(0, 3, ints, i0))
    assert_falls_back(lambda i, x: x * jnp.prod(x), jnp.ones(5000, jnp.float32), 2, "reduce_prod",
                      error_match="5000 elements")
