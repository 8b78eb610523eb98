"""The ``math`` module as CPU kernels see it (``_lk_math`` in the CPU template).

Numba's CPU backend types every ``math`` function that steps may call except ``fmod`` and
``remainder`` (numba-cuda has both); the validator accepts them, so the CPU kernels get them
here with C's and Python's meaning: ``fmod`` keeps the sign of ``x``, ``remainder`` is the
IEEE 754 remainder (the quotient rounded to nearest, ties to even).
"""

import math as _math
from math import *  # noqa: F401,F403 - every other function is Numba's own math.*

import numba as _numba
import numpy as _np


@_numba.njit(cache=False)
def fmod(x, y):
    return _np.fmod(x, y)


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
