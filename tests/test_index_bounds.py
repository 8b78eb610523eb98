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
