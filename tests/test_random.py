"""lk.random: the draws against an independent Philox4x32-10 (tests/refs.py, written from the
published algorithm) for every (seed, step, key, subkey, call site), on every backend and
launch shape; the statistics against theory; and the errors for bad uses."""

import math

import numpy as np
import pytest

import loopkern as lk
import refs
from loopkern.runtime.philox import build

BACKENDS = [pytest.param("cpu", None, None, id="cpu"),
            pytest.param("cuda", "grid", 32, id="sim-grid32", marks=pytest.mark.sim),
            pytest.param("cuda", "block", 96, id="sim-block96", marks=pytest.mark.sim)]

# Random123's known-answer vectors for philox4x32-10: (counter, key, output)
KNOWN_ANSWERS = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
                 ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
                 ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
                  (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


def test_reference_philox_known_answers_and_vectorised_form(rng):
    for ctr, key, want in KNOWN_ANSWERS:
        assert refs.philox4x32_10(ctr, key) == want
        got = refs.philox4x32_10_np([np.array([c]) for c in ctr], key)
        assert tuple(int(g[0]) for g in got) == want
    # the NumPy form equals the plain-Python form on random counters and keys
    ctr = rng.integers(0, 1 << 32, (4, 300), dtype=np.uint64)
    key = rng.integers(0, 1 << 32, 2, dtype=np.uint64)
    vec = refs.philox4x32_10_np(list(ctr), tuple(int(k) for k in key))
    for j in range(300):
        assert tuple(int(w[j]) for w in vec) == refs.philox4x32_10([int(c) for c in ctr[:, j]], key)


def test_loopkerns_philox_equals_the_reference(rng):
    philox, _, _ = build(lambda f: f, python=True)   # loopkern's generator as plain Python
    u = np.uint64
    for ctr, key, want in KNOWN_ANSWERS:
        assert tuple(int(g) for g in philox(*(u(c) for c in ctr), *(u(k) for k in key))) == want
    for _ in range(200):
        ctr = [int(x) for x in rng.integers(0, 1 << 32, 4, dtype=np.uint64)]
        key = [int(x) for x in rng.integers(0, 1 << 32, 2, dtype=np.uint64)]
        got = philox(*(u(c) for c in ctr), *(u(k) for k in key))
        assert tuple(int(g) for g in got) == refs.philox4x32_10(ctr, key)


def draws(t, t0, koff, sub, out, noise):
    n = out.shape[1]
    for i in lk.range(n):
        k = i + koff
        out[t - t0, i] = lk.random.uniform(k)            # call site 1
        noise[t - t0, i, 0] = lk.random.normal(k)        # call site 2
        noise[t - t0, i, 1] = lk.random.normal(k, sub)   # call site 3: a subkey, another stream


DRAWS = lk.megakernel(draws)


def run_draws(seed, n, steps, start=0, koff=0, sub=7, backend="cpu", scope=None, threads=None, blocks=None):
    out = np.full((steps, n), -1.0)
    noise = np.full((steps, n, 2), np.nan)
    run = DRAWS(start, koff, sub, out, noise, steps=steps, start=start, backend=backend, scope=scope,
                threads=threads, blocks=blocks, seed=seed)
    assert run.steps == steps
    return out, noise


def reference_draws(seed, n, steps, start=0, koff=0, sub=7):
    """What lk.random documents: a pure function of (seed, step, key, subkey, call site)."""
    t = np.arange(start, start + steps)[:, None]
    keys = np.arange(n)[None, :] + koff
    u = refs.uniform_np(seed, t, keys, 0, 1)
    z = np.stack([refs.normal_np(seed, t, keys, 0, 2), refs.normal_np(seed, t, keys, sub, 3)], axis=-1)
    return u, z


def _random_call(rng):
    return dict(seed=int(rng.integers(0, 1 << 64, dtype=np.uint64)), start=int(rng.integers(0, 1 << 31)),
                koff=int(rng.integers(0, 1 << 62)), sub=int(rng.integers(1, 1 << 32)))


@pytest.mark.parametrize("backend,scope,threads", BACKENDS)
def test_draws_match_an_independent_philox(backend, scope, threads, rng):
    n, steps = (70, 3) if backend == "cuda" else (1000, 4)
    for call in (_random_call(rng), dict(seed=0, start=0, koff=0, sub=7)):
        u, z = run_draws(n=n, steps=steps, backend=backend, scope=scope, threads=threads, **call)
        ref_u, ref_z = reference_draws(n=n, steps=steps, **call)
        np.testing.assert_array_equal(u, ref_u)                 # uniform: bit for bit
        # normal: NumPy's log/cos against the C library's may differ in the last bit
        np.testing.assert_allclose(z, ref_z, rtol=1e-13, atol=1e-14)
        if backend != "cpu":                                    # and the CPU backend agrees too
            cu, cz = run_draws(n=n, steps=steps, **call)
            np.testing.assert_array_equal(u, cu)
            np.testing.assert_array_equal(z, cz)


def shifted_draws(t, out, noise):
    for i in lk.range(out.shape[1]):
        out[t, i] = lk.random.uniform(i - 3)             # call site 1
        noise[t, i] = lk.random.normal(i, -2)            # call site 2


@pytest.mark.parametrize("backend,scope,threads", BACKENDS)
def test_negative_keys_and_subkeys_count_modulo_2_to_the_64(backend, scope, threads, rng):
    # a key such as i - 3 is negative for the first threads: on the GPU and the CPU backend
    # Numba's cast wraps it modulo 2**64; the simulator raised OverflowError (NumPy 2)
    n, steps = (40, 2) if backend == "cuda" else (500, 3)
    seed = int(rng.integers(0, 1 << 64, dtype=np.uint64))
    out, noise = np.zeros((steps, n)), np.zeros((steps, n))
    lk.megakernel(shifted_draws)(out, noise, steps=steps, backend=backend, scope=scope, threads=threads, seed=seed)
    t = np.arange(steps)[:, None]
    keys = np.arange(n)[None, :]
    np.testing.assert_array_equal(out, refs.uniform_np(seed, t, keys - 3, 0, 1))
    np.testing.assert_allclose(noise, refs.normal_np(seed, t, keys, (1 << 64) - 2, 2), rtol=1e-13, atol=1e-14)


def test_a_run_split_in_two_draws_the_same_numbers(rng):
    call = _random_call(rng)
    u, z = run_draws(n=300, steps=6, **call)
    first = run_draws(n=300, steps=2, **call)
    second = run_draws(n=300, steps=4, **dict(call, start=call["start"] + 2))
    np.testing.assert_array_equal(np.concatenate([first[0], second[0]]), u)
    np.testing.assert_array_equal(np.concatenate([first[1], second[1]]), z)
    np.testing.assert_array_equal(u, reference_draws(n=300, steps=6, **call)[0])


def test_steps_two_to_the_32_apart_draw_different_numbers(rng):
    # the step's high word is in the Philox key: t and t + 2**32 must not repeat the draws
    call = _random_call(rng)
    a, _ = run_draws(n=50, steps=1, **call)
    far = dict(call, start=call["start"] + (1 << 32))
    b, _ = run_draws(n=50, steps=1, **far)
    assert not np.any(a == b)
    np.testing.assert_array_equal(b, reference_draws(n=50, steps=1, **far)[0])


def subkey_draws(t, out, hi):
    for i in lk.range(out.shape[1]):
        for k in range(3):
            out[k, i] = lk.random.uniform(7, i + k * hi)     # one call site


@pytest.mark.parametrize("backend,scope,threads", BACKENDS)
def test_subkeys_two_to_the_32_apart_draw_different_numbers(backend, scope, threads, rng):
    """Every bit of a subkey counts (the README: integers modulo 2**64): the subkey's high word
    is mixed into the Philox key, as the step's is. Before session 36 only its low word counted,
    so uniform(7, 1) and uniform(7, 2**32 + 1) were the same number."""
    n = 40 if backend == "cuda" else 500
    seed = int(rng.integers(0, 1 << 64, dtype=np.uint64))
    hi = 1 << 32
    out = np.zeros((3, n))
    lk.megakernel(subkey_draws)(out, hi, steps=1, backend=backend, scope=scope, threads=threads, seed=seed)
    i = np.arange(n)
    for row in range(3):
        np.testing.assert_array_equal(out[row], refs.uniform_np(seed, 0, 7, i + row * hi, 1))
    assert not np.any(out[0] == out[1]) and not np.any(out[1] == out[2]) and not np.any(out[0] == out[2])


def test_seeds_steps_keys_and_subkeys_give_other_numbers(rng):
    call = _random_call(rng)
    a, za = run_draws(n=500, steps=2, **call)
    b, _ = run_draws(n=500, steps=2, **dict(call, seed=call["seed"] ^ 1))
    c, _ = run_draws(n=500, steps=2, **dict(call, koff=call["koff"] + 500))
    assert not np.any(a == b)                     # another seed
    assert not np.any(a[0] == a[1])               # another step
    assert not np.any(a == c)                     # other keys
    assert not np.any(za[..., 0] == za[..., 1])   # another subkey
    assert len(np.unique(a)) == a.size


def test_statistics_match_theory(rng):
    n = 200_000
    seed = int(rng.integers(0, 1 << 64, dtype=np.uint64))
    u, z = run_draws(seed=seed, n=n, steps=1, sub=int(rng.integers(1, 1 << 32)))
    u, z0, z1 = u.ravel(), z[0, :, 0], z[0, :, 1]
    zz = np.concatenate([z0, z1])
    m = zz.size
    # uniform on [0, 1): mean 1/2, variance 1/12, Var(sample variance) = (1/80 - 1/144) / n
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    assert refs.ks_statistic(u, lambda x: x) < 1.95 / math.sqrt(n)          # Kolmogorov-Smirnov, p = 0.001
    # standard normal: mean 0 (sd 1/sqrt(m)), variance 1 (sd sqrt(2/m)), E z^4 = 3 (sd sqrt(96/m))
    assert abs(zz.mean()) < 5 / math.sqrt(m)
    assert abs(zz.var() - 1.0) < 5 * math.sqrt(2 / m)
    assert abs(np.mean(zz ** 4) - 3.0) < 5 * math.sqrt(96 / m)
    assert refs.ks_statistic(zz, refs.normal_cdf) < 1.95 / math.sqrt(m)
    # no correlation between neighbouring keys, between the two streams, or between u and z
    for a, b in ((z0[:-1], z0[1:]), (z0, z1), (u, z0), (u[:-1], u[1:])):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(a.size)


def test_bad_uses_are_reported(rng):
    def in_helper_draw(i):
        return lk.random.uniform(i)

    def step_with_helper(t, out):
        for i in lk.range(out.shape[0]):
            out[i] = in_helper_draw(i)

    def too_many(t, out):
        for i in lk.range(out.shape[0]):
            out[i] = lk.random.normal(i, 1, 2)

    with pytest.raises(lk.StepSyntaxError, match="only be called in the step function itself"):
        lk.megakernel(step_with_helper)
    with pytest.raises(lk.StepSyntaxError, match="takes a key and an optional subkey"):
        lk.megakernel(too_many)
    with pytest.raises(lk.LoopkernError, match="inside a step"):
        lk.random.uniform(3)
    out, noise = rng.random((1, 4)), rng.random((1, 4, 2))
    before = out.copy(), noise.copy()
    for bad in (-1, 1 << 64):
        with pytest.raises(lk.ArgumentError, match=f"seed={bad}"):
            DRAWS(0, 0, 7, out, noise, steps=1, backend="cpu", seed=bad)
    np.testing.assert_array_equal(out, before[0])          # nothing ran
    np.testing.assert_array_equal(noise, before[1])


def test_kernel_jax_takes_the_seed(rng):
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("CPU JAX test")
    import jax.numpy as jnp
    # scalars are int32 under JAX's defaults
    call = dict(_random_call(rng), koff=int(rng.integers(0, 1 << 30)), sub=int(rng.integers(1, 1 << 31)))
    out, noise = DRAWS.jax(call["start"], call["koff"], call["sub"], jnp.zeros((2, 30)), jnp.zeros((2, 30, 2)),
                           steps=2, start=call["start"], seed=call["seed"])
    ref_u, ref_z = reference_draws(n=30, steps=2, **call)
    assert out.dtype == jnp.float32                  # float32 under JAX's defaults: the draws rounded once
    np.testing.assert_array_equal(np.asarray(out), ref_u.astype(np.float32))
    np.testing.assert_allclose(np.asarray(noise), ref_z.astype(np.float32), rtol=1e-6, atol=1e-7)
