"""lk.fori_loop / while_loop / scan on the GPU (JAX's GPU backend, kernel.jax's FFI path): jnp heat
and Jacobi bodies and QuantEcon's quadratic map, against float64 NumPy references, eagerly and
inside jax.jit; the generated kernel must run on the GPU, not fall back to jax.lax."""

import warnings

import numpy as np
import pytest

import loopkern as lk
import workloads as W

from .jax_gpu import jax, jnp, require_gpu_jax

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def gpu_jax():
    require_gpu_jax()
    with warnings.catch_warnings():
        warnings.simplefilter("error", lk.JaxLoopWarning)      # a fallback to jax.lax is a failure here
        yield


def heat_body(alpha):
    def body(i, u):
        return u.at[1:-1].set(u[1:-1] + alpha * (u[:-2] - 2 * u[1:-1] + u[2:]))
    return body


def heat_ref(u0, steps, alpha):
    u = np.asarray(u0, np.float64).copy()
    for _ in range(steps):
        u[1:-1] = u[1:-1] + alpha * (u[:-2] - 2 * u[1:-1] + u[2:])
    return u


@pytest.mark.parametrize("n", [4099, 65536 + 7])
def test_heat_fori_loop_on_the_gpu(n, rng):
    u0 = rng.random(n).astype(np.float32)
    steps = 301
    got = jax.jit(lambda u: lk.fori_loop(0, steps, heat_body(np.float32(0.25)), u, fallback="error"))(u0)
    ref = heat_ref(u0, steps, 0.25)
    assert got.dtype == jnp.float32 and got.shape == (n,)
    assert np.abs(np.asarray(got, np.float64) - ref).max() < 1e-5


def test_jacobi_while_loop_on_the_gpu(rng):
    side, tol = 96, np.float32(1e-4)
    u0 = np.zeros((side, side), np.float32)
    u0[0, :] = rng.random(side)

    def body(c):
        x, _, k = c
        new = x.at[1:-1, 1:-1].set(np.float32(0.25) * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
        return new, jnp.max(jnp.abs(new - x)), k + 1
    x, err, k = lk.while_loop(lambda c: (c[1] > tol) & (c[2] < 50000), body,
                              (jnp.asarray(u0), jnp.float32(jnp.inf), jnp.int32(0)), fallback="error")
    # the float64 reference with the same stopping rule
    r = u0.astype(np.float64)
    steps = 0
    while True:
        new = r.copy()
        new[1:-1, 1:-1] = 0.25 * (r[:-2, 1:-1] + r[2:, 1:-1] + r[1:-1, :-2] + r[1:-1, 2:])
        e = np.abs(new - r).max()
        r, steps = new, steps + 1
        if not (e > float(tol) and steps < 50000):
            break
    assert abs(int(k) - steps) <= 3 and float(err) <= float(tol)
    assert np.abs(np.asarray(x, np.float64) - r).max() < 1e-3


@pytest.mark.parametrize("pos", [(1, 1), (254, 254), (128, 7), (3, 200)])
def test_while_loop_stops_when_its_reduction_turns_nan_on_the_gpu(pos):
    """A NaN appears in one cell in the fifth step; jnp.max of the change is then NaN, NaN > tol
    is false and the loop stops there, as jax.lax.while_loop does on a GPU, wherever the cell
    lies among the blocks of the grid (a reduction that dropped the NaN ran on). (XLA's CPU
    backend drops NaNs in max by default, xla_cpu_enable_fast_min_max: no reference there.)"""
    side, tol = 256, np.float32(1e-30)
    u0 = np.random.default_rng(3).random((side, side)).astype(np.float32)

    def body(c):
        x, _, k = c
        x = x.at[pos].set(jnp.where(k == 4, jnp.float32(jnp.nan), x[pos]))
        new = x.at[1:-1, 1:-1].set(np.float32(0.25) * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:]))
        return new, jnp.max(jnp.abs(new - x)), k + 1
    x, err, k = lk.while_loop(lambda c: (c[1] > tol) & (c[2] < 1000), body,
                              (jnp.asarray(u0), jnp.float32(jnp.inf), jnp.int32(0)), fallback="error")
    # the float64 reference: five steps, the NaN set before the fifth
    r = u0.astype(np.float64)
    for step in range(5):
        if step == 4:
            r[pos] = np.nan
        new = r.copy()
        new[1:-1, 1:-1] = 0.25 * (r[:-2, 1:-1] + r[2:, 1:-1] + r[1:-1, :-2] + r[1:-1, 2:])
        r = new
    assert int(k) == 5 and np.isnan(float(err))
    got = np.asarray(x, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(r))      # the NaN's interior neighbours
    assert np.isnan(r).sum() >= 2
    np.testing.assert_allclose(got[~np.isnan(r)], r[~np.isnan(r)], rtol=1e-5, atol=1e-6)


def test_quadratic_map_scan_on_the_gpu():
    jax.config.update("jax_enable_x64", True)
    try:
        def body(x, _):
            y = 4.0 * x * (1.0 - x)
            return y, y
        x0 = 0.3141592653589793
        last, ys = jax.jit(lambda x: lk.scan(body, x, None, length=1000, fallback="error"))(jnp.float64(x0))
        ref = np.empty(1000)
        x = x0
        for t in range(1000):
            x = 4.0 * x * (1.0 - x)
            ref[t] = x
        assert ys.dtype == jnp.float64 and ys.shape == (1000,)
        np.testing.assert_allclose(np.asarray(ys)[:25], ref[:25], rtol=1e-9)   # chaotic: early steps only
        assert float(last) == float(ys[-1]) and np.all((np.asarray(ys) >= 0) & (np.asarray(ys) <= 1))
    finally:
        jax.config.update("jax_enable_x64", False)


def test_int64_arithmetic_wraps_on_the_gpu(rng):
    """int64 overflow wraps, as in XLA, also where a comparison, max, sort or division reads the
    wrapped value (Numba-CUDA marks signed arithmetic as never wrapping, which let LLVM fold
    `u * 4 > 0` into `u > 0`), against NumPy's wrapping int64 arithmetic."""
    jax.config.update("jax_enable_x64", True)
    try:
        edge = np.array([2 ** 62, -2 ** 62, 2 ** 63 - 1, -2 ** 63, 2 ** 61 + 7, -1, 0, 5], np.int64)
        x = np.concatenate([edge, rng.integers(-2 ** 63, 2 ** 63 - 1, 4000, dtype=np.int64, endpoint=True)])

        def body(i, c):
            u, flags, q = c
            v = u * 4
            w = u + u
            return (u, jnp.stack([v > 0, w < u, u + 1 > u, -u < 0]),
                    jnp.stack([w // 3, jnp.sort(u + 10), jnp.max(u + 10) + 0 * u]))
        c0 = (jnp.asarray(x), jnp.zeros((4, x.size), bool), jnp.zeros((3, x.size), jnp.int64))
        _, flags, q = lk.fori_loop(0, 1, body, c0, fallback="error")
        with np.errstate(over="ignore"):
            v, w, p = x * 4, x + x, x + 10
            want_flags = np.stack([v > 0, w < x, x + 1 > x, -x < 0])
            want_q = np.stack([w // 3, np.sort(p), np.full_like(x, p.max())])
        np.testing.assert_array_equal(np.asarray(flags), want_flags)
        np.testing.assert_array_equal(np.asarray(q), want_q)
        n = lk.while_loop(lambda c: c[0] * 2 > 0, lambda c: (c[0] * 2, c[1] + 1), (jnp.int64(1), jnp.int32(0)),
                          fallback="error")
        assert (int(n[0]), int(n[1])) == (2 ** 62, 62)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("n", [1000, 1 << 17])
def test_cond_on_a_carried_element_around_a_nested_while_loop_on_the_gpu(n, rng):
    """lax.cond on an element of the carry (read from the buffer no thread writes in the step,
    so every block takes the same branch), its taken branch a while_loop to a tolerance with
    barriers and a reduction, at block scope and on a cooperative grid, against the same float32
    operations in NumPy."""
    from jax import lax
    u0 = (rng.random(n) * 3.0 - 1.0).astype(np.float32)
    u0[0] = 0.5

    def body(i, x):
        def taken(x):
            return lax.while_loop(lambda v: jnp.max(v) < 5.0, lambda v: v + np.float32(0.75), x)
        return lax.cond(x[0] > 1.0, lambda x: x * np.float32(0.5), taken, x)
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 8, body, x, fallback="error"))(jnp.asarray(u0)))
    ref = u0.copy()
    for _ in range(8):
        if ref[0] > np.float32(1.0):
            ref = ref * np.float32(0.5)
        else:
            while ref.max() < np.float32(5.0):
                ref = ref + np.float32(0.75)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("n", [1000, 1 << 17])
def test_cond_on_a_reduction_on_the_gpu(n, rng):
    """lax.cond whose predicate is a grid reduction (the max of the field), at block scope and on
    a cooperative grid, against a float64 NumPy loop."""
    from jax import lax
    u0 = rng.random(n).astype(np.float32)

    def body(i, x):
        return lax.cond(jnp.max(x) > 0.6, lambda y: y * np.float32(0.9), lambda y: y + np.float32(0.01), x)
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 60, body, x, fallback="error"))(jnp.asarray(u0)))
    # the same float32 operations (each correctly rounded), so the branch taken is the same
    ref = u0.copy()
    for _ in range(60):
        ref = ref * np.float32(0.9) if ref.max() > np.float32(0.6) else ref + np.float32(0.01)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("n", [1000, 1 << 17])
def test_argmax_and_cumsum_on_the_gpu(n, rng):
    """argmax (two grid reductions) and cumsum (a prefix loop per element) in one body, against
    the same float32 loop in NumPy."""
    u0 = rng.random(n).astype(np.float32)

    def body(i, x):
        k = jnp.argmax(x)
        return x.at[k].set(x[k] * np.float32(0.5))
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 40, body, x, fallback="error"))(jnp.asarray(u0)))
    ref = u0.copy()
    for _ in range(40):
        k = int(np.argmax(ref))
        ref[k] = ref[k] * np.float32(0.5)
    np.testing.assert_array_equal(got, ref)
    c0 = rng.integers(0, 5, 513).astype(np.int32)
    got = np.asarray(lk.fori_loop(0, 3, lambda i, c: jnp.cumsum(c) % 1009, jnp.asarray(c0), fallback="error"))
    ref = c0.astype(np.int64)
    for _ in range(3):
        ref = np.cumsum(ref) % 1009
    np.testing.assert_array_equal(got, ref.astype(np.int32))


def test_gather_with_computed_indices_on_the_gpu(rng):
    """x[idx] with indices computed per element, clamped past the ends, against NumPy."""
    n = 1 << 16
    u0 = rng.random(n).astype(np.float32)

    def body(i, x):
        j = (jnp.arange(n) * 7 + i) % n
        return np.float32(0.5) * x[j] + np.float32(0.5) * x[jnp.arange(n) * 2 - 100]
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 5, body, x, fallback="error"))(jnp.asarray(u0)))
    ref = u0.copy()
    for i in range(5):
        j = (np.arange(n) * 7 + i) % n
        beyond = np.arange(n) * 2 - 100
        beyond = np.clip(np.where(beyond < 0, beyond + n, beyond), 0, n - 1)
        ref = np.float32(0.5) * ref[j] + np.float32(0.5) * ref[beyond]
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("n,nnz", [(1000, 5000), (1 << 16, 1 << 19)])
def test_coo_spmv_iteration_on_the_gpu(n, nnz, rng):
    """x <- 0.5 x + A x with A in COO form (jax.ops.segment_sum): atomic adds from many blocks
    into a buffer, a grid barrier, then the update; against a float64 NumPy loop."""
    rows = rng.integers(0, n, nnz).astype(np.int32)
    cols = rng.integers(0, n, nnz).astype(np.int32)
    vals = (rng.uniform(-0.5, 0.5, nnz) * n / nnz).astype(np.float32)
    x0 = rng.random(n).astype(np.float32)
    r, c, v = jnp.asarray(rows), jnp.asarray(cols), jnp.asarray(vals)

    def body(i, x):
        return np.float32(0.5) * x + jax.ops.segment_sum(v * x[c], r, num_segments=n)
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 50, body, x, fallback="error"))(jnp.asarray(x0)), np.float64)
    ref = x0.astype(np.float64)
    for _ in range(50):
        y = np.zeros(n)
        np.add.at(y, rows, vals.astype(np.float64) * ref[cols])
        ref = 0.5 * ref + y
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("npts", [3000, 1 << 20])
def test_histogram_carry_on_the_gpu(npts, rng):
    """h.at[bins].add(1), bins moving every step, many threads hitting the same bins: the integer
    counts must equal NumPy's exactly."""
    p0 = rng.uniform(-2.0, 70.0, npts).astype(np.float32)
    p = jnp.asarray(p0)

    def body(i, h):
        b = jnp.floor(p + i.astype(jnp.float32) * np.float32(0.5)).astype(jnp.int32) % 80 - 8
        return h.at[b].add(1)
    got = np.asarray(jax.jit(lambda h: lk.fori_loop(0, 30, body, h, fallback="error"))(jnp.zeros(64, jnp.int32)))
    ref = np.zeros(64, np.int64)
    for i in range(30):
        b = np.floor(p0 + np.float32(i) * np.float32(0.5)).astype(np.int64) % 80 - 8
        b = np.where(b < 0, b + 64, b)
        np.add.at(ref, b[b < 64], 1)
    np.testing.assert_array_equal(got, ref)


def test_nested_newton_and_while_loops_on_the_gpu(rng):
    """A fixed count of Newton steps per element (nested fori_loop) and a trip count from the
    outer counter (nested while) in one body over 1M elements, against a float64 NumPy loop."""
    from jax import lax
    n = 1 << 20
    x0 = rng.uniform(1.0, 2.0, n).astype(np.float32)

    def body(i, x):
        root = lax.fori_loop(0, 6, lambda j, y: y - (y * y - x) / (np.float32(2.0) * y), x)
        z = lax.fori_loop(0, i % 3 + 1, lambda j, z: z * np.float32(0.5) + np.float32(0.25), root)
        return np.float32(0.5) * x + np.float32(0.5) * z + np.float32(0.5)
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 10, body, x, fallback="error"))(jnp.asarray(x0)), np.float64)
    ref = x0.astype(np.float64)
    for i in range(10):
        z = np.sqrt(ref)
        for _ in range(i % 3 + 1):
            z = z * 0.5 + 0.25
        ref = 0.5 * ref + 0.5 * z + 0.5
    assert np.abs(got - ref).max() < 1e-5 * np.abs(ref).max()


def test_unrolled_jacobi_sweeps_on_the_gpu(rng):
    """Backward Euler for 2-D heat with four Jacobi sweeps per step (a nested fori_loop that reads
    its carry's neighbours: unrolled, a grid barrier between sweeps) on 512², against float64."""
    from jax import lax
    side = 512
    u0 = rng.random((side, side)).astype(np.float32)
    a = np.float32(0.2)

    def body(i, u):
        def sweep(j, v):
            nb = jnp.pad(v, 1)
            return (u + a * (nb[:-2, 1:-1] + nb[2:, 1:-1] + nb[1:-1, :-2] + nb[1:-1, 2:])) / (1 + 4 * a)
        return lax.fori_loop(0, 4, sweep, u)
    got = np.asarray(jax.jit(lambda u: lk.fori_loop(0, 20, body, u, fallback="error"))(jnp.asarray(u0)), np.float64)
    ref = u0.astype(np.float64)
    for _ in range(20):
        v = ref.copy()
        for _ in range(4):
            nb = np.pad(v, 1)
            v = (ref + 0.2 * (nb[:-2, 1:-1] + nb[2:, 1:-1] + nb[1:-1, :-2] + nb[1:-1, 2:])) / 1.8
        ref = v
    assert np.abs(got - ref).max() < 1e-5


def test_phased_cg_solve_per_step_on_the_gpu(rng):
    """Backward Euler for 1-D heat on 64K cells, each step solved by conjugate gradients to a
    tolerance (a nested while_loop with reductions, run in phases with grid barriers), against
    the float64 solution of the same linear systems."""
    n = 1 << 16
    u0 = rng.random(n).astype(np.float32)
    step = W.implicit_heat_cg(np.float32(0.3), np.float32(1e-8), 200)
    got = np.asarray(jax.jit(lambda u: lk.fori_loop(0, 5, step, u, fallback="error"))(jnp.asarray(u0)), np.float64)
    from scipy.linalg import solve_banded        # scipy comes with jax
    ab = np.zeros((3, n))
    ab[0, 1:], ab[1, :], ab[2, :-1] = -0.3, 1.6, -0.3
    ref = u0.astype(np.float64)
    for _ in range(5):
        ref = solve_banded((1, 1), ab, ref)
    assert np.abs(got - ref).max() < 1e-4


def test_sort_and_round_on_the_gpu(rng):
    """jnp.sort along each axis of a 64 x 4096 array and jnp.round / floor, against NumPy (the
    same float32 values, so the orders must match exactly)."""
    x0 = rng.normal(0.0, 10.0, (64, 4096)).astype(np.float32)

    def body(i, x):
        return jnp.sort(jnp.round(x * np.float32(0.9)), axis=1) + jnp.sort(jnp.floor(x), axis=0) * np.float32(0.01)
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 2, body, x, fallback="error"))(jnp.asarray(x0)))
    ref = x0.copy()
    for _ in range(2):
        ref = np.sort(np.round(ref * np.float32(0.9)), axis=1) + np.sort(np.floor(ref), axis=0) * np.float32(0.01)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("scope", ["grid", "tile"])
@pytest.mark.parametrize("nested", ["unrolled", "phased"])
def test_nested_stencil_loops_across_blocks_on_the_gpu(nested, scope):
    """The unrolled and phased forms of a nested stencil loop are stencils to the analysis, so
    scope="auto" may pick tile mode for them: exact integer shifts over 7 blocks in both scopes,
    the scratch buffers' neighbour reads crossing tiles behind their barriers. (The shifts
    repeat the edge cell: jnp.roll's wrap-around reads the carry n - 1 cells away, a halo no
    tile holds, and is refused by tile mode with a LaunchError.)"""
    from jax import lax
    from loopkern.jaxloops import loops
    n = 5000
    a0 = ((np.arange(n) * 7) % 19).astype(np.int32)

    def body(i, a):
        count = 3 if nested == "unrolled" else i + 1
        return lax.fori_loop(0, count, lambda j, v: (jnp.concatenate([v[:1], v[:-1]]) * 2
                                                     + jnp.concatenate([v[1:], v[-1:]]) + j) % 1000, a)
    traced = loops._trace_body(lambda i, x: [body(i, x)], [loops._aval(a0)], lead=(jax.ShapeDtypeStruct((), np.int32),))
    plan = loops._lower(loops.flatten(traced[0]), [("index",), ("carry", 0)], {0: 0}, {0: 1})
    mk = loops._kernel(plan)
    args, first = [], None
    for _, role, k in plan.params:
        if role in ("carry", "carry_next"):
            args.append(a0.copy())
            first = args[-1] if role == "carry" else first
        elif role == "lo":
            args.append(np.int32(0))
        else:
            assert role == "scratch"
            args.append(np.zeros(*k))
    run = mk(*args, steps=5, backend="cuda", scope=scope, blocks=7, threads=128)
    assert run.scope == scope and run.steps == 5
    ref = a0.astype(np.int64)
    for i in range(5):
        for j in range(3 if nested == "unrolled" else i + 1):
            ref = (np.concatenate([ref[:1], ref[:-1]]) * 2 + np.concatenate([ref[1:], ref[-1:]]) + j) % 1000
    np.testing.assert_array_equal(first, ref)


def test_dense_solve_on_the_gpu(rng):
    """jnp.linalg.solve of a 48 x 48 matrix that changes every step (one thread factorises, the
    grid waits), against NumPy's float64 solve."""
    a = (rng.normal(size=(48, 48)) * 0.3).astype(np.float32)         # well conditioned with the diagonal
    x0 = rng.random((48, 4)).astype(np.float32)

    def body(i, x):
        return jnp.linalg.solve(jnp.asarray(a) + jnp.diag(np.float32(3.0) + x[:, 0]), x) + np.float32(0.5)
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 6, body, x, fallback="error"))(jnp.asarray(x0)), np.float64)
    ref = x0.astype(np.float64)
    for _ in range(6):
        ref = np.linalg.solve(a.astype(np.float64) + np.diag(3.0 + ref[:, 0]), ref) + 0.5
    assert np.abs(got - ref).max() < 1e-3 * max(1.0, np.abs(ref).max())


def test_jnp_roll_bodies_in_tile_mode_on_the_gpu(rng):
    """jnp.roll by one is a periodic neighbour to the stencil analysis: a Life on a torus
    written with jnp.roll runs in tile mode under scope="auto" at 512² (the tiles' wrap-around
    rows across blocks), and 1-D heat with jnp.roll in tile mode on 7 blocks; lk.fori_loop of
    the Life body end to end. Against NumPy."""
    from jax import lax
    from bench.life import jax_life_step, life_ref
    from lowered_steps import roll_heat_body, roll_heat_ref, run_lowered

    a0 = (rng.random((512, 512)) < 0.35).astype(np.int32)
    a, _, run = run_lowered(lambda i, x: jax_life_step(x), a0, 31, "cuda", threads=None, blocks=None)
    assert run.scope == "tile", run
    np.testing.assert_array_equal(a, life_ref(a0, 31))
    got = jax.jit(lambda x: lk.fori_loop(0, 31, lambda i, y: jax_life_step(y), x, fallback="error"))(jnp.asarray(a0))
    np.testing.assert_array_equal(np.asarray(got), life_ref(a0, 31))
    np.testing.assert_array_equal(np.asarray(lax.fori_loop(0, 31, lambda i, y: jax_life_step(y), jnp.asarray(a0))),
                                  life_ref(a0, 31))
    u0 = rng.random(5000)
    u, _, _ = run_lowered(roll_heat_body, u0, 101, "cuda", threads=None, blocks=7, scope="tile")
    np.testing.assert_allclose(u, roll_heat_ref(u0, 101), rtol=1e-12)


@pytest.mark.parametrize("blocks", [None, 5])
def test_jnp_roll_by_several_cells_in_tile_mode_on_the_gpu(blocks, rng):
    """jnp.roll by 2 and 3 rows (and columns) is a periodic stencil of halo (2, 3): tile mode
    across blocks, each tile's far rows read across the wrap from the other end of the field,
    against NumPy's roll in float64."""
    from lowered_steps import run_lowered, wide_roll_body, wide_roll_ref

    a0 = rng.random((301, 67))
    got, _, run = run_lowered(wide_roll_body, a0, 57, "cuda", threads=None, blocks=blocks, scope="tile")
    assert run.scope == "tile", run
    np.testing.assert_allclose(got, wide_roll_ref(a0, 57), rtol=1e-12)


def test_session27_lowering_fixes_on_the_gpu(rng):
    """Session 27's drop-in fixes on the GPU (written without one, not yet run there), against
    NumPy: a size-1 operand stretched by the primitive (c[:, :1]), unsigned division by zero
    (all ones), the index's lax typing (int8 * i wraps in int8), and traced uint8 bounds
    9 -> 2 (no step)."""
    m0 = rng.uniform(-1, 1, (5, 4099)).astype(np.float32)
    got = np.asarray(jax.jit(lambda c: lk.fori_loop(0, 3, lambda i, c: c - np.float32(0.25) * c[:, :1], c,
                                                    fallback="error"))(jnp.asarray(m0)))
    ref = m0.astype(np.float64)
    for _ in range(3):
        ref = ref - 0.25 * ref[:, :1]
    assert np.abs(got - ref).max() < 1e-5
    a = rng.integers(0, 2 ** 32, 4099, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 5, 4099).astype(np.uint32)
    from jax import lax

    def div(i, c):
        return jnp.stack([c[0] // c[1], c[0] % c[1], lax.div(c[0], c[1]), lax.rem(c[0], c[1])])
    c0 = jnp.asarray(np.stack([a, b, a, b]))
    got = np.asarray(lk.fori_loop(0, 1, div, c0, fallback="error"))
    np.testing.assert_array_equal(got, np.asarray(lax.fori_loop(0, 1, div, c0)))     # XLA's meaning on the GPU
    nz = b != 0
    np.testing.assert_array_equal(got[0][nz], a[nz] // b[nz])
    np.testing.assert_array_equal(got[1][nz], a[nz] % b[nz])
    d8 = rng.integers(-128, 128, 4099).astype(np.int8)
    got = np.asarray(lk.fori_loop(0, 7, lambda i, c: c + (jnp.asarray(d8) * i).astype(jnp.float32),
                                  jnp.zeros(4099, jnp.float32), fallback="error"))
    expect = sum((d8 * np.int8(i)).astype(np.float32) for i in range(7))
    np.testing.assert_array_equal(got, expect)
    got = jax.jit(lambda lo, hi: lk.fori_loop(lo, hi, lambda i, c: c + 1.0, jnp.zeros(4099, jnp.float32),
                                              fallback="error"))(np.uint8(9), np.uint8(2))
    np.testing.assert_array_equal(np.asarray(got), 0.0)


@pytest.mark.parametrize("n", [1000, 65536 + 7])
def test_jax_random_bits_and_draws_on_the_gpu(n, rng):
    """jax.random in the body (a key closed over and folded with the index; a key carried and
    split): the bits equal an independent NumPy Threefry-2x32 and XLA's own, the carried key
    XLA's bit for bit, the uniform/normal draws XLA's to float tolerance. 1000 elements run in
    one block, 65543 on a grid."""
    from refs import np_bits, np_fold_in
    key = jax.random.key(int(rng.integers(2 ** 31)))
    x0 = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)

    def bits(i, x):
        return x ^ jax.random.bits(jax.random.fold_in(key, i), x.shape, jnp.uint32)
    got = np.asarray(jax.jit(lambda x: lk.fori_loop(0, 7, bits, x, fallback="error"))(x0))
    ref = x0.copy()
    raw = np.asarray(jax.random.key_data(key), np.uint32)
    for i in range(7):
        ref ^= np_bits(np_fold_in(raw, i), n)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(got, np.asarray(jax.lax.fori_loop(0, 7, bits, jnp.asarray(x0))))

    def walk(i, c):
        x, k = c
        k, a, b = jax.random.split(k, 3)
        return x + 0.1 * jax.random.normal(a, x.shape) + jax.random.uniform(b, x.shape, minval=-0.05,
                                                                             maxval=0.05), k
    init = (jnp.zeros(n, jnp.float32), key)
    x, k = lk.fori_loop(0, 50, walk, init, fallback="error")
    rx, rk = jax.lax.fori_loop(0, 50, walk, init)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(k)), np.asarray(jax.random.key_data(rk)))
    np.testing.assert_allclose(np.asarray(x), np.asarray(rx), rtol=1e-5, atol=1e-5)
    assert 0.5 < float(jnp.std(x)) < 0.9      # 50 steps of N(0, 0.01) + U(-0.05, 0.05): std ~0.72


def test_float64_jax_random_draws_on_the_gpu(rng):
    """With jax_enable_x64: uint64 bits (the hash's two words, high then low, through the 64-bit
    shifts) equal XLA's bit for bit; float64 uniform and normal draws equal XLA's to float64
    rounding (normal's erf_inv refined to float64 precision, XLA's a polynomial)."""
    from refs import jax_x64
    with jax_x64():
        init = (jnp.zeros(5000, jnp.float64), jnp.zeros(5000, jnp.uint64), jax.random.key(int(rng.integers(2 ** 31))))

        def body(i, c):
            x, b, k = c
            k, s, t = jax.random.split(k, 3)
            x = x + jax.random.uniform(s, x.shape, jnp.float64) + jax.random.normal(t, x.shape, jnp.float64)
            return x, b ^ jax.random.bits(s, b.shape, jnp.uint64), k
        got = lk.fori_loop(0, 20, body, init, fallback="error")
        ref = jax.lax.fori_loop(0, 20, body, init)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(got[2])), np.asarray(jax.random.key_data(ref[2])))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n", [300, 20011])
def test_gamma_beta_and_dirichlet_draws_on_the_gpu(n, rng):
    """jax.random.gamma (JAX's sampler inlined: each element's rejection loop, with a loop
    nested in it, running on its own in the element's thread), beta and dirichlet built on it:
    the carried key XLA's bit for bit, the draws XLA's to float32 rounding; gamma's mean near
    its shape parameter."""
    alpha = jnp.asarray(rng.uniform(0.2, 5.0, n).astype(np.float32))

    def body(i, c):
        g, b, d, k = c
        k, s1, s2, s3 = jax.random.split(k, 4)
        return (g + jax.random.gamma(s1, alpha), b + jax.random.beta(s2, 0.5, 2.0, (n,)),
                d + jax.random.dirichlet(s3, jnp.asarray([0.3, 1.0, 4.0]), (n,)), k)
    z = jnp.zeros(n, jnp.float32)
    init = (z, z, jnp.zeros((n, 3), jnp.float32), jax.random.key(int(rng.integers(2 ** 31))))
    got = jax.jit(lambda c: lk.fori_loop(0, 4, body, c, fallback="error"))(init)
    ref = jax.lax.fori_loop(0, 4, body, init)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got[3])), np.asarray(jax.random.key_data(ref[3])))
    for g, r in zip(got[:3], ref[:3]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got[2]).sum(axis=1), 4.0, rtol=1e-5)
    if n > 10000:
        assert abs(float(jnp.mean(got[0] / 4 - alpha))) < 0.05
