"""Philox4x32-10, the counter-based generator behind ``lk.random``, written once in the
subset of Python that Numba compiles for the CPU and the GPU and that the simulator runs.

A draw is a pure function of (seed, step, key, subkey, call site), never of the thread that
makes it, so results are the same on every backend and for every launch configuration.
Checked against the Random123 known-answer vectors in tests/test_random.py.
"""

import math

import numpy as np

_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_MASK = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_S5 = np.uint64(5)
_S6 = np.uint64(6)
_TWO26 = np.uint64(67108864)
_INV53 = 1.0 / 9007199254740992.0
_INV32 = 1.0 / 4294967296.0
_SITE = np.uint64(0x85EBCA6B)
_STEP_HI = np.uint64(0xC2B2AE35)
_SUBKEY_HI = np.uint64(0x27D4EB2F)


def build(jit, python: bool = False):
    """The generator's functions compiled with ``jit`` (numba.njit, cuda.jit(device=True), or
    the identity for plain Python); returns (philox4x32_10, uniform, normal). ``python``: the
    functions run as Python (the simulator, plain Python)."""

    if python:
        def u64(x):
            # Numba's cast of a negative int64 key or subkey wraps modulo 2**64; NumPy 2's
            # refuses a negative Python int (OverflowError): wrap it the same way here
            return np.uint64(int(x) & 0xFFFFFFFFFFFFFFFF)
    else:
        @jit
        def u64(x):
            return np.uint64(x)

    @jit
    def philox4x32_10(c0, c1, c2, c3, k0, k1):
        """Ten Philox rounds on a 128-bit counter and 64-bit key, as 32-bit values in uint64s."""
        for _ in range(10):
            p0 = _M0 * c0
            p1 = _M1 * c2
            n0 = ((p1 >> _S32) ^ c1 ^ k0) & _MASK
            n2 = ((p0 >> _S32) ^ c3 ^ k1) & _MASK
            c0, c1, c2, c3 = n0, p1 & _MASK, n2, p0 & _MASK
            k0 = (k0 + _W0) & _MASK
            k1 = (k1 + _W1) & _MASK
        return c0, c1, c2, c3

    @jit
    def draw(seed, t, key, subkey, site):
        """The four 32-bit words for one (seed, step, key, subkey, call site).

        The step's low word is the counter's last word; its high word (zero below 2**32
        steps, so those draws do not depend on it) is mixed into the Philox key with the
        call site, so steps 2**32 apart draw different numbers; so is the subkey's high word
        (zero for subkeys below 2**32, whose draws are what they were before it counted)."""
        s = u64(seed)
        k = u64(key)
        st = u64(t)
        sk = u64(subkey)
        return philox4x32_10(k & _MASK, k >> _S32, sk & _MASK, st & _MASK, s & _MASK,
                             ((s >> _S32) ^ (np.uint64(site) * _SITE) ^ ((st >> _S32) * _STEP_HI)
                              ^ ((sk >> _S32) * _SUBKEY_HI)) & _MASK)

    @jit
    def uniform(seed, t, key, subkey, site):
        """A float64 uniform on [0, 1) with 53 random bits."""
        a, b, _, _ = draw(seed, t, key, subkey, site)
        return float((a >> _S5) * _TWO26 + (b >> _S6)) * _INV53

    @jit
    def normal(seed, t, key, subkey, site):
        """A float64 standard normal (Box-Muller on two 32-bit words)."""
        _, _, c, d = draw(seed, t, key, subkey, site)
        u1 = (float(c) + 1.0) * _INV32
        u2 = float(d) * _INV32
        return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)

    return philox4x32_10, uniform, normal
