"""GPU tests of long runs: progress, cancellation, timeouts, Ctrl-C and debug bounds checks.

Run on a machine with a CUDA GPU: ``python -m pytest -m gpu``. Skipped elsewhere. The measured
numbers (cancellation latency, progress updates) are printed for the log; bench.py measures
the overheads.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest

import loopkern as lk
import workloads as W

pytestmark = pytest.mark.gpu
HEAT = lk.megakernel(W.heat_step, swap=[("u", "v")])


def _device(a):
    from numba import cuda
    return cuda.to_device(a)


def _steps_per_second(du, dv):
    HEAT(du, dv, 0.2, steps=1000, backend="cuda")          # compile, warm up
    t0 = time.perf_counter()
    HEAT(du, dv, 0.2, steps=20000, backend="cuda")
    return 20000 / (time.perf_counter() - t0)


def test_progress_from_a_ten_second_run(rng):
    u0 = rng.random(65536)
    du, dv = _device(u0), _device(u0)
    steps = int(10 * _steps_per_second(du, dv))
    seen = []
    t0 = time.perf_counter()
    run = HEAT(du, dv, 0.2, steps=steps, backend="cuda",
               progress=lambda d, t: seen.append((time.perf_counter() - t0, d, t)))
    elapsed = time.perf_counter() - t0
    print(f"progress: {len(seen)} updates over {elapsed:.2f} s for {steps} steps")
    assert run.steps == steps and run.stopped == "steps" and elapsed > 5
    counts = [d for _, d, _ in seen]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == steps
    assert all(t == steps for _, _, t in seen)
    # live: updates all along the run, not only at the end
    assert len(seen) >= 30
    mid = [d for s, d, _ in seen if 0.4 * elapsed < s < 0.6 * elapsed]
    assert mid and 0.2 * steps < mid[0] < 0.8 * steps


@pytest.mark.parametrize("scope", ["grid", "block"])
def test_cancel_a_sixty_second_run_within_100_ms(scope, rng):
    u0 = rng.random(65536 if scope == "grid" else 4096)
    du, dv = _device(u0), _device(u0)
    steps = int(60 * _steps_per_second(du, dv))
    du.copy_to_device(u0)
    dv.copy_to_device(u0)
    h = HEAT.start(du, dv, 0.2, steps=steps, backend="cuda", scope=scope)
    time.sleep(1.0)
    assert not h.done() and h.steps_done > 0
    t0 = time.perf_counter()
    h.cancel()
    run = h.wait()
    latency = time.perf_counter() - t0
    print(f"cancel ({scope}): {latency * 1e3:.2f} ms after {run.steps} of {steps} steps")
    assert run.stopped == "cancelled" and 0 < run.steps < steps
    assert latency < 0.1
    u = du.copy_to_host()
    if run.steps <= 300_000 and u0.size <= 4096:
        np.testing.assert_allclose(u, W.heat_ref(u0, run.steps, 0.2), rtol=1e-9, atol=1e-12)
    else:
        # the exact state after run.steps: the same kernel run for that many steps from the start
        a, b = _device(u0), _device(u0)
        HEAT(a, b, 0.2, steps=run.steps, backend="cuda", scope=scope)
        np.testing.assert_array_equal(u, a.copy_to_host())


def _compiled_and_fresh(u0):
    """Device copies of u0 after a first run (so compile time stays out of what is timed)."""
    du, dv = _device(u0), _device(u0)
    HEAT(du, dv, 0.2, steps=10, backend="cuda")
    du.copy_to_device(u0)
    dv.copy_to_device(u0)
    return du, dv


def test_timeout_stops_at_a_step_boundary(rng):
    u0 = rng.random(4096)
    du, dv = _compiled_and_fresh(u0)
    t0 = time.perf_counter()
    run = HEAT(du, dv, 0.2, steps=10 ** 10, backend="cuda", timeout=0.5)
    elapsed = time.perf_counter() - t0
    print(f"timeout=0.5: returned after {elapsed:.3f} s, {run.steps} steps")
    assert run.stopped == "timeout" and 0 < run.steps < 10 ** 10
    assert 0.5 <= elapsed < 1.5
    a, b = _device(u0), _device(u0)
    HEAT(a, b, 0.2, steps=run.steps, backend="cuda")
    np.testing.assert_array_equal(du.copy_to_host(), a.copy_to_host())


def test_ctrl_c_cancels_the_kernel(rng):
    u0 = rng.random(65536)
    du, dv = _compiled_and_fresh(u0)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt) as info:
        HEAT(du, dv, 0.2, steps=10 ** 10, backend="cuda")
    run = info.value.loopkern_run
    assert run.stopped == "cancelled" and run.steps > 0
    a, b = _device(u0), _device(u0)
    HEAT(a, b, 0.2, steps=run.steps, backend="cuda")
    np.testing.assert_array_equal(du.copy_to_host(), a.copy_to_host())


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


@pytest.mark.parametrize("blocks", [None, 3])
def test_random_numbers_are_the_same_on_the_gpu_and_the_cpu(blocks):
    import test_random as R
    n, steps = 50_000, 3
    a, b = np.zeros((steps, n)), np.zeros((steps, n, 2))
    R.DRAWS(a, b, steps=steps, backend="cpu", seed=11)
    da, db = _device(np.zeros((steps, n))), _device(np.zeros((steps, n, 2)))
    run = R.DRAWS(da, db, steps=steps, backend="cuda", seed=11, blocks=blocks, threads=64 if blocks else None)
    assert run.blocks == (blocks or run.blocks) and run.blocks > 1
    np.testing.assert_array_equal(da.copy_to_host(), a)          # uniform: bit for bit
    # normal: CUDA's log and cos may round the last bit differently from the CPU's
    np.testing.assert_allclose(db.copy_to_host(), b, rtol=4e-15, atol=1e-15)
    # on the GPU itself, the draws do not depend on the launch shape
    dc = _device(np.zeros((steps, n, 2)))
    R.DRAWS(_device(np.zeros((steps, n))), dc, steps=steps, backend="cuda", seed=11, scope="block")
    np.testing.assert_array_equal(dc.copy_to_host(), db.copy_to_host())


def test_one_thread_kernel_polls_fast_and_slow_steps():
    # scope "auto" is "thread" here: one thread, a poll every few steps
    k = lk.megakernel(W.count_step)
    zero = np.zeros(2)
    c = _device(zero)
    k(c, 10 ** 12, 0, steps=10, backend="cuda")          # compile
    c.copy_to_device(zero)
    h = k.start(c, 10 ** 12, 0, steps=10 ** 12, backend="cuda")
    time.sleep(0.5)
    assert not h.done() and h.steps_done > 0
    t0 = time.perf_counter()
    h.cancel()
    run = h.wait()
    latency = time.perf_counter() - t0
    print(f"cancel (thread): {latency * 1e3:.2f} ms after {run.steps} steps")
    assert run.scope == "thread" and run.stopped == "cancelled"
    assert c.copy_to_host()[0] == run.steps and latency < 0.1
    # fast steps first, then slow ones: the stride grown on the fast steps shrinks again
    c.copy_to_device(zero)
    t0 = time.perf_counter()
    run = k(c, 200_000, 20_000, steps=10 ** 12, backend="cuda", timeout=0.5)
    elapsed = time.perf_counter() - t0
    print(f"timeout=0.5 (thread, steps slow after 200000): returned after {elapsed:.3f} s, {run.steps} steps")
    assert run.stopped == "timeout" and run.steps > 200_000 and c.copy_to_host()[0] == run.steps
    assert 0.5 <= elapsed < 1.5
