"""Build, load and register loopkern's XLA FFI shim (``ffi_shim.c``), the only C in loopkern.

The shim is compiled with cffi on first use into the cache directory, against the XLA FFI
header that jaxlib ships. It needs a C compiler and Python's headers but no CUDA toolkit,
GPU or driver: libcuda is opened at run time.

A custom call names its kernel by an image id (:func:`register_image`), not by a CUfunction:
a CUfunction belongs to one device's context, while under ``jax.shard_map`` the same custom
call runs on every device of the mesh. The handler loads the image into the context of the
stream XLA hands it, once per device, and keeps the function (``ffi_shim.c``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from pathlib import Path

from ..errors import BackendError

TARGET = "loopkern_launch"
_SRC = Path(__file__).with_name("ffi_shim.c")
_CDEF = """
int lk_register_image(const void* image, size_t len, const char* entry, int64_t* id, char* err, size_t errlen);
int lk_load_function(int device, int64_t id, char* err, size_t errlen);
int lk_current_device(int* device, int* major, int* minor, int* sms, char* err, size_t errlen);
int lk_function_limits(int device, int64_t id, int64_t threads, int64_t shared, int* max_threads, int64_t* blocks,
                       int* static_shared, char* err, size_t errlen);
int lk_device_shared(int device, int* per_block_optin, int* per_sm, char* err, size_t errlen);
void* lk_launch_address(void);
"""
_lock = threading.Lock()
_state: dict = {}


def build_shim():
    """Compile (once, cached on disk) and import the shim; returns the cffi module."""
    with _lock:
        if "mod" in _state:
            return _state["mod"]
        import jax.ffi
        from cffi import FFI

        from ..compile import cache_dir
        include = jax.ffi.include_dir()
        header = Path(include) / "xla" / "ffi" / "api" / "c_api.h"
        source = _SRC.read_text()
        key = hashlib.sha256(source.encode() + header.read_bytes() + sys.version.encode()).hexdigest()[:16]
        name = f"_loopkern_xla_ffi_{key}"
        build = cache_dir().parent / "ffi" / key
        build.mkdir(parents=True, exist_ok=True)
        built = sorted(build.glob(f"{name}*.so"))
        if not built:
            ffi = FFI()
            ffi.cdef(_CDEF)
            # pthread: the handler's table of loaded kernels is shared by XLA's threads
            ffi.set_source(name, source, include_dirs=[include], libraries=["dl", "pthread"],
                           extra_compile_args=["-O2"])
            try:
                built = [Path(ffi.compile(tmpdir=str(build), verbose=False))]
            except Exception as exc:
                raise BackendError(f"could not build loopkern's XLA FFI shim (needs a C compiler and Python "
                                   f"headers): {exc}") from exc
        spec = importlib.util.spec_from_file_location(name, built[0])
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _state["mod"] = mod
        return mod


def register_cuda_target():
    """Register the shim's handler with XLA for the CUDA platform (once)."""
    mod = build_shim()
    with _lock:
        if _state.get("registered"):
            return
        import ctypes

        import jax.ffi
        addr = int(mod.ffi.cast("uintptr_t", mod.lib.lk_launch_address()))
        fn = ctypes.cast(ctypes.c_void_p(addr), ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(fn), platform="CUDA")
        _state["fn"] = fn    # keep the ctypes object alive
        _state["registered"] = True


def register_image(cubin: bytes, entry: str) -> int:
    """Register a kernel image with the shim (a copy, kept for the life of the process).

    Args:
        cubin: the compiled kernel, for one compute capability.
        entry: the name of its kernel function.

    Returns:
        The image's id, the custom call's ``kernel`` attribute; the same image and entry
        registered again give the same id.
    """
    mod = build_shim()
    ffi, lib = mod.ffi, mod.lib
    out = ffi.new("int64_t*")
    err = ffi.new("char[512]")
    if lib.lk_register_image(ffi.from_buffer(cubin), len(cubin), entry.encode(), out, err, 512) != 0:
        raise BackendError(ffi.string(err).decode(errors="replace"))
    return int(out[0])


def load_function(device: int, image_id: int) -> None:
    """Load a registered image into the device's primary context, as the handler would on its
    first call there (it then finds it loaded): so that a cubin the device cannot run is
    reported when the call is built, not when XLA runs it.

    Raises:
        BackendError: libcuda is missing, or the driver could not load the image.
    """
    mod = build_shim()
    ffi, lib = mod.ffi, mod.lib
    err = ffi.new("char[512]")
    if lib.lk_load_function(device, image_id, err, 512) != 0:
        raise BackendError(ffi.string(err).decode(errors="replace"))


def _ints(function: str, count: int, *args) -> list[int]:
    """The ``count`` ints that the shim's ``function(*args, int* out..., err, errlen)`` writes.

    Raises:
        BackendError: with the shim's message, when it fails.
    """
    mod = build_shim()
    ffi, lib = mod.ffi, mod.lib
    out = ffi.new(f"int[{count}]")
    err = ffi.new("char[512]")
    if getattr(lib, function)(*args, *(out + k for k in range(count)), err, 512) != 0:
        raise BackendError(ffi.string(err).decode(errors="replace"))
    return [int(out[k]) for k in range(count)]


def current_device() -> tuple:
    """(ordinal, compute capability, SM count) of the calling thread's current CUDA device (that
    of its current context; device 0 without one, as for Numba), through the driver: no Numba.

    Raises:
        BackendError: libcuda is missing or the driver refused.
    """
    device, major, minor, sms = _ints("lk_current_device", 4)
    return device, (major, minor), sms


def function_limits(device: int, image_id: int, threads: int = 0, shared: int = 0) -> tuple:
    """(most threads per block, blocks of ``threads`` threads with ``shared`` bytes of dynamic
    shared memory that fit on the device at once (0 when ``threads`` is 0), bytes of static
    shared memory) of a registered image's function in device ``device``'s primary context,
    loading it there if needed. A ``shared`` above the default 48 KiB is allowed to the function
    first, as its launch does.

    Raises:
        BackendError: libcuda is missing, or the driver could not load or query the function.
    """
    mod = build_shim()
    ffi, lib = mod.ffi, mod.lib
    most = ffi.new("int*")
    blocks = ffi.new("int64_t*")
    static = ffi.new("int*")
    err = ffi.new("char[512]")
    if lib.lk_function_limits(device, image_id, threads, shared, most, blocks, static, err, 512) != 0:
        raise BackendError(ffi.string(err).decode(errors="replace"))
    return int(most[0]), int(blocks[0]), int(static[0])


def device_shared(device: int) -> tuple:
    """(bytes of shared memory a block may opt in to, bytes an SM holds) of device ``device``,
    through the driver: no Numba.

    Raises:
        BackendError: libcuda is missing or the driver refused.
    """
    return tuple(_ints("lk_device_shared", 2, device))
