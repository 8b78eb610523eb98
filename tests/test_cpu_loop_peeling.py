"""A step whose loop mixes a wrapped index with clamped ones, compiled for the CPU backend.

llvmlite 0.50's LLVM aborts the whole process on such loops when it peels their last
iterations (compile._without_loop_peeling turns peeling off). Each case runs in a child
process, so that an abort fails this test instead of ending the test run."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STEP = textwrap.dedent("""
    import numpy as np
    import loopkern as lk

    @lk.megakernel(swap=[("u", "v")])
    def mixed(t, u, v):
        n = u.shape[0]
        for i in lk.range(n):
            a = np.float32(-0.189) * u[i] + u[i - 6 if i >= 6 else i - 6 + n]
            near = u[max(i - 2, 0)]
            behind = u[max(i - 8, 0)]
            ahead = u[min(i + 14, n - 1)]
            b = np.float32(-0.189) * near + (ahead if i - 2 < 6 else behind) if i >= 2 else np.float32(0.0)
            v[i] = np.float32(-0.107) * a + np.float32(-0.393) * (b if i >= 2 else np.float32(0.25))

    u0 = np.random.default_rng(0).standard_normal(22).astype(np.float32)
    u, v = u0.copy(), u0.copy()
    run = mixed(u, v, steps=3, backend="cpu")
    x = u0.astype(np.float64)
    for _ in range(3):
        i = np.arange(22)
        a = -0.189 * x + x[(i - 6) % 22]
        near = np.where(i - 2 < 6, x[np.minimum(i + 14, 21)], x[np.maximum(i - 8, 0)])
        b = -0.189 * x[np.maximum(i - 2, 0)] + near
        x = -0.107 * a - 0.393 * np.where(i >= 2, b, 0.25)
    np.testing.assert_allclose(u, x, rtol=1e-5, atol=1e-6)
    print("same as NumPy after", run.steps, "steps")
""")

LOWERED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    import jax
    import jax.numpy as jnp
    from lowered_steps import run_lowered

    def body(i, x):
        x = -0.189 * x + jnp.concatenate([x[16:], x[:16]])
        x = -0.107 * x - 0.393 * jnp.pad(x[:20], ((2, 0),), constant_values=0.25)
        return jnp.tanh(x)
    x0 = np.random.default_rng(1).standard_normal(22).astype(np.float32)
    got, _, _ = run_lowered(body, x0, 3, "cpu")
    x = x0.astype(np.float64)
    for _ in range(3):
        x = -0.189 * x + np.concatenate([x[16:], x[:16]])
        x = np.tanh(-0.107 * x - 0.393 * np.concatenate([[0.25, 0.25], x[:20]]))
    np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-6)
    print("same as NumPy")
""")


def _run(code, tmp_path):
    """Run ``code`` as a script (a step's source must be in a file) in a child process with
    empty caches."""
    script = tmp_path / "case.py"
    script.write_text(code)
    env = dict(os.environ, LOOPKERN_CACHE_DIR=str(tmp_path / "lk"), NUMBA_CACHE_DIR=str(tmp_path / "nb"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)


def test_a_step_mixing_wrapped_and_clamped_indices_compiles_on_the_cpu(tmp_path):
    r = _run(STEP, tmp_path)
    assert r.returncode == 0 and "same as NumPy" in r.stdout, r.stderr[-2000:]


def test_a_lowered_roll_and_pad_body_compiles_on_the_cpu(tmp_path):
    pytest.importorskip("jax")
    r = _run(LOWERED.format(tests=str(ROOT / "tests")), tmp_path)
    assert r.returncode == 0 and "same as NumPy" in r.stdout, r.stderr[-2000:]
