"""Long runs: progress, start/cancel, timeouts, Ctrl-C, the watchdog and debug bounds checks,
on the CPU backend and the CUDA path under Numba's simulator."""

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import loopkern as lk
import refs
import workloads as W
from loopkern import runs

BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="sim", marks=pytest.mark.sim)]
# the simulator runs Python per thread: keep its problems small
SIZE = {"cpu": 2000, "cuda": 64}
THREADS = {"cpu": None, "cuda": 32}


def _heat():
    return lk.megakernel(W.heat_step, swap=[("u", "v")])


def _wait_for(cond, limit=60.0):
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def _check_heat_state(u, u0, steps, alpha):
    # the exact float64 solution after 'steps' steps (any count, in O(n log n))
    np.testing.assert_allclose(u, refs.heat_exact(u0, steps, alpha), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n", [3, 4, 50, 301])
def test_the_exact_heat_reference_equals_the_step_by_step_one(n, rng):
    u0 = rng.random(n)
    alpha = float(rng.uniform(0.05, 0.5))
    for steps in (0, 1, 2, int(rng.integers(3, 400))):
        np.testing.assert_allclose(refs.heat_exact(u0, steps, alpha), W.heat_ref(u0, steps, alpha),
                                   rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_progress_callback_is_monotone_and_reaches_the_total(backend, rng):
    n, steps = SIZE[backend], (300_000 if backend == "cpu" else 40)
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()
    seen = []
    run = _heat()(u, v, 0.2, steps=steps, backend=backend, threads=THREADS[backend],
                  progress=lambda done, total: seen.append((done, total)))
    assert run.steps == steps and run.stopped == "steps"
    assert seen[0] == (0, steps) and seen[-1] == (steps, steps)
    counts = [d for d, _ in seen]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    assert all(t == steps for _, t in seen)
    _check_heat_state(u, u0, steps, 0.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_progress_callback_that_raises_cancels_the_run_before_its_exception(backend, rng):
    """The callback's exception comes out of the call once the run it cancelled has stopped:
    nothing goes on writing the arrays behind it, and they hold the state after run.steps."""
    n = SIZE[backend]
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()

    def fails(done, total):
        if done > 0:
            raise RuntimeError("stop from the callback")
    with pytest.raises(RuntimeError, match="stop from the callback") as info:
        _heat()(u, v, 0.2, steps=10 ** 9, backend=backend, threads=THREADS[backend], progress=fails)
    run = info.value.loopkern_run
    assert run.stopped == "cancelled" and 0 < run.steps < 10 ** 9
    after = u.copy(), v.copy()
    time.sleep(0.2)
    np.testing.assert_array_equal(u, after[0])
    np.testing.assert_array_equal(v, after[1])
    _check_heat_state(u, u0, run.steps, 0.2)
    _check_heat_state(v, u0, run.steps - 1, 0.2)


def test_progress_of_a_while_loop_has_no_total(rng):
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = np.zeros((24, 24))
    u0[0, :] = rng.random(24)
    u0[1:-1, 1:-1] = rng.random((22, 22))
    u, v = u0.copy(), u0.copy()
    seen = []
    run = k(u, v, 1e-4, max_steps=100_000, backend="cpu", progress=lambda d, t: seen.append((d, t)))
    ref, ref_steps = W.jacobi_ref(u0, 1e-4, 100_000)
    assert (run.stopped, run.steps) == ("condition", ref_steps)
    np.testing.assert_allclose(u, ref, rtol=1e-12, atol=1e-14)
    assert seen[-1] == (run.steps, None) and all(t is None for _, t in seen)


def test_progress_true_without_tqdm_prints_a_line(rng, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)     # import tqdm -> ImportError
    u0 = rng.random(100)
    u, v = u0.copy(), u0.copy()
    _heat()(u, v, 0.2, steps=1000, backend="cpu", progress=True)
    err = capsys.readouterr().err
    assert "heat_step: 1000/1000 steps (100%)" in err and err.endswith("\n")
    _check_heat_state(u, u0, 1000, 0.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_stops_every_thread_at_one_step_with_swap_consistent(backend, rng):
    n = SIZE[backend]
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()
    h = _heat().start(u, v, 0.2, steps=10 ** 9, backend=backend, threads=THREADS[backend])
    _wait_for(lambda: h.steps_done >= 3)
    assert not h.done()
    h.cancel()
    run = h.wait()
    assert run.stopped == "cancelled" and 3 <= run.steps < 10 ** 9
    assert h.done() and h.steps_done == run.steps and h.wait() is run
    _check_heat_state(u, u0, run.steps, 0.2)     # the newest state is in the first buffer


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeout_stops_at_a_step_boundary(backend, rng):
    n = SIZE[backend]
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()
    run = _heat()(u, v, 0.2, steps=10 ** 9, backend=backend, threads=THREADS[backend], timeout=0.3)
    assert run.stopped == "timeout" and 0 < run.steps < 10 ** 9
    _check_heat_state(u, u0, run.steps, 0.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_timeout_below_a_nanosecond_still_stops_the_run(backend, rng):
    # the GPU control block holds whole nanoseconds, 0 meaning none: 1e-10 s became no timeout
    n = SIZE[backend]
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()
    run = _heat()(u, v, 0.2, steps=10 ** 9, backend=backend, threads=THREADS[backend], timeout=1e-10)
    assert run.stopped == "timeout" and run.steps < 10 ** 9
    _check_heat_state(u, u0, run.steps, 0.2)


def test_a_progress_callback_that_cannot_take_two_arguments_is_refused_before_anything_runs(rng):
    u0 = rng.random(50)
    u, v = u0.copy(), u0.copy()
    for bad in (lambda done: None, lambda done, total, extra: None, lambda *, k: None):
        with pytest.raises(lk.ArgumentError, match="it is called as f\\(steps_done, total\\)"):
            _heat()(u, v, 0.2, steps=5, backend="cpu", progress=bad)
    np.testing.assert_array_equal(u, u0)
    seen = []
    _heat()(u, v, 0.2, steps=5, backend="cpu", progress=lambda done, total=None, *rest: seen.append(done))
    assert seen[-1] == 5


def test_a_run_that_ends_first_is_not_cancelled(rng):
    u0 = rng.random(50)
    u, v = u0.copy(), u0.copy()
    h = _heat().start(u, v, 0.2, steps=7, backend="cpu")
    run = h.wait()
    h.cancel()
    assert h.wait() is run and run.stopped == "steps" and run.steps == 7
    _check_heat_state(u, u0, 7, 0.2)


def test_wait_with_a_timeout_raises_while_it_runs(rng):
    u0 = rng.random(2000)
    u, v = u0.copy(), u0.copy()
    h = _heat().start(u, v, 0.2, steps=10 ** 9, backend="cpu")
    with pytest.raises(TimeoutError, match="still running"):
        h.wait(timeout=0.05)
    assert "running" in repr(h)
    h.cancel()
    run = h.wait()
    assert run.stopped == "cancelled" and 0 < run.steps < 10 ** 9
    _check_heat_state(u, u0, run.steps, 0.2)



@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_on_memory_a_started_run_holds_is_refused_until_it_is_waited_for(backend, rng):
    """Two runs on the same memory would race silently (session 29): a call or a start whose
    array shares memory with one a kernel.start() run holds is an ArgumentError, raised before
    anything runs, naming both arguments; once wait() has finished the run, the memory is free.
    Other arrays stay usable meanwhile."""
    n = SIZE[backend]
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()
    k = _heat()
    h = k.start(u, v, 0.2, steps=10 ** 9, backend=backend, threads=THREADS[backend])
    _wait_for(lambda: h.steps_done >= 2)
    a, b = u0.copy(), u0.copy()
    with pytest.raises(lk.ArgumentError, match=r"argument 'u' shares memory with argument 'u' of a run of "
                                               r"'heat_step' started with kernel.start\(\)"):
        k(u, b, 0.2, steps=3, backend=backend, threads=THREADS[backend])
    with pytest.raises(lk.ArgumentError, match=r"argument 'u' shares memory with argument 'v'"):
        k.start(v[1:], b[1:], 0.2, steps=3, backend=backend, threads=THREADS[backend])
    np.testing.assert_array_equal(b, u0)         # refused before anything ran
    if backend == "cpu":        # (Numba's simulator cannot run two kernels at once)
        k(a, b, 0.2, steps=5, backend=backend)      # other memory: runs meanwhile
        _check_heat_state(a, u0, 5, 0.2)
    h.cancel()
    run = h.wait()
    _check_heat_state(u, u0, run.steps, 0.2)
    run2 = k(u, v, 0.2, steps=4, start=run.steps, backend=backend, threads=THREADS[backend])
    assert run2.steps == 4
    _check_heat_state(u, u0, run.steps + 4, 0.2)

def test_ctrl_c_cancels_the_kernel_and_reraises(rng):
    u0 = rng.random(2000)
    u, v = u0.copy(), u0.copy()
    heat = _heat()
    # compiled first: on a loaded machine the compile can outlast the timer, and Ctrl-C then
    # interrupts the compile, not the run
    heat(u0.copy(), u0.copy(), 0.2, steps=1, backend="cpu")
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt) as info:
        heat(u, v, 0.2, steps=10 ** 9, backend="cpu")
    run = info.value.loopkern_run
    assert run.stopped == "cancelled" and 0 < run.steps < 10 ** 9
    if sys.version_info >= (3, 11):     # exceptions take notes from 3.11 on
        assert any(f"cancelled after {run.steps} steps" in note for note in info.value.__notes__)
    _check_heat_state(u, u0, run.steps, 0.2)


def _spin_for(seconds):
    """Iterations of busy_step's inner loop that take at least about ``seconds`` here (the
    fastest of three timings: a loaded machine then only makes the step slower)."""
    k = lk.megakernel(W.busy_step)
    x = np.zeros(2)
    k(x, 0, 10, steps=1, backend="cpu")          # compile
    per = []
    for _ in range(3):
        t0 = time.perf_counter()
        k(x, 0, 2_000_000, steps=1, backend="cpu")
        per.append((time.perf_counter() - t0) / 2_000_000)
    return max(int(seconds / min(per)), 1000)


def test_watchdog_cancels_a_step_slower_than_its_interval(rng):
    k = lk.megakernel(W.busy_step)
    x0 = np.array([float(rng.integers(0, 1000)), rng.random()])
    x = x0.copy()
    spin = _spin_for(1.0)
    with pytest.raises(lk.HangError, match="a step takes longer than the watchdog") as info:
        k(x, 3, spin, steps=10 ** 6, backend="cpu", watchdog=0.2)
    run = info.value.run
    assert run.stopped == "cancelled" and 3 < run.steps < 10
    np.testing.assert_allclose(x, refs.busy_ref(x0, run.steps, 3, spin), rtol=1e-9)


def test_watchdog_reports_a_step_that_does_not_stop(monkeypatch, rng):
    monkeypatch.setattr(runs, "WATCHDOG_GRACE_S", 0.05)
    k = lk.megakernel(W.busy_step)
    x0 = np.array([float(rng.integers(0, 1000)), rng.random()])
    x = x0.copy()
    spin = _spin_for(1.5)
    h = k.start(x, 2, spin, steps=10 ** 6, backend="cpu", watchdog=0.2)
    with pytest.raises(lk.HangError, match="did not stop within") as info:
        h.wait()
    assert info.value.run is None
    run = h.wait()             # the watchdog reports once; the cancelled run then ends
    assert run.stopped == "cancelled" and 2 < run.steps < 10
    np.testing.assert_allclose(x, refs.busy_ref(x0, run.steps, 2, spin), rtol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_reports_an_out_of_bounds_store_without_making_it(backend, rng):
    n = SIZE[backend]
    k = lk.megakernel(W.oob_step)
    u = rng.random(n)
    buf = np.full(n + 8, 7.0)
    v = buf[:n]                # the memory just past v must stay untouched
    with pytest.raises(lk.BoundsError) as info:
        k(u, v, 1, steps=50, backend=backend, threads=THREADS[backend], debug=True)
    msg = str(info.value)
    line = W.oob_step.__code__.co_firstlineno + 5
    assert f"workloads.py:{line}:9: in step 'oob_step': out-of-bounds store to 'v' at step t=2" in msg
    assert f"index ({n},) is outside shape ({n},)" in msg
    assert "v[j] = u[i] * 0.5" in msg and "\n            ^" in msg
    assert np.all(buf[n:] == 7.0)
    np.testing.assert_array_equal(v[1:], u[:-1] * 0.5)    # step 2's in-bounds stores were made


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["call", "start"])
def test_debug_reports_an_out_of_bounds_access_in_the_last_step(backend, how, rng):
    # no step boundary follows the offence, so nothing stops the run for it: the record must
    # still be read when the run ends for any other reason (its step count here)
    n = SIZE[backend]
    k = lk.megakernel(W.oob_step)
    u = rng.random(n)
    buf = np.full(n + 8, 7.0)
    v = buf[:n]
    with pytest.raises(lk.BoundsError, match="out-of-bounds store to 'v' at step t=2"):
        if how == "call":
            k(u, v, 1, steps=1, start=2, backend=backend, threads=THREADS[backend], debug=True)
        else:
            k.start(u, v, 1, steps=1, start=2, backend=backend, threads=THREADS[backend], debug=True).wait()
    assert np.all(buf[n:] == 7.0)
    # a clean debug run on the same plan afterwards reports nothing
    run = k(u, v, 1, steps=2, backend=backend, threads=THREADS[backend], debug=True)
    assert run.steps == 2 and run.stopped == "steps"


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_reports_an_out_of_bounds_load_in_a_helper(backend, rng):
    n = SIZE[backend]
    k = lk.megakernel(W.oob_helper_step)
    u = rng.random(n)
    v = np.zeros(n)
    with pytest.raises(lk.BoundsError) as info:
        k(u, v, steps=4, backend=backend, threads=THREADS[backend], debug=True)
    msg = str(info.value)
    line = W.peek.__code__.co_firstlineno + 1
    assert f"workloads.py:{line}:12: in step 'oob_helper_step': in helper 'peek': out-of-bounds load from 'u' " \
           f"at step t=0 by thread {0 if backend == 'cpu' else (n - 1) % THREADS[backend]}: index ({n},)" in msg
    assert "The load read element 0 instead" in msg
    np.testing.assert_array_equal(v, np.append(u[1:], u[0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_gives_the_same_results(backend, rng):
    n = SIZE[backend]
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()
    run = _heat()(u, v, 0.2, steps=5, backend=backend, threads=THREADS[backend], debug=True)
    assert run.stopped == "steps"
    _check_heat_state(u, u0, 5, 0.2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(progress=3), "progress=3: expected True, False or a callable"),
    (dict(timeout=0), "timeout=0: expected a positive number of seconds"),
    (dict(timeout=-1.0), "timeout=-1.0"),
    (dict(timeout="1"), "timeout='1'"),
    (dict(watchdog=float("nan")), "watchdog=nan"),
    (dict(debug=1), "debug=1: expected True or False"),
])
def test_bad_run_control_arguments(kwargs, match, rng):
    u0 = rng.random(20)
    u, v = u0.copy(), u0.copy()
    with pytest.raises(lk.ArgumentError, match=match):
        _heat()(u, v, 0.2, steps=3, backend="cpu", **kwargs)
    with pytest.raises(lk.ArgumentError, match=match):
        _heat().start(u, v, 0.2, steps=3, backend="cpu", **kwargs)
    np.testing.assert_array_equal(u, u0)


@pytest.mark.parametrize("count", [2 ** 63, 2 ** 64 - 1, 2 ** 64, 10 ** 30])
def test_a_step_count_beyond_int64_is_an_argument_error(count, rng):
    # (a raw OverflowError from the kernel's entry before session 28; sys.maxsize runs)
    u0 = rng.random(20)
    u, v = u0.copy(), u0.copy()
    with pytest.raises(lk.ArgumentError, match=rf"steps={count}: must be at most {2 ** 63 - 1}"):
        _heat()(u, v, 0.2, steps=count, backend="cpu")
    with pytest.raises(lk.ArgumentError, match=rf"steps={count}: must be at most"):
        _heat().start(u, v, 0.2, steps=count, backend="cpu")
    np.testing.assert_array_equal(u, u0)
    run = _heat()(u, v, 0.2, steps=sys.maxsize, backend="cpu", timeout=0.05)
    assert run.stopped == "timeout" and run.steps > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_thread_step_stops_exactly_where_it_says(backend, rng):
    # no parallel construct: scope "auto" runs one thread, which polls every few steps
    k = lk.megakernel(W.count_step)
    c0 = np.array([float(rng.integers(0, 1000)), rng.random() * 10])
    c = c0.copy()
    h = k.start(c, 10 ** 12, 0, steps=10 ** 9, backend=backend)
    _wait_for(lambda: h.steps_done > 0)
    h.cancel()
    run = h.wait(timeout=30)
    assert run.stopped == "cancelled" and 0 < run.steps < 10 ** 9
    np.testing.assert_array_equal(c, refs.count_ref(c0, run.steps, 10 ** 12, 0))
    c = c0.copy()
    slow_at = int(rng.integers(1, 6))
    run = k(c, slow_at, 3, steps=10 ** 9, backend=backend, timeout=0.2)
    assert run.stopped == "timeout" and run.steps > slow_at
    np.testing.assert_array_equal(c, refs.count_ref(c0, run.steps, slow_at, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_no_poll_baseline_runs_every_step_without_polling(backend, rng):
    # _control=False is bench.py's baseline for the poll's cost; a one-thread kernel honours it too
    from loopkern import codegen
    k = lk.megakernel(W.count_step)
    src = codegen.render_kernel(k.spec, "cuda", "thread", cache=False, control=False).text
    assert "_lk_rt.poll" not in src
    assert "_lk_rt.poll" in codegen.render_kernel(k.spec, "cuda", "thread", cache=False, control=True).text
    c0 = np.array([float(rng.integers(0, 1000)), rng.random() * 10])
    c = c0.copy()
    slow_at = int(rng.integers(0, 500))
    run = k(c, slow_at, 2, steps=500, backend=backend, _control=False)
    assert (run.steps, run.stopped) == (500, "steps")
    np.testing.assert_array_equal(c, refs.count_ref(c0, 500, slow_at, 2))


def _int_of(t, u, x):
    for i in lk.range(u.shape[0]):
        u[i] = int(x) + u[i]


@pytest.mark.sim
@pytest.mark.parametrize("how", ["call", "start"])
def test_a_step_that_raises_in_the_simulator_is_a_step_error(how):
    """Numba's CUDA simulator follows NumPy's scalar rules, so int(nan) raises there (the GPU
    computes a value): that is an lk.StepError with the exception as its cause, NumPy
    arguments are left as they were, and the next call runs (the slot was given back). Before
    session 36 the ValueError came out raw."""
    k = lk.megakernel(_int_of)
    u = np.arange(4.0)
    with pytest.raises(lk.StepError, match=r"raised ValueError .*Numba's CUDA simulator") as ei:
        if how == "call":
            k(u, float("nan"), steps=3, backend="cuda")
        else:
            k.start(u, float("nan"), steps=3, backend="cuda").wait()
    assert isinstance(ei.value.__cause__, ValueError)
    assert ei.value.run.stopped == "error"
    np.testing.assert_array_equal(u, np.arange(4.0))
    for _ in range(3):          # more calls than the plan has slots: each failed run gave its slot back
        with pytest.raises(lk.StepError):
            k(u, float("inf"), steps=1, backend="cuda")
    run = k(u, 2.0, steps=3, backend="cuda")
    assert run.steps == 3
    np.testing.assert_array_equal(u, np.arange(4.0) + 6)


@pytest.mark.parametrize("how", ["call", "start"])
@pytest.mark.parametrize("bad_at", [0, 3, 4])
def test_a_step_that_raises_stops_the_run_with_the_state_of_the_steps_before(how, bad_at, rng):
    """A debug=True CPU kernel keeps Python's error model: a division by zero at step bad_at
    raises lk.StepError (the ZeroDivisionError its cause) with the Run of the steps completed
    before it, the swap pair in the rename rule's order (odd counts too), and the slot back
    for the next call. Before session 28 the ZeroDivisionError came out raw with the second
    buffer holding the newest state."""
    k = lk.megakernel(W.failing_step, swap=[("u", "v")])
    x = rng.normal(size=5)
    u, v, w = x.copy(), x.copy(), np.zeros(5)
    with pytest.raises(lk.StepError, match=rf"ZeroDivisionError.*at step t={bad_at + 2}.*after {bad_at} complete") as ei:
        if how == "call":
            k(u, v, w, bad_at + 2, steps=10, start=2, backend="cpu", debug=True)
        else:
            k.start(u, v, w, bad_at + 2, steps=10, start=2, backend="cpu", debug=True).wait()
    assert isinstance(ei.value.__cause__, ZeroDivisionError)
    assert ei.value.run is ei.value.loopkern_run
    assert (ei.value.run.steps, ei.value.run.stopped, ei.value.run.start) == (bad_at, "error", 2)
    np.testing.assert_allclose(u, x + bad_at, rtol=1e-15)
    # w is written in place: the failing step had updated elements 0 and 1 before it raised
    np.testing.assert_array_equal(w, [bad_at + 1, bad_at + 1] + [bad_at] * 3)
    u, v, w = x.copy(), x.copy(), np.zeros(5)
    run = k(u, v, w, -1, steps=3, backend="cpu", debug=True)
    assert run.steps == 3 and np.allclose(u, x + 3)
