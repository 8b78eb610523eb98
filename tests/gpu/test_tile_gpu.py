"""scope="tile" and scope="cluster" on the GPU: each block keeps its tile of the swap pairs'
arrays in shared memory for the whole run and exchanges only its edge cells (a cluster's
blocks pass the cluster's hardware barrier instead of the grid barrier). Every run is compared bit for bit with the
same step in scope="grid" (the same arithmetic in the same order, so any difference is a
missing or stale halo cell) and with a float64 reference, over thousands of steps, at several
block counts, on fields that do not divide into equal tiles; a run stopped by its timeout must
hold exactly ``run.steps`` steps."""

import numpy as np
import pytest

import loopkern as lk
import refs
import workloads as W

pytestmark = pytest.mark.gpu


def _cuda():
    from numba import cuda
    return cuda


def wide_step(t, u, v, c):
    n = u.shape[0]
    for i in lk.range(3, n - 2):
        v[i] = u[i] + c * (u[i - 3] - u[i + 2]) + c * c * (u[i + 1] - u[i - 1])
    for i in lk.range(0, 3):
        v[i] = u[i]
    for i in lk.range(n - 2, n):
        v[i] = u[i]


def _both(k, u0, scalars, steps, blocks, dtype=np.float32, mode="tile", **kw):
    """The same run in ``mode`` ("tile" or "cluster", with ``blocks``) and in the grid scope."""
    cuda = _cuda()
    out = {}
    for scope in (mode, "grid"):
        u, v = cuda.to_device(u0.astype(dtype)), cuda.to_device(u0.astype(dtype))
        run = k(u, v, *scalars, steps=steps, backend="cuda", scope=scope,
                blocks=blocks if scope == mode else None, **kw)
        assert run.scope == scope and run.steps == steps
        out[scope] = (u.copy_to_host(), v.copy_to_host(), run)
    return out


# (n, blocks): uneven tiles at several block counts, each small enough for shared memory
# (1M float32 cells on 7 blocks would need 1.2 MB per block)
@pytest.mark.parametrize("n,blocks", [(65536 + 7, 7), (65536 + 7, 132), (65536 + 7, None), (1 << 20, 264),
                                      (1 << 20, None)])
def test_heat_in_tile_mode_equals_the_grid_scope_bit_for_bit(n, blocks, rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(n)
    steps = 2001                                # odd: the end-of-run rename too
    out = _both(k, u0, (np.float32(0.25),), steps, blocks)
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])
    exact = refs.heat_exact(u0.astype(np.float32), steps, 0.25)
    assert np.abs(out["tile"][0] - exact).max() < 1e-4
    if blocks is not None:
        assert out["tile"][2].blocks == blocks


@pytest.mark.parametrize("blocks", [50, 132, None])
def test_a_wide_uneven_stencil_in_tile_mode(blocks, rng):
    k = lk.megakernel(wide_step, swap=[("u", "v")])
    u0 = rng.random(100003)
    out = _both(k, u0, (0.05,), 999, blocks, dtype=np.float64)
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])


def test_tiles_above_48_kib_of_shared_memory(rng):
    # 2M float32 cells, two buffers (16 MiB, about half the chip's shared memory): the tiles
    # need more than 48 KiB per block, so the kernel opts in
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(1 << 21)
    out = _both(k, u0, (np.float32(0.25),), 300, None)
    cfg = out["tile"][2]
    assert 2 * 4 * (-(-(1 << 21) // cfg.blocks)) > 48 * 1024
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])


@pytest.mark.parametrize("mode,n", [("tile", 1 << 20), ("cluster", 65536 + 7)])
def test_a_timeout_leaves_exactly_run_steps_steps(mode, n, rng, request):
    if mode == "cluster":
        request.getfixturevalue("clusters")
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(n).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, np.float32(0.25), steps=10 ** 8, backend="cuda", scope=mode, timeout=0.3)
    assert run.stopped == "timeout" and 0 < run.steps < 10 ** 8
    a, b = cuda.to_device(u0), cuda.to_device(u0)
    k(a, b, np.float32(0.25), steps=run.steps, backend="cuda", scope="grid")
    np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())
    np.testing.assert_array_equal(v.copy_to_host(), b.copy_to_host())


@pytest.mark.parametrize("mode,blocks", [("tile", 7), ("tile", None), ("cluster", None)])
def test_a_cancel_stops_every_block_at_one_step_and_the_next_run_starts_clean(mode, blocks, rng, request):
    # every block must stop after the same step (one stopping at another count would leave the
    # others waiting at the barrier, or a torn state), and nothing the stop left behind may
    # stop or stall the next launch of the same plan
    import time
    if mode == "cluster":
        request.getfixturevalue("clusters")
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(65536 + 7).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    h = k.start(u, v, np.float32(0.25), steps=10 ** 9, backend="cuda", scope=mode, blocks=blocks)
    time.sleep(0.2)
    h.cancel()
    run = h.wait(timeout=30)
    assert run.stopped == "cancelled" and 0 < run.steps < 10 ** 9, run
    a, b = cuda.to_device(u0), cuda.to_device(u0)
    k(a, b, np.float32(0.25), steps=run.steps, backend="cuda", scope="grid")
    np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())
    np.testing.assert_array_equal(v.copy_to_host(), b.copy_to_host())
    # the same plan again (same buffers of the free list): runs its 1001 steps, no fewer
    again = k(u, v, np.float32(0.25), steps=1001, backend="cuda", scope=mode, blocks=blocks)
    k(a, b, np.float32(0.25), steps=1001, backend="cuda", scope="grid")
    assert again.steps == 1001 and again.stopped == "steps"
    np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())


def heat_with_probe(t, u, v, probe, alpha):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]
    for i in lk.range(n // 2, n // 2 + 1):
        probe[t % probe.shape[0]] = u[i]


@pytest.mark.parametrize("mode,blocks", [("tile", 7), ("cluster", None)])
def test_a_step_that_also_writes_global_memory_in_tile_mode(mode, blocks, rng, request):
    # probe stays in global memory (hist[t]-style stores), written by one block's thread at
    # every step: the last write must be the last step's, as in the grid scope
    if mode == "cluster":
        request.getfixturevalue("clusters")
    cuda = _cuda()
    k = lk.megakernel(heat_with_probe, swap=[("u", "v")])
    u0 = rng.random(65536 + 7).astype(np.float32)
    out = {}
    for scope in (mode, "grid"):
        u, v, p = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(np.zeros(5, np.float32))
        k(u, v, p, np.float32(0.25), steps=2003, backend="cuda", scope=scope, blocks=blocks if scope == mode else None)
        out[scope] = (u.copy_to_host(), p.copy_to_host())
    np.testing.assert_array_equal(out[mode][0], out["grid"][0])
    np.testing.assert_array_equal(out[mode][1], out["grid"][1])


@pytest.mark.parametrize("shape,blocks", [((1024, 1024), None), ((517, 333), 7), ((1500, 700), None)])
def test_two_dimensional_heat_in_tile_mode_equals_the_grid_scope(shape, blocks, rng):
    from bench.heat2d import heat2d_kernel
    k = heat2d_kernel()
    u0 = rng.random(shape)
    out = _both(k, u0, (np.float32(0.2),), 1001, blocks)
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])


# stencils that wrap around along dimension 0: the first tile's lower halo is the array's last
# rows, the last tile's upper halo its first rows (codegen _tile_lines, rt.tile_row); odd shapes,
# short last tiles and several block counts
@pytest.mark.parametrize("shape,blocks", [((1024, 1024), None), ((517, 333), 7), ((9, 50), 4), ((64, 96), 3),
                                          ((301, 64), 132)])
def test_game_of_life_in_tile_mode_equals_the_grid_scope(shape, blocks, rng):
    from bench.life import life_kernel
    cuda = _cuda()
    k = life_kernel()
    a0 = (rng.random(shape) < 0.35).astype(np.int32)
    steps = 301
    out = {}
    for scope in ("tile", "grid"):
        a, b = cuda.to_device(a0), cuda.to_device(a0)
        run = k(a, b, steps=steps, backend="cuda", scope=scope, blocks=blocks if scope == "tile" else None)
        assert run.scope == scope and run.steps == steps
        out[scope] = (a.copy_to_host(), b.copy_to_host())
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])
    np.testing.assert_array_equal(out["tile"][0], W.life_ref(a0, steps)[0])


@pytest.mark.parametrize("shape,blocks", [((517, 333), 7), ((1024, 1024), None), ((40, 64), 13)])
def test_a_one_sided_wrapping_stencil_in_tile_mode(shape, blocks, rng):
    # the neighbour above named once (Stencil.row_shifts: addressed from the cell's row)
    k = lk.megakernel(W.drift_step, swap=[("u", "v")])
    u0 = rng.random(shape)
    out = _both(k, u0, (), 1001, blocks)
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])
    np.testing.assert_allclose(out["tile"][0], W.drift_ref(u0.astype(np.float32), 1001), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("blocks", [2, 5, None])
@pytest.mark.parametrize("fn", [W.life_step, W.life_tuple_step])
def test_life_with_its_population_in_tile_mode(fn, blocks, rng):
    # the (i + di + n) % n form (and examples/life.py's, names bound by tuple assignments), a
    # reduction over the grid and a store by one thread each step
    cuda = _cuda()
    k = lk.megakernel(fn, swap=[("a", "b")])
    a0 = (rng.random((203, 77)) < 0.4).astype(np.int32)
    steps = 157
    ref, pops = W.life_ref(a0, steps)
    a, b, pop = cuda.to_device(a0), cuda.to_device(a0), cuda.to_device(np.zeros(steps, np.int64))
    run = k(a, b, pop, steps=steps, backend="cuda", scope="tile", blocks=blocks)
    assert run.scope == "tile" and run.steps == steps
    np.testing.assert_array_equal(a.copy_to_host(), ref)
    np.testing.assert_array_equal(pop.copy_to_host(), pops)


@pytest.mark.parametrize("fn,ref,n,blocks", [(W.ring_rows_step, W.ring_rows_ref, 65536 + 7, 7),
                                             (W.ring_rows_step, W.ring_rows_ref, 65536 + 7, None),
                                             (W.ring_rows_step, W.ring_rows_ref, 400, 132),    # tiles of 3-4 cells
                                             (W.back_step, W.back_ref, 65536 + 7, 132),
                                             (W.back_step, W.back_ref, 97, 3)])
def test_one_dimensional_wrapping_stencils_in_tile_mode(fn, ref, n, blocks, rng):
    k = lk.megakernel(fn, swap=[("u", "v")])
    u0 = rng.random(n)
    steps = 1001
    out = _both(k, u0, (), steps, blocks)
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])
    np.testing.assert_allclose(out["tile"][0], ref(u0.astype(np.float32), steps), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["tile", "cluster"])
def test_jacobi_to_tolerance_in_tile_mode_stops_where_the_grid_scope_does(mode, rng, request):
    # in a cluster, the lk.max reduction combines the blocks' partial results across the
    # cluster barrier
    if mode == "cluster":
        request.getfixturevalue("clusters")
    cuda = _cuda()
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    # 300 x 49: tiles of 3 rows at 132 blocks, and a narrow side that converges in ~6000 steps
    # (the slowest Jacobi mode of a 513 x 257 field needs over 100K steps to reach any useful tolerance)
    u0 = rng.random((300, 49))
    tol = 1e-3
    runs, states = {}, {}
    for scope in (mode, "grid"):
        u, v = cuda.to_device(u0), cuda.to_device(u0)
        runs[scope] = k(u, v, tol, max_steps=20000, backend="cuda", scope=scope)
        states[scope] = u.copy_to_host()
    assert runs[mode].stopped == "condition" and runs[mode].steps == runs["grid"].steps
    np.testing.assert_array_equal(states[mode], states["grid"])
    ref, ref_steps = W.jacobi_ref(u0, tol, 20000)
    assert abs(runs[mode].steps - ref_steps) <= 1
    np.testing.assert_allclose(states[mode], ref, rtol=0, atol=1e-9)


# (shape, blocks, dtype): the step's edge rows published before its reduction, whose grid
# barrier is the exchange's (codegen._tile_lines): tiles of 1 to 43 rows, the last shorter
@pytest.mark.parametrize("shape,blocks,dtype", [((300, 49), 7, np.float64), ((300, 49), 33, np.float64),
                                                ((256, 256), None, np.float32), ((257, 131), 132, np.float32),
                                                ((300, 49), 120, np.float64)])
def test_jacobi_whose_exchange_passes_its_reductions_barrier(shape, blocks, dtype, rng):
    from loopkern import codegen
    cuda = _cuda()
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    src = k.source("cuda", "tile")
    assert "_lk_rt.grid_sync(" not in src, "the exchange should pass the reduction's barrier"
    assert codegen.reduction_barrier_at(k.spec.step) is not None
    u0 = rng.random(shape).astype(dtype)
    tol = dtype(1e-3)
    runs, states = {}, {}
    for scope in ("tile", "grid"):
        u, v = cuda.to_device(u0), cuda.to_device(u0)
        runs[scope] = k(u, v, tol, max_steps=20000, backend="cuda", scope=scope,
                        blocks=blocks if scope == "tile" else None)
        states[scope] = (u.copy_to_host(), v.copy_to_host())
    assert runs["tile"].scope == "tile" and runs["tile"].stopped == "condition"
    assert runs["tile"].steps == runs["grid"].steps
    np.testing.assert_array_equal(states["tile"][0], states["grid"][0])
    np.testing.assert_array_equal(states["tile"][1], states["grid"][1])
    ref, ref_steps = W.jacobi_ref(u0, float(tol), 20000)
    assert abs(runs["tile"].steps - ref_steps) <= (1 if dtype == np.float64 else 40)
    np.testing.assert_allclose(states["tile"][0], ref, rtol=0, atol=1e-9 if dtype == np.float64 else 2e-3)


@pytest.mark.parametrize("blocks", [5, 64, None])
def test_a_carried_reduction_whose_exchange_passes_its_barrier(blocks, rng):
    cuda = _cuda()
    k = lk.megakernel(W.smooth_carried_step, swap=[("u", "v")])
    assert "_lk_rt.grid_sync(" not in k.source("cuda", "tile")
    u0 = rng.random(4099)
    u0[0], u0[-1] = 0.0, 1.0
    tol = 1e-7
    runs, states = {}, {}
    for scope in ("tile", "grid"):
        u, v, last = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(np.full(1, -1.0))
        runs[scope] = k(u, v, tol, last, max_steps=3001, backend="cuda", scope=scope,
                        blocks=blocks if scope == "tile" else None)
        states[scope] = (u.copy_to_host(), v.copy_to_host(), last.copy_to_host())
    assert runs["tile"].scope == "tile" and runs["tile"].steps == runs["grid"].steps
    for a, b in zip(states["tile"], states["grid"]):
        np.testing.assert_array_equal(a, b)
    ref, ref_steps, err = W.smooth_carried_ref(u0, tol, 3001)
    assert runs["tile"].steps == ref_steps
    np.testing.assert_allclose(states["tile"][0], ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(states["tile"][2][0], err, rtol=1e-12)


@pytest.mark.parametrize("stop", ["timeout", "cancel"])
def test_a_fused_exchange_stopped_mid_run_leaves_exactly_run_steps_steps(stop, rng):
    import time
    cuda = _cuda()
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = rng.random((301, 67))
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    # a negative tolerance never converges: only the stop ends the run
    if stop == "timeout":
        run = k(u, v, -1.0, max_steps=10 ** 9, backend="cuda", scope="tile", blocks=17, timeout=0.3)
    else:
        h = k.start(u, v, -1.0, max_steps=10 ** 9, backend="cuda", scope="tile", blocks=17)
        time.sleep(0.2)
        h.cancel()
        run = h.wait(timeout=30)
    assert run.stopped == {"timeout": "timeout", "cancel": "cancelled"}[stop] and 0 < run.steps < 10 ** 9, run
    a, b = cuda.to_device(u0), cuda.to_device(u0)
    k(a, b, -1.0, steps=run.steps, backend="cuda", scope="grid")
    np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())
    np.testing.assert_array_equal(v.copy_to_host(), b.copy_to_host())


BEYOND = [(W.smooth_and_count_longer, (4099,), 6000), (W.smooth_and_count_below_zero, (4099,), 6000),
          (W.smooth_until_a_longer_sum, (4099,), 6000), (W.smooth2d_and_count_longer, (301, 67), (403, 67))]


@pytest.mark.parametrize("blocks", [7, 64, None])
@pytest.mark.parametrize("fn,shape,wshape", BEYOND, ids=[b[0].__name__ for b in BEYOND])
def test_loops_past_the_pairs_extent_run_every_index_on_every_block_count(fn, shape, wshape, blocks, rng):
    # the first block takes a loop's indices below 0 and the last block those from the pair's
    # extent on: every index runs once
    cuda = _cuda()
    k = lk.megakernel(fn, swap=[("u", "v")])
    u0 = rng.random(shape)
    w0 = np.ones(wshape) if fn is W.smooth_until_a_longer_sum else np.zeros(wshape)
    u, v, w = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(w0)
    run = k(u, v, w, max_steps=50, backend="cuda", scope="tile", blocks=blocks)
    ref_u, ref_w, ref_steps = W.beyond_the_pair_refs(fn, u0, w0, 50)
    assert run.scope == "tile" and run.steps == ref_steps
    np.testing.assert_allclose(u.copy_to_host(), ref_u, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(w.copy_to_host(), ref_w)


def test_a_field_too_large_for_the_chip_is_refused_before_anything_runs(rng):
    # 2048² float32, two buffers: 32 MiB, more than all SMs' shared memory together
    from loopkern.errors import LaunchError
    cuda = _cuda()
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = rng.random((2048, 2048)).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    with pytest.raises(LaunchError, match="cannot keep this field on chip"):
        k(u, v, np.float32(1e-4), max_steps=10, backend="cuda", scope="tile")
    np.testing.assert_array_equal(u.copy_to_host(), u0)


def test_scope_auto_keeps_a_large_one_dimensional_stencil_on_chip(rng):
    from loopkern.dispatch.config import AUTO_TILE_MIN_ELEMENTS
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(AUTO_TILE_MIN_ELEMENTS + 5)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, 0.25, steps=501, backend="cuda")
    assert run.scope == "tile", run
    np.testing.assert_allclose(u.copy_to_host(), W.heat_ref(u0, 501, 0.25), rtol=0, atol=1e-12)
    # a step that also writes another array runs one step per exchange: tiles only pay off
    # for large fields, the grid scope runs smaller ones
    p = lk.megakernel(heat_with_probe, swap=[("u", "v")])
    small = cuda.to_device(u0[:65536]), cuda.to_device(u0[:65536]), cuda.to_device(np.zeros(5))
    assert p(*small, 0.25, steps=3, backend="cuda").scope == "grid"


@pytest.mark.parametrize("shape,scope", [((64, 64), "block"), ((1024, 1024), "tile"), ((2048, 2048), "grid")])
def test_scope_auto_keeps_a_two_dimensional_stencil_on_chip_where_it_pays(shape, scope, rng):
    """2-D stencils run in tile mode from config.AUTO_TILE_2D_MIN_ELEMENTS elements where their
    tiles fit: 64² heat runs in one block, 2048² float32 does not fit (both buffers, 32 MB) and
    falls back to the grid scope. Against the float64 reference (float32 arithmetic)."""
    from bench.heat2d import ALPHA2, heat2d_kernel, heat2d_ref
    cuda = _cuda()
    k = heat2d_kernel()
    u0 = rng.random(shape).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, ALPHA2, steps=203, backend="cuda")
    assert run.scope == scope and run.steps == 203, run
    np.testing.assert_allclose(u.copy_to_host(), heat2d_ref(u0, 203), rtol=1e-5, atol=1e-6)


def test_scope_auto_runs_life_and_jacobi_in_tile_mode(rng):
    """A stencil that wraps around (Life) and one that reduces and stops on a condition
    (Jacobi) at 512²: tile mode under scope="auto", against their references."""
    from bench.life import life_kernel, life_ref
    cuda = _cuda()
    a0 = (rng.random((512, 512)) < 0.35).astype(np.int32)
    a, b = cuda.to_device(a0), cuda.to_device(a0)
    run = life_kernel()(a, b, steps=101, backend="cuda")
    assert run.scope == "tile" and run.steps == 101, run
    np.testing.assert_array_equal(a.copy_to_host(), life_ref(a0, 101))
    u0 = np.zeros((512, 512))
    u0[0, :] = 1.0
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    run = k(u, v, 1e-4, max_steps=2000, backend="cuda")
    ref, ref_steps = W.jacobi_ref(u0, 1e-4, 2000)
    assert run.scope == "tile" and run.steps == ref_steps, (run, ref_steps)
    np.testing.assert_allclose(u.copy_to_host(), ref, rtol=0, atol=1e-12)


# -- several steps per halo exchange (temporal blocking) -------------------------------------

@pytest.fixture
def depth_cap(monkeypatch):
    """Sets the most steps per exchange (and 1 for how many widened halos a tile must be long),
    so that small fields and few blocks still run several steps per exchange. Kernels made
    after the call see it."""
    from loopkern.dispatch import config

    def cap(steps):
        monkeypatch.setattr(config, "TILE_DEPTH_MAX", steps)
        monkeypatch.setattr(config, "TILE_DEPTH_SPAN", 1)
    return cap


# (cap, blocks, n): uneven tiles, rounds cut short by an odd step count, a halo as deep as the
# tile is long (4099 on 64 blocks: 65-cell tiles, 32 steps per exchange), the last block's
# tile shorter than the others'
@pytest.mark.parametrize("cap,blocks,n", [(2, 7, 65536 + 7), (5, 33, 65536 + 7), (32, None, 65536 + 7),
                                          (32, None, 4099), (3, 132, 10007), (32, None, (1 << 20) + 3),
                                          (32, 64, 64 * 32 + 1)])
def test_rounds_of_steps_in_tile_mode_equal_the_grid_scope_bit_for_bit(cap, blocks, n, rng, depth_cap):
    depth_cap(cap)
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(n)
    out = _both(k, u0, (np.float32(0.25),), 2003, blocks)
    run = out["tile"][2]
    assert 1 < run.steps_per_exchange <= cap, run
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])
    exact = refs.heat_exact(u0.astype(np.float32), 2003, 0.25)
    assert np.abs(out["tile"][0] - exact).max() < 1e-4


@pytest.mark.parametrize("cap,blocks", [(4, 7), (32, None), (3, 97)])
def test_unwritten_cells_and_different_buffers_in_rounds(cap, blocks, rng, depth_cap):
    # cells a step skips keep the other buffer's value, and the two buffers start different:
    # the halo must carry both buffers of the pair
    depth_cap(cap)
    run, _ = _uneven_in_tile_mode(30011, 1001, blocks, rng)
    assert run.steps_per_exchange > 1


def _uneven_in_tile_mode(n, steps, blocks, rng):
    """test_tile_rounds.uneven_step (cells a step skips, buffers that start different) in tile
    mode and in the grid scope: bit for bit equal, and within rounding of the float64
    reference. Returns the tile run and the kernel."""
    from test_tile_rounds import uneven_ref, uneven_step
    cuda = _cuda()
    k = lk.megakernel(uneven_step, swap=[("u", "v")])
    u0, v0, w = rng.random(n), rng.random(n), rng.random(n)
    out = {}
    for scope in ("tile", "grid"):
        u, v = cuda.to_device(u0), cuda.to_device(v0)
        run = k(u, v, cuda.to_device(w), 0.2, steps=steps, backend="cuda", scope=scope,
                blocks=blocks if scope == "tile" else None)
        out[scope] = (u.copy_to_host(), v.copy_to_host(), run)
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])
    ru, rv = uneven_ref(u0, v0, w, 0.2, steps)
    np.testing.assert_allclose(out["tile"][0], ru, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out["tile"][1], rv, rtol=1e-9, atol=1e-12)
    return out["tile"][2], k


@pytest.mark.parametrize("blocks", [17, None])
def test_two_swap_pairs_and_random_draws_in_rounds(blocks, rng, depth_cap):
    from test_tile_rounds import noisy_step, two_pairs_ref, two_pairs_step
    depth_cap(8)
    cuda = _cuda()
    k = lk.megakernel(two_pairs_step, swap=[("a", "a2"), ("b", "b2")])
    n, steps = 50001, 777
    a0, b0 = rng.random(n), rng.random(n)
    out = {}
    for scope in ("tile", "grid"):
        arrs = [cuda.to_device(x) for x in (a0, a0, b0, b0)]
        run = k(*arrs, 0.1, steps=steps, backend="cuda", scope=scope, blocks=blocks if scope == "tile" else None)
        out[scope] = ([x.copy_to_host() for x in arrs], run)
    assert out["tile"][1].steps_per_exchange > 1
    for got, grid, ref in zip(out["tile"][0], out["grid"][0], two_pairs_ref(a0, b0, 0.1, steps)):
        np.testing.assert_array_equal(got, grid)
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)
    # lk.random: each draw a function of seed, t, key and call site, so recomputed halo cells
    # draw the same numbers as the block that owns them
    noisy = lk.megakernel(noisy_step, swap=[("u", "v")])
    res = {}
    for scope in ("tile", "grid"):
        u, v = cuda.to_device(a0), cuda.to_device(a0)
        run = noisy(u, v, steps=501, seed=11, backend="cuda", scope=scope, blocks=blocks if scope == "tile" else None)
        res[scope] = (u.copy_to_host(), run)
    assert res["tile"][1].steps_per_exchange > 1
    np.testing.assert_array_equal(res["tile"][0], res["grid"][0])


def test_scope_auto_runs_small_and_mid_one_dimensional_stencils_in_rounds(rng):
    cuda = _cuda()
    for n in (4096, 65536 + 3):
        k = lk.megakernel(W.heat_step, swap=[("u", "v")])
        u0 = rng.random(n).astype(np.float32)
        u, v = cuda.to_device(u0), cuda.to_device(u0)
        run = k(u, v, np.float32(0.25), steps=3001, backend="cuda")
        assert run.scope == "tile" and run.steps_per_exchange > 1, run
        a, b = cuda.to_device(u0), cuda.to_device(u0)
        k(a, b, np.float32(0.25), steps=3001, backend="cuda", scope="grid")
        np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())
        np.testing.assert_array_equal(v.copy_to_host(), b.copy_to_host())


@pytest.mark.parametrize("blocks", [13, None])
def test_a_cancel_in_rounds_leaves_exactly_run_steps_steps(blocks, rng, depth_cap):
    # a stop is decided once per round: every block stops after the same round, and the state
    # is exactly run.steps steps
    import time
    depth_cap(7)
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(200003).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    h = k.start(u, v, np.float32(0.25), steps=10 ** 9 + 3, backend="cuda", scope="tile", blocks=blocks)
    time.sleep(0.2)
    h.cancel()
    run = h.wait(timeout=30)
    assert run.stopped == "cancelled" and 0 < run.steps < 10 ** 9 and run.steps_per_exchange == 7, run
    a, b = cuda.to_device(u0), cuda.to_device(u0)
    k(a, b, np.float32(0.25), steps=run.steps, backend="cuda", scope="grid")
    np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())
    np.testing.assert_array_equal(v.copy_to_host(), b.copy_to_host())


# -- scope="cluster": the same tiles in one thread-block cluster (H100/H200: up to 16 blocks) ----

@pytest.fixture
def clusters():
    """Skips a test on a GPU without thread-block clusters (compute capability below 9.0)."""
    if tuple(_cuda().get_current_device().compute_capability) < (9, 0):
        pytest.skip("thread-block clusters need compute capability 9.0 or newer")


needs_clusters = pytest.mark.usefixtures("clusters")


# uneven tiles at the portable and non-portable cluster sizes; 300001 float32 cells in two
# buffers fill 150 KB of each of 16 blocks' shared memory
@needs_clusters
@pytest.mark.parametrize("n,blocks", [(65536 + 7, 7), (65536 + 7, 16), (65536 + 7, None), (4097, 3),
                                      (300001, None)])
def test_heat_in_a_cluster_equals_the_grid_scope_bit_for_bit(n, blocks, rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(n)
    steps = 3001
    out = _both(k, u0, (np.float32(0.25),), steps, blocks, mode="cluster")
    np.testing.assert_array_equal(out["cluster"][0], out["grid"][0])
    np.testing.assert_array_equal(out["cluster"][1], out["grid"][1])
    exact = refs.heat_exact(u0.astype(np.float32), steps, 0.25)
    assert np.abs(out["cluster"][0] - exact).max() < 1e-4
    assert out["cluster"][2].blocks == (blocks or 16)


@needs_clusters
@pytest.mark.parametrize("blocks", [9, None])
def test_a_wide_uneven_stencil_in_a_cluster(blocks, rng):
    k = lk.megakernel(wide_step, swap=[("u", "v")])
    u0 = rng.random(100003)
    out = _both(k, u0, (0.05,), 999, blocks, dtype=np.float64, mode="cluster")
    np.testing.assert_array_equal(out["cluster"][0], out["grid"][0])
    np.testing.assert_array_equal(out["cluster"][1], out["grid"][1])


@needs_clusters
@pytest.mark.parametrize("shape,blocks", [((517, 333), 7), ((256, 256), None), ((300, 200), 16)])
def test_two_dimensional_heat_in_a_cluster_equals_the_grid_scope(shape, blocks, rng):
    from bench.heat2d import heat2d_kernel
    k = heat2d_kernel()
    u0 = rng.random(shape)
    out = _both(k, u0, (np.float32(0.2),), 1001, blocks, mode="cluster")
    np.testing.assert_array_equal(out["cluster"][0], out["grid"][0])
    np.testing.assert_array_equal(out["cluster"][1], out["grid"][1])


@needs_clusters
def test_a_cluster_refuses_what_it_cannot_hold_before_anything_runs(rng):
    from loopkern.errors import LaunchError
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(1 << 20).astype(np.float32)       # 8 MB in two buffers: more than 16 SMs hold
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    with pytest.raises(LaunchError, match="scope='cluster' cannot keep this field on chip"):
        k(u, v, np.float32(0.25), steps=10, backend="cuda", scope="cluster")
    small = cuda.to_device(u0[:4096]), cuda.to_device(u0[:4096])
    with pytest.raises(LaunchError, match="blocks=17: scope='cluster' runs one cluster of 1 to 16 blocks"):
        k(*small, np.float32(0.25), steps=10, backend="cuda", scope="cluster", blocks=17)
    np.testing.assert_array_equal(u.copy_to_host(), u0)
    np.testing.assert_array_equal(small[0].copy_to_host(), u0[:4096])


# -- fields too large to stay on chip: tiles streamed through shared memory each round ----------

def _tile_config(k):
    """The launch configuration of the kernel's tile-mode plan."""
    return next(p.config for p in k.dispatcher.plans.values() if p.config.scope == "tile")


@pytest.mark.parametrize("n,blocks", [((1 << 22) + 3, None), ((1 << 22) + 3, 100), ((1 << 24) + 1, None)])
def test_a_streamed_field_equals_the_grid_scope_bit_for_bit(n, blocks, rng):
    # 4M and 16M float32 cells in two buffers: 32 and 128 MiB, more than the chip's shared memory
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(n)
    out = _both(k, u0, (np.float32(0.25),), 301, blocks)
    cfg = _tile_config(k)
    assert cfg.tiles >= 1 and out["tile"][2].steps_per_exchange > 1, cfg
    if blocks is not None:
        assert cfg.blocks == blocks
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])
    exact = refs.heat_exact(u0.astype(np.float32), 301, 0.25)
    assert np.abs(out["tile"][0] - exact).max() < 1e-4


def test_streamed_unwritten_cells_in_float64(rng):
    _, k = _uneven_in_tile_mode(3_000_017, 101, None, rng)
    assert _tile_config(k).tiles >= 1


def test_a_cancel_of_a_streamed_run_and_scope_auto(rng):
    import time
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random((1 << 22) + 5).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    h = k.start(u, v, np.float32(0.25), steps=10 ** 9, backend="cuda")        # scope="auto"
    time.sleep(0.3)
    h.cancel()
    run = h.wait(timeout=30)
    assert run.scope == "tile" and run.stopped == "cancelled" and 0 < run.steps < 10 ** 9, run
    assert _tile_config(k).tiles >= 1
    a, b = cuda.to_device(u0), cuda.to_device(u0)
    k(a, b, np.float32(0.25), steps=run.steps, backend="cuda", scope="grid")
    np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())
    np.testing.assert_array_equal(v.copy_to_host(), b.copy_to_host())


def test_an_argument_sharing_memory_with_a_tile_is_refused_and_a_copy_runs(rng):
    """w is the caller's u: refused in every scope (session 28 refused tile mode, where it read
    the stale copy in memory; since session 29 any array sharing memory with one the step
    writes); with a copy of u as w, scope='auto' (tile mode is its choice for this size) matches
    a float64 NumPy run."""
    from numba import cuda
    from test_tile import aliased_read_step
    n, steps = 1 << 20, 7
    u0 = rng.random(n)
    k = lk.megakernel(aliased_read_step, swap=[("u", "v")])
    u, v, out = cuda.to_device(u0), cuda.to_device(u0), cuda.to_device(np.zeros(n))
    for scope in ("tile", "auto", "grid"):
        with pytest.raises(lk.ArgumentError, match="argument 'w' shares memory with argument 'u'"):
            k(u, v, u, out, steps=steps, backend="cuda", scope=scope)
    assert k.dispatcher.auto_tile(n, False, sim=False)
    k(u, v, cuda.to_device(u0), out, steps=steps, backend="cuda", scope="auto")
    cur, nxt, ref_out = u0.copy(), u0.copy(), np.zeros(n)
    for _ in range(steps):
        nxt[1:-1] = 0.5 * (cur[:-2] + cur[2:])
        cur, nxt = nxt, cur
    ref_out[1:-1] = u0[1:-1]
    np.testing.assert_allclose(out.copy_to_host(), ref_out, rtol=1e-15)
    np.testing.assert_allclose(u.copy_to_host(), cur, rtol=1e-12)


# (517 rows over 17 tiles of 31 rows, the last one of 21: four float32 arrays of 33 rows of 333
# fit in a block's shared memory; 7 tiles of 75 rows did not)
@pytest.mark.parametrize("shape,blocks", [((517, 333), 17), ((1024, 1024), None), ((40, 64), 13), ((9, 700), 4)])
def test_two_swap_pairs_exchanged_between_two_dimensional_tiles(shape, blocks, rng):
    # both pairs' edge rows go through the exchange (one gather loop loads both arrays' rows)
    cuda = _cuda()
    k = lk.megakernel(W.coupled_rings_step, swap=[("a", "b"), ("c", "d")])
    a0, c0 = rng.random(shape), rng.random(shape)
    steps = 501
    out = {}
    for scope in ("tile", "grid"):
        arrs = [cuda.to_device(x.astype(np.float32)) for x in (a0, a0, c0, c0)]
        run = k(*arrs, steps=steps, backend="cuda", scope=scope, blocks=blocks if scope == "tile" else None)
        assert run.scope == scope and run.steps == steps
        out[scope] = [x.copy_to_host() for x in arrs]
    for x, y in zip(out["tile"], out["grid"]):
        np.testing.assert_array_equal(x, y)
    ra, rc = W.coupled_rings_ref(a0.astype(np.float32), c0.astype(np.float32), steps)
    np.testing.assert_allclose(out["tile"][0], ra, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["tile"][2], rc, rtol=1e-4, atol=1e-5)


def switch_on(monkeypatch, module, name, marker):
    """For an experiment's re-run of these tests (test_tile_split_gpu.py): set ``module.name``
    for the test and watch the kernels it renders; returns the check, for after the test, that
    one of them shows ``marker`` (the experiment's mark in the source), so that no re-run
    passes without it."""
    from loopkern import codegen
    monkeypatch.setattr(module, name, True)
    seen = []
    render = codegen.render_kernel

    def spy(*args, **kw):
        src = render(*args, **kw)
        seen.append(marker in src.text)
        return src
    monkeypatch.setattr(codegen, "render_kernel", spy)

    def check():
        assert any(seen), f"no kernel rendered with {name} showed {marker!r}"
    return check
