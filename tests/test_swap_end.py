"""The end of a run is a rename, however the run stopped: after k steps the first array of a
swap pair holds the newest state and the second the state one step before it (k odd or even;
the step count reached, the step's condition, a cancel or a timeout). Checked on a two-level
scheme, where the second array is state, against a float64 NumPy reference."""

import time

import numpy as np
import pytest

import loopkern as lk

BACKENDS = [pytest.param("cpu", None, id="cpu"),
            pytest.param("cuda", "grid", id="sim-grid", marks=pytest.mark.sim),
            pytest.param("cuda", "block", id="sim-block", marks=pytest.mark.sim)]


def damped_wave(t, u, v, c, limit):
    # leapfrog with damping; stops once step 'limit' has run (limit < 0: never)
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 1.9 * u[i] - 0.9 * v[i] + c * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    return limit < 0 or t < limit


KERNEL = lk.megakernel(damped_wave, swap=[("u", "v")])


def ref(u0, v0, c, steps):
    u, v = u0.astype(np.float64).copy(), v0.astype(np.float64).copy()
    for _ in range(steps):
        w = v.copy()
        w[1:-1] = 1.9 * u[1:-1] - 0.9 * v[1:-1] + c * (u[:-2] - 2 * u[1:-1] + u[2:])
        u, v = w, u
    return u, v


def check(u, v, u0, v0, c, steps):
    want_u, want_v = ref(u0, v0, c, steps)
    np.testing.assert_allclose(u, want_u, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(v, want_v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend,scope", BACKENDS)
@pytest.mark.parametrize("steps", [0, 1, 2, 5, 6])
def test_step_count(backend, scope, steps, rng):
    n = 40 if backend == "cuda" else 200
    u0, v0 = rng.random(n), rng.random(n)
    u, v = u0.copy(), v0.copy()
    run = KERNEL(u, v, 0.1, -1, steps=steps, backend=backend, scope=scope)
    assert run.steps == steps
    check(u, v, u0, v0, 0.1, steps)


@pytest.mark.parametrize("backend,scope", BACKENDS)
@pytest.mark.parametrize("limit", [2, 3])
def test_condition(backend, scope, limit, rng):
    n = 40 if backend == "cuda" else 200
    u0, v0 = rng.random(n), rng.random(n)
    u, v = u0.copy(), v0.copy()
    run = KERNEL(u, v, 0.1, limit, max_steps=50, backend=backend, scope=scope)
    assert (run.steps, run.stopped) == (limit + 1, "condition")
    check(u, v, u0, v0, 0.1, limit + 1)


@pytest.mark.parametrize("backend,scope", BACKENDS)
def test_timeout_and_cancel(backend, scope, rng):
    n = 40 if backend == "cuda" else 2000
    u0, v0 = rng.random(n), rng.random(n)
    u, v = u0.copy(), v0.copy()
    run = KERNEL(u, v, 0.05, -1, steps=10 ** 12, timeout=0.2, backend=backend, scope=scope)
    assert run.stopped == "timeout" and 0 < run.steps < 10 ** 12
    check(u, v, u0, v0, 0.05, run.steps)
    u, v = u0.copy(), v0.copy()
    handle = KERNEL.start(u, v, 0.05, -1, steps=10 ** 12, backend=backend, scope=scope)
    deadline = time.monotonic() + 30
    while handle.steps_done < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
    handle.cancel()
    run = handle.wait()
    assert run.stopped == "cancelled" and 3 <= run.steps < 10 ** 12
    check(u, v, u0, v0, 0.05, run.steps)
