"""Small LLVM helpers shared by the CPU and CUDA runtimes' intrinsics."""

from numba import types


def element_ptr(context, builder, aryty, ary, idx, idxty):
    """Pointer to ``ary[idx]`` (a 1-D contiguous array; ``idx`` of type ``idxty``)."""
    a = context.make_array(aryty)(context, builder, ary)
    return builder.gep(a.data, [context.cast(builder, idx, idxty, types.int64)])
