"""Tile mode with several steps per halo exchange (temporal blocking): which steps may run that
way (``stencil.fused_steps_refusal``), and the rounds kernel under Numba's CUDA simulator
against float64 NumPy references.

The simulator runs ONE block, so the tile covers the whole field: these tests check the
widened tile, the shrinking ranges of a round's steps, rounds cut short by the step count, the
halo scratch's layout, the stop decision per round and the end-of-run rename. The exchange
between blocks needs a GPU (tests/gpu/test_tile_gpu.py)."""

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern import codegen
from loopkern.compile import compile_kernel
from loopkern.dispatch import config
from loopkern.runtime.layout import DONE, HOST_SIZE, STEPS
from loopkern.stencil import NotStencil, Stencil, find_stencil, fused_steps_refusal
from test_tile import check_heat_pair

pytestmark = pytest.mark.sim


# -- which steps may run several per exchange ------------------------------------------------
def uneven_step(t, u, v, w, c):
    # cells a step does not write keep the other buffer's value (two steps old), and the
    # buffers start different: the halo must carry both buffers
    n = u.shape[0]
    for i in lk.range(2, n - 1):
        if (i + t) % 3 != 0:
            v[i] = u[i] + c * w[i] * (u[i - 2] - 2.0 * u[i] + u[i + 1])


def uneven_ref(u0, v0, w, c, steps):
    u, v = u0.astype(np.float64).copy(), v0.astype(np.float64).copy()
    i = np.arange(2, u.shape[0] - 1)
    for t in range(steps):
        j = i[(i + t) % 3 != 0]
        v[j] = u[j] + c * w[j] * (u[j - 2] - 2.0 * u[j] + u[j + 1])
        u, v = v, u
    return u, v


def two_pairs_step(t, a, a2, b, b2, k):
    # two swap pairs read across each other, a source switched on by the step index
    n = a.shape[0]
    for i in lk.range(1, n - 1):
        a2[i] = a[i] + k * (a[i - 1] + a[i + 1] - 2.0 * a[i]) - k * b[i]
        b2[i] = b[i] + k * (b[i + 1] - b[i]) + (k if t % 4 == 1 else 0.0) * a[i]


def two_pairs_ref(a, b, k, steps):
    a, b = a.astype(np.float64).copy(), b.astype(np.float64).copy()
    a2, b2 = a.copy(), b.copy()
    for t in range(steps):
        a2[1:-1] = a[1:-1] + k * (a[:-2] + a[2:] - 2.0 * a[1:-1]) - k * b[1:-1]
        b2[1:-1] = b[1:-1] + k * (b[2:] - b[1:-1]) + (k if t % 4 == 1 else 0.0) * a[1:-1]
        a, a2 = a2, a
        b, b2 = b2, b
    return a, a2, b, b2


def probe_step(t, u, v, hist):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    for i in lk.range(1, 2):
        hist[t] = u[i]


def until_step(t, u, v, tol):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    return t < 10


def sync_step(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    lk.sync()


def noisy_step(t, u, v):
    # a draw is a function of the seed, t, its key and its call site: a recomputed cell draws
    # the same number
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1]) + 0.01 * lk.random.uniform(i)


def atomic_step(t, u, v, total):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
        lk.atomic.add(total, 0, 1.0)


def thread_step(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + lk.thread_id()


@pytest.mark.parametrize("step,swap", [(W.heat_step, [("u", "v")]), (uneven_step, [("u", "v")]),
                                       (two_pairs_step, [("a", "a2"), ("b", "b2")]), (noisy_step, [("u", "v")])])
def test_pure_stencils_may_run_several_steps_per_exchange(step, swap):
    spec = lk.megakernel(step, swap=swap).spec
    st = find_stencil(spec)
    assert isinstance(st, Stencil)
    assert fused_steps_refusal(spec, st) is None


@pytest.mark.parametrize("step,reason", [
    (probe_step, "writes 'hist', which is not in a swap pair"),
    (until_step, "returns a condition"),
    (sync_step, "calls lk.sync"),
    (atomic_step, "writes 'total', which is not in a swap pair"),
    (thread_step, "calls lk.thread_id"),
])
def test_steps_that_depend_on_more_than_their_cells_run_one_step_per_exchange(step, reason):
    k = lk.megakernel(step, swap=[("u", "v")])
    st = find_stencil(k.spec)
    assert isinstance(st, Stencil), st
    got = fused_steps_refusal(k.spec, st)
    assert isinstance(got, NotStencil) and reason in got.reason
    assert not k.dispatcher.fused_steps
    with pytest.raises(ValueError, match="cannot run 4 steps per halo exchange: .*" + reason.split("'")[0]):
        codegen.render_kernel(k.spec, "cuda", "grid", tile=st, depth=4)
    # one step per exchange still renders
    assert "steps per halo exchange" not in codegen.render_kernel(k.spec, "cuda", "grid", tile=st).text


def test_a_reduction_keeps_one_step_per_exchange():
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    got = fused_steps_refusal(k.spec, find_stencil(k.spec))
    assert isinstance(got, NotStencil)


def test_depth_is_checked():
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    st = find_stencil(k.spec)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="depth must be"):
            codegen.render_kernel(k.spec, "cuda", "grid", tile=st, depth=bad)
    with pytest.raises(ValueError, match="depth must be"):
        codegen.render_kernel(k.spec, "cuda", "grid", depth=2)            # not tile mode
    with pytest.raises(ValueError, match="depth must be"):
        codegen.render_kernel(k.spec, "cuda", "grid", tile=st, cluster=True, depth=2)


def test_the_depth_rule():
    assert config.tile_depth(4096, (1, 1), 16) == min(config.TILE_DEPTH_MAX, 256 // (config.TILE_DEPTH_SPAN * 2))
    assert config.tile_depth(100, (1, 1), 132) == 1                 # tiles of one cell
    assert config.tile_depth(10 ** 6, (0, 0), 132) == config.TILE_DEPTH_MAX   # no halo: nothing to recompute
    assert config.tile_depth(10 ** 6, (3, 2), 132) == config.TILE_DEPTH_MAX


def test_rows_of_a_2d_field_take_their_own_span(monkeypatch):
    # an H100's chip: 132 tiles of 8 rows of a 1024^2 float32 pair; the rows' span
    # (TILE_DEPTH_SPAN_ROWS) decides their steps per exchange, the cells' one a 1-D field's
    chip = config.Chip(132, 227 * 1024, 228 * 1024)
    monkeypatch.setattr(config, "TILE_DEPTH_SPAN_ROWS", 2)
    monkeypatch.setattr(config, "TILE_DEPTH_SPAN", 4)
    assert config.tile_layout(1024, (1, 1), 1024 * 8, None, False, True, chip, rows=True) == (2, 0)
    assert config.tile_layout(1024, (1, 1), 1024 * 8, None, False, True, chip) == (1, 0)
    assert config.tile_layout(512, (1, 1), 512 * 8, None, False, True, chip, rows=True) == (1, 0)


# -- the rounds kernel, launched by hand (one block) ------------------------------------------
def run_rounds(fn, swap, arrays, scalars, steps, depth, threads=32):
    from numba import cuda
    k = lk.megakernel(fn, swap=swap)
    st = find_stencil(k.spec)
    src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=st, depth=depth)
    kern = compile_kernel(src).dispatcher
    resident = sorted(i for pair in k.spec.swap for i in pair)
    first = arrays[resident[0]]
    n, row = first.shape[0], int(np.prod(first.shape[1:]))
    (hl, hr) = st.halo[0]
    shared = len(resident) * (n + depth * (hl + hr)) * row * first.dtype.itemsize
    halo = cuda.to_device(np.full(2 * len(resident) * depth * (hl + hr) * row, np.nan, first.dtype))
    dev = [cuda.to_device(a) for a in arrays]
    host = np.zeros(HOST_SIZE, np.int64)
    args = [np.int64(steps), np.int64(0), *dev, *scalars, cuda.to_device(np.zeros((2, 1))),
            cuda.to_device(np.zeros((2, 1), np.int64)), cuda.to_device(np.zeros(2, np.uint32)), np.uint64(0),
            cuda.to_device(np.zeros(2, np.int64)), host, halo]
    kern[1, threads, 0, shared](*args)
    assert host[DONE] == 1 and host[STEPS] == steps
    return [d.copy_to_host() for d in dev]


@pytest.mark.parametrize("depth", [2, 3, 8])
@pytest.mark.parametrize("steps", [0, 1, 2, 7, 16])
def test_heat_in_rounds_matches_the_exact_solution(depth, steps, rng):
    u0 = rng.random(70)
    u, v = run_rounds(W.heat_step, [("u", "v")], [u0, u0.copy()], (0.3,), steps, depth)
    check_heat_pair(u, v, u0, steps, 0.3)


@pytest.mark.parametrize("depth", [2, 5])
@pytest.mark.parametrize("steps", [5, 6])
def test_unwritten_cells_keep_the_other_buffers_value_in_rounds(depth, steps, rng):
    u0, v0, w = rng.random(61), rng.random(61), rng.random(61)
    u, v, _ = run_rounds(uneven_step, [("u", "v")], [u0, v0, w], (0.2,), steps, depth)
    ru, rv = uneven_ref(u0, v0, w, 0.2, steps)
    np.testing.assert_allclose(u, ru, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(v, rv, rtol=1e-12, atol=1e-14)


def test_two_swap_pairs_in_rounds(rng):
    a0, b0 = rng.random(50), rng.random(50)
    got = run_rounds(two_pairs_step, [("a", "a2"), ("b", "b2")], [a0, a0.copy(), b0, b0.copy()], (0.1,), 11, 4)
    for g, r in zip(got, two_pairs_ref(a0, b0, 0.1, 11)):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("depth", [2, 4])
def test_two_dimensional_stencils_in_rounds(depth, rng):
    from test_tile import heat2d_ref, heat2d_step, ring_ref, ring_step
    u0 = rng.random((13, 11))
    u, v = run_rounds(heat2d_step, [("u", "v")], [u0, u0.copy()], (0.2,), 7, depth)
    np.testing.assert_allclose(u, heat2d_ref(u0, 7, 0.2), rtol=1e-12)
    np.testing.assert_allclose(v, heat2d_ref(u0, 6, 0.2), rtol=1e-12)
    u, v = run_rounds(ring_step, [("u", "v")], [u0, u0.copy()], (), 5, depth)
    np.testing.assert_allclose(u, ring_ref(u0, 5), rtol=1e-12)


# -- through a call ----------------------------------------------------------------------------
def test_a_call_in_tile_mode_runs_rounds_and_continues_exactly(rng):
    from numba import cuda
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(200)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    t = 0
    for steps in (13, 1, 30):
        run = k(u, v, 0.25, steps=steps, start=t, backend="cuda", scope="tile")
        assert run.scope == "tile" and run.steps == steps
        assert run.steps_per_exchange == config.tile_depth(200, (1, 1), 1) > 1
        t = run.next_start
    check_heat_pair(u.copy_to_host(), v.copy_to_host(), u0, 44, 0.25)
    # a step that writes another array keeps one step per exchange, and says so
    p = lk.megakernel(probe_step, swap=[("u", "v")])
    hist = cuda.to_device(np.zeros(8))
    run = p(u, v, hist, steps=8, backend="cuda", scope="tile")
    assert run.steps_per_exchange == 1


def test_unwritten_cells_through_a_call(rng):
    from numba import cuda
    k = lk.megakernel(uneven_step, swap=[("u", "v")])
    u0, v0, w = rng.random(300), rng.random(300), rng.random(300)
    u, v = cuda.to_device(u0), cuda.to_device(v0)
    run = k(u, v, w, 0.2, steps=37, backend="cuda", scope="tile")
    assert run.steps_per_exchange > 1
    ru, rv = uneven_ref(u0, v0, w, 0.2, 37)
    np.testing.assert_allclose(u.copy_to_host(), ru, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(v.copy_to_host(), rv, rtol=1e-12, atol=1e-14)


# -- fields too large to stay on chip: tiles streamed through shared memory ----------------------
@pytest.fixture
def small_chip(monkeypatch):
    """A simulated chip whose shared memory holds 1 KiB per block and whose streamed tiles
    get 800: fields of a hundred-odd float64 cells stream through several tiles, so the one
    block the simulator runs exchanges halos between its own tiles through the scratch array."""
    monkeypatch.setattr(config, "SIMULATOR_SHARED_BYTES", 1024)
    monkeypatch.setattr(config, "STREAM_TILE_BYTES", 800)
    monkeypatch.setattr(config, "TILE_DEPTH_SPAN", 1)      # short tiles, several steps per round
    monkeypatch.setattr(config, "TILE_DEPTH_SPAN_ROWS", 1)


def _streamed(k):
    cfg = list(k.dispatcher.plans.values())[-1].config
    assert cfg.tiles > 1, cfg
    return cfg


@pytest.mark.parametrize("n,steps", [(100, 21), (101, 8), (90, 1), (70, 0)])
def test_a_streamed_field_matches_the_exact_solution(n, steps, rng, small_chip):
    from numba import cuda
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(n)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, 0.3, steps=steps, backend="cuda", scope="tile", threads=32)
    cfg = _streamed(k)
    assert run.steps == steps and run.steps_per_exchange == cfg.depth > 1
    check_heat_pair(u.copy_to_host(), v.copy_to_host(), u0, steps, 0.3)


def test_streamed_unwritten_cells_two_pairs_and_two_dimensions(rng, small_chip):
    from numba import cuda
    from test_tile import heat2d_ref, heat2d_step
    k = lk.megakernel(uneven_step, swap=[("u", "v")])
    u0, v0, w = rng.random(111), rng.random(111), rng.random(111)
    u, v = cuda.to_device(u0), cuda.to_device(v0)
    k(u, v, cuda.to_device(w), 0.2, steps=13, backend="cuda", scope="tile", threads=32)
    _streamed(k)
    ru, rv = uneven_ref(u0, v0, w, 0.2, 13)
    np.testing.assert_allclose(u.copy_to_host(), ru, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(v.copy_to_host(), rv, rtol=1e-12, atol=1e-14)

    k = lk.megakernel(two_pairs_step, swap=[("a", "a2"), ("b", "b2")])
    a0, b0 = rng.random(60), rng.random(60)
    arrs = [cuda.to_device(x) for x in (a0, a0, b0, b0)]
    k(*arrs, 0.1, steps=9, backend="cuda", scope="tile", threads=32)
    _streamed(k)
    for got, ref in zip(arrs, two_pairs_ref(a0, b0, 0.1, 9)):
        np.testing.assert_allclose(got.copy_to_host(), ref, rtol=1e-12, atol=1e-14)

    k = lk.megakernel(heat2d_step, swap=[("u", "v")])
    g0 = rng.random((30, 3))
    u, v = cuda.to_device(g0), cuda.to_device(g0)
    k(u, v, 0.2, steps=7, backend="cuda", scope="tile", threads=32)
    _streamed(k)
    np.testing.assert_allclose(u.copy_to_host(), heat2d_ref(g0, 7, 0.2), rtol=1e-12)
    np.testing.assert_allclose(v.copy_to_host(), heat2d_ref(g0, 6, 0.2), rtol=1e-12)


def test_a_step_that_cannot_stream_is_refused_when_its_field_does_not_fit(rng, small_chip):
    from numba import cuda
    from loopkern.errors import LaunchError
    k = lk.megakernel(probe_step, swap=[("u", "v")])
    u0 = rng.random(100)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    with pytest.raises(LaunchError, match="cannot keep this field on chip"):
        k(u, v, cuda.to_device(np.zeros(4)), steps=3, backend="cuda", scope="tile")
    np.testing.assert_array_equal(u.copy_to_host(), u0)


def test_the_stream_layout_rule(monkeypatch):
    monkeypatch.setattr(config, "SIMULATOR_SHARED_BYTES", 1024)
    monkeypatch.setattr(config, "STREAM_TILE_BYTES", 800)
    assert config.tile_layout(30, (1, 1), 8, None, True, True) == (config.tile_depth(30, (1, 1), 1), 0)
    depth, tiles = config.tile_layout(100, (1, 1), 16, None, True, True)
    assert tiles > 1 and depth >= config.STREAM_MIN_DEPTH and 16 * (-(-100 // tiles) + depth * 2) <= 800
    assert config.tile_layout(100, (1, 1), 16, None, True, False) == (1, 0)      # cannot stream
    # rows so wide that a streamed tile holds too few steps per round: not streamed
    assert config.tile_layout(100, (1, 1), 160, None, True, True) == (1, 0)


def test_the_source_of_each_tile_kernel():
    from loopkern.errors import ArgumentError
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    assert "steps per halo exchange" not in k.source(scope="tile")
    assert "8 steps per halo exchange" in k.source(scope="tile", steps_per_exchange=8)
    assert "streamed: 3 tiles per block" in k.source(scope="tile", steps_per_exchange=4, tiles_per_block=3)
    with pytest.raises(ArgumentError, match="steps_per_exchange must be an integer of at least 1"):
        k.source(scope="tile", steps_per_exchange=0)
    with pytest.raises(ArgumentError, match="are for scope='tile'"):
        k.source(scope="grid", steps_per_exchange=4)
    p = lk.megakernel(probe_step, swap=[("u", "v")])
    with pytest.raises(ArgumentError, match="writes 'hist', which is not in a swap pair"):
        p.source(scope="tile", steps_per_exchange=4)
