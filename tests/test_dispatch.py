"""The call path: launch plans cached per call signature, the checks that stay per call, and
blocking CPU calls in the calling thread (paused and continued, with the same result), on the
CPU backend and the CUDA path under Numba's simulator. Every result is checked against a
float64 NumPy reference."""

import threading

import numpy as np
import pytest

import loopkern as lk
import interp
import refs
import workloads as W
from loopkern import runs
from loopkern.dispatch import dispatcher as dispatch_mod
from loopkern.runtime import layout

BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="sim", marks=pytest.mark.sim)]
SIZE = {"cpu": 3000, "cuda": 64}
THREADS = {"cpu": None, "cuda": 32}


def _heat():
    return lk.megakernel(W.heat_step, swap=[("u", "v")])


def _device(backend, a):
    if backend == "cpu":
        return a
    from numba import cuda
    return cuda.to_device(a)


def _host(backend, a):
    return a if backend == "cpu" else a.copy_to_host()


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_with_one_signature_share_a_plan_and_each_gets_its_own_values(backend, rng):
    k = _heat()
    n = SIZE[backend]
    for call in range(6):
        u0 = rng.random(n).astype(np.float32)
        alpha = float(rng.uniform(0.05, 0.45))
        steps = int(rng.integers(1, 40))
        start = int(rng.integers(0, 10 ** 6))
        u, v = _device(backend, u0.copy()), _device(backend, u0.copy())
        run = k(u, v, alpha, steps=steps, start=start, backend=backend, threads=THREADS[backend])
        assert (run.steps, run.stopped, run.start) == (steps, "steps", start)
        np.testing.assert_allclose(_host(backend, u), refs.heat_exact(u0, steps, np.float32(alpha)),
                                   rtol=2e-5, atol=2e-6)
        assert len(k.dispatcher.plans) == 1, "a second plan for the same signature"
    # a new shape, dtype or kind of number is a new signature
    u = _device(backend, rng.random(n + 1).astype(np.float32))
    k(u, _device(backend, _host(backend, u).copy()), 0.25, steps=2, backend=backend, threads=THREADS[backend])
    u = _device(backend, rng.random(n))
    k(u, _device(backend, _host(backend, u).copy()), 0.25, steps=2, backend=backend, threads=THREADS[backend])
    assert len(k.dispatcher.plans) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_warm_plan_still_refuses_bad_calls_before_writing_anything(backend, rng):
    k = _heat()
    n = SIZE[backend]
    u0 = rng.random(n).astype(np.float32)
    u, v = _device(backend, u0.copy()), _device(backend, u0.copy())
    k(u, v, 0.25, steps=1, backend=backend, threads=THREADS[backend])
    pristine = _host(backend, u).copy()
    opts = dict(backend=backend, threads=THREADS[backend])
    with pytest.raises(lk.ArgumentError, match="share memory"):
        k(u, u, 0.25, steps=1, **opts)
    with pytest.raises(lk.ArgumentError, match="swap pair"):
        k(u, _device(backend, np.zeros(n + 1, np.float32)), 0.25, steps=1, **opts)
    with pytest.raises(lk.ArgumentError, match="argument 'alpha'"):
        k(u, v, np.zeros(3), steps=1, **opts)
    with pytest.raises(lk.ArgumentError, match="steps=-1"):
        k(u, v, 0.25, steps=-1, **opts)
    with pytest.raises(lk.ArgumentError, match="start="):
        k(u, v, 0.25, steps=1, start=-5, **opts)
    with pytest.raises(lk.ArgumentError, match="seed="):
        k(u, v, 0.25, steps=1, seed=2 ** 64, **opts)
    with pytest.raises(lk.ArgumentError, match="watchdog="):
        k(u, v, 0.25, steps=1, watchdog=0.0, **opts)
    np.testing.assert_array_equal(_host(backend, u), pristine)


def test_overlapping_views_of_one_buffer_are_refused_by_a_warm_plan(rng):
    k = _heat()
    n = 500
    big = rng.random(2 * n + 1)
    a, b = big[:n].copy(), big[n:2 * n].copy()
    k(a, b, 0.25, steps=1, backend="cpu")                   # warm, with separate buffers
    # same shape, dtype and strides as the warm call, but the two overlap
    with pytest.raises(lk.ArgumentError, match="share memory"):
        k(big[:n], big[1:n + 1], 0.25, steps=1, backend="cpu")
    np.testing.assert_array_equal(big, big.copy())
    assert len(k.dispatcher.plans) == 1


def test_an_integer_outside_int64_is_refused_by_a_warm_plan(rng):
    k = lk.megakernel(W.counter_step, swap=[("a", "b")])
    a0 = rng.integers(0, 100, 50).astype(np.int64)
    a, b = a0.copy(), a0.copy()
    k(a, b, 7, steps=3, backend="cpu")
    np.testing.assert_array_equal(a, W.counter_ref(a0, 3, 7))
    with pytest.raises(lk.ArgumentError, match="does not fit in int64"):
        k(a, b, 2 ** 63, steps=1, backend="cpu")
    np.testing.assert_array_equal(a, W.counter_ref(a0, 3, 7))


def test_a_read_only_array_misses_the_plan_and_is_refused(rng):
    k = _heat()
    u0 = rng.random(100)
    u, v = u0.copy(), u0.copy()
    k(u, v, 0.25, steps=1, backend="cpu")
    ro = u0.copy()
    ro.flags.writeable = False
    with pytest.raises(lk.ArgumentError, match="read-only"):
        k(ro, v, 0.25, steps=1, backend="cpu")


def test_the_plan_cache_is_bounded(rng):
    k = _heat()
    for n in range(5, 5 + dispatch_mod.PlanCache().size + 6):
        u0 = rng.random(n)
        u, v = u0.copy(), u0.copy()
        k(u, v, 0.2, steps=3, backend="cpu")
        np.testing.assert_allclose(u, refs.heat_exact(u0, 3, 0.2), rtol=1e-12, atol=1e-14)
    assert len(k.dispatcher.plans) == dispatch_mod.PlanCache().size


def test_a_blocking_cpu_call_starts_no_thread(monkeypatch, rng):
    k = _heat()
    u0 = rng.random(400)
    u, v = u0.copy(), u0.copy()
    k(u, v, 0.25, steps=1, backend="cpu")            # compile; the ticker thread starts once

    def no_thread(*a, **kw):
        raise AssertionError("a blocking call without progress= started a run thread")
    monkeypatch.setattr(dispatch_mod, "ThreadWaiter", no_thread)
    before = threading.active_count()
    for _ in range(20):
        k(u, v, 0.25, steps=2, backend="cpu")
    assert threading.active_count() == before
    np.testing.assert_allclose(u, refs.heat_exact(u0, 41, 0.25), rtol=1e-12, atol=1e-14)


@pytest.fixture
def pause_often(monkeypatch):
    """The ticker asks a run in the calling thread to pause every millisecond."""
    monkeypatch.setattr(runs, "FIRST_PAUSE_S", 1e-3)
    monkeypatch.setattr(runs, "PAUSE_EVERY_S", 1e-3)
    monkeypatch.setattr(runs.Ticker, "TICK_S", 1e-3)


def _slice_start(k):
    plan = k.dispatcher.plans.values()[0]
    return int(plan.slots._free[-1].view[runs.SLICE_START])


def test_a_run_paused_many_times_ends_where_one_run_would(pause_often, rng):
    k = _heat()
    u0 = rng.random(3000)
    u, v = u0.copy(), u0.copy()
    steps = 40_001                                   # odd: the pair's contents are exchanged at the end
    run = k(u, v, 0.2, steps=steps, start=17, backend="cpu")
    assert (run.steps, run.stopped, run.next_start) == (steps, "steps", 17 + steps)
    assert _slice_start(k) > 17, "the run was never paused: the test does not test pausing"
    np.testing.assert_allclose(u, refs.heat_exact(u0, steps, 0.2), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(v, refs.heat_exact(u0, steps - 1, 0.2), rtol=1e-9, atol=1e-12)


def test_a_paused_while_loop_stops_at_its_condition(pause_often, rng):
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = np.zeros((48, 48))
    u0[0, :] = rng.random(48)
    u, v = u0.copy(), u0.copy()
    tol = 1e-6
    ref, ref_steps = W.jacobi_ref(u0, tol, 100_000)
    run = k(u, v, tol, max_steps=100_000, backend="cpu")
    assert run.stopped == "condition" and run.steps == ref_steps
    assert _slice_start(k) > 0, "the run was never paused"
    np.testing.assert_allclose(u, ref, rtol=1e-9, atol=1e-12)


def test_random_draws_and_records_are_the_same_across_pauses(pause_often, rng):
    # lk.random depends on (seed, t, key) and hist[t] on t: a pause must continue t exactly
    from test_chunks import walk
    k = lk.megakernel(walk)
    steps, start, seed = 20_000, 123, int(rng.integers(0, 2 ** 63))
    x0 = rng.standard_normal(8)
    x, hist = x0.copy(), np.zeros((start + steps, 2))
    run = k(x, hist, 0.5, steps=steps, start=start, seed=seed, backend="cpu")
    assert run.steps == steps
    assert _slice_start(k) > start, "the run was never paused"
    ref_x, ref_hist = x0.copy(), np.zeros_like(hist)
    interp.run(walk, [ref_x, ref_hist, 0.5], steps, start=start, seed=seed)
    np.testing.assert_allclose(x, ref_x, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(hist, ref_hist, rtol=1e-10, atol=1e-9)


def test_concurrent_blocking_calls_get_separate_runs(rng):
    k = _heat()
    u0s = [rng.random(2000) for _ in range(4)]
    out = [None] * 4
    errors = []

    def work(i):
        try:
            u, v = u0s[i].copy(), u0s[i].copy()
            for _ in range(5):
                k(u, v, 0.1 + 0.05 * i, steps=200 + i, backend="cpu")
            out[i] = u
        except BaseException as exc:      # reported below
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        np.testing.assert_allclose(out[i], refs.heat_exact(u0s[i], 5 * (200 + i), 0.1 + 0.05 * i),
                                   rtol=1e-9, atol=1e-12)


@pytest.mark.sim
def test_numpy_arrays_on_the_cuda_path_are_copied_in_and_back_each_call(rng):
    k = _heat()
    for _ in range(3):
        u0 = rng.random(64).astype(np.float32)
        u, v = u0.copy(), u0.copy()
        k(u, v, 0.25, steps=5, backend="cuda", threads=32)
        np.testing.assert_allclose(u, refs.heat_exact(u0, 5, np.float32(0.25)), rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(v, refs.heat_exact(u0, 4, np.float32(0.25)), rtol=2e-5, atol=2e-6)
    assert len(k.dispatcher.plans) == 1


def test_the_layout_names_every_stop_code_the_host_reports():
    assert layout.STOPPED[layout.STEPS_DONE] == "steps"
    assert layout.STOPPED[layout.CONDITION] == "condition"
    assert layout.STOPPED[layout.CANCEL] == "cancelled"
    assert layout.STOPPED[layout.TIMEOUT] == "timeout"
    assert layout.STOPPED[layout.BOUNDS] == "error"
    assert runs.SLICE_START not in (layout.STEPS, layout.REQUEST, layout.WHY, layout.DONE, layout.TIMEOUT_NS)
    assert runs.SLICE_START < layout.HOST_SIZE


@pytest.mark.sim
def test_the_same_device_arrays_again_skip_the_key_and_other_arrays_do_not(monkeypatch, rng):
    from numba import cuda
    k = _heat()
    n = 64
    u0, w0 = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    k(u, v, 0.25, steps=3, threads=32)                    # the full path, remembered
    keys = []
    real_key = dispatch_mod.call_key
    monkeypatch.setattr(dispatch_mod, "call_key", lambda values: keys.append(1) or real_key(values))
    k(u, v, 0.25, steps=4, threads=32)
    assert keys == [], "the same arrays again computed the signature"
    np.testing.assert_allclose(u.copy_to_host(), refs.heat_exact(u0, 7, np.float32(0.25)), rtol=2e-5, atol=2e-6)
    # another pair of the same signature, and the first pair in the other order: each is its own
    # call, with its own pointers
    w, x = cuda.to_device(w0), cuda.to_device(w0)
    k(w, x, 0.1, steps=5, threads=32)
    np.testing.assert_allclose(w.copy_to_host(), refs.heat_exact(w0, 5, np.float32(0.1)), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(u.copy_to_host(), refs.heat_exact(u0, 7, np.float32(0.25)), rtol=2e-5, atol=2e-6)
    state = v.copy_to_host()                              # the state one step before u's
    k(v, u, 0.2, steps=2, threads=32)                    # runs from v's state, and ends in v
    np.testing.assert_allclose(v.copy_to_host(), refs.heat_exact(state, 2, np.float32(0.2)), rtol=2e-5, atol=2e-6)
    assert len(keys) == 2 and len(k.dispatcher.plans) == 1
    # arrays that die and are replaced never match the memo of the dead ones
    del u, v, w, x
    import gc
    gc.collect()
    for _ in range(3):
        a0 = rng.random(n).astype(np.float32)
        a, b = cuda.to_device(a0), cuda.to_device(a0)
        k(a, b, 0.3, steps=2, threads=32)
        np.testing.assert_allclose(a.copy_to_host(), refs.heat_exact(a0, 2, np.float32(0.3)), rtol=2e-5, atol=2e-6)
        del a, b


@pytest.mark.sim
def test_the_same_arrays_with_bad_values_or_options_are_still_refused(rng):
    from numba import cuda
    k = lk.megakernel(W.counter_step, swap=[("a", "b")])
    a0 = rng.integers(0, 100, 40).astype(np.int64)
    a, b = cuda.to_device(a0), cuda.to_device(a0)
    k(a, b, 7, steps=2, threads=32)
    k(a, b, 7, steps=1, start=2, threads=32, debug=True)
    np.testing.assert_array_equal(a.copy_to_host(), W.counter_ref(a0, 3, 7))
    with pytest.raises(lk.ArgumentError, match="does not fit in int64"):
        k(a, b, 2 ** 63, steps=1, threads=32)
    # equal to the values that passed (1 == True, 32.0 == 32), but not what the options take
    with pytest.raises(lk.ArgumentError, match="debug=1"):
        k(a, b, 7, steps=1, threads=32, debug=1)
    with pytest.raises(lk.ArgumentError, match="threads"):
        k(a, b, 7, steps=1, threads=32.0)
    with pytest.raises(lk.ArgumentError, match="share memory"):
        k(a, a, 7, steps=1, threads=32)
    np.testing.assert_array_equal(a.copy_to_host(), W.counter_ref(a0, 3, 7))
    k(a, b, np.int64(5), steps=2, threads=32)             # another kind of number: another plan
    np.testing.assert_array_equal(a.copy_to_host(), W.counter_ref(W.counter_ref(a0, 3, 7), 2, 5))


@pytest.mark.sim
def test_max_steps_calls_take_the_warm_path_and_stop_where_numpy_does(monkeypatch, rng):
    # max_steps= is as common as steps= (a step that returns a condition): repeated calls on the
    # same arrays go straight to the remembered plan, and still stop at the condition or the count
    from numba import cuda
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = np.zeros((12, 12))
    u0[0, :] = rng.random(12)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    first = k(u, v, 1e-3, max_steps=3, threads=32)         # the full path, remembered
    keys = []
    real_key = dispatch_mod.call_key
    monkeypatch.setattr(dispatch_mod, "call_key", lambda values: keys.append(1) or real_key(values))
    state = u.copy_to_host()
    for tol, max_steps in ((1e-3, 5), (1e-3, 10_000), (0.0, 4)):
        run = k(u, v, tol, max_steps=max_steps, threads=32)
        ref, ref_steps = W.jacobi_ref(state, tol, max_steps)
        assert run.steps == ref_steps
        assert run.stopped == ("condition" if ref_steps < max_steps else "steps")
        np.testing.assert_allclose(u.copy_to_host(), ref, rtol=1e-12, atol=1e-12)
        state = ref
    assert first.steps == 3 and keys == [], "a max_steps= call on the same arrays computed the signature"
    for bad, match in ((dict(max_steps=-1), "max_steps=-1"), (dict(max_steps=2, steps=2), "either steps"),
                       (dict(max_steps=2.0), "max_steps=2.0")):
        with pytest.raises(lk.ArgumentError, match=match):
            k(u, v, 1e-3, threads=32, **bad)
    np.testing.assert_allclose(u.copy_to_host(), state, rtol=1e-12, atol=1e-12)
