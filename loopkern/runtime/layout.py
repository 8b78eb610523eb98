"""The numbers the host and the kernels agree on: the control block's slots, the stop codes
and the debug buffer's layout. The host (``runs``, ``dispatch``, the JAX bridge), the CUDA
runtime and the CPU runtime all read them from here; generated kernels call the runtimes,
so none of them is spelled as a literal anywhere else.

This module imports nothing, so that any layer may use it (Numba freezes the module-level
integers as constants in compiled code).
"""

#: int64 slots of a run's control block (mapped pinned host memory on CUDA, a NumPy array on
#: the CPU, a device buffer under ``kernel.jax``)
HOST_SIZE = 8
#: steps done: published while running (-1 until the kernel starts), final at the end
STEPS = 0
#: a request from the host, read at step boundaries: 0 none, or one of the stop codes below
REQUEST = 1
#: why the run stopped: a stop code
WHY = 2
#: 1 once the kernel is done (written last, after a system-wide fence)
DONE = 3
#: timeout in ns from the kernel's start (0: none); CUDA kernels measure it on the GPU clock
TIMEOUT_NS = 4

#: stop codes (``WHY``; the host may request CANCEL, TIMEOUT and PAUSE through ``REQUEST``)
STEPS_DONE = 0      # ran the full count
CONDITION = 1       # the step returned false
CANCEL = 2          # cancelled by the host (RunHandle.cancel, Ctrl-C, the watchdog)
TIMEOUT = 3         # timeout= expired
BOUNDS = 4          # a debug=True kernel recorded an out-of-bounds access
PAUSE = 5           # CPU backend in the calling thread: hand control back to Python for a moment
#: ``Run.stopped`` for the codes a run can end with (PAUSE is internal: the run is continued)
STOPPED = ("steps", "condition", "cancelled", "timeout", "error")

#: the debug buffer of ``debug=True`` kernels (int64[DBG_SIZE])
DBG_SIZE = 24
DBG_FLAG = 0        # 1 once an offence was recorded (the first thread to claim it writes the rest)
DBG_STEP = 1
DBG_THREAD = 2
DBG_SITE = 3        # index into KernelSource.sites
DBG_NDIM = 4        # number of indices recorded
DBG_INDEX = 5       # DBG_INDEX .. DBG_INDEX + MAX_DIMS: the index
DBG_SHAPE = 13      # DBG_SHAPE .. DBG_SHAPE + MAX_DIMS: the array's shape
MAX_DIMS = 8
