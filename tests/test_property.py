"""Property: random sizes, step counts and launch shapes give the same result on the CPU
backend and on the CUDA path (Numba's simulator), and both match NumPy."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loopkern as lk
import workloads as W

pytestmark = pytest.mark.sim

HEAT = lk.megakernel(W.heat_step, swap=[("u", "v")])
COUNTER = lk.megakernel(W.counter_step, swap=[("a", "b")])
LIFE = lk.megakernel(W.life_step, swap=[("a", "b")])
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(n=st.integers(2, 70), steps=st.integers(0, 6), threads=st.sampled_from([32, 64, 96]),
       scope=st.sampled_from(["grid", "block"]), seed=st.integers(0, 2 ** 32 - 1))
def test_heat_cpu_equals_simulator(n, steps, threads, scope, seed):
    u0 = np.random.default_rng(seed).random(n)
    out = {}
    for backend in ("cpu", "cuda"):
        u, v = u0.copy(), u0.copy()
        run = HEAT(u, v, 0.3, steps=steps, backend=backend, scope=scope, threads=threads)
        assert run.steps == steps
        out[backend] = u
    np.testing.assert_allclose(out["cpu"], out["cuda"], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(out["cpu"], W.heat_ref(u0, steps, 0.3), rtol=1e-12, atol=1e-15)


@SETTINGS
@given(n=st.integers(1, 90), steps=st.integers(0, 7), threads=st.sampled_from([32, 64]),
       scope=st.sampled_from(["grid", "block"]), seed=st.integers(0, 2 ** 32 - 1))
def test_integer_counter_cpu_equals_simulator_exactly(n, steps, threads, scope, seed):
    a0 = np.random.default_rng(seed).integers(0, 10_000, n)
    out = {}
    for backend in ("cpu", "cuda"):
        a, b = a0.copy(), np.zeros_like(a0)
        COUNTER(a, b, 7919, steps=steps, backend=backend, scope=scope, threads=threads)
        out[backend] = a
    np.testing.assert_array_equal(out["cpu"], out["cuda"])
    np.testing.assert_array_equal(out["cpu"], W.counter_ref(a0, steps, 7919))


@SETTINGS
@given(shape=st.tuples(st.integers(3, 9), st.integers(3, 9)), steps=st.integers(1, 4),
       threads=st.sampled_from([32, 64]), scope=st.sampled_from(["grid", "block"]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_life_grid_shapes_cpu_equals_simulator(shape, steps, threads, scope, seed):
    a0 = (np.random.default_rng(seed).random(shape) < 0.4).astype(np.int32)
    ref, ref_pop = W.life_ref(a0, steps)
    for backend in ("cpu", "cuda"):
        a, b, pop = a0.copy(), np.zeros_like(a0), np.zeros(steps, np.int64)
        LIFE(a, b, pop, steps=steps, backend=backend, scope=scope, threads=threads)
        np.testing.assert_array_equal(a, ref)
        np.testing.assert_array_equal(pop, ref_pop)
