"""Block scope with the arrays held in shared memory: which arrays are staged, and the results
under Numba's simulator against float64 NumPy references."""

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern.dispatch import config as launch
from loopkern.dispatch.args import classify


def _plan(step, swap, *values):
    k = lk.megakernel(step, swap=swap)
    argv = [classify(p.name, v) for p, v in zip(k.spec.params, values)]
    return launch.plan_staging(k.spec, argv)


def test_swap_pair_and_same_dtype_arrays_are_staged(rng):
    n = int(rng.integers(2, launch.STAGE_MAX_BYTES // 8))        # a float32 pair that fits
    u = rng.random(n).astype(np.float32)
    assert _plan(W.heat_step, [("u", "v")], u, u.copy(), 0.25) == ((0, 1), 2 * 4 * n)
    # two phases: x, tmp and out, all float64
    m = int(rng.integers(1, launch.STAGE_MAX_BYTES // 24))
    x = rng.random(m)
    assert _plan(W.two_phase_step, [], x, x.copy(), x.copy()) == ((0, 1, 2), 3 * 8 * m)


def test_nothing_is_staged_when_the_pair_does_not_fit_or_memory_is_shared(rng):
    big = rng.random(int(rng.integers(launch.STAGE_MAX_BYTES // 16 + 1, launch.STAGE_MAX_BYTES // 4)))
    assert _plan(W.heat_step, [("u", "v")], big, big.copy(), 0.25) == ((), 0)
    x = rng.random(int(rng.integers(1, 500)))
    assert _plan(W.two_phase_step, [], x, x, x.copy()) == ((), 0)        # x passed twice
    # an array of another dtype is left in global memory
    k = int(rng.integers(2, 30))
    a = (rng.random((k, k)) < 0.5).astype(np.int32)
    pop = np.zeros(3, np.int64)
    assert _plan(W.life_step, [("a", "b")], a, a.copy(), pop) == ((0, 1), 2 * 4 * k * k)


@pytest.mark.sim
@pytest.mark.parametrize("steps", [0, 1, 7, 8])
def test_staged_heat_and_life_match_references(steps, rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(200)
    u, v = u0.copy(), np.zeros_like(u0)
    run = k(u, v, 0.25, steps=steps, backend="cuda", scope="block", threads=64)
    assert run.scope == "block" and any(key[4:5] == ((0, 1),) for key in k.dispatcher.kernels.variants)
    np.testing.assert_allclose(u, W.heat_ref(u0, steps, 0.25), rtol=1e-12)
    life = lk.megakernel(W.life_step, swap=[("a", "b")])
    a0 = (rng.random((12, 12)) < 0.4).astype(np.int32)
    a, b, pop = a0.copy(), np.zeros_like(a0), np.zeros(steps + 1, np.int64)
    life(a, b, pop, steps=steps, backend="cuda", scope="block", threads=64)
    ref, pops = W.life_ref(a0, steps)
    np.testing.assert_array_equal(a, ref)
    np.testing.assert_array_equal(pop[:steps], pops)


@pytest.mark.sim
def test_staged_jacobi_with_reductions_matches_the_reference(rng):
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = rng.random((10, 10))
    ref, ref_steps = W.jacobi_ref(u0, 1e-3, 500)
    u, v = u0.copy(), u0.copy()
    run = k(u, v, 1e-3, max_steps=500, backend="cuda", scope="block", threads=64)
    assert run.scope == "block" and run.steps == ref_steps
    assert any(key[4:5] == ((0, 1),) for key in k.dispatcher.kernels.variants)
    np.testing.assert_allclose(u, ref, rtol=1e-12)
