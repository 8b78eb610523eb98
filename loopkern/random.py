"""Counter-based random numbers inside a step: ``lk.random.uniform`` and ``lk.random.normal``.

Each draw is a pure function of the call's ``seed=`` argument, the step index, the key (and
subkey) you pass, and which call in the step it is, never of the thread that makes it. So the
numbers are reproducible from the seed and the same for any number of threads or blocks.
``uniform`` is bit-for-bit the same on the CPU, the simulator and the GPU; ``normal`` too between
the CPU and the simulator, while on the GPU it can differ in the last bit or two (about 1e-16
relative), because CUDA's ``log`` and ``cos`` round differently from the CPU's.
Use the loop index as the key, and a subkey to draw several numbers per index:

    for i in lk.range(n):
        x[i] += sigma * lk.random.normal(i)
        for k in range(3):
            v[i, k] = lk.random.uniform(i, k)

Keys and subkeys are integers, taken modulo 2**64; every bit of the key, the subkey and the step
index counts (subkeys or steps 2**32 apart draw different numbers). Results are float64; cast
with ``np.float32(...)`` for float32 arithmetic.
"""

from .dsl import Intrinsic

uniform = Intrinsic("random_uniform", """A float64 uniform on [0, 1): ``lk.random.uniform(key[, subkey])``.""",
                    "lk.random.uniform")
normal = Intrinsic("random_normal", """A float64 standard normal: ``lk.random.normal(key[, subkey])``.""",
                   "lk.random.normal")
