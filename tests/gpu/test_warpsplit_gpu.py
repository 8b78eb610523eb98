"""Warp-split loops (loopkern/warpsplit.py) on the GPU: all-pairs N-body with 1024 bodies in
float32, where the automatic grid gives each body a warp, and with a grid too small for that
(one thread per body), both against float64 NumPy; integer sums exactly."""

import numpy as np
import pytest

import loopkern as lk
import test_warpsplit as WS

pytestmark = pytest.mark.gpu


def _nbody():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.nbody import nbody_kernel, nbody_ref
    return nbody_kernel(), nbody_ref


@pytest.mark.parametrize("blocks,threads", [(None, None), (4, 256)])     # split; one thread per body
def test_nbody_against_float64(blocks, threads, rng):
    k, ref_fn = _nbody()
    n = 1024
    pos = rng.standard_normal((n, 3)).astype(np.float32)
    vel = (0.1 * rng.standard_normal((n, 3))).astype(np.float32)
    acc = np.zeros((n, 3), np.float32)
    dt, eps2 = np.float32(1e-3), np.float32(1e-2)
    ref = ref_fn(pos, vel, 20, float(dt), float(eps2))
    run = k(pos, vel, acc, dt, eps2, steps=20, backend="cuda", blocks=blocks, threads=threads)
    assert run.steps == 20
    if blocks is None:
        assert run.blocks * run.threads >= 32 * n, run      # a warp per body
    np.testing.assert_allclose(pos, ref, rtol=0, atol=2e-5)


def test_integer_sums_on_the_gpu_are_exact(rng):
    k = lk.megakernel(WS.counts)
    a = rng.integers(0, 300, 100003).astype(np.int64)
    out = np.full((300, 2), -1, np.int64)
    run = k(a, out, 3, 7, steps=1, backend="cuda")
    assert run.blocks * run.threads >= 32 * 300, run
    np.testing.assert_array_equal(out, WS.counts_ref(a, 300, 3, 7))


@pytest.mark.parametrize("rows", [3, 100, 5000])      # groups of warps, warps, one thread per row
def test_an_accumulators_first_value_counts_once_on_the_gpu(rows, rng):
    k = lk.megakernel(WS.split_fresh_each_trip)
    a = rng.random(1000)
    out = np.zeros((rows, 2))
    k(a, out, steps=1, backend="cuda")
    np.testing.assert_allclose(out, WS.split_fresh_ref(a, rows), rtol=1e-12)


@pytest.mark.parametrize("fn,ref", [(WS.not_split_carried_previous, lambda a: a[-1]),
                                    (WS.not_split_carried_weight, lambda a: (a * 0.5 ** np.arange(a.size)).sum())])
def test_a_value_carried_between_inner_trips_on_the_gpu(fn, ref, rng):
    a = rng.random(1000)
    out = np.zeros(4)
    lk.megakernel(fn)(a, out, steps=1, backend="cuda")
    np.testing.assert_allclose(out, ref(a), rtol=1e-12)
