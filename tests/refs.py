"""Independent references for the tests: written from the published algorithms and from the
mathematics, sharing no code with loopkern.

- ``philox4x32_10``: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as
  easy as 1, 2, 3", SC 2011) on Python ints; ``philox4x32_10_np`` the same on NumPy arrays;
  ``draws_np``: lk.random's uniform and normal draws for (seed, step, key, subkey, call site).
- ``heat_exact``: the 1-D heat stencil with fixed ends after any number of steps, from its
  eigen-decomposition (a discrete sine transform), in O(n log n) whatever the step count.
- ``shift_step``/``shift_ref``: a step whose state after N steps has a closed form (exact in
  float64 and in integers): every element takes its right neighbour's value plus one.
- ``busy_ref``, ``count_ref``: the state of workloads.py's ``busy_step`` and ``count_step``
  after any number of steps, in closed form.
- ``jax_x64``: a context in which JAX computes in float64 (references run by ``jax.lax``).
- ``np_threefry``: Threefry-2x32-20 (same paper) on NumPy arrays; ``np_bits`` and ``np_fold_in``:
  ``jax.random.bits`` (32-bit, ``jax_threefry_partitionable`` on) and ``jax.random.fold_in`` from it.
"""

import math

import numpy as np

import loopkern as lk

# ------------------------------------------------------------------------------ Philox4x32-10
PHILOX_M = (0xD2511F53, 0xCD9E8D57)      # round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)      # Weyl key bumps (golden ratio, sqrt(3) - 1)
MASK32 = 0xFFFFFFFF


def philox4x32_10(ctr, key, rounds=10):
    """Random123's philox4x32 on Python ints: ``ctr`` four 32-bit words, ``key`` two."""
    c0, c1, c2, c3 = (int(x) & MASK32 for x in ctr)
    k0, k1 = (int(x) & MASK32 for x in key)
    for r in range(rounds):
        if r:                                   # the key is bumped between rounds
            k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
        hi0, lo0 = divmod(PHILOX_M[0] * c0, 1 << 32)
        hi1, lo1 = divmod(PHILOX_M[1] * c2, 1 << 32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _mulhilo_np(m, x):
    # 32 x 32 -> 64 bits, exact in uint64; split into the high and low words
    p = np.uint64(m) * x.astype(np.uint64)
    return p >> np.uint64(32), p & np.uint64(MASK32)


def philox4x32_10_np(ctr, key, rounds=10):
    """The same on NumPy arrays (broadcast); returns four uint64 arrays of 32-bit words."""
    c = [np.asarray(x, np.uint64) & np.uint64(MASK32) for x in ctr]
    k0, k1 = (np.asarray(x, np.uint64) & np.uint64(MASK32) for x in key)
    for r in range(rounds):
        if r:
            k0 = (k0 + np.uint64(PHILOX_W[0])) & np.uint64(MASK32)
            k1 = (k1 + np.uint64(PHILOX_W[1])) & np.uint64(MASK32)
        hi0, lo0 = _mulhilo_np(PHILOX_M[0], c[0])
        hi1, lo1 = _mulhilo_np(PHILOX_M[1], c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


SITE_MULT = 0x85EBCA6B
STEP_HI_MULT = 0xC2B2AE35
SUBKEY_HI_MULT = 0x27D4EB2F


def draw_words_np(seed, step, key, subkey, site):
    """The four words behind one lk.random draw. Layout (loopkern/runtime/philox.py): counter
    = (key low word, key high word, subkey low word, step low word), Philox key = (seed low
    word, seed high word XOR the low words of site * 0x85EBCA6B, of (step >> 32) * 0xC2B2AE35
    and of (subkey >> 32) * 0x27D4EB2F); keys and subkeys modulo 2**64; call sites count from
    1 in source order."""
    seed, site = int(seed), int(site)
    key = np.asarray(key, np.int64).astype(np.uint64)
    step = np.asarray(step, np.int64).astype(np.uint64)
    subkey = np.asarray(np.asarray(subkey, object) % (1 << 64), np.uint64)
    ctr = (key & np.uint64(MASK32), key >> np.uint64(32), subkey & np.uint64(MASK32),
           step & np.uint64(MASK32))
    step_hi = (step >> np.uint64(32)) * np.uint64(STEP_HI_MULT)
    subkey_hi = (subkey >> np.uint64(32)) * np.uint64(SUBKEY_HI_MULT)
    pkey = (np.uint64(seed & MASK32), (np.uint64((seed >> 32) ^ ((site * SITE_MULT) & MASK32)) ^ step_hi ^ subkey_hi)
            & np.uint64(MASK32))
    ctr = np.broadcast_arrays(*ctr)
    return philox4x32_10_np(ctr, pkey)


def uniform_np(seed, step, key, subkey, site):
    """float64 uniforms on [0, 1): 27 bits of the first word and 26 of the second (53 bits)."""
    a, b, _, _ = draw_words_np(seed, step, key, subkey, site)
    return ((a >> np.uint64(5)).astype(np.float64) * 2.0 ** 26 + (b >> np.uint64(6)).astype(np.float64)) / 2.0 ** 53


def normal_np(seed, step, key, subkey, site):
    """float64 standard normals: Box-Muller on the third and fourth words."""
    _, _, c, d = draw_words_np(seed, step, key, subkey, site)
    u1 = (c.astype(np.float64) + 1.0) / 2.0 ** 32          # (0, 1]: the log is finite
    u2 = d.astype(np.float64) / 2.0 ** 32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def normal_cdf(x):
    return 0.5 * (1.0 + np.vectorize(math.erf)(np.asarray(x) / math.sqrt(2.0)))


def ks_statistic(sample, cdf):
    """Kolmogorov-Smirnov distance between a sample and a continuous CDF."""
    x = np.sort(np.asarray(sample, np.float64))
    f = cdf(x)
    n = x.size
    return max(float(np.max(np.arange(1, n + 1) / n - f)), float(np.max(f - np.arange(n) / n)))


# ------------------------------------------------------------------------------ 1-D heat, exact
def _dst1(x):
    """DST-I along the last axis: X_k = sum_j x_j sin(pi j k / (N + 1)), j, k = 1..N, via the FFT."""
    n = x.shape[-1]
    y = np.zeros(x.shape[:-1] + (2 * (n + 1),))
    y[..., 1:n + 1] = x
    y[..., n + 2:] = -x[..., ::-1]
    return -np.fft.fft(y)[..., 1:n + 1].imag / 2.0


def heat_exact(u0, steps, alpha):
    """``v[i] = u[i] + alpha * (u[i-1] - 2 u[i] + u[i+1])`` for 1 <= i <= n-2 with both ends
    fixed, applied ``steps`` times, in float64. The ends' straight line is a fixed point; the
    rest is a sum of sine modes, mode k multiplied by 1 - 4 alpha sin^2(pi k / 2(n-1)) per step."""
    u0 = np.asarray(u0, np.float64)
    n = u0.shape[0]
    line = u0[0] + (u0[-1] - u0[0]) * np.arange(n) / (n - 1)
    if n < 3:
        return u0.copy()
    m = n - 2
    k = np.arange(1, m + 1)
    mu = 1.0 - 4.0 * alpha * np.sin(np.pi * k / (2.0 * (m + 1))) ** 2
    coef = _dst1(u0[1:-1] - line[1:-1]) * np.power(mu, float(steps))
    out = line.copy()
    out[1:-1] += _dst1(coef) * 2.0 / (m + 1)
    return out


# ------------------------------------------------------------------------------ shift and count
def shift_step(t, u, v):
    # every element takes its right neighbour's value plus one (periodic): after N steps
    # u[i] = u0[(i + N) % n] + N, so any thread that ran a step more or less than the others,
    # or read a neighbour before its step was done, shows up exactly
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[(i + 1) % n] + 1


def shift_ref(u0, steps):
    u0 = np.asarray(u0)
    return np.roll(u0, -(steps % u0.shape[0])) + u0.dtype.type(steps)


# ------------------------------------------------------------------------------ control steps
def busy_ref(x0, steps, slow_at, spin):
    # busy_step's state: x[0] counts the steps; step 'slow_at' maps x[1] through
    # a -> a * 0.999999 + 1e-6 'spin' times (closed form: the fixed point is 1)
    x = np.array(x0, np.float64)
    x[0] += steps
    if steps > slow_at:
        x[1] = 1.0 - (1.0 - x[1]) * 0.999999 ** spin
    return x


def count_ref(c0, steps, slow_at, spin):
    # count_step's state: c[0] counts the steps; from step 'slow_at' on, each step maps c[1]
    # through a -> a * 0.5 + 1 'spin' times (exact in binary; 2.0 after at most ~60 maps)
    c = np.array(c0, np.float64)
    c[0] += steps
    for _ in range(min(max(steps - slow_at, 0) * spin, 200)):
        c[1] = c[1] * 0.5 + 1.0
    return c


# ------------------------------------------------------------------------------ JAX in float64
def jax_x64():
    """A context in which JAX computes in float64 (``jax.enable_x64``; the experimental one of
    older JAX)."""
    import jax
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64
    return enable_x64()


# ------------------------------------------------------------------------------ Threefry-2x32
def _rotl32(x, r):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def np_threefry(k0, k1, c0, c1):
    """Threefry-2x32 with 20 rounds on NumPy uint32 arrays: the two words of the hash of the
    counters (c0, c1) under the key (k0, k1)."""
    with np.errstate(over="ignore"):
        k = [np.uint32(k0), np.uint32(k1), np.uint32(k0) ^ np.uint32(k1) ^ np.uint32(0x1BD11BDA)]
        x0, x1 = np.asarray(c0, np.uint32) + k[0], np.asarray(c1, np.uint32) + k[1]
        rot = [(13, 15, 26, 6), (17, 29, 16, 24)]
        for block in range(5):
            for r in rot[block % 2]:
                x0 = x0 + x1
                x1 = _rotl32(x1, r) ^ x0
            x0 = x0 + k[(block + 1) % 3]
            x1 = x1 + k[(block + 2) % 3] + np.uint32(block + 1)
    return x0, x1


def np_bits(key, n):
    """jax.random.bits(key, (n,), uint32) with jax_threefry_partitionable on: per flat index the
    xor of the two words of its hash (counter words: 0 and the index)."""
    h0, h1 = np_threefry(key[0], key[1], np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32))
    return h0 ^ h1


def np_fold_in(key, data):
    """jax.random.fold_in(key, data): the hash of the counter words (0, data)."""
    h0, h1 = np_threefry(key[0], key[1], np.zeros(1, np.uint32), np.asarray([data], np.uint32))
    return np.array([h0[0], h1[0]], np.uint32)


def np_split(key, n):
    """jax.random.split(key, n) with jax_threefry_partitionable on: key i is the hash of the
    counter words (0, i)."""
    h0, h1 = np_threefry(key[0], key[1], np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32))
    return [np.array([a, b], np.uint32) for a, b in zip(h0, h1)]


def np_uniform01(key):
    """jax.random.uniform(key, (), float32): the 23 high bits of the draw as a float32 in [1, 2),
    minus one (exact in float32; returned as a Python float)."""
    b = np_bits(key, 1)[0]
    return float(np.uint32((int(b) >> 9) | 0x3F800000).view(np.float32)) - 1.0


def np_normal(key, erfinv):
    """jax.random.normal(key, (), float32) in float64: sqrt(2) erfinv(u), u uniform on
    [nextafter(-1, 0), 1) in float32 (``erfinv``: a float64 inverse error function)."""
    lo = float(np.nextafter(np.float32(-1), np.float32(0)))
    u = float(np.float32(np.float32(np_uniform01(key)) * np.float32(1.0 - lo) + np.float32(lo)))
    return math.sqrt(2.0) * erfinv(max(lo, u))


def np_gamma(key, alphas, erfinv):
    """jax.random.gamma(key, alphas) in float64 (JAX's sampler: one key per element split from
    ``key``, then Marsaglia and Tsang's rejection loop per element, alpha < 1 boosted to alpha + 1
    and the sample scaled by a uniform to the power 1/alpha)."""
    out = []
    for k, alpha in zip(np_split(key, len(alphas)), alphas):
        boost = alpha >= 1
        a = alpha if boost else alpha + 1
        d = a - 1 / 3
        c = 1 / 3 / math.sqrt(d)
        k, sub = np_split(k, 2)
        X, V, U = 0.0, 1.0, 2.0
        while U >= 1 - 0.0331 * X * X and math.log(U) >= X * 0.5 + d * (1 - V + math.log(V)):
            k, xk, uk = np_split(k, 3)
            x, v = 0.0, -1.0
            while v <= 0:
                xk, s = np_split(xk, 2)
                x = np_normal(s, erfinv)
                v = 1 + x * c
            X, V, U = x * x, v * v * v, np_uniform01(uk)
        scale = 1.0 if boost else (1 - np_uniform01(sub)) ** (1 / alpha)
        out.append(d * V * scale)
    return np.array(out)
