"""The barrier between steps is left out only where a reduction every thread reaches replaces
it; the end-of-run exchange of swap pairs is fenced. Semantic tests against NumPy on the CPU
backend and under the simulator, plus the source-level proof (``always_reduces``)."""

import ast

import numpy as np
import pytest

import loopkern as lk
from loopkern import codegen
from loopkern.spec import INTRINSIC_PREFIX
import workloads as W

BACKENDS = [pytest.param("cpu", None, id="cpu"),
            pytest.param("cuda", "grid", id="sim-grid", marks=pytest.mark.sim),
            pytest.param("cuda", "block", id="sim-block", marks=pytest.mark.sim)]


CASES = [
    (W.stop_or_later, lambda t, e, tol: t < 5 or e > tol, False),
    (W.reduce_only_after_first, lambda t, e, tol: e > tol if t > 0 else True, False),
    (W.chained, lambda t, e, tol: t < 1000000 < e + 1000000 + tol or t < 6, False),
    (W.reduce_every_step, lambda t, e, tol: e > tol or t < 5, True),
]


@pytest.mark.parametrize("fn,verdict,elided", CASES, ids=[c[0].__name__ for c in CASES])
def test_barrier_is_elided_only_when_every_thread_reduces(fn, verdict, elided):
    for backend_scope in ("grid", "block"):
        src = lk.megakernel(fn, swap=[("u", "v")]).source("cuda", backend_scope)
        loop = src.split("while _lk_t < _lk_nsteps:")[1].split("if _lk_t % 2 == 1:")[0]
        assert (f"_lk_rt.{backend_scope}_sync(_lk_bar)" not in loop) == elided
        # the end-of-run exchange is always fenced
        tail = src.split("if _lk_t % 2 == 1:")[1]
        assert tail.lstrip().startswith(f"_lk_rt.{backend_scope}_sync(_lk_bar)")


@pytest.mark.parametrize("backend,scope", BACKENDS)
@pytest.mark.parametrize("fn,verdict,elided", CASES, ids=[c[0].__name__ for c in CASES])
def test_short_circuited_reductions_match_numpy(fn, verdict, elided, backend, scope, rng):
    n = 60 if backend == "cuda" else 400
    tol = 1e-3
    u0 = rng.random(n)
    ref_u, ref_prev, ref_steps = W.smooth_ref(u0, tol, 40, lambda t, e: verdict(t, e, tol))
    for steps in (7, 40):
        u, v = u0.copy(), u0.copy()
        run = lk.megakernel(fn, swap=[("u", "v")])(u, v, tol, max_steps=steps, backend=backend, scope=scope)
        want_u, want_prev, want_steps = W.smooth_ref(u0, tol, steps, lambda t, e: verdict(t, e, tol))
        assert run.steps == want_steps
        np.testing.assert_allclose(u, want_u, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(v, want_prev, rtol=1e-13, atol=1e-13)
    assert ref_steps > 5


TAIL_CASES = [(W.reduce_then_store, True), (W.reduce_then_store_read, False), (W.reduce_then_store_state, False),
              (W.reduce_then_store_moving, False)]


@pytest.mark.parametrize("fn,elided", TAIL_CASES, ids=[c[0].__name__ for c in TAIL_CASES])
def test_a_reduction_followed_by_write_only_stores_replaces_the_barrier(fn, elided):
    """lk.while_loop's form of a carried reduction (codegen.reduction_barrier_at): elided only when
    every store after the reduction goes, from a fixed thread, to an array that no thread reads."""
    k = lk.megakernel(fn, swap=[("u", "v"), ("e", "en")])
    for scope in ("grid", "block"):
        loop = k.source("cuda", scope).split("while _lk_t < _lk_nsteps:")[1].split("if _lk_t % 2 == 1:")[0]
        assert (f"_lk_rt.{scope}_sync(_lk_bar)" not in loop) == elided, scope


@pytest.mark.parametrize("backend,scope", BACKENDS)
def test_a_reduction_followed_by_write_only_stores_matches_numpy(backend, scope, rng):
    n = 60 if backend == "cuda" else 400
    tol = 1e-3
    k = lk.megakernel(W.reduce_then_store, swap=[("u", "v"), ("e", "en")])
    u0 = rng.random(n)
    for steps in (1, 6, 40):
        u, v, e, en = u0.copy(), u0.copy(), np.full(1, -1.0), np.full(1, -1.0)
        run = k(u, v, e, en, tol, max_steps=steps, backend=backend, scope=scope)
        want_u, want_prev, want_steps = W.smooth_ref(u0, tol, steps, lambda t, err: err > tol)
        assert run.steps == want_steps
        np.testing.assert_allclose(u, want_u, rtol=1e-13, atol=1e-13)
        # e holds the last step's reduction (the newest of its pair), en the one before
        last = np.abs(want_u[1:-1] - want_prev[1:-1]).max()
        np.testing.assert_allclose(e[0], last, rtol=1e-12)
        if want_steps > 1:
            before = W.smooth_ref(u0, tol, want_steps - 1, lambda t, err: err > tol)
            np.testing.assert_allclose(en[0], np.abs(before[0][1:-1] - before[1][1:-1]).max(), rtol=1e-12)
        else:
            assert en[0] == -1.0


@pytest.mark.parametrize("backend,scope", BACKENDS)
def test_an_atomic_update_after_the_reduction_keeps_the_step_barrier(backend, scope):
    # every thread adds 1 to the counter each step, after the step's reduction; the next step
    # reads it: t * threads at step t only if every update of the step before has landed
    k = lk.megakernel(W.reduce_then_count, swap=[("u", "v")])
    for sc in ("grid", "block", "tile"):
        src = k.source("cuda", sc)
        loop = src.split("while _lk_t < _lk_nsteps:")[1].split("_lk_t += 1")[0]
        assert "_sync(_lk_bar)" in loop, sc
    steps, threads = 12, 64
    u0 = np.linspace(0.0, 1.0, 40) ** 2
    u, v, cnt, seen = u0.copy(), u0.copy(), np.zeros(1, np.int64), np.zeros(steps, np.int64)
    kw = dict(threads=threads) if backend == "cuda" else {}
    run = k(u, v, cnt, seen, max_steps=steps, backend=backend, scope=scope, **kw)
    per_step = threads if backend == "cuda" else 1
    assert run.steps == steps
    np.testing.assert_array_equal(seen, np.arange(steps) * per_step)
    assert cnt[0] == steps * per_step


def _expr(text):
    """A normalized expression: lk.sum/max/min become their markers."""
    for name in ("sum", "max", "min"):
        text = text.replace(f"lk.{name}(", f"{INTRINSIC_PREFIX}{name}(")
    return ast.parse(text, mode="eval").body


@pytest.mark.parametrize("text,always", [
    ("lk.max(e) > tol", True),
    ("lk.max(e) > tol and lk.sum(e) > 0", True),
    ("t < 5 or lk.max(e) > tol", False),
    ("lk.max(e) > tol or t < 5", True),
    ("lk.max(e) > tol if t > 0 else True", False),
    ("(lk.max(e) > tol) if lk.sum(e) > 0 else False", True),
    ("lk.max(e) if t > 0 else lk.min(e)", True),
    ("a < b < lk.max(e)", False),
    ("a < lk.max(e) < b", True),
    ("not (lk.sum(e) > 1)", True),
    ("abs(lk.sum(e)) + 1 > 0", True),
    ("t > 3", False),
])
def test_always_reduces(text, always):
    assert codegen.always_reduces(_expr(text)) == always


@pytest.mark.parametrize("backend,scope", BACKENDS)
def test_reductions_of_several_value_types_in_one_step(backend, scope, rng):
    n, steps = (50, 3) if backend == "cuda" else (500, 4)
    x0 = rng.random(n).astype(np.float32)
    x, out = x0.copy(), np.zeros((steps, 4))
    lk.megakernel(W.mixed_reductions_step)(x, out, steps=steps, backend=backend, scope=scope)
    want_x, want_out = W.mixed_reductions_ref(x0, steps)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)


@pytest.mark.sim
def test_simulator_shared_arrays_are_one_per_block_when_first_allocated_at_once(monkeypatch):
    # Numba's simulator creates a block's shared array on the first call from its line; without
    # a lock, threads arriving together could each create one (np.empty: garbage in a
    # reduction, seen in CI). np.empty made slow here widens that window to certainty.
    import threading
    import time

    from numba.cuda.simulator import kernelapi

    from loopkern.runtime import cuda_rt
    assert cuda_rt.SIMULATOR and getattr(kernelapi.FakeCUDAShared.array, "_lk_atomic", False)
    real_empty = np.empty

    def slow_empty(*a, **kw):
        time.sleep(0.02)
        return real_empty(*a, **kw)
    monkeypatch.setattr(kernelapi.np, "empty", slow_empty)
    shared = kernelapi.FakeCUDAShared(0)
    got, gate = [], threading.Barrier(8)

    def thread():
        gate.wait()
        got.append(shared.array(16, np.float64))
    threads = [threading.Thread(target=thread) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 8 and all(a is got[0] for a in got)



def test_control_flow_on_an_element_of_an_array_is_refused_in_a_users_step():
    """In a user's step an array load counts as thread-varying (DESIGN.md's contract), also from
    an array the step never writes: a barrier under such a test is refused. (The steps loopkern
    generates from drop-in loop bodies, whose arrays never share memory, may test a carry's
    element: test_jaxloops_sim.py::test_cond_on_a_carried_element_around_a_nested_while_loop.)"""
    def step(t, u, flags, out):
        if flags[0] > 0.5:
            lk.sync()
        for i in lk.range(u.shape[0]):
            out[i] = u[i]
    with pytest.raises(lk.StepSyntaxError, match="differs between threads"):
        lk.megakernel(step)
