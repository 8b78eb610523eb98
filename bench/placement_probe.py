"""Does where the two buffers of a swap pair lie change a memory-bound step's speed? kernel.jax's
Jacobi 2048² ran 1.75x slower per step than the direct call at the same launch shape (session
39, H100: 28.3 against 16.2 µs/step at 264 blocks), from the same kernel source. XLA places its
buffers one after another, so the pair's buffers may be exactly 16 MiB apart (a power of two),
where Numba's separate allocations are not. Times the direct call on u and v cut from one
allocation at several distances, and on two separate allocations; interleaved rounds, medians
of host wall time per blocking call; every variant must end bit for bit where the first does.

    python bench/placement_probe.py [side] [steps] [rounds]
"""
import os
import statistics
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from numba import cuda  # noqa: E402

from bench.jacobi import jacobi_kernel, jacobi_problem, timed_direct_call  # noqa: E402

side = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 600
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
tol = np.float32(-1.0)
u0 = jacobi_problem(side, np.random.default_rng(0))
nbytes = u0.nbytes
k = jacobi_kernel()


def pair(gap):
    """u and v from one allocation, v starting ``gap`` bytes after u; None: two allocations."""
    if gap is None:
        return cuda.to_device(u0), cuda.to_device(u0)
    big = cuda.device_array((gap + nbytes) // 4, np.float32)
    n = u0.size
    u = big[:n].reshape(u0.shape)
    v = big[gap // 4:gap // 4 + n].reshape(u0.shape)
    u.copy_to_device(u0)
    v.copy_to_device(u0)
    return u, v


MiB = 1 << 20
gaps = {"separate allocations": None, "v at u + size (adjacent)": nbytes, "v at u + 32 MiB": 32 * MiB,
        "v at u + size + 256 B": nbytes + 256, "v at u + size + 4 KiB": nbytes + 4096,
        "v at u + size + 64 KiB": nbytes + 65536, "v at u + size + 1 MiB": nbytes + MiB,
        "v at u + 1.5 size": nbytes + nbytes // 2}
bufs = {name: pair(g) for name, g in gaps.items()}
times = {name: [] for name in gaps}
out, cfg = {}, {}


def run(name):
    dt, out[name], cfg[name] = timed_direct_call(k, *bufs[name], u0, tol, steps)
    return dt


def address(a):
    try:
        return a.__cuda_array_interface__["data"][0]
    except AttributeError:                            # Numba's simulator (a smoke test)
        return a.copy_to_host().__array_interface__["data"][0]


for name in gaps:
    run(name)
for _ in range(rounds):
    for name in gaps:
        times[name].append(run(name))
first = next(iter(gaps))
for name, ts in times.items():
    u, v = bufs[name]
    same = "bitwise equal" if np.array_equal(out[name], out[first]) else "DIFFERS"
    gap = address(v) - address(u)
    print(f"jacobi {side}^2 {cfg[name]}, {name:26s} (v - u = {gap:>10d} B): "
          f"{statistics.median(ts) / steps * 1e6:7.3f} µs/step (min {min(ts) / steps * 1e6:.3f}), {same}")
