"""A stand-in CUDA device, so that Numba compiles kernels to PTX on a machine without a GPU
(nothing is linked, loaded or run)."""
import ctypes
import os


def use_stand_in_device(cc=(9, 0)) -> None:
    """Make Numba's CUDA compiles ask a stand-in device of compute capability ``cc``; load the
    libnvvm named by $NVVM_SO first when it is set (before Numba looks for one). Call before
    anything compiles."""
    if os.environ.get("NVVM_SO"):
        ctypes.CDLL(os.environ["NVVM_SO"], mode=ctypes.RTLD_GLOBAL)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    import numba.cuda.api as api
    import numba.cuda.dispatcher as disp

    class StandIn:
        compute_capability = tuple(cc)
        id = 0
        name = b"stand-in for compiling only"
    api.get_current_device = disp.get_current_device = lambda: StandIn()
