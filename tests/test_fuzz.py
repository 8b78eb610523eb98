"""Differential fuzzing: random valid step programs (tests/stepgen.py) run on the CPU backend and on
the CUDA code path under Numba's simulator (grid and block scope; thread scope for a step without
parallel constructs), each compared with the plain-Python reference interpreter (tests/interp.py):
integer programs bit for bit, float programs to a tight tolerance, and the step count, stop reason
and next start index exactly. More generated programs are compiled for the GPU (PTX, with NVVM:
no GPU needed) to catch CUDA-only compile errors, and hand-written steps return a reduction's
verdict under short-circuits and conditional expressions (the step barrier must stay).

Hypothesis runs derandomized (the same programs every run, no example database), so a failure
reproduces; the falsifying example prints the program's source. Environment:

- ``LOOPKERN_FUZZ_EXAMPLES=N``: N programs per test instead of the CI default;
- ``LOOPKERN_FUZZ_SHRINK=1``: let hypothesis minimise a failing program (every candidate compiles
  a kernel, so this takes minutes);
- ``LOOPKERN_FUZZ_SEED=S``: another fixed seed (other programs) instead of the derandomized one.

How many programs ran is printed in the terminal summary ("loopkern fuzzing") and written to
``fuzz_counts.json`` in pytest's base temporary directory.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import loopkern as lk
import interp
import stepgen
from stepgen import fuzz_counter, fuzz_settings  # noqa: F401 (a fixture)

# every program runs on each of these (a step without parallel constructs: CUDA's thread scope)
BACKENDS = [("cpu", None), ("cuda", "grid"), ("cuda", "block")]

CORE_EXAMPLES = 100       # 1-2 seconds each on one CPU core (compiling the CPU kernel is most)
ATOMIC_EXAMPLES = 30
PTX_PROGRAMS = 15         # compiled for the GPU with NVVM: about 1 second per kernel


def threads_for(prog, threads):
    # more than 4 elements per thread of 32: the CUDA path's unrolled loops run
    return 32 if max(prog.shape) > 64 else threads


@pytest.mark.sim
@fuzz_settings(CORE_EXAMPLES)
@given(prog=stepgen.programs(), threads=st.sampled_from([32, 64]))
def test_random_programs_match_interpreter(fuzz_counter, prog, threads):
    stepgen.check_program(prog, [(backend, scope, threads_for(prog, threads), None) for backend, scope in BACKENDS])
    fuzz_counter("test_fuzz core (cpu, sim grid, sim block)", prog)


@pytest.mark.sim
@fuzz_settings(ATOMIC_EXAMPLES)
@given(prog=stepgen.programs(atomics=True), threads=st.sampled_from([32, 64]))
def test_random_programs_with_atomics_match_interpreter(fuzz_counter, prog, threads):
    stepgen.check_program(prog, [(backend, scope, threads_for(prog, threads), None) for backend, scope in BACKENDS])
    fuzz_counter("test_fuzz lk.atomic (cpu, sim grid, sim block)", prog)


def test_random_programs_compile_to_ptx(fuzz_counter):
    # The simulator runs the CUDA path as Python: IR that NVVM rejects only shows when the kernel
    # is compiled for a GPU. Compile generated programs (a third each int64, float64 and float32:
    # float32 steps mix float32 and float64 values the most) to PTX with NVVM, no GPU needed.
    n = int(os.environ.get("LOOPKERN_FUZZ_EXAMPLES", PTX_PROGRAMS))
    cmd = [sys.executable, stepgen.__file__, "ptx", str(n), "atomics"]
    if os.environ.get("LOOPKERN_FUZZ_SEED"):
        cmd.append(os.environ["LOOPKERN_FUZZ_SEED"])
    p = subprocess.run(cmd, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"), capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(recs) >= n
    if all(not r["ok"] and r["error"].startswith(("DynamicLibNotFoundError", "NvvmSupportError")) for r in recs):
        pytest.skip("NVVM is not installed (pip install 'cuda-toolkit[nvvm,nvrtc]==13.*')")
    failed = [r for r in recs if not r["ok"]]
    assert not failed, "\n\n".join(f"{r['scope']} scope: {r['error']}\n{r['source']}" for r in failed[:3])
    for _ in range(n):
        fuzz_counter("test_fuzz PTX with NVVM (grid and block scope)")


# ------------------------------------------------- a reduction the final return may skip
# Each step continues while t < warm or the largest change exceeds tol; the reduction is not
# evaluated on every step, so the step keeps its barrier (the simulator shows a missing one).
def ret_or(t, u, v, tol, warm):
    n = u.shape[0]
    err = 0
    for i in lk.range(1, n - 1):
        v[i] = (u[i - 1] + 2 * u[i] + u[i + 1]) // 4
        err = max(err, abs(v[i] - u[i]))
    return t < warm or lk.max(err) > tol


def ret_ifexp(t, u, v, tol, warm):
    n = u.shape[0]
    err = 0
    for i in lk.range(1, n - 1):
        v[i] = (u[i - 1] + 2 * u[i] + u[i + 1]) // 4
        err = max(err, abs(v[i] - u[i]))
    return lk.max(err) > tol if t >= warm else True


def ret_ifexp_else(t, u, v, tol, warm):
    n = u.shape[0]
    err = 0
    for i in lk.range(1, n - 1):
        v[i] = (u[i - 1] + 2 * u[i] + u[i + 1]) // 4
        err = max(err, abs(v[i] - u[i]))
    return True if t < warm else lk.max(err) > tol


def ret_not_and(t, u, v, tol, warm):
    n = u.shape[0]
    err = 0
    for i in lk.range(1, n - 1):
        v[i] = (u[i - 1] + 2 * u[i] + u[i + 1]) // 4
        err = max(err, abs(v[i] - u[i]))
    return not (t >= warm and lk.max(err) <= tol)


def ret_plain(t, u, v, tol, warm):
    # always reduces: the reduction's barrier may replace the step's
    n = u.shape[0]
    err = 0
    for i in lk.range(1, n - 1):
        v[i] = (u[i - 1] + 2 * u[i] + u[i + 1]) // 4
        err = max(err, abs(v[i] - u[i]))
    return lk.max(err) > tol or t < warm


def smooth_reference(u0, tol, warm, max_steps):
    """NumPy, exact: (u, v, steps, stopped) with the two-buffer rename."""
    u, v = u0.copy(), u0.copy()
    steps = 0
    while steps < max_steps:
        v[1:-1] = (u[:-2] + 2 * u[1:-1] + u[2:]) // 4
        err = np.abs(v[1:-1] - u[1:-1]).max()
        u, v = v, u
        steps += 1
        if not (steps - 1 < warm or err > tol):
            return u, v, steps, "condition"
    return u, v, steps, "steps"


@pytest.mark.parametrize("backend,scope", [pytest.param("cpu", None, id="cpu"),
                                           pytest.param("cuda", "grid", id="sim-grid", marks=pytest.mark.sim),
                                           pytest.param("cuda", "block", id="sim-block", marks=pytest.mark.sim)])
@pytest.mark.parametrize("step", [ret_or, ret_ifexp, ret_ifexp_else, ret_not_and, ret_plain],
                         ids=lambda f: f.__name__)
def test_return_of_a_reduction_under_short_circuit(step, backend, scope):
    k = lk.megakernel(step, swap=[("u", "v")])
    # 130 elements on 32 threads (the unrolled loop path); the reduction is skipped on steps 0-4
    u0 = np.random.default_rng(0).integers(0, 1 << 10, 130)
    ru, rv, rsteps, rstopped = smooth_reference(u0, 8, 5, 60)
    assert 5 < rsteps < 60
    u, v = u0.copy(), u0.copy()
    opts = {} if backend == "cpu" else dict(scope=scope, threads=32)
    run = k(u, v, 8, 5, max_steps=60, backend=backend, **opts)
    assert (run.steps, run.stopped) == (rsteps, rstopped)
    np.testing.assert_array_equal(u, ru)
    np.testing.assert_array_equal(v, rv)


# ----------------------------------------------------------------------- the tools themselves
def test_interpreter_philox_known_answers():
    # Random123's known-answer vectors: the interpreter's own Philox4x32-10
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        assert interp.philox4x32_10(ctr, key) == want


def test_interpreter_against_numpy_references():
    # the interpreter itself, against the workloads' float64 / exact NumPy references
    import workloads as W
    rng = np.random.default_rng(7)
    u0 = rng.random(40)
    u, v = u0.copy(), u0.copy()
    r = interp.run(W.heat_step, [u, v, 0.25], 7, swap=[("u", "v")])
    assert (r.steps, r.stopped, r.next_start) == (7, "steps", 7)
    np.testing.assert_allclose(u, W.heat_ref(u0, 7, 0.25), rtol=1e-13)
    g0 = rng.random((9, 9))
    g, h = g0.copy(), g0.copy()
    r = interp.run(W.jacobi_step, [g, h, 1e-3], 500, swap=[("u", "v")])
    ref, ref_steps = W.jacobi_ref(g0, 1e-3, 500)
    assert (r.steps, r.stopped) == (ref_steps, "condition")
    np.testing.assert_allclose(g, ref, rtol=1e-13)
    a0 = (rng.random((8, 11)) < 0.35).astype(np.int32)
    a, b, pop = a0.copy(), np.zeros_like(a0), np.zeros(5, np.int64)
    interp.run(W.life_step, [a, b, pop], 5, swap=[("a", "b")])
    ra, rp = W.life_ref(a0, 5)
    np.testing.assert_array_equal(a, ra)
    np.testing.assert_array_equal(pop, rp)
    x0 = rng.standard_normal(30)
    x, stats = x0.copy(), np.zeros((3, 4))
    interp.run(W.normalize_step, [x, stats], 3)
    rx, rstats = W.normalize_ref(x0, 3)
    np.testing.assert_allclose(x, rx, rtol=1e-12)
    np.testing.assert_allclose(stats, rstats, rtol=1e-12, atol=1e-14)
    u0 = rng.random(30) * 3
    u, v = u0.copy(), u0.copy()
    interp.run(W.helper_step, [u, v, 0.3], 5, swap=[("u", "v")])     # helpers rebound too
    np.testing.assert_allclose(u, W.helper_ref(u0, 5, 0.3), rtol=1e-13)
    # float32 arrays: Python floats take their precision, as in NumPy 2
    x = rng.random(50).astype(np.float32)
    y = np.zeros_like(x)
    interp.run(W.scale_step, [x, y, 0.3], 1)
    np.testing.assert_array_equal(y, x * 0.1 + 0.3 * x)


def test_interpreter_swap_rename_and_start():
    # two-level rename: after an odd count the first name holds the newest state, the second
    # the one before; t starts at start
    def shift(t, u, v, log):
        for i in lk.range(u.shape[0]):
            v[i] = u[i] + 1.0
        if lk.thread_id() == 0:
            log[t] = t

    u, v, log = np.zeros(3), np.full(3, -1.0), np.full(8, -1, np.int64)
    r = interp.run(shift, [u, v, log], 3, start=4, swap=[("u", "v")])
    assert (r.steps, r.next_start) == (3, 7)
    np.testing.assert_array_equal(u, 3.0)
    np.testing.assert_array_equal(v, 2.0)
    np.testing.assert_array_equal(log, [-1, -1, -1, -1, 4, 5, 6, -1])


def test_generated_programs_are_valid_and_varied():
    # the generator's programs pass loopkern's validator, and cover what the fuzzing is for
    from hypothesis import HealthCheck, Phase, settings
    seen = []

    @settings(max_examples=150, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(stepgen.programs(atomics=True))
    def collect(prog):
        seen.append(prog)

    collect()
    for prog in seen[::10]:
        lk.megakernel(stepgen.load(prog), swap=prog.swap)     # raises if loopkern rejects it
    features = set().union(*(p.features for p in seen))
    for f in ("swap", "reduction", "sync", "reduction_barrier", "hist", "random", "return_plain", "return_or",
              "return_ifexp", "early_return", "cond_reduction", "uniform_if", "seq_loop", "if", "continue",
              "perm", "scatter", "atomic_own", "augassign", "start"):
        assert f in features, f
    assert {p.kind for p in seen} == {"int", "float64", "float32"}
    assert any(p.sequential for p in seen) and any(len(p.shape) == 2 for p in seen)
    assert any(max(p.shape) > 128 for p in seen)
