"""Test configuration.

``pytest`` (the CI command) runs the CPU tests and the CUDA code path under Numba's CUDA
simulator: NUMBA_ENABLE_CUDASIM=1 is set here, before anything imports numba, unless the run
selects GPU tests (``pytest -m gpu``) or the variable is already set. GPU tests skip cleanly
unless a real GPU is usable; simulator tests skip unless the simulator is on.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    markexpr = config.getoption("markexpr", "") or ""
    if "gpu" in markexpr and "not gpu" not in markexpr:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
    else:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def _simulator() -> bool:
    from numba import config
    return bool(config.ENABLE_CUDASIM)


def _real_gpu() -> bool:
    if _simulator():
        return False
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    gpu_ok = _real_gpu()
    sim_ok = _simulator()
    for item in items:
        if "gpu" in item.keywords and not gpu_ok:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (and NUMBA_ENABLE_CUDASIM unset): "
                                                    "run pytest -m gpu on a GPU machine"))
        if "sim" in item.keywords and not sim_ok:
            item.add_marker(pytest.mark.skip(reason="needs Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"))


@pytest.fixture
def rng(request):
    # a fresh, reproducible generator per test, different between tests
    import zlib
    return __import__("numpy").random.default_rng(zlib.crc32(request.node.nodeid.encode()))
