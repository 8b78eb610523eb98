"""Python floats take the arrays' precision (NumPy 2 and JAX): float32 arrays stay float32
arithmetic, on every backend, as NumPy computes it."""

import math

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern import codegen

BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_arrays_compute_in_float32_like_numpy(backend, rng):
    x = rng.random(300).astype(np.float32)
    y = np.zeros_like(x)
    lk.megakernel(W.scale_step)(x, y, 0.3, steps=1, backend=backend)
    expect = x * 0.1 + 0.3 * x                  # NumPy 2: float32 throughout
    assert expect.dtype == np.float32
    np.testing.assert_array_equal(y, expect)
    promoted = (x.astype(np.float64) * 0.1 + 0.3 * x.astype(np.float64)).astype(np.float32)
    assert not np.array_equal(promoted, expect)  # the test can tell the two apart


def constants_step(t, u, v):
    for i in lk.range(u.shape[0]):
        v[i] = (u[i] * math.pi + np.pi) * u[i] - math.e * math.tau


@pytest.mark.parametrize("backend", BACKENDS)
def test_math_and_numpy_constants_are_python_floats_too(backend, rng):
    """math.pi, np.pi, math.e, math.tau take the arrays' precision as a literal does (they were
    float64 on the CPU backend, so float32 expressions rounded differently from NumPy's)."""
    x = rng.random(300).astype(np.float32)
    y = np.zeros_like(x)
    lk.megakernel(constants_step)(x, y, steps=1, backend=backend)
    expect = (x * math.pi + np.pi) * x - math.e * math.tau
    assert expect.dtype == np.float32
    np.testing.assert_array_equal(y, expect)
    promoted = ((x.astype(np.float64) * math.pi + np.pi) * x - math.e * math.tau).astype(np.float32)
    assert not np.array_equal(promoted, expect)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_arrays_are_unchanged(backend, rng):
    x = rng.random(300)
    y = np.zeros_like(x)
    lk.megakernel(W.scale_step)(x, y, 0.3, steps=1, backend=backend)
    np.testing.assert_array_equal(y, x * 0.1 + 0.3 * x)


def test_an_explicit_float64_stays_float64(rng):
    x = rng.random(300).astype(np.float32)
    y = np.zeros_like(x)
    lk.megakernel(W.scale_step)(x, y, np.float64(0.3), steps=1, backend="cpu")
    np.testing.assert_array_equal(y, (x * np.float32(0.1) + np.float64(0.3) * x.astype(np.float64))
                                  .astype(np.float32))


def test_codegen_gives_literals_the_float_type():
    spec = lk.megakernel(W.scale_step).spec
    text = codegen.render_kernel(spec, "cuda", "grid", float_type="float32").text
    assert "_lk_np.float32(0.1)" in text
    assert "_lk_np.float32(0.1)" not in codegen.render_kernel(spec, "cuda", "grid").text


def test_kernel_jax_gives_python_floats_the_arrays_precision_with_x64_on(rng):
    """As a direct call does: with x64 on, JAX makes a Python float float64, which made
    kernel.jax compute float32 arrays' expressions in float64 (last-bit differences)."""
    jax = pytest.importorskip("jax")
    from refs import jax_x64
    x = rng.random(300).astype(np.float32)
    expect = x * 0.1 + 0.3 * x
    k = lk.megakernel(W.scale_step)
    with jax_x64():
        jnp = jax.numpy
        for scalar in (0.3, jnp.asarray(0.3)):
            _, y = k.jax(jnp.asarray(x), jnp.zeros(300, jnp.float32), scalar, steps=1, backend="cpu")
            np.testing.assert_array_equal(np.asarray(y), expect)
        y = jax.jit(lambda a, s: k.jax(a, jnp.zeros(300, jnp.float32), s, steps=1)[1])(jnp.asarray(x), 0.3)
        np.testing.assert_array_equal(np.asarray(y), expect)


def mixed_step(t, u, out, c):
    for i in lk.range(u.shape[0]):
        out[i] = u[i] * 0.1 + 0.2 + c * u[i] + math.pi * u[i]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_precision_arrays_compute_python_floats_in_float64(backend, rng):
    """Beside a float64 array, Python floats (literals, math.pi, arguments) are float64, and a
    float32 element meets them in float64, as Numba compiles it for a GPU. The simulator ran
    the kernel as Python, where NumPy 2 made u[i] * 0.1 float32 arithmetic (found in session 32)."""
    u = rng.random(300).astype(np.float32)
    out = np.zeros(300)
    lk.megakernel(mixed_step)(u, out, 0.3, steps=1, backend=backend)
    u64 = u.astype(np.float64)
    expect = u64 * 0.1 + 0.2 + 0.3 * u64 + math.pi * u64
    np.testing.assert_array_equal(out, expect)
    in_float32 = (u * 0.1 + 0.2 + 0.3 * u + math.pi * u).astype(np.float64)
    assert not np.array_equal(in_float32, expect)   # the test can tell the two apart
