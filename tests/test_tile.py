"""Tile mode (on-chip residency, experimental): each block keeps its tile of the swap pairs'
arrays in shared memory for the whole run. These tests compile the tile-mode kernels to PTX and
run them under Numba's CUDA simulator with ONE block (the simulator cannot run a grid barrier
across blocks): the tile then covers the whole array, so they check the index shift, the
tile-restricted loops, the halo at the domain's ends, the end-of-run rename and the early
stops, not the exchange between blocks, which needs a GPU."""

import numpy as np
import pytest

import loopkern as lk
import refs
import workloads as W
from loopkern import codegen
from loopkern.compile import compile_kernel
from loopkern.runtime.layout import DONE, HOST_SIZE, STEPS
from loopkern.stencil import find_stencil

pytestmark = pytest.mark.sim


def wide_step(t, u, v, c):
    n = u.shape[0]
    for i in lk.range(2, n - 2):
        v[i] = u[i] + c * (u[i - 2] - u[i + 2]) + c * c * u[i + 1]
    for i in lk.range(0, 2):
        v[i] = u[i]
    for i in lk.range(n - 2, n):
        v[i] = u[i]


def wide_ref(u0, steps, c):
    u = u0.astype(np.float64)
    for _ in range(steps):
        v = u.copy()
        v[2:-2] = u[2:-2] + c * (u[:-4] - u[4:]) + c * c * u[3:-1]
        u = v
    return u


def run_tile(fn, swap, arrays, scalars, steps, threads=32, start=0):
    from numba import cuda
    k = lk.megakernel(fn, swap=swap)
    st = find_stencil(k.spec)
    src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=st)
    kern = compile_kernel(src).dispatcher
    n = arrays[0].shape[0]
    (hl, hr), = st.halo
    shared = 2 * (n + hl + hr) * arrays[0].dtype.itemsize
    dev = [cuda.to_device(a) for a in arrays]
    host = np.zeros(HOST_SIZE, np.int64)
    args = [np.int64(steps), np.int64(start), *dev, *scalars, cuda.to_device(np.zeros((2, 1))),
            cuda.to_device(np.zeros((2, 1), np.int64)), cuda.to_device(np.zeros(2, np.uint32)), np.uint64(0),
            cuda.to_device(np.zeros(2, np.int64)), host]
    kern[1, threads, 0, shared](*args)
    assert host[DONE] == 1 and host[STEPS] == steps
    return [d.copy_to_host() for d in dev], host


def check_heat_pair(u, v, u0, steps, alpha):
    """``u`` and ``v`` hold heat from ``u0`` after ``steps`` and ``steps - 1`` steps (``v``
    is ``u0`` after none), against the exact float64 solution."""
    np.testing.assert_allclose(u, refs.heat_exact(u0, steps, alpha), rtol=1e-12, atol=1e-14)
    if steps:
        np.testing.assert_allclose(v, refs.heat_exact(u0, steps - 1, alpha), rtol=1e-12, atol=1e-14)
    else:
        np.testing.assert_array_equal(v, u0)


@pytest.mark.parametrize("steps", [0, 1, 2, 7])
def test_heat_in_tile_mode_matches_the_exact_solution(steps, rng):
    u0 = rng.random(150)
    (u, v), host = run_tile(W.heat_step, [("u", "v")], [u0, u0.copy()], (0.3,), steps)
    check_heat_pair(u, v, u0, steps, 0.3)


@pytest.mark.parametrize("threads", [32, 64])
def test_a_wide_one_sided_stencil_in_tile_mode(threads, rng):
    u0 = rng.random(97)
    (u, _), _ = run_tile(wide_step, [("u", "v")], [u0, u0.copy()], (0.1,), 5, threads=threads)
    assert find_stencil(lk.megakernel(wide_step, swap=[("u", "v")]).spec).halo == ((2, 2),)
    np.testing.assert_allclose(u, wide_ref(u0, 5, 0.1), rtol=1e-12)


def heat2d_step(t, u, v, alpha):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), (1, m - 1)):
        v[i, j] = u[i, j] + alpha * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1] - 4.0 * u[i, j])


def heat2d_ref(u0, steps, alpha):
    u = u0.astype(np.float64)
    for _ in range(steps):
        v = u.copy()
        c = u[1:-1, 1:-1]
        v[1:-1, 1:-1] = c + alpha * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4.0 * c)
        u = v
    return u


def ring_step(t, u, v):
    # rows are tiles; columns wrap around inside a row, which is all on chip
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), m):
        v[i, j] = 0.5 * u[i, j] + 0.25 * (u[i, (j + 1) % m] + u[i - 1, (j - 1 + m) % m])
    for i, j in lk.grid(1, m):
        v[i, j] = u[i, j]
    for i, j in lk.grid((n - 1, n), m):
        v[i, j] = u[i, j]


def ring_ref(u0, steps):
    u = u0.astype(np.float64)
    for _ in range(steps):
        v = u.copy()
        v[1:-1] = 0.5 * u[1:-1] + 0.25 * (np.roll(u, -1, axis=1)[1:-1] + np.roll(u[:-2], 1, axis=1))
        u = v
    return u


# a block's threads share a tile's rows column by column (codegen.tile_rows): rows of 9 inner
# cells with 32 threads (3 rows at a time, 5 threads idle) and 64 (7 rows, 1 idle), of 22 (one
# row, 10 idle) and of 38 (each thread takes one or two columns of every row)
@pytest.mark.parametrize("steps,threads,shape", [(1, None, (13, 11)), (6, 32, (13, 11)), (6, 64, (13, 11)),
                                                 (6, 32, (9, 24)), (5, 32, (7, 40))])
def test_two_dimensional_stencils_in_tile_mode(steps, threads, shape, rng):
    from numba import cuda
    u0 = rng.random(shape)
    k = lk.megakernel(heat2d_step, swap=[("u", "v")])
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, 0.2, steps=steps, backend="cuda", scope="tile", threads=threads)
    assert run.scope == "tile"
    np.testing.assert_allclose(u.copy_to_host(), heat2d_ref(u0, steps, 0.2), rtol=1e-12)
    np.testing.assert_allclose(v.copy_to_host(), heat2d_ref(u0, steps - 1, 0.2), rtol=1e-12)
    r = lk.megakernel(ring_step, swap=[("u", "v")])
    assert find_stencil(r.spec).periodic == (False, True)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    r(u, v, steps=steps, backend="cuda", scope="tile", threads=threads)
    np.testing.assert_allclose(u.copy_to_host(), ring_ref(u0, steps), rtol=1e-12)


# tile mode of stencils that wrap around along their first dimension: a tile's rows at the ends
# of the array read the far end through its halo (codegen _tile_index, rt.tile_row). The
# simulator runs one block, whose tile is then the whole array: the wrapped rows come from its
# own halo (the GPU tests run several blocks, tests/gpu/test_tile_gpu.py)
@pytest.mark.parametrize("shape,threads,steps", [((8, 8), None, 1), ((8, 8), None, 9), ((11, 7), 32, 6),
                                                 ((5, 40), 32, 4), ((3, 3), 64, 5)])
@pytest.mark.parametrize("fn", [W.life_step, W.life_tuple_step])
def test_game_of_life_wrapping_around_both_dimensions_in_tile_mode(fn, shape, threads, steps, rng):
    # (life_tuple_step: examples/life.py's n, m = a.shape[0], a.shape[1] and up, down = ...,
    # which the stencil analysis did not follow before session 45: "not a stencil")
    from numba import cuda
    a0 = (rng.random(shape) < 0.4).astype(np.int32)
    ref, pops = W.life_ref(a0, steps)
    life = lk.megakernel(fn, swap=[("a", "b")])
    assert find_stencil(life.spec).periodic == (True, True)
    a, b, pop = cuda.to_device(a0), cuda.to_device(a0), cuda.to_device(np.zeros(steps, np.int64))
    run = life(a, b, pop, steps=steps, backend="cuda", scope="tile", threads=threads)
    assert run.scope == "tile"
    np.testing.assert_array_equal(a.copy_to_host(), ref)
    np.testing.assert_array_equal(pop.copy_to_host(), pops)
    from bench.life import life_kernel         # periodic neighbours as conditional expressions
    other = life_kernel()
    a, b = cuda.to_device(a0), cuda.to_device(a0)
    other(a, b, steps=steps, backend="cuda", scope="tile", threads=threads)
    np.testing.assert_array_equal(a.copy_to_host(), ref)
    # one-sided: a neighbour taken from the wrong side changes the result (Life's is symmetric)
    drift = lk.megakernel(W.drift_step, swap=[("u", "v")])
    assert find_stencil(drift.spec).row_shifts == {"up": -1}
    u0 = rng.random(shape)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    drift(u, v, steps=steps, backend="cuda", scope="tile", threads=threads)
    np.testing.assert_allclose(u.copy_to_host(), W.drift_ref(u0, steps), rtol=1e-12)


@pytest.mark.parametrize("n,steps", [(3, 4), (40, 7), (97, 5)])
def test_a_one_dimensional_ring_in_tile_mode(n, steps, rng):
    u0 = rng.random(n)
    (u, _), _ = run_tile(W.ring_rows_step, [("u", "v")], [u0, u0.copy()], (), steps)
    assert find_stencil(lk.megakernel(W.ring_rows_step, swap=[("u", "v")]).spec).halo == ((2, 1),)
    np.testing.assert_allclose(u, W.ring_rows_ref(u0, steps), rtol=1e-12)


def test_a_negative_index_reads_the_far_end_in_tile_mode(rng):
    # tile mode once read the halo below the first tile for u[-1], which nothing had filled:
    # a silently wrong result where the grid scope's was right
    u0 = rng.random(37)
    for threads in (32, 64):
        (u, _), _ = run_tile(W.back_step, [("u", "v")], [u0, u0.copy()], (), 6, threads=threads)
        np.testing.assert_allclose(u, W.back_ref(u0, 6), rtol=1e-12)


def test_stores_through_names_bound_once_in_tile_mode(rng):
    from test_stencil import store_through_names
    u0 = rng.random(29)
    ref = u0.astype(np.float64)
    for _ in range(5):
        ref = np.roll(ref, 1) + 0.5 * ref
    for threads in (32, 64):
        (u, _), _ = run_tile(store_through_names, [("u", "v")], [u0, u0.copy()], (), 5, threads=threads)
        np.testing.assert_allclose(u, ref, rtol=1e-12)


def test_every_row_a_wrapping_tile_reads_holds_the_row_asked_for():
    """The invariant tile mode relies on across blocks, which the simulator (one block) cannot
    run: with tiles of ceil(n / blocks) rows (at least the halo long, as tile_config asks)
    whose every row outside the block's own holds the array's row of its index modulo n (the
    prologue loads them so; each exchange refills them from rows some block publishes, its
    first ``above`` and last ``below`` rows), an access to row ``e`` of a cell of the block,
    wrapped or not, finds that row: at ``e - tb`` for the cell's row plus a literal (a
    negative ``e`` then counts from the end, as in Python), at ``rt.tile_row(e - tb, n)`` for
    a wrapped index in [0, n)."""
    from loopkern.runtime import cuda_rt
    for n in range(1, 15):
        for below, above in ((1, 1), (2, 1), (0, 2), (2, 2), (3, 1)):
            for blocks in range(1, 7):
                T = -(-n // blocks)
                if blocks > 1 and T < max(below, above):
                    continue                     # tile_config refuses the launch
                spans = [(min(b * T, n), min(min(b * T, n) + T, n)) for b in range(blocks)]
                published = {r for lo, hi in spans for r in range(lo, hi)
                             if r < lo + above or r >= hi - below}
                for lo, hi in spans:
                    tb, W = lo - below, T + below + above
                    # the rows an exchange refills (codegen _tile_lines: `below` rows under the
                    # block's, `above` over them) and the block's own: what a step may read
                    halo = list(range(tb, lo)) + list(range(hi, hi + above))
                    assert all((v % n) in published for v in halo), (n, below, above, blocks, lo)
                    fresh = {v - tb for v in halo + list(range(lo, hi))}
                    assert all(0 <= x < W for x in fresh)
                    for i in range(lo, hi):
                        for o in range(-below, above + 1):
                            if not 0 <= i + o < n and o > 0:
                                continue                 # past the end: not a valid access
                            x = i + o - tb               # the cell's row plus a literal
                            assert x in fresh and (tb + x) % n == (i + o) % n
                            e = (i + o) % n              # the same neighbour, wrapped
                            x = cuda_rt.tile_row(e - tb, n)
                            assert x in fresh and (tb + x) % n == e, (n, below, above, blocks, i, o)


def test_a_wrapping_stencil_runs_one_step_per_exchange_and_auto_keeps_the_grid_scope():
    from loopkern.stencil import fused_steps_refusal
    k = lk.megakernel(W.ring_rows_step, swap=[("u", "v")])
    st = find_stencil(k.spec)
    assert "wraps around along its first dimension" in fused_steps_refusal(k.spec, st).reason
    assert not k.dispatcher.auto_tile(1 << 20, False, False)
    with pytest.raises(ValueError, match="one step per halo exchange"):
        codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=st, depth=4)


def test_tile_mode_refuses_what_it_does_not_cover():
    k = lk.megakernel(W.life_step, swap=[("a", "b")])
    for kw in (dict(depth=2), dict(cluster=True)):
        with pytest.raises(ValueError, match="wraps around along the first dimension .*one step per halo exchange"):
            codegen.render_kernel(k.spec, "cuda", "grid", tile=find_stencil(k.spec), **kw)
    h = lk.megakernel(W.heat_step, swap=[("u", "v")])
    st = find_stencil(h.spec)
    for kw in (dict(scope="block"), dict(debug=True), dict(index_bits=64)):
        opts = dict(scope="grid") | kw
        with pytest.raises(ValueError, match="tile mode"):
            codegen.render_kernel(h.spec, "cuda", opts.pop("scope"), tile=st, **opts)
    with pytest.raises(ValueError, match="not a stencil"):
        codegen.render_kernel(h.spec, "cuda", "grid", tile=find_stencil(lk.megakernel(W.helper_step, swap=[("u", "v")]).spec))


@pytest.mark.parametrize("scope", ["tile", "cluster", "streamed"])
def test_scope_tile_through_a_call_continues_runs_exactly(scope, rng, monkeypatch):
    from numba import cuda

    from loopkern.dispatch import config
    if scope == "streamed":
        # a chip of 1 KiB per block: the 120 float64 cells stream through tiles of a few dozen
        monkeypatch.setattr(config, "SIMULATOR_SHARED_BYTES", 1024)
        monkeypatch.setattr(config, "STREAM_TILE_BYTES", 800)
        monkeypatch.setattr(config, "TILE_DEPTH_SPAN", 1)
    mode = "cluster" if scope == "cluster" else "tile"
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(120)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    t = 0
    for steps in (3, 4, 1, 7):
        run = k(u, v, 0.25, steps=steps, start=t, backend="cuda", scope=mode)
        assert (run.scope, run.blocks, run.steps) == (mode, 1, steps)
        t = run.next_start
    assert (list(k.dispatcher.plans.values())[-1].config.tiles > 1) == (scope == "streamed")
    check_heat_pair(u.copy_to_host(), v.copy_to_host(), u0, 15, 0.25)
    # NumPy arrays go through device copies, as in every scope
    a, b = u0.copy(), u0.copy()
    k(a, b, 0.25, steps=5, backend="cuda", scope=mode)
    np.testing.assert_allclose(a, refs.heat_exact(u0, 5, 0.25), rtol=1e-12, atol=1e-14)


def test_scope_tile_says_why_it_cannot_run(rng):
    from numba import cuda
    from loopkern.errors import ArgumentError
    x = cuda.to_device(rng.random(64))
    y = cuda.to_device(rng.random(64))
    helper = lk.megakernel(W.helper_step, swap=[("u", "v")])
    with pytest.raises(ArgumentError, match="is not a stencil .*an array is passed to a helper function"):
        helper(x, y, 0.1, steps=1, backend="cuda", scope="tile")
    life = lk.megakernel(W.life_step, swap=[("a", "b")])
    g = cuda.to_device(np.zeros((8, 8), np.int64))
    h = cuda.to_device(np.zeros((8, 8), np.int64))
    with pytest.raises(ArgumentError, match="wraps around along its first dimension.*scope='tile' or 'grid'"):
        life(g, h, cuda.to_device(np.zeros(4, np.int64)), steps=1, backend="cuda", scope="cluster")
    heat = lk.megakernel(W.heat_step, swap=[("u", "v")])
    with pytest.raises(ArgumentError, match="debug=True with scope='grid'"):
        heat(x, y, 0.1, steps=1, backend="cuda", scope="tile", debug=True)
    no_swap = lk.megakernel(W.heat_step)
    with pytest.raises(ArgumentError, match="no swap pair"):
        no_swap(x, y, 0.1, steps=1, backend="cuda", scope="tile")


def two_pair_step(t, a, b, c, d):
    n = a.shape[0]
    for i in lk.range(1, n - 1):
        b[i] = 0.5 * (a[i - 1] + a[i + 1])
        d[i] = c[i] + a[i]


def aliased_read_step(t, u, v, w, out):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
        out[i] = w[i]


@pytest.mark.parametrize("scope", ["tile", "cluster"])
def test_an_argument_sharing_memory_with_an_array_kept_on_chip_is_refused(scope, rng):
    """w is the caller's u: tile mode keeps u's values on chip, so w read its stale copy in
    memory and the run gave other values than the grid scope, silently, before session 28.
    Now an ArgumentError before anything is written; since session 29 in every scope (an array
    sharing memory with one the step writes, as every swap pair's arrays are); two swap pairs
    sharing memory likewise."""
    from numba import cuda
    k = lk.megakernel(aliased_read_step, swap=[("u", "v")])
    u0 = rng.random(16)
    u, v, out = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(np.zeros(16))
    for sc in (scope, "grid", "auto"):
        with pytest.raises(lk.ArgumentError, match="argument 'w' shares memory with argument 'u', which step "
                                                   "'aliased_read_step' writes"):
            k(u, v, u, out, steps=2, backend="cuda", scope=sc)
    np.testing.assert_array_equal(u.copy_to_host(), u0)
    np.testing.assert_array_equal(out.copy_to_host(), 0.0)
    half = cuda.to_device(u0)
    with pytest.raises(lk.ArgumentError, match="argument 'w' shares memory with argument 'v'"):
        k(u, half, half[4:12], out, steps=2, backend="cuda", scope=scope)
    two = lk.megakernel(two_pair_step, swap=[("a", "b"), ("c", "d")])
    x, y, z = (cuda.to_device(rng.random(16)) for _ in range(3))
    with pytest.raises(lk.ArgumentError, match="argument 'd' shares memory with argument 'a'"):
        two(x, y, z, x, steps=1, backend="cuda", scope=scope)
    # with a copy of u as w, every scope reads the values u had when the call began
    ref_u, ref_v, ref_out = u0.copy(), u0.copy(), np.zeros(16)
    cur, nxt = ref_u, ref_v
    for _ in range(3):
        nxt[1:-1] = 0.5 * (cur[:-2] + cur[2:])
        cur, nxt = nxt, cur
    ref_out[1:-1] = u0[1:-1]
    u, v, w, out = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(np.zeros(16))
    k(u, v, w, out, steps=3, backend="cuda", scope=scope)
    np.testing.assert_allclose(out.copy_to_host(), ref_out, rtol=1e-15)
    np.testing.assert_allclose(u.copy_to_host(), cur, rtol=1e-15)


@pytest.mark.parametrize("shape", [(5, 0), (0, 0), (0, 5), (0,)])
def test_empty_arrays_in_tile_mode_run_no_element(shape, rng):
    # (a (5, 0) or (0, 0) field raised a raw ValueError from inside the kernel before session 28)
    from numba import cuda

    def heat2(t, u, v, a):
        n = u.shape[0]
        m = u.shape[1]
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            v[i, j] = u[i, j] + a * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1] - 4.0 * u[i, j])
    k = lk.megakernel(heat2 if len(shape) == 2 else W.heat_step, swap=[("u", "v")])
    u, v = cuda.to_device(np.ones(shape)), cuda.to_device(np.ones(shape))
    run = k(u, v, 0.2, steps=3, backend="cuda", scope="tile")
    assert run.steps == 3 and u.copy_to_host().shape == shape
    helper = lk.megakernel(W.helper_step, swap=[("u", "v")])
    with pytest.raises(lk.ArgumentError, match="is not a stencil"):
        helper(cuda.to_device(np.ones(0)), cuda.to_device(np.ones(0)), 0.1, steps=1, backend="cuda", scope="tile")


@pytest.mark.parametrize("scope", ["tile", "cluster"])
def test_jacobi_to_tolerance_in_tile_mode(scope, rng):
    # a reduction in the step and a condition as its last statement; the tile's grid barrier
    # is kept, so the stop comes at the same step as a NumPy loop
    from numba import cuda
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = rng.random((9, 10))
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, 1e-3, max_steps=500, backend="cuda", scope=scope)
    ref = u0.copy()
    steps = 0
    while steps < 500:
        new = ref.copy()
        new[1:-1, 1:-1] = 0.25 * (ref[:-2, 1:-1] + ref[2:, 1:-1] + ref[1:-1, :-2] + ref[1:-1, 2:])
        err = np.abs(new - ref).max()
        ref = new
        steps += 1
        if not err > 1e-3:
            break
    assert (run.steps, run.stopped) == (steps, "condition")
    np.testing.assert_allclose(u.copy_to_host(), ref, rtol=1e-12)


def _kernel_loop(src):
    return src[src.index("@cuda.jit(", src.index("def _lk_step")):]


def test_a_step_ending_in_a_reduction_exchanges_its_edges_at_that_reductions_barrier():
    # the step publishes its edge rows before the reduction, whose grid barrier is the
    # exchange's; the kernel gathers after the step with no barrier of its own
    def skipped(t, u, v, tol):
        n = u.shape[0]
        err = 0.0
        for i in lk.range(1, n - 1):
            v[i] = 0.5 * (u[i - 1] + u[i + 1])
            err = max(err, abs(v[i] - u[i]))
        return t < 5 or lk.max(err) > tol            # no reduction on steps 0-4

    for fn, fused in ((W.jacobi_step, True), (W.smooth_carried_step, True), (skipped, False)):
        k = lk.megakernel(fn, swap=[("u", "v")])
        src = k.source("cuda", "tile")
        step = src[src.index("def _lk_step"):src.index("@cuda.jit(", src.index("def _lk_step"))]
        assert ("_lk_rt.grid_sync(" not in _kernel_loop(src)) == fused, fn.__name__
        assert ("_lk_e1" in step) == fused, fn.__name__
        if fused:
            # published after the block's last tile write and before the reduction
            publish, reduce_ = step.index("_lk_rt.store(_lk_e1"), step.index("_lk_rt.grid_max(")
            assert step.rindex("cuda.syncthreads()", 0, publish) < publish < reduce_
        # the cluster form passes the cluster's barrier alike
        csrc = k.source("cuda", "cluster")
        assert ("_lk_rt.cluster_sync(" not in _kernel_loop(csrc)) == fused
    codegen.FUSE_EXCHANGE_WITH_REDUCTION = False
    try:
        src = lk.megakernel(W.jacobi_step, swap=[("u", "v")]).source("cuda", "tile")
        assert "_lk_rt.grid_sync(" in _kernel_loop(src)
    finally:
        codegen.FUSE_EXCHANGE_WITH_REDUCTION = True


def test_a_carried_reduction_in_tile_mode_on_one_block(rng):
    from numba import cuda

    k = lk.megakernel(W.smooth_carried_step, swap=[("u", "v")])
    u0 = rng.random(17)
    u, v, last = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(np.zeros(1))
    run = k(u, v, 1e-3, last, max_steps=3000, backend="cuda", scope="tile")
    ref, steps, err = W.smooth_carried_ref(u0, 1e-3, 3000)
    assert (run.scope, run.steps, run.stopped) == ("tile", steps, "condition")
    np.testing.assert_allclose(u.copy_to_host(), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(last.copy_to_host()[0], err, rtol=1e-12)


BEYOND = [(W.smooth_and_count_longer, (12,), 16), (W.smooth_and_count_below_zero, (12,), 16),
          (W.smooth_until_a_longer_sum, (12,), 16), (W.smooth2d_and_count_longer, (5, 4), (8, 4))]


@pytest.mark.parametrize("fn,shape,wshape", BEYOND, ids=[b[0].__name__ for b in BEYOND])
def test_loops_past_the_pairs_extent_run_every_index_in_tile_mode(fn, shape, wshape, rng):
    # the first block takes the indices below 0 and the last those from n on (one block here:
    # both); they were skipped, silently
    from numba import cuda
    k = lk.megakernel(fn, swap=[("u", "v")])
    u0 = rng.random(shape)
    w0 = np.ones(wshape) if fn is W.smooth_until_a_longer_sum else np.zeros(wshape)
    u, v, w = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(w0)
    run = k(u, v, w, max_steps=10, backend="cuda", scope="tile")
    ref_u, ref_w, ref_steps = W.beyond_the_pair_refs(fn, u0, w0, 10)
    assert run.scope == "tile" and run.steps == ref_steps
    np.testing.assert_allclose(u.copy_to_host(), ref_u, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(w.copy_to_host(), ref_w)


def probe_cells_two_to_five(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    for i in lk.range(2, 5):
        w[i] = w[i] + u[i]


def add_the_pair_modulo_its_length(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    for j in lk.range(w.shape[0]):
        w[j] = w[j] + u[j % n]


def test_loops_naming_the_pair_past_its_extent_are_refused_in_tile_mode(rng):
    """A loop that reads the pair kept on chip runs, in tile mode, the indices of the tiles only:
    one that may run past them (over a longer array, reading u[j % n]) was silently cut short.
    It is refused before anything runs; a literal bound is checked against the arrays given
    (2..5 needs 5 cells); the grid scope runs both, against NumPy."""
    from numba import cuda
    k = lk.megakernel(add_the_pair_modulo_its_length, swap=[("u", "v")])
    u0, w0 = rng.random(6), np.zeros(10)
    u, v, w = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(w0)
    with pytest.raises(lk.ArgumentError, match=r"scope='tile'.*its stop may lie beyond the arrays' extent"):
        k(u, v, w, steps=1, backend="cuda", scope="tile")
    np.testing.assert_array_equal(w.copy_to_host(), w0)         # nothing ran
    k(u, v, w, steps=1, backend="cuda", scope="grid")
    np.testing.assert_array_equal(w.copy_to_host(), u0[np.arange(10) % 6])

    k = lk.megakernel(probe_cells_two_to_five, swap=[("u", "v")])
    u0 = rng.random(4)
    u, v, w = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(np.zeros(8))
    with pytest.raises(lk.ArgumentError, match=r"runs up to index 4 of their first dimension, but 'u' has 4"):
        k(u, v, w, steps=1, backend="cuda", scope="tile")
    u0 = rng.random(9)
    u, v, w = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(np.zeros(8))
    run = k(u, v, w, steps=3, backend="cuda", scope="tile")
    assert run.scope == "tile"
    ref, got_w = u0.copy(), np.zeros(8)
    for _ in range(3):
        new = ref.copy()
        new[1:-1] = 0.5 * (ref[:-2] + ref[2:])
        got_w[2:5] += ref[2:5]
        ref = new
    np.testing.assert_allclose(u.copy_to_host(), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.copy_to_host(), got_w, rtol=0, atol=1e-12)


def test_scope_auto_tries_tile_mode_for_stencils_on_a_gpu():
    from loopkern.dispatch.config import AUTO_TILE_MIN_ELEMENTS

    def heat2d(t, u, v, a):
        n = u.shape[0]
        m = u.shape[1]
        for i, j in lk.grid((1, n - 1), (1, m - 1)):
            v[i, j] = u[i, j] + a * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1] - 4.0 * u[i, j])

    def probed(t, u, v, probe):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            v[i] = 0.5 * (u[i - 1] + u[i + 1])
        for i in lk.range(1, 2):
            probe[t % 4] = u[i]

    heat = lk.megakernel(W.heat_step, swap=[("u", "v")]).dispatcher
    big, plain = AUTO_TILE_MIN_ELEMENTS, False
    assert heat.auto_tile(big, plain, sim=False)
    # several steps per exchange: tiles win at every size (rounds of steps, one barrier each)
    assert heat.fused_steps and heat.auto_tile(100, plain, sim=False)
    # one step per exchange: only large fields; below, the grid scope's barrier is cheaper
    one = lk.megakernel(probed, swap=[("u", "v")]).dispatcher
    assert not one.fused_steps
    assert one.auto_tile(big, plain, sim=False)
    assert not one.auto_tile(big - 1, plain, sim=False)
    assert not heat.auto_tile(big, True, sim=False)  # no bounds-checked tile kernel
    assert not heat.auto_tile(big, plain, sim=True)                       # the simulator runs one block
    # 2-D, wrapping around (Life) or not, a reduction every step or not: from
    # AUTO_TILE_2D_MIN_ELEMENTS elements
    from loopkern.dispatch.config import AUTO_TILE_2D_MIN_ELEMENTS as big2
    from bench.life import life_kernel
    for two_d in (lk.megakernel(heat2d, swap=[("u", "v")]), lk.megakernel(W.jacobi_step, swap=[("u", "v")]),
                  life_kernel()):
        d = two_d.dispatcher
        assert d.auto_tile(big2, plain, sim=False) and not d.auto_tile(big2 - 1, plain, sim=False)
        assert not d.auto_tile(big2, True, sim=False)
    assert not lk.megakernel(W.logistic_step).dispatcher.auto_tile(big, plain, sim=False)   # not a stencil

    # a halo longer than 1/32 of the first extent (jnp.roll's wrap read as offsets of n - 1 by
    # a drop-in loop's body): too few tiles, the grid scope
    def far(t, u, v):
        n = u.shape[0]
        for i in lk.range(n):
            v[i] = 0.5 * (u[i + 99] if i < 1 else u[i - 1])

    wide = lk.megakernel(far, swap=[("u", "v")]).dispatcher
    assert wide.fused_steps and wide.stencil.halo[0] == (1, 99)
    assert wide.auto_tile(100, plain, sim=False)                       # shapes unknown
    assert not wide.auto_tile(100, plain, sim=False, shapes=[(100,), (100,)])
    assert not wide.auto_tile(99 * 32 - 1, plain, sim=False, shapes=[(99 * 32 - 1,), (99 * 32 - 1,)])
    assert wide.auto_tile(99 * 32, plain, sim=False, shapes=[(99 * 32,), (99 * 32,)])
    assert heat.auto_tile(100, plain, sim=False, shapes=[(100,), (100,), None])


def test_a_cluster_kernel_uses_the_cluster_barrier_everywhere():
    # every barrier of a cluster launch, the ones inside reductions and lk.sync() included,
    # must be the cluster's: a grid barrier there would count blocks of another launch's
    # protocol, and a cluster barrier in a grid launch would not span the grid
    def two_phase(t, u, v, w, c):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            w[i] = u[i] + c * (u[i - 1] - 2.0 * u[i] + u[i + 1])
        lk.sync()
        for i in lk.range(1, n - 1):
            v[i] = w[i]
        for i in lk.range(0, n, n - 1):
            v[i] = u[i]
        return lk.max(w[0]) > -1.0

    # (Jacobi's halo exchange passes the barrier of the reduction it ends with: codegen._tile_lines)
    for fn, syncs in ((W.jacobi_step, 0), (two_phase, 2)):
        k = lk.megakernel(fn, swap=[("u", "v")])
        st = find_stencil(k.spec)
        assert hasattr(st, "halo"), st
        src = codegen.render_kernel(k.spec, "cuda", "grid", tile=st, cluster=True).text
        # the tile's halo exchange, and lk.sync()
        assert src.count("_lk_rt.cluster_sync(") == syncs and "_lk_rt.cluster_finish(" in src
        assert "grid_sync" not in src and "_lk_rt.grid_" not in src
        assert "_lk_rt.cluster_max(" in src
        plain = codegen.render_kernel(k.spec, "cuda", "grid", tile=st).text
        assert "cluster_" not in plain
    h = lk.megakernel(W.heat_step, swap=[("u", "v")])
    with pytest.raises(ValueError, match="cluster launches exist for tile mode only"):
        codegen.render_kernel(h.spec, "cuda", "grid", cluster=True)
    assert "_lk_rt.cluster_sync(" in h.source("cuda", "cluster")


def test_scope_cluster_says_why_it_cannot_run(rng):
    from numba import cuda
    from loopkern.errors import ArgumentError, LaunchError
    x = cuda.to_device(rng.random(64))
    y = cuda.to_device(rng.random(64))
    life = lk.megakernel(W.life_step, swap=[("a", "b")])
    g = cuda.to_device(np.zeros((8, 8), np.int64))
    with pytest.raises(ArgumentError, match="scope='cluster': step 'life_step' wraps around along its first dimension"):
        life(g, cuda.to_device(np.zeros((8, 8), np.int64)), cuda.to_device(np.zeros(4, np.int64)), steps=1,
             backend="cuda", scope="cluster")
    heat = lk.megakernel(W.heat_step, swap=[("u", "v")])
    with pytest.raises(ArgumentError, match="scope='cluster' has no bounds-checked kernel"):
        heat(x, y, 0.1, steps=1, backend="cuda", scope="cluster", debug=True)
    with pytest.raises(LaunchError, match="simulator can run only one cooperative block"):
        heat(x, y, 0.1, steps=1, backend="cuda", scope="cluster", blocks=2)
    with pytest.raises(ArgumentError, match="scope='cluster' keeps the swap pairs' arrays on chip"):
        lk.megakernel(W.heat_step)(x, y, 0.1, steps=1, backend="cuda", scope="cluster")
    with pytest.raises(ArgumentError, match="scope='cluster' exists for the CUDA backend only"):
        heat.source("cpu", "cluster")


@pytest.mark.parametrize("shape,steps", [((6, 10), 5), ((9, 40), 4), ((2, 3), 3)])
@pytest.mark.parametrize("knob", [None, "split"])
def test_two_swap_pairs_exchanged_in_a_two_dimensional_tile(shape, steps, knob, rng, monkeypatch):
    # one block: each wrapped halo row of both pairs comes back through the exchange from the
    # buffer the last step wrote (the split experiment too)
    from numba import cuda

    from loopkern.dispatch import kernels
    if knob == "split":
        monkeypatch.setattr(kernels, "SPLIT_EXCHANGE", True)
    k = lk.megakernel(W.coupled_rings_step, swap=[("a", "b"), ("c", "d")])
    st = find_stencil(k.spec)
    assert st.halo[0] == (1, 1) and st.periodic == (True, True)
    a0, c0 = rng.random(shape), rng.random(shape)
    a, b, c, d = (cuda.to_device(x) for x in (a0, a0, c0, c0))
    run = k(a, b, c, d, steps=steps, backend="cuda", scope="tile", threads=32)
    assert run.scope == "tile" and run.steps == steps
    ra, rc = W.coupled_rings_ref(a0, c0, steps)
    pa, pc = W.coupled_rings_ref(a0, c0, steps - 1)
    np.testing.assert_allclose(a.copy_to_host(), ra, rtol=1e-12)
    np.testing.assert_allclose(c.copy_to_host(), rc, rtol=1e-12)
    np.testing.assert_allclose(b.copy_to_host(), pa, rtol=1e-12)
    np.testing.assert_allclose(d.copy_to_host(), pc, rtol=1e-12)
