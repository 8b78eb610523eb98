"""The loop contract on the GPU, at sizes and block counts the simulator cannot run: the step
barrier kept where a reduction is short-circuited, swap pairs ending as a rename, and start=
continuing a run (kernel(...) with NumPy and device arrays, and kernel.jax inside jax.jit),
each against a float64 NumPy reference."""

import os

import numpy as np
import pytest

import loopkern as lk
import workloads as W

pytestmark = pytest.mark.gpu
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.mark.parametrize("fn", [W.stop_or_later, W.reduce_only_after_first])
@pytest.mark.parametrize("n,blocks", [(4096, None), (4096, 1), (4096, 16), (1 << 20, None), (1 << 20, 264)])
def test_short_circuited_reduction_keeps_the_barrier(fn, n, blocks, rng):
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()
    run = lk.megakernel(fn, swap=[("u", "v")])(u, v, 0.0, max_steps=7, backend="cuda", scope="grid",
                                               blocks=blocks)
    assert (run.steps, run.stopped) == (7, "steps")
    want_u, want_v, _ = W.smooth_ref(u0, 0.0, 7, lambda t, e: True)
    np.testing.assert_allclose(u, want_u, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(v, want_v, rtol=1e-12, atol=1e-13)


def wave_step(t, u, v, c, probe):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 2.0 * u[i] - v[i] + c * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    if lk.thread_id() == 0:
        probe[t] = u[n // 2]


def noisy_wave_step(t, u, v, c, probe):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 2.0 * u[i] - v[i] + c * (u[i - 1] - 2.0 * u[i] + u[i + 1]) + 1e-3 * lk.random.uniform(i)
    if lk.thread_id() == 0:
        probe[t] = u[n // 2]


WAVE = lk.megakernel(wave_step, swap=[("u", "v")])
NOISY = lk.megakernel(noisy_wave_step, swap=[("u", "v")])


def wave_ref(u0, v0, c, steps):
    u, v = u0.astype(np.float64).copy(), v0.astype(np.float64).copy()
    probe = np.zeros(steps)
    for t in range(steps):
        probe[t] = u[u.shape[0] // 2]
        w = v.copy()
        w[1:-1] = 2 * u[1:-1] - v[1:-1] + c * (u[:-2] - 2 * u[1:-1] + u[2:])
        u, v = w, u
    return u, v, probe


@pytest.mark.parametrize("scope,n", [("grid", 1 << 16), ("grid", 1 << 20), ("block", 2048)])
@pytest.mark.parametrize("device_arrays", [False, True])
def test_chunked_two_level_run_equals_one_call(scope, n, device_arrays, rng):
    from numba import cuda
    u0, v0 = rng.random(n), rng.random(n)
    total, seed = 23, 7
    ref_u, ref_v, ref_p = wave_ref(u0, v0, 0.2, total)

    def run_split(kernel, split):
        u, v, p = u0.copy(), v0.copy(), np.zeros(total)
        if device_arrays:
            u, v, p = cuda.to_device(u), cuda.to_device(v), cuda.to_device(p)
        start = 0
        for k in split:
            start = kernel(u, v, 0.2, p, steps=k, start=start, seed=seed, backend="cuda", scope=scope).next_start
        assert start == total
        if device_arrays:
            u, v, p = u.copy_to_host(), v.copy_to_host(), p.copy_to_host()
        return u, v, p

    for split in ([total], [5, 18], [1, 1, 7, 14], [11, 12]):
        u, v, p = run_split(WAVE, split)
        np.testing.assert_allclose(u, ref_u, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(v, ref_v, rtol=1e-10, atol=1e-10)    # the level before survives
        np.testing.assert_allclose(p, ref_p, rtol=1e-10, atol=1e-10)
    # with lk.random draws (keyed by t): every split is the same run, bit for bit
    one = run_split(NOISY, [total])
    assert np.abs(one[0] - ref_u).max() > 1e-6     # the draws are in it
    for split in ([5, 18], [1, 1, 7, 14], [11, 12]):
        for a, b in zip(one, run_split(NOISY, split)):
            np.testing.assert_array_equal(a, b)


def test_kernel_jax_start_traced_in_jit(rng):
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.fail("JAX has no GPU backend on this GPU machine")
    jnp = jax.numpy
    n, total, seed = 1 << 16, 12, 3
    u0, v0 = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
    ref_u, ref_v, ref_p = wave_ref(u0, v0, 0.2, total)

    @jax.jit
    def chunk(u, v, p, start):
        return WAVE.jax(u, v, np.float32(0.2), p, steps=3, start=start, seed=seed)

    u, v, p = jnp.asarray(u0), jnp.asarray(v0), jnp.zeros(total, jnp.float32)
    for start in range(0, total, 3):
        u, v, p = chunk(u, v, p, jnp.int32(start))
    np.testing.assert_allclose(np.asarray(u), ref_u, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(v), ref_v, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(p), ref_p, rtol=1e-4, atol=1e-4)
    # odd chunk lengths: the second array is the level before
    u, v, p = jnp.asarray(u0), jnp.asarray(v0), jnp.zeros(total, jnp.float32)
    u, v, p = WAVE.jax(u, v, np.float32(0.2), p, steps=5, seed=seed)
    u, v, p = WAVE.jax(u, v, np.float32(0.2), p, steps=7, start=5, seed=seed)
    np.testing.assert_allclose(np.asarray(u), ref_u, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(v), ref_v, rtol=1e-4, atol=1e-4)
