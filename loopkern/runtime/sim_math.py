"""The ``math`` module as kernels see it under Numba's CUDA simulator (``_lk_math``).

The simulator runs a kernel as Python, so its ``math`` functions are CPython's, which raise
``ValueError`` or ``OverflowError`` where a GPU (and the CPU backend) returns the IEEE 754
result: ``sqrt(-1.0)`` is NaN, ``log(0.0)`` is -inf, ``exp(1000.0)`` is inf, ``fmod(inf, 1.0)``
is NaN. Here each such function returns that result instead of raising, so a simulator test
sees what the GPU computes. Functions that return integers in CPython (``floor``, ``ceil``,
``trunc``) keep CPython's meaning.

A float function of float32 arguments only returns a float32 here, as Numba's does on a GPU
(``log1p(u[i]) - expm1(u[i])`` of a float32 element is float32 arithmetic there; CPython's
float kept the float64 value).
"""

import math as _math
from math import *  # noqa: F401,F403 - every function not wrapped below is CPython's own

import numpy as _np

_INF, _NAN = _math.inf, _math.nan


def _odd_integer(y):
    return _math.isfinite(y) and y == _math.floor(y) and _math.fmod(y, 2.0) != 0.0


def _pow_special(x, y):
    """``pow(x, y)`` where CPython raises: a zero to a negative power (a pole), a negative
    number to a non-integer power (NaN), or an overflow."""
    if x == 0.0 and y < 0:
        return _math.copysign(_INF, x) if _odd_integer(y) else _INF
    if x < 0 and _math.isfinite(y) and y != _math.floor(y):
        return _NAN
    return -_INF if x < 0 and _odd_integer(y) else _INF


# what each function returns where CPython raises ValueError (a domain error or a pole)
_DOMAIN = {
    "log": lambda x, *b: -_INF if x == 0 else _NAN,
    "log2": lambda x: -_INF if x == 0 else _NAN,
    "log10": lambda x: -_INF if x == 0 else _NAN,
    "log1p": lambda x: -_INF if x == -1 else _NAN,
    "atanh": lambda x: _math.copysign(_INF, x) if abs(x) == 1 else _NAN,
    "lgamma": lambda x: _INF,
    "gamma": lambda x: _math.copysign(_INF, x) if x == 0 else _NAN,
    "pow": _pow_special,
}
# ... and where it raises OverflowError
_OVERFLOW = {
    "sinh": lambda x: _math.copysign(_INF, x),
    "ldexp": lambda x, i: _math.copysign(_INF, x),
    "pow": _pow_special,
}
# the functions that can raise (hypot, atan2, erf, tanh and the like return their IEEE result
# in CPython already)
_WRAPPED = ("sqrt", "exp", "expm1", "exp2", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin",
            "acos", "acosh", "atanh", "sinh", "cosh", "pow", "fmod", "remainder", "lgamma", "gamma", "ldexp")


def _ieee(name):
    fn = getattr(_math, name)
    domain = _DOMAIN.get(name, lambda *a: _NAN)
    overflow = _OVERFLOW.get(name, lambda *a: _INF)

    def wrapped(*args):
        try:
            return fn(*args)
        except ValueError:
            return domain(*args)
        except OverflowError:
            return overflow(*args)
    wrapped.__name__ = wrapped.__qualname__ = name
    wrapped.__doc__ = f"math.{name} with the IEEE 754 result where CPython raises."
    return wrapped


for _name in _WRAPPED:
    if hasattr(_math, _name):
        globals()[_name] = _ieee(_name)

# the functions whose result is a float of their arguments' precision (ldexp: its first's)
_FLOATING = ("sqrt", "exp", "expm1", "exp2", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin",
             "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "pow", "hypot", "fmod",
             "remainder", "copysign", "erf", "erfc", "gamma", "lgamma", "fabs", "degrees", "radians", "cbrt",
             "ldexp")


def _single(name):
    fn = globals()[name]
    first_only = name == "ldexp"

    def wrapped(*args):
        r = fn(*args)
        decides = args[:1] if first_only else args
        if decides and all(isinstance(a, _np.float32) for a in decides):
            return _np.float32(r)
        return r
    wrapped.__name__ = wrapped.__qualname__ = name
    wrapped.__doc__ = fn.__doc__
    return wrapped


for _name in _FLOATING:
    if _name in globals():
        globals()[_name] = _single(_name)
del _name
