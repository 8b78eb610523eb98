"""lk.atomic.add/max/min: updates that several iterations make to one element, on the CPU backend
and the CUDA path under Numba's simulator, each checked against an independent NumPy computation
on random inputs."""

import numpy as np
import pytest

import loopkern as lk
import workloads as W

BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="sim", marks=pytest.mark.sim)]


def size(backend, n):
    return n if backend == "cpu" else min(n, 300)     # the simulator runs Python: keep it small


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64, np.float32, np.float64])
def test_histogram_matches_bincount(rng, backend, dtype):
    n, nbins, steps = size(backend, 5000), 17, 3
    data = rng.normal(0.5, 0.3, n).astype(np.float32)          # some fall outside: the edge bins
    hist = np.zeros(nbins, dtype)
    run = lk.megakernel(W.histogram_step)(data, hist, np.float32(0.0), np.float32(1.0 / nbins), steps=steps,
                                          backend=backend)
    assert run.steps == steps
    ref = W.histogram_ref(data, nbins, 0.0, np.float32(1.0 / nbins), steps)
    assert hist.sum() == steps * n
    np.testing.assert_array_equal(hist, ref.astype(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_add_max_min_match_numpy(rng, backend):
    n, m = size(backend, 4000), 8
    idx = rng.integers(0, m, n).astype(np.int64)
    vals = rng.standard_normal(n).astype(np.float32)
    acc0, hi0, lo0 = rng.standard_normal(m), rng.standard_normal((2, m // 2)).astype(np.float32), \
        rng.integers(-5, 5, m).astype(np.int32)
    acc, hi, lo = acc0.copy(), hi0.copy(), lo0.copy()
    count, order = np.zeros(1, np.uint32), np.full(n, -1, np.int64)
    lk.megakernel(W.scatter_step)(idx, vals, acc, hi, lo, count, order, steps=1, backend=backend)
    ref_acc, ref_hi, ref_lo = W.scatter_ref(idx, vals, acc0, hi0, lo0)
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-12, atol=1e-12)     # float64 sums, any order
    np.testing.assert_array_equal(hi, ref_hi.astype(np.float32))
    # lo is int32: each value is cast (truncated toward zero) before the minimum, as NumPy casts
    ref_lo = lo0.copy()
    np.minimum.at(ref_lo, -1 - idx, vals.astype(np.int32))
    np.testing.assert_array_equal(lo, ref_lo)
    assert count[0] == n
    np.testing.assert_array_equal(np.sort(order), np.arange(n))          # every iteration its own slot


def hand_out_slots(t, out, count, taken):
    # each iteration takes the next free slot: the old value of the counter
    for i in lk.range(out.shape[0]):
        slot = lk.atomic.add(count, 0, 1)
        out[slot - t * out.shape[0]] = i
        taken[slot] = t


@pytest.mark.parametrize("backend", BACKENDS)
def test_returned_old_value_hands_out_unique_slots(rng, backend):
    n, steps = size(backend, int(rng.integers(500, 1000))), 3
    out, count, taken = np.full(n, -1, np.int64), np.zeros(1, np.int64), np.full(n * steps, -1, np.int64)
    lk.megakernel(hand_out_slots)(out, count, taken, steps=steps, backend=backend)
    assert count[0] == n * steps
    np.testing.assert_array_equal(np.sort(out), np.arange(n))            # a permutation (of the last step)
    np.testing.assert_array_equal(taken, np.repeat(np.arange(steps), n))  # slots in step order


def bounded(t, x, hi, lo, best):
    # running max/min per key, and the old values: the largest old max seen is below the new max
    for i in lk.range(x.shape[0]):
        k = i % hi.shape[0]
        old = lk.atomic.max(hi, k, x[i])
        lk.atomic.min(lo, k, x[i])
        lk.atomic.max(best, 0, old)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_max_min_per_key_match_numpy(rng, backend, dtype):
    n, keys = size(backend, 3000), 5
    x = (rng.standard_normal(n) * 1000).astype(dtype)
    info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else np.iinfo(dtype)
    hi, lo, best = np.full(keys, info.min, dtype), np.full(keys, info.max, dtype), np.full(1, info.min, dtype)
    lk.megakernel(bounded)(x, hi, lo, best, steps=1, backend=backend)
    k = np.arange(n) % keys
    np.testing.assert_array_equal(hi, [x[k == j].max() for j in range(keys)])
    np.testing.assert_array_equal(lo, [x[k == j].min() for j in range(keys)])
    assert info.min <= best[0] <= hi.max()


def negative_and_2d(t, idx, w, grid, tail):
    for i in lk.range(idx.shape[0]):
        k = idx[i]
        lk.atomic.add(grid, (k // 4 - 2, -1 - k % 4), w[i])     # negative indices in both dimensions
        lk.atomic.add(tail, -k - 1, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_and_2d_indices(rng, backend):
    n = size(backend, 2000)
    idx = rng.integers(0, 8, n).astype(np.int32)
    w = rng.random(n)
    grid, tail = np.zeros((3, 4)), np.zeros(8, np.uint64)
    lk.megakernel(negative_and_2d)(idx, w, grid, tail, steps=2, backend=backend)
    ref = np.zeros((3, 4))
    np.add.at(ref, (idx // 4 - 2, -1 - idx % 4), 2 * w)
    np.testing.assert_allclose(grid, ref, rtol=1e-12)
    np.testing.assert_array_equal(tail, 2 * np.bincount(idx, minlength=8)[::-1])


def add_to(h, k, x):
    return lk.atomic.add(h, k, x)


def helper_histogram(t, data, hist):
    for i in lk.range(data.shape[0]):
        add_to(hist, int(data[i] * hist.shape[0]), 1.5)      # the value is cast: 1 in an int array


@pytest.mark.parametrize("backend", BACKENDS)
def test_atomic_in_a_helper_casts_the_value(rng, backend):
    data = rng.random(size(backend, 1000))
    hist = np.zeros(6, np.int32)
    k = lk.megakernel(helper_histogram)
    assert k.spec.params[1].atomic
    k(data, hist, steps=1, backend=backend)
    np.testing.assert_array_equal(hist, np.bincount((data * 6).astype(int), minlength=6))


def wraps(t, c):
    lk.atomic.add(c, 0, -1)         # a sequential step: one thread; -1 wraps in an unsigned array


@pytest.mark.filterwarnings("ignore:overflow encountered")     # the simulator adds NumPy scalars
@pytest.mark.parametrize("backend", BACKENDS)
def test_sequential_step_and_unsigned_wraparound(backend):
    k = lk.megakernel(wraps)
    assert not k.spec.parallel
    c = np.zeros(1, np.uint32)
    run = k(c, steps=3, backend=backend)
    assert c[0] == np.uint32(2 ** 32 - 3)
    assert backend == "cpu" or run.scope == "thread"


def spill(t, data, hist, shift):
    for i in lk.range(data.shape[0]):
        lk.atomic.add(hist, int(data[i]) + shift, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_skips_an_out_of_bounds_atomic(rng, backend):
    data = rng.integers(0, 8, size(backend, 200)).astype(np.float64)
    memory = np.zeros(16, np.int64)
    hist = memory[:8]                   # what lies behind it must stay untouched
    with pytest.raises(lk.BoundsError) as info:
        lk.megakernel(spill)(data, hist, 1, steps=3, backend=backend, debug=True)
    msg = str(info.value)
    assert "out-of-bounds store to 'hist'" in msg and "outside shape (8,)" in msg
    assert "lk.atomic.add(hist, int(data[i]) + shift, 1)" in msg
    assert not memory[8:].any()
    ran = int(msg.split("this call ran ")[1].split(" step")[0]) if "this call ran " in msg else None
    in_bounds = np.bincount(data.astype(int) + 1, minlength=9)[:8]
    if ran is not None:
        np.testing.assert_array_equal(hist, ran * in_bounds)
    # in bounds, debug=True gives the same result as without
    h1, h2 = np.zeros(9, np.int64), np.zeros(9, np.int64)
    lk.megakernel(spill)(data, h1, 1, steps=2, backend=backend, debug=True)
    lk.megakernel(spill)(data, h2, 1, steps=2, backend=backend)
    np.testing.assert_array_equal(h1, h2)
    np.testing.assert_array_equal(h1, 2 * np.bincount(data.astype(int) + 1, minlength=9))


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_generated_source_calls_the_runtime(backend):
    src = lk.megakernel(W.histogram_step).source(backend)
    assert "_lk_rt.atomic_add(hist, " in src


def top_level_counts(t, x, total, count, slots):
    # every thread runs the top level: each adds once per step (constant indices: the CUDA
    # backend sums a block's values first), then once at an index that depends on t
    for i in lk.range(x.shape[0]):
        x[i] = x[i] + 1.0
    lk.atomic.add(total, 0, 0.5 * t + 0.25)
    lk.atomic.add(count, (1, 0), 1)
    lk.atomic.add(slots, t % 3, 1)


def _top_level_expected(steps, threads):
    total = threads * sum(0.5 * t + 0.25 for t in range(steps))
    slots = np.bincount(np.arange(steps) % 3, minlength=3) * threads
    return total, steps * threads, slots


def test_top_level_atomics_of_a_constant_index_are_summed_per_block_first():
    src = lk.megakernel(top_level_counts).source("cuda")
    assert "_lk_rt.atomic_add_block(total, 0, " in src
    assert "_lk_rt.atomic_add_block(count, (1, 0), " in src
    assert "_lk_rt.atomic_add(slots, " in src          # an index that is not a constant: per thread
    assert "atomic_add_block" not in lk.megakernel(W.histogram_step).source("cuda")
    assert "atomic_add_block" not in lk.megakernel(top_level_counts).source("cpu")
    from loopkern import codegen
    debug = codegen.render_kernel(lk.megakernel(top_level_counts).spec, "cuda", "grid", fingerprint="", debug=True)
    assert "atomic_add_block" not in debug.text and "_lk_rt.atomic_add_checked(total, " in debug.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_level_atomics_add_once_per_thread(backend):
    # the CPU backend runs the step on one thread; CUDA on every thread of the grid
    k = lk.megakernel(top_level_counts)
    x, total, count, slots = np.zeros(100), np.zeros(1), np.zeros((2, 2), np.int32), np.zeros(3, np.int64)
    steps = 7
    kw = dict(scope="grid", blocks=1, threads=64) if backend == "cuda" else {}
    run = k(x, total, count, slots, steps=steps, backend=backend, **kw)
    threads = 1 if backend == "cpu" else run.blocks * run.threads
    want_total, want_count, want_slots = _top_level_expected(steps, threads)
    assert total[0] == pytest.approx(want_total, rel=1e-12)
    assert count[1, 0] == want_count and count.sum() == want_count
    np.testing.assert_array_equal(slots, want_slots)
    np.testing.assert_array_equal(x, np.full(100, float(steps)))
