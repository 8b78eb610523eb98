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


@pytest.mark.parametrize("call,fragment", [
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
])
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
