"""CPU-backend runtime: one thread covers the whole grid, so a reduction is its own value."""

import numba
import numpy as np
from numba import types
from numba.extending import overload

from .philox import build


def _reduce_value(x):
    """A reduction over one thread: floats keep their type, integers and bools become int64."""
    return x


@overload(_reduce_value)
def _reduce_value_impl(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if isinstance(x, (types.Integer, types.Boolean)):
        return lambda x: np.int64(x)
    return None


reduce_sum = reduce_max = reduce_min = _reduce_value

_, random_uniform, random_normal = build(numba.njit)
