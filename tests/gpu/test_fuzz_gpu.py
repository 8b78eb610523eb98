"""Differential fuzzing and chunk invariance on a real GPU: the random programs of
tests/stepgen.py at thousands of elements, each at several block counts (1, 3 and auto, grid
scope) and in block scope, against the reference interpreter (tests/interp.py); a deterministic
regression for the step barrier that a final reduction may replace (``return t < 5 or
lk.max(err) > tol`` must keep it); and the chunk-invariance workloads of tests/test_chunks.py at
4K elements and several block counts, split runs bit for bit against one call.

Run on a machine with a CUDA GPU: ``python -m pytest -m gpu``. ``LOOPKERN_FUZZ_EXAMPLES`` sets
the number of programs per test (see tests/test_fuzz.py).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import loopkern as lk
import interp
import stepgen
from stepgen import fuzz_counter, fuzz_settings  # noqa: F401 (a fixture)
from test_fuzz import ret_or

pytestmark = pytest.mark.gpu

# 1-D sizes are primes (the programs' permutation stores need sizes coprime with 2, 3, 5 and 7);
# 509 elements of a few arrays fit the block scope's shared memory, the others do not
SHAPES_1D = [(509,), (2053,), (4093,)]
SHAPES_2D = [(23, 29), (61, 67)]
GPU_CONFIGS = [("cuda", "grid", None, 1), ("cuda", "grid", None, 3), ("cuda", "grid", None, None),
               ("cuda", "grid", 128, None), ("cuda", "block", None, None)]


def _shape(prog, k):
    return SHAPES_1D[k % 3] if len(prog.shape) == 1 else SHAPES_2D[k % 2]


@fuzz_settings(30)
@given(prog=stepgen.programs(), k=st.integers(0, 5))
def test_random_programs_on_gpu(fuzz_counter, prog, k):
    stepgen.check_program(prog, GPU_CONFIGS, shape=_shape(prog, k))
    fuzz_counter("test_fuzz_gpu core (5 launch shapes)", prog)


@fuzz_settings(15)
@given(prog=stepgen.programs(atomics=True), k=st.integers(0, 5))
def test_random_programs_with_atomics_on_gpu(fuzz_counter, prog, k):
    stepgen.check_program(prog, GPU_CONFIGS, shape=_shape(prog, k))
    fuzz_counter("test_fuzz_gpu lk.atomic (5 launch shapes)", prog)


# ------------------------------------------------------------------ the barrier regression
# integer heat-like smoothing with swap whose reduction the return skips while t < warm, so the
# step must keep its barrier (a missing one lets step t + 1 read neighbours that other blocks
# have not written yet): test_fuzz's ret_or
smooth_warm = ret_or


def heat_warm(t, u, v, tol, warm):
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        v[i] = u[i] + 0.25 * (u[i - 1] - 2.0 * u[i] + u[i + 1])
        err = max(err, abs(v[i] - u[i]))
    return t < warm or lk.max(err) > tol


def heat_warm_ifexp(t, u, v, tol, warm):
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        v[i] = u[i] + 0.25 * (u[i - 1] - 2.0 * u[i] + u[i + 1])
        err = max(err, abs(v[i] - u[i]))
    return lk.max(err) > tol if t >= warm else True


SMOOTH = lk.megakernel(smooth_warm, swap=[("u", "v")])
HEAT = lk.megakernel(heat_warm, swap=[("u", "v")])
HEAT_IFEXP = lk.megakernel(heat_warm_ifexp, swap=[("u", "v")])


def _smooth_ref(u0, tol, warm, max_steps):
    # NumPy, exact: (u, v, steps) after the run, with the two-buffer rename
    u, v = u0.copy(), u0.copy()
    steps = 0
    while steps < max_steps:
        v[1:-1] = (u[:-2] + 2 * u[1:-1] + u[2:]) // 4
        err = np.abs(v[1:-1] - u[1:-1]).max()
        u, v = v, u
        steps += 1
        if not (steps - 1 < warm or err > tol):
            break
    return u, v, steps


def _heat_ref(x0, tol, warm, max_steps):
    u, v = x0.copy(), x0.copy()
    steps = 0
    while steps < max_steps:
        v[1:-1] = u[1:-1] + 0.25 * (u[:-2] - 2.0 * u[1:-1] + u[2:])
        err = np.abs(v[1:-1] - u[1:-1]).max()
        u, v = v, u
        steps += 1
        if not (steps - 1 < warm or err > tol):
            break
    return u, v, steps


@pytest.mark.parametrize("scope,blocks", [("grid", 1), ("grid", 2), ("grid", 3), ("grid", 8), ("grid", None),
                                          ("block", None)])
@pytest.mark.parametrize("warm", [5, 60])
def test_short_circuit_return_keeps_the_step_barrier(scope, blocks, warm):
    # 4K elements, several block counts: bit for bit against NumPy (integers), the float
    # variants to 1e-12; the interpreter checks the NumPy references on a short run
    n = 4096
    rng = np.random.default_rng(warm)
    u0 = rng.integers(0, 1 << 14, n)
    ru, rv, rsteps = _smooth_ref(u0, 8, warm, 400)
    assert warm < rsteps < 400             # the reduction is skipped on some steps, then stops the loop
    for threads in (None, 64):
        u, v = u0.copy(), u0.copy()
        run = SMOOTH(u, v, 8, warm, max_steps=400, backend="cuda", scope=scope, blocks=blocks, threads=threads)
        assert (run.steps, run.stopped) == (rsteps, "condition")
        np.testing.assert_array_equal(u, ru)
        np.testing.assert_array_equal(v, rv)
    x0 = rng.random(n)
    hu, hv, hsteps = _heat_ref(x0, 1e-3, warm, 300)
    assert warm < hsteps < 300
    for kernel in (HEAT, HEAT_IFEXP):
        u, v = x0.copy(), x0.copy()
        run = kernel(u, v, 1e-3, warm, max_steps=300, backend="cuda", scope=scope, blocks=blocks)
        assert (run.steps, run.stopped) == (hsteps, "condition")
        np.testing.assert_allclose(u, hu, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(v, hv, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fn,ref", [(smooth_warm, _smooth_ref), (heat_warm, _heat_ref),
                                    (heat_warm_ifexp, _heat_ref)])
def test_barrier_regression_references_agree_with_the_interpreter(fn, ref):
    rng = np.random.default_rng(1)
    x0 = rng.integers(0, 1 << 20, 300) if fn is smooth_warm else rng.random(300)
    tol = 2 if fn is smooth_warm else 1e-4
    args = [x0.copy(), x0.copy(), tol, 5]
    want = interp.run(fn, args, 40, swap=[("u", "v")])
    u, v, steps = ref(x0, tol, 5, 40)
    assert want.steps == steps
    np.testing.assert_allclose(args[0], u, rtol=1e-13)
    np.testing.assert_allclose(args[1], v, rtol=1e-13)


# ------------------------------------------------------------------ chunk invariance
import test_chunks as C  # noqa: E402

GPU_CHUNK_CASES = [pytest.param(name, scope, blocks, id=f"{name}-{scope}-{blocks}")
                   for name, w in C.WORKLOADS.items()
                   for scope, blocks in ([("thread", None), ("auto", None)] if w.sequential else
                                         [("grid", 1), ("grid", 3), ("grid", None), ("block", None)])]


@pytest.mark.parametrize("name,scope,blocks", GPU_CHUNK_CASES)
@fuzz_settings(4)
@given(split=C.splits(max_total=12), start=C.START, seed=st.integers(0, 2 ** 64 - 1), hows=C.HOWS,
       data_seed=st.integers(0, 1000))
def test_split_run_equals_one_call_on_gpu(fuzz_counter, name, scope, blocks, split, start, seed, hows, data_seed):
    # the GPU contracts a*b+c into FMAs and its normal draws can differ in the last bit: float
    # workloads match the interpreter to 1e-9, the split run the one call bit for bit
    C.check_split(name, "cuda", scope, split, start, 4093, seed, None, hows, data_seed, blocks=blocks,
                  tol_scale=1e3)
    fuzz_counter(f"test_fuzz_gpu chunks {name} {scope}")
