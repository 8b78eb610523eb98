"""Bad calls raise a clear LoopkernError naming the argument, before anything is launched or
written; the inputs stay untouched."""

import re

import numpy as np
import pytest

import loopkern as lk
import workloads as W

BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="sim", marks=pytest.mark.sim)]


@pytest.fixture
def heat():
    return lk.megakernel(W.heat_step, swap=[("u", "v")])


def arrays(rng, n=32, dtype=np.float32):
    u = rng.random(n).astype(dtype)
    return u, u.copy(), u.copy()   # u, v, pristine copy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call,fragment", [
    (lambda k, u, v: k(u, v, steps=3), "missing a required argument: 'alpha'"),
    (lambda k, u, v: k(u, v, 0.25, 1.0, steps=3), "too many positional arguments"),
    (lambda k, u, v: k(u, v, alpah=0.25, steps=3), "unexpected keyword argument 'alpah' (did you mean 'alpha'?)"),
    (lambda k, u, v: k(u, v, beta=0.25, steps=3), "unexpected keyword argument 'beta'; the step takes"),
    (lambda k, u, v: k(u, v, 0.25), "pass steps=N"),
    (lambda k, u, v: k(u, v, 0.25, steps=3, max_steps=4), "either steps= or max_steps="),
    (lambda k, u, v: k(u, v, 0.25, steps=-1), "steps=-1: must be >= 0"),
    (lambda k, u, v: k(u, v, 0.25, steps=2.5), "steps=2.5: expected an integer"),
    (lambda k, u, v: k(u, v, 0.25, steps=True), "steps=True: expected an integer"),
    (lambda k, u, v: k(u, 3.0, 0.25, steps=3), "argument 'v': the step indexes it as an array"),
    (lambda k, u, v: k(u, v, u, steps=3), "argument 'alpha': the step uses it as a number"),
    (lambda k, u, v: k(u, v, "0.25", steps=3), "argument 'alpha': expected an array or a number, got str"),
    (lambda k, u, v: k(u, v, 1j, steps=3), "argument 'alpha': complex numbers are not supported"),
    (lambda k, u, v: k(u.astype(object), v, 0.25, steps=3), "argument 'u': array has dtype object"),
    (lambda k, u, v: k(u.astype(np.complex64), v.astype(np.complex64), 0.25, steps=3), "complex numbers"),
    (lambda k, u, v: k(u.astype(np.float16), v.astype(np.float16), 0.25, steps=3), "dtype float16"),
    (lambda k, u, v: k(u, v.astype(np.float64), 0.25, steps=3), "same shape and dtype"),
    (lambda k, u, v: k(u, v[:-1], 0.25, steps=3), "same shape and dtype"),
    (lambda k, u, v: k(u, u, 0.25, steps=3), "share memory"),
    (lambda k, u, v: k(u[:20], u[10:30], 0.25, steps=3), "share memory"),
    (lambda k, u, v: k(u, v, 0.25, steps=3, backend="gpu"), "backend='gpu'"),
    (lambda k, u, v: k(u, v, 0.25, steps=3, scope="warp"), "scope='warp'"),
    (lambda k, u, v: k(np.float32(1.0), v, 0.25, steps=3), "argument 'u': the step indexes it as an array"),
    (lambda k, u, v: k(np.array(1.0, np.float32), v, 0.25, steps=3), "0-d array"),
    (lambda k, u, v: k(u, v, 0.25, steps=3, threads=0), "threads=0: must be >= 1"),
    (lambda k, u, v: k(u, v, 2 ** 70, steps=3), "does not fit in int64"),
])
def test_bad_call_is_rejected_before_anything_runs(heat, rng, backend, call, fragment):
    u, v, pristine = arrays(rng)
    v_before = v.copy()
    with pytest.raises(lk.ArgumentError) as info:
        call(lambda *a, **kw: heat(*a, backend=kw.pop("backend", backend), **kw), u, v)
    assert fragment in str(info.value)
    np.testing.assert_array_equal(u, pristine)
    np.testing.assert_array_equal(v, v_before)


def test_argument_errors_are_loopkern_and_type_errors():
    assert issubclass(lk.ArgumentError, lk.LoopkernError)
    assert issubclass(lk.ArgumentError, TypeError)


def test_keyword_arguments_bind_by_name(heat, rng):
    u, v, pristine = arrays(rng, 50, np.float64)
    run = heat(alpha=0.25, v=v, u=u, steps=5, backend="cpu")
    assert run.steps == 5
    np.testing.assert_allclose(u, W.heat_ref(pristine, 5, 0.25), rtol=1e-12)


def test_jax_array_points_to_kernel_jax(heat):
    class FakeJax:   # what matters is the module JAX arrays come from
        __module__ = "jaxlib.xla_extension"
    with pytest.raises(lk.ArgumentError, match="JAX arrays are immutable") as info:
        heat(FakeJax(), FakeJax(), 0.25, steps=1, backend="cpu")
    assert "call kernel.jax(...) instead" in str(info.value) and "planned" not in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_list_suggests_np_asarray(heat, rng, backend):
    u, v, pristine = arrays(rng)
    with pytest.raises(lk.ArgumentError) as info:
        heat(u, [0.0] * 32, 0.25, steps=1, backend=backend)
    assert "argument 'v': got a Python list" in str(info.value) and "np.asarray(v)" in str(info.value)
    np.testing.assert_array_equal(u, pristine)


def test_gpu_array_on_cpu_backend(heat, rng):
    class FakeDevice:
        def __init__(self, a, ptr):
            self.__cuda_array_interface__ = dict(shape=a.shape, typestr=a.dtype.str, data=(ptr, False),
                                                 strides=None, version=3)
    u, v, _ = arrays(rng)
    with pytest.raises(lk.ArgumentError, match="argument 'u' is on the GPU, but backend='cpu'"):
        heat(FakeDevice(u, 1 << 30), FakeDevice(v, 1 << 31), 0.25, steps=1, backend="cpu")


def test_swap_pairs_must_have_same_layout_on_cpu(rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u = rng.random(40)
    v = rng.random(80)[::2]
    with pytest.raises(lk.ArgumentError) as info:
        k(u, v, 0.25, steps=2, backend="cpu")
    msg = str(info.value)
    # NumPy's words, not Numba's type names such as array(float64, 1d, A)
    assert "same memory layout" in msg and "'u': float64, 1-D, C-contiguous" in msg
    assert "'v': float64, 1-D, non-contiguous (strides (16,))" in msg and "array(" not in msg


@pytest.mark.sim
def test_simulator_one_block_only(heat, rng):
    u, v, pristine = arrays(rng)
    with pytest.raises(lk.LaunchError, match="one cooperative block"):
        heat(u, v, 0.25, steps=3, backend="cuda", scope="grid", blocks=2)
    np.testing.assert_array_equal(u, pristine)


@pytest.mark.sim
@pytest.mark.parametrize("threads,fragment", [(48, "multiple of 32"), (2048, "multiple of 32 between")])
def test_bad_threads(heat, rng, threads, fragment):
    u, v, pristine = arrays(rng)
    with pytest.raises(lk.LaunchError, match=fragment):
        heat(u, v, 0.25, steps=3, backend="cuda", threads=threads)
    np.testing.assert_array_equal(u, pristine)


@pytest.mark.sim
def test_block_scope_is_one_block(heat, rng):
    u, v, _ = arrays(rng)
    with pytest.raises(lk.LaunchError, match="exactly one block"):
        heat(u, v, 0.25, steps=3, backend="cuda", scope="block", blocks=4)


def test_cuda_backend_without_gpu_is_clear(monkeypatch, heat, rng):
    from loopkern.dispatch import config as launch
    monkeypatch.setattr(launch, "cuda_usable", lambda: False)
    u, v, pristine = arrays(rng)
    with pytest.raises(lk.BackendError, match="no usable CUDA GPU"):
        heat(u, v, 0.25, steps=2, backend="cuda")
    np.testing.assert_array_equal(u, pristine)
    assert launch.choose_backend("auto") == "cpu"


def test_decorator_options_are_checked():
    with pytest.raises(lk.ArgumentError, match="backend='tpu'"):
        lk.megakernel(W.heat_step, backend="tpu")
    with pytest.raises(lk.ArgumentError, match="threads=-3"):
        lk.megakernel(W.heat_step, threads=-3)


@pytest.mark.sim
def test_simulator_device_arrays_in_place(heat, rng):
    from numba import cuda
    u0 = rng.random(48).astype(np.float32)
    du, dv = cuda.to_device(u0), cuda.to_device(u0)
    heat(du, dv, 0.25, steps=3, backend="cuda")
    np.testing.assert_allclose(du.copy_to_host(), W.heat_ref(u0, 3, 0.25), rtol=1e-5)


def test_auto_block_count_follows_problem_size():
    from loopkern.dispatch.config import auto_blocks
    sms, limit = 132, 660
    assert auto_blocks(4096, 256, limit, sms) == 16
    assert auto_blocks(1000, 256, limit, sms) == 4
    assert auto_blocks(16384, 256, limit, sms) == 64
    assert auto_blocks(65536, 256, limit, sms) == 132
    assert auto_blocks(100_000, 256, limit, sms) == 264
    assert auto_blocks(1 << 20, 256, limit, sms) == 264
    assert auto_blocks(1 << 24, 256, limit, sms) == 660
    assert auto_blocks(1, 256, limit, sms) == 1
    assert auto_blocks(1 << 24, 256, 100, sms) == 100     # never more than can be resident


def test_auto_scope_and_block_threads_follow_problem_size():
    from loopkern.dispatch.config import AUTO_BLOCK_SCOPE_MAX_ELEMENTS, cuda_config, resolve_scope

    class Kernel:       # what cuda_config asks of a compiled kernel in block scope
        max_threads_per_block = 1024
    assert resolve_scope("auto", 4096) == "block" and resolve_scope("auto", AUTO_BLOCK_SCOPE_MAX_ELEMENTS) == "block"
    assert resolve_scope("auto", AUTO_BLOCK_SCOPE_MAX_ELEMENTS + 1) == "grid"
    assert resolve_scope("auto", 10, parallel=False) == "thread" and resolve_scope("grid", 10) == "grid"
    threads = {n: cuda_config(Kernel(), "block", n, None, None, simulator=False).threads
               for n in (1, 300, 4096, 8192, 1 << 20)}
    assert threads == {1: 32, 300: 64, 4096: 512, 8192: 1024, 1 << 20: 1024}
    Kernel.max_threads_per_block = 896            # many registers: fewer threads fit
    assert cuda_config(Kernel(), "block", 1 << 20, None, None, simulator=False).threads == 896


def all_pairs_step(t, x, f):
    # every element sums over all the others: heavy work per element
    for i in lk.range(x.shape[0]):
        s = 0.0
        for j in range(x.shape[0]):
            s += x[j] - x[i]
        f[i] = s


def pair_sum(x, i):
    s = 0.0
    for j in range(x.shape[0]):
        s += x[j] - x[i]
    return s


def twice_pair_sum(x, i):
    return 2.0 * pair_sum(x, i)


def looping_helper_step(t, x, f):
    # the same all-pairs work, in a helper called through another helper
    for i in lk.range(x.shape[0]):
        f[i] = twice_pair_sum(x, i)


def test_auto_scope_keeps_heavy_steps_on_a_grid():
    from loopkern.dispatch.config import resolve_scope
    # a helper without loops (W.helper_step's damp and laplacian) is as light as its body
    # written in place; one that loops, directly or through another helper, is not
    light = {name: lk.megakernel(fn).spec.light_elements
             for name, fn in (("heat", W.heat_step), ("jacobi", W.jacobi_step), ("life", W.life_step),
                              ("helper", W.helper_step), ("nbody", all_pairs_step),
                              ("looping_helper", looping_helper_step))}
    assert light == dict(heat=True, jacobi=True, life=False, helper=True, nbody=False, looping_helper=False)
    assert resolve_scope("auto", 3072, True, light["nbody"]) == "grid"
    assert resolve_scope("auto", 3072, True, light["heat"]) == "block"


def test_host_dlpack_only_array_is_imported(heat, rng):
    from doubles import DLPackOnly
    u0 = rng.random(40)
    u, v = u0.copy(), u0.copy()
    heat(DLPackOnly(u), DLPackOnly(v), 0.25, steps=3, backend="cpu")
    np.testing.assert_allclose(u, W.heat_ref(u0, 3, 0.25), rtol=1e-12)   # updated in place


def two_d_step(t, g, out):
    for i, j in lk.grid(g.shape[0], g.shape[1]):
        out[i, j] = g[i, j] * 2.0


def writes_through_helper(a, i):
    a[i] = 1.0


def helper_writer_step(t, src, dst):
    for i in lk.range(src.shape[0]):
        writes_through_helper(dst, i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_too_few_dimensions_is_named(rng, backend):
    k = lk.megakernel(two_d_step)
    with pytest.raises(lk.ArgumentError, match=r"argument 'g': the step indexes it with 2 indices .*got a 1-D"):
        k(rng.random(6), np.zeros((2, 3)), steps=1, backend=backend)


def reads_a_second_extent(t, a, b):
    n = a.shape[1]
    for i in lk.range(b.shape[0]):
        b[i] = n


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shape_the_array_lacks_is_named(rng, backend):
    """a.shape[1] of a 1-D array: an ArgumentError naming it, before anything runs (it was
    Numba's 'tuple index out of range' at compile time)."""
    k = lk.megakernel(reads_a_second_extent)
    b = np.zeros(3)
    with pytest.raises(lk.ArgumentError, match=r"argument 'a': the step reads a.shape\[1\] .*got a 1-D"):
        k(rng.random(6), b, steps=1, backend=backend)
    assert not b.any()
    k(np.ones((2, 5)), b, steps=1, backend=backend)
    np.testing.assert_array_equal(b, 5.0)


def one_index_step(t, u, v):
    for i in lk.range(u.shape[0]):
        v[i] = u[i] + 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_too_many_dimensions_is_named_before_anything_is_written(rng, backend):
    """An array with more dimensions than an element access gives it would make that access a
    row (a store filled whole rows, silently)."""
    k = lk.megakernel(one_index_step)
    u1, v1 = rng.random(3), np.zeros(3)
    for u, v, name in ((rng.random((3, 2)), np.zeros(3), "u"), (u1, np.zeros((3, 2)), "v")):
        before = v.copy()
        with pytest.raises(lk.ArgumentError, match=rf"argument '{name}': the step indexes it with 1 index .*got a 2-D"):
            k(u, v, steps=1, backend=backend)
        np.testing.assert_array_equal(v, before)
    k(u1, v1, steps=1, backend=backend)
    np.testing.assert_array_equal(v1, u1 + 1.0)
    with pytest.raises(lk.ArgumentError, match=r"argument 'g': the step indexes it with 2 indices .*got a 3-D"):
        lk.megakernel(two_d_step)(rng.random((2, 2, 2)), np.zeros((2, 2)), steps=1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_array_in_the_other_byte_order_is_named(rng, backend):
    k = lk.megakernel(one_index_step)
    u = rng.random(3).astype(">f8" if np.little_endian else "<f8")
    v = np.zeros(3)
    with pytest.raises(lk.ArgumentError, match=r"argument 'u': array has dtype .f8, in the other byte order"):
        k(u, v, steps=1, backend=backend)
    np.testing.assert_array_equal(v, 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_array_that_the_step_writes(rng, backend):
    k = lk.megakernel(two_d_step)
    out = np.zeros((3, 3))
    out.flags.writeable = False
    with pytest.raises(lk.ArgumentError, match=r"argument 'out': the NumPy array is read-only \(flags.writeable "
                                               r"is False\), but the step writes into it"):
        k(rng.random((3, 3)), out, steps=1, backend=backend)
    src = rng.random((3, 3))
    src.flags.writeable = False        # read-only inputs the step only reads are fine
    res = np.zeros((3, 3))
    k(src, res, steps=1, backend=backend)
    np.testing.assert_array_equal(res, src * 2.0)
    h = lk.megakernel(helper_writer_step)
    assert h.spec.params[1].written and not h.spec.params[0].written
    dst = np.zeros(4)
    dst.flags.writeable = False
    with pytest.raises(lk.ArgumentError, match="argument 'dst': the NumPy array is read-only"):
        h(np.zeros(4), dst, steps=1, backend=backend)


def reads_u_writes_v(t, u, v):
    for i in lk.range(u.shape[0]):
        v[i] = u[i] + 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["u", "v"])
def test_read_only_swap_buffer_is_refused(rng, backend, which):
    # the kernel exchanges the pair's contents, so both are written, even 'u' that the step only reads
    k = lk.megakernel(reads_u_writes_v, swap=[("u", "v")])
    assert not k.spec.params[0].written
    u, v = rng.random(16), rng.random(16)
    before = dict(u=u.copy(), v=v.copy())
    dict(u=u, v=v)[which].flags.writeable = False
    with pytest.raises(lk.ArgumentError) as info:
        k(u, v, steps=3, backend=backend)
    msg = str(info.value)
    assert msg.startswith(f"argument '{which}': the NumPy array is read-only (flags.writeable is False)")
    assert ("swap buffer" in msg) == (which == "u") and "contiguous" not in msg
    np.testing.assert_array_equal(u, before["u"])
    np.testing.assert_array_equal(v, before["v"])


def atomic_histogram(t, data, hist):
    for i in lk.range(data.shape[0]):
        lk.atomic.add(hist, int(data[i]), 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int16, np.uint8, np.uint16])
def test_atomic_on_unsupported_dtype_is_refused_before_running(rng, backend, dtype):
    k = lk.megakernel(atomic_histogram)
    data = rng.integers(0, 4, 20).astype(np.float64)
    hist = np.zeros(4, dtype)
    with pytest.raises(lk.ArgumentError) as info:
        k(data, hist, steps=1, backend=backend)
    msg = str(info.value)
    assert msg.startswith("argument 'hist': the step updates it with lk.atomic")
    assert "float32, float64, int32, int64, uint32 and uint64" in msg and f"got dtype {np.dtype(dtype)}" in msg
    assert not hist.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_atomic_target_is_refused(rng, backend):
    k = lk.megakernel(atomic_histogram)
    hist = np.zeros(4, np.int64)
    hist.flags.writeable = False
    with pytest.raises(lk.ArgumentError, match="argument 'hist': the NumPy array is read-only .*lk.atomic"):
        k(np.zeros(3), hist, steps=1, backend=backend)


def test_read_only_gpu_array_is_refused():
    from loopkern.dispatch.checks import check_writable
    from loopkern.dispatch.args import classify

    class ReadOnlyDevice:
        __cuda_array_interface__ = dict(shape=(4,), typestr="<f8", data=(1 << 30, True), strides=None, version=3)
    p = lk.megakernel(reads_u_writes_v).spec.params[1]
    a = classify("v", ReadOnlyDevice())
    assert a.readonly
    with pytest.raises(lk.ArgumentError, match="argument 'v': the GPU array is read-only"):
        check_writable(p, a, swapped=False)


def test_hang_error_documents_its_run():
    doc = lk.HangError.__doc__
    assert "run:" in doc and "Run" in doc and "None" in doc


def _shift_step(t, a, b):
    for i in lk.range(b.shape[0]):
        b[i] = a[i] + 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_array_sharing_memory_with_a_written_one_is_refused(rng, backend):
    """A read array that shares memory with one the step writes (overlapping views, or one
    array passed twice) made threads race, and the CPU backend computed what no GPU does
    (session 29): an ArgumentError naming both, before anything runs, on the first call and
    on a call that reuses a cached plan. Disjoint views of one buffer stay allowed."""
    k = lk.megakernel(_shift_step)
    x = rng.random(16)
    pristine = x.copy()
    k(np.zeros(7), np.zeros(7), steps=1, backend=backend)     # a plan for 7-element arrays
    for a, b in ((x[:-1], x[1:]), (x, x), (x[:7], x[3:10])):
        with pytest.raises(lk.ArgumentError, match="argument 'a' shares memory with argument 'b', which step "
                                                    "'_shift_step' writes"):
            k(a, b, steps=1, backend=backend)
        np.testing.assert_array_equal(x, pristine)
    k(x[:8], x[8:], steps=1, backend=backend)
    np.testing.assert_array_equal(x, np.concatenate([pristine[:8], pristine[:8] + 1.0]))


def bounded_fill(t, out, m, key):
    for i in lk.range(m):
        s = 0.0
        for j in range(min(m, 4) - 1):
            s += 1.0
        out[i] = lk.random.uniform(key + i) + s


def converted_bound(t, out, m):
    for i in lk.range(int(m)):
        out[i] = t + 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float_passed_for_a_loop_bound_or_a_key_is_refused_before_anything_runs(backend):
    # a range over 2.5 ran 2 iterations on the CPU backend and 3 in the simulator; a float key
    # was truncated. The step takes m and key as integers: a float for either is refused
    k = lk.megakernel(bounded_fill)
    out = np.zeros(6)
    for m, key, name in ((2.5, 0, "m"), (np.float32(3.0), 0, "m"), (3, 1.5, "key"), (3, np.float64(2.0), "key")):
        with pytest.raises(lk.ArgumentError, match=f"argument '{name}': the step uses it as an integer"):
            k(out, m, key, steps=1, backend=backend)
        assert not out.any()
    k(out, 3, np.int32(7), steps=1, backend=backend)        # integers of any width run
    assert (out[:3] > 0).all() and not out[3:].any()
    out = np.zeros(6)
    lk.megakernel(converted_bound)(out, 2.5, steps=1, backend=backend)   # int(m) in the step: a float is fine
    np.testing.assert_array_equal(out, [1.0, 1.0, 0, 0, 0, 0])


def put_at(t, a, k, j):
    if lk.thread_id() == 0:
        a[k] = 5.0
    lk.sync()
    for i in lk.range(a.shape[0]):
        lk.atomic.add(a, (i + j) % a.shape[0], 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float_or_a_bool_passed_for_an_index_is_refused_before_anything_runs(backend):
    # a[k] with k=True stored into every element in the simulator (NumPy's boolean mask) and
    # did not compile on the CPU backend; k=1.0 raised an IndexError or a CompileError naming
    # no argument (found in session 32)
    k = lk.megakernel(put_at)
    a = np.zeros(4)
    for kk, j, name in ((True, 0, "k"), (1.0, 0, "k"), (np.float32(2), 0, "k"), (1, np.bool_(True), "j"),
                        (1, 0.0, "j")):
        with pytest.raises(lk.ArgumentError, match=f"argument '{name}': the step indexes an array with it"):
            k(a, kk, j, steps=1, backend=backend)
        assert not a.any()
    k(a, np.int16(2), 3, steps=1, backend=backend)
    np.testing.assert_array_equal(a, [1.0, 1.0, 6.0, 1.0])


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_arrays_and_matrices_are_refused_by_name(heat, rng, backend):
    u, v, u0 = arrays(rng)
    for bad, fragment in ((np.ma.masked_array(u, mask=u > 0.5), "argument 'u': got a masked array"),
                          (np.matrix(u), "argument 'u': got an np.matrix")):
        with pytest.raises(lk.ArgumentError, match=fragment):
            heat(bad, v, 0.25, steps=3, backend=backend)
    np.testing.assert_array_equal(u, u0)


def test_a_step_count_beyond_int64_is_refused_on_a_warm_plan(heat, rng):
    # the first call takes the full path and its check; later calls of the same signature go
    # straight to the cached plan, whose test had no upper bound (a raw OverflowError)
    u, v, u0 = arrays(rng)
    heat(u, v, 0.25, steps=2, backend="cpu")
    before = u.copy()
    for _ in range(2):
        with pytest.raises(lk.ArgumentError, match="must be at most 9223372036854775807"):
            heat(u, v, 0.25, steps=2 ** 63, backend="cpu")
    np.testing.assert_array_equal(u, before)


@pytest.mark.sim
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16])
def test_narrow_integer_loop_bounds_visit_each_index_once_in_the_simulator(dtype):
    # the simulator computed the loop's lo + thread * step in the bounds' own 8 bits (NumPy's
    # rule; Numba computes in 64): an int8 range visited indices past 127, a uint8 one hung
    @lk.megakernel
    def fill(t, out, lo, hi, st):
        for i in lk.range(lo, hi, st):
            out[i] = out[i] + 1

    lo, hi, st = dtype(2), dtype(120), dtype(3)
    want = np.zeros(256, np.int64)
    want[2:120:3] = 1
    out = np.zeros(256, np.int64)
    fill(out, lo, hi, st, steps=1, backend="cuda", threads=64)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_array_whose_elements_share_memory_is_refused_where_written(rng, backend):
    # as_strided with a zero or interleaved stride: threads writing "different" elements would
    # race on one address; reading such an array is fine (np.broadcast_to's are read-only anyway)
    from numpy.lib.stride_tricks import as_strided
    k = lk.megakernel(two_d_step)
    base = np.zeros(8)
    for out, shape in ((as_strided(base, (3, 3), (0, 8)), "(3, 3)"), (as_strided(base, (3, 3), (8, 8)), "(3, 3)"),
                       (as_strided(base[:1], (3, 3), (0, 0)), "(3, 3)")):
        with pytest.raises(lk.ArgumentError, match=rf"argument 'out': elements of this array share memory "
                                                   rf"\(strides .* for shape {re.escape(shape)}"):
            k(rng.random((3, 3)), out, steps=1, backend=backend)
        np.testing.assert_array_equal(base, 0.0)
    src = as_strided(rng.random(3), (3, 3), (0, 8))        # a read-only use of a row repeated
    res = np.zeros((3, 3))
    k(src, res, steps=1, backend=backend)
    np.testing.assert_array_equal(res, np.asarray(src) * 2.0)
    # distinct elements in any order or spacing are fine
    for out in (np.zeros((3, 3)).T, np.zeros((3, 6))[:, ::2], np.zeros((3, 3))[::-1, ::-1]):
        a = rng.random((3, 3))
        k(a, out, steps=1, backend=backend)
        np.testing.assert_array_equal(out, a * 2.0)


def test_an_option_of_the_other_call_is_named_as_such(rng):
    """kernel.jax takes no progress= and a direct call no checkpoint_every=: the error says whose
    option it is and lists the call's own (before session 36 it read as a step parameter)."""
    jax = pytest.importorskip("jax")
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u = rng.random(8)
    u0 = u.copy()
    with pytest.raises(lk.ArgumentError, match=r"heat_step\.jax\(\): takes no progress= \(an option of calling the "
                                               r"kernel directly\); its options are steps=.*adjoint_form="):
        k.jax(jax.numpy.asarray(u), jax.numpy.asarray(u), 0.1, steps=2, progress=True)
    with pytest.raises(lk.ArgumentError, match=r"heat_step\(\): takes no checkpoint_every= \(an option of "
                                               r"kernel.jax\)"):
        k(u, u.copy(), 0.1, steps=2, checkpoint_every=2)
    with pytest.raises(lk.ArgumentError, match=r"unexpected keyword argument 'wat'.*plus the options steps="):
        k(u, u.copy(), 0.1, steps=2, wat=2)
    np.testing.assert_array_equal(u, u0)          # refused before anything ran
