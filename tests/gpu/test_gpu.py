"""GPU tests: multi-block correctness in grid and block scope at several block counts, in-place
device arrays, races; every result against a float64 (or exact integer) NumPy reference or the
independent Philox of tests/refs.py.

Run on a machine with a CUDA GPU: ``python -m pytest -m gpu`` (tests/conftest.py: skipped only
where there is no GPU, failed where one is present but unusable).
"""

import numpy as np
import pytest

import loopkern as lk
import refs
import workloads as W
from doubles import DLPackOnly

pytestmark = pytest.mark.gpu

# grid scope at a few fixed block counts (odd and small ones leave uneven shares) and at the
# count scope="auto" picks (None); "block" is one block with syncthreads
GRID_BLOCKS = [pytest.param("grid", 2, id="grid-2"), pytest.param("grid", 7, id="grid-7"),
               pytest.param("grid", None, id="grid-auto")]
LAUNCHES = GRID_BLOCKS + [pytest.param("block", None, id="block")]


def rel_err(a, ref):
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / max(np.linalg.norm(ref), 1e-300))


def _sms():
    from numba import cuda
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


def _check_launch(run, scope, blocks):
    assert run.backend == "cuda"
    if scope == "block":
        assert (run.scope, run.blocks) == ("block", 1)
    elif blocks is not None:
        assert (run.scope, run.blocks) == ("grid", blocks)
    else:
        assert run.scope == "grid"


HEAT_CASES = [pytest.param(4099, 333, *p.values, id=f"4099-{p.id}") for p in LAUNCHES] + \
             [pytest.param(1 << 20, 51, *p.values, id=f"1M-{p.id}") for p in GRID_BLOCKS]


@pytest.mark.parametrize("n,steps,scope,blocks", HEAT_CASES)
def test_heat_multiblock(n, steps, scope, blocks, rng):
    u0 = rng.random(n).astype(np.float32)
    u, v = u0.copy(), np.zeros_like(u0)
    run = lk.megakernel(W.heat_step, swap=[("u", "v")])(u, v, np.float32(0.25), steps=steps, backend="cuda",
                                                        scope=scope, blocks=blocks)
    assert run.steps == steps
    _check_launch(run, scope, blocks)
    if scope == "grid" and blocks is None and n > 1 << 16:
        assert run.blocks > 1
    assert rel_err(u, W.heat_ref(u0, steps, 0.25)) < 1e-5


def test_heat_auto_scope(rng):
    # heat is a stencil whose steps may run several per halo exchange: tile mode at any size
    # (tests/gpu/test_tile_gpu.py); the same stencil written with a global accumulator is not
    def heat_counted(t, u, v, alpha, count):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])
        lk.atomic.add(count, 0, 1)

    for n, steps, scope in ((4096, 333, "block"), (65536, 101, "grid")):
        u0 = rng.random(n).astype(np.float32)
        u, v = u0.copy(), u0.copy()
        run = lk.megakernel(W.heat_step, swap=[("u", "v")])(u, v, np.float32(0.25), steps=steps, backend="cuda")
        assert (run.steps, run.scope) == (steps, "tile") and run.steps_per_exchange > 1
        assert rel_err(u, W.heat_ref(u0, steps, 0.25)) < 1e-5
        u, v = u0.copy(), u0.copy()
        count = np.zeros(1, np.int64)
        run = lk.megakernel(heat_counted, swap=[("u", "v")])(u, v, np.float32(0.25), count, steps=steps,
                                                             backend="cuda")
        assert (run.steps, run.scope) == (steps, scope)
        assert rel_err(u, W.heat_ref(u0, steps, 0.25)) < 1e-5


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_jacobi_multiblock(scope, blocks, rng):
    n = 130 if scope == "grid" else 40
    u0 = rng.random((n, n))
    tol = 1e-4
    ref, ref_steps = W.jacobi_ref(u0, tol, 20000)
    u, v = u0.copy(), u0.copy()
    run = lk.megakernel(W.jacobi_step, swap=[("u", "v")])(u, v, tol, max_steps=20000, backend="cuda",
                                                          scope=scope, blocks=blocks)
    _check_launch(run, scope, blocks)
    assert (run.steps, run.stopped) == (ref_steps, "condition")
    assert rel_err(u, ref) < 1e-12


def test_jacobi_one_barrier_per_step_is_race_free(rng):
    # the step ends in lk.max, so the kernel leaves out the barrier between steps (the one in
    # the reduction orders them): 1500 steps, bit for bit against float64 NumPy (the same
    # additions in the same order), on every resident block and on a few
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    loop = k.source("cuda").split("while _lk_t < _lk_nsteps:")[1].split("if _lk_t % 2 == 1:")[0]
    assert "_lk_rt.grid_sync(_lk_bar)" not in loop
    u0 = rng.random((512, 512))
    ref, ref_steps = W.jacobi_ref(u0, 0.0, 1500)
    assert ref_steps == 1500
    for blocks in (None, 7):
        u, v = u0.copy(), u0.copy()
        run = k(u, v, 0.0, max_steps=1500, backend="cuda", scope="grid", blocks=blocks)
        assert (run.steps, run.stopped) == (1500, "steps")
        if blocks:
            assert run.blocks == blocks
        else:
            assert run.blocks >= 2 * _sms()          # every resident block at this size
        np.testing.assert_array_equal(u, ref)


def test_reduction_then_write_only_store_one_barrier_per_step_is_race_free(rng):
    # lk.while_loop's form: the reduction assigned, then stored by one thread into a write-only
    # swap pair, the verdict returned; its barrier replaces the one between steps. 700 steps on
    # every resident block and on a few, the state and both stored reductions against NumPy
    k = lk.megakernel(W.reduce_then_store, swap=[("u", "v"), ("e", "en")])
    loop = k.source("cuda").split("while _lk_t < _lk_nsteps:")[1].split("if _lk_t % 2 == 1:")[0]
    assert "_lk_rt.grid_sync(_lk_bar)" not in loop
    u0 = rng.random(1 << 18)
    for steps in (700, 699):
        want_u, want_prev, _ = W.smooth_ref(u0, 0.0, steps, lambda t, err: True)
        before_u, before_prev, _ = W.smooth_ref(u0, 0.0, steps - 1, lambda t, err: True)
        for blocks in (None, 7):
            u, v, e, en = u0.copy(), u0.copy(), np.zeros(1), np.zeros(1)
            run = k(u, v, e, en, -1.0, max_steps=steps, backend="cuda", scope="grid", blocks=blocks)
            assert (run.steps, run.stopped) == (steps, "steps")
            np.testing.assert_allclose(u, want_u, rtol=1e-13, atol=1e-13)
            np.testing.assert_allclose(e[0], np.abs(want_u[1:-1] - want_prev[1:-1]).max(), rtol=1e-12)
            np.testing.assert_allclose(en[0], np.abs(before_u[1:-1] - before_prev[1:-1]).max(), rtol=1e-12)


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_life_multiblock(scope, blocks, rng):
    n = 512 if scope == "grid" else 64
    a0 = (rng.random((n, n)) < 0.3).astype(np.int32)
    a, b = a0.copy(), np.zeros_like(a0)
    pop = np.zeros(60, np.int64)
    run = lk.megakernel(W.life_step, swap=[("a", "b")])(a, b, pop, steps=60, backend="cuda", scope=scope,
                                                        blocks=blocks)
    _check_launch(run, scope, blocks)
    ref, ref_pop = W.life_ref(a0, 60)
    np.testing.assert_array_equal(a, ref)
    np.testing.assert_array_equal(pop, ref_pop)
    if scope == "grid" and blocks is None:
        assert run.blocks > 1


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_two_phase_and_reductions_multiblock(scope, blocks, rng):
    n = 300_001 if scope == "grid" else 3001
    x0 = rng.standard_normal(n)
    x, tmp, out = x0.copy(), np.zeros(n), np.zeros(n)
    run = lk.megakernel(W.two_phase_step)(x, tmp, out, steps=15, backend="cuda", scope=scope, blocks=blocks)
    _check_launch(run, scope, blocks)
    rx, rout = W.two_phase_ref(x0, 15)
    assert rel_err(x, rx) < 1e-12 and rel_err(out, rout) < 1e-12

    x, stats = x0.copy(), np.zeros((12, 4))
    run = lk.megakernel(W.normalize_step)(x, stats, steps=12, backend="cuda", scope=scope, blocks=blocks)
    _check_launch(run, scope, blocks)
    rx, rstats = W.normalize_ref(x0, 12)
    assert rel_err(x, rx) < 1e-10
    np.testing.assert_allclose(stats, rstats, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_helpers_multiblock(scope, blocks, rng):
    n = 200_000 if scope == "grid" else 2000
    u0 = rng.random(n) * 3
    u, v = u0.copy(), u0.copy()
    run = lk.megakernel(W.helper_step, swap=[("u", "v")])(u, v, 0.3, steps=21, backend="cuda", scope=scope,
                                                          blocks=blocks)
    _check_launch(run, scope, blocks)
    assert rel_err(u, W.helper_ref(u0, 21, 0.3)) < 1e-12


@pytest.mark.parametrize("per_sm", [1, 2])
def test_race_catcher_many_blocks_many_steps(per_sm, rng):
    """>= 5000 steps at one and two blocks per SM, integer workload compared exactly."""
    sms = _sms()
    k = lk.megakernel(W.counter_step, swap=[("a", "b")])
    n = 2 * sms * 256 * 3 + 17
    a0 = rng.integers(0, 1 << 20, n).astype(np.int64)
    ref = W.counter_ref(a0, 5001, 1_000_003)
    for trial in range(2):
        a, b = a0.copy(), np.zeros_like(a0)
        run = k(a, b, 1_000_003, steps=5001, backend="cuda", scope="grid", threads=256, blocks=per_sm * sms)
        assert run.blocks == per_sm * sms and run.steps == 5001
        np.testing.assert_array_equal(a, ref)


def test_sized_grid_launches_carry_launch_bounds_and_named_ones_do_not(rng):
    # dispatch.kernels.LAUNCH_BOUNDS: a call that leaves threads and blocks to loopkern runs the
    # bounded kernel (at most 256 threads per block); one that names threads above that, or more
    # blocks than two per SM, runs the kernel without bounds, so the launch it asks for fits
    from loopkern.dispatch import kernels
    bounds = kernels.LAUNCH_BOUNDS
    assert bounds is not None
    sms = _sms()
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    n, steps = (1 << 20) + 77, 201
    u0 = rng.random(n).astype(np.float32)
    ref = W.heat_ref(u0, steps, 0.25)
    for opts in ({}, {"threads": 512}, {"threads": 128, "blocks": 4 * sms}):
        u, v = u0.copy(), u0.copy()
        run = k(u, v, np.float32(0.25), steps=steps, backend="cuda", scope="grid", **opts)
        assert run.scope == "grid" and run.steps == steps
        assert run.threads == opts.get("threads", bounds[0]), (opts, run)
        if "blocks" in opts:
            assert run.blocks == opts["blocks"]
        assert rel_err(u, ref) < 1e-5, opts
    texts = [src.text for src in k.dispatcher.kernels.sources.values()]
    assert any(f"launch_bounds={tuple(bounds)!r}" in t for t in texts)
    assert any("launch_bounds" not in t for t in texts)


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_shift_is_exact_at_every_block_count(scope, blocks, rng):
    # every element reads its neighbour's previous value: a thread a step ahead or behind, or a
    # missing barrier, changes the closed-form result
    n = 100_003 if scope == "grid" else 3001
    u0 = rng.integers(-10 ** 6, 10 ** 6, n).astype(np.float64)
    k = lk.megakernel(refs.shift_step, swap=[("u", "v")])
    for steps in (1, 2, int(rng.integers(500, 1500))):
        u, v = u0.copy(), np.zeros_like(u0)
        run = k(u, v, steps=steps, backend="cuda", scope=scope, blocks=blocks)
        _check_launch(run, scope, blocks)
        np.testing.assert_array_equal(u, refs.shift_ref(u0, steps))


def test_device_arrays_in_place_zero_copy(rng):
    from numba import cuda
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = rng.random(1 << 16).astype(np.float32)
    du, dv = cuda.to_device(u0), cuda.to_device(u0)
    ptr = du.device_ctypes_pointer.value
    run = k(du, dv, np.float32(0.25), steps=11, backend="cuda")
    assert du.device_ctypes_pointer.value == ptr
    assert rel_err(du.copy_to_host(), W.heat_ref(u0, 11, 0.25)) < 1e-5
    assert run.steps == 11


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_cuda_array_interface_frameworks_in_place(lib, rng):
    mod = pytest.importorskip(lib)
    u0 = rng.random(50_000).astype(np.float32)
    if lib == "cupy":
        u, v = mod.asarray(u0), mod.asarray(u0)
        to_host = mod.asnumpy
        ptr = u.data.ptr
        get_ptr = lambda x: x.data.ptr  # noqa: E731
    else:
        u, v = mod.tensor(u0, device="cuda"), mod.tensor(u0, device="cuda")
        to_host = lambda x: x.cpu().numpy()  # noqa: E731
        ptr = u.data_ptr()
        get_ptr = lambda x: x.data_ptr()  # noqa: E731
    run = lk.megakernel(W.heat_step, swap=[("u", "v")])(u, v, 0.25, steps=9, backend="cuda")
    assert get_ptr(u) == ptr and run.steps == 9
    assert rel_err(to_host(u), W.heat_ref(u0, 9, 0.25)) < 1e-5


def test_too_many_blocks_is_a_clear_error_before_launch(rng):
    sms = _sms()
    u0 = rng.random(4096).astype(np.float32)
    u, v = u0.copy(), u0.copy()
    with pytest.raises(lk.LaunchError, match="blocks=.*resident"):
        lk.megakernel(W.heat_step, swap=[("u", "v")])(u, v, 0.25, steps=3, backend="cuda", scope="grid",
                                                      blocks=sms * 64, threads=1024)
    np.testing.assert_array_equal(u, u0)
    np.testing.assert_array_equal(v, u0)


def test_numpy_strided_view_and_device_scratch(rng):
    from numba import cuda
    base = rng.standard_normal(2000)
    untouched = base[1::2].copy()
    xs = base[::2]                       # a strided NumPy view, updated in place
    x_init = xs.copy()
    tmp = cuda.device_array(1000)        # device scratch mixed with host arrays
    out = np.zeros(1000)
    lk.megakernel(W.two_phase_step)(xs, tmp, out, steps=4, backend="cuda")
    rx, rout = W.two_phase_ref(x_init, 4)
    assert rel_err(base[::2], rx) < 1e-12 and rel_err(out, rout) < 1e-12
    np.testing.assert_array_equal(base[1::2], untouched)


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_dlpack_only_arrays_in_place_zero_copy(lib, rng):
    mod = pytest.importorskip(lib)
    u0 = rng.random(30_000).astype(np.float32)
    if lib == "cupy":
        u, v = mod.asarray(u0), mod.asarray(u0)
        ptr, host = u.data.ptr, mod.asnumpy
    else:
        u, v = mod.tensor(u0, device="cuda"), mod.tensor(u0, device="cuda")
        ptr, host = u.data_ptr(), (lambda x: x.cpu().numpy())
    run = lk.megakernel(W.heat_step, swap=[("u", "v")])(DLPackOnly(u), DLPackOnly(v), 0.25, steps=7,
                                                        backend="cuda")
    assert run.steps == 7
    assert (u.data.ptr if lib == "cupy" else u.data_ptr()) == ptr
    assert rel_err(host(u), W.heat_ref(u0, 7, 0.25)) < 1e-5


def test_jax_array_to_kernel_call_is_refused(rng):
    jnp = pytest.importorskip("jax.numpy")
    a = jnp.asarray(rng.random(8).astype(np.float32))
    with pytest.raises(lk.ArgumentError, match="immutable"):
        lk.megakernel(W.heat_step, swap=[("u", "v")])(a, a, 0.25, steps=1, backend="cuda")


def test_random_numbers_match_an_independent_philox_at_any_grid_size(rng):
    import test_random as R
    n, steps = 50_000, 2
    call = R._random_call(rng)
    ref_u, ref_z = R.reference_draws(n=n, steps=steps, **call)
    for scope, threads, blocks in (("grid", 256, None), ("grid", 128, 7), ("grid", 64, 2), ("block", None, None)):
        out, noise = R.run_draws(n=n, steps=steps, backend="cuda", scope=scope, threads=threads, blocks=blocks,
                                 **call)
        np.testing.assert_array_equal(out, ref_u)                          # uniform: bit for bit
        # normal: CUDA's log and cos may round the last bit differently from NumPy's
        np.testing.assert_allclose(noise, ref_z, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_subkeys_two_to_the_32_apart_draw_different_numbers_on_the_gpu(scope, blocks, rng):
    """Every bit of a subkey counts on the GPU too (its high word in the Philox key, since
    session 36), bit for bit as the independent Philox of tests/refs.py."""
    import test_random as R
    n, hi = 20_000, 1 << 32
    seed = int(rng.integers(0, 1 << 64, dtype=np.uint64))
    out = np.zeros((3, n))
    lk.megakernel(R.subkey_draws)(out, hi, steps=1, backend="cuda", scope=scope, blocks=blocks, seed=seed)
    i = np.arange(n)
    for row in range(3):
        np.testing.assert_array_equal(out[row], refs.uniform_np(seed, 0, 7, i + row * hi, 1))


def f32_extremes_step(t, x, out):
    # lk.max and lk.min of float32 values run in float32 (runtime/cuda_rt.py _make): each step
    # reduces one row
    n = x.shape[1]
    hi = np.float32(-3e38)
    lo = np.float32(3e38)
    for i in lk.range(n):
        hi = max(hi, x[t, i])
        lo = min(lo, x[t, i])
    a = lk.max(hi)
    b = lk.min(lo)
    if lk.thread_id() == 0:
        out[t, 0] = a
        out[t, 1] = b


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_float32_max_and_min_equal_numpys(scope, blocks, rng):
    steps, n = 9, 3001
    x = (rng.standard_normal((steps, n)) * 10.0 ** rng.integers(-40, 38, (steps, n))).astype(np.float32)
    x[1, 17] = np.inf
    x[2, 5] = -np.inf
    x[3, :] = np.float32(1e-45) * rng.integers(-3, 4, n)        # subnormals and zeros
    out = np.zeros((steps, 2), np.float32)
    run = lk.megakernel(f32_extremes_step)(x, out, steps=steps, backend="cuda", scope=scope, blocks=blocks)
    _check_launch(run, scope, blocks)
    np.testing.assert_array_equal(out[:, 0], x.max(axis=1))
    np.testing.assert_array_equal(out[:, 1], x.min(axis=1))


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_max_and_min_are_nan_when_any_threads_value_is(scope, blocks, rng):
    """A NaN in any thread's value makes lk.max and lk.min NaN (as np.max and np.min), whether
    it meets the others in a warp's shuffles, in the block's slots or in the partials of the
    grid; rows without one give exactly NumPy's extremes."""
    n = 3000
    for dtype in (np.float32, np.float64):
        x = W.nan_rows(rng, n, dtype, 256)
        out = np.zeros((x.shape[0], 2), dtype)
        run = lk.megakernel(W.nan_extremes_step)(x, out, steps=x.shape[0], backend="cuda", scope=scope,
                                                 blocks=blocks)
        _check_launch(run, scope, blocks)
        assert out[0, 0] == x[0].max() and out[0, 1] == x[0].min()
        assert np.isnan(out[1:]).all(), out


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_reductions_of_float32_and_float64_in_one_kernel(scope, blocks, rng):
    n, steps = 5000, 4
    x0 = rng.random(n).astype(np.float32)
    x, out = x0.copy(), np.zeros((steps, 4))
    run = lk.megakernel(W.mixed_reductions_step)(x, out, steps=steps, backend="cuda", scope=scope, blocks=blocks)
    _check_launch(run, scope, blocks)
    want_x, want_out = W.mixed_reductions_ref(x0, steps)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)


@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_division_by_zero_follows_numpy(scope, blocks, rng):
    """A float divided by zero is an infinity or NaN and an integer one 0, as NumPy gives and
    as the CPU backend does (tests/test_backends.py)."""
    x = np.array([0.0, -0.0, 2.0, -3.5, 1e-300])
    k = rng.integers(-9, 10, x.size).astype(np.int64)
    out, iout = np.zeros((3, x.size)), np.ones((2, x.size), np.int64)
    run = lk.megakernel(W.zero_division_step)(x, k, out, iout, steps=1, backend="cuda", scope=scope, blocks=blocks)
    _check_launch(run, scope, blocks)
    with np.errstate(all="ignore"):
        want = np.stack([1.0 / x, x / x, -x / (x * 0.0)])
        iwant = np.stack([k // (k - k), k % (k - k)])
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(iout, iwant)



@pytest.mark.parametrize("scope,blocks", LAUNCHES)
def test_max_and_min_of_uint64_on_the_gpu(scope, blocks, rng):
    """lk.max/lk.min of uint64 order values of 2**63 and more as unsigned (the GPU's int64
    reduction compared them as signed before session 28) and return uint64."""
    n = 20000
    for case in range(3):
        a = rng.integers(0, 2 ** 62, n, dtype=np.uint64)
        a[rng.integers(0, n, 5)] = np.uint64(2 ** 63) + rng.integers(0, 2 ** 62, 5, dtype=np.uint64)
        if case == 1:
            a[:] = np.uint64(2 ** 64 - 1) - a % np.uint64(10 ** 6)
        if case == 2:
            a[rng.integers(0, n)] = 0
        out = np.zeros(2, np.uint64)
        run = lk.megakernel(W.uint64_extremes_step)(a, out, steps=1, backend="cuda", scope=scope, blocks=blocks)
        _check_launch(run, scope, blocks)
        assert out.tolist() == [int(a.max()), int(a.min())], case


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_float_to_an_integer_power_on_the_gpu(dtype, rng):
    """0.0 ** -n is an infinity on the GPU (-inf for -0.0 to an odd power), as NumPy gives: the
    CPU backend's cpu_rt.power (session 28) follows it."""
    W.check_int_power(lk.megakernel(W.int_power_step), "cuda", dtype, rng)


@pytest.mark.parametrize("scope,blocks", [pytest.param("grid", None, id="grid"), pytest.param("block", None, id="block")])
def test_shifts_by_any_count_follow_numpy(scope, blocks, rng):
    # a count of 64 or more, or a negative one, gives NumPy's 0 or sign: NVVM dropped the store
    # of a << 65 (poison), and PTX's clamping shift took a variable count cut to 32 bits
    from test_backends import _shift_right, shift_operands
    n = 1001
    a, s = shift_operands(rng, n)
    left, right = np.zeros(n, np.int64), np.zeros(n, np.int64)
    run = lk.megakernel(W.shifts_step)(a, s, left, right, steps=1, scope=scope, blocks=blocks)
    assert run.backend == "cuda"
    want_left, want_right = W.shifts_ref(a, s)
    np.testing.assert_array_equal(left, want_left)
    np.testing.assert_array_equal(right, 0)
    lk.megakernel(_shift_right)(a, s, right, steps=1, scope=scope, blocks=blocks)
    np.testing.assert_array_equal(right, want_right)
    out = np.zeros((5, n), np.int64)
    lk.megakernel(W.constant_shifts_step)(a, out, steps=1, scope=scope, blocks=blocks)
    np.testing.assert_array_equal(out, W.constant_shifts_ref(a))


@pytest.mark.parametrize("scope,blocks,threads", [("grid", 4, 64), ("grid", None, None), ("block", None, 256)])
@pytest.mark.parametrize("per_thread", [1, 2, 3, 9])
def test_unrolled_loops_with_loads_after_stores_follow_numpy(scope, blocks, threads, per_thread, rng):
    """The unrolled loops' forms compiled for the GPU (codegen._hoist_loads, the two-copy loop):
    a load moved above a store, a load indexed by a carried value and a helper called with one
    array for two parameters (both left in place), at about 1, 2, 3 and 9 indices per thread,
    against NumPy and a plain-Python run of each thread's share."""
    import test_codegen as C
    probe = lk.megakernel(C.hoist_loads_past_stores)
    run = probe(np.zeros(64), np.zeros(64), np.zeros(64), steps=1, backend="cuda", scope=scope, blocks=blocks,
                threads=threads)
    nt = run.blocks * run.threads
    n = nt * per_thread + int(rng.integers(1, 32))
    u = rng.random(n)
    v, w = np.zeros(n), np.zeros(n)
    opts = dict(steps=1, backend="cuda", scope=scope, blocks=run.blocks, threads=run.threads)
    probe(u, v, w, **opts)
    np.testing.assert_array_equal(v, 2 * u)
    np.testing.assert_array_equal(w, (2 * u + u[::-1]) * np.append(u[1:], 0.5))

    idx = rng.integers(0, n, n)
    v, out = np.zeros(n), np.zeros(nt, np.int64)
    lk.megakernel(C.hoist_carried_index)(idx, u, v, out, **opts)
    expect = np.zeros(nt, np.int64)
    for k in range(nt):
        acc = 0
        for _ in range(k, n, nt):
            acc = (acc * 3 + 1 + int(idx[acc])) % n
        expect[k] = acc
    np.testing.assert_array_equal(out, expect)

    x, w = u.copy(), np.zeros(n)
    lk.megakernel(C.hoist_helper_aliased)(x, w, **opts)
    np.testing.assert_array_equal(x, u + 1.0)
    np.testing.assert_array_equal(w, (u + 1.0) * 10.0)
