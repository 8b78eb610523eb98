"""Which indices skip Python's negative-index wraparound (loopkern.index_bounds), and that the
ones that do not keep Python's meaning: a[-1] is the last element, on every backend."""

import ast
import textwrap

import numpy as np
import pytest

import loopkern as lk
from loopkern.index_bounds import mark_nonneg_indices
from loopkern.spec import INTRINSIC_PREFIX


def _marked(src, arrays=("a", "b"), params=("t", "a", "b", "k")):
    """The index expressions wrapped as unsigned in the function body ``src``."""
    body = ast.parse(textwrap.dedent(src).replace("lk.", INTRINSIC_PREFIX)).body
    out = mark_nonneg_indices(body, params, {params.index(a) for a in arrays}, "t")
    return sorted(ast.unparse(n.args[0]) for n in ast.walk(ast.Module(body=out, type_ignores=[]))
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "uint64")


def test_stencil_offsets_inside_the_range_are_proven():
    assert _marked("""
        n = a.shape[0]
        for i in lk.range(1, n - 1):
            b[i] = a[i - 1] + a[i + 1]
    """) == ["i", "i + 1", "i - 1"]


def test_offsets_reaching_below_zero_keep_the_wraparound():
    assert _marked("""
        for i in lk.range(1, a.shape[0]):
            b[i] = a[i - 2] + a[k] + a[i - k]
    """) == ["i"]


def test_each_loop_gives_its_own_variable_its_bound():
    # 'i' runs from 1 in the first loop and from 0 in the second: i - 1 is safe only in the first
    assert _marked("""
        for i in lk.range(1, 9):
            b[i] = a[i - 1]
        for i in lk.range(0, 9):
            b[i] = a[i - 1]
    """) == ["i", "i", "i - 1"]


def test_a_loop_variable_reassigned_in_its_body_is_not_trusted():
    assert _marked("""
        for i in lk.range(1, 9):
            i = i - 3
            b[i] = a[i + 1]
    """) == []


def test_modulo_descending_ranges_grids_and_builtins():
    assert _marked("""
        n = a.shape[0]
        for i, j in lk.grid((1, n), n):
            b[i - 1, (j - 1) % n] = a[max(i - 5, 0), min(j, 3)]
        for i in range(n - 1, 0, -1):
            b[i - 1] = a[abs(i - 4)]
        b[t] = a[lk.thread_id()]
    """) == sorted(["(j - 1) % n", "abs(i - 4)", "i - 1", "i - 1", INTRINSIC_PREFIX + "thread_id()",
                    "max(i - 5, 0)", "min(j, 3)", "t"])


def test_threads_counted_from_the_last_one_down():
    # the rim loop of a split drop-in loop (jaxloops Lowering.split_loop) walks down from the
    # last thread: lk.num_threads() - 1 - lk.thread_id() >= 0, += lk.num_threads() keeps it; a
    # max() of an unbounded argument stays unbounded (it may be a float: no index then)
    assert _marked("""
        r = lk.num_threads() - 1 - lk.thread_id()
        while r < 9:
            b[r] = a[max(k - 3, r)] + a[lk.num_threads() - 2 - lk.thread_id()] + a[min(r, k)]
            r += lk.num_threads()
        b[lk.num_threads() - 1] = a[lk.num_threads() - lk.thread_id()] + a[lk.thread_id() - lk.num_threads()]
    """) == [INTRINSIC_PREFIX + "num_threads() - 1", INTRINSIC_PREFIX + "num_threads() - " + INTRINSIC_PREFIX
             + "thread_id()", "r"]


def test_locals_take_the_least_bound_of_all_their_assignments():
    assert _marked("""
        m = 2
        m += a.shape[0]
        w = 0
        w -= 1
        x = 3
        x = k
        f = 2.0 * t
        b[m - 2] = a[w] + a[x] + a[f] + a[m]
    """) == ["m", "m - 2"]


def test_names_that_are_not_arrays_are_left_alone():
    # a scalar parameter or a local (a tuple, say) is not an array: its subscripts keep their form
    assert _marked("""
        s = (1, 2)
        b[0] = s[t] + k[t]
    """) == []


def test_a_cycle_of_assignments_is_unbounded():
    assert _marked("""
        x = 0
        y = x - 1
        x = y + 1
        b[x] = a[y]
    """) == []


def wrap_step(t, u, v):
    # v[i] = u[i - 1] for every i: at i == 0 that is u[-1], the last element (Python's meaning)
    for i in lk.range(0, u.shape[0]):
        v[i] = u[i - 1]
    lk.sync()       # (the loops' index spaces differ: v[i] is another thread's in the second)
    for i in lk.range(1, u.shape[0]):
        v[i] = v[i] + u[i - 1] - u[i - 1]


BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_indices_still_wrap_around(backend, rng):
    u0 = rng.random(37)
    v = np.zeros_like(u0)
    lk.megakernel(wrap_step)(u0, v, steps=1, backend=backend)
    np.testing.assert_array_equal(v, np.roll(u0, 1))


def test_periodic_neighbours_inside_the_grid_are_proven():
    # inside lk.grid(n, m) the body runs only if n >= 1, so n - 1 is a valid row; the test of
    # each conditional expression holds in its first branch
    assert _marked("""
        n = a.shape[0]
        m = a.shape[1]
        for i, j in lk.grid(n, m):
            up = i - 1 if i > 0 else n - 1
            lf = j - 1 if j >= 1 else m - 1
            dn = i + 1 if i < n - 1 else 0
            b[i, j] = a[up, lf] + a[dn, j]
    """) == ["dn", "i", "j", "j", "lf", "up"]


def test_tests_bound_what_they_compare_where_they_hold():
    assert _marked("""
        n = a.shape[0]
        for i in lk.range(0, n):
            x = a[i - 1] if 0 <= i - 1 < n else a[i]
            y = a[i - 1] if i == 0 else a[i - 2]
            z = 1 if i > 1 and a[i - 2] > 0 else 0
            w = 1 if i > 1 or a[i - 2] > 0 else 0
            if k >= 0 and i - k >= 1:
                b[i - 1] = a[i - k - 1] + a[k]
            if i > 0:
                b[i] = a[i - 1]
            else:
                b[i] = a[i - 1]
    """) == sorted(["i - 1", "i", "i - 2", "i - k - 1", "k", "i", "i - 1", "i"])


def test_where_a_comparison_was_false_its_complement_holds():
    # an else branch (of an if or a conditional expression) knows its test failed: i < 2 false
    # is i >= 2 for an integer; an or, a not (and an and, a chain) give nothing there
    assert _marked("""
        n = a.shape[0]
        for i in lk.range(0, n):
            x = a[0] if i < 2 else a[i - 2]
            y = a[0] if i <= 2 else a[i - 3]
            z = a[0] if i < 3 else a[i - 4]
            w = a[0] if 3 > i else a[i - 3]
            if i < 4:
                b[i] = 0.0
            else:
                b[i - 4] = a[i - 4]
            if i < 5 or k < 0:
                b[i] = 0.0
            else:
                b[i] = a[i - 5]
            if not i >= 6:
                b[i] = 0.0
            else:
                b[i] = a[i - 6]
    """) == sorted(["i - 2", "i - 3", "i - 3", "i", "i - 4", "i - 4", "i", "i", "i", "i"])


def test_a_name_assigned_under_its_guard_loses_the_guards_fact():
    assert _marked("""
        n = a.shape[0]
        for i in lk.range(0, n):
            j = i
            if j > 0:
                j = j - 2
                b[i] = a[j]
            while j > 0:
                b[j - 1] = 0.0
                j -= 1
        for i in range(n):
            n = n - 3
            b[0] = a[n - 1]
    """) == ["i"]


def test_floats_and_calls_give_no_fact():
    # a float compared to 0 may be 0.5 (it is never an index itself); a call may differ each time
    assert _marked("""
        for i in lk.range(0, 8):
            if 0.5 < i:
                b[i] = a[i - 1]
            if min(i, k) > 0:
                b[i] = a[min(i, k) - 1]
    """) == ["i", "i"]


def test_an_assignment_is_bounded_where_it_is_made():
    # x = i - 1 is made where i >= 0, though it is used where i >= 1
    assert _marked("""
        for k in lk.range(0, 8):
            x = 0
            for i in range(0, 1):
                x = i - 1
            for i in range(1, 2):
                b[k] = a[x] + i
    """) == ["k"]


def stale_bound_step(t, u, v):
    for k in lk.range(0, v.shape[0]):
        x = 0
        for i in range(0, 1):
            x = i - 1           # -1: u[x] is the last element
        for i in range(1, 2):
            v[k] = u[x] + i


def periodic_step(t, u, v):
    n = u.shape[0]
    for i in lk.range(0, n):
        left = i - 1 if i > 0 else n - 1
        right = i + 1 if i < n - 1 else 0
        v[i] = u[left] - u[right] + (u[i - 1] if 0 <= i - 1 else 10.0 * u[i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_guarded_and_stale_indices_mean_what_python_means(backend, rng):
    u0 = rng.random(37)
    v = np.zeros_like(u0)
    lk.megakernel(stale_bound_step)(u0, v, steps=1, backend=backend)
    np.testing.assert_array_equal(v, u0[-1] + 1)
    v = np.zeros_like(u0)
    lk.megakernel(periodic_step)(u0, v, steps=1, backend=backend)
    ref = np.roll(u0, 1) - np.roll(u0, -1) + np.where(np.arange(37) >= 1, np.roll(u0, 1), 10.0 * u0)
    np.testing.assert_array_equal(v, ref)


# -- random guarded indices against the plain-Python interpreter -----------------------------
# Steps whose indices are offsets of the loop index, of a parameter and of locals bound under
# conditional expressions, read under random tests (and, or, not, chained comparisons, an if
# with an else, where a single comparison's complement holds): every index lies in [-n, n), so
# each is valid Python, and a negative one means
# an element counted from the end. A wrongly proven index would be read as a huge unsigned one:
# the simulator raises, the CPU backend reads far outside the array.

GUARD_TESTS = ["i > {c}", "i >= {c}", "0 <= i - {c}", "a >= {c}", "b > {c} - 1", "0 <= a - {c} < n",
               "i - {c} >= 0 and a > {d}", "i > {c} or k > {d}", "not i < {c}", "{c} <= b", "k >= {c}",
               "a == {c}", "i - k >= {c}", "i < {c}", "{c} > a", "b <= {c}", "i != {c}"]
GUARD_LOCALS = ["i - {c}", "i - {c} if i > {d} else n - {e}", "i - {c} if {d} <= i else 0", "k - {c}",
                "n - 1 - i", "max(i - {c}, {d})", "min(i, k) - {c}", "i - {c} if i > {d} else i - {e}",
                "max(n - 1 - i - {c}, {d})", "max(k - 9, i - {c})"]
GUARD_INDICES = ["i", "i - {c}", "a", "b", "a - {c}", "k - {c}", "n - 1 - i - {c}",
                 "u.shape[0] - {e}", "b - {c} if b > {d} else a", "i - {c} if i >= {c} else i - {d}"]


def _guarded_program(rng, name):
    def fill(template):
        c, d, e = rng.integers(0, 6), rng.integers(0, 6), rng.integers(1, 6)
        return template.format(c=c, d=d, e=e)
    pick = lambda options: fill(options[rng.integers(len(options))])  # noqa: E731
    c = int(rng.integers(1, 6))
    b_expr = pick(GUARD_LOCALS)
    a_expr = pick(GUARD_LOCALS + ["b - {c} if b >= {c} else b", "b if {d} < b else i"])
    return "\n".join([
        f"def {name}(t, u, v, k):",
        "    n = u.shape[0]",
        f"    for i in lk.range({rng.integers(0, 4)}, n):",
        f"        b = {b_expr}",
        f"        a = {a_expr}",
        # the else branch's index is negative where the test fails (when the range starts low)
        f"        w = u[i - {c}] if i >= {c} else u[i - {rng.integers(1, c + 1)}]",
        f"        if {pick(GUARD_TESTS)}:",
        f"            v[i] = u[{pick(GUARD_INDICES)}] + (u[{pick(GUARD_INDICES)}] if {pick(GUARD_TESTS)} else w)",
        "        else:",
        f"            v[i] = 2.0 * u[{pick(GUARD_INDICES)}] + w",
        ""])


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_guarded_indices_mean_what_python_means(backend, tmp_path, rng):
    import importlib.util

    import interp
    count = 40 if backend == "cpu" else 12
    progs = [_guarded_program(rng, f"guarded_{k}") for k in range(count)]
    path = tmp_path / f"guarded_{backend}.py"
    path.write_text("import loopkern as lk\n\n\n" + "\n\n".join(progs))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for k, src in enumerate(progs):
        fn = getattr(mod, f"guarded_{k}")
        n, kk = 40, int(rng.integers(0, 6))
        u0 = rng.random(n)
        want = np.zeros(n)
        interp.run(fn, [u0.copy(), want, kk], 1)
        got = np.zeros(n)
        lk.megakernel(fn)(u0.copy(), got, kk, steps=1, backend=backend)
        np.testing.assert_array_equal(got, want, err_msg=src)
