"""Turn generated kernel source into a Numba dispatcher: the only module that imports numba
for compiling.

The source is written to a file in the cache directory named by its hash and imported from
there, so that Numba's own on-disk cache (``cache=True``) can reuse the machine code in a new
process, and so that tracebacks show real lines. Numba compiles once per argument-type
signature. Errors from Numba are re-raised as :class:`~loopkern.errors.CompileError` pointing
at the user's line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .codegen import KernelSource
from .errors import CompileError

_LOCK = threading.Lock()
_MODULES: dict[str, object] = {}


_NUMBA_CONFIG: list = []


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1`` at import).

    Asked on every call, so the config module is looked up once (an import statement per call
    costs more than the rest of the question); the flag itself is read each time.
    """
    if not _NUMBA_CONFIG:
        if "numba" not in sys.modules:
            # what Numba's config will read when it is imported; not importing it here keeps a
            # kernel.jax call whose cubin is on disk free of Numba (interop/ffi_kernels.py)
            try:
                return bool(int(os.environ.get("NUMBA_ENABLE_CUDASIM") or 0))
            except ValueError:
                pass
        from numba import config
        _NUMBA_CONFIG.append(config)
    return bool(_NUMBA_CONFIG[0].ENABLE_CUDASIM)


def cache_dir() -> Path:
    """Where generated sources (and Numba's cache beside them) live.

    ``$LOOPKERN_CACHE_DIR`` if set, else ``~/.cache/loopkern``; a temporary directory if
    neither is writable.
    """
    base = os.environ.get("LOOPKERN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "loopkern")
    path = Path(base) / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError:
        path = Path(tempfile.gettempdir()) / f"loopkern-{os.getuid() if hasattr(os, 'getuid') else 'user'}" / "kernels"
        path.mkdir(parents=True, exist_ok=True)
    return path


def numba_version() -> str:
    """Numba's version, without importing Numba when it is not loaded yet (from its metadata)."""
    mod = sys.modules.get("numba")
    if mod is not None:
        return mod.__version__
    from importlib import metadata
    try:
        return metadata.version("numba")
    except metadata.PackageNotFoundError:
        import numba
        return numba.__version__


def runtime_fingerprint() -> str:
    """Hash of the runtime modules generated code imports: a change to them must miss the cache."""
    from . import __version__

    # read, not imported: importing cuda_rt would load numba.cuda for a CPU-only run
    h = hashlib.sha256(f"{__version__} numba {numba_version()}".encode())
    here = Path(__file__).resolve().parent / "runtime"
    # every module of the package, so that a new one cannot be left out
    for path in sorted(here.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class CompiledKernel:
    """A loaded kernel module and its dispatcher.

    Attributes:
        source: what was compiled.
        dispatcher: the Numba dispatcher of ``_lk_kernel``.
        path: the file the source was loaded from.
    """

    source: KernelSource
    dispatcher: object
    path: Path
    _specialized: dict = field(default_factory=dict, repr=False)
    _types: dict = field(default_factory=dict, repr=False)

    def type_of(self, value):
        """The Numba type the kernel will see for ``value``."""
        typeof = getattr(self.dispatcher, "typeof_pyval", None)
        if typeof is not None:
            return typeof(value)
        import numba
        try:
            return numba.typeof(value)
        except Exception:   # the simulator's fake device arrays: describe them the same way
            host = getattr(value, "_ary", None)
            return numba.typeof(host) if host is not None else type(value)

    def types_of(self, args) -> tuple:
        """Numba types of ``args``, memoized on cheap properties (typeof costs microseconds per
        argument, which adds up on every call)."""
        key = tuple(_cheap_key(a) for a in args)
        if None not in key:
            hit = self._types.get(key)
            if hit is None:
                hit = self._types[key] = tuple(self.type_of(a) for a in args)
            return hit
        return tuple(self.type_of(a) for a in args)

    def specialize(self, args: tuple):
        """Compile for the types of ``args`` (once per signature).

        Returns what the launch layer calls: the compiled overload's entry point (CPU), the
        compiled kernel (CUDA), or the dispatcher (simulator). Calling those directly skips
        the dispatcher's own per-call type resolution.
        """
        return self.specialize_types(self.types_of(args))

    def specialize_types(self, types: tuple):
        """:meth:`specialize` for the Numba types of the arguments."""
        hit = self._specialized.get(types)
        if hit is not None:
            return hit
        with _translate_errors(self):
            if self.source.backend == "cpu":
                with _cpu_unroll_capped():
                    self.dispatcher.compile(types)
                kernel = self.dispatcher.overloads[types].entry_point
            elif simulator_enabled():
                kernel = self.dispatcher   # the simulator runs Python: nothing to compile
            else:
                kernel = self.dispatcher.compile(types)
        self._specialized[types] = kernel
        return kernel

    def load_for_ffi(self, types: tuple, xla_ffi, disk_key=None):
        """Compile for ``types`` and register the cubin with the XLA FFI shim.

        Once per signature and compute capability (the cubin is built for the current device's),
        not per device: the custom call names the image by its id, and the shim's handler loads
        it into the context of the stream XLA hands it, once per device (``ffi_shim.c``), so one
        call can run on every device of a mesh. The image is also loaded into the current device
        here, so that a cubin it cannot run is reported now rather than from inside XLA.

        ``disk_key``: a description of ``types`` without Numba (see :func:`cubin_key`); when
        given, the cubin is also written to the disk cache under it, so that a later process
        can launch it without Numba (:func:`load_cubin`).

        Returns:
            (the Numba kernel, for the occupancy query that sizes the grid on the current
            device; the image id, the custom call's ``kernel`` attribute).
        """
        from numba import cuda
        dev = cuda.get_current_device()
        key = ("ffi", types, dev.compute_capability)
        hit = self._specialized.get(key)
        if hit is not None:
            return hit
        with _translate_errors(self):
            kernel = self.dispatcher.compile(types)
        # the cubin Numba linked when it bound the kernel (for the device's own architecture,
        # sm_90a on an H200): asking for it by compute capability, (9, 0), made NVVM and the
        # linker build a second one, a third of a new body's compile time
        cubin = kernel._codelibrary.get_cubin()
        image = getattr(cubin, "code", cubin)
        entry = _entry_name(kernel)
        image_id = xla_ffi.register_image(bytes(image), entry)
        xla_ffi.load_function(dev.id, image_id)
        if disk_key is not None:
            store_cubin(cubin_key(self.source.text, disk_key, dev.compute_capability), bytes(image), entry,
                        int(kernel.max_threads_per_block))
        self._specialized[key] = (kernel, image_id)
        return kernel, image_id


# -- cubins on disk: kernel.jax without Numba ----------------------------------------------
#
# kernel.jax's custom call names a cubin that the FFI shim loads itself (interop/ffi_shim.c);
# Numba only compiles it. So each cubin it compiles is also written here, with its entry point
# and the most threads per block it can run, under a key of everything that made it: the
# generated source (which carries runtime_fingerprint), the kernel's parameter types, the
# compute capability and the versions of Numba and numba-cuda. A new process building the same
# call finds it (interop/jax_bridge.py) and registers it with the shim directly: Numba is not
# even imported. A file that cannot be read, or does not hold what its name says, is a miss.

@dataclass(frozen=True)
class CachedCubin:
    image: bytes
    entry: str
    max_threads_per_block: int


def _package_version(name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def cubin_key(source_text: str, types_key, cc) -> str:
    """The disk cache key of the cubin of ``source_text`` for parameters ``types_key`` (any
    repr-stable description) on compute capability ``cc``."""
    h = hashlib.sha256(source_text.encode())
    h.update(repr((types_key, tuple(cc), numba_version(), _package_version("numba-cuda"))).encode())
    return h.hexdigest()[:32]


def _cubin_paths(key: str):
    d = cache_dir().parent / "cubins"
    return d / f"{key}.cubin", d / f"{key}.json"


def store_cubin(key: str, image: bytes, entry: str, max_threads_per_block: int) -> None:
    """Write a cubin to the disk cache (atomically; a failure to write only loses the cache)."""
    import json
    image_path, meta_path = _cubin_paths(key)
    meta = dict(entry=entry, max_threads_per_block=max_threads_per_block, bytes=len(image),
                sha256=hashlib.sha256(image).hexdigest())
    try:
        image_path.parent.mkdir(parents=True, exist_ok=True)
        for path, data in ((image_path, image), (meta_path, json.dumps(meta).encode())):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
    except OSError:
        pass


def load_cubin(key: str) -> CachedCubin | None:
    """The cubin stored under ``key``, or None (absent, unreadable, or not the bytes its
    metadata describes)."""
    import json
    image_path, meta_path = _cubin_paths(key)
    try:
        meta = json.loads(meta_path.read_text())
        image = image_path.read_bytes()
        if len(image) != meta["bytes"] or hashlib.sha256(image).hexdigest() != meta["sha256"]:
            return None
        return CachedCubin(image, str(meta["entry"]), int(meta["max_threads_per_block"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cheap_key(v):
    """A hashable summary of what Numba's typeof looks at, or None where it cannot be had cheaply."""
    t = type(v)
    if t is np.ndarray:
        f = v.flags
        return (t, v.dtype.str, v.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned)
    if isinstance(v, np.generic):
        return (t,)
    flags = getattr(v, "flags", None)
    if t.__name__ == "DeviceNDArray" and isinstance(flags, dict):
        return (t, v.dtype.str, v.ndim, flags.get("C_CONTIGUOUS"), flags.get("F_CONTIGUOUS"))
    return None


def _entry_name(kernel) -> str:
    name = getattr(kernel, "entry_name", None)
    if name:
        return name
    return kernel._codelibrary.get_cufunc().name


def compile_kernel(source: KernelSource) -> CompiledKernel:
    """Load ``source`` as a module from the cache directory and return its dispatcher.

    Nothing is compiled to machine code until :meth:`CompiledKernel.specialize` or a call.
    """
    with _LOCK:
        mod = _MODULES.get(source.digest)
        path = cache_dir() / f"{_safe(source.step_name)}_{source.backend}_{source.scope}_{source.digest}.py"
        if mod is None:
            if not path.exists() or path.read_text() != source.text:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(source.text)
                os.replace(tmp, path)
            name = f"loopkern_generated_{source.digest}"
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            try:
                spec.loader.exec_module(mod)
            except Exception:
                sys.modules.pop(name, None)
                raise
            if source.backend == "cuda":
                _without_link_time_optimisation(mod._lk_kernel)
                if simulator_enabled() and hasattr(mod, "_lk_math"):
                    # the simulator runs the kernel as Python: math as a GPU computes it
                    # (NaN and infinities where CPython's math raises), looked up at run time
                    from .runtime import sim_math
                    mod._lk_math = sim_math
            else:
                _without_loop_peeling()
            _MODULES[source.digest] = mod
    return CompiledKernel(source, mod._lk_kernel, path)


_peeling_off = False


def _without_loop_peeling() -> None:
    """Turn off LLVM's loop peeling for the CPU backend's compiles (once per process).

    The LLVM in llvmlite 0.50 aborts the process (an assertion in LoopPeel.cpp: "when peeling
    the last iteration, ... can only peel a single iteration") on some loops that mix a wrapped
    index (``i - 6 if i >= 6 else i - 6 + n``, a roll) with clamped ones (``min(i + 14, n -
    1)``), as steps and lowered jnp bodies do (tests/test_cpu_loop_peeling.py); where LLVM is
    built without assertions, the same peel runs unchecked. The option is LLVM's, so it holds
    for every later Numba CPU compile of the process; CUDA kernels go through NVVM and keep
    theirs. Peeling only moves a loop's first or last iterations out of it."""
    global _peeling_off
    if not _peeling_off:
        import llvmlite.binding as llvm
        llvm.set_option("loopkern", "-unroll-peel-max-count=0")
        _peeling_off = True


#: the most trips of a constant-count loop that LLVM fully unrolls in a CPU kernel (see
#: :func:`_cpu_unroll_capped`)
CPU_FULL_UNROLL_MAX = 8
# LLVM's options while loopkern compiles a CPU kernel, and the values that give LLVM's defaults
# back afterwards (no cap on full unrolling; partial unrolling, which the X86 target enables)
_CPU_UNROLL_OPTIONS = (f"-unroll-full-max-count={CPU_FULL_UNROLL_MAX}", "-unroll-allow-partial=false")
_CPU_UNROLL_DEFAULTS = (f"-unroll-full-max-count={2 ** 32 - 1}", "-unroll-allow-partial=true")


@contextmanager
def _cpu_unroll_capped():
    """Around the compile of a CPU kernel: LLVM unrolls no loop of constant count fully beyond
    CPU_FULL_UNROLL_MAX trips, nor partially, and gets its defaults back afterwards.

    With llvmlite 0.50's LLVM (22.1), a loop of 18 to 23 constant trips inside a parallel loop
    (a lowered ``jnp.max(x, axis=1)`` over 18 columns: a running maximum with NaN tests) is
    unrolled whole (fully in the step's own compile; partially, by its trip count, once the
    step is inlined into the kernel's loop over steps), and the loop vectorizer then spends time
    exponential in the trip count on the enclosing loop: minutes, or no end, to compile
    (tests/test_cpu_compile_time.py). 24 trips and more are not unrolled and compile in a
    second, as does every count with the vectorizer off. Capping the unrolling keeps the
    vectorizer for the loops it speeds up (the 1-D heat step runs 3.7x slower on the CPU
    without it); a vectorized loop is still interleaved by the vectorizer. The options are
    process-wide in LLVM, so they are set under Numba's compiler lock, which every Numba compile
    of the process takes, and put back afterwards for other code's compiles: no cap, partial
    unrolling on (LLVM's defaults on x86, whose target turns it on; forced on elsewhere)."""
    import llvmlite.binding as llvm
    from numba.core.compiler_lock import global_compiler_lock
    with global_compiler_lock:
        for option in _CPU_UNROLL_OPTIONS:
            llvm.set_option("loopkern", option)
        try:
            yield
        finally:
            for option in _CPU_UNROLL_DEFAULTS:
                llvm.set_option("loopkern", option)


def _without_link_time_optimisation(dispatcher) -> None:
    """Turn off link-time optimisation for a generated CUDA kernel. Numba turns it on where
    nvJitLink is installed, and then runs NVVM twice for each new kernel (PTX when it builds
    the kernel, LTO-IR again when it binds it: a third of a new body's compile time) although a
    generated kernel links nothing (tests/test_ptx.py: no extern functions). Set on the
    dispatcher because numba-cuda 0.30's ``@cuda.jit(...)`` decorator form does not pass an
    ``lto=`` argument on (its wrapper forwards the other keywords only); the simulator's kernels
    have no such option."""
    options = getattr(dispatcher, "targetoptions", None)
    if isinstance(options, dict) and "lto" in options:
        options["lto"] = False


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:40]


class _translate_errors:
    """Turn a Numba compile error into a CompileError at the user's line."""

    def __init__(self, kernel: CompiledKernel):
        self.kernel = kernel

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not _is_numba_error(exc):
            return False
        raise CompileError(format_compile_error(self.kernel.source, self.kernel.path, str(exc))) from exc


def _is_numba_error(exc) -> bool:
    return any(c.__module__.startswith(("numba", "numba_cuda")) and c.__name__ != "CudaSupportError"
               for c in type(exc).__mro__ if c is not Exception)


_LOC = re.compile(r'File "([^"]+)", line (\d+)')


def format_compile_error(source: KernelSource, path: Path, message: str) -> str:
    """A ``file:line:col: in step 'name': ...`` message for a Numba error in generated code."""
    where = None
    for m in _LOC.finditer(message):
        if os.path.basename(m.group(1)) == path.name:
            hit = source.line_map.get(int(m.group(2)))
            if hit is not None:
                where = hit
                break
    text = _strip_ansi(message).strip()
    useful = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("Failed in ")]
    first = useful[0] if useful else "compile error"
    detail = "\n".join("    | " + ln for ln in text.splitlines()[:25])
    if where is None:
        return (f"{source.line_map and next(iter(source.line_map.values()))[0] or '<generated>'}: "
                f"in step '{source.step_name}': Numba could not compile the generated {source.backend} kernel: "
                f"{first}\n  generated source: {path}\n{detail}")
    filename, line, _ = where
    import linecache
    src = linecache.getline(filename, line).rstrip("\n")
    col = len(src) - len(src.lstrip()) + 1
    return (f"{filename}:{line}:{col}: in step '{source.step_name}': Numba could not compile this line "
            f"for the {source.backend} backend: {first}\n    {src}\n    {' ' * (col - 1)}^\n"
            f"  check the types used on this line (e.g. mixing arrays and numbers, or an unsupported "
            f"operation); Numba said:\n{detail}")


def _strip_ansi(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", s)
