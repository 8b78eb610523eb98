"""How much of the first loopkern kernel's compile (to PTX, no GPU needed) is Numba's own first
use in a process: ``python bench/cold_split_probe.py ORDER`` with ORDER a comma-separated list
of ``trivial`` (a three-line Numba kernel) and ``heat`` (loopkern's 1-D heat grid kernel),
compiled in that order in one fresh process; prints the seconds each took. A stand-in device
of compute capability 9.0 lets Numba compile without a GPU (as tests/ptx_check.py does).
"""
import os, sys, time
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numba.cuda.api as _api, numba.cuda.dispatcher as _disp
from numba import cuda, types
class _Device:
    compute_capability = (9, 0); id = 0; name = b"x"
_api.get_current_device = _disp.get_current_device = lambda: _Device()
import loopkern as lk
import workloads as W
from loopkern import codegen
from loopkern.compile import compile_kernel
SCRATCH = (types.float64[:, ::1], types.int64[:, ::1], types.uint32[::1])
def trivial():
    def axpy(a, x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = a * x[i] + y[i]
    t = time.perf_counter()
    cuda.compile_ptx(axpy, (types.float32, types.float32[::1], types.float32[::1]), cc=(9, 0))
    return time.perf_counter() - t
def heat(step=W.heat_step):
    k = lk.megakernel(step, swap=[("u","v")])
    src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, index_bits=32)
    d = compile_kernel(src).dispatcher
    sig = (types.int64, types.int64, types.float32[::1], types.float32[::1], types.float32, *SCRATCH, types.uint64, types.int64[::1], types.int64[::1])
    t = time.perf_counter()
    cuda.compile_ptx(d.py_func, sig, cc=(9,0))
    return time.perf_counter() - t
order = sys.argv[1] if len(sys.argv) > 1 else "trivial,heat"
out = []
for w in order.split(","):
    out.append((w, round({"trivial": trivial, "heat": heat}[w](), 3)))
print(out)
