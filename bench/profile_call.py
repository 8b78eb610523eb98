"""Where the host time of one kernel(...) call goes: a per-stage breakdown of the call path
(median µs of each stage over many one-step calls), then cProfile's view.

    python bench/profile_call.py [--backend cuda|cpu] [--calls N]
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--backend", default="cuda")
p.add_argument("--calls", type=int, default=2000)
p.add_argument("--n", type=int, default=4096)
p.add_argument("--steps", type=int, default=1)
p.add_argument("--scope", default=None)
p.add_argument("--no-control", action="store_true", help="kernels without the host control block's polls")
args = p.parse_args()
k = bench.heat_kernel()
u0 = np.random.default_rng(0).random(args.n).astype(np.float32)
gpu = args.backend == "cuda"
u, v = bench.on_device(gpu, u0), bench.on_device(gpu, u0)
for _ in range(50):
    k(u, v, bench.ALPHA, steps=args.steps, backend=args.backend, scope=args.scope, _control=not args.no_control)

d = k.dispatcher
opts = dict(steps=args.steps, max_steps=None, start=0, backend=args.backend, scope=args.scope, threads=None, blocks=None, seed=0,
            progress=False, timeout=None, debug=False, watchdog=60.0, control=not args.no_control)
vals = (u, v, bench.ALPHA)
pc = time.perf_counter_ns
stages = {"options": [], "plan lookup": [], "run (fill, launch, wait, finish)": [], "whole call": []}
for _ in range(args.calls):
    t0 = pc()
    o = d.options(*opts.values())
    t1 = pc()
    plan, values, ptrs = d.plan(vals, o)
    t2 = pc()
    d._run(plan, values, ptrs, o)
    t3 = pc()
    k(u, v, bench.ALPHA, steps=args.steps, backend=args.backend, scope=args.scope, _control=not args.no_control)
    t4 = pc()
    for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
        stages[name].append(dt / 1e3)
if gpu:
    from loopkern.dispatch import driver
    slot = plan.slots.take()
    more = {"fill_words": [], "launch": [], "wait (kernel + done flag)": [], "prepare_slot": [],
            "check_values": [], "call_key": [], "event_record (start() only)": []}
    from loopkern.dispatch.signature import call_key
    dr = driver.driver()
    for _ in range(args.calls):
        ts = [pc()]
        call_key(vals); ts.append(pc())
        ptrs = plan.check_values(vals); ts.append(pc())
        plan.prepare_slot(slot, None); ts.append(pc())
        plan.fill_words(vals, ptrs, slot, args.steps, 0, 0); ts.append(pc())
        plan.launch(slot, record=False); ts.append(pc())
        while slot.view[3] != 1:
            pass
        ts.append(pc())
        dr.event_record(slot.event, None); ts.append(pc())
        dr.event_synchronize(slot.event)
        for name, a, b in zip(("call_key", "check_values", "prepare_slot", "fill_words", "launch",
                               "wait (kernel + done flag)", "event_record (start() only)"), ts, ts[1:]):
            more[name].append((b - a) / 1e3)
    plan.slots.give(slot)
    stages.update(more)
for name, xs in stages.items():
    print(f"{name:40s} median {statistics.median(xs):7.2f} us   p10 {np.percentile(xs, 10):7.2f}   "
          f"p90 {np.percentile(xs, 90):7.2f}")
prof = cProfile.Profile()
prof.enable()
for _ in range(500):
    k(u, v, bench.ALPHA, steps=args.steps, backend=args.backend, scope=args.scope, _control=not args.no_control)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
