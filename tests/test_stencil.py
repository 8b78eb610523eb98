"""The stencil analysis (loopkern/stencil.py): which steps could keep their arrays on chip, and
the halo their reads need. Pure analysis of the validated step: no kernel runs here."""

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern.stencil import NotStencil, Stencil, find_stencil


def stencil_of(fn, swap=()):
    return find_stencil(lk.megakernel(fn, swap=swap).spec)


def wide(t, u, v):
    n = u.shape[0]
    for i in lk.range(2, n - 2):
        v[i] = u[i - 2] + u[i + 2] - u[i + 1]


def one_sided(t, u, v):
    n = u.shape[0]
    for i in lk.range(n - 3):
        v[i] = u[i + 3] + u[i]


def periodic_2d(t, a, b):
    n = a.shape[0]
    m = a.shape[1]
    for i, j in lk.grid(n, m):
        b[i, j] = a[(i + 1) % n, j] + a[i, (j - 2 + m) % m] + a[(i - 1) % a.shape[0], j]


def box_3x5(t, u, v, w):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), (2, m - 2)):
        s = 0.0
        for di in range(-1, 2):
            for dj in range(-2, 3, 2):
                s += u[i + di, j + dj]
        v[i, j] = s * w[0]
        w2 = w[1]
        v[i, j] += w2


def reads_itself_twice(t, u, v, x):
    n = u.shape[0]
    for i in lk.range(n):
        x[i] = x[i] * 2.0       # not a swap array, own cell only: resident
        v[i] = u[i] + x[i]


def back_from_zero(t, u, v):
    n = u.shape[0]
    for i in lk.range(n - 1):
        v[i] = u[i - 1] + u[i + 1]      # u[-1] at i = 0: Python's last element


def shape_unpacked(t, u, v):
    n, m = u.shape
    for i, j in lk.grid(n, m):
        v[i, j] = u[(i + n - 1) % n, j]


def back_from_two(t, u, v):
    n = u.shape[0]
    for i in lk.range(2, n - 1, 3):
        v[i] = u[i - 2] + u[i + 1]      # never below 0


def back_from_a_name(t, u, v, k):
    n = u.shape[0]
    for i in lk.range(k, n - 1):
        v[i] = u[i - 1]                 # k may be 0


def negative_start(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i]
    for i in lk.range(-1, 1):
        v[i] = u[i]                     # v[-1] is the last cell in Python


def columns_from_zero(t, u, v):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), m):
        v[i, j] = u[i - 1, j] + u[i, j - 1]     # column -1 at j = 0


@pytest.mark.parametrize("fn,swap,ndim,halo,periodic,resident", [
    (W.heat_step, [("u", "v")], 1, ((1, 1),), (False,), {0, 1}),
    (wide, [("u", "v")], 1, ((2, 2),), (False,), {0, 1}),
    (one_sided, [("u", "v")], 1, ((0, 3),), (False,), {0, 1}),
    (W.life_step, [("a", "b")], 2, ((1, 1), (1, 1)), (True, True), {0, 1}),
    (W.life_tuple_step, [("a", "b")], 2, ((1, 1), (1, 1)), (True, True), {0, 1}),
    (shape_unpacked, [("u", "v")], 2, ((1, 0), (0, 0)), (True, False), {0, 1}),
    (periodic_2d, [("a", "b")], 2, ((1, 1), (2, 0)), (True, True), {0, 1}),
    (box_3x5, [("u", "v")], 2, ((1, 1), (2, 2)), (False, False), {0, 1}),
    (reads_itself_twice, [("u", "v")], 1, ((0, 0),), (False,), {0, 1, 2}),
    # a negative offset from a loop that may start below it is a negative index, which wraps
    (back_from_zero, [("u", "v")], 1, ((1, 1),), (True,), {0, 1}),
    (back_from_two, [("u", "v")], 1, ((2, 1),), (False,), {0, 1}),
    (columns_from_zero, [("u", "v")], 2, ((1, 0), (1, 0)), (False, True), {0, 1}),
])
def test_stencils_and_their_halos(fn, swap, ndim, halo, periodic, resident):
    s = stencil_of(fn, swap)
    assert isinstance(s, Stencil), s
    assert (s.ndim, s.halo, s.periodic, set(s.resident)) == (ndim, halo, periodic, resident)


def test_the_offsets_of_each_read_are_listed():
    s = stencil_of(box_3x5, [("u", "v")])
    assert s.offsets["u"] == {(di, dj) for di in (-1, 0, 1) for dj in (-2, 0, 2)}
    assert s.offsets["v"] == {(0, 0)}          # the augmented store reads its own cell
    # w is read at a fixed index by every thread: it stays in global memory
    assert 2 not in s.resident


def outside_loop(t, u, v):
    n = u.shape[0]
    c = u[0]                                   # every thread reads one cell of the swap pair
    for i in lk.range(n):
        v[i] = u[i] + c


def written_neighbour(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n):
        v[i] = u[i]
    lk.sync()
    for i in lk.range(1, n):
        u[i] = v[i - 1]                        # reads a cell another thread wrote


def through_a_local(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        ip = i + 1                             # a name bound once to the index plus a literal
        v[i] = u[ip]


def store_through_names(t, u, v):
    n = u.shape[0]
    for i in lk.range(n):
        left = i - 1 if i > 0 else n - 1       # periodic neighbour, named once
        here = i
        v[here] = u[left] + 0.5 * u[here]      # a store through a name does not bind it again


def swapped_index(t, u, v):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid(n, m):
        v[i, j] = u[j, i]


def gathered(t, u, v, idx):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[idx[i]]


def scaled(t, u, v):
    n = u.shape[0]
    for i in lk.range(n // 2):
        v[i] = u[2 * i]


def mixed_dims(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i]
    for i, j in lk.grid(w.shape[0], w.shape[1]):
        w[i, j] = 0.0


def atomic_into_swap(t, u, v):
    n = u.shape[0]
    for i in lk.range(n):
        lk.atomic.add(v, (i * 7) % n, u[i])


def _helper(a, i):
    return a[i]


def through_helper(t, u, v):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = _helper(u, i)


def no_loop(t, x, r):
    x[0] = x[0] * r


def wrap_other_extent(t, u, v, w):
    n = w.shape[0]
    for i in lk.range(u.shape[0]):
        v[i] = u[(i + 1) % n]                  # wraps at another array's extent


def store_in_a_tuple(t, u, v):
    n = u.shape[0]
    x = 0.0
    for i in lk.range(n - 1):
        v[i + 1], x = u[i] + x, 0.0            # a store at i + 1 (it was taken for a read)


def sequential_offset_rebound(t, u, v):
    n = u.shape[0]
    for i in lk.range(5, n):
        acc = 0.0
        for d in range(-1, 1):
            d = d * 5                          # reads u[i - 5], not u[i - 1]
            acc += u[i + d]
        v[i] = acc


def loop_variable_rebound_in_a_tuple(t, u, v):
    n = u.shape[0]
    for i in lk.range(3, n):
        i, z = i - 3, 0
        v[i] = u[i] + z


def extent_rebound(t, u, v):
    n = u.shape[0]
    n = n - 3
    for i in lk.range(n):
        v[i] = u[(i + 1) % n]                  # wraps at n - 3, not at the array's extent


def over_another_extent(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i]
    for j in lk.range(w.shape[0]):
        w[j] = w[j] + u[j % n]                 # w may be longer than u: j past u's cells


def guarded_past_the_extent(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i]
    for j in lk.range(n + 2):
        w[j] = u[j] if j < n else 1.0


def from_minus_three(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i]
    for j in lk.range(-3, n):
        w[j + 3] = u[j] if j >= 0 else -1.0


def grid_past_the_rows(t, u, v, w):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), m):
        v[i, j] = u[i, j]
    for i, j in lk.grid(w.shape[0], m):
        w[i, j] = u[i, j] if i < n else 1.0


@pytest.mark.parametrize("fn,swap,reason", [
    (store_in_a_tuple, [("u", "v")], "written by the step and accessed away from the written cell"),
    (sequential_offset_rebound, [("u", "v")], "the variable 'd' of a sequential loop is assigned in its body"),
    (loop_variable_rebound_in_a_tuple, [("u", "v")], "the loop variable 'i' is assigned in the loop"),
    (extent_rebound, [("u", "v")], "not its loop index plus a constant"),
    (outside_loop, [("u", "v")], "'u' is accessed outside the parallel loops"),
    (written_neighbour, [("u", "v")], "written by the step and accessed away from the written cell"),
    (swapped_index, [("u", "v")], "not its loop index plus a constant"),
    (gathered, [("u", "v")], "not its loop index plus a constant"),
    (scaled, [("u", "v")], "not its loop index plus a constant"),
    (mixed_dims, [("u", "v")], "parallel loops over 1 and 2 dimensions"),
    (atomic_into_swap, [("u", "v")], "not its loop index plus a constant"),
    (through_helper, [("u", "v")], "passed to a helper function"),
    (no_loop, [], "no parallel loop"),
    (wrap_other_extent, [("u", "v")], "not its loop index plus a constant"),
    # a loop that starts below 0 writes a swapped array's last cells in Python; in tile mode
    # the block running that index holds only a copy of them
    (negative_start, [("u", "v")], "'v' is written at a negative index"),
    # tile mode runs the indices of its tiles only, in a loop that names a swap pair's array:
    # indices past the pair's extent (or below 0) would run nowhere
    (over_another_extent, [("u", "v")], "its stop may lie beyond the arrays' extent"),
    (guarded_past_the_extent, [("u", "v")], "its stop may lie beyond the arrays' extent"),
    (from_minus_three, [("u", "v")], "its start is below 0"),
    (back_from_a_name, [("u", "v")], "its start may be below 0"),
    (grid_past_the_rows, [("u", "v")], "its stop may lie beyond the arrays' extent"),
])
def test_what_is_not_a_stencil_says_why_and_where(fn, swap, reason):
    s = stencil_of(fn, swap)
    assert isinstance(s, NotStencil), s
    assert reason in s.reason
    import inspect
    first = inspect.getsourcelines(fn)[1]
    assert first <= s.line < first + len(inspect.getsourcelines(fn)[0])


def test_arrays_outside_the_pattern_stay_in_global_memory():
    # a histogram updated atomically and a per-step record are not resident, and do not stop
    # the swap pair from being a stencil
    def step(t, u, v, hist, rec):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            v[i] = 0.5 * (u[i - 1] + u[i + 1])
            lk.atomic.add(hist, 0, 1)
        lk.sync()
        total = lk.sum(v[1] * 0.0)
        if lk.thread_id() == 0:
            rec[t] = total
    s = find_stencil(lk.megakernel(step, swap=[("u", "v")]).spec)
    assert isinstance(s, NotStencil) and "'v' is accessed outside the parallel loops" in s.reason

    def step2(t, u, v, hist, rec):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            v[i] = 0.5 * (u[i - 1] + u[i + 1])
            lk.atomic.add(hist, 0, 1)
        if lk.thread_id() == 0:
            rec[t] = 1.0
    s = find_stencil(lk.megakernel(step2, swap=[("u", "v")]).spec)
    assert isinstance(s, Stencil) and set(s.resident) == {0, 1} and s.halo == ((1, 1),)
    np.testing.assert_equal(sorted(s.offsets["u"]), [(-1,), (1,)])


def life_conditional(t, a, b):
    n = a.shape[0]
    m = a.shape[1]
    for i, j in lk.grid(n, m):
        up = i - 1 if i > 0 else n - 1
        dn = i + 1 if i < n - 1 else 0
        lf = m - 1 if j == 0 else j - 1
        rt = 0 if j == m - 1 else j + 1
        s = a[up, lf] + a[up, j] + a[up, rt] + a[i, lf] + a[i, rt] + a[dn, lf] + a[dn, j] + a[dn, rt]
        b[i, j] = 1 if (s == 3 or (s == 2 and a[i, j] == 1)) else 0


def wrong_wrap(t, a, b):
    n = a.shape[0]
    for i in lk.range(n):
        up = i - 1 if i > 0 else 0           # clamps instead of wrapping: not a constant offset
        b[i] = a[up]


def wide_wrap(t, u, v):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i - 2 if i >= 2 else i - 2 + n] + u[i + 3 if i < n - 3 else i + 3 - n]


def wide_wrap_off_by_one(t, u, v):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i - 2 if i >= 2 else i - 3 + n]     # reads i - 3 + n at i < 2: not i - 2 wrapped


def wide_wrap_wrong_test(t, u, v):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i + 3 if i < n - 2 else i + 3 - n]  # i + 3 at i = n - 3: past the end


def alias_of_a_changing_name(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        d = 1
        ip = i + d                           # names a non-literal: not followed
        v[i] = u[ip]


def test_periodic_neighbours_written_as_conditional_expressions():
    s = stencil_of(life_conditional, [("a", "b")])
    assert isinstance(s, Stencil), s
    assert (s.ndim, s.halo, s.periodic, set(s.resident)) == (2, ((1, 1), (1, 1)), (True, True), {0, 1})
    assert s.offsets["a"] == {(di, dj) for di in (-1, 0, 1) for dj in (-1, 0, 1)}
    s = stencil_of(wide_wrap, [("u", "v")])
    assert isinstance(s, Stencil) and s.halo == ((2, 3),) and s.periodic == (True,), s
    for fn in (wrong_wrap, alias_of_a_changing_name, wide_wrap_off_by_one, wide_wrap_wrong_test):
        r = stencil_of(fn, [(fn.__code__.co_varnames[1], fn.__code__.co_varnames[2])])
        assert isinstance(r, NotStencil) and "not its loop index plus a constant" in r.reason, (fn.__name__, r)


def test_a_name_bound_once_to_the_index_plus_a_constant_is_followed():
    s = stencil_of(through_a_local, [("u", "v")])
    assert isinstance(s, Stencil) and s.halo == ((0, 1),) and s.offsets["u"] == {(1,)}
    # names inside a store's index are read, not bound: the store v[here] keeps 'here' an alias
    s = stencil_of(store_through_names, [("u", "v")])
    assert isinstance(s, Stencil), s
    assert s.halo == ((1, 0),) and s.periodic == (True,) and s.offsets["u"] == {(-1,), (0,)}


def five_cells(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    lk.sync()
    for i in lk.range(2, 5):
        v[i] = v[i] + 1.0


def last_two_down(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    lk.sync()
    for i in lk.range(n - 1, n - 3, -1):
        v[i] = v[i] + u[i]


def test_the_cells_a_loops_literal_bounds_need():
    """Bounds that are literals, or the extent plus a literal, are checked when the arrays are
    known: min_rows is the fewest cells for which each loop stays inside the swap pair."""
    assert stencil_of(five_cells, [("u", "v")]).min_rows == 5
    assert stencil_of(last_two_down, [("u", "v")]).min_rows == 2      # n - 1 and n - 2: n >= 2
    assert stencil_of(W.heat_step, [("u", "v")]).min_rows == 0         # lk.range(0, n, n - 1)
