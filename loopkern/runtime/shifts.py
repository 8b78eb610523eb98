"""``x << n`` and ``x >> n`` with NumPy's meaning of a count of 64 or more, or a negative one
(0, or the sign: NumPy takes the count as unsigned), the same on the CPU backend, the GPU and
the simulator (whose array elements are NumPy scalars).

LLVM's shift by the operand's width or more is poison: on the CPU some elements came out
unchanged and ``1 << 65`` was 2; on the GPU a constant count of 64 or more made NVVM drop the
store, and a variable count was cut to 32 bits before PTX's clamping shift. Every shift below
has a count from 0 to 63: the second one moves out the last bit.
"""


def build_python():
    """Plain ``lshift``/``rshift`` for the simulator (NumPy's shifts of its scalars already give
    0 or the sign)."""
    def lshift(x, n):
        return x << n

    def rshift(x, n):
        return x >> n
    return lshift, rshift


def build_numba(overload, target):
    """``lshift``/``rshift`` for Numba's ``target`` ("cpu" or "cuda"), through ``overload``."""
    from numba import types

    def lshift(x, n):
        """``x << n``; a count of 64 or more, or a negative one, gives 0."""
        return x << n

    def rshift(x, n):
        """``x >> n``; a count of 64 or more, or a negative one, gives the sign (0 or -1; 0 for
        unsigned)."""
        return x >> n

    def integers(x, n):
        return all(isinstance(v, (types.Integer, types.Boolean)) for v in (x, n))

    @overload(lshift, target=target)
    def _lshift_impl(x, n):
        if integers(x, n):
            return lambda x, n: (x << (63 if n < 0 or n > 63 else n)) << (1 if n < 0 or n > 63 else 0)
        return lambda x, n: x << n

    @overload(rshift, target=target)
    def _rshift_impl(x, n):
        if integers(x, n):
            return lambda x, n: (x >> (63 if n < 0 or n > 63 else n)) >> (1 if n < 0 or n > 63 else 0)
        return lambda x, n: x >> n
    return lshift, rshift
