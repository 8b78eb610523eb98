"""The GPU test gating of tests/conftest.py: skip only without a GPU, fail when a GPU is there
but unusable, and LOOPKERN_REQUIRE_GPU=1 turns every GPU skip into a failure. The detection
functions are replaced by fakes; the last tests run a whole pytest session in a subprocess."""

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import conftest as C


def _fail_if_called(*args, **kwargs):
    raise AssertionError("detection must not run when the GPU tests are not selected")


def test_unselected_gpu_tests_skip_without_probing_the_machine(monkeypatch):
    monkeypatch.setattr(C, "gpu_present", _fail_if_called)
    monkeypatch.setattr(C, "gpu_usable", _fail_if_called)
    verdict, reason = C.gpu_verdict(selected=False)
    assert verdict == "skip" and "pytest -m gpu" in reason


def test_no_gpu_on_the_machine_skips(monkeypatch):
    monkeypatch.setattr(C, "gpu_present", lambda: None)
    monkeypatch.setattr(C, "gpu_usable", _fail_if_called)
    verdict, reason = C.gpu_verdict(selected=True)
    assert verdict == "skip" and "no NVIDIA GPU on this machine" in reason


def test_a_present_but_unusable_gpu_fails_with_the_reason(monkeypatch):
    monkeypatch.setattr(C, "gpu_present", lambda: "device node /dev/nvidia3")
    monkeypatch.setattr(C, "gpu_usable", lambda: (False, "CUDA_ERROR_NO_DEVICE: driver 999"))
    verdict, reason = C.gpu_verdict(selected=True)
    assert verdict == "fail"
    assert "/dev/nvidia3" in reason and "CUDA_ERROR_NO_DEVICE: driver 999" in reason


def test_a_usable_gpu_runs(monkeypatch):
    monkeypatch.setattr(C, "gpu_present", lambda: "device node /dev/nvidia0")
    monkeypatch.setattr(C, "gpu_usable", lambda: (True, ""))
    assert C.gpu_verdict(selected=True) == ("run", "")


@pytest.mark.parametrize("value,required", [("", False), ("0", False), ("false", False), ("1", True),
                                            ("yes", True)])
def test_require_gpu_reads_the_environment(value, required, monkeypatch):
    monkeypatch.setenv(C.REQUIRE_GPU_ENV, value)
    assert C.require_gpu() is required


class _FakeRun:
    def __init__(self, rc, out):
        self.returncode, self.stdout = rc, out


@pytest.mark.parametrize("nodes,smi,libcuda,expect", [
    ([], None, 0, None),
    (["/dev/nvidiactl", "/dev/nvidia-uvm"], None, 0, None),            # driver nodes, no GPU node
    (["/dev/nvidiactl", "/dev/nvidia2"], None, 0, "device node /dev/nvidia2"),
    ([], (0, "GPU 0: NVIDIA H200 (UUID: GPU-1)\n"), 0, "nvidia-smi -L: GPU 0: NVIDIA H200"),
    ([], (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"), 0, None),
    ([], (9, "failed"), 2, "libcuda reports 2 device(s)"),
])
def test_gpu_present_looks_at_device_nodes_nvidia_smi_and_libcuda(nodes, smi, libcuda, expect, monkeypatch):
    monkeypatch.setattr(C.glob, "glob", lambda pattern: list(nodes))
    monkeypatch.setattr(C.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if smi else None)
    monkeypatch.setattr(C.subprocess, "run", lambda *a, **k: _FakeRun(*smi))
    monkeypatch.setattr(C, "_libcuda_device_count", lambda: libcuda)
    got = C.gpu_present()
    if expect is None:
        assert got is None
    else:
        assert got is not None and got.startswith(expect)


def test_gpu_usable_reports_the_simulator(monkeypatch):
    import numba
    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", 1)
    ok, why = C.gpu_usable()
    assert not ok and "NUMBA_ENABLE_CUDASIM=1" in why


def test_gpu_usable_reports_an_import_failure(monkeypatch):
    import numba
    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", 0)
    monkeypatch.delattr(numba, "cuda", raising=False)
    monkeypatch.setitem(sys.modules, "numba.cuda", None)       # import numba.cuda -> ImportError
    ok, why = C.gpu_usable()
    assert not ok and re.match(r"numba-cuda does not import: (ModuleNotFound|Import)Error", why)


def test_gpu_usable_reports_a_driver_failure(monkeypatch):
    import numba

    def list_devices():
        raise RuntimeError("Error at driver init: CUDA_ERROR_UNKNOWN (999)")

    fake = types.SimpleNamespace(is_available=lambda: False, list_devices=list_devices)
    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", 0)
    monkeypatch.delattr(numba, "cuda", raising=False)
    monkeypatch.setitem(sys.modules, "numba.cuda", fake)
    ok, why = C.gpu_usable()
    assert not ok and "CUDA_ERROR_UNKNOWN (999)" in why and "cannot be used from numba" in why


# ------------------------------------------------------------------------------ whole sessions
INNER_TESTS = '''
import pytest

@pytest.mark.gpu
def test_on_gpu():
    assert 1 + 1 == 2

@pytest.mark.gpu
def test_needs_an_optional_library():
    pytest.skip("cupy is not installed")

def test_on_cpu():
    assert 2 * 2 == 4
'''

FAKES = '''
_FAKE = os.environ["FAKE_GPU"]

def gpu_present():
    return None if _FAKE == "absent" else "device node /dev/nvidia0 (fake)"

def gpu_usable():
    return _FAKE == "ok", "fake driver failure"
'''


SESSIONS = {  # name: (fake GPU, LOOPKERN_REQUIRE_GPU, pytest arguments)
    "absent": ("absent", "0", ("-m", "gpu")), "absent-required": ("absent", "1", ("-m", "gpu")),
    "broken": ("broken", "0", ("-m", "gpu")),
    "ok": ("ok", "0", ("-m", "gpu")), "ok-required": ("ok", "1", ("-m", "gpu")),
    "plain": ("ok", "0", ()), "plain-required": ("ok", "1", ()),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """Every session of SESSIONS, run at once: name -> (exit status, outcome counts, output)."""
    procs = {}
    for name, (fake, require, args) in SESSIONS.items():
        d = tmp_path_factory.mktemp(name)
        (d / "pytest.ini").write_text("[pytest]\n")
        (d / "conftest.py").write_text(Path(C.__file__).read_text() + FAKES)
        (d / "test_inner.py").write_text(INNER_TESTS)
        env = dict(os.environ, FAKE_GPU=fake, LOOPKERN_REQUIRE_GPU=require, NUMBA_ENABLE_CUDASIM="1")
        env.pop("PYTEST_ADDOPTS", None)
        procs[name] = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args,
                                        str(d)], cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    out = {}
    for name, p in procs.items():
        text = p.communicate(timeout=300)[0]
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                                     text.splitlines()[-1])}
        counts["error"] = counts.pop("errors", 0) + counts.pop("error", 0)
        out[name] = (p.returncode, counts, text)
    return out


def test_session_without_a_gpu_skips_and_require_gpu_fails(sessions):
    rc, counts, out = sessions["absent"]
    assert rc == 0 and counts.get("skipped") == 2 and "no NVIDIA GPU on this machine" in out
    rc, counts, out = sessions["absent-required"]
    assert rc == 1 and counts.get("skipped", 0) == 0 and counts.get("passed", 0) == 0
    assert counts["error"] + counts.get("failed", 0) == 2
    assert "LOOPKERN_REQUIRE_GPU=1 and this GPU test was skipped: no NVIDIA GPU" in out


def test_session_with_an_unusable_gpu_fails_even_without_require_gpu(sessions):
    rc, counts, out = sessions["broken"]
    assert rc == 1 and counts.get("skipped", 0) == 0 and counts.get("passed", 0) == 0
    assert counts["error"] == 2
    assert "a GPU is present (device node /dev/nvidia0 (fake)) but the GPU tests cannot use it: " \
           "fake driver failure" in out


def test_session_with_a_usable_gpu_runs_and_require_gpu_fails_a_skip_inside_a_test(sessions):
    rc, counts, out = sessions["ok"]
    assert rc == 0 and counts.get("passed") == 1 and counts.get("skipped") == 1
    rc, counts, out = sessions["ok-required"]
    assert rc == 1 and counts.get("passed") == 1 and counts.get("failed") == 1
    assert "LOOPKERN_REQUIRE_GPU=1 and this GPU test was skipped: cupy is not installed" in out


def test_plain_session_skips_gpu_tests_unless_required(sessions):
    rc, counts, out = sessions["plain"]
    assert rc == 0 and counts.get("passed") == 1 and counts.get("skipped") == 2
    assert "GPU tests run only with pytest -m gpu" in out
    rc, counts, out = sessions["plain-required"]
    assert rc == 1 and counts.get("passed") == 1 and counts["error"] + counts.get("failed", 0) == 2
