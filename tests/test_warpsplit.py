"""Warp-split parallel loops (loopkern/warpsplit.py): which loops qualify, and what the split
form computes under Numba's CUDA simulator (one block; 256 threads and few iterations, so the
split form runs), against float64 NumPy or plain-Python sequential references."""

import math

import numpy as np
import pytest
from numba import cuda

from loopkern.runtime import cuda_rt

import loopkern as lk
from loopkern.warpsplit import find_warp_split, step_has_warp_split
from loopkern.spec import INTRINSIC_PREFIX


def _parallel_loops(k):
    import ast
    return [n for n in ast.walk(ast.Module(body=list(k.spec.step.body), type_ignores=[]))
            if isinstance(n, ast.For) and isinstance(n.iter, ast.Call) and isinstance(n.iter.func, ast.Name)
            and n.iter.func.id == INTRINSIC_PREFIX + "range"]


def forces(t, pos, acc, eps2):
    n = pos.shape[0]
    for i in lk.range(n):
        xi = pos[i, 0]
        yi = pos[i, 1]
        ax = 0.0
        ay = 0.0
        for j in range(n):
            dx = pos[j, 0] - xi
            dy = pos[j, 1] - yi
            r2 = dx * dx + dy * dy + eps2
            inv = 1.0 / (r2 * math.sqrt(r2))
            ax += dx * inv
            ay += dy * inv
        acc[i, 0] += ax               # after the inner loop: lane 0 only (a lane's += would repeat)
        acc[i, 1] += ay


def counts(t, a, out, lo, stride):
    # integer sums (exact), a strided inner range starting at lo, an if and a continue inside
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        big = 0
        hits = 0
        for j in range(lo, n, stride):
            if a[j] == i:
                continue
            if a[j] > i:
                big += a[j] * (i + 1)
            hits += 1
        out[i, 0] = big
        out[i, 1] = hits


def counts_ref(a, out_rows, lo, stride):
    out = np.zeros((out_rows, 2), np.int64)
    for i in range(out_rows):
        for j in range(lo, a.shape[0], stride):
            if a[j] == i:
                continue
            if a[j] > i:
                out[i, 0] += int(a[j]) * (i + 1)
            out[i, 1] += 1
    return out


def backwards(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = np.float32(0.0)
        for j in range(n - 1, -1, -2):
            s += a[j] * np.float32(i + 1)
        out[i] = s


# ------------------------------------------------------------------------------ the shape
def not_split_store_inside(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 0.0
        for j in range(n):
            s += a[j]
            out[i] = s


def not_split_partial_read(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 0.0
        for j in range(n):
            s += a[j] * s
        out[i] = s


def not_split_outer_accumulator(t, a, out):
    n = a.shape[0]
    s = 0.0
    for i in lk.range(out.shape[0]):
        for j in range(n):
            s += a[j]
        out[i] = s


def not_split_lane_value_after(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 0.0
        last = 0.0
        for j in range(n):
            last = a[j]
            s += last
        out[i] = s + last


def not_split_product(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        p = 1.0
        for j in range(n):
            p *= a[j]
        out[i] = p


def not_split_two_loops(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 0.0
        for j in range(n):
            s += a[j]
        for j in range(n):
            s += a[j]
        out[i] = s


def not_split_random(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 0.0
        for j in range(n):
            s += a[j] * lk.random.uniform(i * n + j)
        out[i] = s


def not_split_carried_previous(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 0.0
        prev = 0.0
        for j in range(n):
            s += a[j] - prev          # prev is the last trip's a[j]: a lane runs every 32nd trip
            prev = a[j]
        out[i] = s


def not_split_carried_weight(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 0.0
        w = 1.0
        for j in range(n):
            s += w * a[j]
            w *= 0.5
        out[i] = s


def not_split_carried_under_if(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 0.0
        x = 0.0
        for j in range(n):
            if a[j] > 0.5:
                x = a[j]
            s += x
        out[i] = s


def split_fresh_each_trip(t, a, out):
    n = a.shape[0]
    for i in lk.range(out.shape[0]):
        s = 10.0 + i                  # a first value: counted once, not once per lane
        c = 5
        for j in range(n):
            d = a[j] - a[n - 1 - j]   # assigned before it is read in every trip
            if d > 0.0:
                e = d * d
                s += e
            c += 1
        out[i, 0] = s
        out[i, 1] = c


def split_fresh_ref(a, rows):
    n = a.size
    out = np.zeros((rows, 2))
    for i in range(rows):
        d = a - a[::-1]
        out[i] = 10.0 + i + (d[d > 0] ** 2).sum(), 5 + n
    return out


@pytest.mark.parametrize("fn,accs", [(forces, ("ax", "ay")), (counts, ("big", "hits")), (backwards, ("s",)),
                                     (split_fresh_each_trip, ("s", "c"))])
def test_loops_of_the_warp_split_shape_are_found(fn, accs):
    k = lk.megakernel(fn)
    split = find_warp_split(_parallel_loops(k)[0])
    assert split is not None and split.accumulators == accs
    assert step_has_warp_split(k.spec.step)


@pytest.mark.parametrize("fn", [not_split_store_inside, not_split_partial_read, not_split_outer_accumulator,
                                not_split_lane_value_after, not_split_product, not_split_two_loops,
                                not_split_random, not_split_carried_previous, not_split_carried_weight,
                                not_split_carried_under_if])
def test_loops_that_would_change_meaning_are_not_split(fn):
    k = lk.megakernel(fn)
    assert all(find_warp_split(loop) is None for loop in _parallel_loops(k))
    assert not step_has_warp_split(k.spec.step)
    assert "warp_sum" not in k.source()


def test_the_cuda_source_has_both_forms_and_the_cpu_source_one():
    k = lk.megakernel(forces)
    cuda_src = k.source()
    assert "_lk_rt.warp_sum(ax)" in cuda_src and "* 32 <= _lk_nt" in cuda_src
    assert "warp_sum" not in k.source(backend="cpu")


# ---------------------------------------------------------- what the split form computes


def forces_ref(pos, acc0, eps2, steps):
    p = pos.astype(np.float64)
    d = p[None, :, :] - p[:, None, :]
    r2 = (d ** 2).sum(-1) + eps2
    step_acc = (d / (r2 * np.sqrt(r2))[..., None]).sum(1)
    return acc0 + steps * step_acc


@pytest.mark.sim
@pytest.mark.parametrize("threads,n", [(256, 8), (256, 5), (64, 2), (64, 40)])   # split, split, split, not split
def test_forces_match_float64_numpy(threads, n, rng):
    k = lk.megakernel(forces)
    pos = rng.standard_normal((n, 2))
    acc0 = rng.standard_normal((n, 2))
    acc = acc0.copy()
    run = k(pos, acc, 1e-2, steps=2, backend="cuda", threads=threads)
    assert run.steps == 2
    np.testing.assert_allclose(acc, forces_ref(pos, acc0, 1e-2, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.sim
@pytest.mark.parametrize("lo,stride", [(0, 1), (3, 5), (1, 40)])
def test_integer_sums_are_exact(lo, stride, rng):
    k = lk.megakernel(counts)
    a = rng.integers(0, 9, 123).astype(np.int64)
    out = np.full((7, 2), -1, np.int64)
    k(a, out, lo, stride, steps=1, backend="cuda", threads=256)
    np.testing.assert_array_equal(out, counts_ref(a, 7, lo, stride))


@pytest.mark.sim
def test_a_backwards_strided_inner_loop(rng):
    k = lk.megakernel(backwards)
    a = rng.random(77).astype(np.float32)
    out = np.zeros(6, np.float32)
    k(a, out, steps=1, backend="cuda", threads=256)
    ref = np.array([(a[76::-2].astype(np.float64) * (i + 1)).sum() for i in range(6)])
    np.testing.assert_allclose(out, ref, rtol=1e-5)


# ---------------------------------------------- groups of several warps (rt.group_shift)
def few_bodies(t, pos, acc, eps2):
    # forces on the first acc.shape[0] bodies from all of them: few outer iterations, a long
    # inner loop
    n = pos.shape[0]
    for i in lk.range(acc.shape[0]):
        xi = pos[i, 0]
        yi = pos[i, 1]
        ax = 0.0
        ay = 0.0
        for j in range(n):
            dx = pos[j, 0] - xi
            dy = pos[j, 1] - yi
            r2 = dx * dx + dy * dy + eps2
            inv = 1.0 / (r2 * math.sqrt(r2))
            ax += dx * inv
            ay += dy * inv
        acc[i, 0] += ax
        acc[i, 1] += ay


def _group_warps(count, threads):
    """Warps per iteration the CUDA form should pick for one block of ``threads``."""
    g = 1
    while g < 8 and count * 32 * 2 * g <= threads and threads % (64 * g) == 0:
        g *= 2
    return g


@pytest.mark.sim
@pytest.mark.parametrize("threads,n,warps", [(256, 1, 8), (256, 2, 4), (256, 3, 2), (128, 2, 2), (192, 2, 2),
                                             (256, 5, 1)])
def test_groups_of_warps_match_float64_numpy(threads, n, warps, rng):
    # (256, 3): the block's fourth two-warp group has no iteration (it recomputes the last one
    # and discards it); (192, 2): six warps, so groups of two
    assert _group_warps(n, threads) == warps
    k = lk.megakernel(few_bodies)
    pos = rng.standard_normal((n + 300, 2))
    acc0 = rng.standard_normal((n, 2))
    acc = acc0.copy()
    run = k(pos, acc, 1e-2, steps=2, backend="cuda", threads=threads)
    assert run.steps == 2
    p = pos.astype(np.float64)
    d = p[None, :, :] - p[:n, None, :]
    r2 = (d ** 2).sum(-1) + 1e-2
    ref = acc0 + 2 * (d / (r2 * np.sqrt(r2))[..., None]).sum(1)
    np.testing.assert_allclose(acc, ref, rtol=1e-12, atol=1e-12)


def _group_shift_probe(out, count, naccs):
    # the simulator hands a kernel its cuda module through the function's globals
    if cuda.threadIdx.x == 0:
        out[0] = cuda_rt.group_shift(count, cuda.blockDim.x, naccs)


@pytest.mark.sim
@pytest.mark.parametrize("threads,count", [(256, 1), (256, 2), (128, 1), (96, 1), (256, 9)])
def test_the_group_size_rule(threads, count):
    probe = cuda.jit(_group_shift_probe)
    out = np.zeros(2, np.int64)
    probe[1, threads](out, count, 1)
    assert 1 << (int(out[0]) - 5) == _group_warps(count, threads)
    probe[1, threads](out, count, 64)         # too many accumulators for the slots: one warp
    assert out[0] == 5


@pytest.mark.sim
@pytest.mark.parametrize("rows", [1, 3])
def test_group_integer_sums_are_exact(rows, rng):
    k = lk.megakernel(counts)
    a = rng.integers(0, 9, 123).astype(np.int64)
    out = np.full((rows, 2), -1, np.int64)
    k(a, out, 2, 3, steps=1, backend="cuda", threads=256)
    np.testing.assert_array_equal(out, counts_ref(a, rows, 2, 3))


def between_reductions(t, a, out, tot):
    # grid reductions before and after a split loop share the block's per-warp slots with the
    # group exchange
    n = a.shape[0]
    part = 0.0
    for i in lk.range(n):
        part += a[i]
    total = lk.sum(part)
    for i in lk.range(out.shape[0]):
        s = 0.0
        for j in range(n):
            s += a[j] * (i + 1)
        out[i] = s + total
    part2 = 0.0
    for i in lk.range(n):
        part2 += a[i] * a[i]
    biggest = lk.max(part2)
    total2 = lk.sum(part2)
    for i in lk.range(1):
        tot[i] += total2 + biggest * 0.0


@pytest.mark.sim
def test_group_exchange_between_reductions(rng):
    k = lk.megakernel(between_reductions)
    a = rng.standard_normal(500)
    out = np.zeros(2)
    tot = np.zeros(1)
    k(a, out, tot, steps=3, backend="cuda", threads=256)
    np.testing.assert_allclose(out, a.sum() * np.arange(1, 3) + a.sum(), rtol=1e-12)
    np.testing.assert_allclose(tot, 3 * (a * a).sum(), rtol=1e-12)


@pytest.mark.sim
@pytest.mark.parametrize("threads,rows", [(64, 2), (256, 3), (256, 8), (64, 40)])   # warps, groups, groups, not split
def test_an_accumulators_first_value_counts_once(threads, rows, rng):
    # every lane ran `s = 10.0 + i` before the inner loop, and the lanes' partial sums were
    # added: the first value counted 32 times (64 with a group of two warps)
    k = lk.megakernel(split_fresh_each_trip)
    a = rng.random(100)
    out = np.zeros((rows, 2))
    k(a, out, steps=1, backend="cuda", threads=threads)
    np.testing.assert_allclose(out, split_fresh_ref(a, rows), rtol=1e-12)


@pytest.mark.sim
@pytest.mark.parametrize("fn,ref", [(not_split_carried_previous, lambda a: a[-1]),
                                    (not_split_carried_weight, lambda a: (a * 0.5 ** np.arange(a.size)).sum())])
def test_a_value_carried_between_inner_trips_keeps_its_meaning(fn, ref, rng):
    a = rng.random(100)
    out = np.zeros(2)
    lk.megakernel(fn)(a, out, steps=1, backend="cuda", threads=64)
    np.testing.assert_allclose(out, ref(a), rtol=1e-12)
