"""Tile mode with the exchange's grid barrier split in two (``dispatch.kernels.SPLIT_EXCHANGE``,
an experiment off by default) on the GPU, across blocks: the tile-mode tests of one step per
exchange from test_tile_gpu.py run again with the split (each bit for bit against the grid
scope and against a float64 reference, at several block counts, on odd shapes), and runs
stopped by a timeout or a cancel must hold exactly ``run.steps`` steps."""

import time

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern.dispatch import config, kernels

from .test_tile_gpu import (test_a_one_sided_wrapping_stencil_in_tile_mode,  # noqa: F401
                            test_game_of_life_in_tile_mode_equals_the_grid_scope,
                            test_one_dimensional_wrapping_stencils_in_tile_mode,
                            test_two_dimensional_heat_in_tile_mode_equals_the_grid_scope,
                            test_two_swap_pairs_exchanged_between_two_dimensional_tiles, switch_on)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def split(monkeypatch):
    check = switch_on(monkeypatch, kernels, "SPLIT_EXCHANGE", "barrier split in two")
    yield
    check()


def _cuda():
    from numba import cuda
    return cuda


@pytest.mark.parametrize("shape,blocks", [((2, 64), 2), ((5, 33), 5), ((3, 40), 3), ((64, 64), 60)])
def test_tiles_of_a_row_or_two(shape, blocks, rng):
    # tiles shorter than two halos: no row needs no halo, every row waits for the gather
    from bench.heat2d import heat2d_kernel
    cuda = _cuda()
    k = heat2d_kernel()
    u0 = rng.random(shape).astype(np.float32)
    out = {}
    for scope in ("tile", "grid"):
        u, v = cuda.to_device(u0), cuda.to_device(u0)
        k(u, v, np.float32(0.2), steps=777, backend="cuda", scope=scope, blocks=blocks if scope == "tile" else None)
        out[scope] = (u.copy_to_host(), v.copy_to_host())
    np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
    np.testing.assert_array_equal(out["tile"][1], out["grid"][1])


def test_one_dimensional_heat_at_one_step_per_exchange(monkeypatch, rng):
    monkeypatch.setattr(config, "TILE_DEPTH_MAX", 1)
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(65536 + 7).astype(np.float32)
    for blocks in (7, 132, None):
        out = {}
        for scope in ("tile", "grid"):
            u, v = cuda.to_device(u0), cuda.to_device(u0)
            run = k(u, v, np.float32(0.25), steps=2001, backend="cuda", scope=scope,
                    blocks=blocks if scope == "tile" else None)
            assert run.steps == 2001
            out[scope] = (u.copy_to_host(), v.copy_to_host())
        np.testing.assert_array_equal(out["tile"][0], out["grid"][0])
        np.testing.assert_array_equal(out["tile"][1], out["grid"][1])


@pytest.mark.parametrize("stop", ["timeout", "cancel"])
def test_a_stopped_split_run_leaves_exactly_run_steps_steps(stop, rng):
    from bench.heat2d import heat2d_kernel
    cuda = _cuda()
    k = heat2d_kernel()
    u0 = rng.random((1024, 1000)).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    if stop == "timeout":
        run = k(u, v, np.float32(0.2), steps=10 ** 8, backend="cuda", scope="tile", timeout=0.3)
    else:
        h = k.start(u, v, np.float32(0.2), steps=10 ** 9, backend="cuda", scope="tile")
        time.sleep(0.2)
        h.cancel()
        run = h.wait(timeout=30)
    assert run.stopped == ("timeout" if stop == "timeout" else "cancelled") and 0 < run.steps < 10 ** 8, run
    a, b = cuda.to_device(u0), cuda.to_device(u0)
    k(a, b, np.float32(0.2), steps=run.steps, backend="cuda", scope="grid")
    np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())
    np.testing.assert_array_equal(v.copy_to_host(), b.copy_to_host())
    # the same plan again starts clean and runs all its steps
    again = k(u, v, np.float32(0.2), steps=1001, backend="cuda", scope="tile")
    k(a, b, np.float32(0.2), steps=1001, backend="cuda", scope="grid")
    assert again.steps == 1001 and again.stopped == "steps"
    np.testing.assert_array_equal(u.copy_to_host(), a.copy_to_host())
