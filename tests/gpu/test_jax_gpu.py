"""kernel.jax on the GPU: the XLA FFI custom call inside jax.jit, zero copy under donation,
traced scalars and steps, pipelines, vmap, several block counts, and a race test against XLA's
own ops; every result against a float64 NumPy reference or a closed form (tests/refs.py).

Without JAX, or with a JAX that has no GPU backend, these tests skip; LOOPKERN_REQUIRE_GPU=1
makes that a failure (tests/conftest.py)."""

import numpy as np
import pytest

import loopkern as lk
import refs
import workloads as W

from .jax_gpu import jax, jnp, require_gpu_jax

pytestmark = pytest.mark.gpu

HEAT = lk.megakernel(W.heat_step, swap=[("u", "v")])
JACOBI = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
SHIFT = lk.megakernel(refs.shift_step, swap=[("u", "v")])


@pytest.fixture(autouse=True)
def gpu_jax():
    require_gpu_jax(": install jax[cuda13]")


def rel_err(a, ref):
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref))


def test_kernel_jax_grid_launch_bounds_only_where_loopkern_sizes_the_launch(rng):
    # kernel.jax's grid kernels carry dispatch.kernels.LAUNCH_BOUNDS when threads and blocks are
    # left to loopkern, and not where the call names threads above the bound
    from loopkern.dispatch import kernels
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    n, steps = (1 << 20) + 77, 57
    u0 = rng.random(n).astype(np.float32)
    ref = W.heat_ref(u0, steps, 0.25)
    for opts in ({}, {"threads": 512}):
        f = jax.jit(lambda u, v, opts=opts: k.jax(u, v, np.float32(0.25), steps=steps, scope="grid", **opts))
        u, _ = f(jnp.asarray(u0), jnp.asarray(u0))
        assert rel_err(u, ref) < 1e-5, opts
    texts = [src.text for src in k.dispatcher.kernels.sources.values()]
    assert any(f"launch_bounds={tuple(kernels.LAUNCH_BOUNDS)!r}" in t for t in texts)
    assert any("launch_bounds" not in t for t in texts)


@pytest.mark.parametrize("n,steps", [(4096, 333), (1 << 20, 41)])
def test_heat_in_jit_matches_reference(n, steps, rng):
    u0 = rng.random(n).astype(np.float32)
    ref = W.heat_ref(u0, steps, 0.25)
    f = jax.jit(lambda u, v, s: HEAT.jax(u, v, np.float32(0.25), steps=s))
    u, v = f(jnp.asarray(u0), jnp.asarray(u0), steps)
    assert rel_err(u, ref) < 1e-5
    u2, _ = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), np.float32(0.25), steps=steps)   # eager
    assert rel_err(u2, ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(u2), np.asarray(u))      # and the same kernel both ways


@pytest.mark.parametrize("blocks", [2, 7, None])
def test_several_block_counts_in_jit(blocks, rng):
    n = 1 << 18
    a0 = rng.integers(-10 ** 6, 10 ** 6, n).astype(np.int32)
    f = jax.jit(lambda u, s: SHIFT.jax(u, u, steps=s, scope="grid", blocks=blocks)[0])
    for steps in (1, 2, int(rng.integers(100, 400))):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(a0), steps)), refs.shift_ref(a0, steps))
    u0 = rng.random(n).astype(np.float32)
    g = jax.jit(lambda u: HEAT.jax(u, u, np.float32(0.25), steps=57, scope="grid", blocks=blocks)[0])
    assert rel_err(g(jnp.asarray(u0)), W.heat_ref(u0, 57, 0.25)) < 1e-5


def test_donation_is_zero_copy(rng):
    u0 = rng.random(1 << 16).astype(np.float32)
    f = jax.jit(lambda u, v: HEAT.jax(u, v, np.float32(0.25), steps=10), donate_argnums=(0, 1))
    a, b = jnp.asarray(u0), jnp.asarray(u0)
    pa, pb = a.unsafe_buffer_pointer(), b.unsafe_buffer_pointer()
    u, v = f(a, b)
    assert {u.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()} == {pa, pb}
    assert u.unsafe_buffer_pointer() == pa
    assert rel_err(u, W.heat_ref(u0, 10, 0.25)) < 1e-5


def test_traced_scalar_and_steps_and_while_count(rng):
    u0 = rng.random(5000).astype(np.float32)
    f = jax.jit(lambda u, a, s: HEAT.jax(u, u, a, steps=s)[0])
    for alpha, steps in ((0.1, 7), (0.3, 12)):
        out = f(jnp.asarray(u0), jnp.float32(alpha), jnp.int32(steps))
        assert rel_err(out, W.heat_ref(u0, steps, alpha)) < 1e-5
    g0 = rng.random((100, 100)).astype(np.float32)
    u, v, steps = jax.jit(lambda a: JACOBI.jax(a, a, np.float32(1e-4), max_steps=20000))(jnp.asarray(g0))
    # the same float32 kernel launched directly stops at the same step
    du, dv = g0.copy(), g0.copy()
    run = JACOBI(du, dv, np.float32(1e-4), max_steps=20000, backend="cuda")
    assert int(steps) == run.steps
    np.testing.assert_array_equal(np.asarray(u), du)
    # and float32 rounding moves the float64 reference's stopping step by well under 1%
    ref, ref_steps = W.jacobi_ref(g0, 1e-4, 20000)
    assert abs(int(steps) - ref_steps) <= 0.01 * ref_steps
    assert rel_err(u, ref) < 1e-3


SCALARS = lk.megakernel(W.scalars_step, swap=[("u", "v")])


@pytest.mark.parametrize("n,scope", [(4096, "block"), (4096, "grid"), (1 << 16, "grid"), (1 << 16, None)])
def test_scalars_read_where_the_step_uses_them(n, scope, rng):
    # kernel.jax reads each scalar buffer before the step's statement that uses it: inside a
    # loop (a), through a helper (b, k) and after the loop's reduction only (tol), traced or not
    u0 = rng.random(n).astype(np.float32)
    a, b, k = 0.2, 1e-4, 3
    f = jax.jit(lambda u, a, b, k, tol, s: SCALARS.jax(u, u, a, b, k, tol, max_steps=s, scope=scope))
    # tol -1 never stops the run: every step's field against float64
    u, _, done = f(jnp.asarray(u0), jnp.float32(a), jnp.float32(b), jnp.int32(k), jnp.float32(-1.0), 57)
    ref, ref_done = W.scalars_ref(u0, 57, a, b, k, -1.0)
    assert int(done) == ref_done == 57
    assert rel_err(u, ref) < 1e-5
    # a tolerance between the first step's change and the second's stops it after two steps
    # (the first step's change is about 0.2 * |laplacian|, which decays as the field smooths)
    ref1, _ = W.scalars_ref(u0, 1, a, b, k, -1.0)
    ref2, _ = W.scalars_ref(u0, 2, a, b, k, -1.0)
    change1 = np.abs(ref1 - u0).max()
    change2 = np.abs(ref2 - ref1).max()
    assert change2 < 0.9 * change1
    tol = 0.5 * (change1 + change2)
    u, _, done = f(jnp.asarray(u0), jnp.float32(a), jnp.float32(b), jnp.int32(k), jnp.float32(tol), 57)
    assert int(done) == W.scalars_ref(u0, 57, a, b, k, tol)[1] == 2
    assert rel_err(u, ref2) < 1e-5
    # the same scalars as Python numbers (concrete, not traced)
    u, _, done = jax.jit(lambda u: SCALARS.jax(u, u, np.float32(a), np.float32(b), k, np.float32(-1.0),
                                               max_steps=57, scope=scope))(jnp.asarray(u0))
    assert int(done) == 57 and rel_err(u, ref) < 1e-5


def test_concrete_zero_d_gpu_arrays_are_scalars(rng):
    # a 0-d JAX array on the GPU has a CUDA array interface: it is still a number (eagerly, and
    # as the reverse sweep passes scalars to its segment runs)
    u0 = rng.random(5000).astype(np.float32)
    alpha = jnp.float32(0.2)
    assert hasattr(alpha, "__cuda_array_interface__")
    u, _ = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), alpha, steps=jnp.int32(9))
    assert rel_err(u, W.heat_ref(u0, 9, 0.2)) < 1e-5
    with pytest.raises(lk.ArgumentError, match="argument 'alpha'"):
        HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), jnp.ones(3, jnp.float32), steps=2)


def test_vmap_and_pipeline(rng):
    batch = rng.random((3, 3000)).astype(np.float32)
    out = jax.jit(jax.vmap(lambda a: HEAT.jax(jnp.sin(a), jnp.sin(a), np.float32(0.25), steps=5)[0] * 2))(
        jnp.asarray(batch))
    for k in range(3):
        assert rel_err(out[k], 2 * W.heat_ref(np.sin(batch[k].astype(np.float64)), 5, 0.25)) < 1e-5



@pytest.mark.parametrize("jit", [False, True])
def test_vmap_over_rows_passed_straight_in(jit, rng):
    """The rows of a batch passed to the call as they are (no XLA op of their own before it):
    XLA runs JAX's sequential vmap as a loop whose custom call reads a slice of the batch in
    place and writes its result into a slice of another buffer (a dynamic-slice fusion), so the
    aliased result the kernel works in is not the input's buffer. Before 2485d48 the kernel ran
    on what that buffer held (a jax.grad through vmap came out 0.0 on an H100); the FFI handler
    now copies the input there first. Each row against a float64 NumPy reference, with both
    arrays of the swap pair distinct per row and one unbatched array argument."""
    batch = rng.random((4, 2048)).astype(np.float32)
    other = rng.random((4, 2048)).astype(np.float32)

    def rows(u, v):
        return jax.vmap(lambda a, b: HEAT.jax(a, b, np.float32(0.25), steps=7))(u, v)
    f = jax.jit(rows) if jit else rows
    for attempt in range(3):        # buffers XLA reuses from earlier calls hold earlier values
        scale = np.float32(attempt + 1)
        u, v = f(jnp.asarray(batch * scale), jnp.asarray(other * scale))
        for k in range(4):
            ref_u = W.heat_ref(batch[k].astype(np.float64) * scale, 7, 0.25)
            assert rel_err(u[k], ref_u) < 1e-5, (attempt, k)
    shared = jnp.asarray(other[0])          # one array for every row (in_axes None)
    g = jax.vmap(lambda a: HEAT.jax(a, shared, np.float32(0.25), steps=6)[0])
    out = (jax.jit(g) if jit else g)(jnp.asarray(batch))
    for k in range(4):
        assert rel_err(out[k], W.heat_ref(batch[k].astype(np.float64), 6, 0.25)) < 1e-5

def test_race_with_xla_ops_before_and_after(rng):
    """An XLA op writes the input right before the megakernel and another reads its output
    right after, on the same stream, many times with large arrays: every result is checked."""
    n = 1 << 22
    base = rng.random(n).astype(np.float32)

    @jax.jit
    def f(x, k):
        u = x * k + 1.0                          # produced by XLA just before
        u, _ = HEAT.jax(u, u, np.float32(0.25), steps=3)
        return u * 2.0 - 1.0                     # consumed by XLA just after

    x = jnp.asarray(base)
    head = base[:4096].astype(np.float64)
    for k in range(20):
        out = np.asarray(f(x, jnp.float32(k + 1))[:4000])
        ref = W.heat_ref(head * (k + 1) + 1.0, 3, 0.25)[:4000] * 2.0 - 1.0
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


def test_cpu_array_with_forced_cuda_is_an_error(rng):
    cpu = jax.devices("cpu")[0]
    u = jax.device_put(jnp.asarray(rng.random(16).astype(np.float32)), cpu)
    with pytest.raises(lk.ArgumentError, match="platforms|backend='cuda'"):
        HEAT.jax(u, u, 0.25, steps=1, backend="cuda")


def test_timeout_and_seed_inside_jit(rng):
    import time
    a0 = rng.integers(-10 ** 6, 10 ** 6, 1 << 16).astype(np.int32)
    f = jax.jit(lambda u, v: SHIFT.jax(u, v, steps=10 ** 9, timeout=0.3))
    jax.block_until_ready(f(jnp.asarray(a0), jnp.asarray(a0)))       # compile
    t0 = time.perf_counter()
    u, v, done = jax.block_until_ready(f(jnp.asarray(a0), jnp.asarray(a0)))
    elapsed = time.perf_counter() - t0
    done = int(done)
    print(f"kernel.jax timeout=0.3: {elapsed:.3f} s, {done} steps")
    assert 0 < done < 10 ** 9 and 0.3 <= elapsed < 1.5
    # exactly the state after 'done' steps (a closed form), every element
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, done))
    # seed= reaches the kernel: the draws of an independent Philox for that seed
    import test_random as R
    n, steps = 5000, 3
    call = dict(R._random_call(rng), koff=int(rng.integers(0, 1 << 30)), sub=int(rng.integers(1, 1 << 31)))
    a, b = R.DRAWS.jax(call["start"], call["koff"], call["sub"], jnp.zeros((steps, n), jnp.float32),
                       jnp.zeros((steps, n, 2), jnp.float32), steps=steps, start=call["start"], seed=call["seed"])
    ref_u, ref_z = R.reference_draws(n=n, steps=steps, **call)
    np.testing.assert_array_equal(np.asarray(a), ref_u.astype(np.float32))
    np.testing.assert_allclose(np.asarray(b), ref_z.astype(np.float32), rtol=1e-6, atol=1e-7)


def test_repeated_traces_reuse_one_cached_call(rng, monkeypatch, tmp_path):
    """A signature is built once (kernel load, occupancy query, custom call): new jitted
    functions with the same shapes and eager calls reuse it, and every result is right."""
    from loopkern import compile as lk_compile
    from loopkern.dispatch import config as lk_config
    from loopkern.dispatch import dispatcher as lk_dispatcher
    from loopkern.interop import jax_bridge

    # an empty disk cache: the cubin is Numba's (load_for_ffi), not one an earlier test stored
    monkeypatch.setenv("LOOPKERN_CACHE_DIR", str(tmp_path))

    entries = jax_bridge.call_cache(HEAT)
    entries.clear()
    counts = dict(build=0, load=0, occupancy=0)

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(jax_bridge, "_build", counting("build", jax_bridge._build))
    monkeypatch.setattr(lk_compile.CompiledKernel, "load_for_ffi",
                        counting("load", lk_compile.CompiledKernel.load_for_ffi))
    monkeypatch.setattr(lk_config, "cuda_config", counting("occupancy", lk_config.cuda_config))
    # (64K heat runs in tile mode under scope="auto": its grid comes from tile_config)
    monkeypatch.setattr(lk_dispatcher, "tile_config", counting("occupancy", lk_dispatcher.tile_config))

    n = 1 << 16
    for _ in range(3):
        u0 = rng.random(n).astype(np.float32)
        steps = int(rng.integers(10, 300))
        ref = W.heat_ref(u0, steps, 0.25)
        f = jax.jit(lambda u, s: HEAT.jax(u, u, np.float32(0.25), steps=s)[0])     # a new function each time
        assert rel_err(f(jnp.asarray(u0), steps), ref) < 1e-5
        g = jax.jit(lambda u, v: HEAT.jax(u, v, np.float32(0.25), steps=steps), donate_argnums=(0, 1))
        assert rel_err(g(jnp.asarray(u0), jnp.asarray(u0))[0], ref) < 1e-5
        u, _ = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), np.float32(0.25), steps=steps)   # eager
        assert rel_err(u, ref) < 1e-5
    assert counts == dict(build=1, load=1, occupancy=1)
    assert len(entries) == 1
    (key,) = entries.keys()
    assert entries.get(key).eager._cache_size() == 1          # eager calls: one trace, then dispatch only

    # another shape or block count: one more entry each; the first one is still used
    a0 = rng.integers(-10 ** 6, 10 ** 6, n // 2).astype(np.int32)
    for blocks in (3, 3, 5):
        f = jax.jit(lambda u, s: SHIFT.jax(u, u, steps=s, scope="grid", blocks=blocks)[0])
        steps = int(rng.integers(1, 200))
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(a0), steps)), refs.shift_ref(a0, steps))
    assert counts["build"] == 3
    for m in (n // 4, n, n // 4):
        u0 = rng.random(m).astype(np.float32)
        u, _ = HEAT.jax(jnp.asarray(u0), jnp.asarray(u0), np.float32(0.25), steps=31)
        assert rel_err(u, W.heat_ref(u0, 31, 0.25)) < 1e-5
    assert counts["build"] == 4 and len(entries) == 2


def test_a_new_kernel_is_compiled_and_linked_once(rng, monkeypatch, tmp_path):
    """kernel.jax registers the cubin Numba linked when it bound the kernel: NVVM and the
    linker run once for a new kernel, not again for the FFI shim's image."""
    from numba.cuda.cudadrv import driver, nvvm

    monkeypatch.setenv("LOOPKERN_CACHE_DIR", str(tmp_path))
    counts = dict(nvvm=0, link=0)
    compile_ir, linker = nvvm.compile_ir, driver._Linker

    def counted_compile(*a, **k):
        counts["nvvm"] += 1
        return compile_ir(*a, **k)

    def counted_linker(*a, **k):
        counts["link"] += 1
        return linker(*a, **k)
    monkeypatch.setattr(nvvm, "compile_ir", counted_compile)
    monkeypatch.setattr(driver, "_Linker", counted_linker)

    def scaled(t, u, v, a):         # a step no other test compiles
        n = u.shape[0]
        for i in lk.range(n):
            v[i] = a * u[i] + np.float32(0.125) * t
    k = lk.megakernel(scaled, swap=[("u", "v")])
    u0 = rng.random(5000).astype(np.float32)
    u, _ = k.jax(jnp.asarray(u0), jnp.asarray(u0), np.float32(0.5), steps=3, scope="grid")
    ref = u0.astype(np.float64)
    for t in range(3):
        ref = 0.5 * ref + 0.125 * t
    np.testing.assert_allclose(np.asarray(u), ref, rtol=1e-6)
    assert counts == dict(nvvm=1, link=1)


def test_timeout_entry_reused_across_traces(rng):
    """timeout= is part of the signature: each jitted function with it reports the steps done,
    and the state is exactly that of the reported step count."""
    from loopkern.interop import jax_bridge
    entries = jax_bridge.call_cache(SHIFT)
    entries.clear()
    a0 = rng.integers(-10 ** 6, 10 ** 6, 1 << 14).astype(np.int32)
    for _ in range(2):
        f = jax.jit(lambda u, v: SHIFT.jax(u, v, steps=10 ** 9, timeout=0.1))
        u, v, done = f(jnp.asarray(a0), jnp.asarray(a0))
        done = int(done)
        assert 0 < done < 10 ** 9
        np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, done))
    u, v, done = SHIFT.jax(jnp.asarray(a0), jnp.asarray(a0), steps=1000, timeout=30.0)    # eager, finishes
    assert int(done) == 1000
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, 1000))
    assert len(entries) == 2


# ------------------------------------------------------------------------------ fresh state every call
# The control block (timeout in, steps out) and the grid barrier's counter are plain results of
# the custom call, in memory XLA hands out uninitialised; the handler zeroes them and writes the
# timeout on XLA's stream before each launch. Between the calls below, freed device memory is
# left holding patterns that would break a call that skipped that: a nonzero stop request
# (REQUEST), a tiny timeout, a counter with its low bits set (an early barrier release).
POISON = (0x7FFFFFFF, 0x00000005, 0xFFFFFFFF, 0x80000001)


_FILLS = []


def _poison(k):
    """Leave freed device memory of several sizes (large and small allocations come from
    different pools) holding the k-th pattern."""
    if not _FILLS:
        _FILLS.extend(jax.jit(lambda q, m=m: jnp.full((m,), q, jnp.uint32) ^ jnp.uint32(0))
                      for m in (64, 1024, 1 << 14, 1 << 20))
    xs = [fill(jnp.uint32(POISON[k % len(POISON)])) for fill in _FILLS]
    jax.block_until_ready(xs)
    del xs


def test_repeated_jit_calls_grid_scope_many_blocks(rng):
    """Grid scope at 1<<20 elements (all the co-resident blocks), many jitted calls in a row:
    every result exact (integer shift, closed form) or against float64 NumPy (heat), and
    bitwise the same call after call."""
    n = 1 << 20
    a0 = rng.integers(-10 ** 6, 10 ** 6, n).astype(np.int32)
    f = jax.jit(lambda u, v, s: SHIFT.jax(u, v, steps=s, scope="grid"))
    for k in range(24):
        _poison(k)
        steps = (1, 2, 3, 50, 201)[k % 5]
        u, v = f(jnp.asarray(a0), jnp.asarray(a0), steps)
        np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, steps), err_msg=f"call {k}")
        np.testing.assert_array_equal(np.asarray(v), refs.shift_ref(a0, steps - 1), err_msg=f"call {k}")
    u0 = rng.random(n).astype(np.float32)
    ref = W.heat_ref(u0, 40, 0.25)
    g = jax.jit(lambda u, v: HEAT.jax(u, v, np.float32(0.25), steps=40, scope="grid")[0])
    first = None
    for k in range(12):
        _poison(k)
        out = np.asarray(g(jnp.asarray(u0), jnp.asarray(u0)))
        assert rel_err(out, ref) < 1e-5, f"call {k}"
        if first is None:
            first = out
        np.testing.assert_array_equal(out, first, err_msg=f"call {k}")


def test_repeated_jit_calls_with_timeout(rng):
    """timeout= inside jit, call after call: a timeout that is not reached reports exactly the
    steps asked for; one that is reports the steps done, and the state is that of exactly that
    many steps; a timeout over 2**32 ns (both words of the slot) is honoured too."""
    import time
    n = 1 << 20
    a0 = rng.integers(-10 ** 6, 10 ** 6, n).astype(np.int32)
    f = jax.jit(lambda u, v, s: SHIFT.jax(u, v, steps=s, timeout=30.0, scope="grid"))
    for k in range(12):
        _poison(k)
        steps = (1, 7, 120)[k % 3]
        u, _, done = f(jnp.asarray(a0), jnp.asarray(a0), steps)
        assert done.dtype == jnp.int32 and done.shape == () and int(done) == steps, f"call {k}"
        np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, steps), err_msg=f"call {k}")
    g = jax.jit(lambda u, v: SHIFT.jax(u, v, steps=10 ** 9, timeout=0.05, scope="grid"))
    jax.block_until_ready(g(jnp.asarray(a0), jnp.asarray(a0)))        # compile
    for k in range(4):
        _poison(k)
        t0 = time.perf_counter()
        u, _, done = jax.block_until_ready(g(jnp.asarray(a0), jnp.asarray(a0)))
        elapsed = time.perf_counter() - t0
        done = int(done)
        assert 0 < done < 10 ** 9 and 0.05 <= elapsed < 1.0, (k, done, elapsed)
        np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(a0, done), err_msg=f"call {k}")
    # the heat stencil against the float64 closed form after the steps done
    u0 = rng.random(1 << 16).astype(np.float32)
    h = jax.jit(lambda u, v: HEAT.jax(u, v, np.float32(0.2), steps=10 ** 9, timeout=0.05))
    for k in range(3):
        _poison(k)
        u, _, done = h(jnp.asarray(u0), jnp.asarray(u0))
        done = int(done)
        assert 0 < done < 10 ** 9
        np.testing.assert_allclose(np.asarray(u), refs.heat_exact(u0, done, 0.2), rtol=1e-2, atol=1e-4)
    # 4.5 s = 2**32 ns + 205 ms: a lost high word would stop the run after 0.2 s
    b0 = a0[:1 << 14]
    g = jax.jit(lambda u, v, s: SHIFT.jax(u, v, steps=s, timeout=4.5))
    assert int(g(jnp.asarray(b0), jnp.asarray(b0), 3)[2]) == 3          # compile
    _poison(0)
    t0 = time.perf_counter()
    u, _, done = jax.block_until_ready(g(jnp.asarray(b0), jnp.asarray(b0), 10 ** 9))
    elapsed = time.perf_counter() - t0
    done = int(done)
    assert 0 < done < 10 ** 9 and 4.5 <= elapsed < 8.0, (done, elapsed)
    np.testing.assert_array_equal(np.asarray(u), refs.shift_ref(b0, done))


def test_repeated_jit_calls_condition_step(rng):
    """A step that returns a condition (a grid-wide max reduction, through the barrier), at
    grid scope, call after call: the step count and state match the same kernel launched
    directly, and the float64 reference closely; a run cut short by max_steps reports it."""
    g0 = rng.random((96, 96)).astype(np.float32)
    tol = np.float32(1e-3)
    du, dv = g0.copy(), g0.copy()
    run = JACOBI(du, dv, tol, max_steps=20000, backend="cuda", scope="grid")
    ref, ref_steps = W.jacobi_ref(g0, float(tol), 20000)
    assert abs(run.steps - ref_steps) <= max(2, 0.01 * ref_steps)
    f = jax.jit(lambda a, b: JACOBI.jax(a, b, tol, max_steps=20000, scope="grid"))
    for k in range(10):
        _poison(k)
        u, _, steps = f(jnp.asarray(g0), jnp.asarray(g0))
        assert steps.dtype == jnp.int32 and int(steps) == run.steps, (k, int(steps), run.steps)
        np.testing.assert_array_equal(np.asarray(u), du, err_msg=f"call {k}")
        assert rel_err(u, ref) < 1e-3
    short = jax.jit(lambda a, b: JACOBI.jax(a, b, tol, max_steps=7, scope="grid"))
    ref7, _ = W.jacobi_ref(g0, float(tol), 7)
    for k in range(4):
        _poison(k)
        u, _, steps = short(jnp.asarray(g0), jnp.asarray(g0))
        assert int(steps) == 7
        assert rel_err(u, ref7) < 1e-5


# ------------------------------------------------------------------------------ several devices
# The custom call names its kernel by the id of a registered cubin, and the handler loads it
# into the context of the stream XLA hands it, once per device (ffi_shim.c): so the same call
# runs on any GPU, and inside jax.shard_map on every device of the mesh. Each shard below is an
# independent rod with fixed ends, compared with the NumPy run of its block alone.
def _sharded_heat(mesh, steps, scope):
    from jax.sharding import PartitionSpec as P
    return jax.jit(jax.shard_map(lambda u, v: HEAT.jax(u, v, 0.25, steps=steps, scope=scope), mesh=mesh,
                                 in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))


def _check_blocks(u, u0, shards, steps):
    out, n = np.asarray(u), len(u0) // shards
    for b in range(shards):
        block = slice(b * n, (b + 1) * n)
        assert rel_err(out[block], W.heat_ref(u0[block], steps, 0.25)) < 1e-5, f"shard {b}"


@pytest.mark.parametrize("scope", [None, "grid"])
def test_kernel_jax_inside_shard_map_on_a_one_device_mesh(scope, rng):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((1,), ("x",))
    u0 = rng.random(1 << 14).astype(np.float32)
    x = jax.device_put(jnp.asarray(u0), NamedSharding(mesh, P("x")))    # JAX 0.10: the inputs carry it
    f = _sharded_heat(mesh, 50, scope)
    u, _ = f(x, x)
    _check_blocks(u, u0, 1, 50)
    np.testing.assert_array_equal(np.asarray(f(x, x)[0]), np.asarray(u))


@pytest.mark.parametrize("scope", [None, "grid"])
def test_one_compiled_call_on_every_gpu(scope, rng):
    """One jitted function and one kernel.jax entry (built on Numba's current device, device 0),
    run on each visible GPU in turn, jitted and eager: on every other device the handler loads
    the kernel there at the first launch. With one GPU this checks the same path once."""
    from loopkern.interop import jax_bridge
    jax_bridge.call_cache(HEAT).clear()
    steps = 50
    f = jax.jit(lambda u, v: HEAT.jax(u, v, 0.25, steps=steps, scope=scope))
    for d in jax.devices("gpu"):
        u0 = rng.random(1 << 14).astype(np.float32)
        x = jax.device_put(jnp.asarray(u0), d)
        u, _ = f(x, x)
        assert u.devices() == {d}
        _check_blocks(u, u0, 1, steps)
        u2, _ = HEAT.jax(x, x, 0.25, steps=steps, scope=scope)          # eager
        assert u2.devices() == {d}
        np.testing.assert_array_equal(np.asarray(u2), np.asarray(u))
    assert len(jax_bridge.call_cache(HEAT)) == 1       # not an entry per device


@pytest.mark.multi_gpu
@pytest.mark.parametrize("scope", [None, "grid"])
def test_kernel_jax_inside_shard_map_on_several_gpus(scope, rng):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    gpus = len(jax.devices("gpu"))
    if gpus < 2:
        pytest.skip(f"needs at least 2 GPUs (this machine has {gpus})")
    for shards in sorted({2, gpus}):
        mesh = jax.make_mesh((shards,), ("x",))
        u0 = rng.random(shards << 14).astype(np.float32)
        x = jax.device_put(jnp.asarray(u0), NamedSharding(mesh, P("x")))
        u, _ = _sharded_heat(mesh, 50, scope)(x, x)
        assert set(u.devices()) == set(mesh.devices.flat)
        _check_blocks(u, u0, shards, 50)


def _staged_entries(k):
    from loopkern.interop import jax_bridge
    return [e for e in jax_bridge.call_cache(k).values() if e.config is not None and e.config.shared > 0]


@pytest.mark.parametrize("n", [100, 4096])
def test_block_scope_holds_its_arrays_in_shared_memory_under_jit(n, rng):
    """At block scope kernel.jax stages the swap pairs in shared memory, as the direct call
    does (the handler passes the dynamic shared memory): odd and even step counts, donated or
    not, in jit and eager, against the float64 reference and the direct call."""
    from numba import cuda
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    f = jax.jit(lambda u, v, s: k.jax(u, v, np.float32(0.3), steps=s, scope="block"))
    g = jax.jit(lambda u, v: k.jax(u, v, np.float32(0.3), steps=8, scope="block"), donate_argnums=(0, 1))
    for steps in (1, 2, 7, int(rng.integers(50, 400))):
        u0, w0 = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
        u, v = f(jnp.asarray(u0), jnp.asarray(w0), steps)
        ref_u = W.heat_ref(u0, steps, 0.3)
        assert rel_err(u, ref_u) < 1e-5
        # v holds the state one step earlier (the pair swaps every step)
        assert rel_err(v, W.heat_ref(u0, steps - 1, 0.3)) < 1e-5
        du, dv = cuda.to_device(u0), cuda.to_device(w0)
        k(du, dv, np.float32(0.3), steps=steps, scope="block")
        np.testing.assert_array_equal(np.asarray(u), du.copy_to_host())
    assert _staged_entries(k), "no kernel.jax call at block scope staged its arrays"
    # a short run of a static step count is not staged (jax_bridge.STAGE_MIN_STEPS), and is right
    from loopkern.interop import jax_bridge
    assert 8 < jax_bridge.STAGE_MIN_STEPS
    u0 = rng.random(n).astype(np.float32)
    u, _ = g(jnp.asarray(u0), jnp.asarray(u0))
    assert rel_err(u, W.heat_ref(u0, 8, 0.3)) < 1e-5
    shared = sorted(e.config.shared for e in jax_bridge.call_cache(k).values())
    assert shared[0] == 0 and shared[-1] > 0, shared


def test_staged_jacobi_with_a_reduction_stops_where_the_reference_does(rng):
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = np.zeros((64, 64), np.float32)
    u0[0, :] = 1.0
    u0[:, 0] = rng.random(64).astype(np.float32)
    tol = 1e-3
    _, ref_steps = W.jacobi_ref(u0, tol, 20000)
    f = jax.jit(lambda a, b: k.jax(a, b, np.float32(tol), max_steps=20000, scope="block"))
    u, v, steps = f(jnp.asarray(u0), jnp.asarray(u0))
    assert abs(int(steps) - ref_steps) <= 1
    ref, _ = W.jacobi_ref(u0, tol, int(steps))
    np.testing.assert_allclose(np.asarray(u), ref, rtol=1e-4, atol=1e-5)
    assert _staged_entries(k)


_CHILD = """
import sys, json
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, {tests!r})
import loopkern as lk, workloads as W
k = lk.megakernel(W.heat_step, swap=[("u", "v")])
u0 = np.random.default_rng(3).random({n}).astype(np.float32)
u, v = jax.jit(lambda a, b: k.jax(a, b, np.float32(0.25), steps=77, scope={scope!r}))(jnp.asarray(u0),
                                                                                   jnp.asarray(u0))
ref = W.heat_ref(u0, 77, 0.25)
err = float(np.linalg.norm(np.asarray(u, np.float64) - ref) / np.linalg.norm(ref))
print(json.dumps(dict(err=err, numba="numba" in sys.modules)))
"""


@pytest.mark.parametrize("n,scope", [(4096, "block"), (1 << 16, "grid"), (4096, "auto"), (1 << 16, "tile")])
def test_a_new_process_launches_a_cached_cubin_without_numba(n, scope, tmp_path):
    """The first process compiles with Numba and stores the cubin; a second one with the same
    cache directory registers it with the FFI shim without importing Numba at all (block scope
    with staged arrays at 4K, a cooperative grid at 64K, tile mode's rounds of steps with their
    dynamic shared memory and halo scratch at both), with the same result."""
    import json
    import os
    import subprocess
    import sys
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, LOOPKERN_CACHE_DIR=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _CHILD.format(tests=tests, n=n, scope=scope)], env=env,
                           capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert runs[0]["numba"] and not runs[1]["numba"], runs
    assert runs[0]["err"] < 1e-5 and runs[1]["err"] == runs[0]["err"], runs
    assert list(tmp_path.rglob("*.cubin")), "no cubin was stored"


@pytest.mark.parametrize("n,blocks", [(4096, None), (4099, 5), (1 << 16, None), (100003, 13), (1 << 20, None)])
def test_tile_mode_under_jit_equals_the_direct_call_bit_for_bit(n, blocks, rng):
    """kernel.jax runs tile mode's kernels (several steps per halo exchange, the tiles in
    dynamic shared memory, the halo scratch a result of the custom call): bit for bit the
    direct call's tile mode and the grid scope, within rounding of the float64 reference, for
    odd and even step counts, counts that end inside a round, traced step counts and starts,
    donated or not, fields that do not divide into tiles."""
    from numba import cuda
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    f = jax.jit(lambda u, v, s: k.jax(u, v, np.float32(0.3), steps=s, scope="tile", blocks=blocks))
    g = jax.jit(lambda u, v: k.jax(u, v, np.float32(0.3), steps=45, scope="tile", blocks=blocks),
                donate_argnums=(0, 1))
    for steps in (1, 2, 31, 33, int(rng.integers(200, 900))):
        u0, w0 = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
        u, v = f(jnp.asarray(u0), jnp.asarray(w0), steps)
        assert rel_err(u, W.heat_ref(u0, steps, 0.3)) < 1e-5
        du, dv = cuda.to_device(u0), cuda.to_device(w0)
        run = k(du, dv, np.float32(0.3), steps=steps, scope="tile", blocks=blocks)
        assert run.scope == "tile"
        np.testing.assert_array_equal(np.asarray(u), du.copy_to_host())
        np.testing.assert_array_equal(np.asarray(v), dv.copy_to_host())
        gu, gv = cuda.to_device(u0), cuda.to_device(w0)
        k(gu, gv, np.float32(0.3), steps=steps, scope="grid")
        np.testing.assert_array_equal(np.asarray(u), gu.copy_to_host())
    u0 = rng.random(n).astype(np.float32)
    u, _ = g(jnp.asarray(u0), jnp.asarray(u0))
    assert rel_err(u, W.heat_ref(u0, 45, 0.3)) < 1e-5
    entries = list(jax_bridge_calls(k))
    assert entries and all(e.config.scope == "tile" and e.config.shared > 0 for e in entries)
    assert any(e.config.depth > 1 for e in entries)


def jax_bridge_calls(k):
    from loopkern.interop import jax_bridge
    return jax_bridge.call_cache(k).values()


def test_tile_mode_under_jit_continues_from_a_traced_start_and_stops_at_a_timeout(rng):
    """start= continues a run split into calls exactly (lk.random's draws and t follow the
    start), and a timeout inside jit stops tile mode at a round's end with the steps done
    returned: the state is exactly that many steps."""
    def noisy(t, u, v, a):
        n = u.shape[0]
        for i in lk.range(1, n - 1):
            v[i] = u[i] + a * (u[i - 1] - 2 * u[i] + u[i + 1]) + 1e-3 * lk.random.uniform(i)
    k = lk.megakernel(noisy, swap=[("u", "v")])
    n = 1 << 16
    u0 = rng.random(n).astype(np.float32)
    f = jax.jit(lambda u, v, s, t0: k.jax(u, v, np.float32(0.2), steps=s, start=t0, scope="tile", seed=5))
    whole = f(jnp.asarray(u0), jnp.asarray(u0), 300, 0)
    part = f(jnp.asarray(u0), jnp.asarray(u0), 113, 0)
    split = f(part[0], part[1], 187, 113)
    np.testing.assert_array_equal(np.asarray(split[0]), np.asarray(whole[0]))
    from numba import cuda
    du, dv = cuda.to_device(u0), cuda.to_device(u0)
    k(du, dv, np.float32(0.2), steps=300, scope="tile", seed=5)
    np.testing.assert_array_equal(np.asarray(whole[0]), du.copy_to_host())
    # a timeout: the steps done come back with the state of exactly that many steps
    h = jax.jit(lambda u, v: k.jax(u, v, np.float32(0.2), max_steps=10 ** 9, scope="tile", seed=5, timeout=0.05))
    u, v, done = h(jnp.asarray(u0), jnp.asarray(u0))
    done = int(done)
    assert 0 < done < 10 ** 9
    du, dv = cuda.to_device(u0), cuda.to_device(u0)
    k(du, dv, np.float32(0.2), steps=done, scope="tile", seed=5)
    np.testing.assert_array_equal(np.asarray(u), du.copy_to_host())
