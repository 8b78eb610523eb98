"""Launching and waiting through the CUDA driver directly (``libcuda`` via ctypes).

A cached :class:`~loopkern.dispatch.plan.LaunchPlan` holds the kernel's parameter words; a call
only writes its pointers and scalars into them and launches, so Numba's per-call argument
marshalling (tens of microseconds) is left out. Numba still compiles the kernel, loads its
module and owns the context: the kernel handle comes from Numba's compiled kernel, and a
thread that has no current context gets Numba's (the device's primary context) first.

Under Numba's CUDA simulator nothing here is used: the simulator runs Python.
"""

from __future__ import annotations

import ctypes
import threading

from ..errors import LaunchError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_EVENT_DISABLE_TIMING = 2

_lock = threading.Lock()
_lib: list = []
_threads_with_context: set = set()


class _Driver:
    """The few driver entry points the launch path needs, with their ctypes signatures."""

    def __init__(self, lib):
        vp, u, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t

        def fn(name, *argtypes):
            f = getattr(lib, name)
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            return f

        self.launch = fn("cuLaunchKernel", vp, u, u, u, u, u, u, u, vp, vp, vp)
        self.launch_cooperative = fn("cuLaunchCooperativeKernel", vp, u, u, u, u, u, u, u, vp, vp)
        self.ctx_get_current = fn("cuCtxGetCurrent", ctypes.POINTER(vp))
        self.event_create = fn("cuEventCreate", ctypes.POINTER(vp), u)
        self.event_record = fn("cuEventRecord", vp, vp)
        self.event_query = fn("cuEventQuery", vp)
        self.event_synchronize = fn("cuEventSynchronize", vp)
        self.stream_query = fn("cuStreamQuery", vp)
        self.memcpy_htod = fn("cuMemcpyHtoD_v2", ctypes.c_uint64, vp, sz)
        self.memcpy_dtoh = fn("cuMemcpyDtoH_v2", vp, ctypes.c_uint64, sz)
        self.memset_d8 = fn("cuMemsetD8_v2", ctypes.c_uint64, ctypes.c_ubyte, sz)
        self.get_error_name = fn("cuGetErrorName", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self.func_set_attribute = fn("cuFuncSetAttribute", vp, ctypes.c_int, ctypes.c_int)
        # Numba's handles come from cuLibraryGetKernel (CUkernel), which cuFuncSetAttribute
        # rejects; cuKernelSetAttribute (CUDA 12.0+) sets the attribute for one device
        self.kernel_set_attribute = getattr(lib, "cuKernelSetAttribute", None)
        if self.kernel_set_attribute is not None:
            self.kernel_set_attribute.argtypes = [ctypes.c_int, ctypes.c_int, vp, ctypes.c_int]
            self.kernel_set_attribute.restype = ctypes.c_int
        # cuLaunchKernelEx (CUDA 12+) takes the grid as one prepared struct: called with four
        # ready ctypes objects and no argtypes, ctypes converts nothing, which saves a few
        # microseconds per launch against the eleven arguments of cuLaunchKernel
        try:
            self.launch_ex = lib.cuLaunchKernelEx
            self.launch_ex.restype = ctypes.c_int
        except AttributeError:
            self.launch_ex = None
        # thread-block clusters (CUDA 12+): how many fit, and a CUkernel's CUfunction
        self.occupancy_clusters = self.kernel_get_function = None
        if hasattr(lib, "cuOccupancyMaxActiveClusters"):
            self.occupancy_clusters = fn("cuOccupancyMaxActiveClusters", ctypes.POINTER(ctypes.c_int), vp, vp)
        if hasattr(lib, "cuKernelGetFunction"):
            self.kernel_get_function = fn("cuKernelGetFunction", ctypes.POINTER(vp), vp)


def driver() -> _Driver:
    """The process's libcuda bindings (loaded on first use; Numba has already initialised CUDA)."""
    if not _lib:
        with _lock:
            if not _lib:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError:
                    lib = ctypes.CDLL("nvcuda.dll" if hasattr(ctypes, "WinDLL") else "libcuda.so")
                _lib.append(_Driver(lib))
    return _lib[0]


def error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if driver().get_error_name(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
        return name.value.decode()
    return f"CUDA error {code}"


def check(code: int, what: str):
    """LaunchError naming the driver's error unless ``code`` is CUDA_SUCCESS."""
    if code != CUDA_SUCCESS:
        raise LaunchError(f"{what} failed: {error_name(code)} ({code})")


def ensure_context():
    """Make Numba's context current on this thread (once per thread): the driver calls below use
    the calling thread's current context, which a new thread does not have."""
    ident = threading.get_ident()
    if ident not in _threads_with_context:
        from numba import cuda
        cuda.current_context()
        _threads_with_context.add(ident)


_tls = threading.local()


def current_context() -> int:
    """The calling thread's current CUDA context handle (0 if none)."""
    try:
        get, buf, ref = _tls.ctx
    except AttributeError:
        buf = ctypes.c_void_p()
        get, ref = driver().ctx_get_current, ctypes.byref(buf)
        _tls.ctx = (get, buf, ref)
    get(ref)
    return buf.value or 0


def kernel_handle(kernel) -> int:
    """The driver handle (CUfunction, or a CUkernel, which the launch calls also accept) of a
    Numba-compiled kernel in the current context."""
    kernel.bind()
    return int(kernel._codelibrary.get_cufunc().handle)


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


CUDA_ERROR_INVALID_HANDLE = 400


def _set_attribute(func: int, attr: int, value: int, device: int, what: str):
    """Set attribute ``attr`` of kernel ``func`` on device ordinal ``device``.

    ``func`` may be a CUkernel (what Numba's library loading hands out) or a CUfunction: the
    kernel call is tried first and the function call only when the driver says the handle is
    not a kernel; any other error, or both refusing, raises LaunchError.
    """
    d = driver()
    if d.kernel_set_attribute is not None:
        code = d.kernel_set_attribute(attr, value, func, device)
        if code != CUDA_ERROR_INVALID_HANDLE:
            check(code, f"cuKernelSetAttribute({what}, {value})")
            return
    check(d.func_set_attribute(func, attr, value), f"cuFuncSetAttribute({what}, {value})")


def allow_dynamic_shared(func: int, nbytes: int, device: int):
    """Let kernel ``func`` launch on device ordinal ``device`` with ``nbytes`` of dynamic shared
    memory (above 48 KiB a kernel must opt in)."""
    _set_attribute(func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes, device,
                   "MAX_DYNAMIC_SHARED_SIZE_BYTES")


#: blocks in a thread-block cluster: at most 8 everywhere, 16 where the device allows a
#: non-portable size (H100/H200) and the kernel opted in
CLUSTER_PORTABLE_MAX = 8
CLUSTER_MAX = 16


def allow_large_clusters(func: int, device: int):
    """Let kernel ``func`` launch in clusters of more than CLUSTER_PORTABLE_MAX blocks."""
    _set_attribute(func, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1, device,
                   "NON_PORTABLE_CLUSTER_SIZE_ALLOWED")


def max_active_clusters(func: int, blocks: int, threads: int, shared: int) -> int:
    """How many clusters of ``blocks`` blocks of kernel ``func`` (``threads`` threads and
    ``shared`` bytes of dynamic shared memory each) the current device can run at once; 0 if
    none can (the driver refusing the size counts as none)."""
    d = driver()
    if d.occupancy_clusters is None:
        return 0
    cfg = _LaunchConfig(blocks, 1, 1, threads, 1, 1, shared, None, None, 0)
    attr = _ClusterAttribute(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 0, blocks, 1, 1)
    cfg.attrs, cfg.nattrs = ctypes.addressof(attr), 1
    count = ctypes.c_int(0)
    code = d.occupancy_clusters(ctypes.byref(count), ctypes.c_void_p(func), ctypes.byref(cfg))
    if code == CUDA_ERROR_INVALID_HANDLE and d.kernel_get_function is not None:
        # a CUkernel handle: the occupancy query wants the function in the current context
        f = ctypes.c_void_p()
        check(d.kernel_get_function(ctypes.byref(f), ctypes.c_void_p(func)), "cuKernelGetFunction")
        code = d.occupancy_clusters(ctypes.byref(count), f, ctypes.byref(cfg))
    return int(count.value) if code == CUDA_SUCCESS else 0


def new_event() -> int:
    ev = ctypes.c_void_p()
    check(driver().event_create(ctypes.byref(ev), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    return ev.value


class ParamBlock:
    """A kernel's parameters as 8-byte words, with the pointer array the launch call takes.

    Every Numba kernel parameter is at most 8 bytes (an array is 5 + 2*ndim of them), and the
    driver reads each through its own pointer with the size the kernel declares, so a value
    smaller than 8 bytes sits in the low bytes of its word (little-endian).
    """

    def __init__(self, nwords: int):
        import numpy as np
        self.words = np.zeros(max(nwords, 1), np.uint64)
        base = self.words.ctypes.data
        self.params = (ctypes.c_void_p * max(nwords, 1))(*[base + 8 * k for k in range(max(nwords, 1))])


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, and a 64-byte value union (here its int)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h): grid and block sizes, dynamic shared memory, stream, attributes."""
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("nattrs", ctypes.c_uint)]


class _ClusterAttribute(ctypes.Structure):
    """CUlaunchAttribute holding a cluster's dimensions (the value union's clusterDim)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("x", ctypes.c_uint), ("y", ctypes.c_uint),
                ("z", ctypes.c_uint), ("rest", ctypes.c_char * 52)]


CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
assert ctypes.sizeof(_LaunchAttribute) == 72 and ctypes.sizeof(_ClusterAttribute) == 72


def make_launcher(func: int, blocks: int, threads: int, shared: int, cooperative: bool, cluster: bool = False):
    """A call ``launch(params) -> CUresult`` that launches kernel ``func`` on the legacy default
    stream with this grid (cooperatively if asked; as one thread-block cluster of every block
    if ``cluster``), ``params`` being the parameter pointer array (:class:`ParamBlock`'s
    ``params``)."""
    d = driver()
    if cluster and d.launch_ex is None:
        raise LaunchError("scope='cluster' needs cuLaunchKernelEx (a CUDA 12 driver)")
    if d.launch_ex is not None:
        cfg = _LaunchConfig(blocks, 1, 1, threads, 1, 1, shared, None, None, 0)
        if cluster:
            # every block in one cluster: all are scheduled together, as a cooperative launch
            # promises, and the cluster's hardware barrier spans the grid
            attr = _ClusterAttribute(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 0, blocks, 1, 1)
        else:
            attr = _LaunchAttribute(CU_LAUNCH_ATTRIBUTE_COOPERATIVE, 0, 1)
        if cooperative or cluster:
            cfg.attrs, cfg.nattrs = ctypes.addressof(attr), 1

        def launch(params, fn=d.launch_ex, ref=ctypes.byref(cfg), f=ctypes.c_void_p(func), _keep=(cfg, attr)):
            return fn(ref, f, params, None)
    elif cooperative:
        def launch(params, fn=d.launch_cooperative, head=(func, blocks, 1, 1, threads, 1, 1, shared, None)):
            return fn(*head, params)
    else:
        def launch(params, fn=d.launch, head=(func, blocks, 1, 1, threads, 1, 1, shared, None)):
            return fn(*head, params, None)
    return launch
