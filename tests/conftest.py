"""Test configuration.

``pytest`` (the CI command) runs the CPU tests and the CUDA code path under Numba's CUDA
simulator: NUMBA_ENABLE_CUDASIM=1 is set here, before anything imports numba, unless the run
selects GPU tests (``pytest -m gpu``) or the variable is already set. Simulator tests (marked
``sim``) skip unless the simulator is on.

GPU tests (marked ``gpu``) are gated so that a broken GPU setup cannot pass as "skipped":

- In a run that does not select them (plain ``pytest``), they are skipped: that run uses the
  simulator. Run them with ``pytest -m gpu``.
- With ``pytest -m gpu`` they are skipped only when this machine has no NVIDIA GPU at all:
  no ``/dev/nvidia<N>`` device node, no GPU listed by ``nvidia-smi -L``, and no device found
  through the driver library (libcuda) -- see ``gpu_present``.
- If a GPU is present but the tests cannot use it (numba-cuda does not import, the driver
  fails to initialise, NUMBA_ENABLE_CUDASIM=1 is set, ...), every GPU test FAILS (reported as
  an error at setup) with the reason -- see ``gpu_usable``.
- ``LOOPKERN_REQUIRE_GPU=1`` turns every skip of a GPU test into a failure, whatever its cause
  (no GPU found, a plain ``pytest`` run, an optional library such as CuPy or PyTorch missing,
  JAX without a GPU backend): set it on machines that are meant to run the GPU tests, so that
  nothing is silently left out.
"""

import glob
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# JAX's CPU backend as 4 devices, so that the CPU tests can run kernel.jax and sharded runs
# under jax.shard_map on a mesh of several devices. XLA reads the flag when the backend is
# first created: this runs before any test module imports jax. A count set already is kept.
_HOST_DEVICES = "--xla_force_host_platform_device_count"
if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_HOST_DEVICES}=4".strip()

REQUIRE_GPU_ENV = "LOOPKERN_REQUIRE_GPU"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with: pytest -m gpu)")
    config.addinivalue_line("markers", "sim: runs the CUDA code path under Numba's CUDA simulator")
    config.addinivalue_line("markers", "multi_gpu: needs two or more GPUs (also marked gpu); on a machine with one "
                                       "GPU run pytest -m 'gpu and not multi_gpu'")
    if gpu_selected(config):
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
    else:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def gpu_selected(config) -> bool:
    """Does the run select the GPU tests (``-m gpu``, ``-m "gpu and not slow"``, ...)?"""
    markexpr = config.getoption("markexpr", "") or ""
    return "gpu" in markexpr and "not gpu" not in markexpr


def require_gpu() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "").strip().lower() not in ("", "0", "false", "no")


# ------------------------------------------------------------------------------ GPU detection
def gpu_present() -> str | None:
    """Evidence that this machine has an NVIDIA GPU, found without numba; None if there is none."""
    nodes = sorted(p for p in glob.glob("/dev/nvidia*") if p[len("/dev/nvidia"):].isdigit())
    if nodes:
        return f"device node {nodes[0]}"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and "GPU" in out.stdout:
                return f"nvidia-smi -L: {out.stdout.strip().splitlines()[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
    count = _libcuda_device_count()
    if count:
        return f"libcuda reports {count} device(s)"
    return None


def _libcuda_device_count() -> int:
    """Devices seen by the CUDA driver library, or 0 if it does not load or finds none."""
    import ctypes
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            n = ctypes.c_int(0)
            if lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0:
                return n.value
        except (AttributeError, OSError):
            pass
        return 0
    return 0


def gpu_usable() -> tuple[bool, str]:
    """Can numba-cuda run kernels on a real GPU in this process? (ok, reason if not)."""
    try:
        from numba import config
        if config.ENABLE_CUDASIM:
            return False, ("NUMBA_ENABLE_CUDASIM=1 is set, so Numba runs its simulator instead of the GPU: "
                           "unset it (or set it to 0) for pytest -m gpu")
        from numba import cuda
    except Exception as exc:          # numba or numba-cuda missing or broken
        return False, f"numba-cuda does not import: {type(exc).__name__}: {exc}"
    try:
        if cuda.is_available():            # initialises the driver and finds a device
            return True, ""
        cuda.list_devices()                # raises with the driver's reason
        return False, "numba.cuda.is_available() is False"
    except Exception as exc:
        return False, f"the CUDA driver cannot be used from numba: {type(exc).__name__}: {exc}"


def gpu_verdict(selected: bool) -> tuple[str, str]:
    """What happens to the GPU tests of this run: ("run" | "skip" | "fail", reason)."""
    if not selected:
        return "skip", "GPU tests run only with pytest -m gpu (this run uses Numba's CUDA simulator)"
    present = gpu_present()
    if not present:
        return "skip", ("no NVIDIA GPU on this machine (no /dev/nvidia<N>, nvidia-smi -L lists none, libcuda "
                        "finds no device)")
    ok, why = gpu_usable()
    if not ok:
        return "fail", f"a GPU is present ({present}) but the GPU tests cannot use it: {why}"
    return "run", ""


def _simulator() -> bool:
    from numba import config
    return bool(config.ENABLE_CUDASIM)


_GPU_FAIL = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items:
        verdict, reason = gpu_verdict(gpu_selected(config))
        for item in gpu_items:
            if verdict == "skip":
                item.add_marker(pytest.mark.skip(reason=reason))
            elif verdict == "fail":
                item.stash[_GPU_FAIL] = reason
    sim_items = [item for item in items if "sim" in item.keywords and "gpu" not in item.keywords]
    if sim_items and not _simulator():
        for item in sim_items:
            item.add_marker(pytest.mark.skip(reason="needs Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    reason = item.stash.get(_GPU_FAIL, None)
    if reason:
        pytest.fail(reason, pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and "gpu" in item.keywords and require_gpu() and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
        rep.outcome = "failed"
        rep.longrepr = f"{REQUIRE_GPU_ENV}=1 and this GPU test was skipped: {reason}"


@pytest.fixture
def rng(request):
    # a fresh, reproducible generator per test, different between tests
    import zlib
    return __import__("numpy").random.default_rng(zlib.crc32(request.node.nodeid.encode()))
