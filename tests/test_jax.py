"""kernel.jax on JAX's CPU backend: eager, jit, donation, pipelines, vmap, traced scalars and
steps, while-loop step counts, against lax.fori_loop / lax.while_loop and NumPy."""

import os


import numpy as np
import pytest

import loopkern as lk
from loopkern.dispatch.dispatcher import Dispatcher
import refs
import workloads as W

jax = pytest.importorskip("jax")
jnp = jax.numpy

HEAT = lk.megakernel(W.heat_step, swap=[("u", "v")])
JACOBI = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
SHIFT = lk.megakernel(refs.shift_step, swap=[("u", "v")])
_AUTO_TILE = Dispatcher.auto_tile


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


def test_kernel_jax_inside_shard_map_on_cpu_devices(rng):
    """kernel.jax inside jax.shard_map on a mesh of the CPU backend's devices (tests/conftest.py
    asks XLA for 4): each device runs the call on its own block, an independent rod with fixed
    ends, and each block is the NumPy run of that block alone."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    k = len(jax.devices())
    if k < 2:
        pytest.skip(f"JAX's CPU backend has {k} device here (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
    mesh = jax.make_mesh((k,), ("x",))
    n, steps = 96, 50
    u0 = rng.random(k * n).astype(np.float32)
    f = jax.jit(jax.shard_map(lambda u, v: HEAT.jax(u, v, 0.25, steps=steps), mesh=mesh,
                              in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
    x = jax.device_put(jnp.asarray(u0), NamedSharding(mesh, P("x")))
    u, v = f(x, x)
    assert u.shape == (k * n,) and set(u.devices()) == set(mesh.devices.flat)
    out = np.asarray(u)
    for b in range(k):
        block = slice(b * n, (b + 1) * n)
        np.testing.assert_allclose(out[block], W.heat_ref(u0[block], steps, 0.25), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out, np.asarray(f(x, x)[0]))     # a second run: the same


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


def window_mean_step(t, u, v):
    # an inner range loop that carries a recurrence with a step that is not a constant:
    # forward mode has its rule, reverse mode (which walks such loops backwards) not yet
    n = u.shape[0]
    for i in lk.range(n):
        acc = 0.0
        for k in range(0, n, n // 8):
            acc = 0.5 * acc + u[(i + k) % n]
        v[i] = acc / 3.0


WINDOW = lk.megakernel(window_mean_step, swap=[("u", "v")])


def test_grad_of_a_step_reverse_mode_does_not_cover_is_a_clear_error(rng):
    # (tests/test_adjoint.py has what reverse mode covers)
    u = jnp.asarray(rng.random(16).astype(np.float32))
    with pytest.raises(lk.LoopkernError, match="when its step is 1 or a positive constant"):
        jax.grad(lambda a: WINDOW.jax(a, a, steps=3)[0].sum())(u)


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
    (lambda u: HEAT.jax(u, u, 0.25, steps=1, backend="xyz"), "backend='xyz': expected one of"),
    (lambda u: HEAT.jax(u, u, 0.25, steps=1, scope="bogus"), "scope='bogus': expected one of"),
    (lambda u: HEAT.jax(u, u, 0.25, steps=2 ** 63), "steps=9223372036854775808: more than JAX's"),
    # (a raw OverflowError naming no argument before session 28)
    (lambda u: HEAT.jax(u, u, 2 ** 64 - 1, steps=1), "argument 'alpha': the integer 18446744073709551615 does not fit"),
]


def float_bit_op_step(t, u, v):
    for i in lk.range(u.shape[0]):
        v[i] = u[i] & 1                 # a bit operation on a float array: no such function


def test_a_compile_error_under_kernel_jax_is_the_loopkern_error():
    """On JAX's CPU backend the kernel is compiled while JAX traces the call: its compile error
    is lk.CompileError, as from a direct call (it came out of XLA's callback as an INTERNAL
    JaxRuntimeError with the message inside)."""
    k = lk.megakernel(float_bit_op_step)
    u = jnp.linspace(1.0, 2.0, 8)
    with pytest.raises(lk.CompileError):
        k(np.asarray(u), np.zeros(8, np.float32), steps=1, backend="cpu")
    with pytest.raises(lk.CompileError):
        k.jax(u, jnp.zeros(8), steps=1)
    with pytest.raises(lk.CompileError):
        jax.jit(lambda x: k.jax(x, jnp.zeros(8), steps=1))(u)


def test_a_returned_step_count_beyond_int32_is_refused_before_running():
    from refs import jax_x64
    with jax_x64():     # (without x64 such a count is refused as more than JAX's int32 holds)
        u = jnp.zeros((4, 4), jnp.float32)
        with pytest.raises(lk.ArgumentError, match=r"max_steps=2147483648: the call returns the steps it ran as an "
                                                   r"int32"):
            JACOBI.jax(u, u, np.float32(1e-3), max_steps=2 ** 31)


def test_a_concrete_negative_step_count_array_is_rejected():
    # (a traced one runs no step: its value is not known before the kernel runs)
    u = jnp.zeros(8, jnp.float32)
    with pytest.raises(lk.ArgumentError, match="steps=-3: must be >= 0"):
        HEAT.jax(u, u, 0.25, steps=jnp.asarray(-3))


@pytest.mark.parametrize("call,fragment", BAD_CALLS)
def test_bad_input_is_rejected_at_trace_time(call, fragment):
    with pytest.raises(lk.ArgumentError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(jnp.zeros(8, jnp.float32))


def _head(t, out, m):
    for i in lk.range(m):
        out[i] = out[i] + 1.0


def test_a_float_for_a_loop_bound_is_rejected_at_trace_time():
    k = lk.megakernel(_head)
    out = jnp.zeros(6, jnp.float32)
    for m in (2.5, jnp.float32(3.0)):
        with pytest.raises(lk.ArgumentError, match="argument 'm': the step uses it as an integer"):
            k.jax(out, m, steps=1)
    np.testing.assert_array_equal(np.asarray(k.jax(out, 3, steps=2)[0]), [2, 2, 2, 0, 0, 0])


def _put(t, out, k):
    if lk.thread_id() == 0:
        out[k] = out[k] + 1.0


def test_a_float_or_a_bool_for_an_index_is_rejected_at_trace_time():
    k = lk.megakernel(_put)
    out = jnp.zeros(4, jnp.float32)
    for m in (True, 1.5, jnp.float32(1.0)):
        with pytest.raises(lk.ArgumentError, match="argument 'k': the step indexes an array with it"):
            k.jax(out, m, steps=1)
    np.testing.assert_array_equal(np.asarray(k.jax(out, 2, steps=3)[0]), [0, 0, 3, 0])


def test_xla_ffi_shim_builds_and_registers_without_a_gpu():
    from loopkern.interop import xla_ffi
    pytest.importorskip("cffi")
    mod = xla_ffi.build_shim()
    assert int(mod.ffi.cast("uintptr_t", mod.lib.lk_launch_address())) != 0
    xla_ffi.register_cuda_target()     # queued for CUDA on a CPU-only jaxlib


def test_the_shims_device_queries_report_a_missing_driver():
    """Without libcuda the shim's device queries (what kernel.jax sizes a call by without
    Numba) raise BackendError with the driver's absence as the reason: the Python side calls
    them with the arguments their C declarations take."""
    import ctypes.util

    from loopkern.interop import xla_ffi
    pytest.importorskip("cffi")
    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has a CUDA driver (the GPU tests query it)")
    for query in (xla_ffi.current_device, lambda: xla_ffi.device_shared(0),
                  lambda: xla_ffi.function_limits(0, 1, 64, 1000)):
        with pytest.raises(lk.BackendError, match="libcuda"):
            query()


def test_timeout_returns_the_steps_done(rng):
    # an integer step with a closed form: exactly the state after 'done' steps, every element
    a0 = rng.integers(-1000, 1000, 2000).astype(np.int32)
    u, v, done = SHIFT.jax(jnp.asarray(a0), jnp.asarray(a0), steps=10 ** 9, timeout=0.3)
    done = int(done)
    assert 0 < done < 10 ** 9
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, done))
    # the heat stencil in float32, against the exact float64 solution after 'done' steps. Float32
    # rounding drifts with the number of steps, which depends on the machine's speed: a field of
    # 64K keeps that number (1e4-1e5 on a CPU) far below where the drift nears the tolerance
    # (1.8e-2 after the 1e6 steps that 2000 elements ran in 0.3 s on a fast CPU)
    u0 = rng.random(1 << 16).astype(np.float32)
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
    for k in (HEAT, JACOBI, SHIFT, WINDOW):
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



def test_cache_with_x64(rng, builds):
    u0 = rng.random(129)
    with refs.jax_x64():
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


def test_a_refused_grad_leaves_the_cache_warm(rng, builds):
    u = jnp.asarray(rng.random(16).astype(np.float32))
    WINDOW.jax(u, u, steps=3)
    with pytest.raises(lk.LoopkernError, match="when its step is 1 or a positive constant"):
        jax.grad(lambda a: WINDOW.jax(a, a, steps=3)[0].sum())(u)
    # the primal call was built once; the refused grad built only the tangent kernel's call
    assert sum(1 for key in builds if key[2][0][0] == (16,) and len(key[2]) == 2) == 1


def test_cache_is_bounded(rng, builds, monkeypatch):
    entries = jax_bridge.call_cache(SHIFT)
    monkeypatch.setattr(entries, "size", 3)
    for n in (10, 11, 12, 13, 10):
        a0 = rng.integers(-9, 9, n).astype(np.int32)
        u, _ = SHIFT.jax(jnp.asarray(a0), jnp.asarray(a0), steps=3)
        np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, 3))
    assert len(entries) == 3 and len(builds) == 5        # 10 was dropped, then built again


# ------------------------------------------------------------------------------ the CUDA lowering
# Without a GPU, the CUDA call is still built and lowered: the kernel load and the occupancy
# query are faked (a made-up CUfunction handle, a fixed grid), and the platform is forced.
import re  # noqa: E402
import types  # noqa: E402


@pytest.fixture
def as_if_cuda(monkeypatch):
    """kernel.jax builds its CUDA call here (nothing is launched); the kernels' call caches
    are emptied before and after, so no entry with a fake handle outlives the test.
    ``scope="auto"`` resolves as without tile mode here (its calls need the device's answers:
    ``cached_tile_device``)."""
    from numba import cuda

    from loopkern import compile as lk_compile
    from loopkern.dispatch import config as lk_config
    from loopkern.interop import xla_ffi as lk_xla_ffi

    def fake_config(kernel, scope, work, threads, blocks, simulator, shared=0, sms=None):
        if scope == "thread":
            return lk_config.LaunchConfig("thread", 1, 1)
        return lk_config.LaunchConfig(scope, blocks or (132 if scope == "grid" else 1), threads or 256)
    monkeypatch.setattr(lk_compile.CompiledKernel, "load_for_ffi",
                        lambda self, types_, xla_ffi, disk_key=None: (None, 0x1234))
    monkeypatch.setattr(lk_xla_ffi, "current_device", lambda: (0, (9, 0), 132))
    monkeypatch.setattr(lk_compile, "load_cubin", lambda key: None)      # nothing on disk: Numba's path
    monkeypatch.setattr(lk_config, "cuda_config", fake_config)
    monkeypatch.setattr(jax_bridge, "_platform", lambda mk, arrays, backend: "cuda")
    monkeypatch.setattr(cuda, "get_current_device", lambda: types.SimpleNamespace(id=0, compute_capability=(9, 0)))
    monkeypatch.setattr(Dispatcher, "auto_tile", lambda self, work, debug, sim, shapes=None: False)
    kernels = (HEAT, JACOBI, SHIFT)
    for k in kernels:
        jax_bridge.call_cache(k).clear()
    yield
    for k in kernels:
        jax_bridge.call_cache(k).clear()


# (the jitted function, its arguments, donated arguments, the number of arrays it passes)
LOWERED = {
    "numbers": (lambda a, b: HEAT.jax(a, b, 0.25, steps=1), 0, 2),
    "numpy scalar, grid": (lambda a, b: HEAT.jax(a, b, np.float32(0.25), steps=3, scope="grid", seed=5), 0, 2),
    "traced scalar and steps": (lambda a, b, al, s: HEAT.jax(a, b, al, steps=s), 2, 2),
    "timeout": (lambda a, b: SHIFT.jax(a, b, steps=10, timeout=1.5, scope="grid"), 0, 2),
    "long timeout, start": (lambda a, b: SHIFT.jax(a, b, steps=10, start=3, timeout=10.0), 0, 2),
    "condition": (lambda a, b: JACOBI.jax(a, b, np.float32(1e-3), max_steps=100, scope="grid"), 0, 2),
}


def _lowered_args(name, n_traced):
    if name.startswith("condition"):
        return (jnp.zeros((48, 48), jnp.float32), jnp.ones((48, 48), jnp.float32))
    dt = jnp.int32 if "timeout" in name else jnp.float32
    arrays = (jnp.zeros(4096, dt), jnp.ones(4096, dt))
    return arrays + ((jnp.float32(0.25), 7) if n_traced else ())


@pytest.mark.parametrize("name", LOWERED)
def test_cuda_lowering_is_the_custom_call_alone(name, as_if_cuda):
    """The StableHLO of a jitted call for the CUDA platform: the custom call, constants, and
    reshapes of the jitted function's parameters (bitcasts to XLA); no op fills, copies or
    slices a buffer for it (the control block and the barrier counter are plain results the
    handler initialises, the step count is one of its results)."""
    f, n_traced, n_arrays = LOWERED[name]
    text = jax.jit(f).trace(*_lowered_args(name, n_traced)).lower(lowering_platforms=("cuda",)).as_text()
    ops = re.findall(r"= stablehlo\.([a-z_]+)", text)
    assert ops.count("custom_call") == 1, text
    assert set(ops) <= {"custom_call", "constant", "reshape"}, text
    # a reshape only where a traced number becomes a 1-element buffer
    reshaped = re.findall(r"= stablehlo\.reshape (%\S+)", text)
    assert sorted(reshaped) == [f"%arg{i}" for i in range(2, 2 + n_traced)], text
    # only the arrays are aliased: XLA need not fill or copy a buffer for the custom call
    assert text.count("stablehlo.output_operand_alias<") == n_arrays, text
    # everything returned comes straight from the custom call
    (call_id,) = re.findall(r"(%\S+?)(?::\d+)? = stablehlo\.custom_call", text)
    returned = re.search(r"return (.*?) :", text).group(1).split(", ")
    assert all(r.startswith(call_id + "#") for r in returned), text
    with_count = "timeout" in name or name.startswith("condition")
    assert len(returned) == n_arrays + with_count
    attrs = re.search(r"mhlo\.backend_config = \{(.*?)\}", text).group(1)
    timeout = {"timeout": 1500000000, "long timeout, start": 10000000000}.get(name, 0)
    assert f"timeout_ns = {timeout} : i64" in attrs and f"count = {n_arrays + 4 if with_count else -1} : i64" in attrs
    assert "kernel = 4660 : i64" in attrs       # the image id (load_for_ffi's, faked: 0x1234), not a CUfunction


def test_a_cubin_on_disk_is_launched_without_compiling(as_if_cuda, monkeypatch):
    """A kernel.jax call whose cubin an earlier process compiled registers that cubin with the
    shim and sizes its grid from the driver's answers: Numba compiles nothing."""
    from loopkern import compile as lk_compile
    from loopkern.dispatch import config as lk_config
    from loopkern.interop import xla_ffi

    keys, seen = [], {}

    def load(key):
        keys.append(key)
        return lk_compile.CachedCubin(b"CUBIN", "entry_fn", 640)
    monkeypatch.setattr(lk_compile, "load_cubin", load)
    monkeypatch.setattr(xla_ffi, "register_image", lambda image, entry: seen.update(image=(image, entry)) or 0x777)
    monkeypatch.setattr(xla_ffi, "function_limits", lambda dev, image_id, threads=0, shared=0: (512, 7 * threads, 0))
    monkeypatch.setattr(lk_compile.CompiledKernel, "load_for_ffi", lambda *a, **k: pytest.fail("Numba compiled"))
    fake = lk_config.cuda_config

    def sizing(kernel, scope, *args, **kw):
        seen.update(max_threads=kernel.max_threads_per_block, blocks=kernel.max_cooperative_grid_blocks(64))
        return fake(kernel, scope, *args, **kw)
    monkeypatch.setattr(lk_config, "cuda_config", sizing)
    text = jax.jit(lambda a, b: SHIFT.jax(a, b, steps=10, scope="grid")).trace(
        jnp.zeros(4096, jnp.int32), jnp.ones(4096, jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    attrs = re.search(r"mhlo\.backend_config = \{(.*?)\}", text).group(1)
    assert "kernel = 1911 : i64" in attrs                        # 0x777, the registered cached image
    assert seen == dict(image=(b"CUBIN", "entry_fn"), max_threads=512, blocks=448)   # min(640, the driver's 512)
    # the key is of the generated source and the parameter types: another dtype, another key
    jax.jit(lambda a, b: SHIFT.jax(a, b, steps=10, scope="grid")).trace(
        jnp.zeros(4096, jnp.float32), jnp.ones(4096, jnp.float32)).lower(lowering_platforms=("cuda",))
    assert len(keys) == 2 and keys[0] != keys[1]


@pytest.fixture
def cached_tile_device(as_if_cuda, monkeypatch):
    """kernel.jax builds a CUDA call from cubins 'on disk' for an H200-like device (132 SMs,
    227 KiB of shared memory a block may opt in to): the driver's answers come through the shim
    (faked), Numba compiles nothing. Yields what was seen: the kernel sources asked for and the
    occupancy queries (threads, dynamic shared memory). The grid scope's sizing is
    ``as_if_cuda``'s (132 blocks, no shared memory)."""
    from loopkern import compile as lk_compile
    from loopkern.interop import xla_ffi

    seen = dict(queries=[])

    def limits(dev, image_id, threads=0, shared=0):
        seen["queries"].append((threads, shared))
        return 1024, (132 if shared <= 200 * 1024 else 0) if threads else 0, 512
    monkeypatch.setattr(lk_compile, "load_cubin", lambda key: lk_compile.CachedCubin(b"CUBIN", "entry_fn", 1024))
    monkeypatch.setattr(xla_ffi, "register_image", lambda image, entry: 0x777)
    monkeypatch.setattr(xla_ffi, "function_limits", limits)
    monkeypatch.setattr(xla_ffi, "device_shared", lambda dev: (232448, 233472))
    monkeypatch.setattr(lk_compile.CompiledKernel, "load_for_ffi", lambda *a, **k: pytest.fail("Numba compiled"))
    monkeypatch.setattr(Dispatcher, "auto_tile", _AUTO_TILE)
    yield seen


def _custom_call(text):
    """(the backend_config attributes, the result types) of the one custom call in ``text``."""
    import re
    attrs = re.search(r"mhlo\.backend_config = \{(.*?)\}", text).group(1)
    line = next(ln for ln in text.splitlines() if "stablehlo.custom_call" in ln)
    return attrs, re.findall(r"tensor<[^>]*>", line.rsplit("->", 1)[1])


def test_kernel_jax_runs_tile_mode_with_its_shared_memory_and_halo_scratch(cached_tile_device):
    """scope='tile' under kernel.jax: the custom call launches the rounds kernel cooperatively
    with the tiles' dynamic shared memory and carries the halo scratch as one more result (4096
    float32 cells of heat: 16 blocks of 256 cells, 32 steps per exchange, a halo 32 cells deep
    on either side)."""
    import re
    f = jax.jit(lambda a, b: HEAT.jax(a, b, 0.25, steps=100, scope="tile"))
    attrs, results = _custom_call(f.trace(jnp.zeros(4096, jnp.float32), jnp.zeros(4096, jnp.float32))
                                  .lower(lowering_platforms=("cuda",)).as_text())
    assert "cooperative = 1 : i64" in attrs and "blocks = 16 : i64" in attrs
    assert f"shared = {2 * 4 * (256 + 64)} : i64" in attrs          # both buffers' tiles and halos
    # the halo scratch after the control block: two parities x 16 blocks x (32 below + 32
    # above) cells x both buffers
    assert results[2:] == ["tensor<2x128xui8>", "tensor<2x128xui8>", "tensor<16xui8>", "tensor<18xui32>",
                           f"tensor<{2 * 16 * 64 * 2}xf32>"]
    layout = [int(x) for x in re.search(r"layout = dense<\[(.*?)\]>", attrs).group(1).split(", ")]
    n_arrays = 2
    assert layout[-5:] == [1, n_arrays + 4, 0, 0, 0]                # the halo: the kernel's last parameter
    # the occupancy was asked with the tiles' shared memory (the shim allows it first)
    assert any(shared == 2 * 4 * (256 + 64) for _, shared in cached_tile_device["queries"])


def test_kernel_jax_auto_picks_tile_mode_as_a_direct_call_does(cached_tile_device):
    """scope='auto' (the default) runs a 1-D stencil that allows rounds in tile mode under
    kernel.jax too; a step that is not a stencil keeps its scope, and scope='tile' for it is an
    ArgumentError naming the scope (the logistic map is sequential: since session 36 that is the
    reason given, before the stencil test)."""
    f = jax.jit(lambda a, b: HEAT.jax(a, b, 0.25, steps=100))
    attrs, results = _custom_call(f.trace(jnp.zeros(4096, jnp.float32), jnp.zeros(4096, jnp.float32))
                                  .lower(lowering_platforms=("cuda",)).as_text())
    assert "cooperative = 1 : i64" in attrs and "blocks = 16 : i64" in attrs and results[-1] == "tensor<4096xf32>"
    assert len(results) == 7
    logistic = lk.megakernel(W.logistic_step)
    x = jnp.zeros(4096, jnp.float32)
    attrs, results = _custom_call(jax.jit(lambda a: logistic.jax(a, 3.9, steps=10)).trace(x)
                                  .lower(lowering_platforms=("cuda",)).as_text())
    assert "shared = 0 : i64" in attrs and len(results) == 5 and results[-1] == "tensor<18xui32>"
    with pytest.raises(lk.ArgumentError, match="scope='tile': step 'logistic_step' has no parallel construct"):
        logistic.jax(x, 3.9, steps=10, scope="tile")


def test_kernel_jax_auto_keeps_its_scope_when_the_tiles_do_not_fit(cached_tile_device, monkeypatch):
    """When no tile-mode grid can be co-resident (the driver says none fits), scope='auto'
    falls back to the scope it resolves to without tiles, as a direct call does; scope='tile'
    raises LaunchError."""
    from loopkern.interop import xla_ffi
    monkeypatch.setattr(xla_ffi, "function_limits",
                        lambda dev, image_id, threads=0, shared=0: (1024, 0 if shared else 264, 512))
    x = jnp.zeros(4096, jnp.float32)
    attrs, results = _custom_call(jax.jit(lambda a, b: HEAT.jax(a, b, 0.25, steps=100)).trace(x, x)
                                  .lower(lowering_platforms=("cuda",)).as_text())
    # the scope "auto" resolves to without tiles: one block for 4096 cells, no halo scratch
    assert "blocks = 1 : i64" in attrs and "cooperative = 0 : i64" in attrs and len(results) == 6
    with pytest.raises(lk.LaunchError, match="scope='tile'"):
        HEAT.jax(x, x, 0.25, steps=100, scope="tile")


def test_cubins_on_disk_round_trip_and_a_damaged_one_is_a_miss(monkeypatch, tmp_path):
    from loopkern import compile as lk_compile
    monkeypatch.setenv("LOOPKERN_CACHE_DIR", str(tmp_path))
    key = lk_compile.cubin_key("source", ("types",), (9, 0))
    assert key != lk_compile.cubin_key("source", ("types",), (8, 0))
    assert key != lk_compile.cubin_key("source ", ("types",), (9, 0))
    assert key != lk_compile.cubin_key("source", ("types", 1), (9, 0))
    assert lk_compile.load_cubin(key) is None
    image = bytes(range(256)) * 10
    lk_compile.store_cubin(key, image, "entry", 896)
    assert lk_compile.load_cubin(key) == lk_compile.CachedCubin(image, "entry", 896)
    cubin = next(tmp_path.rglob(f"{key}.cubin"))
    cubin.write_bytes(image[:-1] + b"x")                         # same length, other bytes
    assert lk_compile.load_cubin(key) is None
    cubin.write_bytes(image[:100])
    assert lk_compile.load_cubin(key) is None
    next(tmp_path.rglob(f"{key}.json")).write_text("{not json")
    assert lk_compile.load_cubin(key) is None


_cpu_registered = []


def _compiled_entry(f, args, donate):
    """The optimized HLO's entry instructions of ``f`` built for CUDA and compiled by XLA:CPU,
    minus parameters, constants, bitcasts and tuple plumbing (which run nothing). XLA:CPU runs
    the same algebraic simplification and copy insertion as XLA:GPU; for it to compile the
    custom call, the shim's handler is registered for the CPU platform too (never run)."""
    if not _cpu_registered:
        import ctypes

        from loopkern.interop import xla_ffi
        mod = xla_ffi.build_shim()
        addr = int(mod.ffi.cast("uintptr_t", mod.lib.lk_launch_address()))
        fn = ctypes.cast(ctypes.c_void_p(addr), ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p))
        jax.ffi.register_ffi_target(xla_ffi.TARGET, jax.ffi.pycapsule(fn), platform="cpu")
        _cpu_registered.append(fn)
    text = jax.jit(f, donate_argnums=donate).trace(*args).lower(lowering_platforms=("cpu",)).compile().as_text()
    entry = text[text.index("\nENTRY") + 1:]
    entry = entry[:entry.index("\n}")]
    return [line.strip() for line in entry.splitlines()[1:]
            if not re.search(r" (parameter|constant|bitcast|tuple|get-tuple-element)\(", line)]


@pytest.mark.parametrize("name", LOWERED)
def test_cuda_call_compiles_to_the_custom_call_alone(name, as_if_cuda):
    """After XLA's optimizations, with the arrays donated: the custom call and nothing else (the
    all-zero default seed stays a constant; no memset, broadcast or copy of an aliased buffer;
    no slice or bitcast-convert for the step count)."""
    f, n_traced, _ = LOWERED[name]
    ops = _compiled_entry(f, _lowered_args(name, n_traced), (0, 1))
    assert len(ops) == 1 and " custom-call(" in ops[0], "\n".join(ops)


def test_undonated_arrays_are_the_only_copies(as_if_cuda):
    # without donation XLA copies each array into the result the kernel updates in place (JAX
    # semantics: the inputs stay as they were); nothing else
    f, n_traced, _ = LOWERED["timeout"]
    ops = _compiled_entry(f, _lowered_args("timeout", n_traced), ())
    assert len(ops) == 3 and sum(" copy(" in op for op in ops) == 2, "\n".join(ops)


# ------------------------------------------------------------------------------ the handler itself
# ffi_shim.c's handler, compiled into a small C program with hand-made XLA FFI call frames and
# linked against a stand-in for libcuda (device pointers are host pointers, every call is
# logged, a launch runs a fake kernel that records its parameters and writes the control block
# as the real one does): the driver calls it makes, in order, and what the kernel sees.
_FAKE_LIBCUDA = r"""
/* A stand-in for libcuda: device pointers are host pointers, a stream runs its work at once,
   in order; every call is logged; a launch calls the harness's kernel. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
typedef unsigned long long CUdeviceptr;
char fake_log[8192];
void (*fake_kernel)(void** params) = 0;
static void logf_(const char* s) { strncat(fake_log, s, sizeof fake_log - strlen(fake_log) - 1); }
int cuInit(unsigned f) { (void)f; return 0; }
int cuDeviceGet(int* d, int o) { *d = o; return 0; }
/* device d's stream is 0x5157 + 0x1000 d, its (primary) context 0x15157 + 0x1000 d; a function
   loaded there is 0x1234 + 0x1000 d; device d has 4 >> d SMs, each holding 2 blocks of up to
   64 threads (1 of more). Context pushes, loads and occupancy queries go to fake_loads. */
char fake_loads[8192];
int fake_depth = 0, fake_nloads = 0;
static uintptr_t current = 0;
static void logl_(const char* s) { strncat(fake_loads, s, sizeof fake_loads - strlen(fake_loads) - 1); }
int cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)(uintptr_t)(0x15157 + 0x1000 * d); return 0; }
int cuStreamGetCtx(void* s, void** c) { *c = (void*)((uintptr_t)s + 0x10000); return 0; }
int cuCtxPushCurrent_v2(void* c) {
  char b[64]; snprintf(b, sizeof b, "push(%p);", c); logl_(b);
  fake_depth++; current = (uintptr_t)c; return 0;
}
int cuCtxPopCurrent_v2(void** c) { logl_("pop;"); fake_depth--; *c = (void*)current; current = 0; return 0; }
int cuCtxGetDevice(int* d) { *d = (int)((current - 0x15157) / 0x1000); return 0; }
int cuCtxGetCurrent(void** c) { *c = (void*)current; return 0; }
int cuFuncGetAttribute(int* v, int a, void* f) { (void)f; *v = a == 0 ? 768 : a == 1 ? 256 : -1; return 0; }
int cuDeviceGetAttribute(int* v, int a, int d) {
  *v = a == 16 ? 4 >> d : a == 97 ? 232448 : a == 81 ? 233472 : -1;
  return 0;
}
int cuModuleLoadData(void** m, const void* i) {
  char b[64]; snprintf(b, sizeof b, "load(%.16s);", (const char*)i); logl_(b);
  if (!strncmp((const char*)i, "BAD", 3)) return 209;
  fake_nloads++; *m = (void*)current; return 0;
}
int cuModuleUnload(void* m) { (void)m; logl_("unload;"); return 0; }
int cuModuleGetFunction(void** f, void* m, const char* n) {
  char b[64]; snprintf(b, sizeof b, "get(%s);", n); logl_(b);
  *f = (void*)((uintptr_t)m - 0x15157 + 0x1234); return 0;
}
int cuOccupancyMaxActiveBlocksPerMultiprocessor(int* nb, void* f, int t, size_t sh) {
  char b[64]; snprintf(b, sizeof b, "occupancy(%p,%d,%zu);", f, t, sh); logl_(b);
  *nb = t <= 64 ? 2 : 1; return 0;
}
int cuGetErrorName(int r, const char** s) { *s = r == 209 ? "CUDA_ERROR_NO_BINARY_FOR_GPU" : "FAKE_ERROR"; return 0; }
int cuMemsetD32Async(CUdeviceptr p, unsigned v, size_t n, void* s) {
  char b[128]; snprintf(b, sizeof b, "memset(+%llu,%u,%zu,%p);", p & 0xFFF, v, n, s); logf_(b);
  for (size_t i = 0; i < n; ++i) ((uint32_t*)(uintptr_t)p)[i] = v;
  return 0;
}
int cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) {
  char b[128]; snprintf(b, sizeof b, "copy(%zu,%p);", n, st); logf_(b);
  memcpy((void*)(uintptr_t)d, (void*)(uintptr_t)s, n);
  return 0;
}
/* a launch with dynamic shared memory logs it; one with more than the function was allowed
   (the 48 KiB default, or what cuFuncSetAttribute raised it to) fails, as the driver's does */
static int allowed[8];
int cuFuncSetAttribute(void* f, int a, int v) {
  char b[64]; snprintf(b, sizeof b, "attr(%p,%d,%d);", f, a, v); logl_(b);
  if (a == 8) allowed[((uintptr_t)f - 0x1234) / 0x1000 % 8] = v;
  return 0;
}
static int launch(const char* how, void* f, unsigned g, unsigned t, unsigned sh, void* s, void** params) {
  char b[128];
  if (sh) snprintf(b, sizeof b, "%s(%p,%u,%u,%p,shared=%u);", how, f, g, t, s, sh);
  else snprintf(b, sizeof b, "%s(%p,%u,%u,%p);", how, f, g, t, s);
  logf_(b);
  int limit = allowed[((uintptr_t)f - 0x1234) / 0x1000 % 8];
  if (sh > (unsigned)(limit > 48 * 1024 ? limit : 48 * 1024)) return 1;   /* CUDA_ERROR_INVALID_VALUE */
  if (fake_kernel) fake_kernel(params);
  return 0;
}
int cuLaunchCooperativeKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                              unsigned sh, void* s, void** p) {
  (void)gy; (void)gz; (void)by; (void)bz; return launch("coop", f, gx, bx, sh, s, p);
}
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned sh, void* s, void** p, void** e) {
  (void)gy; (void)gz; (void)by; (void)bz; (void)e; return launch("launch", f, gx, bx, sh, s, p);
}
"""

_HARNESS = r"""
/* Drives lk_launch with hand-made XLA FFI call frames against fake_cuda.c. Prints one line per
   check; exits nonzero on the first failure. */
#include "ffi_shim.c"
#include <stdlib.h>

extern char fake_log[8192], fake_loads[8192];
extern int fake_depth, fake_nloads;
extern void (*fake_kernel)(void** params);

static int fails = 0;
#define CHECK(c, ...) do { if (!(c)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); fails++; } } while (0)

static char last_error[512];
static XLA_FFI_Error* fake_error_create(XLA_FFI_Error_Create_Args* a) {
  snprintf(last_error, sizeof last_error, "%s", a->message);
  return (XLA_FFI_Error*)1;
}
/* the stream XLA hands the handler (device d's is 0x5157 + 0x1000 d), and the kernel called */
static uintptr_t the_stream = 0x5157;
static int64_t the_kernel, the_shared = 0;
/* where XLA put the result aliased to u: NULL, u's own buffer (the alias kept) */
static int32_t* the_u_result = NULL;
static XLA_FFI_Error* fake_stream_get(XLA_FFI_Stream_Get_Args* a) { a->stream = (void*)the_stream; return NULL; }

/* a kernel with parameters nsteps, t0, u (2-D), alpha, redf, redi, bar, seed, info, host: it
   records what it sees and writes the control block as the real one does */
typedef struct { int64_t nitems, itemsize; char* data; int64_t shape[2], strides[2]; } Arr;
static Arr seen[10];
static const int ranks[10] = {1, 1, 2, 1, 2, 2, 1, 1, 1, 1};
static int64_t seen_timeout, seen_request, seen_steps_before;
static uint32_t seen_bar;
static void kernel(void** params) {
  int k = 0;
  for (int p = 0; p < 10; ++p) {
    Arr* a = &seen[p];
    k += 2;
    a->nitems = *(int64_t*)params[k++];
    a->itemsize = *(int64_t*)params[k++];
    a->data = *(char**)params[k++];
    for (int d = 0; d < ranks[p]; ++d) a->shape[d] = *(int64_t*)params[k++];
    for (int d = 0; d < ranks[p]; ++d) a->strides[d] = *(int64_t*)params[k++];
  }
  int64_t* host = (int64_t*)seen[9].data;
  seen_timeout = host[4];
  seen_request = host[1];
  seen_steps_before = host[0];
  seen_bar = *(uint32_t*)seen[6].data;
  host[0] = 1234567;        /* STEPS */
  host[2] = 0;              /* WHY */
  host[3] = 1;              /* DONE */
}

typedef struct { XLA_FFI_ByteSpan name; XLA_FFI_AttrType type; void* value; } Attr;

static int run(int64_t timeout_ns, int64_t count, int64_t coop, const int64_t* layout, size_t nlayout,
               uint32_t* ctl_out, int32_t* cnt_out, int32_t* u_data) {
  /* arguments: nsteps, t0, u (aliased: the result's buffer), alpha, seed[3] */
  static int32_t nsteps = 10, t0 = 0; static float alpha = 0.25f; static uint32_t seed[3] = {7, 9, 6};
  int64_t d1 = 1, d3 = 3, du[2] = {4, 6}, dr[2] = {2, 8 * 5}, dinfo = 16, dctl = 17;
  XLA_FFI_Buffer args[5], rets[7];
  memset(args, 0, sizeof args); memset(rets, 0, sizeof rets);
  void* argp[5]; XLA_FFI_ArgType argt[5];
  XLA_FFI_Buffer* a;
  a = &args[0]; a->dtype = XLA_FFI_DataType_S32; a->data = &nsteps; a->rank = 1; a->dims = &d1;
  a = &args[1]; a->dtype = XLA_FFI_DataType_S32; a->data = &t0; a->rank = 1; a->dims = &d1;
  a = &args[2]; a->dtype = XLA_FFI_DataType_S32; a->data = u_data; a->rank = 2; a->dims = du;
  a = &args[3]; a->dtype = XLA_FFI_DataType_F32; a->data = &alpha; a->rank = 1; a->dims = &d1;
  a = &args[4]; a->dtype = XLA_FFI_DataType_U32; a->data = seed; a->rank = 1; a->dims = &d3;
  for (int i = 0; i < 5; ++i) { argp[i] = &args[i]; argt[i] = XLA_FFI_ArgType_BUFFER; }
  /* results: u, redf, redi, info (bytes), control (17 words), count */
  static uint8_t redf[80], redi[80], info[16];
  a = &rets[0]; *a = args[2]; if (the_u_result) a->data = the_u_result;
  a = &rets[1]; a->dtype = XLA_FFI_DataType_U8; a->data = redf; a->rank = 2; a->dims = dr;
  a = &rets[2]; a->dtype = XLA_FFI_DataType_U8; a->data = redi; a->rank = 2; a->dims = dr;
  a = &rets[3]; a->dtype = XLA_FFI_DataType_U8; a->data = info; a->rank = 1; a->dims = &dinfo;
  a = &rets[4]; a->dtype = XLA_FFI_DataType_U32; a->data = ctl_out; a->rank = 1; a->dims = &dctl;
  a = &rets[5]; a->dtype = XLA_FFI_DataType_S32; a->data = cnt_out; a->rank = 0; a->dims = NULL;
  void* retp[6]; XLA_FFI_RetType rett[6];
  int nrets = count >= 0 ? 6 : 5;
  for (int i = 0; i < nrets; ++i) { retp[i] = &rets[i]; rett[i] = XLA_FFI_RetType_BUFFER; }

  int64_t kernel = the_kernel, blocks = 5, threads = 64, control = 4, tslot = 4, sslot = 0;
  XLA_FFI_Scalar s[12]; XLA_FFI_Array lay = {XLA_FFI_DataType_S64, nlayout, (void*)layout};
  static const int64_t alias_pairs[2] = {2, 0};     /* input 2 (u) is result 0 */
  XLA_FFI_Array ali = {XLA_FFI_DataType_S64, 2, (void*)alias_pairs};
  const char* names[] = {"blocks", "control", "cooperative", "count", "kernel", "layout", "shared", "steps_slot",
                         "threads", "timeout_ns", "timeout_slot", "aliases"};
  int64_t* vals[] = {&blocks, &control, &coop, &count, &kernel, NULL, &the_shared, &sslot, &threads, &timeout_ns,
                     &tslot, NULL};
  XLA_FFI_ByteSpan spans[12], *spanp[12]; XLA_FFI_AttrType types[12]; void* attrs[12];
  for (int i = 0; i < 12; ++i) {
    spans[i].ptr = names[i]; spans[i].len = strlen(names[i]); spanp[i] = &spans[i];
    if (vals[i]) { s[i].dtype = XLA_FFI_DataType_S64; s[i].value = vals[i]; types[i] = XLA_FFI_AttrType_SCALAR; attrs[i] = &s[i]; }
    else { types[i] = XLA_FFI_AttrType_ARRAY; attrs[i] = i == 11 ? (void*)&ali : (void*)&lay; }
  }
  static XLA_FFI_Api api;
  api.XLA_FFI_Error_Create = fake_error_create;
  api.XLA_FFI_Stream_Get = fake_stream_get;
  XLA_FFI_CallFrame cf;
  memset(&cf, 0, sizeof cf);
  cf.api = &api;
  cf.stage = XLA_FFI_ExecutionStage_EXECUTE;
  cf.args.size = 5; cf.args.types = argt; cf.args.args = argp;
  cf.rets.size = nrets; cf.rets.types = rett; cf.rets.rets = retp;
  cf.attrs.size = 12; cf.attrs.types = types; cf.attrs.names = spanp; cf.attrs.attrs = attrs;
  fake_log[0] = 0; fake_loads[0] = 0; last_error[0] = 0;
  memset(ctl_out, 0xAB, 17 * 4);    /* what XLA's allocator left there */
  *cnt_out = -5;
  return lk_launch(&cf) == NULL ? 0 : -1;
}

int main(void) {
  /* the layout jax_bridge builds for this signature (5 numbers per kernel parameter) */
  const int64_t layout[] = {0, 0, 0, 0, 0,  0, 1, 0, 0, 0,  1, 0, 0, 0, 0,  0, 3, 0, 0, 0,
                            1, 1, 8, 0, 0,  1, 2, 8, 0, 0,  1, 4, 4, 64, 1,  0, 4, 0, 0, 2,
                            1, 3, 8, 0, 0,  1, 4, 8, 0, 8};
  uint32_t* ctl = malloc(17 * 4); int32_t cnt; int32_t u[24];
  fake_kernel = kernel;
  char expect[512], err[512];

  /* images are copied: the caller's buffer may go; the same bytes and entry, the same id */
  char image[16] = "CUBIN-A";
  int64_t id = 0, again = 0, other = 0;
  CHECK(lk_register_image(image, 8, "k", &id, err, sizeof err) == 0 && id >= 1, "register: %s", err);
  CHECK(lk_register_image(image, 8, "k", &again, err, sizeof err) == 0 && again == id, "registered again: %lld",
        (long long)again);
  CHECK(lk_register_image(image, 8, "k2", &other, err, sizeof err) == 0 && other != id, "another entry");
  strcpy(image, "CUBIN-B");
  CHECK(lk_register_image(image, 8, "k", &other, err, sizeof err) == 0 && other != id, "another image");
  strcpy(image, "overwritten");
  the_kernel = id;

  /* a timeout under 2^32 ns, the step count wanted, cooperative */
  CHECK(run(1500000000, 5, 1, layout, 50, ctl, &cnt, u) == 0, "call failed: %s", last_error);
  snprintf(expect, sizeof expect, "memset(+%llu,0,17,0x5157);memset(+%llu,1500000000,1,0x5157);coop(0x1234,5,64,0x5157);copy(4,0x5157);",
           (unsigned long long)((uintptr_t)ctl & 0xFFF), (unsigned long long)(((uintptr_t)ctl + 32) & 0xFFF));
  CHECK(!strcmp(fake_log, expect), "driver calls: %s\n  expected %s", fake_log, expect);
  /* the first call on a device loads the kernel into the stream's context, and asks how many
     blocks fit there, with that context pushed */
  snprintf(expect, sizeof expect, "push(%p);load(CUBIN-A);get(k);pop;push(%p);occupancy(%p,64,0);pop;",
           (void*)0x15157, (void*)0x15157, (void*)0x1234);
  CHECK(!strcmp(fake_loads, expect), "loads: %s\n  expected %s", fake_loads, expect);
  CHECK(fake_depth == 0, "context stack depth %d", fake_depth);
  CHECK(seen_timeout == 1500000000 && seen_request == 0 && seen_steps_before == 0 && seen_bar == 0,
        "the kernel saw timeout %lld request %lld steps %lld bar %u", (long long)seen_timeout,
        (long long)seen_request, (long long)seen_steps_before, seen_bar);
  CHECK(cnt == 1234567, "step count %d", cnt);
  CHECK(seen[2].data == (char*)u && seen[2].nitems == 24 && seen[2].itemsize == 4 && seen[2].shape[0] == 4 &&
        seen[2].shape[1] == 6 && seen[2].strides[0] == 24 && seen[2].strides[1] == 4, "u as the kernel saw it");
  CHECK(seen[4].nitems == 10 && seen[4].itemsize == 8 && seen[4].shape[0] == 2 && seen[4].shape[1] == 5 &&
        seen[4].strides[0] == 40 && seen[4].strides[1] == 8, "redf as the kernel saw it");
  CHECK(seen[6].data == (char*)ctl + 64 && seen[6].nitems == 1 && seen[6].itemsize == 4 && seen[6].shape[0] == 1 &&
        seen[6].strides[0] == 4, "bar as the kernel saw it");
  CHECK(seen[7].nitems == 2 && seen[7].itemsize == 4 && ((uint32_t*)seen[7].data)[0] == 7 &&
        ((uint32_t*)seen[7].data)[1] == 9, "the seed as the kernel saw it");
  CHECK(seen[8].nitems == 2 && seen[8].itemsize == 8, "info as the kernel saw it");
  CHECK(seen[9].data == (char*)ctl && seen[9].nitems == 8 && seen[9].itemsize == 8 && seen[9].strides[0] == 8,
        "the control block as the kernel saw it");
  for (int w = 0; w < 17; ++w)
    if (w != 0 && w != 1 && w != 6 && w != 8)
      CHECK(ctl[w] == 0, "control word %d = %#x after the call", w, ctl[w]);

  /* XLA placed u's result apart from its input (an alias it did not keep): the input is copied
     into the result before the launch, and the kernel runs on the result holding u's values */
  int32_t u_apart[24];
  for (int i = 0; i < 24; ++i) { u[i] = 100 + i; u_apart[i] = -1; }
  the_u_result = u_apart;
  CHECK(run(0, 5, 1, layout, 50, ctl, &cnt, u) == 0, "call failed: %s", last_error);
  CHECK(!strncmp(fake_log, "copy(96,0x5157);memset(", 23), "driver calls: %s", fake_log);
  CHECK(seen[2].data == (char*)u_apart && u_apart[0] == 100 && u_apart[23] == 123, "u apart: the kernel saw %p",
        (void*)seen[2].data);
  the_u_result = NULL;

  /* a timeout over 2^32 ns: both words */
  CHECK(run(10000000000LL, 5, 1, layout, 50, ctl, &cnt, u) == 0, "call failed: %s", last_error);
  CHECK(seen_timeout == 10000000000LL, "the kernel saw timeout %lld", (long long)seen_timeout);
  CHECK(strstr(fake_log, ",1410065408,1,") && strstr(fake_log, ",2,1,"), "driver calls: %s", fake_log);

  /* no timeout, no step count, not cooperative: one memset and the launch */
  CHECK(run(0, -1, 0, layout, 50, ctl, &cnt, u) == 0, "call failed: %s", last_error);
  CHECK(!strncmp(fake_log, "memset(", 7) && strstr(fake_log, ",0,17,0x5157);launch(0x1234,5,64,0x5157);") &&
        !strstr(fake_log, "copy") && strlen(strstr(fake_log, ";")) == strlen(strstr(fake_log, ";launch")),
        "driver calls: %s", fake_log);
  CHECK(seen_timeout == 0 && seen_request == 0 && seen_bar == 0 && cnt == -5, "no timeout: %lld %lld %u %d",
        (long long)seen_timeout, (long long)seen_request, seen_bar, cnt);

  /* the same device again: nothing loaded or queried */
  CHECK(run(0, 5, 1, layout, 50, ctl, &cnt, u) == 0 && !fake_loads[0] && fake_nloads == 1, "call failed: %s / %s",
        last_error, fake_loads);

  /* another device (2 SMs: 4 blocks fit) runs the same call: its own load; the grid of 5 blocks
     cannot be co-resident there, which is said before anything is enqueued */
  the_stream = 0x6157;
  CHECK(run(0, 5, 1, layout, 50, ctl, &cnt, u) != 0 && fake_nloads == 2 && !fake_log[0] &&
        strstr(last_error, "the grid of 5 blocks cannot be co-resident on device 1 (at most 4 blocks of 64 threads"),
        "an unlike device: %s / %s", last_error, fake_log);
  CHECK(run(0, 5, 0, layout, 50, ctl, &cnt, u) == 0 && fake_nloads == 2 &&
        strstr(fake_log, "launch(0x2234,5,64,0x6157);"), "not cooperative on device 1: %s / %s", last_error, fake_log);
  the_stream = 0x5157;

  /* loaded from Python first (lk_load_function, the primary context): the handler finds it */
  the_kernel = other;
  CHECK(lk_load_function(0, other, err, sizeof err) == 0 && fake_nloads == 3, "lk_load_function: %s", err);
  CHECK(run(0, 5, 0, layout, 50, ctl, &cnt, u) == 0 && fake_nloads == 3 && !strstr(fake_loads, "load("),
        "after lk_load_function: %s / %s", last_error, fake_loads);

  /* an image the device cannot load; an id nobody registered: errors, nothing enqueued */
  CHECK(lk_register_image("BADCUBIN", 9, "k", &the_kernel, err, sizeof err) == 0, "register: %s", err);
  CHECK(run(0, 5, 1, layout, 50, ctl, &cnt, u) != 0 && !fake_log[0] && fake_depth == 0 &&
        strstr(last_error, "on the device of XLA's stream failed: CUDA_ERROR_NO_BINARY_FOR_GPU (209)"),
        "a load error: %s / %s", last_error, fake_log);
  CHECK(lk_load_function(1, the_kernel, err, sizeof err) != 0 &&
        strstr(err, "on device 1 failed: CUDA_ERROR_NO_BINARY"),
        "a load error from lk_load_function: %s", err);
  the_kernel = 1000;
  CHECK(run(0, 5, 1, layout, 50, ctl, &cnt, u) != 0 && !fake_log[0] &&
        strstr(last_error, "kernel 1000 is not registered"),
        "an unknown kernel: %s / %s", last_error, fake_log);
  the_kernel = id;

  /* without Numba: the current device (no current context: device 0) and a function's limits
     in a device's primary context (device 1: 2 SMs, 2 blocks of up to 64 threads each) */
  int devno = -1, major = 0, minor = 0, sms = 0, most = 0, stat = -1, optin = 0, per_sm = 0;
  int64_t fit = -1;
  CHECK(lk_current_device(&devno, &major, &minor, &sms, err, sizeof err) == 0 && devno == 0 && sms == 4,
        "lk_current_device: %s (%d, %d SMs)", err, devno, sms);
  CHECK(lk_device_shared(1, &optin, &per_sm, err, sizeof err) == 0 && optin == 232448 && per_sm == 233472,
        "lk_device_shared: %s (%d, %d)", err, optin, per_sm);
  CHECK(lk_function_limits(1, id, 64, 0, &most, &fit, &stat, err, sizeof err) == 0 && most == 768 && fit == 4 &&
        stat == 256, "lk_function_limits: %s (%d, %lld, %d)", err, most, (long long)fit, stat);
  CHECK(lk_function_limits(1, id, 0, 0, &most, &fit, &stat, err, sizeof err) == 0 && fit == 0, "no threads: %lld",
        (long long)fit);
  /* above the default 48 KiB the function is allowed the shared memory before the occupancy
     query, which would not count the launch otherwise */
  CHECK(lk_function_limits(1, id, 64, 120000, &most, &fit, &stat, err, sizeof err) == 0 &&
        strstr(fake_loads, ",8,120000);") && strstr(fake_loads, ",64,120000);") &&
        strstr(fake_loads, ",8,120000);") < strstr(fake_loads, ",64,120000);"),
        "limits with 120000 bytes: %s / %s", err, fake_loads);
  CHECK(fake_depth == 0, "context stack depth %d after the queries", fake_depth);

  /* dynamic shared memory: passed to the launch and to the occupancy query; above 48 KiB the
     function is allowed it first, once per size it grows to */
  the_shared = 40000;
  CHECK(run(0, 5, 0, layout, 50, ctl, &cnt, u) == 0 && strstr(fake_log, "launch(0x1234,5,64,0x5157,shared=40000);") &&
        !strstr(fake_loads, "attr("), "40000 bytes: %s / %s / %s", last_error, fake_log, fake_loads);
  the_shared = 100000;
  CHECK(run(0, 5, 1, layout, 50, ctl, &cnt, u) == 0 && strstr(fake_log, "coop(0x1234,5,64,0x5157,shared=100000);") &&
        strstr(fake_loads, "attr(0x1234,8,100000);") && strstr(fake_loads, "occupancy(0x1234,64,100000);"),
        "100000 bytes: %s / %s / %s", last_error, fake_log, fake_loads);
  CHECK(run(0, 5, 1, layout, 50, ctl, &cnt, u) == 0 && !strstr(fake_loads, "attr(") &&
        !strstr(fake_loads, "occupancy("), "100000 bytes again: %s / %s", last_error, fake_loads);
  the_shared = -1;
  CHECK(run(0, 5, 1, layout, 50, ctl, &cnt, u) != 0 && strstr(last_error, "malformed") && !fake_log[0],
        "negative shared memory: %s / %s", last_error, fake_log);
  the_shared = 0;

  /* malformed calls fail before anything is enqueued */
  int64_t bad[50];
  memcpy(bad, layout, sizeof bad);
  bad[33] = 68;          /* the barrier past the end of the control block */
  CHECK(run(0, 5, 1, bad, 50, ctl, &cnt, u) != 0 && strstr(last_error, "outside its buffer") && !fake_log[0],
        "a part outside its buffer: %s / %s", last_error, fake_log);
  CHECK(run(0, 5, 1, layout, 48, ctl, &cnt, u) != 0 && strstr(last_error, "malformed") && !fake_log[0],
        "a short layout: %s / %s", last_error, fake_log);
  CHECK(run(0, 9, 1, layout, 50, ctl, &cnt, u) != 0 && strstr(last_error, "step count") && !fake_log[0],
        "a missing count result: %s / %s", last_error, fake_log);
  memcpy(bad, layout, sizeof bad);
  bad[46] = 3;           /* the control block in info's 16 bytes */
  bad[49] = 8;
  CHECK(run(0, 5, 1, bad, 50, ctl, &cnt, u) != 0 && strstr(last_error, "outside its buffer") && !fake_log[0],
        "a control block view larger than its buffer: %s / %s", last_error, fake_log);
  printf(fails ? "%d FAILED\n" : "ok\n", fails);
  return fails != 0;
}
"""


def test_ffi_handler_against_a_fake_driver(tmp_path):
    import shutil
    import subprocess
    import sysconfig

    from loopkern.interop import xla_ffi
    cc = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "fake_cuda.c").write_text(_FAKE_LIBCUDA)
    (tmp_path / "harness.c").write_text(_HARNESS)
    warn = ["-Wall", "-Wextra", "-Werror"]
    subprocess.run([cc, *warn, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "fake_cuda.c", "-o", "libcuda.so.1"],
                   cwd=tmp_path, check=True, capture_output=True)
    build = subprocess.run([cc, *warn, "-pthread", "-I", jax.ffi.include_dir(), "-I", str(xla_ffi._SRC.parent),
                            "harness.c", "-o", "harness", "-L.", "-l:libcuda.so.1", "-ldl", f"-Wl,-rpath,{tmp_path}"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(tmp_path / "harness")], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_grid_barrier_counter_needs_its_low_bits_clear():
    """Why the handler zeroes the barrier counter each call (it sits in the zeroed control
    buffer): cuda_rt.grid_sync's arithmetic (block 0 adds 0x80000000 - (blocks - 1), the others
    1; a block waits for the top bit to differ from the value it saw) releases every block
    exactly when the last one arrives, and leaves the low 31 bits as they were, only when those
    start at zero; from any other value some arrival order releases a block early."""
    import itertools

    def early(start, blocks):
        for order in itertools.permutations(range(blocks)):
            value, seen = start, []
            for k, b in enumerate(order):
                seen.append(value)
                value = (value + (1 if b else 0x80000000 - (blocks - 1))) & 0xFFFFFFFF
                released = [((old ^ value) & 0x80000000) != 0 for old in seen]
                if any(released) and k < blocks - 1:
                    return True
            assert all(released) and value & 0x7FFFFFFF == start & 0x7FFFFFFF
        return False
    for blocks in (2, 3, 5):
        assert not early(0, blocks) and not early(0x80000000, blocks)
        assert all(early(v, blocks) for v in (1, 5, 0x7FFFFFFF, 0xFFFFFFFF, 0x12345678))
