"""kernel.jax on JAX's CPU backend: eager, jit, donation, pipelines, vmap, traced scalars and
steps, while-loop step counts, against lax.fori_loop / lax.while_loop and NumPy."""

import numpy as np
import pytest

import loopkern as lk
import refs
import workloads as W

jax = pytest.importorskip("jax")
jnp = jax.numpy

HEAT = lk.megakernel(W.heat_step, swap=[("u", "v")])
JACOBI = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
SHIFT = lk.megakernel(refs.shift_step, swap=[("u", "v")])


def jax_heat(u, steps, alpha):
    def body(_, x):
        return x.at[1:-1].set(x[1:-1] + alpha * (x[:-2] - 2 * x[1:-1] + x[2:]))
    return jax.lax.fori_loop(0, steps, body, u)


@pytest.fixture(autouse=True)
def cpu_only():
    if jax.default_backend() != "cpu":
        pytest.skip("these tests run on JAX's CPU backend (see tests/gpu for the GPU)")


def test_eager_matches_numpy_and_fori_loop(rng):
    u0 = rng.random(301).astype(np.float32)
    u, v = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), 0.25, steps=13)
    assert isinstance(u, jax.Array) and u.shape == u0.shape and u.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(u), W.heat_ref(u0, 13, 0.25), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(u), np.asarray(jax_heat(jnp.asarray(u0), 13, 0.25)), rtol=1e-5)


def test_inputs_are_not_modified(rng):
    u0 = rng.random(64).astype(np.float32)
    a = jnp.asarray(u0)
    u, _ = HEAT.jax(a, a, 0.25, steps=5)
    np.testing.assert_array_equal(np.asarray(a), u0)
    np.testing.assert_allclose(np.asarray(u), W.heat_ref(u0, 5, 0.25), rtol=1e-5, atol=1e-6)


def test_jit_with_donation_traced_scalar_and_traced_steps(rng):
    u0 = rng.random(200).astype(np.float32)

    @jax.jit
    def f(u, alpha, steps):
        return HEAT.jax(u, u, alpha, steps=steps)[0]

    out = f(jnp.asarray(u0), jnp.float32(0.2), 17)
    np.testing.assert_allclose(np.asarray(out), W.heat_ref(u0, 17, 0.2), rtol=1e-5, atol=1e-6)
    g = jax.jit(lambda u, v: HEAT.jax(u, v, 0.25, steps=4), donate_argnums=(0, 1))
    out = g(jnp.asarray(u0), jnp.asarray(u0))[0]
    np.testing.assert_allclose(np.asarray(out), W.heat_ref(u0, 4, 0.25), rtol=1e-5, atol=1e-6)


def test_pipeline_with_other_ops(rng):
    x0 = rng.random(150).astype(np.float32)

    @jax.jit
    def pipeline(x):
        u = jnp.sin(x) * 2.0                     # work before
        u, _ = HEAT.jax(u, u, 0.25, steps=9)
        return jnp.sum(u ** 2), u * 3.0          # work after

    s, w = pipeline(jnp.asarray(x0))
    ref = W.heat_ref(np.sin(x0.astype(np.float64)) * 2.0, 9, 0.25)
    np.testing.assert_allclose(float(s), (ref ** 2).sum(), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(w), ref * 3.0, rtol=1e-4, atol=1e-5)


def test_while_loop_step_count_matches_lax_while_loop(rng):
    g0 = rng.random((24, 24)).astype(np.float32)
    tol = np.float32(1e-3)

    def lax_jacobi(u):
        def body(c):
            x, _, k = c
            new = x.at[1:-1, 1:-1].set(0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
            return new, jnp.max(jnp.abs(new - x)), k + 1
        return jax.lax.while_loop(lambda c: (c[1] > tol) & (c[2] < 1000), body, (u, jnp.float32(jnp.inf), 0))

    u, v, steps = jax.jit(lambda a: JACOBI.jax(a, a, tol, max_steps=1000))(jnp.asarray(g0))
    ref_u, _, ref_steps = lax_jacobi(jnp.asarray(g0))
    assert int(steps) == int(ref_steps) == W.jacobi_ref(g0, float(tol), 1000)[1]
    np.testing.assert_allclose(np.asarray(u), np.asarray(ref_u), rtol=1e-5, atol=1e-6)


def test_vmap_sequential(rng):
    batch = rng.random((3, 40)).astype(np.float32)
    out = jax.vmap(lambda a: HEAT.jax(a, a, 0.25, steps=6)[0])(jnp.asarray(batch))
    for k in range(3):
        np.testing.assert_allclose(np.asarray(out[k]), W.heat_ref(batch[k], 6, 0.25), rtol=1e-5, atol=1e-6)


def test_grad_is_a_clear_error(rng):
    u = jnp.asarray(rng.random(16).astype(np.float32))
    with pytest.raises(lk.LoopkernError, match="not supported yet"):
        jax.grad(lambda a: HEAT.jax(a, a, 0.25, steps=2)[0].sum())(u)


BAD_CALLS = [
    (lambda u: HEAT.jax(np.zeros(8, np.float32), u, 0.25, steps=1), "kernel.jax takes JAX arrays"),
    (lambda u: HEAT.jax(u, u.astype(jnp.int32), 0.25, steps=1), "same shape and dtype"),
    (lambda u: HEAT.jax(u, u[:-1], 0.25, steps=1), "same shape and dtype"),
    (lambda u: HEAT.jax(u, u, u, steps=1), "uses it as a number"),
    (lambda u: HEAT.jax(u, 1.0, 0.25, steps=1), "indexes it as an array"),
    (lambda u: HEAT.jax(u, u, 0.25), "exactly one of steps= or max_steps="),
    (lambda u: HEAT.jax(u, u, 0.25, steps=-2), "must be >= 0"),
    (lambda u: HEAT.jax(u, u, 0.25, steps=1.5), "expected an int"),
    (lambda u: HEAT.jax(u, u, 0.25, steps=1, backend="cuda"), "backend='cuda'"),
    (lambda u: HEAT.jax(u, u, steps=1), "missing a required argument"),
    (lambda u: HEAT.jax(u, u, 0.25, steps=1, start=-1), "must be >= 0"),
    (lambda u: HEAT.jax(u, u, 0.25 + 1j, steps=1), "complex numbers"),
    (lambda u: HEAT.jax(u, u, 0.25, steps=1, seed=-1), "seed"),
    (lambda u: HEAT.jax(u, u, 0.25, steps=1, timeout=0), "timeout=0"),
]


@pytest.mark.parametrize("call,fragment", BAD_CALLS)
def test_bad_input_is_rejected_at_trace_time(call, fragment):
    with pytest.raises(lk.ArgumentError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(jnp.zeros(8, jnp.float32))


def test_xla_ffi_shim_builds_and_registers_without_a_gpu():
    from loopkern.interop import xla_ffi
    pytest.importorskip("cffi")
    mod = xla_ffi.build_shim()
    assert int(mod.ffi.cast("uintptr_t", mod.lib.lk_launch_address())) != 0
    xla_ffi.register_cuda_target()     # queued for CUDA on a CPU-only jaxlib


def test_timeout_returns_the_steps_done(rng):
    # an integer step with a closed form: exactly the state after 'done' steps, every element
    a0 = rng.integers(-1000, 1000, 2000).astype(np.int32)
    u, v, done = SHIFT.jax(jnp.asarray(a0), jnp.asarray(a0), steps=10 ** 9, timeout=0.3)
    done = int(done)
    assert 0 < done < 10 ** 9
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, done))
    # the heat stencil in float32, against the exact float64 solution after 'done' steps (float32
    # rounding drifts by a few 1e-3 over the 1e5+ steps that run here)
    u0 = rng.random(2000).astype(np.float32)
    u, v, done = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), 0.2, steps=10 ** 9, timeout=0.3)
    done = int(done)
    assert 0 < done < 10 ** 9
    np.testing.assert_allclose(np.asarray(u), refs.heat_exact(u0, done, 0.2), rtol=1e-2)
    with pytest.raises(lk.ArgumentError, match="timeout=-2"):
        HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), 0.2, steps=3, timeout=-2)


# ------------------------------------------------------------------------------ the call cache
from loopkern.interop import jax_bridge  # noqa: E402


@pytest.fixture
def builds(monkeypatch):
    """Counts the builds of kernel.jax calls (each a cache miss); the caches of the kernels
    used here start empty."""
    for k in (HEAT, JACOBI, SHIFT):
        jax_bridge.call_cache(k).clear()
    made = []
    real = jax_bridge._build

    def counting(mk, key):
        made.append(key)
        return real(mk, key)
    monkeypatch.setattr(jax_bridge, "_build", counting)
    return made


def test_cache_reuses_one_build_eager_and_under_fresh_jits(rng, builds):
    entries = jax_bridge.call_cache(HEAT)
    n = 257
    for _ in range(3):                      # eager, new values each time: one build, one trace
        u0 = rng.random(n).astype(np.float32)
        steps, alpha = int(rng.integers(1, 40)), float(rng.uniform(0.05, 0.25))
        u, v = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), alpha, steps=steps)
        np.testing.assert_allclose(np.asarray(u), W.heat_ref(u0, steps, np.float32(alpha)), rtol=1e-5, atol=1e-6)
    assert len(builds) == 1 and len(entries) == 1
    assert entries.get(builds[0]).eager._cache_size() == 1       # the eager calls did not retrace
    for _ in range(2):                      # a new jitted function each time, same shapes: no new build
        u0 = rng.random(n).astype(np.float32)
        steps = int(rng.integers(1, 40))
        f = jax.jit(lambda a, al, s: HEAT.jax(a, a, al, steps=s)[0])
        out = f(jnp.asarray(u0), jnp.float32(0.2), steps)
        np.testing.assert_allclose(np.asarray(out), W.heat_ref(u0, steps, np.float32(0.2)), rtol=1e-5, atol=1e-6)
        g = jax.jit(lambda a: HEAT.jax(a, a, 0.125, steps=7), donate_argnums=0)
        out, _ = g(jnp.asarray(u0))
        np.testing.assert_allclose(np.asarray(out), W.heat_ref(u0, 7, 0.125), rtol=1e-5, atol=1e-6)
    out = jax.vmap(lambda a: HEAT.jax(a, a, 0.25, steps=3)[0])(jnp.asarray(rng.random((2, n)).astype(np.float32)))
    assert out.shape == (2, n)
    assert len(builds) == 1 and len(entries) == 1
    # a new shape is a new entry; the first one stays and is used again
    for m in (64, n, 64):
        u0 = rng.random(m).astype(np.float32)
        u, _ = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), 0.25, steps=11)
        np.testing.assert_allclose(np.asarray(u), W.heat_ref(u0, 11, 0.25), rtol=1e-5, atol=1e-6)
    assert len(builds) == 2 and len(entries) == 2
    assert {k[2][0][0] for k in entries.keys()} == {(64,), (n,)}


def test_cache_key_seed_timeout_dtypes(rng, builds):
    a0 = rng.integers(-1000, 1000, 500).astype(np.int32)
    a = jnp.asarray(a0)
    u, _ = SHIFT.jax(a, a, steps=5)
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, 5))
    u, _ = SHIFT.jax(a, a, steps=jnp.int32(9))           # steps as a 0-d int32 array: same signature
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, 9))
    assert len(builds) == 1
    SHIFT.jax(a, a, steps=5, seed=7)                       # another seed
    assert len(builds) == 2
    u, _, done = SHIFT.jax(a, a, steps=6, timeout=30.0)    # a timeout: the step count comes back too
    assert int(done) == 6
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, 6))
    assert len(builds) == 3
    u, _, done = SHIFT.jax(a, a, steps=4, timeout=30.0)
    assert int(done) == 4 and len(builds) == 3
    SHIFT.jax(a, a, steps=5, timeout=20.0)                 # another timeout
    assert len(builds) == 4
    b0 = a0.astype(np.int16)                               # another dtype
    u, _ = SHIFT.jax(jnp.asarray(b0), jnp.asarray(b0), steps=5)
    assert u.dtype == jnp.int16
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(b0, 5))
    assert len(builds) == 5
    SHIFT.jax(a, a, steps=5, start=jnp.int16(2))           # another dtype of start
    assert len(builds) == 6
    keys = jax_bridge.call_cache(SHIFT).keys()
    assert len(keys) == len(set(keys)) == 6
    # a scalar of another dtype is another signature too
    u0 = rng.random(100).astype(np.float32)
    HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), 0.25, steps=2)
    HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), np.float32(0.25), steps=2)   # float32 either way
    assert len(builds) == 7
    u, _ = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), 0, steps=2)          # an int32 alpha
    np.testing.assert_array_equal(np.asarray(u), u0)
    assert len(builds) == 8


def _x64():
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64      # older JAX
    return enable_x64()


def test_cache_with_x64(rng, builds):
    u0 = rng.random(129)
    with _x64():
        for steps in (5, 8):
            u, v = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), 0.25, steps=steps)
            assert u.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(u), W.heat_ref(u0, steps, 0.25), rtol=1e-13, atol=1e-14)
        assert len(builds) == 1
        assert builds[0][2][0][1] == np.float64 and builds[0][3] == np.int64    # array and steps dtypes
    u, v = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), 0.25, steps=5)        # float32 without x64
    assert u.dtype == jnp.float32 and len(builds) == 2
    np.testing.assert_allclose(np.asarray(u), W.heat_ref(u0.astype(np.float32), 5, 0.25), rtol=1e-5, atol=1e-6)


def test_condition_step_count_eager_and_jit_from_one_entry(rng, builds):
    tol = np.float32(1e-3)
    for _ in range(2):
        g0 = rng.random((20, 20)).astype(np.float32)
        ref_u, ref_steps = W.jacobi_ref(g0, float(tol), 1000)
        u, v, steps = JACOBI.jax(jnp.asarray(g0), jnp.asarray(g0), tol, max_steps=1000)
        assert steps.dtype == jnp.int32 and int(steps) == ref_steps
        np.testing.assert_allclose(np.asarray(u), ref_u, rtol=1e-4, atol=1e-5)
        u2, _, steps2 = jax.jit(lambda a: JACOBI.jax(a, a, tol, max_steps=1000))(jnp.asarray(g0))
        assert int(steps2) == int(steps)
        np.testing.assert_array_equal(np.asarray(u2), np.asarray(u))
    assert len(builds) == 1


@pytest.mark.parametrize("call,fragment", BAD_CALLS)
def test_bad_input_is_rejected_with_a_warm_cache(call, fragment, builds):
    u = jnp.zeros(8, jnp.float32)
    HEAT.jax(u, u, 0.25, steps=1)
    jax.jit(lambda a: HEAT.jax(a, a, 0.25, steps=1))(u)
    assert len(builds) == 1
    with pytest.raises(lk.ArgumentError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(u)
    with pytest.raises(lk.ArgumentError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        jax.jit(call)(u)
    assert len(builds) == 1


def test_grad_is_a_clear_error_with_a_warm_cache(rng, builds):
    u = jnp.asarray(rng.random(16).astype(np.float32))
    HEAT.jax(u, u, 0.25, steps=2)
    with pytest.raises(lk.LoopkernError, match="not supported yet"):
        jax.grad(lambda a: HEAT.jax(a, a, 0.25, steps=2)[0].sum())(u)
    assert len(builds) == 1


def test_cache_is_bounded(rng, builds, monkeypatch):
    entries = jax_bridge.call_cache(SHIFT)
    monkeypatch.setattr(entries, "size", 3)
    for n in (10, 11, 12, 13, 10):
        a0 = rng.integers(-9, 9, n).astype(np.int32)
        u, _ = SHIFT.jax(jnp.asarray(a0), jnp.asarray(a0), steps=3)
        np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, 3))
    assert len(entries) == 3 and len(builds) == 5        # 10 was dropped, then built again
