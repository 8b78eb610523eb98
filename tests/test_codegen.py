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


def test_disk_cache_is_reused_by_a_new_process(tmp_path):
    script = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import loopkern as lk, workloads as W
        k = lk.megakernel(W.heat_step, swap=[("u", "v")])
        u = np.random.rand(64); v = u.copy()
        k(u, v, 0.25, steps=3, backend="cpu")
        d = k._compiled[("cpu", "grid", None, False, (), True, None)].dispatcher
        print(sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()))
    """)
    env = dict(os.environ, LOOPKERN_CACHE_DIR=str(tmp_path), NUMBA_ENABLE_CUDASIM="0")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    first = [int(x) for x in runs[0].stdout.split()]
    second = [int(x) for x in runs[1].stdout.split()]
    assert first[0] == 0 and first[1] >= 1      # compiled and stored
    assert second[0] >= 1 and second[1] == 0    # loaded from disk
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
    for i in lk.range(u.shape[0]):
        if u[i] > 0.5:
            v[i] = 1.0


def unroll_temp_used_after(t, u, v):
    w = 0.0
    for i in lk.range(u.shape[0]):
        w = u[i]
        v[i] = w
    v[0] = w


def unroll_index_reused_by_a_later_loop(t, u, v):
    for i in lk.range(u.shape[0]):
        v[i] = u[i] * 2.0
    for i in lk.range(0, u.shape[0], 7):     # rebinds i before reading it
        v[i] = v[i] + 1.0


def unroll_index_read_after(t, u, v):
    i = 0
    for i in lk.range(u.shape[0]):
        v[i] = u[i] * 2.0
    v[0] = i


def unroll_index_read_by_a_later_loop_header(t, u, v):
    i = 0
    for i in lk.range(u.shape[0]):
        v[i] = u[i] * 2.0
    for i in range(i, i + 1):                # the range reads the first loop's last i
        v[0] = i


@pytest.mark.parametrize("fn,unrolled", [(unroll_ok, True), (unroll_carried_twice, False),
                                         (unroll_control_flow, False), (unroll_temp_used_after, False),
                                         (unroll_index_reused_by_a_later_loop, True),
                                         (unroll_index_read_after, False),
                                         (unroll_index_read_by_a_later_loop_header, False)])
def test_unrolling_only_when_it_cannot_change_the_result(fn, unrolled):
    assert ("while _lk_u1 + 3 * _lk_nt" in _step_source(fn)) == unrolled


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
