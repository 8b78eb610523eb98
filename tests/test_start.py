"""``start=``: the first step index of a call, so that a run split into calls is the same run.

Checked against float64 NumPy references (the leapfrog wave keeps two time levels in a swap
pair, so the end-of-run rename matters) on the CPU backend, under the simulator and through
``kernel.jax`` on JAX's CPU backend, traced ``start`` included. The random splits of every
backend and scope are in test_chunks.py.
"""

import numpy as np
import pytest

import loopkern as lk

BACKENDS = [pytest.param("cpu", None, id="cpu"),
            pytest.param("cuda", "grid", id="sim-grid", marks=pytest.mark.sim),
            pytest.param("cuda", "block", id="sim-block", marks=pytest.mark.sim)]


def wave_step(t, u, v, c, energy):
    # leapfrog: u is the newest level, v the one before; the new level overwrites v
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 2.0 * u[i] - v[i] + c * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    if lk.thread_id() == 0:
        energy[t] = u[n // 2]


WAVE = lk.megakernel(wave_step, swap=[("u", "v")])


def wave_ref(u0, v0, c, steps, start=0, record=None):
    """float64 NumPy leapfrog: (newest level, the level before, records at t = start...)."""
    u, v = u0.astype(np.float64).copy(), v0.astype(np.float64).copy()
    rec = {} if record is None else record
    for t in range(start, start + steps):
        rec[t] = u[u.shape[0] // 2]
        w = v.copy()
        w[1:-1] = 2 * u[1:-1] - v[1:-1] + c * (u[:-2] - 2 * u[1:-1] + u[2:])
        u, v = w, u
    return u, v, rec


@pytest.mark.parametrize("backend,scope", BACKENDS)
def test_split_calls_continue_a_two_level_scheme(backend, scope, rng):
    n = 48 if backend == "cuda" else 300
    u0, v0 = rng.random(n), rng.random(n)
    total = 11
    ref_u, ref_v, rec = wave_ref(u0, v0, 0.2, total)
    for split in ([total], [4, 7], [5, 1, 5], [3, 3, 3, 2]):
        u, v, energy = u0.copy(), v0.copy(), np.zeros(total)
        start = 0
        for k in split:
            run = WAVE(u, v, 0.2, energy, steps=k, start=start, backend=backend, scope=scope)
            assert (run.start, run.steps, run.next_start) == (start, k, start + k)
            start = run.next_start
        np.testing.assert_allclose(u, ref_u, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(v, ref_v, rtol=1e-12, atol=1e-12)    # the level before survives
        np.testing.assert_allclose(energy, [rec[t] for t in range(total)], rtol=1e-12, atol=1e-12)


def test_start_shifts_the_step_index(rng):
    u0, v0 = rng.random(40), rng.random(40)
    energy = np.full(20, -1.0)
    u, v = u0.copy(), v0.copy()
    WAVE(u, v, 0.1, energy, steps=4, start=13, backend="cpu")
    ref_u, ref_v, rec = wave_ref(u0, v0, 0.1, 4, start=13)
    np.testing.assert_allclose(u, ref_u, rtol=1e-12)
    assert (energy[:13] == -1).all() and (energy[17:] == -1).all()
    np.testing.assert_allclose(energy[13:17], [rec[t] for t in range(13, 17)], rtol=1e-12)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None, 2 ** 62])
def test_bad_start_is_refused_before_anything_runs(bad, rng):
    u0 = rng.random(16)
    u, v, energy = u0.copy(), u0.copy(), np.zeros(4)
    with pytest.raises(lk.ArgumentError, match=r"start="):
        WAVE(u, v, 0.1, energy, steps=2, start=bad, backend="cpu")
    np.testing.assert_array_equal(u, u0)
    np.testing.assert_array_equal(energy, 0)


jax = pytest.importorskip("jax")
jnp = jax.numpy


@pytest.fixture
def jax_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("JAX's CPU backend (tests/gpu has the GPU)")


def test_jax_start_traced_inside_jit(jax_cpu, rng):
    n, total = 64, 9
    u0, v0 = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
    ref_u, ref_v, rec = wave_ref(u0, v0, 0.2, total)

    @jax.jit
    def chunk(u, v, energy, start):
        return WAVE.jax(u, v, 0.2, energy, steps=3, start=start)

    u, v, e = jnp.asarray(u0), jnp.asarray(v0), jnp.zeros(total, jnp.float32)
    for start in (0, 3, 6):
        u, v, e = chunk(u, v, e, jnp.int32(start))
    np.testing.assert_allclose(np.asarray(u), ref_u, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(v), ref_v, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(e), [rec[t] for t in range(total)], rtol=2e-5, atol=2e-5)
    # odd chunks: the rename puts the level before in v
    u, v, e = jnp.asarray(u0), jnp.asarray(v0), jnp.zeros(total, jnp.float32)
    u, v, e = WAVE.jax(u, v, 0.2, e, steps=5)
    u, v, e = WAVE.jax(u, v, 0.2, e, steps=4, start=5)
    np.testing.assert_allclose(np.asarray(v), ref_v, rtol=2e-5, atol=2e-5)


def test_jax_bad_start(jax_cpu):
    u = jnp.zeros(8)
    with pytest.raises(lk.ArgumentError, match="start="):
        WAVE.jax(u, u, 0.1, jnp.zeros(2), steps=1, start=-2)
    with pytest.raises(lk.ArgumentError, match="start="):
        WAVE.jax(u, u, 0.1, jnp.zeros(2), steps=1, start=jnp.zeros(2, jnp.int32))
