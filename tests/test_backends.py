"""The workloads on the CPU backend and on the CUDA path under Numba's simulator (one block),
each against a float64 NumPy reference on random inputs."""

import math

import numpy as np
import pytest

import loopkern as lk
import workloads as W

BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="sim", marks=pytest.mark.sim)]
SCOPES_FOR = {"cpu": [None], "cuda": ["grid", "block"]}


def cases():
    for b in BACKENDS:
        for scope in SCOPES_FOR[b.values[0]]:
            yield pytest.param(b.values[0], scope, marks=b.marks, id=f"{b.id}-{scope or 'cpu'}")


def small(backend):
    return backend == "cuda"   # the simulator runs Python threads: keep problems tiny


def rel_err(a, ref):
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / max(np.linalg.norm(ref), 1e-300))


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_heat_odd_steps_swap(backend, scope, rng):
    n, steps = (70, 7) if small(backend) else (1000, 101)
    u0 = rng.random(n).astype(np.float32)
    u, v = u0.copy(), rng.random(n).astype(np.float32)
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    run = k(u, v, 0.25, steps=steps, backend=backend, scope=scope)
    assert (run.steps, run.stopped) == (steps, "steps")
    ref = W.heat_ref(u0, steps, 0.25)
    assert rel_err(u, ref) < 1e-5


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_heat_even_and_zero_steps(backend, scope, rng):
    n = 40 if small(backend) else 500
    u0 = rng.random(n)
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    for steps in (0, 4):
        u, v = u0.copy(), np.empty_like(u0)
        run = k(u, v, 0.2, steps=steps, backend=backend, scope=scope)
        assert run.steps == steps
        assert rel_err(u, W.heat_ref(u0, steps, 0.2)) < 1e-12


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_jacobi_to_tolerance(backend, scope, rng):
    n = 10 if small(backend) else 48
    u0 = np.zeros((n, n))
    u0[0, :], u0[-1, :], u0[:, 0], u0[:, -1] = rng.random(n), rng.random(n), rng.random(n), rng.random(n)
    u0[1:-1, 1:-1] = rng.random((n - 2, n - 2))
    tol, max_steps = 1e-3, 5000
    ref, ref_steps = W.jacobi_ref(u0, tol, max_steps)
    u, v = u0.copy(), u0.copy()
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    run = k(u, v, tol, max_steps=max_steps, backend=backend, scope=scope)
    assert run.stopped == "condition"
    assert run.steps == ref_steps
    assert rel_err(u, ref) < 1e-12


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_jacobi_hits_max_steps(backend, scope, rng):
    n = 10 if small(backend) else 32
    u0 = rng.random((n, n))
    u, v = u0.copy(), u0.copy()
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    run = k(u, v, 1e-12, max_steps=5, backend=backend, scope=scope)
    assert (run.steps, run.stopped) == (5, "steps")
    assert rel_err(u, W.jacobi_ref(u0, 1e-12, 5)[0]) < 1e-12


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_life_exact(backend, scope, rng):
    n, m, steps = (8, 12, 5) if small(backend) else (64, 48, 40)
    a0 = (rng.random((n, m)) < 0.35).astype(np.int32)
    a, b = a0.copy(), np.zeros_like(a0)
    pop = np.zeros(steps, np.int64)
    k = lk.megakernel(W.life_step, swap=[("a", "b")])
    run = k(a, b, pop, steps=steps, backend=backend, scope=scope)
    ref, ref_pop = W.life_ref(a0, steps)
    assert run.steps == steps
    np.testing.assert_array_equal(a, ref)
    np.testing.assert_array_equal(pop, ref_pop)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_two_phase_sync(backend, scope, rng):
    n, steps = (50, 3) if small(backend) else (777, 20)
    x0 = rng.standard_normal(n)
    x, tmp, out = x0.copy(), np.zeros(n), np.zeros(n)
    k = lk.megakernel(W.two_phase_step)
    k(x, tmp, out, steps=steps, backend=backend, scope=scope)
    rx, rout = W.two_phase_ref(x0, steps)
    assert rel_err(x, rx) < 1e-12 and rel_err(out, rout) < 1e-12


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_several_reductions_per_step(backend, scope, rng):
    n, steps = (45, 3) if small(backend) else (1001, 25)
    x0 = rng.standard_normal(n)
    x, stats = x0.copy(), np.zeros((steps, 4))
    lk.megakernel(W.normalize_step)(x, stats, steps=steps, backend=backend, scope=scope)
    rx, rstats = W.normalize_ref(x0, steps)
    assert rel_err(x, rx) < 1e-10
    np.testing.assert_allclose(stats, rstats, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_helper_functions(backend, scope, rng):
    n, steps = (40, 5) if small(backend) else (600, 33)
    u0 = (rng.random(n) * 3).astype(np.float64)
    u, v = u0.copy(), u0.copy()
    lk.megakernel(W.helper_step, swap=[("u", "v")])(u, v, 0.3, steps=steps, backend=backend, scope=scope)
    assert rel_err(u, W.helper_ref(u0, steps, 0.3)) < 1e-12


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_integer_counter_exact(backend, scope, rng):
    n, steps = (64, 9) if small(backend) else (999, 301)
    a0 = rng.integers(0, 1000, n).astype(np.int64)
    a, b = a0.copy(), np.zeros_like(a0)
    lk.megakernel(W.counter_step, swap=[("a", "b")])(a, b, 9973, steps=steps, backend=backend, scope=scope)
    np.testing.assert_array_equal(a, W.counter_ref(a0, steps, 9973))


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_thread_id_and_num_threads_cover_every_index(backend, scope, rng):
    @lk.megakernel
    def spmd(t, hits, who, nt):
        n = hits.shape[0]
        i = lk.thread_id()
        while i < n:
            hits[i] += 1
            who[i] = lk.thread_id()
            i += lk.num_threads()
        if lk.thread_id() == 0:
            nt[0] = lk.num_threads()

    n = 100 if small(backend) else 5000
    h0 = rng.integers(-50, 50, n)
    hits, who, nt = h0.copy(), np.full(n, -1, np.int64), np.zeros(1, np.int64)
    run = spmd(hits, who, nt, steps=3, backend=backend, scope=scope)
    np.testing.assert_array_equal(hits, h0 + 3)               # every index exactly once per step
    assert nt[0] == run.threads * run.blocks                  # num_threads() is the launch's thread count
    np.testing.assert_array_equal(who, np.arange(n) % nt[0])  # thread k takes k, k + nt, ...
    if backend == "cpu":
        assert (run.threads, run.blocks) == (1, 1)
    else:                                                     # the simulator runs one block
        assert run.blocks == 1 and run.threads % 32 == 0 and 32 <= run.threads <= 1024


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_reduction_types(backend, scope, rng):
    @lk.megakernel
    def red(t, xf, xi, out):
        a = 0.0
        b = 0
        for i in lk.range(xf.shape[0]):
            a += xf[i]
            b += xi[i]
        s = lk.sum(a)
        c = lk.sum(b)
        hi = lk.max(b)
        lo = lk.min(a)
        if lk.thread_id() == 0:
            out[0] = s
            out[1] = c
            out[2] = hi
            out[3] = lo

    n = 64 if small(backend) else 3000
    xf = rng.random(n).astype(np.float32)
    xi = rng.integers(-50, 50, n).astype(np.int32)
    out = np.zeros(4)
    run = red(xf, xi, out, steps=1, backend=backend, scope=scope)
    threads = run.threads * run.blocks
    # each thread's partial sums over its grid-stride share
    parts_f = np.array([xf[k::threads].astype(np.float64).sum() for k in range(threads)])
    parts_i = np.array([xi[k::threads].astype(np.int64).sum() for k in range(threads)])
    np.testing.assert_allclose(out[0], xf.astype(np.float64).sum(), rtol=1e-5)
    assert out[1] == xi.astype(np.int64).sum()
    assert out[2] == parts_i.max()
    np.testing.assert_allclose(out[3], parts_f.min(), rtol=1e-5)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_an_accumulator_started_as_an_int_that_becomes_a_float(backend, scope, rng):
    # s = 0 made a float by the loop in the threads that get an iteration; the others (more
    # threads than iterations) keep the int. Numba types s float64 throughout; the simulator
    # reduced the two kinds of value in separate slot arrays and returned garbage (6.9e18)
    @lk.megakernel
    def mixed(t, a, out, n):
        s = 0
        for i in lk.range(n):
            s += a[i] * 0.5
        top = lk.max(s)
        total = lk.sum(s)
        if lk.thread_id() == 0:
            out[t, 0] = total
            out[t, 1] = top

    a = rng.random(64).astype(np.float32)
    out = np.zeros((2, 2))
    run = mixed(a, out, 5, steps=2, backend=backend, scope=scope)
    assert run.threads * run.blocks > 5 or backend == "cpu"
    half = a[:5].astype(np.float64) * 0.5
    np.testing.assert_allclose(out[:, 0], half.sum(), rtol=1e-6)
    # a thread's share is its grid-stride part (the CPU backend: one thread, the whole sum)
    np.testing.assert_allclose(out[:, 1], half.sum() if backend == "cpu" else half.max(), rtol=1e-6)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_max_and_min_are_nan_when_any_threads_value_is(backend, scope, rng):
    """lk.max and lk.min give NaN when any thread's value is NaN, wherever that thread is in
    the order of the reduction (as np.max and np.min): a NaN in the first, a middle or the last
    thread's share, or none (then exactly NumPy's extremes)."""
    n = 96 if small(backend) else 3000
    for dtype in (np.float32, np.float64):
        x = W.nan_rows(rng, n, dtype, 64 if small(backend) else 1)
        out = np.zeros((x.shape[0], 2), dtype)
        lk.megakernel(W.nan_extremes_step)(x, out, steps=x.shape[0], backend=backend, scope=scope,
                                           **({"threads": 64} if small(backend) else {}))
        assert out[0, 0] == x[0].max() and out[0, 1] == x[0].min()
        assert np.isnan(out[1:]).all(), out


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_grid_3d_and_single_name_target(backend, scope, rng):
    @lk.megakernel
    def scale3(t, a, b):
        for idx in lk.grid(a.shape[0], (1, a.shape[1]), a.shape[2]):
            b[idx] = a[idx] * 2.0 + t

    a = rng.random((3, 5, 4) if small(backend) else (9, 17, 11))
    b = np.full_like(a, -1.0)
    scale3(a, b, steps=2, backend=backend, scope=scope)
    expect = np.full_like(a, -1.0)
    expect[:, 1:, :] = a[:, 1:, :] * 2.0 + 1
    np.testing.assert_array_equal(b, expect)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_lk_range_negative_step_and_strides(backend, scope, rng):
    @lk.megakernel
    def rev(t, src, dst):
        n = src.shape[0]
        for i in lk.range(n - 1, -1, -2):
            dst[i] = src[n - 1 - i]

    src = rng.random(33)
    dst = np.zeros(33)
    rev(src, dst, steps=1, backend=backend, scope=scope)
    expect = np.zeros(33)
    idx = np.arange(32, -1, -2)
    expect[idx] = src[32 - idx]
    np.testing.assert_array_equal(dst, expect)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_lk_range_with_a_step_argument_of_zero_runs_nothing(backend, scope, rng):
    """A zero step from an argument runs no iteration on every backend (a grid-stride loop
    with it would never end; the CPU backend's range() raised mid-run); other steps from an
    argument visit Python's range."""
    @lk.megakernel
    def mark(t, a, s):
        for i in lk.range(a.shape[0] - 1, -1, s):
            a[i] += 1.0

    for step in (0, -3, -1):
        a = rng.random(17)
        expect = a.copy()
        expect[list(range(16, -1, step)) if step else []] += 1.0
        run = mark(a, step, steps=1, backend=backend, scope=scope)
        assert run.steps == 1
        np.testing.assert_array_equal(a, expect)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_step_index_and_early_uniform_return(backend, scope, rng):
    @lk.megakernel
    def count(t, log, stop_at):
        if lk.thread_id() == 0:
            log[t] = t * 10
        return t + 1 < stop_at

    stop_at = int(rng.integers(1, 19))
    log0 = rng.integers(-100, -1, 20)
    log = log0.copy()
    run = count(log, stop_at, max_steps=20, backend=backend, scope=scope)
    assert (run.steps, run.stopped) == (stop_at, "condition")
    expect = log0.copy()
    expect[:stop_at] = np.arange(stop_at) * 10
    np.testing.assert_array_equal(log, expect)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_while_loop_swap_parity(backend, scope, rng):
    # a while loop that stops after an odd or even number of steps: the first buffer is newest
    @lk.megakernel(swap=[("u", "v")])
    def inc(t, u, v, limit):
        for i in lk.range(u.shape[0]):
            v[i] = u[i] + 1.0
        return lk.max(v[0] if lk.thread_id() == 0 else -1.0) < limit

    for stop in (int(rng.integers(1, 6)) * 2 + 1, int(rng.integers(1, 6)) * 2):
        u0 = rng.random(37)
        u0[0] = 0.0
        u, v = u0.copy(), u0.copy()
        run = inc(u, v, stop - 0.5, max_steps=100, backend=backend, scope=scope)
        assert (run.steps, run.stopped) == (stop, "condition")
        np.testing.assert_allclose(u, u0 + stop, rtol=1e-15)
        np.testing.assert_allclose(v, u0 + stop - 1, rtol=1e-15)   # the state one step before


@pytest.mark.sim
@pytest.mark.parametrize("scope", ["grid", "block"])
def test_unrolled_loops_under_simulator(scope, rng):
    # 32 threads and > 4 * 32 elements: the unrolled path and its remainder loop both run
    n = 4 * 32 * 2 + 13
    u0 = rng.random(n)
    u, v = u0.copy(), u0.copy()
    lk.megakernel(W.heat_step, swap=[("u", "v")])(u, v, 0.2, steps=3, backend="cuda", scope=scope, threads=32)
    assert rel_err(u, W.heat_ref(u0, 3, 0.2)) < 1e-12
    g0 = rng.random((19, 17))
    g, h = g0.copy(), g0.copy()
    run = lk.megakernel(W.jacobi_step, swap=[("u", "v")])(g, h, 1e-3, max_steps=7, backend="cuda", scope=scope,
                                                          threads=32)
    ref, ref_steps = W.jacobi_ref(g0, 1e-3, 7)
    assert run.steps == ref_steps and rel_err(g, ref) < 1e-12

    import test_codegen as C
    x = rng.random(n)
    y, acc = np.zeros(n), np.zeros(32)
    lk.megakernel(C.unroll_ok)(x, y, acc, steps=1, backend="cuda", scope=scope, threads=32)
    np.testing.assert_allclose(y, x * 2 + 1)
    # each of the 32 threads: the sum over its grid-stride share, through the unrolled loop
    np.testing.assert_allclose(acc, [(x[k::32] * 2).sum() for k in range(32)])


@pytest.mark.parametrize("backend", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.sim)])
def test_sequential_step_runs_on_one_thread(backend, rng):
    k = lk.megakernel(W.logistic_step)
    assert not k.spec.parallel
    x = np.zeros(301)
    x[0] = rng.random()
    run = k(x, 2.9, steps=300, backend=backend)
    if backend == "cuda":
        assert (run.scope, run.blocks, run.threads) == ("thread", 1, 1)
    np.testing.assert_allclose(x, W.logistic_ref(x[0], 300, 2.9), rtol=1e-12)
    assert "_lk_tid = 0" in k.source("cuda", "thread")


@pytest.mark.sim
def test_thread_scope_refused_for_parallel_step(rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u = rng.random(10)
    with pytest.raises(lk.ArgumentError, match="scope='thread'"):
        k(u, u.copy(), 0.1, steps=1, backend="cuda", scope="thread")
    with pytest.raises(lk.ArgumentError, match="scope='thread'"):
        k.source("cuda", "thread")


def _count_up(t, x):
    x[0] = x[0] + 1.0


@pytest.mark.sim
@pytest.mark.parametrize("scope", ["grid", "block", "tile"])
def test_many_thread_scopes_refused_for_a_sequential_step(scope):
    """A step with no parallel construct is sequential code one thread runs (its updates are
    not checked): forcing a scope of many threads ran it on every thread (64 adds per step in
    the simulator; found by session 36's adversarial run). Refused before anything runs, by the
    call, the decorator's default and kernel.source; auto still runs it on one thread."""
    x = np.zeros(1)
    with pytest.raises(lk.ArgumentError, match=rf"scope='{scope}': step '_count_up' has no parallel construct"):
        lk.megakernel(_count_up)(x, steps=10, backend="cuda", scope=scope)
    if scope != "tile":
        with pytest.raises(lk.ArgumentError, match="no parallel construct"):
            lk.megakernel(_count_up, scope=scope)(x, steps=10, backend="cuda")
        with pytest.raises(lk.ArgumentError, match="no parallel construct"):
            lk.megakernel(_count_up).source("cuda", scope)
    # the CPU backend refuses it too: a call it runs is one a GPU runs
    with pytest.raises(lk.ArgumentError, match="no parallel construct"):
        lk.megakernel(_count_up)(x, steps=10, backend="cpu", scope=scope)
    assert x[0] == 0.0
    run = lk.megakernel(_count_up)(x, steps=10, backend="cuda")
    assert run.scope == "thread" and x[0] == 10.0


def _newton_sqrt(t, x, a, log):
    x[0] = 0.5 * (x[0] + a / x[0])
    log[t] = x[0]
    return abs(x[0] * x[0] - a) > 1e-12 * a


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_a_sequential_step_may_return_a_condition_read_from_its_arrays(backend, rng):
    """A step with no parallel construct runs on one thread, so its return value cannot differ
    between threads: a scalar recursion may stop on the value it keeps in an array (refused
    before session 36 as a value that can differ between threads), step for step as Python."""
    for a in rng.uniform(2.0, 1e6, 3):
        x, log = np.array([a]), np.full(64, np.nan)
        run = lk.megakernel(_newton_sqrt)(x, a, log, max_steps=64, backend=backend)
        y, want = a, []
        while True:
            y = 0.5 * (y + a / y)
            want.append(y)
            if not abs(y * y - a) > 1e-12 * a:
                break
        assert (run.steps, run.stopped) == (len(want), "condition")
        np.testing.assert_array_equal(log[:len(want)], want)
        assert x[0] == want[-1] and np.isnan(log[len(want):]).all()


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_grid_continue_and_empty_dimension(backend, scope, rng):
    @lk.megakernel
    def offdiag(t, a, b):
        for i, j, k in lk.grid(a.shape[0], a.shape[1], (1, a.shape[2])):
            if i == j:
                continue
            b[i, j, k] = a[i, j, k] + 1.0

    a = rng.random((5, 7, 6) if small(backend) else (13, 11, 17))
    b = np.zeros_like(a)
    offdiag(a, b, steps=1, backend=backend, scope=scope)
    expect = np.zeros_like(a)
    expect[:, :, 1:] = a[:, :, 1:] + 1.0
    for i in range(min(a.shape[:2])):
        expect[i, i, :] = 0.0
    np.testing.assert_array_equal(b, expect)
    empty = np.zeros((0, 4, 3))
    run = offdiag(empty, empty.copy(), steps=2, backend=backend, scope=scope)   # no iteration, no error
    assert (run.steps, run.stopped) == (2, "steps")


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_grid_loops_whose_extents_change_between_steps(backend, scope, rng):
    """A thread's first index and stride in an n-D loop are split into digits once per extent
    (the CUDA kernel keeps them across steps): loops of one step with different extents, and
    a loop whose inner extent changes with t (and comes back to an earlier one), each cover
    exactly their index space every step."""
    @lk.megakernel
    def sweep(t, a, b, c):
        w = 1 + (t % 3) * 2
        for i, j in lk.grid(a.shape[0], (1, w + 1)):
            b[i, j] += a[i, j] * (t + 1)
        lk.sync()       # (the two loops update b over different index spaces)
        for i, j in lk.grid((1, a.shape[0]), a.shape[1]):
            b[i, j] += 0.5 * a[i - 1, j]
        for i, j, k in lk.grid(c.shape[0], w, c.shape[2]):
            c[i, j, k] += a[i, j] + k

    shape = (5, 7) if small(backend) else (37, 29)
    a = rng.random(shape)
    b = rng.random(shape)
    c = rng.random((3, shape[1], 4))
    ra, rb, rc = a.copy(), b.copy(), c.copy()
    for t in range(5):
        w = 1 + (t % 3) * 2
        rb[:, 1:w + 1] += ra[:, 1:w + 1] * (t + 1)
        rb[1:, :] += 0.5 * ra[:-1, :]
        rc[:, :w, :] += ra[:3, :w, None] + np.arange(4)[None, None, :]
    sweep(a, b, c, steps=5, backend=backend, scope=scope)
    np.testing.assert_allclose(b, rb, rtol=1e-13, atol=0)
    np.testing.assert_allclose(c, rc, rtol=1e-13, atol=0)


def five_grid_loops(t, a, b):
    # (each loop updates b over other index spaces than the one before: a barrier between them)
    for i, j in lk.grid(a.shape[0], a.shape[1]):
        b[i, j] += a[i, j]
    lk.sync()
    for i, j in lk.grid((1, a.shape[0]), a.shape[1]):
        b[i, j] += 2.0 * a[i - 1, j]
    lk.sync()
    for i, j in lk.grid(a.shape[0], (1, a.shape[1])):
        b[i, j] += 3.0 * a[i, j - 1]
    lk.sync()
    for i, j in lk.grid(a.shape[0] - 1, a.shape[1]):
        b[i, j] += 4.0 * a[i + 1, j]
    lk.sync()
    for i, j in lk.grid(a.shape[0], a.shape[1] - 1 - t % 2):
        b[i, j] += 5.0 * a[i, j + 1]


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_more_grid_loops_than_the_kernel_keeps_digits_for(backend, scope, rng):
    """A step's first codegen.MEMO_LOOPS n-D loops keep their index digits across steps; the
    ones after divide every step. Both kinds cover exactly their index space."""
    from loopkern import codegen
    k = lk.megakernel(five_grid_loops)
    if backend == "cuda":
        kept = [line for line in k.source("cuda", scope).splitlines() if line.strip().startswith("if _lk_st[")]
        assert len(kept) == codegen.MEMO_LOOPS < 5
    a = rng.random((4, 6) if small(backend) else (19, 23))
    b = rng.random(a.shape)
    ref = b.copy()
    for t in range(3):
        ref += a
        ref[1:, :] += 2.0 * a[:-1, :]
        ref[:, 1:] += 3.0 * a[:, :-1]
        ref[:-1, :] += 4.0 * a[1:, :]
        w = a.shape[1] - 1 - t % 2
        ref[:, :w] += 5.0 * a[:, 1:w + 1]
    k(a, b, steps=3, backend=backend, scope=scope)
    np.testing.assert_allclose(b, ref, rtol=1e-13, atol=0)


def two_arg_math_step(t, x, y, out):
    for i in lk.range(x.size):
        out[0, i] = math.fmod(x[i], y[i])
        out[1, i] = math.remainder(x[i], y[i])
        out[2, i] = math.copysign(x[i], y[i])
        out[3, i] = math.hypot(x[i], y[i])
        out[4, i] = math.atan2(x[i], y[i])


def _py_or_nan(f, a, b):
    try:
        return f(a, b)
    except (ValueError, ZeroDivisionError):
        return math.nan


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_two_argument_math_matches_python(backend, scope, rng):
    # fmod and remainder are not in Numba's CPU math: the CPU kernels bring their own
    n = 24 if small(backend) else 400
    x, y = rng.normal(size=n) * 10, rng.normal(size=n)
    x[:3], y[:3] = [5.0, 2.5, 7.5], [2.0, 1.0, 5.0]          # remainder's ties go to the even quotient
    # C returns NaN where Python's math raises (the simulator's math does too: runtime/sim_math.py)
    x[3:6], y[3:6] = [math.inf, 3.0, -0.0], [1.0, 0.0, math.inf]
    out = np.zeros((5, n))
    lk.megakernel(two_arg_math_step)(x, y, out, steps=1, backend=backend, scope=scope)
    for row, f in enumerate((math.fmod, math.remainder, math.copysign, math.hypot, math.atan2)):
        ref = [_py_or_nan(f, a, b) for a, b in zip(x, y)]
        if f in (math.hypot, math.atan2):       # libm and CPython may differ in the last bit
            np.testing.assert_allclose(out[row], ref, rtol=1e-15, atol=0, err_msg=f.__name__)
        else:
            np.testing.assert_array_equal(out[row], ref, err_msg=f.__name__)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_max_and_min_of_uint64_order_values_from_2_63_on(backend, scope, rng):
    """lk.max/lk.min of uint64 return uint64 and order values of 2**63 and more above the rest
    (before session 28 the CPU backend returned them as negative int64, the simulator raised
    OverflowError and the GPU compared them as signed)."""
    n = 24 if small(backend) else 500
    for case in range(4):
        a = rng.integers(0, 2 ** 62, n, dtype=np.uint64)
        if case >= 1:
            a[rng.integers(0, n, 3)] = np.uint64(2 ** 63) + rng.integers(0, 2 ** 62, 3, dtype=np.uint64)
        if case == 2:
            a[:] = np.uint64(2 ** 64 - 1) - a % np.uint64(1000)
        if case == 3:
            a[rng.integers(0, n)] = 0
        out = np.zeros(2, np.uint64)
        lk.megakernel(W.uint64_extremes_step)(a, out, steps=1, backend=backend, scope=scope)
        assert out.tolist() == [int(a.max()), int(a.min())], case


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_float_to_an_integer_power_follows_numpy_on_the_cpu_backend(dtype, rng):
    """x ** n with x a float and n a signed integer: 0.0 ** -n is an infinity (-inf for -0.0 to
    an odd power), as NumPy and the GPU give; Numba's CPU power raised ZeroDivisionError out of
    the kernel (whatever its error model) before session 28."""
    W.check_int_power(lk.megakernel(W.int_power_step), "cpu", dtype, rng)


def test_division_by_zero_follows_numpy_on_the_cpu_backend(rng):
    """A step's float division by zero is an infinity or NaN, an integer one 0, as NumPy and
    the GPU's kernels (NumPy's error model, Numba-CUDA's without debug) give; the CPU backend
    raised ZeroDivisionError out of the kernel before session 26. (The simulator runs Python's
    operators, which raise.)"""
    x = np.array([0.0, -0.0, 2.0, -3.5, 1e-300])
    k = rng.integers(-9, 10, x.size).astype(np.int64)
    out, iout = np.zeros((3, x.size)), np.ones((2, x.size), np.int64)
    lk.megakernel(W.zero_division_step)(x, k, out, iout, steps=1, backend="cpu")
    with np.errstate(all="ignore"):
        want = np.stack([1.0 / x, x / x, -x / (x * 0.0)])
        iwant = np.stack([k // (k - k), k % (k - k)])
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(np.signbit(out[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))
    np.testing.assert_array_equal(iout, iwant)



@pytest.mark.parametrize("backend,scope", list(cases()))
def test_an_element_to_a_negative_power_in_place(backend, scope):
    # a[i] **= -1 of a zero is an infinity, as x ** -1 is (the CPU backend raised
    # ZeroDivisionError for the element form)
    @lk.megakernel
    def invert(t, a, b):
        for i in lk.range(a.shape[0]):
            a[i] **= -1
            b[i - 1] **= -2        # an index the front end does not prove non-negative

    a = np.array([0.0, 2.0, -0.0, 4.0])
    b = np.array([0.0, 2.0, -0.0, 4.0])
    invert(a, b, steps=1, backend=backend, scope=scope)
    with np.errstate(divide="ignore"):
        want_a = np.array([0.0, 2.0, -0.0, 4.0]) ** -1.0
        want_b = np.array([0.0, 2.0, -0.0, 4.0]) ** -2.0
    np.testing.assert_array_equal(a, want_a)
    np.testing.assert_array_equal(b, want_b)


@pytest.mark.parametrize("backend,scope", list(cases()))
def test_shifts_by_any_count_follow_numpy(backend, scope, rng):
    # a count of 64 or more, or a negative one: NumPy's 0 or sign (it takes the count as
    # unsigned); the CPU backend's LLVM shift was poison there (some elements unchanged,
    # 1 << 65 == 2)
    n = 41 if small(backend) else 301
    a, s = shift_operands(rng, n)
    left, right = np.zeros(n, np.int64), np.zeros(n, np.int64)
    lk.megakernel(W.shifts_step)(a, s, left, right, steps=1, backend=backend, scope=scope)
    want_left, want_right = W.shifts_ref(a, s)
    np.testing.assert_array_equal(left, want_left)
    np.testing.assert_array_equal(right, 0)
    right = np.zeros(n, np.int64)
    lk.megakernel(_shift_right)(a, s, right, steps=1, backend=backend, scope=scope)
    np.testing.assert_array_equal(right, want_right)
    out = np.zeros((5, n), np.int64)
    lk.megakernel(W.constant_shifts_step)(a, out, steps=1, backend=backend, scope=scope)
    np.testing.assert_array_equal(out, W.constant_shifts_ref(a))


def shift_operands(rng, n):
    # the special counts at both ends: a vectorised loop on the CPU shifts with instructions
    # that give 0 for any count past 63, its scalar remainder with ones that take it modulo 64
    a = rng.integers(-2 ** 62, 2 ** 62, n).astype(np.int64)
    s = rng.integers(-3, 80, n).astype(np.int64)
    a[:6] = a[-6:] = (-7, -1, 0, 1, 5, -5)
    s[:6] = s[-6:] = (64, 65, 100, 63, -1, -2)
    return a, s


def _shift_right(t, a, s, out):
    for i in lk.range(a.shape[0]):
        out[i] = a[i] >> s[i]


def int_fmod_step(t, a, b, out):
    for i in lk.range(a.size):
        out[i] = math.fmod(a[i], b[i])


@pytest.mark.parametrize("backend,scope", list(cases()))
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8])
def test_fmod_of_integers_matches_python(backend, scope, dtype, rng):
    """math.fmod of integers is a float with the sign of x, as in Python: the CPU backend's fmod
    was NumPy's integer fmod, which Numba gets wrong for negative operands (fmod(-7, 2) gave 1.0;
    found by session 36's adversarial run)."""
    n = 24 if small(backend) else 300
    a = rng.integers(-100, 100, n).astype(dtype)
    b = rng.integers(1, 9, n).astype(dtype) * rng.choice(np.array([-1, 1], dtype), n)
    a[:3], b[:3] = [-7, 7, -9], [2, -2, -4]
    out = np.zeros(n)
    lk.megakernel(int_fmod_step)(a, b, out, steps=1, backend=backend, scope=scope)
    np.testing.assert_array_equal(out, [math.fmod(int(x), int(y)) for x, y in zip(a, b)])
