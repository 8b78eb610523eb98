"""Property: for random sizes, step counts, launch shapes and inputs, the CPU backend and the
CUDA path (Numba's simulator) each match an independent float64 (or exact integer) NumPy
reference; that the two backends also agree with each other is checked in addition."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loopkern as lk
import refs
import workloads as W

pytestmark = pytest.mark.sim

HEAT = lk.megakernel(W.heat_step, swap=[("u", "v")])
COUNTER = lk.megakernel(W.counter_step, swap=[("a", "b")])
LIFE = lk.megakernel(W.life_step, swap=[("a", "b")])
SHIFT = lk.megakernel(refs.shift_step, swap=[("u", "v")])
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(n=st.integers(2, 70), steps=st.integers(0, 6), threads=st.sampled_from([32, 64, 96]),
       scope=st.sampled_from(["grid", "block"]), seed=st.integers(0, 2 ** 32 - 1))
def test_heat_matches_numpy_on_cpu_and_simulator(n, steps, threads, scope, seed):
    u0 = np.random.default_rng(seed).random(n)
    ref = W.heat_ref(u0, steps, 0.3)
    out = {}
    for backend in ("cpu", "cuda"):
        u, v = u0.copy(), u0.copy()
        run = HEAT(u, v, 0.3, steps=steps, backend=backend, scope=scope, threads=threads)
        assert run.steps == steps
        np.testing.assert_allclose(u, ref, rtol=1e-12, atol=1e-15, err_msg=backend)
        out[backend] = u
    np.testing.assert_allclose(out["cpu"], out["cuda"], rtol=1e-12, atol=1e-15)


@SETTINGS
@given(n=st.integers(1, 90), steps=st.integers(0, 7), threads=st.sampled_from([32, 64]),
       scope=st.sampled_from(["grid", "block"]), seed=st.integers(0, 2 ** 32 - 1))
def test_integer_counter_matches_numpy_exactly_on_cpu_and_simulator(n, steps, threads, scope, seed):
    a0 = np.random.default_rng(seed).integers(0, 10_000, n)
    ref = W.counter_ref(a0, steps, 7919)
    for backend in ("cpu", "cuda"):
        a, b = a0.copy(), np.zeros_like(a0)
        run = COUNTER(a, b, 7919, steps=steps, backend=backend, scope=scope, threads=threads)
        assert run.steps == steps
        np.testing.assert_array_equal(a, ref, err_msg=backend)


@SETTINGS
@given(shape=st.tuples(st.integers(3, 9), st.integers(3, 9)), steps=st.integers(1, 4),
       threads=st.sampled_from([32, 64]), scope=st.sampled_from(["grid", "block"]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_life_grid_shapes_match_numpy_on_cpu_and_simulator(shape, steps, threads, scope, seed):
    a0 = (np.random.default_rng(seed).random(shape) < 0.4).astype(np.int32)
    ref, ref_pop = W.life_ref(a0, steps)
    for backend in ("cpu", "cuda"):
        a, b, pop = a0.copy(), np.zeros_like(a0), np.zeros(steps, np.int64)
        LIFE(a, b, pop, steps=steps, backend=backend, scope=scope, threads=threads)
        np.testing.assert_array_equal(a, ref, err_msg=backend)
        np.testing.assert_array_equal(pop, ref_pop, err_msg=backend)


@SETTINGS
@given(n=st.integers(1, 80), steps=st.integers(0, 9), threads=st.sampled_from([32, 64]),
       scope=st.sampled_from(["grid", "block"]), seed=st.integers(0, 2 ** 32 - 1))
def test_shift_is_exact_after_any_step_count_on_cpu_and_simulator(n, steps, threads, scope, seed):
    # a closed-form reference: u[i] = u0[(i + steps) % n] + steps
    u0 = np.random.default_rng(seed).integers(-10 ** 6, 10 ** 6, n).astype(np.float64)
    for backend in ("cpu", "cuda"):
        u, v = u0.copy(), np.zeros_like(u0)
        run = SHIFT(u, v, steps=steps, backend=backend, scope=scope, threads=threads)
        assert run.steps == steps
        np.testing.assert_array_equal(u, refs.shift_ref(u0, steps), err_msg=backend)
