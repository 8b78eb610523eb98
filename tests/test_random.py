"""lk.random: Philox4x32-10 known answers, the same numbers on every backend and launch shape,
reproducible from the seed, and the right statistics."""

import numpy as np
import pytest

import loopkern as lk
from loopkern.runtime.philox import build

BACKENDS = [pytest.param("cpu", None, None, id="cpu"),
            pytest.param("cuda", "grid", 32, id="sim-grid32", marks=pytest.mark.sim),
            pytest.param("cuda", "block", 96, id="sim-block96", marks=pytest.mark.sim)]


def test_philox_known_answers():
    # Random123's known-answer vectors for philox4x32-10
    philox, _, _ = build(lambda f: f)
    u = np.uint64
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        got = philox(*(u(c) for c in ctr), *(u(k) for k in key))
        assert tuple(int(g) for g in got) == want


def draws(t, out, noise):
    n = out.shape[1]
    for i in lk.range(n):
        out[t, i] = lk.random.uniform(i)
        noise[t, i, 0] = lk.random.normal(i)
        noise[t, i, 1] = lk.random.normal(i, 7)     # a subkey: another stream


DRAWS = lk.megakernel(draws)


def run_draws(backend, scope, threads, seed, n=70, steps=3):
    out = np.zeros((steps, n))
    noise = np.zeros((steps, n, 2))
    DRAWS(out, noise, steps=steps, backend=backend, scope=scope, threads=threads, seed=seed)
    return out, noise


@pytest.mark.parametrize("backend,scope,threads", BACKENDS)
def test_same_numbers_on_every_backend_and_launch_shape(backend, scope, threads):
    ref_u, ref_n = run_draws("cpu", None, None, seed=12345)
    u, z = run_draws(backend, scope, threads, seed=12345)
    np.testing.assert_array_equal(u, ref_u)
    np.testing.assert_allclose(z, ref_n, rtol=1e-14, atol=1e-14)


def test_reproducible_and_distinct():
    a, za = run_draws("cpu", None, None, seed=1)
    b, zb = run_draws("cpu", None, None, seed=1)
    c, _ = run_draws("cpu", None, None, seed=2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(za, zb)
    assert not np.any(a == c)                     # another seed: other numbers
    assert not np.any(a[0] == a[1])               # another step: other numbers
    assert not np.any(za[..., 0] == za[..., 1])   # another subkey: other numbers
    assert len(np.unique(a)) == a.size


def test_statistics():
    out = np.zeros((1, 200_000))
    noise = np.zeros((1, 200_000, 2))
    DRAWS(out, noise, steps=1, backend="cpu", seed=99)
    u, z = out.ravel(), noise.ravel()
    n = u.size
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 0.002
    assert abs(z.mean()) < 5 / np.sqrt(z.size)
    assert abs(z.var() - 1.0) < 0.02
    assert abs(np.mean(z ** 4) - 3.0) < 0.1       # Gaussian kurtosis
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 0.01


def test_bad_uses_are_reported():
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
    with pytest.raises(lk.ArgumentError, match="seed=-1"):
        DRAWS(np.zeros((1, 4)), np.zeros((1, 4, 2)), steps=1, backend="cpu", seed=-1)


def test_kernel_jax_takes_the_seed():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("CPU JAX test")
    import jax.numpy as jnp
    out, noise = DRAWS.jax(jnp.zeros((2, 30)), jnp.zeros((2, 30, 2)), steps=2, seed=5)
    ref_u, ref_n = run_draws("cpu", None, None, seed=5, n=30, steps=2)
    np.testing.assert_allclose(np.asarray(out), ref_u, rtol=1e-6)   # float32 under JAX defaults
