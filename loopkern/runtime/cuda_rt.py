"""CUDA-backend runtime: barriers, reductions and ``lk.atomic`` updates called by generated kernels.

Reductions (``grid_sum`` ... ``block_min``) take the thread's value, the global partial-result
slots ``redf`` (float64[2, blocks]) and ``redi`` (int64[2, blocks]), ``st``, a per-thread
counter of reductions so far, and ``bar``: the grid barrier's counter and the count of blocks
that have finished (uint32[2]). Floats are combined in float64 and returned in the input's type;
integers and bools are combined and returned as int64.

Why two slots: reduction *r* uses slot ``r % 2`` (in shared and global memory). A thread can
only write slot ``r % 2`` again at reduction ``r + 2``, after passing the barrier inside
reduction ``r + 1``, which every thread reaches only after reading reduction *r*'s slot. So
back-to-back reductions need no reset and no extra barrier.

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) warp shuffles do not exist, so the
same protocol is implemented with shared memory in plain Python.
"""

import math

import numpy as np
from numba import config, cuda

from .layout import BOUNDS, DBG_FLAG, DONE, REQUEST, STEPS, TIMEOUT, TIMEOUT_NS, WHY
from .philox import build

SIMULATOR = bool(config.ENABLE_CUDASIM)
_OPS = ("sum", "max", "min")
#: warps per block at most; the kernel's per-warp reduction slots are two of this many (the
#: templates' cuda.shared.array(64, ...) must be 2 * _MAX_WARPS)
_MAX_WARPS = 32


def _make_sim_shared_arrays_atomic():
    """Numba's simulator finds a block's shared array by the line that allocates it, creating
    it on the first call without a lock: threads of a block making that first call at once
    could each get an array of their own (uninitialized: np.empty), and a reduction then
    read garbage (seen once in CI, on two cores). This replaces the lookup with the same one
    under a lock. Dynamic shared memory (shape 0) has no lookup and is left to the original."""
    import sys
    import threading
    import traceback

    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support
    from numba import types

    cls = kernelapi.FakeCUDAShared
    original = cls.array
    if getattr(original, "_lk_atomic", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[-1])[0:2]
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res
    array._lk_atomic = True
    cls.array = array


if SIMULATOR:
    _make_sim_shared_arrays_atomic()
    @cuda.jit(device=True)
    def grid_sync(bar):
        """Barrier across every thread of the grid (the simulator runs one block)."""
        cuda.cg.this_grid().sync()

    @cuda.jit(device=True)
    def grid_arrive(bar):
        """The first half of a split grid barrier (the simulator runs one block)."""
        cuda.syncthreads()
        return np.uint32(0)

    @cuda.jit(device=True)
    def grid_wait(bar, old):
        """The second half of a split grid barrier (the simulator runs one block)."""
        cuda.syncthreads()

    @cuda.jit(device=True)
    def cluster_sync(bar):
        """Barrier across every thread of the grid launched as one cluster (the simulator runs
        one block)."""
        cuda.cg.this_grid().sync()
else:
    from llvmlite import ir
    from numba import types as _types, uint32
    from numba.cuda.extending import intrinsic

    from .lowering import element_ptr

    @intrinsic
    def _atom_add_release(typingctx, arr, val):
        """``atom.add.release.gpu`` on ``arr[0]`` (uint32); returns the old value."""
        sig = _types.uint32(arr, val)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [ir.Constant(ir.IntType(64), 0)])
            v = context.cast(builder, args[1], sig.args[1], _types.uint32)
            fnty = ir.FunctionType(ir.IntType(32), [ptr.type, ir.IntType(32)])
            asm = ir.InlineAsm(fnty, "atom.add.release.gpu.global.u32 $0, [$1], $2;", "=r,l,r,~{memory}",
                               side_effect=True)
            return builder.call(asm, [ptr, v])
        return sig, codegen

    @intrinsic
    def _ld_acquire(typingctx, arr):
        """``ld.acquire.gpu`` of ``arr[0]`` (uint32)."""
        sig = _types.uint32(arr)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [ir.Constant(ir.IntType(64), 0)])
            fnty = ir.FunctionType(ir.IntType(32), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.acquire.gpu.global.u32 $0, [$1];", "=r,l,~{memory}", side_effect=True)
            return builder.call(asm, [ptr])
        return sig, codegen

    @cuda.jit(device=True)
    def grid_sync(bar):
        """Barrier across every thread of the grid: one release-add and acquire-spin per block.

        Block 0 adds 0x80000000 - (blocks - 1) and every other block adds 1, so the counter's top
        bit flips exactly when the last block arrives, provided the low 31 bits start at zero (the
        counter is zeroed when it is allocated, and a completed barrier leaves them at zero;
        from any other value block 0 could be released early). The
        release/acquire pair orders every write before the barrier (made visible to thread 0
        by the first syncthreads) before every read after it. Requires all blocks resident:
        the launch is cooperative and sized by occupancy. Proven race-free (bitwise against
        cooperative groups over 20000 steps at up to 528 blocks) before it was adopted.
        """
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            nb = uint32(cuda.gridDim.x)
            inc = uint32(1) if cuda.blockIdx.x != 0 else uint32(uint32(0x80000000) - (nb - uint32(1)))
            old = _atom_add_release(bar, inc)
            while ((old ^ _ld_acquire(bar)) & uint32(0x80000000)) == 0:
                pass
        cuda.syncthreads()

    @cuda.jit(device=True)
    def grid_arrive(bar):
        """The first half of :func:`grid_sync`, split so that a block can work between the two:
        every write of the block before it is released to the grid; returns what the block's
        thread 0 must pass to :func:`grid_wait` (the counter before its add; 0 elsewhere).
        Every block must arrive exactly once per barrier, and wait before arriving again."""
        cuda.syncthreads()
        old = uint32(0)
        if cuda.threadIdx.x == 0:
            nb = uint32(cuda.gridDim.x)
            inc = uint32(1) if cuda.blockIdx.x != 0 else uint32(uint32(0x80000000) - (nb - uint32(1)))
            old = _atom_add_release(bar, inc)
        return old

    @cuda.jit(device=True)
    def grid_wait(bar, old):
        """The second half of :func:`grid_sync`: returns once every block has arrived (the
        counter's top bit has flipped since this block's add), with every write released
        before any block's arrival visible to every thread of this one."""
        if cuda.threadIdx.x == 0:
            while ((old ^ _ld_acquire(bar)) & uint32(0x80000000)) == 0:
                pass
        cuda.syncthreads()

    @intrinsic
    def _cluster_barrier(typingctx):
        """``barrier.cluster.arrive.release`` then ``barrier.cluster.wait.acquire`` (sm_90+)."""
        sig = _types.void()

        def codegen(context, builder, sig, args):
            # not the .aligned forms: those require every thread of a warp to execute the same
            # barrier instruction, which a step's divergent code before it does not promise
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                               "barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;", "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return sig, codegen

    @cuda.jit(device=True)
    def cluster_sync(bar):
        """Barrier across every thread of a grid launched as one thread-block cluster (compute
        capability 9.0+; ``scope="cluster"``): the cluster's hardware barrier, whose
        release/acquire at cluster scope orders every write before it, global and shared, before
        every read after it by any thread of the cluster. On the H200 it costs 0.2-0.35 µs
        against 0.6-0.8 µs for :func:`grid_sync` at 8-16 blocks (bench/cluster_probe.py)."""
        _cluster_barrier()


# -- warp-split loops (loopkern/warpsplit.py): a sum across the 32 lanes of a warp --------------
if SIMULATOR:
    import threading as _threading

    _WARPS: dict = {}
    _WARPS_LOCK = _threading.Lock()

    @cuda.jit(device=True)
    def warp_sum(v):
        """The xor-butterfly sum of ``v`` over the warp, as the GPU's shuffles compute it (each
        lane gets its own order of the same additions); every lane of the warp must call it."""
        lane = cuda.threadIdx.x % 32
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, cuda.threadIdx.x // 32)
        with _WARPS_LOCK:
            if key not in _WARPS:
                _WARPS[key] = ([None] * 32, _threading.Barrier(32))
            vals, gate = _WARPS[key]
        vals[lane] = v
        gate.wait()
        mine = list(vals)
        gate.wait()                   # nobody overwrites vals before every lane has read them
        off = 16
        while off > 0:
            mine = [mine[k] + mine[k ^ off] for k in range(32)]
            off >>= 1
        return mine[lane]
else:
    @cuda.jit(device=True)
    def warp_sum(v):
        """The sum of ``v`` over the warp (xor butterfly: every lane gets a sum); every lane of
        the warp must call it."""
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off >>= 1
        return v


#: warps per group of a warp-split loop at most (loopkern/warpsplit.py): 8 warps, 256 lanes
GROUP_WARPS_MAX = 8
#: the kernel's per-warp slots (``_lk_shf``/``_lk_shi``) a group exchange may use: slot
#: ``k * warps_per_block + warp`` for accumulator ``k``
_GROUP_SLOTS = 2 * _MAX_WARPS


@cuda.jit(device=True)
def group_shift(count, nt, naccs):
    """log2 of the lanes that share one iteration of a warp-split loop of ``count`` iterations
    (5: a warp; up to 8: eight warps). Groups grow while the grid still has that many lanes for
    every iteration, a group stays inside a block, and the block's per-warp slots hold every
    accumulator of every warp. The same on every thread of the grid."""
    s = 5
    bd = cuda.blockDim.x
    if naccs * (bd >> 5) <= _GROUP_SLOTS:
        while s < 5 + 3 and (count << (s + 1)) <= nt and bd % (1 << (s + 1)) == 0:
            s += 1
    return s


@cuda.jit(device=True)
def group_base(tid, shift):
    """(the first group of this thread's block, this thread's group within the block, this
    thread's lane within its group) for groups of ``1 << shift`` consecutive threads."""
    tix = cuda.threadIdx.x
    return (tid - tix) >> shift, tix >> shift, tix & ((1 << shift) - 1)


if SIMULATOR:
    @cuda.jit(device=True)
    def zero_of(v):
        """The additive identity in ``v``'s type: -0.0 for a float (x + -0.0 is x for every x,
        -0.0 included), 0 for an integer."""
        if isinstance(v, (float, np.floating)):
            return type(v)(-0.0)
        return type(v)(0) if isinstance(v, np.generic) else 0

    @cuda.jit(device=True)
    def group_put(v, k, shf, shi):
        """Lane 0 of a warp: store its warp's sum of accumulator ``k`` in the block's slots."""
        slot = k * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)
        if isinstance(v, (float, np.floating)):
            shf[slot] = v
        else:
            shi[slot] = v

    @cuda.jit(device=True)
    def group_get(v, k, shift, shf, shi):
        """The sum over this thread's group of accumulator ``k``: its warps' sums added in warp
        order, in ``v``'s type (every thread of the group gets the same value)."""
        first = k * (cuda.blockDim.x >> 5) + ((cuda.threadIdx.x >> shift) << (shift - 5))
        is_float = isinstance(v, (float, np.floating))
        cast = type(v) if isinstance(v, np.generic) else (float if is_float else int)
        buf = shf if is_float else shi
        tot = cast(buf[first])
        for w in range(1, 1 << (shift - 5)):
            tot = cast(tot + cast(buf[first + w]))
        return tot
else:
    from numba import float64, int64, types, uint64
    from numba.cuda.extending import overload

    def zero_of(v):
        raise NotImplementedError("only callable from a loopkern kernel")

    @overload(zero_of, target="cuda")
    def _zero_of_impl(v):
        out = v
        if isinstance(v, types.Float):
            return lambda v: out(-0.0)
        if isinstance(v, (types.Integer, types.Boolean)):
            return lambda v: out(0)
        return None

    def group_put(v, k, shf, shi):
        raise NotImplementedError("only callable from a loopkern kernel")

    def group_get(v, k, shift, shf, shi):
        raise NotImplementedError("only callable from a loopkern kernel")

    @overload(group_put, target="cuda")
    def _group_put_impl(v, k, shf, shi):
        if isinstance(v, types.Float):
            def impl(v, k, shf, shi):
                shf[k * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)] = float64(v)
            return impl
        if isinstance(v, (types.Integer, types.Boolean)):
            def impl(v, k, shf, shi):
                shi[k * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)] = int64(v)
            return impl
        return None

    @overload(group_get, target="cuda")
    def _group_get_impl(v, k, shift, shf, shi):
        # a float partial went through float64 unchanged, so casting back is exact and the sum
        # is done in the accumulator's own type, as the sequential loop does
        out = v

        if isinstance(v, types.Float):
            def impl(v, k, shift, shf, shi):
                first = k * (cuda.blockDim.x >> 5) + ((cuda.threadIdx.x >> shift) << (shift - 5))
                tot = out(shf[first])
                for w in range(1, 1 << (shift - 5)):
                    tot = out(tot + out(shf[first + w]))
                return tot
            return impl
        if isinstance(v, (types.Integer, types.Boolean)):
            def impl(v, k, shift, shf, shi):
                first = k * (cuda.blockDim.x >> 5) + ((cuda.threadIdx.x >> shift) << (shift - 5))
                tot = out(shi[first])
                for w in range(1, 1 << (shift - 5)):
                    tot = out(tot + out(shi[first + w]))
                return tot
            return impl
        return None


@cuda.jit(device=True)
def block_barrier():
    """``syncthreads``: every thread of the block must call it."""
    cuda.syncthreads()


@cuda.jit(device=True)
def block_sync(bar):
    """Barrier across the threads of this block."""
    cuda.syncthreads()


def _identity(op, is_float):
    if op == "sum":
        return 0.0 if is_float else 0
    if is_float:
        return -math.inf if op == "max" else math.inf
    info = np.iinfo(np.int64)
    return int(info.min) if op == "max" else int(info.max)


if SIMULATOR:
    def _combine(op, a, b):
        # a NaN wins whichever side it is on, as in _max and _min below
        if op == "sum":
            return a + b
        if op == "max":
            return a if (a >= b or a != a) else b
        return a if (a <= b or a != a) else b

    def _make(op, sync):
        """The reduction ``op`` across a block (``sync`` None) or across the threads that
        ``sync`` (grid_sync, cluster_sync) joins."""
        grid = sync is not None
        # a device function either way, so that the branch not taken still types
        sync = sync if grid else block_sync

        @cuda.jit(device=True)
        def reduce(x, redf, redi, st, bar, shf, shi):
            # the kernel's per-warp slots are for the GPU's warp shuffles; here one slot per
            # thread, holding the thread's own Python or NumPy value
            unsigned = isinstance(x, np.uint64)
            if unsigned:
                # in the int64 slots: a sum wraps (its result is int64); max and min compare
                # the values with the top bit flipped, which orders uint64 as int64
                x = int(x)
                if op != "sum":
                    x -= 2 ** 63
                elif x >= 2 ** 63:
                    x -= 2 ** 64
            slot = st[0] & 1
            st[0] += 1
            tid, n = cuda.threadIdx.x, cuda.blockDim.x
            sh = cuda.shared.array(2048, object)
            sh[slot * 1024 + tid] = x
            cuda.syncthreads()
            mine = [sh[slot * 1024 + k] for k in range(n)]
            # Numba types the reduced variable once for every thread: float when any thread's
            # value is a float (an accumulator started as s = 0 that some threads made a float:
            # a thread that ran no iteration holds the int); then every value counts as one
            is_float = any(isinstance(v, (float, np.floating)) for v in mine)
            if is_float and not isinstance(x, (float, np.floating)):
                x = float(x)
            red = redf if is_float else redi
            acc = _identity(op, is_float)
            for v in mine:
                # (a float64 or int64 slot on the GPU: int32 values add without wrapping at 2**31)
                acc = _combine(op, acc, float(v) if is_float else np.int64(v))
            if grid:
                if tid == 0:
                    red[slot, cuda.blockIdx.x] = acc
                sync(bar)
                acc = _identity(op, is_float)
                for b in range(cuda.gridDim.x):
                    acc = _combine(op, acc, red[slot, b])
            if is_float:
                return type(x)(acc) if isinstance(x, np.floating) else float(acc)
            if unsigned and op != "sum":
                return np.uint64(int(acc) + 2 ** 63)
            return np.int64(acc)
        return reduce
else:
    from numba import float64, int64, types, uint64
    from numba.cuda.extending import overload

    @cuda.jit(device=True)
    def _add(a, b):
        return a + b

    # A NaN on either side is the result (a != a only for a NaN; always false for integers), so
    # a reduction is NaN when any thread's value is, whatever the order in which the shuffles
    # and the partials meet, as np.max and jnp.max are: with ``a if a >= b else b`` alone a NaN
    # was kept or dropped by its position (a lowered jnp.max of 64 values with one NaN gave
    # NaN only when the NaN was the last value).
    @cuda.jit(device=True)
    def _max(a, b):
        return a if (a >= b or a != a) else b

    @cuda.jit(device=True)
    def _min(a, b):
        return a if (a <= b or a != a) else b

    _COMBINE = {"sum": _add, "max": _max, "min": _min}

    def _make_core(op, sync, dtype):
        """Block reduction (``sync`` None) or grid reduction (across the threads ``sync`` joins)
        of a float64, int64 or (max and min only) float32 value; every thread gets the
        result."""
        grid = sync is not None
        sync = sync if grid else block_sync      # a device function either way (see above)
        combine = _COMBINE[op]
        ident = _identity(op, dtype == np.float64)
        full = 0xFFFFFFFF

        @cuda.jit(device=True)
        def warp_all(v):
            off = 16
            while off > 0:
                v = combine(v, cuda.shfl_xor_sync(full, v, off))
                off >>= 1
            return v

        # Each lane combines partials lane, lane + 32, ... in that order. Eight are loaded
        # before the first is combined, so up to 256 blocks cost one L2 round trip after the
        # barrier; a loop that loaded and combined one at a time (unrolled by four) waited for
        # two at 132 blocks. The result is bit for bit the one-at-a-time loop's. (Loads
        # predicated on the block count, at fixed offsets from one address: clamping the index
        # instead took eight 64-bit addresses, and a float64 Jacobi kernel went from 95 to 128
        # registers, half as many blocks resident.)
        @cuda.jit(device=True)
        def partials(red, slot, lane):
            nb = np.int64(cuda.gridDim.x)
            acc = dtype(ident)
            b = np.int64(lane)
            # unsigned indices: no negative-index test (both are in range)
            s = np.uint64(slot)
            while b < nb:
                x0 = dtype(red[s, np.uint64(b)])
                x1 = dtype(red[s, np.uint64(b + 32)]) if b + 32 < nb else dtype(ident)
                x2 = dtype(red[s, np.uint64(b + 64)]) if b + 64 < nb else dtype(ident)
                x3 = dtype(red[s, np.uint64(b + 96)]) if b + 96 < nb else dtype(ident)
                x4 = dtype(red[s, np.uint64(b + 128)]) if b + 128 < nb else dtype(ident)
                x5 = dtype(red[s, np.uint64(b + 160)]) if b + 160 < nb else dtype(ident)
                x6 = dtype(red[s, np.uint64(b + 192)]) if b + 192 < nb else dtype(ident)
                x7 = dtype(red[s, np.uint64(b + 224)]) if b + 224 < nb else dtype(ident)
                acc = combine(acc, x0)
                if b + 32 < nb:
                    acc = combine(acc, x1)
                if b + 64 < nb:
                    acc = combine(acc, x2)
                if b + 96 < nb:
                    acc = combine(acc, x3)
                if b + 128 < nb:
                    acc = combine(acc, x4)
                if b + 160 < nb:
                    acc = combine(acc, x5)
                if b + 192 < nb:
                    acc = combine(acc, x6)
                if b + 224 < nb:
                    acc = combine(acc, x7)
                b += 256
            return acc

        # ``sh`` (the per-warp slots, 2 * _MAX_WARPS of float64 or int64) is the kernel's own shared
        # array, passed in: a shared array allocated here would be one global symbol in each
        # compiled copy of this function, and reductions of two value types in one kernel
        # (a float32 and a float64 lk.max, an int32 and an int64 lk.sum) link two copies,
        # which NVVM rejects as invalid IR
        @cuda.jit(device=True)
        def core(v, red, st, bar, sh):
            slot = st[0] & 1
            st[0] += 1
            lane = cuda.threadIdx.x & 31
            warp = cuda.threadIdx.x >> 5
            v = warp_all(v)
            if lane == 0:
                sh[slot * _MAX_WARPS + warp] = v
            cuda.syncthreads()
            w = dtype(sh[slot * _MAX_WARPS + lane]) if lane < (cuda.blockDim.x >> 5) else dtype(ident)
            w = warp_all(w)
            if grid:
                if cuda.threadIdx.x == 0:
                    red[slot, cuda.blockIdx.x] = w
                sync(bar)
                w = warp_all(partials(red, slot, lane))
            return w

        return core

    def _make(op, sync):
        core_f = _make_core(op, sync, np.float64)
        core_i = _make_core(op, sync, np.int64)
        # max and min are exact: a float32 value is reduced in float32 (one 32-bit shuffle per
        # step instead of two 32-bit halves and a float64 compare), to the same result as in
        # float64 (the slots stay float64 and hold it exactly); a sum stays in float64
        core_f32 = _make_core(op, sync, np.float32) if op != "sum" else None

        def reduce(x, redf, redi, st, bar, shf, shi):
            raise NotImplementedError("only callable from a loopkern kernel")

        @overload(reduce, target="cuda")
        def _reduce_impl(x, redf, redi, st, bar, shf, shi):
            if isinstance(x, types.Float) and x.bitwidth == 32 and core_f32 is not None:
                def impl(x, redf, redi, st, bar, shf, shi):
                    return core_f32(x, redf, st, bar, shf)
                return impl
            if isinstance(x, types.Float):
                out = x

                def impl(x, redf, redi, st, bar, shf, shi):
                    return out(core_f(float64(x), redf, st, bar, shf))
                return impl
            if isinstance(x, types.Integer) and not x.signed and x.bitwidth == 64 and op != "sum":
                # uint64 with the top bit flipped orders as int64: reduced so, flipped back
                top = uint64(1 << 63)

                def impl(x, redf, redi, st, bar, shf, shi):
                    return uint64(core_i(int64(x ^ top), redi, st, bar, shi)) ^ top
                return impl
            if isinstance(x, (types.Integer, types.Boolean)):
                def impl(x, redf, redi, st, bar, shf, shi):
                    return core_i(int64(x), redi, st, bar, shi)
                return impl
            return None
        return reduce


grid_sum, grid_max, grid_min = (_make(op, grid_sync) for op in _OPS)
cluster_sum, cluster_max, cluster_min = (_make(op, cluster_sync) for op in _OPS)
_, random_uniform, random_normal = build(cuda.jit(device=True), python=SIMULATOR)
block_sum, block_max, block_min = (_make(op, None) for op in _OPS)


@cuda.jit(device=True)
def atomic_add_block(a, idx, v, redf, redi, st, bar, shf, shi):
    """``lk.atomic.add(a, idx, v)`` made by every thread of the block with one ``idx`` and
    its result unused (a top-level statement of a step, ``idx`` a constant: codegen emits it
    only there): the block's values summed first (a block reduction, in float64 or int64),
    then one atomic update per block. Every thread of the block must call it."""
    total = block_sum(v, redf, redi, st, bar, shf, shi)
    if cuda.threadIdx.x == 0:
        atomic_add(a, idx, total)


# -- run control: progress, cancellation, timeouts, debug stops ------------------------------
#
# ``host`` (int64[HOST_SIZE]) is the run's control block, in mapped pinned host memory for
# kernel(...) (a device buffer under kernel.jax); its slots and the stop codes are in layout.py.
# The leader (thread 0) polls once per step: the cycle counter rate-limits reads of the global
# timer, and those rate-limit the PCIe round trip to the host block to one per PUBLISH_NS.
POLL_CYCLES = 65536
PUBLISH_NS = 1_000_000

if SIMULATOR:
    import time

    def _special_u64(which):
        return time.monotonic_ns()      # stands in for both the global timer and the cycle counter

    def _ld_volatile(arr, idx):
        return int(arr[idx])

    def _st_volatile(arr, idx, val):
        arr[idx] = val

    # a device function, so that the simulator gives it the kernel's cuda module while it runs
    # (cuda.atomic exists only there); the plain-Python bounds checks call it from kernel code
    @cuda.jit(device=True)
    def _claim(dbg):
        return cuda.atomic.compare_and_swap(dbg, DBG_FLAG, 1) == 0
else:
    @intrinsic
    def _special_u64(typingctx, which):
        """``mov.u64`` from ``%globaltimer`` (ns) or ``%clock64`` (cycles), as int64."""
        from numba.core.errors import TypingError
        if not isinstance(which, _types.StringLiteral) or which.literal_value not in ("globaltimer", "clock64"):
            raise TypingError("expected 'globaltimer' or 'clock64'")
        reg = which.literal_value
        sig = _types.int64(which)

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []), f"mov.u64 $0, %{reg};", "=l", side_effect=True)
            return builder.call(asm, [])
        return sig, codegen

    @intrinsic
    def _ld_volatile(typingctx, arr, idx):
        """``ld.volatile`` of ``arr[idx]`` (int64): seen fresh from host memory or other threads."""
        sig = _types.int64(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            fnty = ir.FunctionType(ir.IntType(64), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.volatile.u64 $0, [$1];", "=l,l,~{memory}", side_effect=True)
            return builder.call(asm, [ptr])
        return sig, codegen

    @intrinsic
    def _st_volatile(typingctx, arr, idx, val):
        """``st.volatile`` of ``val`` into ``arr[idx]`` (int64)."""
        sig = _types.void(arr, idx, val)

        def codegen(context, builder, sig, args):
            ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            v = context.cast(builder, args[2], sig.args[2], _types.int64)
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "st.volatile.u64 [$0], $1;", "l,l,~{memory}", side_effect=True)
            builder.call(asm, [ptr, v])
            return context.get_dummy_value()
        return sig, codegen

    @cuda.jit(device=True)
    def _claim(dbg):
        return cuda.atomic.compare_and_swap(dbg, DBG_FLAG, 1) == 0


@cuda.jit(device=True)
def poll(t, host, last, publish, deadline, code):
    """The leader's stop decision before step ``t``: 0 (go on) or a stop code (sticky).

    The state lives in registers, threaded through the calls: the cycle count of the last
    look at the clock, the next time to publish, the deadline (0: none; negative: minus the
    start time, the timeout not read yet) and the decision so far. Returns the new (decision,
    last, publish, deadline).

    Host memory is read (a PCIe round trip, 1-2 µs on the kernel's path) only once per
    publish period: the host's request and, at the first period, the timeout. A run shorter
    than one period reads none; a timeout is measured from the kernel's start on the GPU clock
    but acted on no earlier than the first period (PUBLISH_NS) has passed.
    """
    c = _special_u64("clock64")
    if t == 0:
        # the step count is a posted write; nothing is read from the host yet
        code = 0
        now = _special_u64("globaltimer")
        deadline = -now
        publish = now + PUBLISH_NS
        _st_volatile(host, STEPS, t)
        return code, c, publish, deadline
    elif c - last < POLL_CYCLES:
        return code, last, publish, deadline
    last = c
    now = _special_u64("globaltimer")
    if now >= publish:
        publish = now + PUBLISH_NS
        _st_volatile(host, STEPS, t)
        req = _ld_volatile(host, REQUEST)
        if req != 0 and code == 0:
            code = req
        if deadline < 0:
            timeout = _ld_volatile(host, TIMEOUT_NS)
            deadline = -deadline + timeout if timeout > 0 else 0
    if deadline > 0 and now >= deadline and code == 0:
        code = TIMEOUT
    return code, last, publish, deadline


# One thread's step can take nanoseconds (a scalar recursion); reading the clock every step
# would then cost more than the step. So a thread-scope kernel polls every ``stride`` steps,
# doubling the stride while polls come less than POLL_CYCLES apart and shrinking it back to
# about POLL_CYCLES' worth of steps when they come more than four times that apart. The cap bounds how long a sudden run of slow steps
# goes unpolled.
POLL_STRIDE_MAX = 4096


@cuda.jit(device=True)
def poll_strided(t, host, last, publish, deadline, code, stride):
    """:func:`poll` for one thread, called every ``stride`` steps (``last``: the clock at the
    previous call). Returns (decision, last, publish, deadline, next stride)."""
    c = _special_u64("clock64")
    if t > 0:
        if c - last < POLL_CYCLES:
            if stride < POLL_STRIDE_MAX:
                stride *= 2
        elif c - last > 4 * POLL_CYCLES and stride > 1:
            stride = max(1, stride * POLL_CYCLES // (c - last))
    # last = 0: this call always looks at the timer (the stride did the rate-limiting)
    code, _, publish, deadline = poll(t, host, 0, publish, deadline, code)
    return code, c, publish, deadline, stride


@cuda.jit(device=True)
def poll_debug(t, host, last, publish, deadline, code, dbg):
    code, last, publish, deadline = poll(t, host, last, publish, deadline, code)
    return (BOUNDS if _ld_volatile(dbg, DBG_FLAG) != 0 else code), last, publish, deadline


@cuda.jit(device=True)
def finish(host, t, why):
    """Publish the final step count and stop code, then mark the run done."""
    _st_volatile(host, STEPS, t)
    _st_volatile(host, WHY, why)
    cuda.threadfence_system()
    _st_volatile(host, DONE, 1)


# The done flag is the host's proof that the run is complete: a blocking call returns as soon
# as it reads it, without synchronizing the stream (and a host reading a mapped array right
# after the call must see the last step). So it is written only after every thread's last
# global write is fenced system-wide. In one block, a fence per thread and a syncthreads
# order those writes before the leader's flag. In a grid, each block counts itself out on
# bar[1] after the same fence and syncthreads (the last-block pattern of CUDA's
# threadFenceReduction sample); the block whose increment completes the count has seen every
# other block's fenced increment, fences again (finish) and writes the flag. No block waits.
# It resets the count to zero for the next launch, which the stream orders after this one.
@cuda.jit(device=True)
def block_finish(host, bar, t, why):
    """:func:`finish` once every thread of the block has fenced its writes."""
    cuda.threadfence_system()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        finish(host, t, why)


@cuda.jit(device=True)
def grid_finish(host, bar, t, why):
    """:func:`finish` once every thread of the grid has fenced its writes (see above)."""
    cuda.threadfence_system()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        if cuda.atomic.add(bar, 1, np.uint32(1)) == np.uint32(cuda.gridDim.x - 1):
            bar[1] = np.uint32(0)
            finish(host, t, why)


#: a cluster's end of run is a grid's: the cluster is the whole grid
cluster_finish = grid_finish


@cuda.jit(device=True)
def tile_range(lo, hi, st, tlo, thi):
    """The part of ``range(lo, hi, st)`` whose values lie in this block's tile ``[tlo, thi)``:
    (first, stop) of a range with the same step (empty when ``first`` fails the loop's test)."""
    if st > 0:
        first = lo
        if first < tlo:
            first = lo + ((tlo - lo + st - 1) // st) * st
        return first, min(hi, thi)
    if st < 0:
        first = lo
        if first > thi - 1:
            first = lo - ((lo - (thi - 1) - st - 1) // -st) * -st
        return first, max(hi, tlo - 1)
    return lo, lo


@cuda.jit(device=True)
def tile_columns(n1, bnt, btid):
    """How a block's threads share the rows of a 2-D tile that are ``n1`` cells wide: each
    thread keeps one column of a row and takes it in every ``rows``-th row, so no cell costs
    a carry between row and column (see codegen ``tile_rows``). Returns (the thread's
    first row, its first column, rows per pass, columns per pass); a thread left over when
    the rows do not divide the block gets no column (its first column is ``n1``)."""
    if n1 >= bnt:
        return np.int64(0), np.int64(btid), np.int64(1), np.int64(bnt)
    width = np.int64(max(n1, 1))
    # a block's thread count is below 2**31: 32-bit divisions, not Python's 64-bit floor
    # division (tens of instructions each)
    row = np.int64(np.uint32(btid) // np.uint32(width))
    rows = np.int64(np.uint32(bnt) // np.uint32(width))
    col = np.int64(btid) - row * width
    return row, col if row < rows else np.int64(n1), rows, width


@cuda.jit(device=True)
def tile_row(x, n):
    """The tile row of an access to row ``x + tb`` of an array of ``n`` rows that wraps around
    along them, given ``x`` (the row less the tile's base): the row taken modulo ``n`` (one
    correction is enough: the row is in ``[0, n)`` and the base in ``[-halo, n)``). Every row
    of a tile that is not the block's own holds the array's row of that index modulo ``n``,
    so the row found holds the one asked for, whichever of its copies it is."""
    if x < 0:
        return x + n
    if x >= n:
        return x - n
    return x


from . import bounds as _bounds  # noqa: E402

if SIMULATOR:
    checked, in_bounds = _bounds.build_python(_claim)
else:
    checked, in_bounds = _bounds.build_numba(overload, "cuda", _claim)


# -- x << n, x >> n: a count outside 0..63 gives 0 or the sign, as on the CPU backend -------
from . import shifts as _shifts  # noqa: E402

if SIMULATOR:
    lshift, rshift = _shifts.build_python()
else:
    lshift, rshift = _shifts.build_numba(overload, "cuda")


# -- lk.atomic: the GPU's atomic read-modify-write instructions -------------------------------
from . import atomics as _atomics  # noqa: E402

if SIMULATOR:
    def _sim_rmw(op):
        # a device function: the simulator gives it the kernel's cuda module (cuda.atomic)
        if op == "add":
            return cuda.jit(device=True)(lambda a, idx, v: cuda.atomic.add(a, idx, v))
        if op == "max":
            return cuda.jit(device=True)(lambda a, idx, v: cuda.atomic.max(a, idx, v))
        return cuda.jit(device=True)(lambda a, idx, v: cuda.atomic.min(a, idx, v))

    _ATOMIC = _atomics.build_python({op: _sim_rmw(op) for op in _atomics.OPS}, in_bounds)
else:
    _ATOMIC = _atomics.build_numba(overload, "cuda", lambda op: f"cuda.atomic.{op}(a, idx, w)", dict(cuda=cuda),
                                   in_bounds)
atomic_add, atomic_max, atomic_min = _ATOMIC["atomic_add"], _ATOMIC["atomic_max"], _ATOMIC["atomic_min"]
atomic_add_checked, atomic_max_checked, atomic_min_checked = (
    _ATOMIC["atomic_add_checked"], _ATOMIC["atomic_max_checked"], _ATOMIC["atomic_min_checked"])


# -- block scope with the arrays held in shared memory ----------------------------------------
if SIMULATOR:
    def shared_like(sh, off, a):
        """A C-contiguous view of ``sh[off:off + a.size]`` with ``a``'s shape."""
        return sh[off:off + a.size].reshape(a.shape)
else:
    from numba.core import cgutils
    from numba.np.arrayobj import populate_array

    def _view_of(sh, a, sh_arg, off_arg, a_arg):
        """(signature maker, codegen) of a C-contiguous view of shared array ``sh`` from an
        element offset, with array ``a``'s shape (argument positions given)."""
        ret = _types.Array(sh.dtype, a.ndim, "C")

        def codegen(context, builder, sig, args):
            src = context.make_array(sig.args[sh_arg])(context, builder, args[sh_arg])
            like = context.make_array(sig.args[a_arg])(context, builder, args[a_arg])
            out = context.make_array(ret)(context, builder)
            start = context.cast(builder, args[off_arg], sig.args[off_arg], _types.intp)
            data = builder.gep(src.data, [start])
            shape = cgutils.unpack_tuple(builder, like.shape, a.ndim)
            itemsize = context.get_constant(_types.intp, context.get_abi_sizeof(context.get_data_type(sh.dtype)))
            strides, stride = [], itemsize
            for dim in reversed(shape):
                strides.insert(0, stride)
                stride = builder.mul(stride, dim)
            populate_array(out, data=data, shape=cgutils.pack_array(builder, shape),
                           strides=cgutils.pack_array(builder, strides), itemsize=itemsize, meminfo=None)
            return out._getvalue()
        return ret, codegen

    @intrinsic
    def shared_like(typingctx, sh, off, a):
        """A C-contiguous view of ``sh[off:off + a.size]`` with ``a``'s shape, built directly:
        ``reshape`` would link a helper library into the kernel, and Numba cannot cache
        kernels that link one."""
        ret, codegen = _view_of(sh, a, 0, 1, 2)
        return ret(sh, off, a), codegen


# -- tile mode: a block's tile of an array in shared memory (codegen._tile_lines) ----------------
if SIMULATOR:
    class _TileView:
        """``width`` elements of shared memory from ``off`` that report ``a``'s shape (the
        generated step reads ``u.shape[0]`` and indexes the tile relative to its base)."""

        def __init__(self, sh, off, width, a):
            self._data = sh[off:off + width].reshape((-1,) + tuple(a.shape[1:]))
            self.shape, self.dtype, self.size, self.ndim = a.shape, a.dtype, a.size, a.ndim

        def __getitem__(self, idx):
            return self._data[idx]

        def __setitem__(self, idx, value):
            self._data[idx] = value

        def ravel(self):
            """The tile's elements in row-major order (a view: arrays.py's flat accesses)."""
            return self._data.reshape(-1)

    def tile_like(sh, off, width, a):
        """The tile view of ``sh[off:off + width]`` with ``a``'s shape (see the GPU version)."""
        return _TileView(sh, off, width, a)
else:
    @intrinsic
    def tile_like(typingctx, sh, off, width, a):
        """``sh[off:off + width]`` as an array with ``a``'s shape: the tile of ``a`` kept in
        shared memory, of which only the first ``width`` elements are ever indexed."""
        ret, codegen = _view_of(sh, a, 0, 1, 3)
        return ret(sh, off, width, a), codegen


# -- array elements: loopkern's own loads and stores (see arrays.py) -----------------------------
from . import arrays as _arrays  # noqa: E402

if SIMULATOR:
    _ARRAYS = _arrays.build_python()
else:
    _ARRAYS = _arrays.build_numba(overload, intrinsic)
load, store, load32, store32 = _ARRAYS["load"], _ARRAYS["store"], _ARRAYS["load32"], _ARRAYS["store32"]
sload, sstore = _ARRAYS["sload"], _ARRAYS["sstore"]
sloadf, sstoref = _ARRAYS["sloadf"], _ARRAYS["sstoref"]
