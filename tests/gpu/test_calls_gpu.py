"""The call path on the GPU: launches through the driver with a cached plan's parameter words.

Each call writes its own pointers and numbers into the plan's words, so these tests vary
exactly that between calls with one signature (new buffers, new scalar values of every dtype,
strided and Fortran-ordered views, 1- to 3-D arrays, NumPy inputs copied in and back, debug
and timeout, start() handles, several threads) and check every result against a float64
NumPy reference."""

import threading
import time

import numpy as np
import pytest

import loopkern as lk
import refs
import workloads as W

pytestmark = pytest.mark.gpu


def _cuda():
    from numba import cuda
    return cuda


def mixed_step(t, x, y, m, a, b, k, flag, s8, u64):
    # every kind of number the kernel can take, each used so that a wrong word shows
    n = x.shape[0]
    for i in lk.range(n):
        base = x[i] * a + b
        if flag:
            base = base + k
        y[i] = base + s8 + (u64 % 1000) + t
    for i, j in lk.grid(m.shape[0], m.shape[1]):
        m[i, j] = m[i, j] + a * (i - j) + k


def mixed_ref(x, m, steps, start, a, b, k, flag, s8, u64):
    x = x.astype(np.float64)
    y = None
    m = m.astype(np.float64).copy()
    for t in range(start, start + steps):
        base = x * a + b + (k if flag else 0)
        y = base + s8 + (u64 % 1000) + t
        i, j = np.indices(m.shape)
        m = m + a * (i - j) + k
    return y, m


MIXED = lk.megakernel(mixed_step)


@pytest.mark.parametrize("order", ["C", "F"])
def test_every_scalar_dtype_and_new_buffers_each_call(order, rng):
    cuda = _cuda()
    for call in range(4):
        n = 5000
        x0 = rng.random(n)
        m0 = np.asarray(rng.random((37, 53)), order=order)
        a = float(rng.uniform(-2, 2))
        b = np.float32(rng.uniform(-2, 2))
        k = int(rng.integers(-10 ** 12, 10 ** 12))
        flag = bool(call % 2)
        s8 = np.int8(rng.integers(-128, 127))
        u64 = np.uint64(rng.integers(2 ** 33, 2 ** 50))    # above 32 bits, exact as a float
        steps, start = int(rng.integers(1, 5)), int(rng.integers(0, 10 ** 9))
        x, y, m = cuda.to_device(x0), cuda.device_array(n), cuda.to_device(m0)
        run = MIXED(x, y, m, a, b, k, flag, s8, u64, steps=steps, start=start, backend="cuda")
        assert run.steps == steps
        want_y, want_m = mixed_ref(x0, m0, steps, start, a, np.float64(b), k, flag, int(s8), int(u64))
        np.testing.assert_allclose(y.copy_to_host(), want_y, rtol=1e-12, atol=1e-6)
        np.testing.assert_allclose(m.copy_to_host(), want_m, rtol=1e-12, atol=1e-6)
    assert len(MIXED.dispatcher.plans) >= 1


def test_strided_device_views_and_reversed_views(rng):
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    for step in (2, 3, -1):
        u0 = rng.random(3 * 4000)
        du, dv = cuda.to_device(u0.copy()), cuda.to_device(u0.copy())
        u, v = du[::step], dv[::step]
        k(u, v, 0.2, steps=50, backend="cuda")
        got = du.copy_to_host()[::step]         # Numba copies no negative-strided view itself
        np.testing.assert_allclose(got, refs.heat_exact(u0[::step], 50, 0.2), rtol=1e-9, atol=1e-12)
        # the elements outside the view are untouched
        if step != -1:
            rest = np.ones(u0.shape, bool)
            rest[::step] = False
            np.testing.assert_array_equal(du.copy_to_host()[rest], u0[rest])


@pytest.mark.parametrize("scope", ["block", "grid"])
def test_many_calls_continue_one_run(scope, rng):
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    n = 4096 if scope == "block" else 1 << 16
    u0 = rng.random(n).astype(np.float32)
    u, v = cuda.to_device(u0), cuda.to_device(u0)
    t = 0
    for _ in range(300):
        run = k(u, v, 0.25, steps=3, start=t, backend="cuda", scope=scope)
        assert run.scope == scope
        t = run.next_start
    assert len(k.dispatcher.plans) == 1
    np.testing.assert_allclose(u.copy_to_host(), refs.heat_exact(u0, 900, np.float32(0.25)), rtol=1e-4,
                               atol=1e-5)


def test_numpy_inputs_are_copied_in_and_back_every_call(rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    for _ in range(5):
        u0 = rng.random(10_000)
        u, v = u0.copy(), u0.copy()
        k(u, v, 0.3, steps=7, backend="cuda")
        np.testing.assert_allclose(u, refs.heat_exact(u0, 7, 0.3), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(v, refs.heat_exact(u0, 6, 0.3), rtol=1e-9, atol=1e-12)
    # a non-contiguous NumPy view is copied back through a contiguous buffer
    big = rng.random(20_000)
    u, v = big[::2], big[::2].copy()
    u0 = u.copy()
    k(u, v, 0.3, steps=7, backend="cuda")
    np.testing.assert_allclose(big[::2], refs.heat_exact(u0, 7, 0.3), rtol=1e-9, atol=1e-12)


def test_a_warm_plan_refuses_aliased_device_buffers(rng):
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    n = 4000
    big = cuda.to_device(rng.random(2 * n + 1))
    k(big[:n], big[n:2 * n], 0.2, steps=1, backend="cuda")
    before = big.copy_to_host()
    with pytest.raises(lk.ArgumentError, match="share memory"):
        k(big[:n], big[1:n + 1], 0.2, steps=1, backend="cuda")
    np.testing.assert_array_equal(big.copy_to_host(), before)


def test_debug_and_timeout_through_a_warm_plan(rng):
    cuda = _cuda()
    k = lk.megakernel(W.oob_step, swap=[("u", "v")])
    u = cuda.to_device(rng.random(1000))
    v = cuda.to_device(rng.random(1000))
    k(u, v, 0, steps=3, backend="cuda", debug=True)          # in bounds (shift 0)
    with pytest.raises(lk.BoundsError, match="out-of-bounds"):
        k(u, v, 5, steps=10, backend="cuda", debug=True)
    h = lk.megakernel(W.heat_step, swap=[("u", "v")])
    a, b = cuda.to_device(rng.random(1 << 16)), cuda.to_device(rng.random(1 << 16))
    run = h(a, b, 0.1, steps=10 ** 9, backend="cuda", timeout=0.2)
    assert run.stopped == "timeout" and 0 < run.steps < 10 ** 9
    run = h(a, b, 0.1, steps=5, backend="cuda")              # the same plan, no timeout left over
    assert (run.steps, run.stopped) == (5, "steps")


def test_start_handles_and_threads_share_a_plan_safely(rng):
    cuda = _cuda()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    n = 1 << 14
    u0s = [rng.random(n) for _ in range(4)]
    pairs = [(cuda.to_device(u0), cuda.to_device(u0)) for u0 in u0s]
    handles = [k.start(u, v, 0.2, steps=400, backend="cuda") for u, v in pairs[:2]]
    errors = []

    def work(i):
        try:
            u, v = pairs[i]
            for _ in range(4):
                k(u, v, 0.2, steps=100, backend="cuda")
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(i,)) for i in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in handles:
        assert h.wait().steps == 400
    assert not errors, errors
    for (u, _), u0 in zip(pairs, u0s):
        np.testing.assert_allclose(u.copy_to_host(), refs.heat_exact(u0, 400, 0.2), rtol=1e-9, atol=1e-12)


def test_cupy_and_torch_arrays_through_a_warm_plan(rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    cp = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    for _ in range(3):
        u0 = rng.random(5000)
        u, v = cp.asarray(u0), cp.asarray(u0)
        k(u, v, 0.2, steps=9, backend="cuda")
        np.testing.assert_allclose(cp.asnumpy(u), refs.heat_exact(u0, 9, 0.2), rtol=1e-9, atol=1e-12)
        tu, tv = torch.tensor(u0, device="cuda"), torch.tensor(u0, device="cuda")
        k(tu, tv, 0.2, steps=9, backend="cuda")
        np.testing.assert_allclose(tu.cpu().numpy(), refs.heat_exact(u0, 9, 0.2), rtol=1e-9, atol=1e-12)


def test_the_watchdog_of_a_blocking_gpu_call(rng):
    # step 2 spins for about a second on one GPU thread; the watchdog (0.2 s) cancels the run,
    # which then stops after that step: HangError with the Run, and the state after its steps
    k = lk.megakernel(W.busy_step)
    x0 = np.array([0.0, rng.random()])
    x = _cuda().to_device(x0)
    k(x, 0, 10, steps=1, backend="cuda")                  # compile
    # The spin is sized on this GPU to take about a second: a fixed count took 2 s on an H200
    # and more than the 5 s the cancelled run is given on an H100 (2026-12-05)
    probe = 20_000_000
    began = time.perf_counter()
    k(x, 0, probe, steps=1, backend="cuda")
    spin = int(probe * min(1.0 / max(time.perf_counter() - began, 1e-3), 50.0))
    x = _cuda().to_device(x0)
    with pytest.raises(lk.HangError, match="a step takes longer than the watchdog") as info:
        k(x, 2, spin, steps=10 ** 6, backend="cuda", watchdog=0.2)
    run = info.value.run
    assert run.stopped == "cancelled" and 2 < run.steps < 10 ** 6
    np.testing.assert_allclose(x.copy_to_host(), refs.busy_ref(x0, run.steps, 2, spin), rtol=1e-6)


@pytest.mark.parametrize("scope,n,blocks", [("grid", 1 << 20, None), ("grid", 3 * 4099, 7), ("block", 2048, None)])
def test_the_host_reads_mapped_arrays_right_after_a_blocking_call(scope, n, blocks, rng):
    # A blocking CUDA call returns as soon as it reads the kernel's done flag, without
    # synchronizing the stream: the flag must come after every thread's last write. Mapped
    # arrays are host memory the kernel writes over PCIe, read here by the CPU with no CUDA
    # call in between. Odd step counts end with every thread exchanging its share of the swap
    # pair (grid), or copying the staged arrays out of shared memory (block); a write that
    # landed after the flag shows up as an element one step behind (shift_ref is exact).
    cuda = _cuda()
    k = lk.megakernel(refs.shift_step, swap=[("u", "v")])
    u = cuda.mapped_array(n, np.int64)
    v = cuda.mapped_array(n, np.int64)
    t = 0
    for call, steps in enumerate((1, 3, 2, 5, 1, 1, 7)):
        u0 = rng.integers(0, 1 << 40, n)
        u[:] = u0
        v[:] = -1
        run = k(u, v, steps=steps, start=t, backend="cuda", scope=scope, threads=256, blocks=blocks)
        got_u, got_v = np.array(u), np.array(v)     # host reads, nothing synchronized
        assert run.steps == steps and run.scope == scope
        np.testing.assert_array_equal(got_u, refs.shift_ref(u0, steps), err_msg=f"call {call}: u")
        np.testing.assert_array_equal(got_v, refs.shift_ref(u0, steps - 1), err_msg=f"call {call}: v")
        t = run.next_start
    assert len(k.dispatcher.plans) == 1
