"""kernel.sharded on GPUs: a mesh of one GPU (the FFI custom call under jax.shard_map), and,
where the machine has two or more, the fields split across them with halo exchanges, against
float64 NumPy references and the single-device run."""

import numpy as np
import pytest

from .jax_gpu import jax, jnp, require_gpu_jax

pytestmark = pytest.mark.gpu
P = jax.sharding.PartitionSpec if jax is not None else None

from test_sharded import heat_ref, jacobi, jacobi_ref, life, life_ref  # noqa: E402  (tests/ is on sys.path)

import loopkern as lk  # noqa: E402


@pytest.fixture(autouse=True)
def gpu_jax():
    require_gpu_jax()


@lk.megakernel(swap=[("u", "v")])
def heat(t, u, v, a):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + a * (u[i - 1] - 2.0 * u[i] + u[i + 1])


def test_one_gpu_mesh_jacobi_to_tolerance(rng):
    n = 128
    u0 = np.zeros((n, n), np.float32)
    u0[0, :], u0[-1, :], u0[:, 0], u0[:, -1] = (rng.random(n) for _ in range(4))
    one = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    sk = jacobi.sharded(one, P("x"))
    run = jax.jit(lambda u: sk(u, u, 1e-3, max_steps=5000))
    u, v, steps = run(jnp.asarray(u0))
    ru, rv, rsteps = jacobi_ref(u0, 1e-3, 5000, 1)
    assert int(steps) == rsteps < 5000
    np.testing.assert_allclose(np.asarray(u), ru, rtol=1e-4, atol=1e-5)
    su, sv, ssteps = jacobi.jax(jnp.asarray(u0), jnp.asarray(u0), 1e-3, max_steps=5000)
    assert int(ssteps) == int(steps)
    assert np.array_equal(np.asarray(u), np.asarray(su)) and np.array_equal(np.asarray(v), np.asarray(sv))


def test_one_gpu_mesh_heat_and_life(rng):
    one = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    u0 = rng.random(4096).astype(np.float32)
    u, v = heat.sharded(one, P("x"))(jnp.asarray(u0), jnp.asarray(u0), 0.25, steps=300)
    np.testing.assert_allclose(np.asarray(u), heat_ref(u0, 0.25, 300)[0], rtol=1e-4, atol=1e-5)
    board = (rng.random((64, 64)) < 0.3).astype(np.int32)
    a, b = life.sharded(one, P("x"))(jnp.asarray(board), jnp.asarray(np.zeros_like(board)), steps=50)
    assert np.array_equal(np.asarray(a), life_ref(board, 50)[0])


@pytest.fixture
def gpus():
    devs = jax.devices("gpu")
    if len(devs) < 2:
        pytest.skip(f"needs two or more GPUs (this machine has {len(devs)})")
    return devs


@pytest.mark.multi_gpu
def test_split_across_gpus_heat_jacobi_life(rng, gpus):
    count = len(gpus)
    m = jax.make_mesh((count,), ("x",), devices=gpus)
    u0 = rng.random(512 * count).astype(np.float32)
    for every in (1, 7, None):
        u, v = heat.sharded(m, P("x"), exchange_every=every)(jnp.asarray(u0), jnp.asarray(u0), 0.25, steps=333)
        np.testing.assert_allclose(np.asarray(u), heat_ref(u0, 0.25, 333)[0], rtol=1e-4, atol=1e-5)
        su, _ = heat.jax(jax.device_put(jnp.asarray(u0), gpus[0]), jax.device_put(jnp.asarray(u0), gpus[0]), 0.25,
                         steps=333)
        assert np.array_equal(np.asarray(u), np.asarray(su))
    n = 32 * count
    j0 = np.zeros((n, n), np.float32)
    j0[0, :], j0[-1, :], j0[:, 0], j0[:, -1] = (rng.random(n) for _ in range(4))
    u, v, steps = jacobi.sharded(m, P("x"), exchange_every=4)(jnp.asarray(j0), jnp.asarray(j0), 2e-3,
                                                                max_steps=4000)
    ru, _, rsteps = jacobi_ref(j0, 2e-3, 4000, 4)
    assert int(steps) == rsteps
    np.testing.assert_allclose(np.asarray(u), ru, rtol=1e-4, atol=1e-5)
    board = (rng.random((n, n)) < 0.3).astype(np.int32)
    a, _ = life.sharded(m, P(None, "x"))(jnp.asarray(board), jnp.asarray(np.zeros_like(board)), steps=77)
    assert np.array_equal(np.asarray(a), life_ref(board, 77)[0])
