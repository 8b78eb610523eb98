"""Steps with a running maximum over 18-23 constant trips inside a parallel loop, compiled for
the CPU backend.

With llvmlite 0.50's LLVM such a loop was unrolled whole, and the loop vectorizer then took time
exponential in the trip count on the loop around it: a lowered ``jnp.max(x, axis=1)`` over 18
columns did not finish compiling (README listed it as not fixed since session 28). Since session
43 loopkern caps LLVM's unrolling while it compiles a CPU kernel (compile._cpu_unroll_capped).

Each case runs in a child process with empty caches and a limit far beyond the compile it needs
(about a second): a compile that does not end fails the test instead of hanging the run. The
results are checked against float64 NumPy, NaNs included."""

import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 300

LOWERED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    import jax.numpy as jnp
    from lowered_steps import run_lowered

    def body(i, x):
        return x * 0.5 + jnp.{op}(x, axis=1, keepdims=True)
    x0 = np.random.default_rng({cols}).standard_normal((5, {cols})).astype(np.float32)
    x0[2, 7] = np.nan                    # a NaN row: the maximum and minimum are NaN, as in JAX
    got, _, _ = run_lowered(body, x0, 3, "cpu")
    x = x0.astype(np.float64)
    for _ in range(3):
        x = x * 0.5 + np.{op}(x, axis=1, keepdims=True)
    np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-6)
    assert np.isnan(got[2]).all() and not np.isnan(np.delete(got, 2, axis=0)).any()
    print("same as NumPy")
""")

HAND_WRITTEN = textwrap.dedent("""
    import math
    import numpy as np
    import loopkern as lk

    def nan_max(a, b):                           # NaN-keeping, +0 over -0: JAX's maximum
        if a > b or a != a:
            return a
        if b > a or b != b:
            return b
        return a if a != 0 or math.copysign(1.0, a) > 0 else b

    @lk.megakernel(swap=[("u", "v")])
    def row_max(t, u, v):
        for i, j in lk.grid(u.shape[0], {cols}):
            m = np.float32(-math.inf)
            for k in range({cols}):              # a constant count: LLVM may unroll it
                m = nan_max(m, u[i, k])
            v[i, j] = np.float32(0.5) * u[i, j] + m

    u0 = np.random.default_rng(3).standard_normal((6, {cols})).astype(np.float32)
    u0[4, 1] = np.nan
    u, v = u0.copy(), u0.copy()
    run = row_max(u, v, steps=4, backend="cpu")
    x = u0.astype(np.float64)
    for _ in range(4):
        x = 0.5 * x + np.max(x, axis=1, keepdims=True)
    np.testing.assert_allclose(u, x, rtol=1e-5, atol=1e-6)
    assert np.isnan(u[4]).all() and not np.isnan(np.delete(u, 4, axis=0)).any()
    print("same as NumPy after", run.steps, "steps")
""")


def _run(code, tmp_path):
    script = tmp_path / "case.py"
    script.write_text(code)
    env = dict(os.environ, LOOPKERN_CACHE_DIR=str(tmp_path / "lk"), NUMBA_CACHE_DIR=str(tmp_path / "nb"),
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                              timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the CPU kernel did not finish compiling and running in {LIMIT_S} s (a second is usual)")


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("cols", [18, 21])
def test_a_lowered_reduction_along_18_to_23_columns_compiles_on_the_cpu(tmp_path, op, cols):
    pytest.importorskip("jax")
    r = _run(LOWERED.format(tests=str(ROOT / "tests"), op=op, cols=cols), tmp_path)
    assert r.returncode == 0 and "same as NumPy" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("cols", [18, 20])
def test_a_step_with_a_constant_inner_loop_of_18_to_23_trips_compiles_on_the_cpu(tmp_path, cols):
    r = _run(HAND_WRITTEN.format(cols=cols), tmp_path)
    assert r.returncode == 0 and "same as NumPy" in r.stdout, r.stderr[-3000:]


def test_the_unrolling_cap_holds_for_loopkerns_compile_only(monkeypatch):
    """LLVM's options are process-wide: the cap is set for the CPU kernel's compile and LLVM's
    defaults are back after it (the user's own Numba code compiles as before), also when the
    compile fails."""
    import llvmlite.binding as llvm

    from loopkern import compile as lk_compile
    calls = []
    monkeypatch.setattr(llvm, "set_option", lambda name, option: calls.append(option))
    with lk_compile._cpu_unroll_capped():
        during = list(calls)
    assert during == list(lk_compile._CPU_UNROLL_OPTIONS)
    assert calls[len(during):] == list(lk_compile._CPU_UNROLL_DEFAULTS)
    calls.clear()
    with pytest.raises(RuntimeError):
        with lk_compile._cpu_unroll_capped():
            raise RuntimeError("a compile error")
    assert calls[-len(lk_compile._CPU_UNROLL_DEFAULTS):] == list(lk_compile._CPU_UNROLL_DEFAULTS)


def test_a_cpu_kernel_is_compiled_under_the_cap(monkeypatch, tmp_path):
    """The CPU backend's compile (CompiledKernel.specialize_types) runs inside the cap, and the
    kernel it builds computes what float64 NumPy does."""
    import llvmlite.binding as llvm

    import loopkern as lk
    from loopkern import compile as lk_compile
    monkeypatch.setenv("LOOPKERN_CACHE_DIR", str(tmp_path))
    seen = []
    real = lk_compile._cpu_unroll_capped

    @contextmanager
    def spy():
        with real():
            seen.append("compile")
            yield
    monkeypatch.setattr(lk_compile, "_cpu_unroll_capped", spy)
    options = []
    set_option = llvm.set_option
    monkeypatch.setattr(llvm, "set_option", lambda name, option: (options.append(option), set_option(name, option)))

    @lk.megakernel(swap=[("u", "v")])
    def smooth(t, u, v):
        for i in lk.range(1, u.shape[0] - 1):
            v[i] = np.float32(0.25) * (u[i - 1] + 2 * u[i] + u[i + 1])

    u0 = np.random.default_rng(5).random(37).astype(np.float32)
    u, v = u0.copy(), u0.copy()
    smooth(u, v, steps=3, backend="cpu")
    x = u0.astype(np.float64)
    for _ in range(3):
        x[1:-1] = 0.25 * (x[:-2] + 2 * x[1:-1] + x[2:])
    np.testing.assert_allclose(u, x, rtol=1e-6)
    assert seen == ["compile"]
    # (the first CPU compile of the process also turns loop peeling off: compile._without_loop_peeling)
    unrolling = [o for o in options if o.startswith(("-unroll-full-max-count", "-unroll-allow-partial"))]
    assert unrolling == list(lk_compile._CPU_UNROLL_OPTIONS) + list(lk_compile._CPU_UNROLL_DEFAULTS)
