"""loopkern's own lowering of array element loads and stores in CUDA kernels.

Numba lowers ``a[i]`` on a device array to 64-bit index arithmetic and a *generic* load or
store (``ld``/``st`` without a state space), which the GPU resolves to global memory at run
time. For an element access whose indices the front end proved non-negative (they arrive
wrapped in ``uint64``, see ``index_bounds.py``) on a C-contiguous array, generated kernels call
these functions instead:

- ``load(a, idx)`` / ``store(a, idx, value)``: the element's address computed from the shape
  (no stride loads), a ``ld.global``/``st.global`` through an ``addrspace(1)`` pointer;
- ``load32`` / ``store32``: the same with a 1-D array's element offset computed in 32 bits,
  for kernels the host specialised because every array argument has fewer than 2**31
  elements (an in-bounds offset then fits; an out-of-bounds index is undefined behaviour in a
  kernel without ``debug=True`` either way). Arrays of two or more dimensions keep 64-bit
  offsets in these too: measured slower in 32 bits (see ``_address``).

The loads are plain weak ``ld.global`` (not ``ld.global.nc``): a swap buffer is written every
other step, so its loads must stay coherent across the grid barrier, exactly as the generic
loads they replace. Any other access (an index not proven non-negative, fewer indices than
dimensions, a non-contiguous array) falls back to Numba's own ``a[idx]``, with Python's
meaning.

- ``sload`` / ``sstore``: for a view of shared memory (a tile-mode kernel's tiles, block
  scope's staged arrays): the same addressing through an ``addrspace(3)`` pointer
  (``ld.shared``/``st.shared``), with 64-bit offsets (32-bit ones kept LLVM from giving a
  stencil's neighbours one base address with immediate offsets).
- ``sloadf`` / ``sstoref``: an element of a C-contiguous array in shared memory by its flat
  (row-major) offset, for 2-D tiles whose accesses codegen writes as one offset per cell plus
  each access's own (``_Lower.visit_Subscript``): LLVM then shares the cell's offset between
  a stencil's neighbours, where the row-major ``(i + c) * m + j`` of each access is computed
  anew.
"""

from __future__ import annotations


def build_numba(overload, intrinsic, target="cuda") -> dict:
    """The functions as Numba overloads for ``target``: {"load", "store", "load32", "store32",
    "sload", "sstore"} (the last two for arrays in shared memory)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils

    def _address(context, builder, aryty, ary, idxty, idx, bits, space, flat=False):
        """The ``addrspace(space)`` pointer to ``ary[idx]`` (C layout, every index >= 0), or
        with ``flat`` to the element at flat offset ``idx``."""
        a = context.make_array(aryty)(context, builder, ary)
        n = 1 if flat else aryty.ndim
        if n > 1:
            # measured on the H200 (bench/lowering_probe.py, 2026-12-03): 32-bit row-major
            # offsets keep LLVM from sharing one address between a stencil's neighbours, so
            # Jacobi 2048² ran 19.5 µs/step against 15.1 with 64-bit offsets, Life 1024² 11.7
            # against 10.6; in 1-D they win (heat 1M: 3.77 against 4.35)
            bits = 64
        idxs = cgutils.unpack_tuple(builder, idx, n) if isinstance(idxty, types.BaseTuple) else [idx]
        ity = ir.IntType(bits)

        def narrow(v):
            w = v.type.width
            return builder.trunc(v, ity) if w > bits else builder.zext(v, ity) if w < bits else v
        lin = narrow(idxs[0])
        if n > 1:
            shape = cgutils.unpack_tuple(builder, a.shape, n)
            for k in range(1, n):
                lin = builder.add(builder.mul(lin, narrow(shape[k])), narrow(idxs[k]))
        off = builder.zext(lin, ir.IntType(64)) if bits < 64 else lin
        elem = context.get_data_type(aryty.dtype)
        data = builder.addrspacecast(a.data, ir.PointerType(elem, space))
        return builder.gep(data, [off], inbounds=True)

    def _fits(aryty, idxty, flat=False):
        """A C-contiguous array indexed by one unsigned integer per dimension (``flat``: one
        unsigned integer, the flat offset)."""
        if not isinstance(aryty, types.Array) or aryty.layout != "C" or aryty.ndim < 1:
            return False
        kinds = list(idxty.types) if isinstance(idxty, types.BaseTuple) else [idxty]
        return len(kinds) == (1 if flat else aryty.ndim) and all(isinstance(k, types.Integer) and not k.signed
                                                                 for k in kinds)

    def make(bits, space=1, flat=False):
        @intrinsic
        def _load(typingctx, ary, idx):
            def codegen(context, builder, sig, args):
                ptr = _address(context, builder, sig.args[0], args[0], sig.args[1], args[1], bits, space, flat)
                return context.unpack_value(builder, sig.args[0].dtype, ptr)
            return ary.dtype(ary, idx), codegen

        @intrinsic
        def _store(typingctx, ary, idx, val):
            def codegen(context, builder, sig, args):
                ptr = _address(context, builder, sig.args[0], args[0], sig.args[1], args[1], bits, space, flat)
                v = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
                context.pack_value(builder, sig.args[0].dtype, v, ptr)
                return context.get_dummy_value()
            return types.void(ary, idx, val), codegen

        def load(a, idx):
            raise NotImplementedError("only callable from a loopkern kernel")

        def store(a, idx, v):
            raise NotImplementedError("only callable from a loopkern kernel")

        @overload(load, target=target)
        def _ol_load(a, idx):
            if _fits(a, idx, flat):
                return lambda a, idx: _load(a, idx)
            if flat:
                return lambda a, idx: a.reshape(a.size)[idx]
            return lambda a, idx: a[idx]

        @overload(store, target=target)
        def _ol_store(a, idx, v):
            if _fits(a, idx, flat) and isinstance(v, (types.Number, types.Boolean)):
                return lambda a, idx, v: _store(a, idx, v)
            if flat:
                def generic_flat(a, idx, v):
                    a.reshape(a.size)[idx] = v
                return generic_flat

            def generic(a, idx, v):
                a[idx] = v
            return generic
        return load, store

    load64, store64 = make(64)
    load32, store32 = make(32)
    sload, sstore = make(64, 3)
    sloadf, sstoref = make(64, 3, flat=True)
    return {"load": load64, "store": store64, "load32": load32, "store32": store32, "sload": sload, "sstore": sstore,
            "sloadf": sloadf, "sstoref": sstoref}


def build_python() -> dict:
    """The same functions for Numba's CUDA simulator: plain indexing."""
    def load(a, idx):
        return a[idx]

    def store(a, idx, v):
        a[idx] = v

    # (ravel: a view of a C-contiguous array, or of a tile, runtime/cuda_rt.py's _TileView)
    def loadf(a, idx):
        return a.ravel()[idx]

    def storef(a, idx, v):
        a.ravel()[idx] = v
    return {"load": load, "store": store, "load32": load, "store32": store, "sload": load, "sstore": store,
            "sloadf": loadf, "sstoref": storef}
