"""The front end: every rule violation is reported at the right file:line:col with the source
line, a caret and a hint; all problems of a step together."""

import inspect
import math
import re

import numpy as np
import pytest

import loopkern as lk
import bad_steps as B

MARKS = {}
for lineno, line in enumerate(inspect.getsource(B).splitlines(), start=1):
    if "# ERR:" in line:
        MARKS[lineno] = line.split("# ERR:")[1].split("  #")[0].strip()
FILE = inspect.getsourcefile(B)
LOC = re.compile(r"^(.+?):(\d+):(\d+): in step '(\w+)':", re.M)


def expected_for(fn):
    lines, first = inspect.getsourcelines(fn)
    out = {ln: MARKS[ln] for ln in range(first, first + len(lines)) if ln in MARKS}
    # a helper's errors are reported by the step that calls it
    for helper in (B.reduction_in_helper_helper, B.recursive):
        if helper.__name__ in inspect.getsource(fn) and fn is not helper:
            hl, hf = inspect.getsourcelines(helper)
            out.update({ln: MARKS[ln] for ln in range(hf, hf + len(hl)) if ln in MARKS})
    return out


BAD = [f for name, f in inspect.getmembers(B, inspect.isfunction)
       if f.__module__ == B.__name__ and expected_for(f) and f not in (B.reduction_in_helper_helper, B.recursive)]


@pytest.mark.parametrize("fn", BAD, ids=lambda f: f.__name__)
def test_each_error_at_its_line_with_caret_and_hint(fn):
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(fn)
    err = info.value
    msg = str(err)
    want = expected_for(fn)
    got = {d.line: d for d in err.diagnostics}
    assert set(got) == set(want), msg
    for line, fragment in want.items():
        d = got[line]
        assert fragment in d.message, (fragment, d.message)
        assert d.filename == FILE and d.step == fn.__name__
        src = inspect.getsource(B).splitlines()[line - 1]
        assert d.source_line.rstrip("\n") == src
        assert 1 <= d.col <= len(src)
        text = d.format()
        first, shown, caret = text.splitlines()[:3]
        assert first.startswith(f"{FILE}:{line}:{d.col}: in step '{fn.__name__}':")
        assert shown == "    " + src
        assert caret == "    " + " " * (d.col - 1) + "^"
        assert d.hint and d.hint in text
    # the whole message lists every location
    assert {int(m.group(2)) for m in LOC.finditer(msg)} == set(want)


def test_columns_point_at_the_offending_node():
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(B.sync_in_parallel_loop)
    (d,) = info.value.diagnostics
    line = d.source_line
    assert line[d.col - 1:].startswith("lk.sync()")


def test_valid_step_with_uniform_barriers_is_accepted():
    k = lk.megakernel(B.reduction_after_loop_is_fine)
    assert k.spec.returns_condition
    assert [p.kind for p in k.spec.params] == ["array", "array"]


def test_all_problems_reported_together():
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(B.many_problems)
    assert len(info.value.diagnostics) == 5
    assert str(info.value).startswith("5 problems in the step function:")


def test_errors_are_loopkern_errors():
    assert issubclass(lk.StepSyntaxError, lk.LoopkernError)
    with pytest.raises(lk.LoopkernError):
        lk.megakernel(B.uses_list)


def test_step_needs_index_parameter():
    def no_params():
        pass
    with pytest.raises(lk.StepSyntaxError, match="step index as its first parameter"):
        lk.megakernel(no_params)


def test_signature_rules():
    def defaults(t, u, a=1.0):
        u[0] = a

    def star(t, *arrays):
        pass
    with pytest.raises(lk.StepSyntaxError, match="default parameter values"):
        lk.megakernel(defaults)
    with pytest.raises(lk.StepSyntaxError, match=r"\*args"):
        lk.megakernel(star)


@pytest.mark.parametrize("swap,fragment", [
    ([("u", "w")], "'w' is not a parameter"),
    ([("u", "u")], "two different parameters"),
    ([("u", "v"), ("v", "x")], "more than one swap pair"),
    (["uv"], "is not a pair"),
    ([("t", "u")], "'t' is not a parameter"),
])
def test_bad_swap(swap, fragment):
    def step(t, u, v, x):
        for i in lk.range(u.shape[0]):
            v[i] = u[i] + x[i]
    with pytest.raises(lk.StepSyntaxError, match=re.escape(fragment)):
        lk.megakernel(step, swap=swap)


def test_in_step_api_outside_a_step_raises():
    with pytest.raises(lk.LoopkernError, match="only be used inside a step"):
        lk.sync()
    with pytest.raises(lk.LoopkernError):
        lk.sum(1.0)


def test_step_defined_in_exec_has_clear_error():
    ns = {"lk": lk}
    exec("def step(t, u):\n    u[0] = 1.0\n", ns)
    with pytest.raises(lk.StepSyntaxError, match="cannot read the source"):
        lk.megakernel(ns["step"])


def test_globals_and_closure_numbers_are_inlined():
    factor = 3.0

    def step(t, u):
        for i in lk.range(u.shape[0]):
            u[i] = u[i] * factor + B.SCALE
    src = lk.megakernel(step).source("cpu")
    assert "* 3.0 + 2.5" in src


def test_math_and_numpy_casts_allowed():
    import math
    from math import sqrt

    def step(t, u):
        for i in lk.range(u.shape[0]):
            u[i] = np.float32(math.sin(u[i]) + sqrt(2.0) + math.pi)
    np = __import__("numpy")
    src = lk.megakernel(step).source("cuda")
    assert "_lk_math.sin" in src and "_lk_math.sqrt" in src and "_lk_np.float32" in src


# ---------------------------------------------------------------- parallel loops every thread reaches
def _diagnostic(fn, **kw):
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(fn, **kw)
    (d,) = info.value.diagnostics
    return d


def test_nested_parallel_loop_says_why_and_suggests_one_grid():
    d = _diagnostic(B.nested_parallel_loops)
    assert "threads run different numbers of iterations" in d.message and "never be visited" in d.message
    assert d.hint == "use one lk.grid over both dimensions: `for i, j in lk.grid(n, m):`"
    assert d.source_line.strip().startswith("for j in lk.range")


def test_parallel_loop_under_varying_if_suggests_moving_the_condition():
    d = _diagnostic(B.parallel_loop_under_varying_if)
    assert "some indices would never be visited" in d.message
    assert "move the condition inside the loop" in d.hint


def test_helper_with_parallel_loop_must_be_called_by_every_thread():
    d = _diagnostic(B.helper_loop_in_parallel_loop)
    assert "lk.grid" in d.hint and "outside the parallel loop" in d.hint

    def varying_argument(t, a):
        k = lk.thread_id()
        fill_upto(a, k)
    d = _diagnostic(varying_argument)
    assert "argument 2 of this call ('k') differs between threads" in d.message


def fill_upto(a, n):
    for i in lk.range(n):
        a[i] = 0.0


def nested_in_helper(a):
    for i in lk.range(a.shape[0]):
        for j in lk.range(a.shape[1]):
            a[i, j] = 0.0


def calls_fill(a):
    fill_upto(a, a.shape[0])


def test_parallel_loops_nested_inside_a_helper_are_rejected_there():
    def step(t, a):
        nested_in_helper(a)
    d = _diagnostic(step)
    assert d.where == "in helper 'nested_in_helper'" and "lk.grid" in d.hint
    # a helper that calls a helper with a parallel loop runs one too
    assert lk.megakernel(lambda_free_step_calls_helper).spec.helpers[-1].has_parallel_loop

    def in_loop(t, a, b):
        for i in lk.range(b.shape[0]):
            calls_fill(a)
    assert "helper 'calls_fill' runs a parallel loop" in _diagnostic(in_loop).message


def lambda_free_step_calls_helper(t, a):
    calls_fill(a)


def uniform_control_flow(t, a, alpha, count):
    # parallel loops under uniform control flow: every thread runs them the same number of times
    for k in range(3):
        if t % 2 == 0 and alpha > 0.0:
            for i in lk.range(a.shape[0]):
                a[i] = a[i] + alpha
    total = lk.max(1)
    while total > 0:
        for i, j in lk.grid(count.shape[0], 2):
            count[i, j] += 1
        total -= 1
    fill_upto(a, a.shape[0] if t > 2 else 0)


def test_parallel_loops_under_uniform_control_flow_are_accepted():
    k = lk.megakernel(uniform_control_flow)
    assert k.spec.parallel and [p.kind for p in k.spec.params] == ["array", "scalar", "array"]


@pytest.mark.parametrize("backend", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.sim)])
def test_uniform_control_flow_runs_every_index(rng, backend):
    a0 = rng.random(37)
    a, count = a0.copy(), np.zeros((5, 2), np.int64)
    lk.megakernel(uniform_control_flow)(a, 0.5, count, steps=2, backend=backend)
    ref = a0 + 3 * 0.5                       # step 0 adds 3 times, step 1 (odd) not at all
    np.testing.assert_allclose(a, ref, rtol=1e-12)
    assert (count == 2).all()                # one pass of the while loop per step, every (i, j)


# ---------------------------------------------------------------- racing read-modify-writes
def test_racing_update_hint_names_lk_atomic():
    for fn in (B.racing_histogram, B.racing_read_then_write, B.racing_offsets):
        d = _diagnostic(fn)
        assert d.hint == ("several iterations may update the same element at once: use lk.atomic.add(a, idx, x) "
                          "(or lk.atomic.max/min)"), fn
    d = _diagnostic(B.racing_histogram)
    assert "'hist[b]'" in d.message and d.source_line.strip().startswith("hist[b] += 1")
    d = _diagnostic(B.racing_top_level)
    assert "every thread makes this update" in d.message
    assert "`if lk.thread_id() == 0:`" in d.hint and "lk.atomic.add" in d.hint


def own_updates(t, a, g, h, c):
    n = a.shape[0]
    for i in lk.range(1, n - 1):
        a[i] += 1.0                          # the iteration's own element
        a[i] = a[i] * 0.5
        v = g[i - 1, 0]
        g[i - 1, 0] = v + 1.0                # an offset, the same one each time
        for k in range(3):
            h[k, i] += a[i]                  # other dimensions may be anything
        c[lk.thread_id()] += 1               # the thread's own element
    lk.sync()                                # (g's elements are other threads' in the grid loops)
    for p in lk.grid(g.shape[0], g.shape[1]):
        g[p] += 1.0
    for i, j in lk.grid(g.shape[0], g.shape[1]):     # the same elements, the same threads
        g[i, j] = g[i, j] - 1.0
    if lk.thread_id() == 0:
        c[0] = c[0] + 1                      # one thread
    m = lk.thread_id()
    while m < c.shape[0]:                    # the grid-stride idiom: each thread its own elements
        c[m] += 1
        m += lk.num_threads()
    lk.sync()
    for i in lk.range(n):
        c[int(a[i]) % c.shape[0]] = 0       # a plain store at a computed index is not an update


def test_updates_of_own_elements_are_accepted():
    k = lk.megakernel(own_updates)
    assert [p.written for p in k.spec.params] == [True, True, True, True]


def test_sequential_steps_update_freely():
    def seq(t, x, c, r):
        x[t + 1] = r * x[t] * (1.0 - x[t])
        c[0] = c[0] + 1
        c[int(x[t] * 3)] += 1
    assert not lk.megakernel(seq).spec.parallel


def add_at(a, k, x):
    a[k] += x


def add_next(a, k, x):
    add_at(a, k + 1, x)


def test_helper_updates_are_checked_with_the_call_arguments():
    def own(t, a, b):
        for i in lk.range(1, b.shape[0]):
            add_at(a, i - 1, b[i])
            add_next(a, i - 2, b[i])         # a[i - 1] as well: the same element
    lk.megakernel(own)

    def racing(t, a, b, idx):
        for i in lk.range(b.shape[0]):
            add_at(a, idx[i], b[i])
    d = _diagnostic(racing)
    assert "helper 'add_at' updates 'a[k]'" in d.message and "lk.atomic.add" in d.hint

    def shifted(t, a, b):
        for i in lk.range(b.shape[0] - 1):
            add_at(a, i, b[i])
            add_next(a, i, b[i])
    assert "other offsets" in _diagnostic(shifted).message

    def top_level(t, a, b):
        for i in lk.range(b.shape[0]):
            b[i] = 0.0
        add_at(a, 0, 1.0)
    assert "guard the call" in _diagnostic(top_level).hint

    def guarded(t, a, b):
        for i in lk.range(b.shape[0]):
            b[i] = 0.0
        if lk.thread_id() == 0:
            add_at(a, 0, 1.0)
    lk.megakernel(guarded)


# ---------------------------------------------------------------- assigning to parameters
def test_assigning_to_a_parameter_says_the_value_is_lost():
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(B.assigns_parameters)
    total, t, u = info.value.diagnostics
    assert "parameters are inputs" in total.message and "lost when the step ends" in total.message
    assert total.hint == ("to return a number, pass a 1-element array and write `total[0] = ...` (guarded by "
                          "`if lk.thread_id() == 0:`)")
    assert "step index" in t.message and "u[i] = ..." in u.hint


def rescale(x, s):
    x = x * s            # a helper's parameters are its own locals, as in Python
    s = 2
    return x + s


def test_helpers_may_assign_to_their_own_parameters(rng):
    def step(t, u):
        for i in lk.range(u.shape[0]):
            u[i] = rescale(u[i], 0.5)
    u0 = rng.random(50) * 4.0
    u = u0.copy()
    lk.megakernel(step)(u, steps=3, backend="cpu")
    want = u0.copy()
    for _ in range(3):
        want = np.array([rescale(x, 0.5) for x in want])    # the helper as plain Python
    np.testing.assert_array_equal(u, want)


# ---------------------------------------------------------------- messages
def test_module_used_without_import_names_the_import():
    d = _diagnostic(B.math_not_imported)
    assert d.message == "name 'math' is not defined in the step's module"
    assert d.hint == "add `import math` at the top of bad_steps.py"

    def uses_np(t, u):
        for i in lk.range(u.shape[0]):
            u[i] = numpy_alias.float32(u[i])  # noqa: F821
    assert "name 'numpy_alias' is not defined" in _diagnostic(uses_np).message


def test_numpy_functions_point_to_math():
    d = _diagnostic(B.numpy_function)
    assert "'np.sqrt' is a NumPy function; NumPy functions are not supported in step code" in d.message
    assert d.hint == "use math.sqrt(x) instead"
    import numpy

    def others(t, u):
        u[0] = numpy.arctan2(u[0], 1.0)
        u[1] = numpy.maximum(u[0], u[1])
        u[2] = numpy.sum(u[1])
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(others)
    hints = [d.hint for d in info.value.diagnostics]
    assert hints == ["use math.atan2(y, x) instead", "use max(x, y) instead",
                     "write it with a loop over elements; math.* has the scalar functions"]


# ---------------------------------------------------------------- lk.atomic in the front end
def test_atomic_resolves_and_marks_parameters():
    from loopkern import atomic

    def step(t, data, hist, lo, hi):
        for i in lk.range(data.shape[0]):
            old = lk.atomic.add(hist, int(data[i]), 1)
            atomic.max(hi, (0, i % 2), data[i] + old)
            atomic.min(lo, -1, data[i])
    k = lk.megakernel(step)
    flags = {p.name: (p.kind, p.written, p.atomic, p.min_ndim) for p in k.spec.params}
    assert flags == dict(data=("array", False, False, 1), hist=("array", True, True, 1),
                         lo=("array", True, True, 1), hi=("array", True, True, 2))


def atomic_helper(h, k):
    return lk.atomic.add(h, k, 1)


def test_atomic_in_a_helper_and_in_a_sequential_step():
    def step(t, data, hist):
        for i in lk.range(data.shape[0]):
            atomic_helper(hist, int(data[i]))
    k = lk.megakernel(step)
    assert k.spec.params[1].atomic and k.spec.params[1].written

    def seq(t, c):
        lk.atomic.add(c, 0, 1)          # one thread: it does not make the step parallel
    assert not lk.megakernel(seq).spec.parallel


def test_atomic_outside_a_step_and_as_a_value():
    with pytest.raises(lk.LoopkernError, match=r"lk.atomic.add\(\) can only be used inside a step"):
        lk.atomic.add(None, 0, 1)

    def step(t, u):
        f = lk.atomic
        u[0] = 1.0
    assert "cannot be used in step code" in _diagnostic(step).message


def test_guard_may_be_one_operand_of_and():
    def step(t, a, count):
        for i in lk.range(a.shape[0]):
            a[i] = 0.0
        if t > 2 and lk.thread_id() == a.shape[0] - 1:
            count[0] += 1
    k = lk.megakernel(step)
    assert k.spec.parallel
    a, count = np.ones(1), np.zeros(1, np.int64)
    k(a, count, steps=6, backend="cpu")     # one thread, whose id is 0 == a.shape[0] - 1
    assert count[0] == 3 and a[0] == 0.0


def test_read_then_write_of_the_same_element_is_an_update():
    def step(t, a, idx):
        for i in lk.range(idx.shape[0]):
            a[idx[i]] = a[idx[i]] + 1.0
    d = _diagnostic(step)
    assert "'a[idx[i]]' is read and written" in d.message


def test_helper_with_parallel_loop_in_a_varying_conditional_expression():
    def step(t, a):
        x = fill_and_count(a) if lk.thread_id() == 0 else 0
        a[0] = x
    d = _diagnostic(step)
    assert "conditional expression" in d.message and "helper 'fill_and_count' runs a parallel loop" in d.message


def fill_and_count(a):
    for i in lk.range(a.shape[0]):
        a[i] = 1.0
    return a.shape[0]


def test_numpy_used_without_import_names_the_import(tmp_path, monkeypatch):
    import importlib
    (tmp_path / "no_numpy_step.py").write_text(
        "import loopkern as lk\n\n\n"
        "def step(t, u):\n"
        "    for i in lk.range(u.shape[0]):\n"
        "        u[i] = np.float32(u[i]) * np.pi\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("no_numpy_step")
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(mod.step)
    assert [(d.message, d.hint) for d in info.value.diagnostics] == \
        [("name 'np' is not defined in the step's module",
          "add `import numpy as np` at the top of no_numpy_step.py")] * 2


def test_a_helper_defined_below_the_step_is_named_as_such(tmp_path, monkeypatch):
    """At decoration time a helper defined further down the module does not exist yet: the
    hint says so (it said "define the function at module level", which it already was)."""
    mod = tmp_path / "later_helper_mod.py"
    mod.write_text("import loopkern as lk\n\n"
                   "@lk.megakernel\n"
                   "def k(t, u):\n"
                   "    for i in lk.range(u.shape[0]):\n"
                   "        u[i] = helper(u[i]) + SCALE\n\n\n"
                   "def helper(x):\n"
                   "    return x * 2.0\n\n\n"
                   "SCALE = 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(lk.StepSyntaxError) as info:
        import later_helper_mod  # noqa: F401
    hints = {d.hint for d in info.value.diagnostics}
    assert any("'helper' is defined further down later_helper_mod.py, after the step" in h for h in hints), hints
    assert any("'SCALE' is defined further down" in h for h in hints), hints


def _every_path_assigns(t, a, b):
    # assigned on every path that reaches the read: the if/else, a branch that continues, a
    # value before the loop that may reassign it, and a while loop's condition variable
    for i in lk.range(a.shape[0]):
        if a[i] > 0.5:
            y = 10.0 * a[i]
        else:
            y = -1.0
        if a[i] < 0.1:
            b[i] = 0.0
            continue
        else:
            z = 2.0
        m = 0.0
        for k in range(3):
            m = m + k
        j = 0
        while j < 2:
            j += 1
        b[i] = y + z + m + j


def test_locals_assigned_on_every_path_are_accepted_and_computed(rng):
    """The definite-assignment check (session 29) accepts what Python runs without an
    UnboundLocalError; the results against a plain NumPy version."""
    k = lk.megakernel(_every_path_assigns)
    a = rng.random(257)
    b = np.zeros(257)
    k(a, b, steps=1, backend="cpu")
    want = np.where(a < 0.1, 0.0, np.where(a > 0.5, 10.0 * a, -1.0) + 2.0 + 3.0 + 2)
    np.testing.assert_allclose(b, want, rtol=1e-15)


def _phases_that_need_no_barrier(t, u, v, w, a, b):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] * 0.5
    for i in lk.range(1, n - 1):          # the same iterations, the same element: the same thread
        w[i] = v[i] + 1.0
    for i in lk.range(0, n, n - 1):       # two writes (a boundary beside an interior): apart
        v[i] = u[i]
    for i in lk.range(2, n - 2):          # reads what the next loop writes, elsewhere
        a[i] = b[i - 1] * 3.0
    for i in lk.range(n - 1, n):
        b[i] = b[i] * 2.0
    lk.sync()
    for i in lk.range(1, n - 1):          # after a barrier anything goes
        a[i] = v[i - 1] + v[i + 1]


def _edges_of_a_grid(t, u, v, h):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), (1, m - 1)):
        v[i, j] = 0.25 * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
    for j in lk.range(m):                 # the edges: apart from the interior in one dimension
        v[0, j] = u[0, j]
        v[n - 1, j] = u[n - 1, j]
    for i in lk.range(n):                 # the corners again: the same copy, the same value
        v[i, 0] = u[i, 0]
        v[i, m - 1] = u[i, m - 1]
    for k in lk.range(h.shape[0]):        # atomic adds commute
        lk.atomic.add(h, k % 3, 1.0)
    for k in lk.range(h.shape[0]):
        lk.atomic.add(h, (k + 1) % 3, 2.0)


def test_phases_that_need_no_barrier_are_accepted_and_computed(rng):
    """The check for parallel loops without lk.sync() (session 29) accepts loops whose shared
    elements are each one thread's in both, and writes beside writes; results against NumPy."""
    k = lk.megakernel(_phases_that_need_no_barrier)
    u = rng.random(64)
    b = rng.random(64)
    b0 = b.copy()
    v, w, a = np.zeros(64), np.zeros(64), np.zeros(64)
    k(u, v, w, a, b, steps=1, backend="cpu")
    want_v = u * 0.5
    want_v[[0, -1]] = u[[0, -1]]
    want_w = np.zeros(64)
    want_w[1:-1] = u[1:-1] * 0.5 + 1.0
    want_a = np.zeros(64)
    want_a[1:-1] = want_v[:-2] + want_v[2:]
    want_b = b0.copy()
    want_b[-1] *= 2.0
    np.testing.assert_allclose(b, want_b, rtol=1e-15)
    np.testing.assert_allclose(v, want_v, rtol=1e-15)
    np.testing.assert_allclose(w, want_w, rtol=1e-15)
    np.testing.assert_allclose(a, want_a, rtol=1e-15)


def test_edges_beside_an_interior_without_a_barrier_are_accepted_and_computed(rng):
    """Writes in consecutive parallel loops (checked since session 32): a 2-D interior, its
    edge rows and its edge columns (whose corners both loops store, copying one value) need no
    barrier; two loops of atomic adds neither. Results against NumPy."""
    k = lk.megakernel(_edges_of_a_grid, swap=[("u", "v")])
    u0 = rng.random((9, 7))
    u, v, h = u0.copy(), np.zeros((9, 7)), np.zeros(3)
    k(u, v, h, steps=1, backend="cpu")
    want = u0.copy()
    want[1:-1, 1:-1] = 0.25 * (u0[:-2, 1:-1] + u0[2:, 1:-1] + u0[1:-1, :-2] + u0[1:-1, 2:])
    np.testing.assert_allclose(u, want, rtol=1e-15)     # after one step the pair has swapped
    ks = np.arange(3)
    want_h = np.bincount(ks % 3, minlength=3) * 1.0 + np.bincount((ks + 1) % 3, minlength=3) * 2.0
    np.testing.assert_array_equal(h, want_h)


def test_a_swap_pair_naming_a_number_parameter_is_refused_at_the_def():
    def step(t, u, v, alpha):
        for i in lk.range(u.shape[0]):
            v[i] = u[i] * alpha
    with pytest.raises(lk.StepSyntaxError, match="'alpha' is in a swap pair, so it must be an array") as e:
        lk.megakernel(step, swap=[("u", "alpha")])
    assert ":" + str(step.__code__.co_firstlineno + 2) + ":" in str(e.value)      # at the use as a number


def _for_over_array(t, a):
    for x in a:
        a[0] = x


def _for_over_tuple(t, a):
    for i in (1, 2, 3):
        a[i] = 1.0


def _for_into_element(t, a):
    for a[0] in range(3):
        pass


def _for_star_target(t, a):
    for i, *j in lk.grid(3, 2):
        a[i] = 1.0


@pytest.mark.parametrize("fn", [_for_over_array, _for_over_tuple, _for_into_element, _for_star_target])
def test_unsupported_for_loops_are_step_syntax_errors(fn):
    # they crashed the decorator with AttributeError (a later analysis read the loop's range)
    with pytest.raises(lk.StepSyntaxError) as e:
        lk.megakernel(fn)
    assert f"in step '{fn.__name__}'" in str(e.value)


def _len_none(t, a):
    a[0] = len()


def _len_two(t, a):
    a[0] = len(a, a)


def _abs_none(t, a):
    a[0] = abs()


def _float_none(t, a):
    a[0] = float()


def _max_one(t, a):
    a[0] = max(a[1])


@pytest.mark.parametrize("fn,fragment", [(_len_none, "len() takes 1 positional argument"),
                                         (_len_two, "len() takes 1 positional argument"),
                                         (_abs_none, "abs() takes 1"), (_float_none, "float() takes 1"),
                                         (_max_one, "max() takes 2 or more")])
def test_builtins_with_the_wrong_number_of_arguments_are_refused_at_the_def(fn, fragment):
    # (they reached Numba, which raised a raw ValueError at the first call)
    with pytest.raises(lk.StepSyntaxError, match=re.escape(fragment)):
        lk.megakernel(fn)


def _float_by_augmented_assignment(t, a):
    n = a.shape[0] // 2
    n += 0.5
    for i in lk.range(n):
        a[i] += 1.0


def _atomic_on_a_local(t, a):
    x = 0.0
    for i in lk.range(a.shape[0]):
        lk.atomic.add(x, 0, 1.0)


def test_a_local_made_a_float_by_augmented_assignment_is_no_loop_bound():
    with pytest.raises(lk.StepSyntaxError, match="lk.range\\(\\) takes integers; 'n' is a float"):
        lk.megakernel(_float_by_augmented_assignment)


def test_lk_atomic_on_a_local_number_is_refused():
    with pytest.raises(lk.StepSyntaxError, match="must be an array: a parameter of the step"):
        lk.megakernel(_atomic_on_a_local)


def _log_with_base(t, a):
    for i in lk.range(a.shape[0]):
        a[i] = math.log(a[i], 2.0)


def _hypot_of_three(t, a):
    for i in lk.range(a.shape[0]):
        a[i] = math.hypot(a[i], 1.0, 2.0)


@pytest.mark.parametrize("fn,fragment", [(_log_with_base, "math.log() takes 1 positional argument in step code, got 2"),
                                         (_hypot_of_three, "math.hypot() takes 2 positional arguments")])
def test_math_functions_with_other_argument_counts_are_refused_at_the_def(fn, fragment):
    # (math.log(x, base) passed and the CPU compile failed with a hint about mixed types)
    with pytest.raises(lk.StepSyntaxError, match=re.escape(fragment)) as e:
        lk.megakernel(fn)
    if fn is _log_with_base:
        assert "math.log(x) / math.log(base)" in str(e.value)


def test_integer_constants_that_int64_arithmetic_gives_are_accepted():
    # the same constants wrap to what Python gives, or stand alone as a uint64 literal
    def fine(t, a, b):
        for i in lk.range(a.shape[0]):
            a[i] = a[i] + (-2 ** 63) * 0 + (2 ** 63 - 1) // 2 ** 62 - (1 << 62) // 2 ** 61
            b[i] = 18446744073709551615 + b[i] * 0

    a, b = np.ones(3), np.zeros(3, np.uint64)
    lk.megakernel(fine)(a, b, steps=1, backend="cpu")
    np.testing.assert_array_equal(a, np.ones(3) + 1 - 2)
    np.testing.assert_array_equal(b, np.full(3, 2 ** 64 - 1, np.uint64))


def red_black_sweep(t, a, f):
    # red-black Gauss-Seidel: each half-step stores the cells of one colour and reads the other's
    n = a.shape[0]
    for i, j in lk.grid((1, n - 1), (1, n - 1)):
        if (i + j + t) % 2 == 0:
            a[i, j] = 0.25 * (a[i - 1, j] + a[i + 1, j] + a[i, j - 1] + a[i, j + 1] - f[i, j])


def every_other_shift(t, a):
    for i in lk.range(0, a.shape[0] - 1, 2):
        a[i] = a[i + 1]                # the odd elements are read, only the even ones stored


def upper_into_lower(t, a):
    for i in lk.range(4):
        a[i] = a[i + 4]                # elements 4..7 read, 0..3 stored


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_in_place_updates_that_store_and_read_disjoint_elements_are_accepted(rng, backend):
    n, steps = (10, 4) if backend == "cuda" else (24, 9)
    a0, f = rng.random((n, n)), rng.random((n, n))
    a = a0.copy()
    lk.megakernel(red_black_sweep)(a, f, steps=steps, backend=backend)
    ref = a0.copy()
    for t in range(steps):
        new = ref.copy()
        for i in range(1, n - 1):
            for j in range(1, n - 1):
                if (i + j + t) % 2 == 0:
                    new[i, j] = 0.25 * (ref[i - 1, j] + ref[i + 1, j] + ref[i, j - 1] + ref[i, j + 1] - f[i, j])
        ref = new
    np.testing.assert_allclose(a, ref, rtol=1e-12, atol=1e-12)
    b0 = rng.random(9)
    b = b0.copy()
    lk.megakernel(every_other_shift)(b, steps=1, backend=backend)
    want = b0.copy()
    want[0:8:2] = b0[1:9:2]
    np.testing.assert_array_equal(b, want)
    b = b0.copy()
    lk.megakernel(upper_into_lower)(b, steps=1, backend=backend)
    want = b0.copy()
    want[:4] = b0[4:8]
    np.testing.assert_array_equal(b, want)


def _bool_cast(t, u, x):
    for i in lk.range(u.shape[0]):
        u[i] = np.bool_(u[i] - x) + 0.5


def test_numpy_bool_cast_is_accepted_under_its_numpy_2_name(rng):
    """NumPy 2 calls np.bool_ 'bool': the cast is allowed (before session 36 it was refused with a
    message that recommended bool_) and follows Python's bool() of the value."""
    u0 = np.round(rng.random(8) * 3)
    u = u0.copy()
    lk.megakernel(_bool_cast)(u, 1.0, steps=1, backend="cpu")
    np.testing.assert_array_equal(u, [float(bool(v - 1.0)) + 0.5 for v in u0])


def test_a_lambda_inside_a_statement_is_refused_as_not_a_def():
    """inspect gives a lambda the lines of the statement around it, which do not parse on their
    own (a for header without its body): a StepSyntaxError, not a raw IndentationError."""
    for step in [lambda t, u: None]:
        with pytest.raises(lk.StepSyntaxError, match="is not a plain 'def' function"):
            lk.megakernel(step)


def test_a_missing_function_of_an_lk_namespace_names_those_it_has():
    def step(t, a):
        lk.atomic.sub(a, 0, 1.0)
    with pytest.raises(lk.StepSyntaxError, match=r"lk\.atomic has no function 'sub'") as info:
        lk.megakernel(step)
    assert "it has lk.atomic.add, lk.atomic.max, lk.atomic.min" in str(info.value)
