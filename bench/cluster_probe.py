"""Probe: what a thread-block cluster's hardware barrier costs against loopkern's grid barrier,
alone and between the steps of a 1-D heat stencil (H100/H200, compute capability 9.0+).

    python bench/cluster_probe.py

Every kernel runs ITERS barriers (or steps) in one launch; the launch goes through loopkern's
driver module with CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION set to the whole grid (one cluster).
The heat kernels are checked against a float64 NumPy reference before they are timed.
"""

import ctypes
import sys
import time

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

sys.path.insert(0, ".")
from loopkern.dispatch import driver as drv  # noqa: E402
from loopkern.runtime.cuda_rt import grid_sync  # noqa: E402


@intrinsic
def cluster_barrier(typingctx):
    sig = types.void()

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [])
        asm = ir.InlineAsm(fnty, "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;",
                           "~{memory}", side_effect=True)
        builder.call(asm, [])
        return context.get_dummy_value()
    return sig, codegen


@cuda.jit("void(int64, uint32[:], float32[:])")
def k_cluster(iters, bar, out):
    for _ in range(iters):
        cluster_barrier()
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = 1.0


@cuda.jit("void(int64, uint32[:], float32[:])")
def k_grid(iters, bar, out):
    for _ in range(iters):
        grid_sync(bar)
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = 1.0


def _heat(barrier):
    """A heat kernel reading and writing global memory, ``barrier(bar)`` between steps."""
    @cuda.jit("void(int64, uint32[:], float32[:], float32[:], int64)")
    def heat(iters, bar, u, v, n):
        tid = cuda.grid(1)
        nt = cuda.gridsize(1)
        a, b = u, v
        for _ in range(iters):
            for i in range(tid + 1, n - 1, nt):
                b[i] = a[i] + np.float32(0.25) * (a[i - 1] - np.float32(2.0) * a[i] + a[i + 1])
            barrier(bar)
            a, b = b, a
    return heat


@cuda.jit(device=True)
def _cluster_barrier_of(bar):
    cluster_barrier()


heat_cluster = _heat(_cluster_barrier_of)
heat_grid = _heat(grid_sync)


@intrinsic
def dsmem_load(typingctx, arr, idx, rank):
    """``arr[idx]`` (float32, a shared array) of block ``rank`` of the cluster: the address is
    mapped into that block's shared memory (mapa) and read with ld.shared::cluster."""
    sig = types.float32(arr, idx, rank)

    def codegen(context, builder, sig, args):
        from loopkern.runtime.lowering import element_ptr
        ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        r = context.cast(builder, args[2], sig.args[2], types.uint32)
        fnty = ir.FunctionType(ir.FloatType(), [ptr.type, ir.IntType(32)])
        asm = ir.InlineAsm(fnty, "{ .reg .u64 a; .reg .u32 s, m; cvta.to.shared.u64 a, $1; cvt.u32.u64 s, a; "
                                 "mapa.shared::cluster.u32 m, s, $2; ld.shared::cluster.f32 $0, [m]; }",
                           "=f,l,r,~{memory}", side_effect=True)
        return builder.call(asm, [ptr, r])
    return sig, codegen


@cuda.jit("void(int64, uint32[:], float32[:], float32[:], int64)")
def heat_dsmem(iters, bar, u, v, n):
    # each block keeps cells [lo, hi) of both buffers and one halo cell each side in shared
    # memory; after each step's cluster barrier it reads its neighbours' edge cells from their
    # shared memory (DSMEM) into its halo
    sh = cuda.shared.array(0, np.float32)
    b = cuda.blockIdx.x
    nb = cuda.gridDim.x
    T = (n + nb - 1) // nb
    lo = b * T
    hi = min(lo + T, n)
    W = T + 2
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for k in range(tid, W, nt):
        c = lo - 1 + k
        if 0 <= c < n:
            sh[k] = u[c]
            sh[W + k] = v[c]
    cuda.syncthreads()
    cur = 0
    m = hi - lo
    for _ in range(iters):
        src = cur * W
        dst = W - src
        for k in range(tid + 1, m + 1, nt):
            c = lo + k - 1
            x = sh[src + k]
            if 0 < c < n - 1:
                sh[dst + k] = x + np.float32(0.25) * (sh[src + k - 1] - np.float32(2.0) * x + sh[src + k + 1])
            else:
                sh[dst + k] = x
        cluster_barrier()
        if tid == 0 and b > 0:
            sh[dst] = dsmem_load(sh, dst + T, b - 1)
        if tid == 32 and b < nb - 1:
            sh[dst + m + 1] = dsmem_load(sh, dst + 1, b + 1)
        cuda.syncthreads()
        cur = 1 - cur
    # the buffer the last step wrote is u's (its name after the swaps), the other v's
    src = cur * W
    for k in range(tid + 1, m + 1, nt):
        u[lo + k - 1] = sh[src + k]
        v[lo + k - 1] = sh[W - src + k]
    cluster_barrier()        # nobody leaves while a neighbour may still read its shared memory


class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("x", ctypes.c_uint), ("y", ctypes.c_uint),
                ("z", ctypes.c_uint), ("rest", ctypes.c_char * 52)]


def array_words(a):
    ai = a.__cuda_array_interface__
    return [0, 0, a.size, a.dtype.itemsize, ai["data"][0], a.shape[0], a.strides[0]]


def launch(kernel, blocks, threads, words, cluster, shared=0):
    d = drv.driver()
    kern = next(iter(kernel.overloads.values()))
    func = drv.kernel_handle(kern)
    if cluster and blocks > 8:
        code = d.kernel_set_attribute(14, 1, func, 0) if d.kernel_set_attribute else d.func_set_attribute(func, 14, 1)
        drv.check(code, "NON_PORTABLE_CLUSTER_SIZE_ALLOWED")
    if shared > 48 * 1024:
        drv.allow_dynamic_shared(func, shared, 0)
    pb = drv.ParamBlock(len(words))
    pb.words[:] = np.array(words, dtype=np.uint64)
    cfg = drv._LaunchConfig(blocks, 1, 1, threads, 1, 1, shared, None, None, 0)
    attr = Attr(4 if cluster else 2, 0, blocks if cluster else 1, 1, 1)
    cfg.attrs, cfg.nattrs = ctypes.addressof(attr), 1
    drv.check(d.launch_ex(ctypes.byref(cfg), ctypes.c_void_p(func), pb.params, None), "cuLaunchKernelEx")
    cuda.synchronize()


def timed(kernel, blocks, threads, words_fn, cluster, reps=5, shared=0):
    ts = []
    for _ in range(reps):
        w = words_fn()
        t0 = time.perf_counter()
        launch(kernel, blocks, threads, w, cluster, shared)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    dev = cuda.get_current_device()
    print(dev.name, "cc", dev.compute_capability, "SMs", dev.MULTIPROCESSOR_COUNT)
    bar = cuda.to_device(np.zeros(2, np.uint32))
    out = cuda.device_array(1024, np.float32)
    iters = 100000
    for threads in (256, 1024) if "--barriers" in sys.argv else ():
        for blocks in (1, 2, 4, 8, 16):
            def words():
                return [iters] + array_words(bar) + array_words(out)
            try:
                tc = timed(k_cluster, blocks, threads, words, True)
                s_c = f"{tc / iters * 1e6:.3f}"
            except Exception as e:  # noqa: BLE001 (a probe: report and go on)
                s_c = f"failed: {e}"
            tg = timed(k_grid, blocks, threads, words, False)
            print(f"barrier only, {blocks:3d} x {threads:4d}: cluster {s_c} us, grid_sync {tg / iters * 1e6:.3f} us")
    for blocks in (132,) if "--barriers" in sys.argv else ():
        tg = timed(k_grid, blocks, 256, lambda: [iters] + array_words(bar) + array_words(out), False)
        print(f"barrier only, {blocks:3d} x  256: grid_sync {tg / iters * 1e6:.3f} us")

    steps = 20000
    for n in (4096, 16384, 65536, 262144):
        rng = np.random.default_rng(0)
        u0 = rng.random(n).astype(np.float32)
        ref = u0.astype(np.float64)
        for _ in range(100):
            r = ref.copy()
            r[1:-1] = ref[1:-1] + 0.25 * (ref[:-2] - 2 * ref[1:-1] + ref[2:])
            ref = r
        for kernel, blocks, threads, cluster in ((heat_dsmem, 16, 256, True), (heat_dsmem, 16, 512, True),
                                                 (heat_dsmem, 16, 1024, True), (heat_dsmem, 8, 512, True),
                                                 (heat_dsmem, 4, 512, True), (heat_dsmem, 1, 512, True),
                                                 (heat_grid, 132, 256, False)):
            name = "heat_dsmem" if kernel is heat_dsmem else "heat_grid"
            shared = 4 * 2 * (-(-n // blocks) + 2) if kernel is heat_dsmem else 0
            if shared > 227 * 1024:
                continue

            def words(k=steps):
                du, dv = cuda.to_device(u0), cuda.to_device(u0)
                words.keep = (du, dv)
                return [k] + array_words(bar) + array_words(du) + array_words(dv) + [n]
            try:
                launch(kernel, blocks, threads, words(100), cluster, shared)
                got = words.keep[0].copy_to_host()
                err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                t = timed(kernel, blocks, threads, words, cluster, shared=shared)
                print(f"heat {n:8d} {name:13s} {blocks:3d} x {threads:4d}: {t / steps * 1e6:.3f} us/step "
                      f"(rel err after 100 steps {err:.1e})")
            except Exception as e:  # noqa: BLE001
                print(f"heat {n:8d} {name:13s} {blocks:3d} x {threads:4d}: failed: {e}")


if __name__ == "__main__":
    main()
