"""lk.atomic on a real GPU: many blocks updating the same elements at once.

Run on a machine with a CUDA GPU: ``python -m pytest -m gpu``. Skipped elsewhere.
"""

import numpy as np
import pytest

import loopkern as lk
import workloads as W

pytestmark = pytest.mark.gpu

N = 100_000


@pytest.mark.parametrize("scope,blocks", [("grid", 1), ("grid", 7), ("grid", 64), ("grid", None), ("block", None)])
@pytest.mark.parametrize("dtype", [np.int32, np.uint64])
def test_histogram_exact_on_many_blocks(rng, scope, blocks, dtype):
    # 100,000 items into 37 bins: thousands of threads hit each bin in every step; any lost update
    # shows up as a count below np.bincount's
    nbins, steps = 37, 5
    data = rng.normal(0.5, 0.25, N).astype(np.float32)
    hist = np.zeros(nbins, dtype)
    width = np.float32(1.0 / nbins)
    run = lk.megakernel(W.histogram_step)(data, hist, np.float32(0.0), width, steps=steps, backend="cuda",
                                          scope=scope, blocks=blocks)
    assert run.backend == "cuda" and run.steps == steps
    if blocks is not None:
        assert run.blocks == blocks
    np.testing.assert_array_equal(hist, W.histogram_ref(data, nbins, 0.0, width, steps).astype(dtype))


@pytest.mark.parametrize("blocks", [2, 33, None])
def test_scatter_and_unique_slots_on_many_blocks(rng, blocks):
    m = 64
    idx = rng.integers(0, m, N).astype(np.int64)
    vals = rng.standard_normal(N).astype(np.float32)
    acc0, hi0, lo0 = np.zeros(m), np.full((2, m // 2), -np.inf, np.float32), np.full(m, 10 ** 6, np.int32)
    acc, hi, lo = acc0.copy(), hi0.copy(), lo0.copy()
    count, order = np.zeros(1, np.uint32), np.full(N, -1, np.int64)
    run = lk.megakernel(W.scatter_step)(idx, vals, acc, hi, lo, count, order, steps=1, backend="cuda",
                                        scope="grid", blocks=blocks)
    assert blocks is None or run.blocks == blocks
    ref_acc, ref_hi, _ = W.scatter_ref(idx, vals, acc0, hi0, lo0)
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-9, atol=1e-9)      # float64 sums in any order
    np.testing.assert_array_equal(hi, ref_hi.astype(np.float32))
    ref_lo = lo0.copy()
    np.minimum.at(ref_lo, -1 - idx, vals.astype(np.int32))
    np.testing.assert_array_equal(lo, ref_lo)
    assert count[0] == N
    np.testing.assert_array_equal(np.sort(order), np.arange(N))           # every iteration its own slot


def test_debug_atomic_out_of_bounds_on_gpu(rng):
    def spill(t, data, hist, shift):
        for i in lk.range(data.shape[0]):
            lk.atomic.add(hist, int(data[i]) + shift, 1)
    data = rng.integers(0, 8, N).astype(np.float64)
    from numba import cuda
    memory = cuda.to_device(np.zeros(16, np.int64))
    hist = memory[:8]
    with pytest.raises(lk.BoundsError, match="out-of-bounds store to 'hist'"):
        lk.megakernel(spill)(data, hist, 1, steps=3, backend="cuda", debug=True)
    assert not memory.copy_to_host()[8:].any()                            # nothing written past the end


@pytest.mark.parametrize("scope,blocks,threads", [("grid", 1, 32), ("grid", 7, 96), ("grid", None, None),
                                                  ("block", None, 1024)])
def test_top_level_atomics_summed_per_block_on_the_gpu(scope, blocks, threads):
    # every thread of the grid adds at the top level; those of a constant index are summed per
    # block first (runtime atomic_add_block): the totals must still count every thread
    import test_atomic as TA
    k = lk.megakernel(TA.top_level_counts)
    x, total, count, slots = np.zeros(10_000), np.zeros(1), np.zeros((2, 2), np.int32), np.zeros(3, np.int64)
    steps = 11
    run = k(x, total, count, slots, steps=steps, backend="cuda", scope=scope, blocks=blocks, threads=threads)
    want_total, want_count, want_slots = TA._top_level_expected(steps, run.blocks * run.threads)
    assert total[0] == pytest.approx(want_total, rel=1e-12)
    assert count[1, 0] == want_count and count.sum() == want_count
    np.testing.assert_array_equal(slots, want_slots)
    np.testing.assert_array_equal(x, np.full(10_000, float(steps)))


@pytest.mark.parametrize("scope,blocks,threads", [("grid", 7, 128), ("grid", 64, 256), ("grid", None, None),
                                                  ("block", None, 1024), ("tile", None, None)])
def test_an_atomic_update_after_the_last_reduction_lands_before_the_next_step(scope, blocks, threads):
    """W.reduce_then_count: every thread adds 1 to a counter after the step's lk.max, and one
    thread records the counter at the start of the next step. Without the barrier between steps
    (before cf93aec the reduction's barrier was taken for the step's last one) the record runs
    ahead of updates still in flight from other blocks."""
    k = lk.megakernel(W.reduce_then_count, swap=[("u", "v")])
    steps = 3000
    u0 = np.linspace(0.0, 1.0, 5000) ** 2
    u, v, cnt, seen = u0.copy(), u0.copy(), np.zeros(1, np.int64), np.zeros(steps, np.int64)
    run = k(u, v, cnt, seen, max_steps=steps, backend="cuda", scope=scope, blocks=blocks, threads=threads)
    nt = run.blocks * run.threads
    assert run.steps == steps
    np.testing.assert_array_equal(seen, np.arange(steps) * nt)
    assert cnt[0] == steps * nt
