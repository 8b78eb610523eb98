"""Whether the hand-written Jacobi step's time at 256² depends on where its buffers lie
(session 26, H100: loopkern[auto] 3.33 and loopkern[grid] 2.89 µs/step in one interleaved
bench.py run, the same grid of 132 x 256 threads, the same code; in an earlier run 3.32 and
3.25). Several kernel instances, each with its own arrays and scratch, timed in interleaved
rounds with CUDA events, each printed with the addresses of its arrays, reduction partials,
barrier counter and stop slots (offsets within 2 MiB pages and 128-byte lines). Then the
first instance again with fresh arrays, and with fresh scratch.

    python bench/instance_probe.py [instances] [rounds] [side]
"""

import os
import statistics
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from numba import cuda  # noqa: E402

from bench.jacobi import JACOBI_TOL, jacobi_kernel, jacobi_problem  # noqa: E402

count = int(sys.argv[1]) if len(sys.argv) > 1 else 6
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
side = int(sys.argv[3]) if len(sys.argv) > 3 else 256
u0 = jacobi_problem(side, np.random.default_rng(0))


def ptr(a):
    return a.device_ctypes_pointer.value


def where(p):
    return f"{p:#x} (+{p % (2 << 20):#x} in 2M, {p % 128:3d} in line)"


class Instance:
    def __init__(self, name, k=None):
        self.name = name
        self.k = k or jacobi_kernel()
        self.u, self.v = cuda.to_device(u0), cuda.to_device(u0)

    def once(self):
        self.u.copy_to_device(u0)
        self.v.copy_to_device(u0)
        cuda.synchronize()
        e0, e1 = cuda.event(), cuda.event()
        e0.record()
        r = self.k(self.u, self.v, JACOBI_TOL, max_steps=20000)
        e1.record()
        e1.synchronize()
        return cuda.event_elapsed_time(e0, e1) / 1e3, r

    def scratch(self):
        plans = list(self.k.dispatcher.plans.values())
        slots = [s for p in plans for s in p.slots._free]
        return slots[0].scratch if slots else ()


def measure(insts):
    times = {i.name: [] for i in insts}
    for rnd in range(rounds + 1):
        for i in insts:
            t, r = i.once()
            if rnd:
                times[i.name].append(t / r.steps)
    for i in insts:
        ts = times[i.name]
        i.median = statistics.median(ts)
        redf, redi, bar, stop = i.scratch()
        print(f"{i.name:28s} {statistics.median(ts) * 1e6:6.3f} µs/step (min {min(ts) * 1e6:.3f}, max "
              f"{max(ts) * 1e6:.3f})  u {where(ptr(i.u))}  v {where(ptr(i.v))}", flush=True)
        print(f"{'':28s} redf {where(ptr(redf))}  redi {where(ptr(redi))}  bar {where(ptr(bar))}  "
              f"stop {where(ptr(stop))}", flush=True)


insts = [Instance(f"instance {j}") for j in range(count)]
measure(insts)
for i in insts:
    print(f"{i.name}: kernel handle {[p.func for p in i.k.dispatcher.plans.values()]}", flush=True)
# the fastest and the slowest instance again, then each with the other's arrays, then with
# their scratch made anew
fast, slow = sorted(insts, key=lambda i: i.median)[::len(insts) - 1]
print(f"-- {fast.name} (fastest) and {slow.name} (slowest): again, arrays exchanged, scratch anew", flush=True)
measure([fast, slow])
fast.u, fast.v, slow.u, slow.v = slow.u, slow.v, fast.u, fast.v
measure([fast, slow])
for i in (fast, slow):
    for p in i.k.dispatcher.plans.values():
        p.slots._free.clear()
measure([fast, slow])
