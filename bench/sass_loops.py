"""Count the SASS instructions of a bench kernel's loops without a GPU: the kernel is rendered
and compiled to PTX by Numba for a stand-in sm_90 device, assembled by ``ptxas`` and
disassembled by ``cuobjdump``; each backward branch is reported with the instructions of the
loop it closes (and how many of them are shared/global loads and stores).

    python bench/sass_loops.py heat2d|jacobi|life|heat tile|grid [depth] [bounds=THREADS/BLOCKS] [split]
    python bench/sass_loops.py jacobi|jacobi_lowered block|grid [bounds=THREADS/BLOCKS]

``split`` renders tile mode with the exchange's barrier split (``render_kernel(split=True)``,
an experiment, off by default).
``bounds=256/2`` assembles the kernel with launch bounds (``.maxntid 256``, ``.minnctapersm
2``), as ``cuda.jit(launch_bounds=...)`` would compile it.

``jacobi_lowered`` is the Jacobi body of bench.py's jaxloops workload as ``lk.while_loop``
lowers it, in kernel.jax's form (step count, start and scalars by reference); ``block`` is
block scope with the swap pair staged in shared memory (how 64x64 runs), ``grid`` with 32-bit
indices (256x256). ``jacobi`` in these modes is the hand-written step in the same form.

``ptxas`` and ``cuobjdump`` are taken from $PTXAS and $CUOBJDUMP, else from PATH (CUDA 12.8+
or 13: ``pip download nvidia-cuda-cuobjdump`` has a cuobjdump). A PTX version newer than the
ptxas is lowered to its own (the kernel uses nothing newer). Static counts, not a profile:
they say what one trip of a loop costs, not how often it runs or how long it waits.

Each loop's "load waves" are its loads grouped by the waits between them: a wait is an
instruction that reads the result of a load still outstanding, and the loads between two waits
go to memory together. ``[20]`` is one trip per pass; ``[6, 4, 2, 2, 3, 3]`` six, one after
another (kernel.jax's Jacobi kernel before 178e521: 27.8 against 16.2 µs/step at 2048², H100).
ptxas's choices differ between releases and with NVVM's: set $NVVM_SO to a libnvvm.so (e.g.
from ``pip download nvidia-nvvm==13.0.88``) and $PTXAS to the matching ptxas to see what the
GPU machine builds (its CUDA 13.0).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

if os.environ.get("NVVM_SO"):
    # loaded before Numba looks for libnvvm, which then uses this one
    import ctypes
    ctypes.CDLL(os.environ["NVVM_SO"], mode=ctypes.RTLD_GLOBAL)
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class _StandIn:
    """The device Numba's compile asks about (compute capability only)."""
    compute_capability = (9, 0)
    id = 0
    name = b"stand-in sm_90"


def _jacobi_lowered():
    """The MegaKernel that ``lk.while_loop`` builds for bench.py's jaxloops Jacobi body."""
    import jax.numpy as jnp

    from bench.jaxloops import jacobi_body
    from loopkern.jaxloops import loops
    made = []
    build = loops._kernel
    loops._kernel = lambda plan: made.append(build(plan)) or made[-1]
    try:
        tol, steps = np.float32(1e-5), 100
        loops.while_loop(lambda c: (c[1] > tol) & (c[2] < steps), jacobi_body,
                         (jnp.zeros((64, 64), jnp.float32), jnp.float32(jnp.inf), jnp.int32(0)), fallback="error")
    finally:
        loops._kernel = build
    return made[-1]


def kernel_ptx(which: str, mode: str, depth: int, split: bool = False) -> tuple[str, str]:
    """(generated Python source, PTX) of bench kernel ``which`` in ``mode`` (grid: with 32-bit
    indices, as the dispatcher picks for these sizes; tile: ``depth`` steps per exchange;
    block: the swap pair staged in shared memory, kernel.jax's form)."""
    import numba.cuda.api as api
    import numba.cuda.dispatcher as disp
    from numba import cuda, typeof, types
    api.get_current_device = disp.get_current_device = lambda: _StandIn()

    from loopkern import codegen
    from loopkern.compile import compile_kernel
    from loopkern.stencil import find_stencil
    f32 = np.zeros((4, 4), np.float32)
    scratch = (types.float64[:, ::1], types.int64[:, ::1], types.uint32[::1])
    if which in ("jacobi_lowered",) or mode == "block":
        if which == "jacobi":
            from bench.jacobi import jacobi_kernel
            k, args = jacobi_kernel(), [f32, f32, np.float32(0.1)]
        elif which == "jacobi_lowered":
            # carries: the field (a swap pair), the error (a 1-element pair), the step counter
            k, args = _jacobi_lowered(), [f32, f32, np.zeros(1, np.float32), np.zeros(1, np.float32),
                                          np.int32(0), np.int32(0)]
        else:
            raise SystemExit(f"mode {mode!r} is for jacobi and jacobi_lowered")
        if mode not in ("block", "grid"):
            raise SystemExit("jacobi_lowered: mode block or grid")
        refs = frozenset(i for i, a in enumerate(args) if not isinstance(a, np.ndarray))
        staged = (0, 1) if mode == "block" else ()
        src = codegen.render_kernel(k.spec, "cuda", mode, cache=False, by_ref=refs, staged=staged,
                                    index_bits=None if staged else 32)
        params = [typeof(a) if isinstance(a, np.ndarray) else types.Array(typeof(a), 1, "C") for a in args]
        sig = (types.int64[::1], types.int64[::1], *params, *scratch, types.uint32[::1], types.int64[::1],
               types.int64[::1])
        ptx, _ = cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))
        return src.text, ptx
    if which == "heat2d":
        from bench.heat2d import heat2d_kernel as make
        args, float_type = [f32, f32, np.float32(0.1)], "float32"
    elif which == "jacobi":
        from bench.jacobi import jacobi_kernel as make
        args, float_type = [f32, f32, np.float32(0.1)], "float32"
    elif which == "life":
        from bench.life import life_kernel as make
        args, float_type = [np.zeros((4, 4), np.int32)] * 2, None
    elif which == "heat":
        from bench.heat import heat_kernel as make
        args, float_type = [np.zeros(4, np.float32)] * 2 + [np.float32(0.1)], "float32"
    else:
        raise SystemExit(f"unknown kernel {which!r}: heat2d, jacobi, jacobi_lowered, life or heat")
    k = make()
    tile = find_stencil(k.spec) if mode == "tile" else None
    src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=tile, float_type=float_type, split=split,
                                index_bits=None if tile is not None else 32, depth=depth)
    sig = (types.int64, types.int64, *[typeof(a) for a in args], *scratch, types.uint64, types.int64[::1],
           types.int64[::1])
    if tile is not None and depth > 1:
        sig += (typeof(args[0]).dtype[::1],)          # the halo scratch
    ptx, _ = cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))
    return src.text, ptx


def sass(ptx: str) -> list[str]:
    """The kernel's SASS lines ``/*addr*/ INSTR ;``."""
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not ptxas or not cuobjdump:
        raise SystemExit("needs ptxas and cuobjdump (set $PTXAS and $CUOBJDUMP)")
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release (\d+)\.(\d+)", version)
    if release and int(release.group(1)) >= 13:
        # ptxas 13.0 reads PTX ISA up to 9.0; Numba's NVVM may write a newer header
        ptx = re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", str(src), "-o", str(cubin)], check=True,
                              capture_output=True, text=True)
        regs = re.findall(r"Used (\d+) registers", done.stderr)
        if regs:
            print(f"registers: {', '.join(regs)}")
        out = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"\s*/\* 0x[0-9a-f]+ \*/", "", ln).strip() for ln in out.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]


def load_waves(body: list[str]) -> list[int]:
    """The loads of a loop body (SASS lines) grouped by the waits between them (see above)."""
    pending, groups, current = set(), [], 0
    for ln in body:
        ins = re.sub(r"^(/\*[0-9a-f]+\*/)?\s*(@!?P\d+\s+)?", "", ln).split(";")[0]
        parts = ins.split(None, 1)
        if len(parts) < 2:
            continue
        op, operands = parts
        regs = re.findall(r"\bR(\d+)\b", operands)
        is_load = re.match(r"LD(G|S)?(\.|$)", op)
        # a load waits only for its address; a store reads every register it names; anything
        # else reads all but its first (the destination)
        reads = set(re.findall(r"\[R(\d+)", operands)) if is_load else set(regs if op.startswith("ST") else regs[1:])
        if reads & pending:
            groups.append(current)
            current = 0
            pending.clear()
        if is_load:
            pending.add(regs[0])
            current += 1
        elif regs and not op.startswith("ST"):
            pending.discard(regs[0])        # overwritten: no longer a load's result
    groups.append(current)
    return [g for g in groups if g]


def loops(lines: list[str]) -> list[str]:
    addr = [int(re.match(r"/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    found = []
    for ln, a in zip(lines, addr):
        m = re.search(r"\bBRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a:
            start = int(m.group(1), 16)
            body = [x for x, b in zip(lines, addr) if start <= b <= a]
            count = {op: sum(bool(re.search(rf"\b{op}(\.| )", x)) for x in body)
                     for op in ("LDS", "STS", "LDG", "STG", "LD", "ST")}
            waves = load_waves(body) if len(body) < 400 else None   # an outer loop: not one pass
            found.append(f"loop {start:#06x}-{a:#06x}: {len(body):4d} instructions; "
                         + ", ".join(f"{op} {n}" for op, n in count.items() if n)
                         + (f"; load waves {waves}" if waves else ""))
    return found


def with_launch_bounds(ptx: str, threads: int, min_blocks: int) -> str:
    """``ptx`` with ``.maxntid threads`` and ``.minnctapersm min_blocks`` on its kernel (what
    ``cuda.jit(launch_bounds=(threads, min_blocks))`` writes): ptxas then knows how many
    registers each thread may have."""
    out, n = re.subn(r"^(\.visible \.entry [^(]*\((?:[^)]*)\n\))", rf"\1\n.maxntid {threads}, 1, 1\n.minnctapersm {min_blocks}",
                     ptx, count=1, flags=re.M)
    if n != 1:
        raise SystemExit("no kernel entry found in the PTX")
    return out


def main():
    which, mode = sys.argv[1], sys.argv[2]
    depth = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 1
    bounds = next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("bounds=")), None)
    _, ptx = kernel_ptx(which, mode, depth, split="split" in sys.argv[3:])
    if bounds:
        threads, min_blocks = (int(x) for x in bounds.split("/"))
        ptx = with_launch_bounds(ptx, threads, min_blocks)
    lines = sass(ptx)
    print(f"{which} {mode} depth={depth}{f' bounds={bounds}' if bounds else ''}: {len(lines)} SASS instructions in all")
    for ln in loops(lines):
        print(" ", ln)


if __name__ == "__main__":
    main()
