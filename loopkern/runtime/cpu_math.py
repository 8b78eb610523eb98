"""The ``math`` module as CPU kernels see it (``_lk_math`` in the CPU template).

Numba's CPU backend types every ``math`` function that steps may call except ``fmod`` and
``remainder`` (numba-cuda has both); the validator accepts them, so the CPU kernels get them
here with C's and Python's meaning: ``fmod`` keeps the sign of ``x``, ``remainder`` is the
IEEE 754 remainder (the quotient rounded to nearest, ties to even).
"""

import math as _math
from math import *  # noqa: F401,F403 - every other function is Numba's own math.*

import numba as _numba
import numba.extending  # noqa: F401 - _numba.extending.overload
import numpy as _np


def _float_of(x):
    return float(x)


@_numba.extending.overload(_float_of)
def _float_of_impl(x):
    # an integer becomes a float64, as in Python's math.fmod; float32 stays float32, as on a GPU
    if isinstance(x, _numba.types.Float):
        return lambda x: x
    return lambda x: _np.float64(x)


@_numba.njit(cache=False)
def fmod(x, y):
    # (NumPy's fmod of two integers is an integer remainder, and Numba's gets negative ones wrong)
    return _np.fmod(_float_of(x), _float_of(y))


@_numba.njit(cache=False)
def remainder(x, y):
    # CPython's algorithm (Modules/mathmodule.c m_remainder), so the CPU backend agrees with it
    if _math.isnan(x) or _math.isnan(y):
        return x + y
    if _math.isinf(x) or y == 0:
        return _math.nan
    if _math.isinf(y):
        return x * 1.0
    absx = abs(x)
    absy = abs(y)
    m = _np.fmod(absx, absy)
    c = absy - m
    if m < c:
        r = m
    elif m > c:
        r = -c
    else:
        r = m - 2.0 * _np.fmod(0.5 * (absx - m), absy)
    return _math.copysign(1.0, x) * r
