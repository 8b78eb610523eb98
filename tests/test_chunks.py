"""Chunk invariance: N steps in one call equal any split of N into calls, each starting where the
last stopped (``start=run.next_start``), bit for bit, on every backend and scope: the CPU, the
CUDA path under Numba's simulator (grid and block scope, thread scope for a sequential step),
``kernel.start(...).wait()`` and ``kernel.jax`` on JAX's CPU backend. The workloads cover swap
pairs of one- and two-level schemes (heat; a leapfrog wave, whose second buffer must hold the
level before), ``hist[t]`` records, ``lk.random`` draws, a step that returns a condition (also
one that keeps its step barrier: ``return t < K or lk.max(err) > tol``) and integer arithmetic.
Both runs are also compared with the reference interpreter (tests/interp.py) and, where there is
one, a NumPy reference.
"""

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import loopkern as lk
import interp
from stepgen import fuzz_counter, fuzz_settings  # noqa: F401 (a fixture)


# ------------------------------------------------------------------------------ workloads
def heat_rec(t, u, v, hist, alpha):
    # one-level scheme; records the largest change of each step
    n = u.shape[0]
    e = 0.0
    for i in lk.range(1, n - 1):
        v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])
        e = max(e, abs(v[i] - u[i]))
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]
    m = lk.max(e)
    if lk.thread_id() == 0:
        hist[t] = m


def wave(t, u, v, c2):
    # leapfrog, two levels: u is the newest level, v the one before; the new level is written
    # over the older one, then the names swap
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 2.0 * u[i] - v[i] + c2 * (u[i - 1] - 2.0 * u[i] + u[i + 1])


def walk(t, x, hist, sigma):
    # random walk with random reflections; records the sum of positions each step
    n = x.shape[0]
    s = 0.0
    for i in lk.range(n):
        x[i] += sigma * lk.random.normal(i)
        if lk.random.uniform(i, 1) < 0.25:
            x[i] = -x[i]
        s += x[i]
    total = lk.sum(s)
    if lk.thread_id() == 0:
        hist[t, 0] = total
        hist[t, 1] = lk.random.uniform(t)


def mix(t, a, b, hist, mod):
    # integers, exact; the odd count and the step index recorded
    n = a.shape[0]
    k = 0
    for i in lk.range(n):
        b[i] = (a[(i + n - 1) % n] + 3 * a[i] + a[(i + 1) % n] + t) % mod
        k += b[i] % 2
    odd = lk.sum(k)
    if lk.thread_id() == 0:
        hist[t, 0] = t
        hist[t, 1] = odd


def smooth_until(t, u, v, tol, warm):
    # a condition; the step keeps its barrier (the reduction is skipped while t < warm)
    n = u.shape[0]
    err = 0
    for i in lk.range(n):
        v[i] = (u[(i + n - 1) % n] + 2 * u[i] + u[(i + 1) % n]) // 4
        err = max(err, abs(v[i] - u[i]))
    return t < warm or lk.max(err) > tol


def logistic_rec(t, x, r):
    # sequential: no parallel construct (one thread on CUDA)
    x[t + 1] = r * x[t] * (1.0 - x[t])


def random_walk_seq(t, x, sigma):
    # sequential with lk.random: README's thread scope is for a step without lk.range, lk.grid,
    # lk.thread_id, lk.num_threads, lk.sync or a reduction, which this is
    x[t + 1] = x[t] + sigma * lk.random.normal(t)


class W:
    """A workload: its kernel, fresh arguments and an independent NumPy reference."""

    def __init__(self, fn, swap, make, exact, numpy_ref=None, condition=False, sequential=False):
        self.fn, self.swap, self.make, self.exact = fn, swap, make, exact
        self.kernel = lk.megakernel(fn, swap=swap)
        self.numpy_ref = numpy_ref
        self.condition, self.sequential = condition, sequential


def _heat_args(rng, n, total):
    u = rng.random(n)
    return [u, u.copy(), np.zeros(total), 0.2]


def _heat_numpy(args0, steps, start, seed):
    u = args0[0].copy()
    hist = args0[2].copy()
    for t in range(start, start + steps):
        new = u.copy()
        new[1:-1] = u[1:-1] + 0.2 * (u[:-2] - 2 * u[1:-1] + u[2:])
        hist[t] = np.abs(new - u).max()
        u = new
    return {0: u, 2: hist}


def _wave_args(rng, n, total):
    x = np.linspace(0, 1, n)
    u = np.exp(-80 * (x - 0.4) ** 2) + 0.01 * rng.random(n)
    v = np.exp(-80 * (x - 0.41) ** 2)
    return [u, v, 0.3]


def _wave_numpy(args0, steps, start, seed):
    u, v = args0[0].copy(), args0[1].copy()
    for _ in range(steps):
        new = v.copy()
        new[1:-1] = 2 * u[1:-1] - v[1:-1] + 0.3 * (u[:-2] - 2 * u[1:-1] + u[2:])
        u, v = new, u
    return {0: u, 1: v}


def _walk_args(rng, n, total):
    return [rng.standard_normal(n), np.zeros((total, 2)), 0.5]


def _mix_args(rng, n, total):
    return [rng.integers(0, 1000, n), np.zeros(n, np.int64), np.zeros((total, 2), np.int64), 997]


def _mix_numpy(args0, steps, start, seed):
    a = args0[0].copy()
    hist = args0[2].copy()
    for t in range(start, start + steps):
        a = (np.roll(a, 1) + 3 * a + np.roll(a, -1) + t) % 997
        hist[t] = (t, (a % 2).sum())
    return {0: a, 2: hist}


def _smooth_args(rng, n, total):
    u = rng.integers(0, 4000, n)
    return [u, u.copy(), 3, 2]


def _logistic_args(rng, n, total):
    x = np.zeros(total + 1)
    x[:] = -1.0
    x[0] = rng.uniform(0.1, 0.9)
    return [x, 3.7]


def _logistic_numpy(args0, steps, start, seed):
    x = args0[0].copy()
    for t in range(start, start + steps):
        x[t + 1] = 3.7 * x[t] * (1.0 - x[t])
    return {0: x}


def _walk_seq_args(rng, n, total):
    x = np.zeros(total + 1)
    return [x, 0.5]


WORKLOADS = {
    "heat": W(heat_rec, [("u", "v")], _heat_args, False, _heat_numpy),
    "wave": W(wave, [("u", "v")], _wave_args, False, _wave_numpy),
    "walk": W(walk, (), _walk_args, False),
    "mix": W(mix, [("a", "b")], _mix_args, True, _mix_numpy),
    "smooth_until": W(smooth_until, [("u", "v")], _smooth_args, True, condition=True),
    "logistic": W(logistic_rec, (), _logistic_args, False, _logistic_numpy, sequential=True),
}

CONFIGS = [pytest.param("cpu", None, id="cpu"),
           pytest.param("cuda", "grid", id="sim-grid", marks=pytest.mark.sim),
           pytest.param("cuda", "block", id="sim-block", marks=pytest.mark.sim)]
SEQ_CONFIGS = [pytest.param("cpu", None, id="cpu"),
               pytest.param("cuda", "thread", id="sim-thread", marks=pytest.mark.sim)]

CASES = [pytest.param(name, *c.values, id=f"{name}-{c.id}", marks=c.marks)
         for name, w in WORKLOADS.items() for c in (SEQ_CONFIGS if w.sequential else CONFIGS)]


@st.composite
def splits(draw, max_total=9):
    """(total, [chunk sizes summing to total]); chunks may be empty."""
    total = draw(st.integers(0, max_total))
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=4)))
    return total, [b - a for a, b in zip([0] + cuts, cuts + [total])]


def call(w, args, n_steps, start, seed, backend, scope, threads, how, blocks=None):
    opts = dict(backend=backend, seed=seed, start=start)
    if backend == "cuda":
        opts.update(scope=scope, threads=None if scope in ("thread", "auto") else threads, blocks=blocks)
    count = dict(max_steps=n_steps) if w.condition else dict(steps=n_steps)
    if how == "start":
        return w.kernel.start(*args, **count, **opts).wait()
    return w.kernel(*args, **count, **opts)


def run_split(w, args, start, sizes, seed, backend, scope, threads, hows, blocks=None):
    """Runs the chunks one after another from ``start``; returns (steps, stopped, next_start)."""
    t, done, stopped = start, 0, "steps"
    for size, how in zip(sizes, hows):
        run = call(w, args, size, t, seed, backend, scope, threads, how, blocks)
        assert run.next_start == t + run.steps
        assert run.steps <= size
        t, done = run.next_start, done + run.steps
        if w.condition and run.stopped == "condition":
            stopped = "condition"
            break
        assert (run.steps, run.stopped) == (size, "steps")
    return done, stopped, t


def check_against_references(w, name, args0, got, steps, start, seed, tol_scale=1.0):
    ref = [a.copy() if isinstance(a, np.ndarray) else a for a in args0]
    want = interp.run(w.fn, ref, steps, start=start, swap=w.swap, seed=seed)
    for k, (g, e) in enumerate(zip(got, ref)):
        if isinstance(e, np.ndarray):
            if w.exact:
                np.testing.assert_array_equal(g, e, err_msg=f"{name}: argument {k} vs the interpreter")
            else:
                np.testing.assert_allclose(g, e, rtol=1e-12 * tol_scale, atol=1e-12 * tol_scale,
                                           err_msg=f"{name}: argument {k} vs the interpreter")
    if w.numpy_ref is not None:
        for k, e in w.numpy_ref(args0, steps, start, seed).items():
            if w.exact:
                np.testing.assert_array_equal(got[k], e, err_msg=f"{name}: argument {k} vs NumPy")
            else:
                np.testing.assert_allclose(got[k], e, rtol=1e-11 * tol_scale, atol=1e-12 * tol_scale,
                                           err_msg=f"{name}: argument {k} vs NumPy")
    return want


def check_split(name, backend, scope, split, start, n, seed, threads, hows, data_seed, blocks=None,
                tol_scale=1.0):
    """One call of ``total`` steps against the same steps split into calls: bit for bit; both
    against the interpreter and NumPy."""
    w = WORKLOADS[name]
    total, sizes = split
    if w.sequential:
        n = total + 1
    if start > 2 ** 31 and (w.fn.__name__ in ("heat_rec", "walk", "mix") or w.sequential):
        start = 3                # records index by t: keep them small
    note(f"{name} {backend} {scope} blocks={blocks}: {total} steps from {start} as {sizes}, n={n}, "
         f"threads={threads}, calls {hows[:len(sizes)]}")
    mk = lambda: w.make(np.random.default_rng(data_seed), n, start + total)   # noqa: E731
    args0 = mk()
    one = mk()
    if w.sequential:
        one = _shift_sequential(one, start)
        args0 = _shift_sequential(args0, start)
    run = call(w, one, total, start, seed, backend, scope, threads, "call", blocks)
    assert run.next_start == start + run.steps
    if not w.condition:
        assert (run.steps, run.stopped) == (total, "steps")
    split_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args0]
    steps, stopped, next_start = run_split(w, split_args, start, sizes, seed, backend, scope, threads, hows,
                                           blocks)
    assert (steps, stopped, next_start) == (run.steps, run.stopped, run.next_start)
    for k, (a, b) in enumerate(zip(one, split_args)):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(b, a, err_msg=f"argument {k}: split run != one call")
    want = check_against_references(w, name, args0, one, run.steps, start, seed, tol_scale)
    assert (want.steps, want.stopped) == (run.steps, run.stopped)
    return run


START = st.sampled_from([0, 0, 1, 4, 2 ** 32 - 2])
HOWS = st.lists(st.sampled_from(["call", "start"]), min_size=5, max_size=5)


@pytest.mark.parametrize("name,backend,scope", CASES)
@fuzz_settings(6)
@given(split=splits(), start=START, n=st.integers(3, 40), seed=st.integers(0, 2 ** 64 - 1),
       threads=st.sampled_from([32, 64]), hows=HOWS, data_seed=st.integers(0, 1000))
def test_split_run_equals_one_call(fuzz_counter, name, backend, scope, split, start, n, seed, threads, hows,
                                   data_seed):
    check_split(name, backend, scope, split, start, n, seed, threads, hows, data_seed)
    fuzz_counter(f"test_chunks {name} {backend}-{scope or 'cpu'}")


def _shift_sequential(args, start):
    # a sequential trajectory x[t + 1] = f(x[t]) from step 'start': the state sits at x[start]
    x = args[0]
    if start:
        x[start] = x[0]
        x[:start] = -1.0
    return args


@pytest.mark.parametrize("backend,scope", CONFIGS)
def test_two_level_scheme_keeps_the_level_before_across_calls(backend, scope):
    # leapfrog across odd splits: after each call u is the newest level and v the one before
    w = WORKLOADS["wave"]
    args = _wave_args(np.random.default_rng(5), 33, 0)
    args0 = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    t = 0
    for size in (1, 3, 0, 5, 2):
        run = call(w, args, size, t, 0, backend, scope, 32, "call")
        t = run.next_start
        ref = _wave_numpy(args0, t, 0, 0)
        np.testing.assert_allclose(args[0], ref[0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(args[1], ref[1], rtol=1e-12, atol=1e-13)
    assert t == 11


@pytest.mark.parametrize("backend,scope", [pytest.param("cpu", None, id="cpu"),
                                           pytest.param("cuda", "auto", id="sim-auto", marks=pytest.mark.sim)])
def test_sequential_random_walk_runs_on_one_thread(backend, scope):
    # lk.random is not a parallel construct (README, "Backends": thread scope is for a step with
    # no lk.range, lk.grid, lk.thread_id, lk.num_threads, lk.sync or reduction), so this step runs
    # on one thread; split into calls it equals one call and the interpreter
    k = lk.megakernel(random_walk_seq)
    opts = dict(backend=backend) if backend == "cpu" else dict(backend=backend, scope=scope)
    one = np.zeros(13)
    run = k(one, 0.5, steps=12, seed=3, **opts)
    if backend == "cuda":
        assert (run.scope, run.blocks, run.threads) == ("thread", 1, 1)
    split = np.zeros(13)
    t = 0
    for size in (5, 0, 7):
        t = k(split, 0.5, steps=size, start=t, seed=3, **opts).next_start
    np.testing.assert_array_equal(split, one)
    ref = np.zeros(13)
    interp.run(random_walk_seq, [ref, 0.5], 12, seed=3)
    np.testing.assert_allclose(one, ref, rtol=1e-14, atol=1e-14)


# ------------------------------------------------------------------------------ kernel.jax


@pytest.mark.parametrize("name", ["heat", "walk", "mix"])
@fuzz_settings(6)
@given(split=splits(max_total=7), start=st.sampled_from([0, 3]), n=st.integers(3, 30), seed=st.integers(0, 2 ** 32))
def test_jax_split_equals_one_call(fuzz_counter, name, split, start, n, seed):
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("JAX's CPU backend (tests/gpu has the GPU)")
    jnp = jax.numpy
    w = WORKLOADS[name]
    total, sizes = split
    rng = np.random.default_rng(seed)
    args0 = w.make(rng, n, start + total)
    # JAX without x64: float32 and int32
    args0 = [a.astype(np.float32 if a.dtype.kind == "f" else np.int32) if isinstance(a, np.ndarray) else a
             for a in args0]
    arrays = [i for i, a in enumerate(args0) if isinstance(a, np.ndarray)]

    def jcall(cur, size, t):
        out = w.kernel.jax(*cur, steps=size, start=t, seed=seed)
        out = out[:len(arrays)]
        new = list(cur)
        for i, o in zip(arrays, out):
            new[i] = o
        return new

    one = jcall([jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args0], total, start)
    cur = [jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args0]
    t = start
    for size in sizes:
        cur = jcall(cur, size, t)
        t += size
    for i in arrays:
        np.testing.assert_array_equal(np.asarray(cur[i]), np.asarray(one[i]), err_msg=f"argument {i}")
    # and the interpreter, in float32 like the kernel
    ref = [a.copy() if isinstance(a, np.ndarray) else a for a in args0]
    interp.run(w.fn, ref, total, start=start, swap=w.swap, seed=seed)
    for i in arrays:
        if w.exact:
            np.testing.assert_array_equal(np.asarray(one[i]), ref[i])
        else:
            np.testing.assert_allclose(np.asarray(one[i]), ref[i], rtol=2e-5, atol=2e-5)
    fuzz_counter(f"test_chunks jax {name}")
