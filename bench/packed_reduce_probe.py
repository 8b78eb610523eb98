"""A/B of two grid-reduction protocols for a float32 ``lk.max`` at the end of a step (the Jacobi
256² miss of issues 12 and 14: one grid reduction and its barrier per step).

  current  loopkern's float32 grid max (cuda_rt._make_core): the block's value into a float64
           partial slot, the grid barrier (a release-add on one counter, an acquire spin), then
           every warp loads every block's partial (one more L2 round trip after the barrier)
  packed   the block's value and the reduction's number packed into one 64-bit word stored with
           release; warp 0 of each block polls all blocks' words (relaxed loads, eight per lane
           at once) until each carries this reduction's number, fences, combines them and hands
           the result to the block through shared memory: the barrier and the gather are the
           same loads

Measured on an H100 (session 34, bench-results/session34/5-packed-reduce-probe.log): packed
1.31x slower at 256² (4.21 against 3.21 µs/step) and 1.50x at 128²; in loopkern's runtime the
bench's Jacobi 256² went from ~2.9 to 4.6 µs/step. So loopkern keeps the counter barrier; the
packed protocol lives here only, to be measured again.

Both run the same Jacobi step (a 5-point update of the interior and the max of |update|) in one
kernel of STEPS steps, at 132 x 256 threads (one block per SM of an H100), called alternately;
prints µs per step (medians) and checks the two fields are bitwise equal and within float
tolerance of a float64 NumPy run.

    python bench/packed_reduce_probe.py [SIDE] [STEPS] [ROUNDS]
"""
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))
from llvmlite import ir  # noqa: E402
from numba import cuda, float32, float64, int64, uint64  # noqa: E402
from numba import types as _types  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

from bench.jacobi import jacobi_problem, jacobi_ref  # noqa: E402
from loopkern.runtime import cuda_rt as rt  # noqa: E402
from loopkern.runtime.cuda_rt import _COMBINE, _MAX_WARPS, _identity  # noqa: E402


# -- the packed protocol, as it was measured in loopkern's runtime (cuda_rt) and taken out again --

def _word_ptr(context, builder, aryty, ary, row, rowty, col, colty):
    """Pointer to ``ary[row, col]`` of a C-contiguous 2-D array of 8-byte elements."""
    from numba.core import cgutils
    a = context.make_array(aryty)(context, builder, ary)
    width = cgutils.unpack_tuple(builder, a.shape, 2)[1]
    r = context.cast(builder, row, rowty, _types.int64)
    c = context.cast(builder, col, colty, _types.int64)
    return builder.gep(a.data, [builder.add(builder.mul(r, width), c)])

@intrinsic
def _st_release_word(typingctx, ary, row, col, word):
    """``st.release.gpu`` of the 64-bit ``word`` (uint64) into ``ary[row, col]``."""
    sig = _types.void(ary, row, col, word)

    def codegen(context, builder, sig, args):
        ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2], sig.args[2])
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type, ir.IntType(64)]),
                           "st.release.gpu.global.u64 [$0], $1;", "l,l,~{memory}", side_effect=True)
        builder.call(asm, [ptr, args[3]])
        return context.get_dummy_value()
    return sig, codegen

@intrinsic
def _ld_relaxed_word(typingctx, ary, row, col):
    """``ld.relaxed.gpu`` of the 64-bit word at ``ary[row, col]``, as uint64 (not an acquire
    load: those wait for each other, and eight of them would be eight L2 round trips)."""
    sig = _types.uint64(ary, row, col)

    def codegen(context, builder, sig, args):
        ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2], sig.args[2])
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), [ptr.type]),
                           "ld.relaxed.gpu.global.u64 $0, [$1];", "=l,l,~{memory}", side_effect=True)
        return builder.call(asm, [ptr])
    return sig, codegen

@intrinsic
def _fence_acq_rel(typingctx):
    """``fence.acq_rel.gpu``: after relaxed loads that saw release stores, the acquire half
    of the synchronisation (PTX memory model: a fence after the observing load)."""
    sig = _types.void()

    def codegen(context, builder, sig, args):
        builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "fence.acq_rel.gpu;", "~{memory}",
                                  side_effect=True), [])
        return context.get_dummy_value()
    return sig, codegen

@intrinsic
def _f32_word(typingctx, x):
    """The bits of float32 ``x`` as the low half of a uint64."""
    sig = _types.uint64(_types.float32)

    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))
    return sig, codegen

@intrinsic
def _word_f32(typingctx, w):
    """The float32 whose bits are the low half of uint64 ``w``."""
    sig = _types.float32(_types.uint64)

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())
    return sig, codegen

def _make_packed_core(op):
    """Grid reduction (max or min) of a float32 value in which the barrier and the gather of
    the blocks' partials are the same loads.

    Each block publishes one 64-bit word, its partial's bits under the reduction's number
    (``epoch``), with a release store into row ``2 + epoch % 2`` of ``red``; warp 0 of each
    block reads every block's word (relaxed loads, eight per lane at once) until each
    carries this epoch, fences (acquire), and combines the partials in the order
    :func:`_make_core`'s gather does (lane ``l`` takes blocks ``l``, ``l + 32``, ...; then
    the warp), so the result is the same. Seeing every block's word is seeing every block
    arrive, and each release store with the relaxed load that saw it and the fence after
    (joined by the block's syncthreads on both sides) orders every memory access before
    the reduction before every access after it, as :func:`grid_sync` does: a step that ends in such a
    reduction still needs no barrier of its own (codegen.reduction_barrier_at). Where the
    barrier's counter and the partials each took an L2 round trip after the last block
    arrived, this takes one.

    Why two rows: a block writes row ``2 + e % 2`` again at epoch ``e + 2``, after seeing
    every block arrive at ``e + 1``, which a block does only after reading epoch ``e``'s
    words. A row's stale words are older epochs; a 32-bit epoch repeats only after 2**32
    packed reductions. The epoch counts packed reductions only (the high half of
    ``st[0]``, whose low half counts all reductions as before), so a stale word from a
    packed reduction of the same row is never one epoch this reduction waits for; the rows
    start every run at zero (:func:`grid_reset`, epoch 0 is never waited for) whatever
    an earlier run or XLA left in the buffer.
    """
    combine = _COMBINE[op]
    ident = np.float32(_identity(op, True))
    low = int64(0xFFFFFFFF)

    @cuda.jit(device=True)
    def warp_all(v):
        off = 16
        while off > 0:
            v = combine(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, off))
            off >>= 1
        return v

    @cuda.jit(device=True)
    def word(red, row, b, nb, idw):
        return _ld_relaxed_word(red, row, b) if b < nb else idw

    @cuda.jit(device=True)
    def poll8(red, row, b, nb, idw, epoch):
        """The words of blocks b, b + 32, ..., b + 224 once each carries ``epoch``: all eight
        loaded at once, then only those not yet written loaded again (one L2 round trip
        when every block has arrived; the gather of _make_core loads eight at once too)."""
        x0 = word(red, row, b, nb, idw)
        x1 = word(red, row, b + 32, nb, idw)
        x2 = word(red, row, b + 64, nb, idw)
        x3 = word(red, row, b + 96, nb, idw)
        x4 = word(red, row, b + 128, nb, idw)
        x5 = word(red, row, b + 160, nb, idw)
        x6 = word(red, row, b + 192, nb, idw)
        x7 = word(red, row, b + 224, nb, idw)
        top = uint64(32)
        while ((x0 >> top) != epoch or (x1 >> top) != epoch or (x2 >> top) != epoch
               or (x3 >> top) != epoch or (x4 >> top) != epoch or (x5 >> top) != epoch
               or (x6 >> top) != epoch or (x7 >> top) != epoch):
            if (x0 >> top) != epoch:
                x0 = word(red, row, b, nb, idw)
            if (x1 >> top) != epoch:
                x1 = word(red, row, b + 32, nb, idw)
            if (x2 >> top) != epoch:
                x2 = word(red, row, b + 64, nb, idw)
            if (x3 >> top) != epoch:
                x3 = word(red, row, b + 96, nb, idw)
            if (x4 >> top) != epoch:
                x4 = word(red, row, b + 128, nb, idw)
            if (x5 >> top) != epoch:
                x5 = word(red, row, b + 160, nb, idw)
            if (x6 >> top) != epoch:
                x6 = word(red, row, b + 192, nb, idw)
            if (x7 >> top) != epoch:
                x7 = word(red, row, b + 224, nb, idw)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @cuda.jit(device=True)
    def core(v, red, st, bar, sh):
        s0 = st[0]
        slot = s0 & 1
        p = s0 >> 32
        st[0] = ((p + 1) << 32) | ((s0 + 1) & low)
        row = 2 + (p & 1)
        epoch = uint64((p + 1) & low)
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        v = warp_all(v)
        if lane == 0:
            sh[slot * _MAX_WARPS + warp] = v
        cuda.syncthreads()
        if warp == 0:
            w = np.float32(sh[slot * _MAX_WARPS + lane]) if lane < (cuda.blockDim.x >> 5) else ident
            w = warp_all(w)
            if lane == 0:
                _st_release_word(red, row, cuda.blockIdx.x, (epoch << uint64(32)) | _f32_word(w))
            acc = ident
            nb = int64(cuda.gridDim.x)
            b = int64(lane)
            # a slot past the last block reads as a ready word holding the identity
            idw = (epoch << uint64(32)) | _f32_word(ident)
            while b < nb:
                x0, x1, x2, x3, x4, x5, x6, x7 = poll8(red, row, b, nb, idw, epoch)
                acc = combine(acc, _word_f32(x0))
                acc = combine(acc, _word_f32(x1))
                acc = combine(acc, _word_f32(x2))
                acc = combine(acc, _word_f32(x3))
                acc = combine(acc, _word_f32(x4))
                acc = combine(acc, _word_f32(x5))
                acc = combine(acc, _word_f32(x6))
                acc = combine(acc, _word_f32(x7))
                b += 256
            _fence_acq_rel()
            acc = warp_all(acc)
            if lane == 0:
                # this parity's slot 0: warp 0 read it above; the other warps read the
                # per-warp slots of this parity again only two reductions on
                sh[slot * _MAX_WARPS] = acc
        cuda.syncthreads()
        return np.float32(sh[slot * _MAX_WARPS])

    return core



@cuda.jit(device=True)
def fmax(a, b):
    return a if (a >= b or a != a) else b


@cuda.jit(device=True)
def grid_reset(red, bar):
    """Clears this block's packed words (rows 2 and 3 of ``red``), then a grid barrier."""
    if cuda.threadIdx.x == 0:
        red[2, cuda.blockIdx.x] = 0.0
        red[3, cuda.blockIdx.x] = 0.0
    rt.grid_sync(bar)


# the library's float32 grid-max core (cuda_rt._make_core) and the packed one above
CORES = [rt._make_core("max", rt.grid_sync, np.float32), _make_packed_core("max")]


def make(kind):
    core = CORES[kind]

    @cuda.jit(fastmath=False)
    def kern(u, v, nsteps, tol, redf, redi, bar):
        tid = cuda.grid(1)
        nt = cuda.gridsize(1)
        st = cuda.local.array(1, int64)
        st[0] = 0
        shf = cuda.shared.array(64, float64)
        n = np.int32(u.shape[0])
        m = np.int32(u.shape[1])
        w = m - np.int32(2)
        cells = (n - np.int32(2)) * w
        grid_reset(redf, bar)
        t = 0
        while t < nsteps:
            a = u if t % 2 == 0 else v
            b = v if t % 2 == 0 else u
            err = float32(0.0)
            k = np.int32(tid)
            while k < cells:
                i = k // w + np.int32(1)
                j = k - (i - np.int32(1)) * w + np.int32(1)
                x = float32(0.25) * (a[i - 1, j] + a[i + 1, j] + a[i, j - 1] + a[i, j + 1])
                err = fmax(err, abs(x - a[i, j]))
                b[i, j] = x
                k += np.int32(nt)
            r = core(err, redf, st, bar, shf)
            t += 1
            if not r > tol:
                break
    return kern


def main():
    side = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    dev = cuda.get_current_device()
    nb, nthreads = dev.MULTIPROCESSOR_COUNT, 256
    u0 = jacobi_problem(side, np.random.default_rng(0))
    kerns = {"current": make(0), "packed": make(1)}
    bufs = {}
    for name in kerns:
        bufs[name] = dict(redf=cuda.to_device(np.zeros((4, nb))), redi=cuda.to_device(np.zeros((2, nb), np.int64)),
                          bar=cuda.to_device(np.zeros(2, np.uint32)))
    times = {name: [] for name in kerns}
    finals = {}
    for rnd in range(rounds + 1):
        for name, k in kerns.items():
            s = bufs[name]
            u, v = cuda.to_device(u0), cuda.to_device(u0)
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            k[nb, nthreads](u, v, steps, np.float32(-1.0), s["redf"], s["redi"], s["bar"])
            e1.record()
            e1.synchronize()
            if rnd:
                times[name].append(cuda.event_elapsed_time(e0, e1) * 1e3 / steps)
            finals[name] = (u if steps % 2 == 0 else v).copy_to_host()
    ref, _, _ = jacobi_ref(u0, -1.0, steps)
    for name in kerns:
        med = statistics.median(times[name])
        err = float(np.abs(finals[name] - ref).max())
        print(f"{name:8s} {side}x{side} {steps} steps, {nb}x{nthreads}: {med:.3f} us/step "
              f"(all {[round(x, 3) for x in times[name]]}); max |field - float64| {err:.1e}")
    same = np.array_equal(finals["current"], finals["packed"])
    print(f"packed/current {statistics.median(times['packed']) / statistics.median(times['current']):.3f}; "
          f"fields bitwise equal: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
