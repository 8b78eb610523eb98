"""Code generation: golden sources, line tracing back to the user's file, compile errors at
the user's line."""

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern import codegen
from loopkern.stencil import find_stencil

GOLDEN = Path(__file__).parent / "golden"
WORKLOADS_FILE = inspect.getsourcefile(W)
CASES = [("heat", W.heat_step, [("u", "v")]), ("jacobi", W.jacobi_step, [("u", "v")]),
         ("helper", W.helper_step, [("u", "v")])]


def normalized(text):
    return text.replace(WORKLOADS_FILE, "<workloads.py>")


@pytest.mark.parametrize("backend,scope", [("cuda", "grid"), ("cuda", "block"), ("cpu", "grid")])
@pytest.mark.parametrize("name,fn,swap", CASES, ids=[c[0] for c in CASES])
def test_golden_source(name, fn, swap, backend, scope):
    k = lk.megakernel(fn, swap=swap)
    text = normalized(k.source(backend, scope))
    path = GOLDEN / f"{name}_{backend}_{scope}.py"
    if os.environ.get("LOOPKERN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"generated source changed; regenerate with LOOPKERN_UPDATE_GOLDEN=1 ({path})"
    compile(text, str(path), "exec")   # valid Python


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_every_body_line_traces_to_the_users_line(backend):
    k = lk.megakernel(W.helper_step, swap=[("u", "v")])
    src = codegen.render_kernel(k.spec, backend, "grid")
    user_lines = {}
    for fn in (W.helper_step, W.damp, W.laplacian):
        lines, first = inspect.getsourcelines(fn)
        user_lines.update({first + i: ln for i, ln in enumerate(lines)})
    mapped = 0
    for gen_line, (filename, line, col) in src.line_map.items():
        assert filename == WORKLOADS_FILE
        assert line in user_lines
        mapped += 1
    body = [ln for ln in src.text.splitlines() if ln.startswith("    ") and "_lk_step" not in ln]
    # every line of the step and helper bodies is mapped
    assert mapped >= sum(1 for fn in (W.helper_step, W.damp, W.laplacian)
                         for ln in inspect.getsource(fn).splitlines()[1:] if ln.strip())
    assert len(body) > mapped


def type_clash(t, u):
    x = 1.0
    for i in lk.range(u.shape[0]):
        u[i] = x
    lk.sync()
    x = u.shape
    u[0] = x


def test_numba_error_points_at_user_line():
    k = lk.megakernel(type_clash)
    with pytest.raises(lk.CompileError) as info:
        k(np.zeros(8), steps=1, backend="cpu")
    msg = str(info.value)
    lines, first = inspect.getsourcelines(type_clash)
    head = msg.splitlines()[0]
    assert head.startswith(f"{__file__}:")
    line = int(head.split(":")[1])
    assert first < line < first + len(lines)
    assert "in step 'type_clash'" in head
    assert msg.splitlines()[1].strip() == lines[line - first].strip()
    assert "^" in msg.splitlines()[2]


def test_source_for_unknown_backend_is_an_error():
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    with pytest.raises(lk.ArgumentError):
        k.source("opencl")


def test_templates_are_installed_and_have_no_logic():
    from importlib import resources
    names = [p.name for p in resources.files("loopkern.templates").iterdir() if p.name.endswith(".tmpl")]
    assert {"cuda_kernel.py.tmpl", "cpu_kernel.py.tmpl"} <= set(names)


def test_disk_cache_is_reused_by_a_new_process(tmp_path, rng):
    seed = int(rng.integers(0, 2 ** 32))
    script = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import loopkern as lk, workloads as W
        k = lk.megakernel(W.heat_step, swap=[("u", "v")])
        u0 = np.random.default_rng({seed}).random(64); u = u0.copy(); v = u.copy()
        k(u, v, 0.25, steps=3, backend="cpu")
        d = k.dispatcher.kernels.variants[("cpu", "grid", None, False, (), True, None, None, None, False, 1, 0, None, False)].dispatcher
        print(sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()),
              float(np.abs(u - W.heat_ref(u0, 3, 0.25)).max()))
    """)
    env = dict(os.environ, LOOPKERN_CACHE_DIR=str(tmp_path), NUMBA_ENABLE_CUDASIM="0")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    first = [float(x) for x in runs[0].stdout.split()]
    second = [float(x) for x in runs[1].stdout.split()]
    assert first[0] == 0 and first[1] >= 1      # compiled and stored
    assert second[0] >= 1 and second[1] == 0    # loaded from disk
    assert first[2] < 1e-14 and second[2] < 1e-14   # and both compute the float64 reference
    assert list(tmp_path.glob("kernels/*.py"))


def _step_source(fn):
    return lk.megakernel(fn).source("cuda").split("def _lk_step")[1].split("@cuda.jit")[0]


def unroll_ok(t, u, v, acc):
    s = 0.0
    for i in lk.range(u.shape[0]):
        w = u[i] * 2.0
        v[i] = w + 1.0
        s = s + w
    acc[lk.thread_id()] = s


def unroll_carried_twice(t, u, v):
    s = 0.0
    for i in lk.range(u.shape[0]):
        a = s + u[i]
        s = a
        v[i] = a


def unroll_control_flow(t, u, v):
    # a guarded store (no else): unrolled, the store under its test in each copy
    for i in lk.range(u.shape[0]):
        if u[i] > 0.5:
            v[i] = 1.0


def unroll_guarded_read(t, u, v):
    # the test keeps u[i + 1] in bounds: the value is read under it, never hoisted
    n = u.shape[0]
    for i in lk.range(n):
        x = u[i] * 2.0
        if i + 1 < n and x > 0.6:
            v[i] = u[i + 1] + x


def unroll_if_else(t, u, v):
    for i in lk.range(u.shape[0]):
        if u[i] > 0.5:
            v[i] = 1.0
        else:
            v[i] = 2.0


def unroll_guarded_name(t, u, v):
    for i in lk.range(u.shape[0]):
        x = 0.0
        if u[i] > 0.5:
            x = 1.0
        v[i] = x


def unroll_temp_used_after(t, u, v):
    w = 0.0
    for i in lk.range(u.shape[0]):
        w = u[i]
        v[i] = w
    lk.sync()
    v[0] = w


def unroll_index_reused_by_a_later_loop(t, u, v):
    for i in lk.range(u.shape[0]):
        v[i] = u[i] * 2.0
    lk.sync()                                # (v[i] is another thread's in the second loop)
    for i in lk.range(0, u.shape[0], 7):     # rebinds i before reading it
        v[i] = v[i] + 1.0


def unroll_index_read_after(t, u, v):
    i = 0
    for i in lk.range(u.shape[0]):
        v[i] = u[i] * 2.0
    lk.sync()
    v[0] = i


def unroll_index_read_by_a_later_loop_header(t, u, v):
    i = 0
    for i in lk.range(u.shape[0]):
        v[i] = u[i] * 2.0
    lk.sync()
    for i in range(i, i + 1):                # the range reads the first loop's last i
        v[0] = i


def hoist_loads_past_stores(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i] * 2.0
        x = v[i] + u[n - 1 - i]               # v[i]: the value just stored; u[n - 1 - i] moves up
        y = u[i + 1] if i + 1 < n else 0.5    # read only where its test holds: stays under it
        w[i] = x * y


def hoist_carried_index(t, idx, u, v, out):
    # idx[acc] reads the name the statement updates: each copy of the unrolled loop has its
    # own acc there, so the load stays in place (moved to the top, every copy read idx at the
    # acc of before the first copy's update: found by an adversarial trial)
    n = u.shape[0]
    acc = 0
    for i in lk.range(n):
        v[i] = u[i] * 2.0
        acc = (acc * 3 + 1 + idx[acc]) % n
    out[lk.thread_id()] = acc


def _bump_then_scale(a, b, c):
    # called with one array for a and b: a helper's arguments may share memory (the dispatcher
    # checks only the step's), so its loads after the store to b stay in place
    for i in lk.range(a.shape[0]):
        b[i] = a[i] + 1.0
        x = a[i] * 10.0
        c[i] = x
    return 0.0


def hoist_helper_aliased(t, u, w):
    z = _bump_then_scale(u, u, w)


def test_loads_after_a_store_move_above_it_only_when_nothing_can_change_them():
    """_hoist_loads: in the unrolled copies and the remainder, the load of u (never written)
    after the store to v is issued before the store; v[i] (just written) and u[i + 1] (read
    only under its condition) stay where they are."""
    src = _step_source(hoist_loads_past_stores)
    moved = [ln for ln in src.splitlines() if "__lk_ld" in ln.split("=")[0]]
    # 4 + 2 unrolled copies and the remainder; each the load of u[n - 1 - i]
    assert len(moved) == 7 and all(ln.split("=")[1].lstrip().startswith("u[n - 1 - ") for ln in moved)
    body = src.split("while _lk_u1 + 3 * _lk_nt")[1].split("_lk_u1 += 4 * _lk_nt")[0].splitlines()
    first_store = min(k for k, ln in enumerate(body) if ln.lstrip().startswith("v["))
    assert max(k for k, ln in enumerate(body) if "__lk_ld" in ln.split("=")[0]) < first_store
    # a carried index, and a helper's body: nothing moves
    assert "__lk_ld" not in _step_source(hoist_carried_index)
    assert "__lk_ld" not in lk.megakernel(hoist_helper_aliased).source("cuda")


@pytest.mark.parametrize("fn,unrolled", [(unroll_ok, True), (unroll_carried_twice, False),
                                         (unroll_control_flow, True), (unroll_guarded_read, True),
                                         (unroll_if_else, False), (unroll_guarded_name, False),
                                         (unroll_temp_used_after, False),
                                         (unroll_index_reused_by_a_later_loop, True)])
def test_unrolling_only_when_it_cannot_change_the_result(fn, unrolled):
    assert ("while _lk_u1 + 3 * _lk_nt" in _step_source(fn)) == unrolled


@pytest.mark.parametrize("fn", [unroll_index_read_after, unroll_index_read_by_a_later_loop_header])
def test_a_parallel_index_read_after_its_loop_is_refused(fn):
    """After an lk.range loop its variable holds the last index the thread ran, which depends on
    the number of threads: reading it there is refused since session 36 (before, these steps
    ran, the unrolled loop keeping the value each thread's own loop left)."""
    with pytest.raises(lk.StepSyntaxError, match="is read after the parallel loop at line"):
        lk.megakernel(fn)


def ends_after_an_early_return(t, u, v, tol):
    if t > 3:
        return False
    err = 0.0
    for i in lk.range(u.shape[0]):
        v[i] = u[i] * 0.5
        err = max(err, abs(v[i] - u[i]))
    return lk.max(err) > tol


def ends_in_two_reductions(t, u, v, tol):
    err = 0.0
    for i in lk.range(u.shape[0]):
        v[i] = u[i] * 0.5
        err = max(err, abs(v[i] - u[i]))
    return lk.max(err) > tol and lk.sum(err) > 0.0


@pytest.mark.parametrize("fn,elided", [(W.jacobi_step, True), (ends_in_two_reductions, True), (W.heat_step, False),
                                       (ends_after_an_early_return, False),
                                       (W.normalize_step, False)])
def test_the_step_barrier_is_left_out_only_after_a_final_reduction(fn, elided):
    src = lk.megakernel(fn).source("cuda")
    loop = src.split("while _lk_t < _lk_nsteps:")[1]
    assert ("_lk_rt.grid_sync(_lk_bar)" not in loop) == elided


def _shares(n, nt):
    """The indices each of nt threads takes in a grid-stride loop over range(n)."""
    return [np.arange(k, n, nt) for k in range(nt)]


# each unrolling case against NumPy: on the CPU (one thread) and under the simulator with 32
# threads and more than 4 * 32 elements, so that the unrolled loop and its remainder both run
UNROLL_BACKENDS = [pytest.param("cpu", None, id="cpu"), pytest.param("cuda", 32, id="sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("backend,threads", UNROLL_BACKENDS)
@pytest.mark.parametrize("per_thread", [1, 2, 3, 8])
def test_every_unrolling_case_computes_what_numpy_does(backend, threads, per_thread, rng):
    """``per_thread``: about how many indices each of the 32 threads takes: 1 (the remainder
    loop only), 2 and 3 (the two-copy loop, then the remainder or not), 8 or 9 (the unrolled
    loop twice, then the remainder)."""
    n = 32 * per_thread + int(rng.integers(1, 32))
    u = rng.random(n)
    nt = 1 if backend == "cpu" else threads
    shares = _shares(n, nt)
    opts = dict(steps=1, backend=backend, threads=threads)

    v, acc = np.zeros(n), np.zeros(nt)
    lk.megakernel(unroll_ok)(u, v, acc, **opts)
    np.testing.assert_allclose(v, 2 * u + 1, rtol=1e-15)
    np.testing.assert_allclose(acc, [(2 * u[s]).sum() for s in shares], rtol=1e-12)

    v = np.zeros(n)
    lk.megakernel(unroll_carried_twice)(u, v, **opts)
    expect = np.zeros(n)
    for s in shares:                      # each thread's running sum over its own share
        expect[s] = np.cumsum(u[s])
    np.testing.assert_allclose(v, expect, rtol=1e-12)

    v0 = rng.random(n)
    v = v0.copy()
    lk.megakernel(unroll_control_flow)(u, v, **opts)
    np.testing.assert_array_equal(v, np.where(u > 0.5, 1.0, v0))
    v = v0.copy()
    lk.megakernel(unroll_guarded_read)(u, v, **opts)
    expect = v0.copy()
    hit = np.flatnonzero(2 * u[:-1] > 0.6)
    expect[hit] = u[hit + 1] + 2 * u[hit]
    np.testing.assert_array_equal(v, expect)

    # v[0] is written by every thread after its loop (a race between threads by design): it
    # holds one of the values a thread wrote there
    v = np.zeros(n)
    lk.megakernel(unroll_temp_used_after)(u, v, **opts)
    np.testing.assert_array_equal(v[1:], u[1:])
    assert v[0] in {u[0]} | {u[s[-1]] for s in shares}

    # the second loop adds 1 to every seventh element the first loop wrote (a barrier between
    # them: since session 29 the front end refuses the two loops without one, a race)
    v = np.zeros(n)
    lk.megakernel(unroll_index_reused_by_a_later_loop)(u, v, **opts)
    sevens = np.arange(n) % 7 == 0
    np.testing.assert_array_equal(v, 2 * u + sevens)

    v, w = np.zeros(n), np.zeros(n)
    lk.megakernel(hoist_loads_past_stores)(u, v, w, **opts)
    np.testing.assert_array_equal(v, 2 * u)
    np.testing.assert_array_equal(w, (2 * u + u[::-1]) * np.append(u[1:], 0.5))

    idx = rng.integers(0, n, n)
    v, out = np.zeros(n), np.zeros(nt, np.int64)
    lk.megakernel(hoist_carried_index)(idx, u, v, out, **opts)
    expect = np.zeros(nt, np.int64)
    for k, share in enumerate(shares):       # each thread's acc over its own indices, in order
        acc = 0
        for _ in share:
            acc = (acc * 3 + 1 + int(idx[acc])) % n
        expect[k] = acc
    np.testing.assert_array_equal(out, expect)
    np.testing.assert_array_equal(v, 2 * u)

    x, w = u.copy(), np.zeros(n)
    lk.megakernel(hoist_helper_aliased)(x, w, **opts)
    np.testing.assert_array_equal(x, u + 1.0)
    np.testing.assert_array_equal(w, (u + 1.0) * 10.0)



@pytest.mark.parametrize("backend,threads", UNROLL_BACKENDS)
def test_steps_without_a_final_barrier_stop_where_numpy_says(backend, threads, rng):
    n = int(rng.integers(40, 200))
    u = rng.standard_normal(n)
    half = 0.5 * np.abs(u).max()          # each step's err: max |0.5 u - u|
    opts = dict(max_steps=50, backend=backend, threads=threads)
    for fn, small_tol_steps in ((ends_after_an_early_return, (5, "condition")),   # t > 3 returns False
                                (ends_in_two_reductions, (50, "steps"))):
        k = lk.megakernel(fn)
        v = np.zeros(n)
        run = k(u, v, half * 0.9, **opts)                   # err > tol: continue
        assert (run.steps, run.stopped) == small_tol_steps
        np.testing.assert_allclose(v, 0.5 * u, rtol=1e-15)
        v = np.zeros(n)
        run = k(u, v, half * 1.1, **opts)                   # err <= tol: stop after one step
        assert (run.steps, run.stopped) == (1, "condition")
        np.testing.assert_allclose(v, 0.5 * u, rtol=1e-15)


def _own_access_step(t, u, v, w, m, m2, k):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i - 1] + u[i + 1]          # proven non-negative: loopkern's own load and store
        v[i] += u[k]                        # k may be negative: Numba's indexing (wraparound)
    lk.sync()
    for i in lk.range(n):
        w[i - 1] = v[i] * 0.5               # i - 1 is -1 for i = 0: Numba's
    for i, j in lk.grid(m.shape[0], m.shape[1]):
        m2[i, j] += m[(i + 1) % m.shape[0], j]   # 2-D, both indices proven, an augmented store


@pytest.mark.parametrize("bits", [64, 32])
def test_own_element_accesses_only_where_every_index_is_proven_non_negative(bits):
    k = lk.megakernel(_own_access_step)
    src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, index_bits=bits).text
    sfx = "32" if bits == 32 else ""
    first = _own_access_step.__code__.co_firstlineno
    lines = {}
    for ln in src.splitlines():
        if "  # line " in ln:
            lines.setdefault(int(ln.rsplit("# line ", 1)[1]) - first, []).append(ln)
    text = {no: "\n".join(ls) for no, ls in lines.items()}
    # (the remainder loop, unrolled form: each store's value in a temporary first)
    assert f" = _lk_rt.load{sfx}(u, _lk_np.uint64(i - 1)) + _lk_rt.load{sfx}(u, _lk_np.uint64(i + 1))" in text[3]
    assert f"_lk_rt.store{sfx}(v, _lk_np.uint64(i), _lk_u1_r__lk_v0)" in text[3]
    # v[i] += u[k]: the store and the load of v are loopkern's, the load of u[k] is Numba's
    # (issued before the first store, _hoist_loads)
    assert f" = _lk_rt.load{sfx}(v, _lk_np.uint64(i)) + _lk_u1_r__lk_ld0" in text[4]
    assert "_lk_u1_r__lk_ld0 = u[k]" in text[4]
    assert f"_lk_rt.store{sfx}(v, _lk_np.uint64(i), _lk_u1_r__lk_v1)" in text[4]
    assert "w[i - 1] = " in text[7] and "_lk_rt.store" not in text[7]
    assert f"_lk_rt.store{sfx}(m2, (_lk_np.uint64(i), _lk_np.uint64(j)), " in text[9]
    assert f" = _lk_rt.load{sfx}(m2, (_lk_np.uint64(i), _lk_np.uint64(j))) + " in text[9]
    # without index_bits (and in the golden sources) every access is Numba's
    plain = codegen.render_kernel(k.spec, "cuda", "grid", cache=False).text
    assert "_lk_rt.load" not in plain and "_lk_rt.store" not in plain


def test_own_element_accesses_are_refused_where_arrays_may_not_be_global():
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    with pytest.raises(ValueError, match="index_bits"):
        codegen.render_kernel(k.spec, "cuda", "block", staged=(0, 1), index_bits=64)
    with pytest.raises(ValueError, match="index_bits"):
        codegen.render_kernel(k.spec, "cuda", "grid", debug=True, index_bits=64)
    with pytest.raises(ValueError, match="index_bits"):
        codegen.render_kernel(k.spec, "cpu", "grid", index_bits=64)
    with pytest.raises(ValueError, match="index_bits"):
        codegen.render_kernel(k.spec, "cuda", "grid", index_bits=16)


@pytest.mark.sim
def test_own_element_accesses_compute_what_numpy_does(rng):
    # under the simulator the generated source with loopkern's accesses runs as Python: the
    # rewrite of loads, stores and augmented stores must keep every access's meaning
    from numba import cuda
    k = lk.megakernel(_own_access_step)
    n, kk = 37, -3
    u0, v0, w0, m0, m20 = rng.random(n), rng.random(n), rng.random(n), rng.random((5, 7)), rng.random((5, 7))
    v, w, m2 = v0.copy(), w0.copy(), m20.copy()
    for _ in range(3):
        v[1:n - 1] = u0[:n - 2] + u0[2:] + u0[kk]
        w = 0.5 * np.roll(v, -1)               # w[i - 1] = v[i] / 2, w[-1] is w[n - 1]
        m2 = m2 + np.roll(m0, -1, axis=0)
    args = [cuda.to_device(a) for a in (u0, v0, w0, m0, m20)]
    run = k(*args, kk, steps=3, backend="cuda", scope="grid", threads=32)
    assert run.steps == 3
    # arrays of fewer than 2**31 elements: the kernel with 32-bit offsets for 1-D arrays
    assert k.dispatcher.kernels.variants and all(key[7] == 32 for key in k.dispatcher.kernels.variants)
    for got, want in zip(args, (u0, v, w, m0, m2)):
        np.testing.assert_allclose(got.copy_to_host(), want, rtol=1e-12)


def test_kernel_jax_reads_each_scalar_where_the_step_uses_it():
    # kernel.jax passes scalars as 1-element buffers (by_ref). Read once in the kernel's
    # prologue, each held a register through every loop of every step (ptxas then gave the
    # Jacobi kernel 80 registers, not 96, and issued most of its interior loads late); each is
    # now read before the step's top-level statement that uses it. The buffers are inputs the
    # kernel never writes, so the reads all give the value the prologue read
    k = lk.megakernel(W.scalars_step, swap=[("u", "v")])
    text = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, by_ref=frozenset({2, 3, 4, 5})).text
    step = text[text.index("def _lk_step("):text.index("@cuda.jit", text.index("def _lk_step("))]
    kernel = text[text.index("def _lk_kernel("):]
    lines = [ln.split("  #")[0].strip() for ln in step.splitlines()]
    assert lines[0].startswith("def _lk_step(t, u, v, _lk_ref_a, _lk_ref_b, _lk_ref_k, _lk_ref_tol, ")
    at = {name: lines.index(f"{name} = _lk_ref_{name}[0]") for name in "abk"}
    assert lines.count("tol = _lk_ref_tol[0]") == 1
    first_loop = next(i for i, ln in enumerate(lines) if ln.startswith("while "))
    last_max = max(i for i, ln in enumerate(lines) if ln.startswith("err = max("))
    ret = next(i for i, ln in enumerate(lines) if ln.startswith("return "))
    # b and k before the helper's call that uses them, a just before the loop, tol after the
    # loop's last use of err and before the return that compares with it
    helper_call = next(i for i, ln in enumerate(lines) if "_lk_fn_bias(b, k + 1" in ln)
    assert at["b"] < helper_call and at["k"] < helper_call < at["a"] < first_loop
    assert last_max < lines.index("tol = _lk_ref_tol[0]") < ret
    assert all(lines.count(f"{name} = _lk_ref_{name}[0]") == 1 for name in "abk")
    # the kernel reads none of them up front and hands the step the buffers
    assert "_lk_ref_" not in kernel and "_ref[0]" not in kernel.replace("_lk_nsteps_ref[0]", "").replace(
        "_lk_t0_ref[0]", "").replace("_lk_seed_ref[0]", "").replace("_lk_seed_ref[1]", "")
    assert "_lk_step(_lk_t0 + _lk_t, _lk_a0, _lk_a1, _lk_a2_ref, _lk_a3_ref, _lk_a4_ref, _lk_a5_ref, " in kernel


@pytest.mark.sim
@pytest.mark.parametrize("scope,staged", [("grid", ()), ("block", ()), ("block", (0, 1))])
def test_kernel_jax_form_with_scalars_read_at_use_follows_numpy(scope, staged, rng):
    # kernel.jax's form of the kernel (step count, start, seed and scalars as 1-element buffers,
    # laid out as the FFI shim passes them) run by Numba's CUDA simulator, one block, against
    # float64 NumPy: a scalar inside a loop, through a helper and after a reduction only
    from loopkern.compile import compile_kernel
    from loopkern.runtime.layout import HOST_SIZE, STEPS, WHY
    k = lk.megakernel(W.scalars_step, swap=[("u", "v")])
    src = codegen.render_kernel(k.spec, "cuda", scope, cache=False, by_ref=frozenset({2, 3, 4, 5}),
                                staged=staged)
    kernel = compile_kernel(src).dispatcher
    n, a, b, kk = 301, 0.2, 1e-4, 3
    u0 = rng.random(n).astype(np.float32)
    r1, _ = W.scalars_ref(u0, 1, a, b, kk, -1.0)
    r2, _ = W.scalars_ref(u0, 2, a, b, kk, -1.0)
    between = 0.5 * (np.abs(r1 - u0).max() + np.abs(r2 - r1).max())
    for steps, tol in ((9, -1.0), (9, between)):
        u, v = u0.copy(), u0.copy()
        host = np.zeros(HOST_SIZE, np.int64)
        args = [np.array([steps], np.int32), np.array([0], np.int32), u, v, np.array([a], np.float32),
                np.array([b], np.float32), np.array([kk], np.int32), np.array([tol], np.float32),
                np.zeros((2, 1)), np.zeros((2, 1), np.int64), np.zeros(2, np.uint32),
                np.array([5, 0, 4], np.uint32), np.zeros(2, np.int64), host]
        kernel[1, 64, 0, 4 * 2 * n if staged else 0](*args)
        ref, done = W.scalars_ref(u0, steps, a, b, kk, tol)
        assert host[STEPS] == done and done == (steps if tol < 0 else 2)
        assert host[WHY] == (0 if tol < 0 else 1)
        np.testing.assert_allclose(u, ref, rtol=2e-6, atol=2e-6)


def test_launch_bounds_are_a_grid_kernels_decorator_option():
    # (dispatch.kernels.LAUNCH_BOUNDS): the bounds go to cuda.jit as they are;
    # tests/test_ptx.py shows Numba compiling them into the PTX
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    text = codegen.render_kernel(k.spec, "cuda", "grid", cache=True, launch_bounds=(256, 2)).text
    assert "@cuda.jit(cache=True, launch_bounds=(256, 2))\ndef _lk_kernel(" in text
    plain = codegen.render_kernel(k.spec, "cuda", "grid", cache=True).text
    assert "launch_bounds" not in plain and "@cuda.jit(cache=True)\ndef _lk_kernel(" in plain
    for scope, extra in (("block", {}), ("grid", {"debug": True}), ("grid", {"tile": find_stencil(k.spec)})):
        with pytest.raises(ValueError, match="launch_bounds is"):
            codegen.render_kernel(k.spec, "cuda", scope, launch_bounds=(256, 2), **extra)
    for bad in ((2048, 1), (256,), (256, 0), (256.0, 2)):
        with pytest.raises(ValueError, match="launch_bounds is"):
            codegen.render_kernel(k.spec, "cuda", "grid", launch_bounds=bad)
    with pytest.raises(ValueError, match="launch_bounds is"):
        codegen.render_kernel(k.spec, "cpu", "grid", launch_bounds=(256, 2))


def test_launch_bounds_only_where_loopkern_sizes_a_grid_launch(monkeypatch):
    # a grid-scope CUDA kernel carries dispatch.kernels.LAUNCH_BOUNDS when the call names
    # neither threads nor blocks (any size a call asks for still launches without them), never
    # under the simulator, in debug, tile mode or another scope or backend
    from loopkern import compile as lk_compile
    from loopkern.dispatch import kernels
    assert kernels.LAUNCH_BOUNDS == (256, 2)
    simulated = lk_compile.simulator_enabled()

    def source(scope="grid", backend="cuda", **kw):
        return lk.megakernel(W.heat_step, swap=[("u", "v")]).dispatcher.kernels.source(backend, scope, **kw).text
    # the simulator's cuda.jit has no bounds
    assert "launch_bounds" not in source(sized=True) or not simulated
    monkeypatch.setattr(lk_compile, "simulator_enabled", lambda: False)
    assert "@cuda.jit(cache=True, launch_bounds=(256, 2))" in source(sized=True)
    assert "launch_bounds" not in source()
    tile = find_stencil(lk.megakernel(W.heat_step, swap=[("u", "v")]).spec)
    for scope, extra in (("block", {}), ("grid", {"debug": True}), ("grid", {"tile": tile})):
        assert "launch_bounds" not in source(scope, sized=True, **extra)
    assert "launch_bounds" not in source(backend="cpu", sized=True)
    monkeypatch.setattr(kernels, "LAUNCH_BOUNDS", None)
    assert "launch_bounds" not in source(sized=True)
    monkeypatch.setattr(kernels, "LAUNCH_BOUNDS", (512, 1))
    assert "launch_bounds=(512, 1)" in source(sized=True)


def test_a_call_that_names_threads_or_blocks_gets_the_kernel_without_bounds(monkeypatch):
    # the dispatcher asks for the bounded variant only when it sizes the launch itself (seen
    # through the cache's requests; under the simulator none of them carries bounds)
    from loopkern.dispatch import kernels
    asked = []
    get = kernels.KernelCache.get

    def spy(self, backend, scope, **kw):
        asked.append((scope, kw.get("sized", False)))
        return get(self, backend, scope, **kw)
    monkeypatch.setattr(kernels.KernelCache, "get", spy)
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    x = np.linspace(0.0, 1.0, 64)
    for opts, sized in (({}, True), ({"threads": 64}, False), ({"blocks": 1}, False)):
        asked.clear()
        k(x.copy(), x.copy(), 0.1, steps=3, backend="cuda", scope="grid", **opts)
        assert asked == [("grid", sized)], opts
