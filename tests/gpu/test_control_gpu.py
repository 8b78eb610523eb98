"""GPU tests of long runs: progress, cancellation, timeouts, Ctrl-C and debug bounds checks.

Run on a machine with a CUDA GPU: ``python -m pytest -m gpu`` (see tests/conftest.py). The
measured numbers (cancellation latency, progress updates) are printed for the log; bench.py
measures the overheads. Runs that stop after millions of steps are checked against closed
forms (tests/refs.py): the shift step exactly, the heat stencil through its exact solution.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest

import loopkern as lk
import refs
import workloads as W

pytestmark = pytest.mark.gpu
HEAT = lk.megakernel(W.heat_step, swap=[("u", "v")])
SHIFT = lk.megakernel(refs.shift_step, swap=[("u", "v")])


def _device(a):
    from numba import cuda
    return cuda.to_device(a)


def _steps_per_second(k, du, dv, *args, **kw):
    k(du, dv, *args, steps=1000, backend="cuda", **kw)          # compile, warm up
    t0 = time.perf_counter()
    k(du, dv, *args, steps=20000, backend="cuda", **kw)
    return 20000 / (time.perf_counter() - t0)


def _ints(rng, n):
    # integer values in float64: the shift step's closed form stays exact for 2**52 steps
    return rng.integers(-10 ** 6, 10 ** 6, n).astype(np.float64)


def test_progress_from_a_ten_second_run(rng):
    u0 = _ints(rng, 65536)
    du, dv = _device(u0), _device(u0)
    steps = int(10 * _steps_per_second(SHIFT, du, dv))
    du.copy_to_device(u0)
    dv.copy_to_device(u0)
    seen = []
    t0 = time.perf_counter()
    run = SHIFT(du, dv, steps=steps, backend="cuda",
                progress=lambda d, t: seen.append((time.perf_counter() - t0, d, t)))
    elapsed = time.perf_counter() - t0
    print(f"progress: {len(seen)} updates over {elapsed:.2f} s for {steps} steps")
    assert run.steps == steps and run.stopped == "steps" and elapsed > 5
    np.testing.assert_array_equal(du.copy_to_host(), refs.shift_ref(u0, steps))
    counts = [d for _, d, _ in seen]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == steps
    assert all(t == steps for _, _, t in seen)
    # live: updates all along the run, not only at the end
    assert len(seen) >= 30
    mid = [d for s, d, _ in seen if 0.4 * elapsed < s < 0.6 * elapsed]
    assert mid and 0.2 * steps < mid[0] < 0.8 * steps


@pytest.mark.parametrize("scope,blocks", [("grid", None), ("grid", 7), ("block", None)])
def test_cancel_a_sixty_second_run_within_100_ms(scope, blocks, rng):
    n = 65536 if scope == "grid" else 4096
    u0 = _ints(rng, n)
    du, dv = _device(u0), _device(u0)
    steps = int(60 * _steps_per_second(SHIFT, du, dv, scope=scope, blocks=blocks))
    du.copy_to_device(u0)
    dv.copy_to_device(u0)
    h = SHIFT.start(du, dv, steps=steps, backend="cuda", scope=scope, blocks=blocks)
    time.sleep(1.0)
    assert not h.done() and h.steps_done > 0
    t0 = time.perf_counter()
    h.cancel()
    run = h.wait()
    latency = time.perf_counter() - t0
    print(f"cancel ({scope}, blocks={run.blocks}): {latency * 1e3:.2f} ms after {run.steps} of {steps} steps")
    assert run.stopped == "cancelled" and 0 < run.steps < steps
    assert latency < 0.1
    if blocks:
        assert run.blocks == blocks
    # every thread stopped after the same step, and the newest state is in the first buffer
    np.testing.assert_array_equal(du.copy_to_host(), refs.shift_ref(u0, run.steps))


def test_cancel_heat_in_one_block_matches_the_exact_solution(rng):
    # the heat stencil on 4096 elements, ends 0 and 0.1 and the rest in [0, 1): the slowest mode
    # has amplitude ~0.5 and moves by ~1e-7 of it per step, so in float64 one step more or less
    # after ~10^6 steps is still far outside the tolerance
    u0 = rng.random(4096)
    u0[0], u0[-1] = 0.0, 0.1
    du, dv = _device(u0), _device(u0)
    HEAT(du, dv, 0.2, steps=10, backend="cuda", scope="block")      # compile
    du.copy_to_device(u0)
    dv.copy_to_device(u0)
    h = HEAT.start(du, dv, 0.2, steps=10 ** 10, backend="cuda", scope="block")
    time.sleep(0.5)
    h.cancel()
    run = h.wait()
    assert run.stopped == "cancelled" and 0 < run.steps < 10 ** 10
    np.testing.assert_allclose(du.copy_to_host(), refs.heat_exact(u0, run.steps, 0.2), rtol=1e-9, atol=1e-12)


def _compiled_and_fresh(u0):
    """Device copies of u0 after a first run (so compile time stays out of what is timed)."""
    du, dv = _device(u0), _device(u0)
    SHIFT(du, dv, steps=10, backend="cuda")
    du.copy_to_device(u0)
    dv.copy_to_device(u0)
    return du, dv


def test_timeout_stops_at_a_step_boundary(rng):
    u0 = _ints(rng, 4096)
    du, dv = _compiled_and_fresh(u0)
    t0 = time.perf_counter()
    run = SHIFT(du, dv, steps=10 ** 10, backend="cuda", timeout=0.5)
    elapsed = time.perf_counter() - t0
    print(f"timeout=0.5: returned after {elapsed:.3f} s, {run.steps} steps")
    assert run.stopped == "timeout" and 0 < run.steps < 10 ** 10
    assert 0.5 <= elapsed < 1.5
    np.testing.assert_array_equal(du.copy_to_host(), refs.shift_ref(u0, run.steps))


def test_ctrl_c_cancels_the_kernel(rng):
    u0 = _ints(rng, 65536)
    du, dv = _compiled_and_fresh(u0)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt) as info:
        SHIFT(du, dv, steps=10 ** 10, backend="cuda")
    run = info.value.loopkern_run
    assert run.stopped == "cancelled" and run.steps > 0
    np.testing.assert_array_equal(du.copy_to_host(), refs.shift_ref(u0, run.steps))


@pytest.mark.parametrize("scope", ["grid", "block"])
def test_debug_reports_a_planted_out_of_bounds_write(scope, rng):
    n = 100_000 if scope == "grid" else 3000
    k = lk.megakernel(W.oob_step)
    u = rng.random(n)
    buf = _device(np.full(n + 64, 7.0))
    v = buf[:n]
    with pytest.raises(lk.BoundsError) as info:
        k(_device(u), v, 1, steps=100, backend="cuda", scope=scope, debug=True)
    msg = str(info.value)
    print(msg)
    assert "out-of-bounds store to 'v' at step t=2 by thread " in msg and f"index ({n},) is outside shape ({n},)" in msg
    host = buf.copy_to_host()
    assert np.all(host[n:] == 7.0)                      # nothing written past the end
    # step 2's in-bounds stores were made (v[i + 1] = u[i] / 2); v[0] keeps step 1's u[0] / 2
    np.testing.assert_array_equal(host[:n], np.concatenate([[u[0] * 0.5], u[:-1] * 0.5]))


@pytest.mark.parametrize("blocks", [None, 3])
def test_random_numbers_on_the_gpu_match_an_independent_philox(blocks, rng):
    import test_random as R
    n, steps = 50_000, 3
    call = R._random_call(rng)
    ref_u, ref_z = R.reference_draws(n=n, steps=steps, **call)
    da, db = _device(np.zeros((steps, n))), _device(np.zeros((steps, n, 2)))
    run = R.DRAWS(call["start"], call["koff"], call["sub"], da, db, steps=steps, start=call["start"],
                  backend="cuda", seed=call["seed"], blocks=blocks, threads=64 if blocks else None)
    assert run.blocks > 1
    if blocks:
        assert run.blocks == blocks
    np.testing.assert_array_equal(da.copy_to_host(), ref_u)          # uniform: bit for bit
    # normal: CUDA's log and cos may round the last bit differently from NumPy's
    np.testing.assert_allclose(db.copy_to_host(), ref_z, rtol=1e-13, atol=1e-14)
    # on the GPU itself, the draws do not depend on the launch shape
    dc = _device(np.zeros((steps, n, 2)))
    R.DRAWS(call["start"], call["koff"], call["sub"], _device(np.zeros((steps, n))), dc, steps=steps,
            start=call["start"], backend="cuda", seed=call["seed"], scope="block")
    np.testing.assert_array_equal(dc.copy_to_host(), db.copy_to_host())


def test_one_thread_kernel_polls_fast_and_slow_steps(rng):
    # scope "auto" is "thread" here: one thread, a poll every few steps
    k = lk.megakernel(W.count_step)
    c0 = np.array([float(rng.integers(0, 1000)), rng.random() * 10])
    c = _device(c0)
    k(c, 10 ** 12, 0, steps=10, backend="cuda")          # compile
    c.copy_to_device(c0)
    h = k.start(c, 10 ** 12, 0, steps=10 ** 12, backend="cuda")
    time.sleep(0.5)
    assert not h.done() and h.steps_done > 0
    t0 = time.perf_counter()
    h.cancel()
    run = h.wait()
    latency = time.perf_counter() - t0
    print(f"cancel (thread): {latency * 1e3:.2f} ms after {run.steps} steps")
    assert run.scope == "thread" and run.stopped == "cancelled" and latency < 0.1
    np.testing.assert_array_equal(c.copy_to_host(), refs.count_ref(c0, run.steps, 10 ** 12, 0))
    # fast steps first, then slow ones: the stride grown on the fast steps shrinks again
    c.copy_to_device(c0)
    t0 = time.perf_counter()
    run = k(c, 200_000, 20_000, steps=10 ** 12, backend="cuda", timeout=0.5)
    elapsed = time.perf_counter() - t0
    print(f"timeout=0.5 (thread, steps slow after 200000): returned after {elapsed:.3f} s, {run.steps} steps")
    assert run.stopped == "timeout" and run.steps > 200_000
    np.testing.assert_array_equal(c.copy_to_host(), refs.count_ref(c0, run.steps, 200_000, 20_000))
    assert 0.5 <= elapsed < 1.5
