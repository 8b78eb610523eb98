"""``jax.random`` inside lk.fori_loop / while_loop / scan bodies (JAX's CPU backend; loopkern's CPU
backend runs the kernel): keys in the carry, closed over, scanned over and returned as ys, typed
(``jax.random.key``) and legacy (``jax.random.PRNGKey``); ``bits``, ``split``, ``fold_in``,
``key``/``PRNGKey`` from a traced seed, ``uniform``, ``normal``, ``bernoulli``, ``randint``; keys
moved by slices, ``lax.cond`` and ``vmap``.

Random bits are compared bit for bit with the same loop run by ``jax.lax`` and with an
independent NumPy Threefry-2x32 (checked itself against JAX's hash and Random123's
known-answer vectors); floats drawn from them to a tolerance (XLA may fuse a multiply and an add;
``normal``'s inverse error function is a polynomial), ``erf_inv`` against a float64 reference.
Every compiled test passes ``fallback="error"``, so a body that ran as the lax loop would fail."""

import warnings

import numpy as np
import pytest

import loopkern as lk
from refs import jax_x64, np_bits, np_fold_in, np_gamma, np_split, np_threefry

jax = pytest.importorskip("jax")
jnp = jax.numpy
lax = jax.lax


@pytest.fixture(autouse=True)
def cpu_and_partitionable():
    if jax.default_backend() != "cpu":
        pytest.skip("these tests run on JAX's CPU backend (see tests/gpu for the GPU)")
    if not jax.config.jax_threefry_partitionable:
        pytest.skip("loopkern draws bits as JAX does with jax_threefry_partitionable on (its default since 0.5)")


def test_numpy_threefry_reference():
    """The NumPy hash above against Random123's known-answer vectors and JAX's own."""
    assert [int(v[0]) for v in np_threefry(0, 0, [0], [0])] == [0x6B200159, 0x99BA4EFE]
    assert [int(v[0]) for v in np_threefry(0xFFFFFFFF, 0xFFFFFFFF, [0xFFFFFFFF], [0xFFFFFFFF])] == \
        [0x1CB996FC, 0xBB002BE7]
    assert [int(v[0]) for v in np_threefry(0x13198A2E, 0x03707344, [0x243F6A88], [0x85A308D3])] == \
        [0xC4923A9C, 0x483DF7A0]
    key = np.array([123456789, 987654321], np.uint32)
    np.testing.assert_array_equal(np_bits(key, 50), np.asarray(jax.random.bits(jax.random.wrap_key_data(key),
                                                                                 (50,), jnp.uint32)))
    np.testing.assert_array_equal(np_fold_in(key, 7),
                                  np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), 7))))


def same(got, ref, exact=True, rtol=2e-6, atol=1e-6):
    """Same pytree, shapes and dtypes (keys: the same implementation and words); values bit for
    bit (exact) or to a tolerance."""
    g_leaves, g_tree = jax.tree_util.tree_flatten(got)
    r_leaves, r_tree = jax.tree_util.tree_flatten(ref)
    assert g_tree == r_tree
    for g, r in zip(g_leaves, r_leaves):
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, g.dtype, r.shape, r.dtype)
        if jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key):
            g, r = jax.random.key_data(g), jax.random.key_data(r)
        if exact:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=rtol, atol=atol)


@pytest.fixture
def rng():
    return np.random.default_rng(20261207)


# ----------------------------------------------------------------- bits, bit for bit
@pytest.mark.parametrize("shape", [(37,), (5, 7), (3, 4, 2)])
@pytest.mark.parametrize("legacy", [False, True])
def test_bits_of_a_closed_over_key_folded_with_the_index(shape, legacy, rng):
    seed = int(rng.integers(2 ** 31))
    key = jax.random.PRNGKey(seed) if legacy else jax.random.key(seed)
    x0 = jnp.asarray(rng.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32))

    def body(i, x):
        return x ^ jax.random.bits(jax.random.fold_in(key, i), shape, jnp.uint32)
    got = lk.fori_loop(0, 9, body, x0, fallback="error")
    same(got, lax.fori_loop(0, 9, body, x0))
    # the NumPy reference: the xor of nine draws of the flat shape
    raw = np.asarray(jax.random.key_data(key) if not legacy else key, np.uint32)
    ref = np.asarray(x0).reshape(-1).copy()
    for i in range(9):
        ref ^= np_bits(np_fold_in(raw, i), ref.size)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), ref)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.uint32])
def test_bits_of_narrow_widths_from_a_carried_key(dtype, rng):
    x0 = jnp.zeros(29, dtype)

    def body(i, c):
        x, k = c
        k, sub = jax.random.split(k)
        return x + jax.random.bits(sub, x.shape, dtype), k
    init = (x0, jax.random.key(int(rng.integers(2 ** 31))))
    same(lk.fori_loop(0, 6, body, init, fallback="error"), lax.fori_loop(0, 6, body, init))


def test_split_into_many_keys_sliced_and_vmapped(rng):
    """split(key, 5): a key array sliced per key (slice + squeeze on keys) and drawn from under
    vmap (a batch of keys: random_bits of a key array)."""
    x0 = jnp.zeros((5, 6), jnp.uint32)

    def body(i, c):
        x, k = c
        ks = jax.random.split(k, 6)
        rows = jax.vmap(lambda kk: jax.random.bits(kk, (6,), jnp.uint32))(ks[1:])
        return x ^ rows, ks[0]
    init = (x0, jax.random.key(int(rng.integers(2 ** 31))))
    same(lk.fori_loop(0, 4, body, init, fallback="error"), lax.fori_loop(0, 4, body, init))


@pytest.mark.parametrize("x64", [False, True])
def test_keys_made_from_a_traced_seed(x64, rng):
    """jax.random.key and PRNGKey of the loop index (random_seed; a 64-bit seed under x64 puts
    its high word first)."""
    def body(i, x):
        a = jax.random.bits(jax.random.key(i * 7919 + 3), x.shape, jnp.uint32)
        b = jax.random.bits(jax.random.PRNGKey(-i - 2), x.shape, jnp.uint32)
        return x ^ a ^ (b >> 1)
    if x64:
        with jax_x64():
            x0 = jnp.zeros(11, jnp.uint32)
            lo = jnp.int64(2 ** 33)
            same(lk.fori_loop(lo, lo + 5, body, x0, fallback="error"), lax.fori_loop(lo, lo + 5, body, x0))
    else:
        x0 = jnp.zeros(11, jnp.uint32)
        same(lk.fori_loop(0, 5, body, x0, fallback="error"), lax.fori_loop(0, 5, body, x0))


def test_a_key_chosen_by_lax_cond(rng):
    def body(i, c):
        x, k1, k2 = c
        k = lax.cond(i % 3 == 0, lambda a, b: a, lambda a, b: b, k1, k2)
        k1, k2 = jax.random.split(k)
        return x ^ jax.random.bits(k, x.shape, jnp.uint32), k1, k2
    init = (jnp.zeros(13, jnp.uint32), jax.random.key(1), jax.random.key(2))
    same(lk.fori_loop(0, 7, body, init, fallback="error"), lax.fori_loop(0, 7, body, init))


def test_keys_gathered_and_scattered_at_computed_indices(rng):
    """ks[idx] (a gather) and ks.at[j].set(k) (a scatter) of a key array: the same operation
    on each of its words."""
    def body(i, c):
        x, ks = c
        picked = ks[(jnp.arange(8) * 3 + i) % 8]
        ks = ks.at[(i * 5) % 8].set(jax.random.fold_in(ks[0], i))
        return x ^ jax.vmap(lambda k: jax.random.bits(k, (), jnp.uint32))(picked), ks
    init = (jnp.zeros(8, jnp.uint32), jax.random.split(jax.random.key(int(rng.integers(2 ** 31))), 8))
    same(lk.fori_loop(0, 6, body, init, fallback="error"), lax.fori_loop(0, 6, body, init))


# ----------------------------------------------------------------- draws, as JAX users write them
def test_random_walk_with_uniform_normal_and_bernoulli(rng):
    x0 = jnp.asarray(rng.random(300).astype(np.float32))

    def body(i, c):
        x, key = c
        key, a, b, d = jax.random.split(key, 4)
        step = 0.1 * jax.random.normal(a, x.shape) + jax.random.uniform(b, x.shape, minval=-0.05, maxval=0.05)
        keep = jax.random.bernoulli(d, 0.9, x.shape)
        return jnp.where(keep, x + step, x), key
    init = (x0, jax.random.key(int(rng.integers(2 ** 31))))
    got = lk.fori_loop(0, 40, body, init, fallback="error")
    ref = lax.fori_loop(0, 40, body, init)
    same(got[1], ref[1])                                   # the key: bit for bit
    same(got[0], ref[0], exact=False, rtol=1e-5, atol=1e-5)


def test_randint_and_uniform_scan_over_split_keys_recording_keys(rng):
    """lax.scan over keys (xs a key array), with the draws and the keys themselves as ys."""
    keys = jax.random.split(jax.random.key(int(rng.integers(2 ** 31))), 12)

    def f(c, k):
        a, b = jax.random.split(k)
        n = jax.random.randint(a, (4,), -50, 50)
        u = jax.random.uniform(b, (4,))
        return c + n, (u, a)
    init = jnp.zeros(4, jnp.int32)
    got = lk.scan(f, init, keys, fallback="error")
    ref = lax.scan(f, init, keys)
    same(got[0], ref[0])
    same(got[1][1], ref[1][1])
    same(got[1][0], ref[1][0], exact=False)


def test_while_loop_random_walk_to_a_threshold(rng):
    def cond(c):
        return (jnp.max(jnp.abs(c[0])) < 3.0) & (c[2] < 10_000)

    def body(c):
        x, key, n = c
        key, sub = jax.random.split(key)
        return x + jax.random.normal(sub, x.shape), key, n + 1
    init = (jnp.zeros(64, jnp.float32), jax.random.key(int(rng.integers(2 ** 31))), 0)
    got = lk.while_loop(cond, body, init, fallback="error")
    ref = lax.while_loop(cond, body, init)
    assert int(got[2]) == int(ref[2]) > 1
    same(got[1], ref[1])
    same(got[0], ref[0], exact=False, rtol=1e-5, atol=1e-5)


def test_in_jit_with_a_traced_key(rng):
    @jax.jit
    def run(x, key):
        return lk.fori_loop(0, 5, lambda i, x: x + jax.random.uniform(jax.random.fold_in(key, i), x.shape), x,
                            fallback="error")
    x0 = jnp.zeros(17, jnp.float32)
    key = jax.random.key(int(rng.integers(2 ** 31)))
    ref = lax.fori_loop(0, 5, lambda i, x: x + jax.random.uniform(jax.random.fold_in(key, i), x.shape), x0)
    same(run(x0, key), ref, exact=False)


# ----------------------------------------------------------------- the primitives underneath
def test_erf_inv_against_float64(rng):
    from math import erf
    xs = np.concatenate([rng.uniform(-1, 1, 200), [0.0, -0.0, 1.0, -1.0, 1.5, -2.0, np.nan, 1e-30, -1e-30,
                                                    0.999999, -0.9999999, 0.5, -0.5, 0.49999997]])

    def body(i, x):
        return lax.erf_inv(x)
    for dtype, tol in ((np.float32, 3e-6), (np.float64, 1e-13)):
        ctx = jax_x64() if dtype == np.float64 else _nothing()
        with ctx:
            x0 = jnp.asarray(xs.astype(dtype))
            got = np.asarray(lk.fori_loop(0, 1, body, x0, fallback="error"), np.float64)
        src = xs.astype(dtype).astype(np.float64)
        for g, v in zip(got, src):
            if np.isnan(v) or abs(v) > 1:
                assert np.isnan(g)
            elif abs(v) == 1:
                assert g == np.copysign(np.inf, v)
            elif v == 0:
                assert g == 0 and np.signbit(g) == np.signbit(v)
            else:
                # erf of the result is the input: a float64 check that needs no erfinv
                assert abs(erf(g) - v) <= tol * abs(v) + (2e-7 if dtype == np.float32 else 1e-16) * (1 - abs(v)) \
                    or abs(g - _erfinv_ref(v)) <= tol * abs(_erfinv_ref(v)), (dtype, v, g)


def _erfinv_ref(v):
    """erfinv in float64 by bisection on math.erfc / math.erf (slow, independent)."""
    from math import erf, erfc
    a, lo, hi = abs(v), 0.0, 10.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if (erf(mid) < a) if a < 0.5 else (erfc(mid) > 1 - a):
            lo = mid
        else:
            hi = mid
    return np.copysign(0.5 * (lo + hi), v)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _same_floats(g, ref, itype):
    """Bit for bit, NaNs as NaNs; a subnormal may come back as the zero of its sign: the CPU
    kernel runs as JAX's host callback, on a thread of XLA's that flushes subnormal results of
    arithmetic (the same kernel run directly keeps them; a GPU keeps them)."""
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(g), nan)
    sub = ~nan & (ref != 0) & (np.abs(ref) < np.finfo(ref.dtype).tiny)
    flushed = sub & (g == 0) & (np.signbit(g) == np.signbit(ref))
    keep = ~nan & ~flushed
    np.testing.assert_array_equal(g[keep].view(itype), ref[keep].view(itype))
    assert (~sub).sum() > 0.9 * g.size      # mostly normal numbers, compared bit for bit


def test_bitcasts_of_random_bit_patterns(rng):
    """bitcast_convert_type of int32/uint32 to float32 over random patterns with zeros,
    denormals, infinities and NaNs among them, against NumPy's view; NaNs compare as NaN (their
    payload is not kept). An integer to the other integer type of its width wraps."""
    pats = rng.integers(0, 2 ** 32, 400, dtype=np.uint64).astype(np.uint32)
    pats[:8] = [0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F7FFFFF]
    for itype in (np.uint32, np.int32):
        init = (jnp.asarray(pats.view(itype)), jnp.zeros(400, jnp.float32))

        def body(i, c):
            return c[0], lax.bitcast_convert_type(c[0], jnp.float32)
        got = np.asarray(lk.fori_loop(0, 1, body, init, fallback="error")[1])
        _same_floats(got, pats.view(np.float32), np.uint32)

    def flip(i, x):
        return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) + 1, jnp.uint32)
    x0 = jnp.asarray(pats)
    got = lk.fori_loop(0, 3, flip, x0, fallback="error")
    same(got, lax.fori_loop(0, 3, flip, x0))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(np.asarray(got), pats + np.uint32(3))


def test_bitcast_of_int64_to_float64(rng):
    with jax_x64():
        pats = rng.integers(-2 ** 63, 2 ** 63 - 1, 300, dtype=np.int64)
        pats[:6] = [0, -2 ** 63, 1, 0x7FF0000000000000, -0x10000000000000, 0x000FFFFFFFFFFFFF]
        init = (jnp.asarray(pats), jnp.zeros(300, jnp.float64))

        def body(i, c):
            return c[0], lax.bitcast_convert_type(c[0], jnp.float64)
        got = np.asarray(lk.fori_loop(0, 1, body, init, fallback="error")[1])
    _same_floats(got, pats.view(np.float64), np.int64)


# ----------------------------------------------------------------- gamma and the draws built on it
def test_gamma_draws_against_numpy_and_lax(rng):
    """jax.random.gamma (JAX's own sampler inlined: a vmapped while_loop per element, each
    element's rejection loop running on its own, with a while_loop nested in it) for shape
    parameters on both sides of 1, against an independent float64 NumPy run of Marsaglia and
    Tsang's loop on the NumPy Threefry's bits (refs.np_gamma) and against lax."""
    alphas = np.concatenate([[0.05, 0.3, 0.999, 1.0, 1.5], rng.uniform(0.1, 6.0, 43)]).astype(np.float32)
    a = jnp.asarray(alphas)

    def body(i, c):
        x, k = c
        k, s = jax.random.split(k)
        return x + jax.random.gamma(s, a), k
    seed = int(rng.integers(2 ** 31))
    init = (jnp.zeros(alphas.size, jnp.float32), jax.random.key(seed))
    got = lk.fori_loop(0, 3, body, init, fallback="error")
    ref = lax.fori_loop(0, 3, body, init)
    same(got[1], ref[1])
    same(got[0], ref[0], exact=False, rtol=2e-5, atol=1e-6)
    key, want = np.asarray(jax.random.key_data(init[1])), np.zeros(alphas.size)
    for _ in range(3):
        key, sub = np_split(key, 2)
        want += np_gamma(sub, alphas.astype(np.float64), _erfinv_ref)
    np.testing.assert_allclose(np.asarray(got[0], np.float64), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("draw", ["beta", "dirichlet", "chisquare", "t", "loggamma", "generalized_normal"])
def test_draws_built_on_gamma(draw, rng):
    shape = (40, 3)
    alpha = jnp.asarray([0.4, 1.0, 2.5], jnp.float32)
    draws = {"beta": lambda k: jax.random.beta(k, 0.5, alpha, shape),
             "dirichlet": lambda k: jax.random.dirichlet(k, alpha, shape[:1]),
             "chisquare": lambda k: jax.random.chisquare(k, alpha, shape),
             "t": lambda k: jax.random.t(k, alpha + 2.0, shape),
             "loggamma": lambda k: jax.random.loggamma(k, alpha, shape),
             "generalized_normal": lambda k: jax.random.generalized_normal(k, 1.5, shape)}

    def body(i, c):
        x, k = c
        k, s = jax.random.split(k)
        return x + draws[draw](s), k
    init = (jnp.zeros(shape, jnp.float32), jax.random.key(int(rng.integers(2 ** 31))))
    got = lk.fori_loop(0, 3, body, init, fallback="error")
    ref = lax.fori_loop(0, 3, body, init)
    same(got[1], ref[1])
    same(got[0], ref[0], exact=False, rtol=2e-5, atol=2e-5)
    if draw == "dirichlet":     # each row of a draw sums to one
        np.testing.assert_allclose(np.asarray(got[0]).sum(axis=1), 3.0, rtol=1e-5)


@pytest.mark.parametrize("lo, hi", [(-1.0, 2.0), (0.0, np.inf), (-np.inf, -0.5), ("run time", 1.5)])
def test_truncated_normal(lo, hi, rng):
    """truncated_normal nudges its bounds inwards with nextafter, folded when they are
    constants (NumPy's nextafter at lowering time), jl_nextafter when they are known at run
    time only: against lax, and every draw inside its bounds."""
    def body(i, c):
        x, y, k = c
        k, s = jax.random.split(k)
        low = lo if lo != "run time" else -0.25 * i.astype(jnp.float32) - 0.5
        d = jax.random.truncated_normal(s, low, hi, x.shape)
        return x + d, jnp.minimum(y, jnp.where((d > low) & (d < hi), 1, 0)), k
    init = (jnp.zeros(500, jnp.float32), jnp.ones(500, jnp.int32), jax.random.key(int(rng.integers(2 ** 31))))
    got = lk.fori_loop(0, 4, body, init, fallback="error")
    ref = lax.fori_loop(0, 4, body, init)
    same(got[2], ref[2])
    same(got[0], ref[0], exact=False, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got[1]) == 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nextafter_of_run_time_values_against_numpy(dtype, rng):
    """lax.nextafter of values known at run time (jl_nextafter: the spacing at x), bit for bit
    against NumPy's IEEE nextafter: zeros, the smallest normal numbers (whose neighbours below
    are subnormal), powers of two in both directions, the largest finite values, infinities,
    NaNs and random values. (Subnormal operands: the simulator test of jl_nextafter, since the
    CPU kernel inside JAX runs on an XLA thread that reads subnormal inputs as zeros.)"""
    fi = np.finfo(dtype)
    special = np.array([0.0, -0.0, fi.tiny, -fi.tiny, 2 * fi.tiny, 1.0, -1.0, 0.5, 2.0, fi.max, -fi.max,
                        np.inf, -np.inf, np.nan, 3.0], dtype)
    xs = np.concatenate([special, special, rng.standard_normal(40).astype(dtype)])
    ys = np.concatenate([np.full(special.size, np.inf, dtype), np.full(special.size, -np.inf, dtype),
                         rng.standard_normal(40).astype(dtype)])
    ys[5], ys[7], ys[20] = xs[5], np.nan, xs[20]            # equal operands, a NaN direction

    def body(i, c):
        x, y, z = c
        return x, y, lax.nextafter(x, y)
    with (jax_x64() if dtype == np.float64 else _nothing()):
        init = (jnp.asarray(xs), jnp.asarray(ys), jnp.zeros(xs.size, dtype))
        got = np.asarray(lk.fori_loop(0, 1, body, init, fallback="error")[2])
    # (a subnormal result may come back as the zero of its sign: _same_floats says why)
    _same_floats(got, np.nextafter(xs, ys), np.uint32 if dtype == np.float32 else np.uint64)


def test_gamma_draws_in_float64(rng):
    with jax_x64():
        a = jnp.asarray(rng.uniform(0.2, 4.0, 30))

        def body(i, c):
            x, k = c
            k, s = jax.random.split(k)
            return x + jax.random.gamma(s, a, dtype=jnp.float64), k
        init = (jnp.zeros(30, jnp.float64), jax.random.key(int(rng.integers(2 ** 31))))
        got = lk.fori_loop(0, 2, body, init, fallback="error")
        ref = lax.fori_loop(0, 2, body, init)
    same(got[1], ref[1])
    same(got[0], ref[0], exact=False, rtol=1e-12, atol=1e-14)


def test_a_vmapped_while_loop_runs_each_element_to_its_own_condition(rng):
    """A while_loop vmapped over a carry (one condition per element: XLA iterates while any
    holds and keeps each element's carry once its own fails) runs per element: Collatz step
    counts, bit for bit against lax and plain Python."""
    x0 = rng.integers(1, 3000, 150).astype(np.int32)

    def steps_to_one(n):
        def step(c):
            n, k = c
            return jnp.where(n % 2 == 0, n // 2, 3 * n + 1), k + 1
        return lax.while_loop(lambda c: c[0] != 1, step, (n, jnp.int32(0)))[1]

    def body(i, c):
        x, total = c
        return x + 1, total + jax.vmap(steps_to_one)(x)
    init = (jnp.asarray(x0), jnp.zeros(150, jnp.int32))
    got = lk.fori_loop(0, 3, body, init, fallback="error")
    same(got, lax.fori_loop(0, 3, body, init))

    def collatz(n):
        k = 0
        while n != 1:
            n, k = (n // 2 if n % 2 == 0 else 3 * n + 1), k + 1
        return k
    want = [sum(collatz(int(v) + i) for i in range(3)) for v in x0]
    np.testing.assert_array_equal(np.asarray(got[1]), want)


def test_a_vmapped_while_loop_over_rows_runs_the_lax_loop():
    """Each row's loop reads its whole row (a max in its condition): not per element, and a
    sequential loop of all rows would not stop each row on its own condition."""
    def body(i, m):
        return jax.vmap(lambda r: lax.while_loop(lambda r: jnp.max(r) < 10.0, lambda r: r + jnp.roll(r, 1), r))(m)
    _falls_back(body, jnp.asarray(np.linspace(0.1, 1.0, 12, dtype=np.float32).reshape(3, 4)),
                "one condition per element")


# ----------------------------------------------------------------- what still runs the lax loop
def _falls_back(body, init, match):
    with pytest.raises(lk.StepSyntaxError, match=match):
        lk.fori_loop(0, 3, body, init, fallback="error")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = lk.fori_loop(0, 3, body, init)
    assert any(issubclass(x.category, lk.JaxLoopWarning) for x in w)
    same(got, lax.fori_loop(0, 3, body, init))
    return [str(x.message) for x in w if issubclass(x.category, lk.JaxLoopWarning)]


def test_a_key_of_another_implementation_runs_the_lax_loop():
    init = (jnp.zeros(8, jnp.uint32), jax.random.key(3, impl="rbg"))

    def body(i, c):
        x, k = c
        k, s = jax.random.split(k)
        return x ^ jax.random.bits(s, x.shape, jnp.uint32), k
    (msg,) = _falls_back(body, init, "rbg")
    # the carry's key is where it comes from, not loopkern's wrapping of the body
    assert "the loop's carry" in msg and "loops.py" not in msg, msg


def test_64_bit_draws_with_x64(rng):
    """float64 uniform and normal draws and uint64 bits (64-bit random bits: the hash's first
    word high, the second low)."""
    with jax_x64():
        init = (jnp.zeros(23, jnp.float64), jnp.zeros(23, jnp.uint64), jax.random.key(int(rng.integers(2 ** 31))))

        def body(i, c):
            x, b, k = c
            k, s, t = jax.random.split(k, 3)
            x = x + jax.random.uniform(s, x.shape, jnp.float64) + 1e-3 * jax.random.normal(t, x.shape, jnp.float64)
            return x, b ^ jax.random.bits(s, b.shape, jnp.uint64), k
        got = lk.fori_loop(0, 6, body, init, fallback="error")
        ref = lax.fori_loop(0, 6, body, init)
    same(got[1:], ref[1:])
    same(got[0], ref[0], exact=False, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_64_bit_shifts(dtype, rng):
    """Left, logical and arithmetic right shifts of uint64 and int64 values by counts from 0 to
    past 64 (and negative ones: huge as XLA reads them), bit for bit against lax."""
    with jax_x64():
        info = np.iinfo(dtype)
        vals = rng.integers(info.min, info.max, 64, dtype=dtype, endpoint=True)
        vals[:4] = [info.min, info.max, 0, 1]
        counts = np.arange(-2, 70, dtype=np.int64)[:64].astype(dtype)

        def body(i, c):
            v, a, b, d = c
            return (v, lax.shift_left(v, counts), lax.shift_right_logical(v, counts),
                    lax.shift_right_arithmetic(v, counts))
        z = jnp.zeros(64, dtype)
        init = (jnp.asarray(vals), z, z, z)
        same(lk.fori_loop(0, 1, body, init, fallback="error"), lax.fori_loop(0, 1, body, init))


def test_draws_without_partitionable_threefry_run_the_lax_loop():
    init = (jnp.zeros(8, jnp.uint32), jax.random.key(3))

    def body(i, c):
        x, k = c
        k, s = jax.random.split(k)
        return x ^ jax.random.bits(s, x.shape, jnp.uint32), k
    jax.config.update("jax_threefry_partitionable", False)
    try:
        _falls_back(body, init, "jax_threefry_partitionable")
    finally:
        jax.config.update("jax_threefry_partitionable", True)


def test_a_body_that_turns_a_key_into_another_type_runs_the_lax_loop():
    """The carry holds a key; a body returning its words instead is lax's type error, not a
    silently different carry."""
    init = (jnp.zeros(4, jnp.uint32), jax.random.key(0))
    with pytest.raises(TypeError):
        lk.fori_loop(0, 2, lambda i, c: (c[0], jax.random.key_data(c[1])), init, fallback="error")
    with pytest.raises(TypeError):
        lax.fori_loop(0, 2, lambda i, c: (c[0], jax.random.key_data(c[1])), init)


def test_unstacked_keys_and_arrays(rng):
    """lax.unstack (how some JAX versions iterate over an array: ``k, a, b = jax.random.split(k,
    3)``): of a key array and of an array along either axis."""
    m0 = jnp.asarray(rng.random((3, 5)).astype(np.float32))

    def body(i, c):
        m, k = c
        k, a, b = lax.unstack(jax.random.split(k, 3))
        r0, r1, r2 = lax.unstack(m)
        c0, *_, c4 = lax.unstack(m, axis=1)
        m = m + 0.1 * jax.random.uniform(a, m.shape) - 0.01 * jax.random.uniform(b, m.shape)
        return m.at[0].set(r2 - r1 + r0).at[:, 0].add(c4 * c0), k
    init = (m0, jax.random.key(int(rng.integers(2 ** 31))))
    got = lk.fori_loop(0, 4, body, init, fallback="error")
    ref = lax.fori_loop(0, 4, body, init)
    same(got[1], ref[1])
    same(got[0], ref[0], exact=False, rtol=1e-5, atol=1e-5)
