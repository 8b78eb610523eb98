"""The simulator's math module (loopkern/runtime/sim_math.py): the IEEE 754 result, as NumPy
computes it in float64, where CPython's math raises; and a step run by the simulator that
calls such functions."""

import math

import numpy as np
import pytest

import loopkern as lk
from loopkern.runtime import sim_math

SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -3.0, 1e300, -1e300, 710.0, -800.0]

UNARY = {
    "sqrt": np.sqrt, "exp": np.exp, "expm1": np.expm1, "log": np.log, "log2": np.log2, "log10": np.log10,
    "log1p": np.log1p, "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos,
    "acosh": np.arccosh, "atanh": np.arctanh, "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh,
    "atan": np.arctan, "asinh": np.arcsinh, "cbrt": np.cbrt,
}
BINARY = {"fmod": np.fmod, "atan2": np.arctan2, "hypot": np.hypot}


def same(got, want):
    if math.isnan(want):
        return math.isnan(got)
    return got == pytest.approx(want, rel=1e-14, abs=0.0) and math.copysign(1.0, got) == math.copysign(1.0, want)


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_functions_give_ieee_results_where_python_raises(name):
    fn = getattr(sim_math, name)
    with np.errstate(all="ignore"):
        for x in SPECIAL:
            want = float(UNARY[name](np.float64(x)))
            assert same(fn(x), want), (name, x, fn(x), want)


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_functions_give_ieee_results_where_python_raises(name):
    fn = getattr(sim_math, name)
    with np.errstate(all="ignore"):
        for x in SPECIAL:
            for y in SPECIAL:
                want = float(BINARY[name](np.float64(x), np.float64(y)))
                assert same(fn(x, y), want), (name, x, y, fn(x, y), want)


def test_pow_poles_domain_and_overflow():
    """Where CPython's math.pow raises: a zero to a negative power, a negative number to a
    fractional one, an overflow."""
    with np.errstate(all="ignore"):
        for x in SPECIAL:
            for y in [-3.0, -2.0, -0.5, 0.5, 2.0, 3.0, 1e300, -1e300, math.inf, -math.inf, math.nan, 0.0]:
                try:
                    math.pow(x, y)
                    continue        # CPython's own result (C99's, as CUDA's; NumPy differs on -0.0 and -inf)
                except (ValueError, OverflowError):
                    pass
                want = float(np.power(np.float64(x), np.float64(y)))
                assert same(sim_math.pow(x, y), want), (x, y, sim_math.pow(x, y), want)


def test_poles_of_lgamma_and_gamma():
    assert sim_math.lgamma(0.0) == math.inf and sim_math.lgamma(-2.0) == math.inf
    assert sim_math.gamma(-0.0) == -math.inf and sim_math.gamma(0.0) == math.inf
    assert math.isnan(sim_math.gamma(-2.0))


def ieee_math_step(t, x, out):
    for i in lk.range(x.shape[0]):
        out[0, i] = math.sqrt(x[i])
        out[1, i] = math.log(x[i])
        out[2, i] = math.exp(x[i] * 1000.0)
        out[3, i] = math.fmod(x[i] * math.inf, 2.0)


@pytest.mark.sim
def test_a_step_under_the_simulator_gets_the_gpus_math():
    """A step calling math.sqrt/log/exp/fmod where CPython's raise runs under the simulator
    and gives NaN and infinities, as a GPU does (against NumPy in float64)."""
    x = np.array([-1.0, 0.0, -0.0, 2.0, 0.5, -2.0])
    out = np.zeros((4, x.size))
    lk.megakernel(ieee_math_step)(x, out, steps=1, backend="cuda")
    with np.errstate(all="ignore"):
        want = np.stack([np.sqrt(x), np.log(x), np.exp(x * 1000.0), np.fmod(x * np.inf, 2.0)])
    np.testing.assert_allclose(out, want, rtol=1e-14)
    finite = ~np.isnan(want)                                # (a NaN's sign bit means nothing)
    np.testing.assert_array_equal(np.signbit(out[finite]), np.signbit(want[finite]))


def test_float_functions_of_float32_values_return_float32():
    """Numba's math of float32 arguments is float32 (on a GPU and the CPU backend); CPython's
    returned a float, which kept float64 precision in the simulator (found in session 32)."""
    x, y = np.float32(0.3), np.float32(1.7)
    for name in sorted(UNARY) + ["fabs", "erf", "erfc", "lgamma", "degrees", "radians"]:
        got = getattr(sim_math, name)(x)
        assert type(got) is np.float32, name
        want = getattr(sim_math, name)(float(x))          # the float64 result, rounded once
        assert got == np.float32(want) or (math.isnan(got) and math.isnan(want)), name
        assert type(getattr(sim_math, name)(float(x))) is not np.float32, name      # a float stays a float
    for name in sorted(BINARY) + ["pow", "copysign"]:
        assert type(getattr(sim_math, name)(x, y)) is np.float32, name
        assert type(getattr(sim_math, name)(x, float(y))) is not np.float32, name   # float64 beside: float64
    assert type(sim_math.ldexp(x, 3)) is np.float32 and sim_math.ldexp(x, 3) == np.float32(2.4)
    assert isinstance(sim_math.floor(x), int)


def _cancelling(t, u, out):
    for i in lk.range(u.shape[0]):
        out[i] = math.log1p(u[i]) - math.expm1(u[i])


@pytest.mark.sim
def test_a_float32_step_calling_math_computes_in_float32_in_the_simulator():
    u = np.array([0.01, 0.3, 0.77], np.float32)
    out = np.zeros(3, np.float32)
    lk.megakernel(_cancelling)(u, out, steps=1, backend="cuda")
    want = np.array([np.float32(math.log1p(v)) - np.float32(math.expm1(v)) for v in u.astype(np.float64)])
    np.testing.assert_array_equal(out, want)
    in_float64 = np.array([math.log1p(v) - math.expm1(v) for v in u.astype(np.float64)]).astype(np.float32)
    assert not np.array_equal(in_float64, want)      # the test can tell the two apart
