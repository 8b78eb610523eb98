"""The check for consecutive parallel loops without lk.sync() (validate._check_phases with
loopkern/disjoint.py): every step it accepts is checked here by enumeration, over small sizes
and argument values, to touch no element from two iterations of different loops where one of
them writes it (the iterations of two loops over the same range and the same index are one
thread's). Random steps of two loops over one array, with bounds, steps and indices of the
forms the analysis reasons about and others it must refuse."""

import importlib.util
import itertools
import textwrap

import numpy as np
import pytest

import loopkern as lk

BOUNDS = ["0", "1", "2", "r", "n - 1", "n - 2", "n", "n - r", "r + 1", "2 * r", "k"]
STEPS = [None, "1", "2", "3", "-1", "n - 1", "r", "SPAN"]      # SPAN: the loop's stop - start - 1
INDICES = ["i", "i + 1", "i - 1", "i + 2", "i - 2", "0", "n - 1", "r", "-1", "k", "2 * i", "n - i"]


def _loop(rng):
    a, b = rng.choice(BOUNDS, 2)
    s = rng.choice(STEPS)
    if s == "SPAN":
        s = f"({b}) - ({a}) - 1"
    return a, b, s


def _range_text(a, b, s):
    return f"lk.range({a}, {b})" if s is None else f"lk.range({a}, {b}, {s})"


def _values(a, b, s, env):
    lo, hi = eval(a, {}, env), eval(b, {}, env)
    st = 1 if s is None else eval(s, {}, env)
    return [] if st == 0 else list(range(lo, hi, st))


def _elements(index, iters, env, n):
    out = []
    for k, i in enumerate(iters):
        v = eval(index, {}, dict(env, i=i))
        if -n <= v < n:
            out.append((k, v % n))
    return out


def _races(first, second, same_iters, env, n):
    """Whether an element is written by one loop and read or written by the other, from
    different threads (same_iters: the loops run the same range, so the k-th iteration of each
    is one thread's; otherwise any two iterations may be two threads')."""
    (ia, ka, ra), (ib, kb, rb) = first, second
    if ka == "r" and kb == "r":
        return False
    ea = _elements(ia, ra, env, n)
    eb = _elements(ib, rb, env, n)
    return any(x == y and not (same_iters and p == q) for p, x in ea for q, y in eb)


def _step_source(name, loops):
    lines = [f"def {name}(t, u, w, r, k):", "    n = u.shape[0]"]
    for (a, b, s), (index, kind) in loops:
        lines.append(f"    for i in {_range_text(a, b, s)}:")
        lines.append(f"        u[{index}] = t + 1.0" if kind == "w" else f"        w[i % n] = u[{index}]")
    return "\n".join(lines) + "\n"


def test_every_accepted_pair_of_loops_touches_disjoint_elements(tmp_path, monkeypatch):
    rng = np.random.default_rng(32)
    cases = []
    for c in range(2000):
        loops = [(_loop(rng), (rng.choice(INDICES), rng.choice(["r", "w"]))) for _ in range(2)]
        if loops[0][1][1] == "r" and loops[1][1][1] == "r":
            loops[1] = (loops[1][0], (loops[1][1][0], "w"))
        cases.append((f"s{c}", loops))
    if True:     # one module holding every step (parse_step reads each one's source)
        path = tmp_path / "disjoint_cases.py"
        path.write_text("import loopkern as lk\n\n\n" + "\n\n".join(_step_source(n, lp) for n, lp in cases))
        spec = importlib.util.spec_from_file_location("disjoint_cases", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    accepted = refused = 0
    for name, loops in cases:
        try:
            lk.megakernel(getattr(mod, name))
        except lk.StepSyntaxError as e:
            assert "no lk.sync() between them" in str(e) or "race" in str(e) or "not provably" in str(e) \
                or "is read and written" in str(e) or "in-place" in str(e) or "reads" in str(e), str(e)
            refused += 1
            continue
        accepted += 1
        ((a1, b1, s1), (i1, k1)), ((a2, b2, s2), (i2, k2)) = loops
        same = (a1, b1, s1) == (a2, b2, s2)
        for n, r, k in itertools.product(range(0, 9), range(-2, 6), range(-3, 10)):
            env = dict(n=n, r=r, k=k)
            try:
                it1, it2 = _values(a1, b1, s1, env), _values(a2, b2, s2, env)
            except ZeroDivisionError:
                continue
            assert not _races((i1, k1, it1), (i2, k2, it2), same, env, n), (
                f"accepted, but the loops touch one element (n={n}, r={r}, k={k}):\n"
                + textwrap.dedent(_step_source(name, loops)))
    # the analysis proves a fair share apart, and refuses the rest
    assert accepted >= 100 and refused >= 100, (accepted, refused)


# ---------------------------------------------------------------- 2-D: grids, edge rows, edge columns
LO = ["0", "1", "2", "r"]
HI_N = ["n", "n - 1", "n - 2", "n - r"]
HI_M = ["m", "m - 1", "m - 2"]
ROW = ["0", "1", "n - 1", "n - 2", "r", "-1"]
COL = ["0", "1", "m - 1", "m - 2", "-1"]
OFF = ["", " + 1", " - 1", " + 2"]


def _loop2(rng):
    kind = rng.choice(["grid", "row", "col"])
    if kind == "grid":
        b = (rng.choice(LO), rng.choice(HI_N), rng.choice(LO), rng.choice(HI_M))
        idx = (f"i{rng.choice(OFF)}", f"j{rng.choice(OFF)}")
        head = f"for i, j in lk.grid(({b[0]}, {b[1]}), ({b[2]}, {b[3]})):"
    elif kind == "row":      # over columns, a fixed row
        b = (rng.choice(LO), rng.choice(HI_M))
        idx = (rng.choice(ROW), f"j{rng.choice(OFF)}")
        head = f"for j in lk.range({b[0]}, {b[1]}):"
    else:
        b = (rng.choice(LO), rng.choice(HI_N))
        idx = (f"i{rng.choice(OFF)}", rng.choice(COL))
        head = f"for i in lk.range({b[0]}, {b[1]}):"
    return kind, b, idx, head


def _source2d(name, loops):
    lines = [f"def {name}(t, u, w, r):", "    n = u.shape[0]", "    m = u.shape[1]"]
    for (kind, b, idx, head), rw in loops:
        lines.append("    " + head)
        ix = f"{idx[0]}, {idx[1]}"
        lines.append(f"        u[{ix}] = t + 1.0" if rw == "w" else f"        w[0, 0] = u[{ix}]")
    return "\n".join(lines) + "\n"


def _touched2d(loop, env, n, m):
    kind, b, idx, head = loop
    ev = lambda e, **kw: eval(e, {}, dict(env, **kw))  # noqa: E731
    if kind == "grid":
        its = [dict(i=i, j=j) for i in range(ev(b[0]), ev(b[1])) for j in range(ev(b[2]), ev(b[3]))]
    elif kind == "row":
        its = [dict(j=j) for j in range(ev(b[0]), ev(b[1]))]
    else:
        its = [dict(i=i) for i in range(ev(b[0]), ev(b[1]))]
    out = []
    for k, it in enumerate(its):
        x, y = ev(idx[0], **it), ev(idx[1], **it)
        if -n <= x < n and -m <= y < m:
            out.append((k, (x % n, y % m)))
    return out



def test_every_accepted_pair_of_2d_loops_touches_disjoint_elements(tmp_path):
    rng = np.random.default_rng(7)
    cases = []
    for c in range(1500):
        loops = [(_loop2(rng), rng.choice(["r", "w"])) for _ in range(2)]
        if loops[0][1] == "r" and loops[1][1] == "r":
            loops[1] = (loops[1][0], "w")
        cases.append((f"g{c}", loops))
    path = tmp_path / "disjoint_cases_2d.py"
    path.write_text("import loopkern as lk\n\n\n" + "\n\n".join(_source2d(nm, lp) for nm, lp in cases))
    spec = importlib.util.spec_from_file_location("disjoint_cases_2d", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    accepted = 0
    for name, loops in cases:
        try:
            lk.megakernel(getattr(mod, name))
        except lk.StepSyntaxError:
            continue
        accepted += 1
        (l1, _), (l2, _) = loops
        same = l1[0] == l2[0] and l1[1] == l2[1] and l1[3] == l2[3]
        for n, m, r in itertools.product(range(0, 6), range(0, 6), range(-2, 5)):
            e1 = _touched2d(l1, dict(n=n, m=m, r=r), n, m)
            e2 = _touched2d(l2, dict(n=n, m=m, r=r), n, m)
            kinds = {loops[0][1], loops[1][1]}
            assert kinds == {"r"} or not any(x == y and not (same and p == q) for p, x in e1 for q, y in e2), (
                f"accepted, but the loops touch one element (n={n}, m={m}, r={r}):\n" + _source2d(name, loops))
    assert accepted >= 300, accepted


# ---------------------------------------------------------------- cases an adversarial review found (session 32)
def warp_split_then_read(t, pos, acc, vel):
    n = pos.shape[0]
    for i in lk.range(n):          # warp-split on a GPU: iteration i is a group of 32 threads
        ax = 0.0
        for j in range(n):
            ax += pos[j] - pos[i]
        acc[i] = ax
    for i in lk.range(n):
        vel[i] += acc[i] * 0.01


def reduction_on_some_steps(t, u, v, err):
    n = u.shape[0]
    e = 0.0
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
        e = max(e, abs(v[i] - u[i]))
    e = lk.max(e) if t % 10 == 0 else 0.0     # a barrier on some steps only
    for i in lk.range(1, n - 1):
        u[i] = v[i]


def sync_on_some_steps(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    if t > 100:
        lk.sync()
    for i in lk.range(1, n - 1):
        u[i] = v[i]


def read_outside_then_write(t, a):
    n = a.shape[0]
    s = a[0]                       # every thread reads a[0] ...
    for i in lk.range(n):
        a[i] = a[i] / s            # ... while the thread of i = 0 overwrites it


def start_rebound(t, u, v):
    n = u.shape[0]
    s = 0
    for i in lk.range(s, n):
        u[i] = 2.0
    s = 1
    for i in lk.range(s, n):       # the same text, other iterations per thread
        v[i] = u[i]


def index_from_the_thread(t, a, b):
    n = b.shape[0]
    k = lk.thread_id()
    for i in lk.range(n):
        a[k] = 1.0 * i
    for i in lk.range(n):
        b[i] = a[k + 1]


def repeated_grid_name(t, a, b):
    n = a.shape[0]
    for i, i in lk.grid(n, n):
        b[i, i] = a[i, i]
    for i, i in lk.grid(n, n):
        a[i, i] = 2.0 + a[i, i]


def shift_outside_the_loops(t, u, w):
    n = w.shape[0]
    for i in lk.range(n):
        w[i] = 1.0
    for q in range(3, 0, -1):      # every thread runs it: one writes u[2] as another reads it
        u[q] = u[q - 1]


def read_in_a_test(t, u, w):
    n = u.shape[0]
    for i in lk.range(n):
        u[i] = t + 1.0
    if lk.min(u[0]) > 0.5:         # read by every thread while the thread of i = 0 writes it
        for i in lk.range(n):
            w[i] = 1.0


def read_in_bounds_of_an_empty_loop(t, u, w, r):
    n = u.shape[0]
    for i in lk.range(0, 1):
        u[n - r] = 1.0
    for i, j in lk.grid((r, n), int(lk.min(u[0]))):   # the bound is read even where no iteration runs
        w[i] = 1.0


@pytest.mark.parametrize("fn", [warp_split_then_read, reduction_on_some_steps, sync_on_some_steps,
                                read_outside_then_write, start_rebound, index_from_the_thread, repeated_grid_name,
                                shift_outside_the_loops, read_in_a_test, read_in_bounds_of_an_empty_loop])
def test_accepted_races_that_a_review_found_are_refused(fn):
    with pytest.raises(lk.StepSyntaxError, match="no lk.sync[(][)] between them"):
        lk.megakernel(fn)


def edges_without_a_swap_pair(t, u, v, x, r2):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), (1, m - 1)):
        v[i, j] = 0.25 * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
    for j in lk.range(m):                  # corners copied twice from u, which no loop writes
        v[0, j] = u[0, j]
        v[n - 1, j] = u[n - 1, j]
    for i in lk.range(n):
        v[i, 0] = u[i, 0]
        v[i, m - 1] = u[i, m - 1]
    for p in lk.range(x.shape[0]):         # a row per iteration, in both loops
        for d in range(3):
            x[p, d] += 0.5 * d
    for p in lk.range(0, x.shape[0]):      # the same iterations, spelled out
        r2[p] = x[p, 0] * x[p, 0] + x[p, 1] * x[p, 1] + x[p, 2] * x[p, 2]


def dirichlet_edges(t, v):
    n = v.shape[0]
    m = v.shape[1]
    for j in lk.range(m):
        v[0, j] = 0.0
        v[n - 1, j] = 0.0
    for i in lk.range(n):                  # the corners get the same literal again
        v[i, 0] = 0.0
        v[i, m - 1] = 0.0


def test_correct_steps_that_a_review_found_refused_are_accepted_and_computed(rng):
    u = rng.random((7, 6))
    v = np.zeros((7, 6))
    x = rng.random((5, 3))
    x0 = x.copy()
    r2 = np.zeros(5)
    lk.megakernel(edges_without_a_swap_pair)(u, v, x, r2, steps=1, backend="cpu")
    want = u.copy()
    want[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
    np.testing.assert_allclose(v, want, rtol=1e-15)
    x1 = x0 + 0.5 * np.arange(3)
    np.testing.assert_allclose(x, x1, rtol=1e-15)
    np.testing.assert_allclose(r2, (x1 ** 2).sum(axis=1), rtol=1e-14)
    w = rng.random((4, 5))
    lk.megakernel(dirichlet_edges)(w, steps=1, backend="cpu")
    want = w.copy()
    want[[0, -1], :] = 0.0
    want[:, [0, -1]] = 0.0
    np.testing.assert_array_equal(w, want)
