"""Steps that loopkern lowers from jnp loop bodies, run through the CUDA code path under Numba's
simulator (many threads, so a missing barrier between a scatter's copy, its atomic adds and its
readers shows) and on the CPU backend, each against a float64 NumPy reference of the loop."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
lax = jax.lax

import loopkern as lk  # noqa: E402
from bench.life import jax_life_step, life_ref  # noqa: E402
from refs import jax_x64  # noqa: E402
from lowered_steps import (lowered, roll_heat_body, roll_heat_ref, run_lowered, wide_roll_body,  # noqa: E402
                           wide_roll_ref)

BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_histogram_of_a_moving_cloud(backend):
    """h.at[bins].add(w): the copy of the old histogram into the new buffer runs over 12 bins,
    the atomic adds over 90 points; every thread must see the whole copy before it adds."""
    h0 = np.arange(12, dtype=np.int32) % 5

    def body(i, h):
        p = jnp.arange(90, dtype=jnp.float32) * 0.37 + i.astype(jnp.float32) * 1.3
        return h.at[jnp.floor(p).astype(jnp.int32) % 15 - 2].add(1 + i % 3)
    got, _, _ = run_lowered(body, h0, 7, backend)
    ref = h0.astype(np.int64)
    for i in range(7):
        p = np.arange(90, dtype=np.float32) * np.float32(0.37) + np.float32(i) * np.float32(1.3)
        b = np.floor(p).astype(np.int64) % 15 - 2
        b = np.where(b < 0, b + 12, b)
        ok = (b >= 0) & (b < 12)
        np.add.at(ref, b[ok], 1 + i % 3)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_sum_read_back_by_a_stencil(backend):
    """A segment_sum whose result is read at neighbouring positions in the next phase: the read
    must wait for every thread's atomic adds."""
    x0 = np.linspace(0.0, 1.0, 40).astype(np.float32)

    def body(i, x):
        seg = (jnp.arange(40) * 7) % 40
        s = jax.ops.segment_sum(x, seg, num_segments=40)
        return 0.5 * x + 0.25 * (jnp.roll(s, 1) + jnp.roll(s, -1))
    got, plan, _ = run_lowered(body, x0, 5, backend)
    assert "lk.atomic.add(" in plan.source and "lk.sync()" in plan.source
    x = x0.astype(np.float64)
    for _ in range(5):
        s = np.zeros(40)
        np.add.at(s, (np.arange(40) * 7) % 40, x)
        x = 0.5 * x + 0.25 * (np.roll(s, 1) + np.roll(s, -1))
    np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unrolled_jacobi_sweeps_of_an_implicit_step(backend):
    """Three Jacobi sweeps per step of backward Euler for 1-D heat (a nested fori_loop that reads
    its carry's neighbours, so it runs unrolled): every sweep must see the whole previous one."""
    u0 = np.sin(np.linspace(0.0, 3.0, 70)).astype(np.float32)
    a = 0.3

    def body(i, u):
        def sweep(j, v):
            nb = jnp.pad(v, 1)
            return (u + a * (nb[:-2] + nb[2:])) / (1 + 2 * a)
        return lax.fori_loop(0, 3, sweep, u)
    got, plan, _ = run_lowered(body, u0, 4, backend)
    assert plan.source.count("lk.sync()") == 2
    u = u0.astype(np.float64)
    for _ in range(4):
        v = u.copy()
        for _ in range(3):
            nb = np.pad(v, 1)
            v = (u + a * (nb[:-2] + nb[2:])) / (1 + 2 * a)
        u = v
    np.testing.assert_allclose(got, u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_phased_jacobi_to_a_tolerance(backend):
    """Jacobi sweeps of an implicit step until they change nothing above a tolerance (a nested
    while_loop that reads its carry's neighbours, run in phases: a sweep, a barrier, the copy
    back, a barrier, the condition's reduction)."""
    u0 = np.cos(np.linspace(0.0, 4.0, 50)).astype(np.float32)
    a = 0.4

    def body(i, u):
        def sweep(c):
            v, err = c
            nb = jnp.pad(v, 1)
            w = (u + a * (nb[:-2] + nb[2:])) / (1 + 2 * a)
            return w, jnp.max(jnp.abs(w - v))
        return lax.while_loop(lambda c: c[1] > 1e-6, sweep, (u, jnp.float32(1.0)))[0]
    got, plan, _ = run_lowered(body, u0, 3, backend)
    assert "while go" in plan.source
    u = u0.astype(np.float64)
    for _ in range(3):
        v, err = u.copy(), 1.0
        while err > 1e-6:
            nb = np.pad(v, 1)
            w = (u + a * (nb[:-2] + nb[2:])) / (1 + 2 * a)
            err, v = np.abs(w - v).max(), w
        u = v
    np.testing.assert_allclose(got, u, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_phased_shifts_with_a_count_from_the_step(backend):
    """A nested fori_loop whose count is the outer step's index plus one (a while loop in
    phases) shifting an integer array by one place per iteration: any read of the carry before
    every thread has copied the last iteration back shows as a wrong element."""
    a0 = np.arange(64, dtype=np.int32) * 3 % 17

    def body(i, a):
        return lax.fori_loop(0, i + 1, lambda j, v: jnp.roll(v, 1) + j, a)
    got, plan, _ = run_lowered(body, a0, 5, backend)
    assert "while go" in plan.source
    ref = a0.astype(np.int64)
    for i in range(5):
        for j in range(i + 1):
            ref = np.roll(ref, 1) + j
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_phased_shifts_an_odd_static_number_of_times(backend):
    """17 shifts per step (above the unrolling limit, an odd count: the last iteration's buffer
    is copied back once)."""
    a0 = np.arange(48, dtype=np.int32) * 5 % 23

    def body(i, a):
        return lax.fori_loop(0, 17, lambda j, v: jnp.roll(v, -1) * 2 % 1000 + j, a)
    got, plan, _ = run_lowered(body, a0, 3, backend)
    assert "in range(8)" in plan.source
    ref = a0.astype(np.int64)
    for _ in range(3):
        for j in range(17):
            ref = np.roll(ref, -1) * 2 % 1000 + j
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sort_read_back_by_neighbours(backend):
    """jnp.sort of integers (each element counts its row and stores itself at its rank), read at
    shifted positions in the next phase: the read must wait for every thread's store."""
    a0 = (np.arange(60, dtype=np.int32) * 37) % 101

    def body(i, a):
        s = jnp.sort(a)
        return (jnp.roll(s, 7) * 3 + s + i) % 101
    got, plan, _ = run_lowered(body, a0, 4, backend)
    assert "lk.sync()" in plan.source
    ref = a0.astype(np.int64)
    for i in range(4):
        s = np.sort(ref)
        ref = (np.roll(s, 7) * 3 + s + i) % 101
    np.testing.assert_array_equal(got, ref)


@pytest.mark.sim
@pytest.mark.parametrize("nested", ["unrolled", "phased"])
def test_nested_stencil_loops_in_tile_mode(nested):
    """The stencil analysis takes the unrolled and phased forms of a nested stencil loop for
    stencils (every loop over one index space, constant offsets), so scope="auto" may run them in
    tile mode on a GPU: the same exact shifts there, the scratch buffers' neighbour reads behind
    their barriers."""
    a0 = (np.arange(64, dtype=np.int32) * 7) % 19

    def body(i, a):
        count = 3 if nested == "unrolled" else i + 1
        return lax.fori_loop(0, count, lambda j, v: (jnp.roll(v, 1) * 2 + jnp.roll(v, -1) + j) % 1000, a)
    got, plan, _ = run_lowered(body, a0, 4, "cuda", scope="tile")
    ref = a0.astype(np.int64)
    for i in range(4):
        for j in range(3 if nested == "unrolled" else i + 1):
            ref = (np.roll(ref, 1) * 2 + np.roll(ref, -1) + j) % 1000
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_phased_window_update_keeps_the_cells_outside(backend):
    """A nested loop in phases that writes only a window of its carry (v.at[2:-3].set(...)):
    the two buffers swap roles every iteration and the cells outside the window, written by
    no iteration, must hold the initial values in both (an odd and an even count)."""
    a0 = (np.arange(50, dtype=np.int32) * 11) % 23

    def body(i, a):
        return lax.fori_loop(0, i + 2, lambda j, v: v.at[2:-3].set((v[1:-4] + 2 * v[3:-2] + j) % 97), a * 2 % 89)
    got, plan, _ = run_lowered(body, a0, 3, backend)
    assert "while go" in plan.source
    ref = a0.astype(np.int64)
    for i in range(3):
        v = ref * 2 % 89
        for j in range(i + 2):
            w = v.copy()
            w[2:-3] = (v[1:-4] + 2 * v[3:-2] + j) % 97
            v = w
        ref = v
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_solve_waits_for_the_factorisation(backend):
    """jnp.linalg.solve in the body: one thread factorises and substitutes (lu, two triangular
    solves), the others wait at the barriers before reading the result."""
    rng = np.random.default_rng(5)
    a = rng.normal(size=(12, 12)).astype(np.float32) + 4.0 * np.eye(12, dtype=np.float32)
    x0 = rng.random(12).astype(np.float32)

    def body(i, x):
        return jnp.linalg.solve(jnp.asarray(a), x) + 0.5
    got, plan, _ = run_lowered(body, x0, 3, backend)
    assert plan.source.count("lk.thread_id() == 0") == 3
    x = x0.astype(np.float64)
    for _ in range(3):
        x = np.linalg.solve(a.astype(np.float64), x) + 0.5
    np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-6)


def test_jnp_roll_by_one_is_a_periodic_neighbour_to_the_stencil_analysis():
    """jnp.roll(x, ±1, axis) of the carry is read with its wrap as a conditional expression:
    a periodic stencil of halo one (the two pieces' plain reads were offsets n - 1 apart, a
    halo no tile holds); a roll by s of halo min(s, n - s), s taken modulo n."""
    heat, _, _ = lowered(roll_heat_body, np.zeros(500))
    st = heat.dispatcher.stencil
    assert st.halo == ((1, 1),) and st.periodic == (True,)
    life, _, _ = lowered(lambda i, x: jax_life_step(x), np.zeros((40, 30), np.int32))
    st = life.dispatcher.stencil
    assert st.halo == ((1, 1), (1, 1)) and st.periodic == (True, True)
    # a roll by s (modulo n) is a neighbour min(s, n - s) away, on the side it comes from
    for shift, halo in ((3, (3, 0)), (-7, (0, 7)), (250, (250, 0)), (251, (0, 249)), (-498, (2, 0)), (1003, (3, 0))):
        far, _, _ = lowered(lambda i, x: 0.5 * (jnp.roll(x, shift) + x), np.zeros(500))
        st = far.dispatcher.stencil
        assert st.halo == (halo,) and st.periodic == (True,), (shift, st)
    both, _, _ = lowered(lambda i, x: 0.5 * (jnp.roll(x, 3, axis=0) + jnp.roll(x, -2, axis=1)), np.zeros((40, 30)))
    st = both.dispatcher.stencil
    assert st.halo == ((3, 0), (0, 2)) and st.periodic == (True, True), st


@pytest.mark.sim
@pytest.mark.parametrize("scope", ["grid", "tile"])
def test_jnp_roll_bodies_in_tile_mode_on_the_simulator(scope, rng):
    """Periodic jnp bodies (1-D heat with jnp.roll, Life on a torus) in tile mode (one block in
    the simulator: the wrap reads the tile's own rows) and the grid scope, against NumPy."""
    u0 = rng.random(300)
    got, _, _ = run_lowered(roll_heat_body, u0, 9, "cuda", scope=scope)
    np.testing.assert_allclose(got, roll_heat_ref(u0, 9), rtol=1e-12)
    a0 = (rng.random((24, 20)) < 0.4).astype(np.int32)
    got, _, _ = run_lowered(lambda i, x: jax_life_step(x), a0, 6, "cuda", scope=scope)
    np.testing.assert_array_equal(got, life_ref(a0, 6))


@pytest.mark.parametrize("backend,scope", [("cpu", "auto"), pytest.param("cuda", "grid", marks=pytest.mark.sim),
                                           pytest.param("cuda", "tile", marks=pytest.mark.sim)])
def test_jnp_roll_by_several_cells(backend, scope, rng):
    """A wider periodic stencil written with jnp.roll by 2 and 3 cells (both directions, both
    axes of a 2-D field, and shifts past the extent), against NumPy's roll in float64."""
    opts = {} if scope == "auto" else {"scope": scope}
    a0 = rng.random((12, 9))
    got, _, _ = run_lowered(wide_roll_body, a0, 5, backend, **opts)
    np.testing.assert_allclose(got, wide_roll_ref(a0, 5), rtol=1e-12)
    u0 = rng.random(37)
    got, _, _ = run_lowered(lambda i, x: 0.5 * x + 0.25 * (jnp.roll(x, 5) + jnp.roll(x, -4)), u0, 7, backend,
                            **opts)
    ref = u0.copy()
    for _ in range(7):
        ref = 0.5 * ref + 0.25 * (np.roll(ref, 5) + np.roll(ref, -4))
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def _edge_windows_body(i, x):
    """Windows against every edge of a 7x9 field, each at least half of it (a window whose loads
    are made with indices outside it, or outside the field, reads a wrong cell or fails in the
    simulator)."""
    a = x.at[1:, :].set(0.5 * (x[:-1, :] + x[1:, :]))              # reads the row above: index i - 1
    b = a.at[:-2, 3:].set(a[2:, :-3] - 0.25 * a[:-2, 3:])         # reads i + 2, j - 3
    c = b + 0.5 * jnp.pad(b[:-2, :-2], ((2, 0), (2, 0)), constant_values=0.25)    # i - 2, j - 2
    return c.at[1:, 1:].add(-0.125 * x[:-1, :-1])                  # the carry itself at i - 1, j - 1


def _edge_windows_ref(x):
    a = x.copy()
    a[1:, :] = 0.5 * (x[:-1, :] + x[1:, :])
    b = a.copy()
    b[:-2, 3:] = a[2:, :-3] - 0.25 * a[:-2, 3:]
    p = np.full_like(b, 0.25)
    p[2:, 2:] = b[:-2, :-2]
    c = b + 0.5 * p
    c[1:, 1:] += -0.125 * x[:-1, :-1]
    return c


@pytest.mark.parametrize("backend", BACKENDS)
def test_windows_at_every_edge_load_only_cells_of_the_field(backend):
    """Windows against every edge of a field: the cells outside each window keep their values and
    no load leaves the field (the simulator raises on an index past the end, where a load made
    outside its window's condition would read past the array on a GPU). Against a float64 NumPy
    reference."""
    x0 = np.random.default_rng(5).standard_normal((7, 9)).astype(np.float32)
    got, _, _ = run_lowered(_edge_windows_body, x0, 4, backend)
    ref = x0.astype(np.float64)
    for _ in range(4):
        ref = _edge_windows_ref(ref)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def _extremes_body(i, x):
    return x.at[0].set(jnp.max(x)).at[1].set(jnp.min(x[2:]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_and_min_of_a_carry_holding_a_nan_are_nan(backend):
    """jnp.max and jnp.min are NaN when any element is (as in JAX), wherever the NaN is among
    the threads that reduce it; without one, exactly NumPy's extremes."""
    rng = np.random.default_rng(11)
    for k in [None, 2, 3, 31, 32, 40, 63, 95]:
        x0 = rng.standard_normal(96).astype(np.float32)
        if k is not None:
            x0[k] = np.nan
        got, _, _ = run_lowered(_extremes_body, x0, 1, backend)
        want = x0.copy()
        want[0], want[1] = np.max(x0), np.min(x0[2:])
        np.testing.assert_array_equal(got, want)


def _zero_division_body(i, x):
    # rsqrt of |x|: the simulator runs Python's math.sqrt, which raises on a negative number
    return jnp.stack([x[0] ** -2, x[0] ** -3, jax.lax.rsqrt(jnp.abs(x[0])), jnp.sign(x[0])])


@pytest.mark.parametrize("backend", BACKENDS)
def test_division_by_zero_and_signed_zeros_as_ieee(backend):
    """x ** -n and rsqrt of a zero are infinities with IEEE's signs (the CPU backend and the
    simulator raised ZeroDivisionError: Python's division), and sign keeps a zero's sign."""
    x = np.array([0.0, -0.0, 2.0, 0.5, -3.0, 1e-3], np.float32)
    x0 = np.stack([x, x, x, x])
    got, _, _ = run_lowered(_zero_division_body, x0, 1, backend)
    v = x.astype(np.float64)
    with np.errstate(divide="ignore"):
        want = np.stack([v ** -2.0, v ** -3.0, 1.0 / np.sqrt(np.abs(v)), np.sign(v)])
    want[3] = np.where(v == 0, v, want[3])                  # sign(-0.0) is -0.0 in JAX
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _int_division_body(i, x):
    return jnp.stack([jax.lax.div(x[0], x[1]), jax.lax.rem(x[0], x[1]), x[0] // x[1], x[0] % x[1]])


def _wrap32(v):
    return (v + 2 ** 31) % 2 ** 32 - 2 ** 31


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_division_and_remainder_at_every_edge(backend):
    """lax.div / lax.rem (truncated, as XLA: x / 0 = -1, x rem 0 = x, MIN / -1 = MIN) and
    jnp's floor division and mod built on them, for every pair of int32 edge values (zero, +-1,
    MIN, MAX: abs(MIN) stays negative, which the lowering once divided by), against Python's
    exact integers wrapped to int32."""
    edge = [0, 1, -1, 2, -2, 7, -7, 31, -32, 2 ** 31 - 1, -2 ** 31, 2 ** 31 - 2, -2 ** 31 + 1]
    a = np.repeat(np.array(edge, np.int32), len(edge))
    b = np.tile(np.array(edge, np.int32), len(edge))
    x0 = np.stack([a, b, a, b])
    got, _, _ = run_lowered(_int_division_body, x0, 1, backend)
    want = np.zeros_like(x0)
    for k, (p, q) in enumerate(zip(a.tolist(), b.tolist())):
        if q == 0:
            div, rem = -1, p
        else:
            div = abs(p) // abs(q) * (1 if (p < 0) == (q < 0) else -1)
            rem = p - div * q
        fdiv = div - 1 if q != 0 and rem != 0 and (rem < 0) != (q < 0) else div
        fmod = rem + q if q != 0 and rem != 0 and (rem < 0) != (q < 0) else rem
        want[:, k] = [_wrap32(div), _wrap32(rem), _wrap32(fdiv), _wrap32(fmod)]
    np.testing.assert_array_equal(got[:2], want[:2])
    # jnp's floor forms of a zero divisor are JAX's own arithmetic on the -1 and x above
    nz = b != 0
    np.testing.assert_array_equal(got[2:, nz], want[2:, nz])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cbrt_and_exp2_against_numpy(backend):
    """jnp.cbrt and jnp.exp2 (per element, to rounding) with infinities, NaN, signed zeros and
    an overflow, against NumPy in float64."""
    x = np.array([-27.0, -8.0, -0.0, 0.0, 0.001, 2.0, 1000.0, 200.0, -200.0, np.inf, -np.inf, np.nan],
                 np.float32)
    got, _, _ = run_lowered(lambda i, v: jnp.stack([jnp.cbrt(v[0]), jnp.exp2(v[1])]), np.stack([x, x]), 1, backend)
    v = x.astype(np.float64)
    with np.errstate(over="ignore"):
        want = np.stack([np.cbrt(v), np.exp2(v)]).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)
    np.testing.assert_array_equal(np.signbit(got[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))


def _ieee_max(a, b):
    """IEEE 754-2019 maximum (XLA's max): a NaN wins, +0 is above -0."""
    if a != a or b != b:
        return np.nan
    if a == b == 0:
        return a if math.copysign(1.0, a) > 0 else b
    return max(a, b)


def _ieee_min(a, b):
    if a != a or b != b:
        return np.nan
    if a == b == 0:
        return a if math.copysign(1.0, a) < 0 else b
    return min(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_maximum_minimum_clip_and_axis_extremes_with_signed_zeros(backend):
    """jnp.maximum / minimum / clip per element and max / min along an axis are IEEE's maximum
    and minimum, as XLA's: a NaN wins and +0 is above -0, in either order."""
    v = [0.0, -0.0, np.nan, 1.0, -1.0, np.inf, -np.inf]
    a = np.repeat(np.array(v, np.float32), len(v))
    b = np.tile(np.array(v, np.float32), len(v))
    x0 = np.stack([a, b, a, b])

    def body(i, x):
        pair = x[:2].reshape(2, -1)
        return jnp.stack([jnp.maximum(x[0], x[1]), jnp.minimum(x[0], x[1]),
                          jnp.max(pair, axis=0), jnp.clip(x[0], -0.0, 0.0)])
    got, _, _ = run_lowered(body, x0, 1, backend)
    want = np.array([[_ieee_max(p, q) for p, q in zip(a, b)], [_ieee_min(p, q) for p, q in zip(a, b)],
                     [_ieee_max(p, q) for p, q in zip(a, b)], [_ieee_min(_ieee_max(p, -0.0), 0.0) for p in a]],
                    np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))


SHIFTS = {"shl": jax.lax.shift_left, "sra": jax.lax.shift_right_arithmetic, "srl": jax.lax.shift_right_logical}


def _shift_ref(kind, x, s, dtype):
    """XLA's shift of the N-bit integer x by s, with Python's integers: a count outside
    [0, N) gives 0 (the top bit in every bit for an arithmetic right shift)."""
    bits = np.dtype(dtype).itemsize * 8
    u = x % (1 << bits)                                     # the bits of x
    signed = u - (1 << bits) if u >> (bits - 1) else u      # ... read as a signed number
    if kind == "sra":
        r = signed >> (s if 0 <= s < bits else bits - 1)
    elif not 0 <= s < bits:
        r = 0
    else:
        r = u << s if kind == "shl" else u >> s
    return np.array(r % (1 << bits), np.uint64).astype(np.dtype(f"u{bits // 8}")).view(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int8, np.uint8, np.int16])
def test_bit_shifts_at_every_count(backend, dtype):
    """lax.shift_left / shift_right_arithmetic / shift_right_logical for counts inside and
    outside [0, N) (negative ones too) and values with the top bit set, against XLA's
    definition computed with Python's integers."""
    info = np.iinfo(dtype)
    vals = np.array([0, 1, -1, 5, info.max, info.min, -3], np.int64).astype(dtype)
    counts = [-1, 0, 1, 3, 7, 8, 15, 16, 31, 32, 33, 100]
    a = np.repeat(vals, len(counts))
    s = np.tile(np.array(counts, np.int64), len(vals)).astype(dtype)
    for kind, f in SHIFTS.items():
        got, _, _ = run_lowered(lambda i, x, f=f: x.at[0].set(f(x[0], x[1])), np.stack([a, s]), 1, backend)
        want = [_shift_ref(kind, int(p), int(q), dtype) for p, q in zip(a, s)]
        np.testing.assert_array_equal(got[0], np.array(want, dtype), err_msg=kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_64_bit_shifts_at_every_count(backend, dtype):
    """The same for 64-bit values: the logical right shift of int64 and every shift of uint64
    run on the bits as int64 (jl_shl64, jl_srl64, jl_sra64; they ran the lax loop before
    session 44)."""
    info = np.iinfo(dtype)
    vals = np.array([0, 1, -1, 5, int(info.max), int(info.min), -3], dtype=object)
    vals = np.array([int(v) % (1 << 64) for v in vals], np.uint64).view(dtype)
    counts = [-1, 0, 1, 3, 31, 32, 33, 62, 63, 64, 65, 100]
    a = np.repeat(vals, len(counts))
    s = np.tile(np.array(counts, np.int64), len(vals)).view(np.uint64).astype(dtype) if dtype == np.uint64 \
        else np.tile(np.array(counts, np.int64), len(vals))
    with jax_x64():
        for kind, f in SHIFTS.items():
            got, _, _ = run_lowered(lambda i, x, f=f: x.at[0].set(f(x[0], x[1])), np.stack([a, s]), 1, backend)
            want = [_shift_ref(kind, int(p), int(q), dtype) for p, q in zip(a, s)]
            np.testing.assert_array_equal(got[0], np.array(want, dtype), err_msg=kind)


def _random_window_op(rng, shape):
    """One shape-keeping operation on a window of a field, as JAX users write them: a window set
    or added from other windows of the same size, a static dynamic_update_slice, a constant or
    edge pad of a window back to the field's shape, or a roll. Returns (function, description)."""
    kind = rng.choice(["set", "add", "dus", "pad", "pad_edge", "roll"])
    wins, srcs, srcs2 = [], [], []
    for n in shape:
        m = int(rng.integers(1, n))
        lo = int(rng.integers(0, n - m + 1))
        wins.append((lo, lo + m))
        for out in (srcs, srcs2):
            s = int(rng.integers(0, n - m + 1))
            out.append(slice(s, s + m))
    w = tuple(slice(lo, hi) for lo, hi in wins)
    s1, s2 = tuple(srcs), tuple(srcs2)
    c1, c2 = (round(float(c), 3) for c in rng.uniform(-0.7, 0.7, 2))
    if kind == "set":
        f = lambda x: x.at[w].set(c1 * x[s1] + c2 * x[s2])  # noqa: E731
    elif kind == "add":
        f = lambda x: x.at[w].add(c1 * x[s1] * x[s2])  # noqa: E731
    elif kind == "dus":
        f = lambda x: lax.dynamic_update_slice(x, c1 * x[s1] + c2, tuple(lo for lo, _ in wins))  # noqa: E731
    elif kind.startswith("pad"):
        cfg = tuple((lo, n - hi) for (lo, hi), n in zip(wins, shape))
        kw = dict(constant_values=0.25) if kind == "pad" else dict(mode="edge")
        f = lambda x: c2 * x + c1 * jnp.pad(x[s1], cfg, **kw)  # noqa: E731
    else:
        sh = tuple(int(rng.integers(-n, n)) for n in shape)
        f = lambda x: c2 * x + c1 * jnp.roll(x, sh, axis=tuple(range(len(shape))))  # noqa: E731
    return f, f"{kind} window={w} sources={s1},{s2} c={c1},{c2}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(12))
def test_random_window_bodies_match_a_float64_run_of_the_body(backend, seed):
    """Random compositions of window operations on 1-D and 2-D fields of random sizes (windows
    from one cell to all but one, so that some are lowered with unconditional clamped loads and
    some not), squashed by tanh each step; the lowered step against the same body run by
    jax.lax.fori_loop in float64."""
    rng = np.random.default_rng(1000 + seed)
    nd = int(rng.integers(1, 3))
    shape = tuple(int(rng.integers(2, 41 if nd == 1 else 12)) for _ in range(nd))
    ops = [_random_window_op(rng, shape) for _ in range(int(rng.integers(1, 5)))]

    def body(i, x):
        for f, _ in ops:
            x = f(x)
        return jnp.tanh(x)
    x0 = rng.standard_normal(shape).astype(np.float32)
    steps = int(rng.integers(1, 5))
    got, _, _ = run_lowered(body, x0, steps, backend)
    with jax_x64():
        ref = np.asarray(lax.fori_loop(0, steps, body, jnp.asarray(x0, jnp.float64)))
    assert ref.dtype == np.float64
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=str([d for _, d in ops]))



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(10))
def test_random_window_bodies_split_into_interior_and_rim(backend, seed):
    """Lowering.split_loop: random window bodies (as above) whose result is also reduced over
    the whole field each step, lowered to a step whose loops are split into an interior loop
    without conditions and a rim loop of slabs, run with that split step (also where the drop-in
    loops would keep the plain step for tile mode) on threads that do not divide the cells, against
    the body run by jax.lax.fori_loop in float64."""
    rng = np.random.default_rng(2000 + seed)
    for _ in range(100):
        nd = int(rng.integers(1, 4))
        shape = tuple(int(rng.integers(3, 60 if nd == 1 else 14 if nd == 2 else 7)) for _ in range(nd))
        ops = [_random_window_op(rng, shape) for _ in range(int(rng.integers(1, 4)))]

        def body(i, x, ops=ops):
            for f, _ in ops:
                x = f(x)
            y = jnp.tanh(x)
            return y - 0.125 * jnp.max(y) + 0.0625 * jnp.sum(jnp.abs(y[1:]))
        x0 = rng.standard_normal(shape).astype(np.float32)
        _, plan, _ = lowered(body, x0)
        if plan.plain_source is not None:
            break
    else:
        raise AssertionError("no random body had a loop to split")
    assert "_v_ in lk.range(" in plan.source or "_v = lk.num_threads() - 1 - lk.thread_id()" in plan.source
    steps = int(rng.integers(1, 5))
    threads = int(rng.choice([32, 64, 96]))
    scope = dict(scope=str(rng.choice(["grid", "block"]))) if backend == "cuda" else {}
    got, _, _ = run_lowered(body, x0, steps, backend, threads=threads, split=True, **scope)
    with jax_x64():
        ref = np.asarray(lax.fori_loop(0, steps, body, jnp.asarray(x0, jnp.float64)))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=str([d for _, d in ops]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cond_on_a_carried_element_around_a_nested_while_loop(backend):
    """lax.cond on an element of the carry, its taken branch a while_loop to a tolerance (phases,
    barriers and a reduction under the cond): the element is read from the carry's old buffer,
    which no thread writes in the step, so every thread takes the same branch. Both branches
    taken over the steps, against a float64 run of the body."""
    x0 = np.linspace(-1.0, 2.0, 64).astype(np.float32)
    x0[0] = 0.5

    def body(i, x):
        def taken(x):
            return lax.while_loop(lambda v: jnp.max(v) < 5.0, lambda v: v + np.float32(0.75), x)
        return lax.cond(x[0] > 1.0, lambda x: x * np.float32(0.5), taken, x)
    got, plan, _ = run_lowered(body, x0, 6, backend)
    assert "lk.sync()" in plan.source and "while " in plan.source
    x = x0.astype(np.float64)
    for _ in range(6):
        if x[0] > 1.0:
            x = x * 0.5
        else:
            while x.max() < 5.0:
                x = x + 0.75
    np.testing.assert_allclose(got, x, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, threads", [((40, 30), 32), ((12, 9), 64)])
def test_a_reduction_over_the_rim_with_its_loads_issued_early(backend, shape, threads, monkeypatch):
    """A max and a sum over the whole new field, whose rim holds the old values (the largest
    ones here; the sum counts every rim cell once): the rim's first cell per thread has its
    loads before the interior loop and its reductions after (Lowering._prefetch_rim), later
    rim cells run in the loop after it (136 rim cells on 32 threads; 38 on 64). Against a
    float64 NumPy loop, and bit for bit the form without the early loads. Dropping the early
    cells' reductions, or counting them twice, fails it."""
    from loopkern.jaxloops import lower
    # (fields of at most PREFETCH_RIM_MIN_CELLS cells keep their rim loads in the rim loop)
    monkeypatch.setattr(lower, "PREFETCH_RIM_MIN_CELLS", 0)

    def body(i, x):
        new = x.at[1:-1, 1:-1].set(0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
        return new.at[0, 0].set(jnp.max(new) + 0.001 * jnp.sum(new))
    rng = np.random.default_rng(sum(shape) + threads)
    x0 = rng.random(shape).astype(np.float32)
    x0[0, :] += 9.0 * rng.random(shape[1]).astype(np.float32)     # the rim holds the maxima
    x0[1:, -1] += 9.0 * rng.random(shape[0] - 1).astype(np.float32)
    steps = 5
    scope = dict(scope="grid") if backend == "cuda" else {}
    got, plan, _ = run_lowered(body, x0, steps, backend, threads=threads, split=True, **scope)
    head, tail = plan.source.split(" in lk.grid(", 1)
    assert "= c0[0, " in head and "while " in tail, plan.source
    ref = x0.astype(np.float64)
    for _ in range(steps):
        new = ref.copy()
        new[1:-1, 1:-1] = 0.25 * (ref[:-2, 1:-1] + ref[2:, 1:-1] + ref[1:-1, :-2] + ref[1:-1, 2:])
        new[0, 0] = new.max() + 0.001 * new.sum()
        ref = new
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(lower, "PREFETCH_RIM", False)
    late, plan_late, _ = run_lowered(body, x0, steps, backend, threads=threads, split=True, **scope)
    assert plan_late.source.split(" in lk.grid(", 1)[0].count("= c0[") == 0, plan_late.source
    np.testing.assert_array_equal(got, late)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n, threads, blocks", [(37, 32, 1), (203, 64, 1)])
def test_jax_random_bits_in_a_lowered_step(backend, n, threads, blocks):
    """jax.random.bits of a closed-over (legacy, uint32[2]) key folded with the loop index: the
    Threefry-2x32 the lowering spells out (jaxloops.prng), run by the kernel on every thread,
    against an independent NumPy Threefry (refs.np_bits)."""
    from refs import np_bits, np_fold_in
    key = jax.random.PRNGKey(n)

    def body(i, x):
        return x ^ jax.random.bits(jax.random.fold_in(key, i), x.shape, jnp.uint32)
    x0 = np.random.default_rng(n).integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    scope = dict(scope="grid") if backend == "cuda" else {}
    got, _, _ = run_lowered(body, x0, 4, backend, threads=threads, blocks=blocks if backend == "cuda" else 1,
                            **scope)
    ref = x0.copy()
    for i in range(4):
        ref ^= np_bits(np_fold_in(np.asarray(key, np.uint32), i), n)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jax_random_uniform_and_normal_in_a_lowered_step(backend):
    """uniform (random bits made a float through bitcast_convert_type: jl_bits_f32) and normal
    (erf_inv: jl_erfinv32) draws of a closed-over key folded with the index, against the same
    draws made by JAX (float32 rounding apart)."""
    key = jax.random.PRNGKey(5)

    def body(i, x):
        k = jax.random.fold_in(key, i)
        a, b = jax.random.split(k)
        return x + jax.random.uniform(a, x.shape, minval=-1.0) + 0.5 * jax.random.normal(b, x.shape)
    x0 = np.zeros(150, np.float32)
    scope = dict(scope="grid") if backend == "cuda" else {}
    got, _, _ = run_lowered(body, x0, 3, backend, threads=64, **scope)
    ref = np.asarray(jax.lax.fori_loop(0, 3, body, jnp.asarray(x0)))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert 0.8 < float(np.std(got)) < 1.5       # three draws of U(-1, 1) + N(0, 1/4): std ~1.12


@pytest.mark.parametrize("backend", BACKENDS)
def test_jax_random_gamma_in_a_lowered_step(backend):
    """gamma draws (each element's rejection loop, and the loop nested in it, run by the
    element's own thread to its own condition: a vmapped while_loop per element) of a
    closed-over key folded with the index, against the same draws made by JAX."""
    key = jax.random.PRNGKey(11)
    alpha = jnp.asarray(np.linspace(0.2, 4.0, 45, dtype=np.float32))

    def body(i, x):
        return x + jax.random.gamma(jax.random.fold_in(key, i), alpha)
    x0 = np.zeros(45, np.float32)
    scope = dict(scope="grid") if backend == "cuda" else {}
    got, _, _ = run_lowered(body, x0, 2, backend, threads=32, **scope)
    ref = np.asarray(jax.lax.fori_loop(0, 2, body, jnp.asarray(x0)))
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nextafter_of_subnormals_and_around_them(backend):
    """jl_nextafter run directly (no XLA thread flushing subnormals): subnormal operands and
    results, float32, bit for bit against NumPy's IEEE nextafter."""
    fi = np.finfo(np.float32)
    rng = np.random.default_rng(9)
    xs = np.concatenate([[0.0, -0.0, fi.smallest_subnormal, -fi.smallest_subnormal, fi.tiny, -fi.tiny,
                          fi.tiny - fi.smallest_subnormal], rng.standard_normal(25) * fi.tiny]).astype(np.float32)
    toward = np.where(np.arange(xs.size) % 2 == 0, np.inf, -np.inf).astype(np.float32)

    def body(i, x):
        return lax.nextafter(x, jnp.asarray(toward))
    scope = dict(scope="grid") if backend == "cuda" else {}
    got, _, _ = run_lowered(body, xs, 1, backend, threads=32, **scope)
    np.testing.assert_array_equal(got.view(np.uint32), np.nextafter(xs, toward).view(np.uint32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_convolve2d_heat_in_a_lowered_step(backend):
    """A 2-D heat step written with jax.scipy.signal.convolve2d (jaxloops/conv.py: the pad and the
    kernel's nine taps as slices), against float64 NumPy."""
    from jax.scipy.signal import convolve2d
    lap = jnp.asarray(np.array([[0, 1, 0], [1, -4, 1], [0, 1, 0]], np.float32))

    def body(i, x):
        return x + 0.2 * convolve2d(x, lap, mode="same")
    x0 = np.random.default_rng(3).random((13, 19)).astype(np.float32)
    scope = dict(scope="grid") if backend == "cuda" else {}
    got, _, _ = run_lowered(body, x0, 6, backend, threads=64, **scope)
    ref = x0.astype(np.float64)
    for _ in range(6):
        p = np.pad(ref, 1)
        ref = ref + 0.2 * (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * p[1:-1, 1:-1])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jnp_prod_of_a_field_the_step_computes(backend):
    """jnp.prod along an axis and of the whole array (every thread multiplies all of it after the
    barrier behind the new values) of a field computed in the same step, against float64 NumPy."""
    def body(i, x):
        y = x * 1.001
        return 0.5 * y + 0.5 * jnp.prod(y, axis=1, keepdims=True) ** (1 / 7) + 0.001 * jnp.prod(y)
    x0 = np.random.default_rng(4).uniform(0.9, 1.1, (9, 7)).astype(np.float32)
    scope = dict(scope="grid") if backend == "cuda" else {}
    got, _, _ = run_lowered(body, x0, 4, backend, threads=32, **scope)
    ref = x0.astype(np.float64)
    for _ in range(4):
        y = ref * 1.001
        ref = 0.5 * y + 0.5 * np.prod(y, axis=1, keepdims=True) ** (1 / 7) + 0.001 * np.prod(y)
    np.testing.assert_allclose(got, ref, rtol=2e-5)
