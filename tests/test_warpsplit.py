"""Warp-split parallel loops (loopkern/warpsplit.py): which loops qualify, and what the split
form computes under Numba's CUDA simulator (one block; 256 threads and few iterations, so the
split form runs), against float64 NumPy or plain-Python sequential references."""

import math

import numpy as np
import pytest

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


@pytest.mark.parametrize("fn,accs", [(forces, ("ax", "ay")), (counts, ("big", "hits")), (backwards, ("s",))])
def test_loops_of_the_warp_split_shape_are_found(fn, accs):
    k = lk.megakernel(fn)
    split = find_warp_split(_parallel_loops(k)[0])
    assert split is not None and split.accumulators == accs
    assert step_has_warp_split(k.spec.step)


@pytest.mark.parametrize("fn", [not_split_store_inside, not_split_partial_read, not_split_outer_accumulator,
                                not_split_lane_value_after, not_split_product, not_split_two_loops,
                                not_split_random])
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
