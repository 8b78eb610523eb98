"""Tile mode with the exchange's grid barrier split in two (``dispatch.kernels.SPLIT_EXCHANGE``,
an experiment off by default; ``codegen.render_kernel(split=True)``): after each step a block
publishes its edge rows and arrives at the barrier, computes the next step's rows that read no
halo row, then waits, gathers its halo and computes its remaining rows.

Under Numba's simulator (one block, whose tile is the whole array) these check that the three
windows of each step cover every row once, that the gather after the swap fills the halo of
the buffer that holds the newest state (a wrapping stencil's halo is the array's far end, read
back through the exchange), the end-of-run rename, and which steps may split. Several blocks
need a GPU: tests/gpu/test_tile_split_gpu.py."""

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern import codegen
from loopkern.dispatch import kernels
from loopkern.stencil import find_stencil, split_exchange_refusal
from test_tile import check_heat_pair, heat2d_ref, heat2d_step

pytestmark = pytest.mark.sim


@pytest.fixture
def split(monkeypatch):
    from loopkern.dispatch import config
    monkeypatch.setattr(kernels, "SPLIT_EXCHANGE", True)
    # one step per exchange, which the split needs (1-D stencils otherwise run several)
    monkeypatch.setattr(config, "TILE_DEPTH_MAX", 1)


def _split_sources(k) -> list:
    return [s for s in k.dispatcher.kernels.sources.values() if "barrier split in two" in s.text]


def t_heat_step(t, u, v, a):
    # a step that depends on its index: each window must be given the step's own t
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + a * (u[i - 1] - 2.0 * u[i] + u[i + 1]) + 1e-3 * (t % 5)
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]


def t_heat_ref(u0, t0, steps, a):
    u = u0.astype(np.float64)
    for t in range(t0, t0 + steps):
        v = u.copy()
        v[1:-1] = u[1:-1] + a * (u[:-2] - 2.0 * u[1:-1] + u[2:]) + 1e-3 * (t % 5)
        u = v
    return u


@pytest.mark.parametrize("steps", [0, 1, 2, 7])
def test_one_dimensional_heat_with_a_split_exchange(split, steps, rng):
    from numba import cuda
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(150)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, 0.3, steps=steps, backend="cuda", scope="tile", threads=32)
    assert run.scope == "tile" and run.steps == steps and len(_split_sources(k)) == 1
    check_heat_pair(u.copy_to_host(), v.copy_to_host(), u0, steps, 0.3)


@pytest.mark.parametrize("steps,threads,shape", [(1, None, (13, 11)), (6, 32, (13, 11)), (5, 64, (9, 24)),
                                                 (4, 32, (3, 40)), (3, 32, (2, 7))])
def test_two_dimensional_heat_with_a_split_exchange(split, steps, threads, shape, rng):
    from numba import cuda
    k = lk.megakernel(heat2d_step, swap=[("u", "v")])
    u0 = rng.random(shape)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, 0.2, steps=steps, backend="cuda", scope="tile", threads=threads)
    assert run.scope == "tile" and len(_split_sources(k)) == 1
    np.testing.assert_allclose(u.copy_to_host(), heat2d_ref(u0, steps, 0.2), rtol=1e-12)
    np.testing.assert_allclose(v.copy_to_host(), heat2d_ref(u0, steps - 1, 0.2), rtol=1e-12)


@pytest.mark.parametrize("shape,steps", [((8, 8), 9), ((11, 7), 6), ((3, 3), 5), ((1, 6), 4)])
def test_wrapping_stencils_read_their_far_end_through_a_split_exchange(split, shape, steps, rng):
    # one block: the halo rows are the array's own far rows, which the gather must take from
    # the buffer the last step wrote (the other holds the state a step older)
    from numba import cuda

    from bench.life import life_kernel
    a0 = (rng.random(shape) < 0.4).astype(np.int32)
    life = life_kernel()
    a, b = cuda.to_device(a0), cuda.to_device(a0)
    life(a, b, steps=steps, backend="cuda", scope="tile", threads=32)
    assert len(_split_sources(life)) == 1
    np.testing.assert_array_equal(a.copy_to_host(), W.life_ref(a0, steps)[0])
    np.testing.assert_array_equal(b.copy_to_host(), W.life_ref(a0, steps - 1)[0])
    drift = lk.megakernel(W.drift_step, swap=[("u", "v")])
    u0 = rng.random(shape)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    drift(u, v, steps=steps, backend="cuda", scope="tile", threads=32)
    assert len(_split_sources(drift)) == 1
    np.testing.assert_allclose(u.copy_to_host(), W.drift_ref(u0, steps), rtol=1e-12)
    ring = lk.megakernel(W.ring_rows_step, swap=[("u", "v")])
    u0 = rng.random(40)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    ring(u, v, steps=steps, backend="cuda", scope="tile", threads=32)
    assert len(_split_sources(ring)) == 1
    np.testing.assert_allclose(u.copy_to_host(), W.ring_rows_ref(u0, steps), rtol=1e-12)


def test_a_split_run_continues_exactly_across_calls(split, rng):
    from numba import cuda
    k = lk.megakernel(t_heat_step, swap=[("u", "v")])
    u0 = rng.random(61)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    t = 0
    for steps in (3, 4, 1, 6):
        run = k(u, v, 0.25, steps=steps, start=t, backend="cuda", scope="tile", threads=32)
        assert run.steps == steps
        t = run.next_start
    assert len(_split_sources(k)) == 1
    np.testing.assert_allclose(u.copy_to_host(), t_heat_ref(u0, 0, 14, 0.25), rtol=1e-12)
    np.testing.assert_allclose(v.copy_to_host(), t_heat_ref(u0, 0, 13, 0.25), rtol=1e-12)


def test_which_steps_split_their_exchange(split, rng):
    from numba import cuda
    # a reduction, a condition, a write outside the swap pair: each needs every block at the
    # barrier or makes what a block writes visible to others before it; they keep the whole
    # barrier, and the knob leaves their kernels as they were
    for fn, swap, why in ((W.jacobi_step, [("u", "v")], "returns a condition"),
                          (W.life_step, [("a", "b")], "writes 'pop'")):
        k = lk.megakernel(fn, swap=swap)
        refusal = split_exchange_refusal(k.spec, find_stencil(k.spec))
        assert refusal is not None and why in refusal.reason
        with pytest.raises(ValueError, match="cannot split its exchange"):
            codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=find_stencil(k.spec), split=True)
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = rng.random((9, 10))
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    run = k(u, v, 1e-3, max_steps=40, backend="cuda", scope="tile")
    assert run.scope == "tile" and not _split_sources(k)
    ref = u0.copy()
    for _ in range(run.steps):
        new = ref.copy()
        new[1:-1, 1:-1] = 0.25 * (ref[:-2, 1:-1] + ref[2:, 1:-1] + ref[1:-1, :-2] + ref[1:-1, 2:])
        ref = new
    np.testing.assert_allclose(u.copy_to_host(), ref, rtol=1e-12)
    # several steps per exchange, a cluster: no split
    heat = lk.megakernel(W.heat_step, swap=[("u", "v")])
    st = find_stencil(heat.spec)
    for kw in ({"depth": 4}, {"cluster": True}):
        with pytest.raises(ValueError, match="one step per halo exchange"):
            codegen.render_kernel(heat.spec, "cuda", "grid", cache=False, tile=st, split=True, **kw)
    with pytest.raises(ValueError, match="split is for tile mode"):
        codegen.render_kernel(heat.spec, "cuda", "grid", cache=False, split=True)
    with pytest.raises(ValueError, match="with run control"):
        codegen.render_kernel(heat.spec, "cuda", "grid", cache=False, tile=st, split=True, control=False)


def test_the_split_kernel_waits_before_writing_its_tiles_back():
    # the last barrier's wait comes before the copy-back: a block that wrote its tiles back
    # while a neighbour still gathered from the same buffer would hand it the wrong state
    k = lk.megakernel(heat2d_step, swap=[("u", "v")])
    text = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=find_stencil(k.spec), split=True).text
    body = text[text.index("def _lk_kernel"):]
    waits = [i for i, ln in enumerate(body.splitlines()) if "grid_wait" in ln]
    copy = next(i for i, ln in enumerate(body.splitlines()) if "_lk_rt.store(_lk_a0" in ln)
    assert len(waits) == 2 and waits[-1] < copy
    assert body.count("grid_arrive") == 1 and "grid_sync" not in body
