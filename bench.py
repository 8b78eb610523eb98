"""Side-by-side benchmark: loopkern against the loops users would write instead.

    python bench.py              # every workload and variant on this machine's GPU
    python bench.py --quick      # small sizes, CPU backend vs JAX on the CPU (a CI smoke test)
    python bench.py --workloads heat,jacobi --sizes 4096,65536

Workloads: 1D heat (4K..16M float32), 2D heat (5-point, 512² to 2048² float32), 2D Jacobi to
tolerance (a while loop with a grid
reduction), Game of Life (int32, periodic), all-pairs N-body (two phases per step), and the
quadratic map x <- 4x(1-x) for 10M steps with its trajectory recorded (a sequential
recursion). Variants: loopkern in each scope that applies, jax.lax.fori_loop / while_loop /
scan(unroll=16), the same JAX loops with XLA's WHILE command buffers (a subprocess), one Numba
kernel launch per step, a CUDA graph of per-step kernels, hand-written CUDA C++ cooperative
kernels (1D and 2D heat: int indices, __restrict__, the best block count of a sweep), and Numba on the CPU (quadratic map). The calls workload measures what a call
costs on the host: one heat step at 4K per blocking call (loopkern with device or NumPy arrays,
kernel.jax in jax.jit, and bare Numba/CuPy/JAX/numba.njit calls as anchors; the median of 1000
calls, each timed on its own after 20 untimed), and 10,000 heat steps at 64K run as 1, 10, 100
and 1000 calls continued with start=.

Every variant is checked against a float64 NumPy reference at every size before it is timed
(heat: 100 steps, also at 16M; Jacobi: the whole run to convergence, whose step count every
timed call must repeat); a wrong result is listed at the end and makes the exit status 1.
Timing: the variants of one size are timed in interleaved rounds (a warm-up call of each, then
--reps rounds of one call of each), each call on freshly reset inputs, and the median is
quoted; GPU variants without their own synchronisation are timed with CUDA events, the others
by blocking on the result (JAX: from the call to its results being ready; a loop's step count, a
device scalar, is read back after the time is taken, since that transfer cost 0.4-0.8 ms a call
on an H100 and is no part of the loop). Compile time is measured in fresh processes: first call with an empty
cache, then first call with the cache on disk. Results go to bench-results/<device>-<date>.json,
.md and .png.

This file parses the options and runs the workloads; they and the harness are in the package
bench/ next to it (bench/__init__.py lists its modules).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

# ``import bench`` finds the package bench/ next to this file (a package wins over this module)
from bench import (ALIASES, DEFAULT_WORKLOADS, WORKLOADS, Bench, device_name, gpu_available, have,
                   report_wrong_results, run_cmdbuf_subprocess, write_outputs)
from bench.variants import EXPERIMENTS

HERE = Path(__file__).resolve().parent


def workload_list(text):
    """--workloads: known names (aliases resolved), each once, in the order given."""
    names = [ALIASES.get(w.strip(), w.strip()) for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {', '.join(bad)}; choose from "
                                         f"{', '.join(WORKLOADS)} (or {', '.join(ALIASES)})")
    return ",".join(dict.fromkeys(names))


def launch_bounds(text: str):
    """``THREADS/BLOCKS`` as (threads, blocks per SM), "off" as itself (no bounds), or None for
    an empty string."""
    if not text:
        return None
    if text == "off":
        return text
    try:
        threads, blocks = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--launch-bounds wants THREADS/BLOCKS, e.g. 256/2; got {text!r}") from None
    if not (32 <= threads <= 1024 and threads % 32 == 0 and blocks >= 1):
        raise argparse.ArgumentTypeError(f"--launch-bounds: threads a multiple of 32 up to 1024 and blocks >= 1; "
                                         f"got {text!r}")
    return threads, blocks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes on the CPU backend (CI smoke test)")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, type=workload_list,
                   help=f"comma-separated, from {DEFAULT_WORKLOADS} (overhead: the old name of calls)")
    p.add_argument("--sizes", default="", help="comma-separated sizes for heat")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "bench-results"))
    p.add_argument("--sweep", action="store_true", help="also time fixed block counts (to tune scope='auto')")
    p.add_argument("--no-jax", action="store_true", help="leave out the JAX variants")
    p.add_argument("--no-cmdbuf", action="store_true", help="leave out the command-buffer subprocess")
    p.add_argument("--jax-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", help=argparse.SUPPRESS)
    p.add_argument("--launch-bounds", default="", type=launch_bounds, metavar="THREADS/BLOCKS",
                   help="also time loopkern's grid scope with these launch bounds (e.g. 512/1), or with none "
                        "('off'; the default is dispatch.kernels.LAUNCH_BOUNDS), a variant of its own in the same "
                        "rounds")
    p.add_argument("--split-exchange", action="store_true",
                   help="an experiment: also time tile mode with the exchange's grid barrier split (the rows "
                        "that read no halo computed between its halves), a variant of its own")
    p.add_argument("--prefetch-rim", choices=("on", "off"), default="on",
                   help="'off': also time the drop-in Jacobi body lowered without its rim's early loads "
                        "(jaxloops.lower.PREFETCH_RIM), a variant of its own in the same rounds")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="write one table from the JSON files of several runs (same device and date)")
    args = p.parse_args(argv)
    if args.merge:
        docs = [json.loads(Path(f).read_text()) for f in args.merge]
        meta = dict(docs[0]["meta"], merged=args.merge)
        results = [r for d in docs for r in d["results"]]
        md = write_outputs(results, meta, Path(args.out))
        print(md.read_text())
        return report_wrong_results(results)
    if args.launch_bounds:
        EXPERIMENTS["bounds"] = args.launch_bounds
    if args.split_exchange:
        EXPERIMENTS["split"] = True
    if args.prefetch_rim == "off":
        EXPERIMENTS["prefetch_rim"] = False
    gpu = gpu_available() and not args.quick
    b = Bench(args, gpu)
    meta = dict(device=device_name(gpu), date=_dt.date.today().isoformat(), reps=args.reps,
                python=sys.version.split()[0], quick=args.quick, argv=sys.argv[1:])
    for wl in args.workloads.split(","):
        if args.jax_only and wl not in ("heat", "jacobi"):
            continue
        WORKLOADS[wl](b)
    if gpu and not args.jax_only and not args.no_cmdbuf and not args.no_jax and have("jax"):
        for row in run_cmdbuf_subprocess(args, Path(__file__).resolve()):
            b.emit(row)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, results=b.results)))
        return report_wrong_results(b.results)
    md = write_outputs(b.results, meta, Path(args.out))
    print(md.read_text())
    return report_wrong_results(b.results)


if __name__ == "__main__":
    sys.exit(main())
