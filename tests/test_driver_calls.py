"""The driver-level pieces of a blocking CUDA call, without a GPU: the launch through
cuLaunchKernelEx (the struct layouts of cuda.h and what the driver is handed), and the wait on
the done flag (a fault, a kernel that ends without its flag). A fake driver stands in for libcuda."""

import ctypes

import numpy as np
import pytest

from loopkern.dispatch import driver as D
from loopkern.errors import LaunchError
from loopkern.runtime.layout import DONE, HOST_SIZE, STEPS


def test_launch_structs_match_cuda_h():
    # CUlaunchConfig: seven unsigned ints, then (8-byte aligned) the stream, the attribute
    # pointer and their count; CUlaunchAttribute: an int id padded to 8 bytes, a 64-byte union
    cfg = D._LaunchConfig
    assert [getattr(cfg, f).offset for f in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
                                             "shared")] == [0, 4, 8, 12, 16, 20, 24]
    assert (cfg.stream.offset, cfg.attrs.offset, cfg.nattrs.offset, ctypes.sizeof(cfg)) == (32, 40, 48, 56)
    attr = D._LaunchAttribute
    assert (attr.id.offset, attr.value.offset, ctypes.sizeof(attr)) == (0, 8, 72)
    assert D.CU_LAUNCH_ATTRIBUTE_COOPERATIVE == 2


class _FakeLaunchDriver:
    """A launch_ex that records what it was handed (read back through the struct pointers)."""

    def __init__(self, result=0):
        self.calls = []
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

        def launch_ex(cfg_ptr, func, params, extra):
            c = ctypes.cast(cfg_ptr, ctypes.POINTER(D._LaunchConfig)).contents
            attrs = []
            if c.nattrs:
                a = ctypes.cast(c.attrs, ctypes.POINTER(D._LaunchAttribute))
                attrs = [(a[k].id, a[k].value) for k in range(c.nattrs)]
            self.calls.append(dict(grid=(c.grid_x, c.grid_y, c.grid_z), block=(c.block_x, c.block_y, c.block_z),
                                   shared=c.shared, stream=c.stream, attrs=attrs, func=func, params=params,
                                   extra=extra))
            return result
        self.launch_ex = proto(launch_ex)


@pytest.fixture
def fake_driver(monkeypatch):
    fake = _FakeLaunchDriver()
    monkeypatch.setattr(D, "_lib", [fake])
    return fake


@pytest.mark.parametrize("cooperative", [True, False])
def test_a_launch_hands_the_driver_the_plans_grid(fake_driver, cooperative):
    launch = D.make_launcher(0xBEEF00, blocks=132, threads=256, shared=40960, cooperative=cooperative)
    params = D.ParamBlock(9)
    for _ in range(2):                           # the prepared struct is reused, unchanged
        assert launch(params.params) == 0
    for call in fake_driver.calls:
        assert call["grid"] == (132, 1, 1) and call["block"] == (256, 1, 1) and call["shared"] == 40960
        assert call["stream"] is None and call["extra"] is None     # the legacy default stream
        assert call["func"] == 0xBEEF00
        assert call["params"] == ctypes.addressof(params.params)
        assert call["attrs"] == ([(D.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, 1)] if cooperative else [])


class _FakeWaitDriver:
    def __init__(self, stream_result):
        self.stream_result = stream_result
        self.queries = 0

    def stream_query(self, stream):
        self.queries += 1
        return self.stream_result

    def event_query(self, event):
        return self.stream_result

    def event_synchronize(self, event):
        return 0


@pytest.fixture
def wait_with(monkeypatch):
    from loopkern import runs

    def install(result):
        fake = _FakeWaitDriver(result)
        monkeypatch.setattr(runs, "_DRIVER", [fake])
        monkeypatch.setattr(D, "error_name", lambda code: f"CUDA_ERROR_{code}")
        monkeypatch.setattr(runs.EventWaiter, "QUERY_EVERY_S", 0.01)
        return fake
    return install


def test_a_done_flag_returns_without_asking_the_driver(wait_with):
    from loopkern.runs import wait_cuda
    fake = wait_with(600)
    host = np.zeros(HOST_SIZE, np.int64)
    host[DONE] = 1
    wait_cuda(host, None, "step", watchdog=None)
    assert fake.queries == 0


def test_a_kernel_that_faulted_raises_launch_error(wait_with):
    from loopkern.runs import wait_cuda
    fake = wait_with(700)                        # CUDA_ERROR_ILLEGAL_ADDRESS: sticky
    host = np.zeros(HOST_SIZE, np.int64)
    host[STEPS] = 3
    with pytest.raises(LaunchError, match=r"step: the kernel failed while running: CUDA_ERROR_700 \(700\)"):
        wait_cuda(host, None, "step", watchdog=None)
    assert fake.queries >= 1


def test_a_kernel_that_ended_without_its_flag_raises_launch_error(wait_with):
    from loopkern.runs import wait_cuda
    wait_with(0)                                 # the stream is idle, the flag never came
    host = np.zeros(HOST_SIZE, np.int64)
    with pytest.raises(LaunchError, match="ended without marking the run done"):
        wait_cuda(host, None, "step", watchdog=None)


class _FakeClock:
    """time.monotonic and time.sleep on a clock that moves 1 µs per look and by each sleep; the
    kernel's done flag goes up when the clock passes ``finish``."""

    def __init__(self, host, finish):
        self.host, self.finish, self.now, self.sleeps = host, finish, 0.0, []

    def _advance(self, dt):
        self.now += dt
        if self.now >= self.finish:
            self.host[DONE] = 1

    def monotonic(self):
        self._advance(1e-6)
        return self.now

    def sleep(self, pause):
        self.sleeps.append((self.now, pause))
        self._advance(pause)


@pytest.mark.parametrize("spans", [0.3, 1.45, 5.5, 125])
def test_a_blocking_wait_returns_soon_after_the_kernel_ends(wait_with, monkeypatch, spans):
    # the wait spins for SPIN_S, then sleeps at most SLEEP_FRACTION of the time waited between
    # looks, so a run ending at any time is seen at most that fraction late (a geometric
    # back-off alone saw a 3 ms run's flag ~0.1-0.2 ms after it went up)
    from loopkern import runs
    wait_with(600)                               # CUDA_ERROR_NOT_READY: still running
    host = np.zeros(HOST_SIZE, np.int64)
    finish = spans * runs.SPIN_S
    clock = _FakeClock(host, finish)
    monkeypatch.setattr(runs.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(runs.time, "sleep", clock.sleep)
    runs.wait_cuda(host, None, "step", watchdog=None)
    assert bool(clock.sleeps) == (spans > 1), "slept while spinning, or never slept after"
    late = 0.02                                  # runs.SLEEP_FRACTION's promise, spelled out
    assert all(pause <= late * now + 1e-9 for now, pause in clock.sleeps)
    assert finish <= clock.now <= finish * (1 + late) + 1e-5


class _FakeAttributeDriver:
    """cuKernelSetAttribute / cuFuncSetAttribute stand-ins returning the given codes."""

    def __init__(self, kernel_code, func_code, has_kernel_call=True):
        self.calls = []
        self.func_code = func_code
        if has_kernel_call:
            def kernel_set_attribute(attr, value, func, device):
                self.calls.append(("kernel", attr, value, func, device))
                return kernel_code
            self.kernel_set_attribute = kernel_set_attribute
        else:
            self.kernel_set_attribute = None

    def func_set_attribute(self, func, attr, value):
        self.calls.append(("func", attr, value, func))
        return self.func_code


@pytest.mark.parametrize("kernel_code,func_code,has_kernel_call,expect_calls,raises", [
    (0, 0, True, ["kernel"], False),                 # a CUkernel (Numba's handles)
    (400, 0, True, ["kernel", "func"], False),       # not a CUkernel: a CUfunction
    (400, 400, True, ["kernel", "func"], True),      # neither
    (1, 0, True, ["kernel"], True),                  # a real error is not retried
    (0, 0, False, ["func"], False),                  # a driver older than CUDA 12
])
def test_the_shared_memory_opt_in_sets_the_attribute_on_the_right_handle(
        monkeypatch, kernel_code, func_code, has_kernel_call, expect_calls, raises):
    fake = _FakeAttributeDriver(kernel_code, func_code, has_kernel_call)
    monkeypatch.setattr(D, "_lib", [fake])
    monkeypatch.setattr(D, "error_name", lambda code: f"CUDA_ERROR_{code}")
    if raises:
        with pytest.raises(LaunchError, match="MAX_DYNAMIC_SHARED_SIZE_BYTES, 100000"):
            D.allow_dynamic_shared(0xF00, 100000, 3)
    else:
        D.allow_dynamic_shared(0xF00, 100000, 3)
    assert [c[0] for c in fake.calls] == expect_calls
    for c in fake.calls:
        assert c[1] == D.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES and c[2] == 100000 and c[3] == 0xF00
        if c[0] == "kernel":
            assert c[4] == 3


_NUMBER_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float32",
                  "float64"]


def _random_number(rng, dtype):
    d = np.dtype(dtype)
    if d.kind == "b":
        return bool(rng.integers(0, 2))
    if d.kind in "iu":
        info = np.iinfo(d)
        return d.type(rng.integers(info.min, info.max, endpoint=True, dtype=d))
    return float(rng.normal() * 10.0 ** rng.integers(-30, 30))


def test_call_words_hold_each_value_as_the_kernel_declares_it(rng):
    from loopkern.dispatch.plan import CallWords
    for _ in range(200):
        dtypes = list(rng.choice(_NUMBER_DTYPES, size=int(rng.integers(0, 5))))
        narrays = int(rng.integers(0, 4))
        cw = CallWords(narrays, dtypes)
        buf = (ctypes.c_uint64 * cw.nwords)(*([0xDEADBEEF] * cw.nwords))     # stale words from a last call
        view = np.frombuffer(buf, np.uint64)
        nsteps, start = int(rng.integers(0, 2 ** 40)), int(rng.integers(0, 2 ** 62))
        ptrs = [int(p) for p in rng.integers(0, 2 ** 48, narrays)]
        values = [_random_number(rng, d) for d in dtypes]
        seed = int(rng.integers(0, 2 ** 63)) * 2 + 1
        cw.fill(buf, view, nsteps, start, ptrs, values, seed)
        assert view.view(np.int64)[:2].tolist() == [nsteps, start]
        assert view[2:2 + narrays].tolist() == ptrs
        for k, (d, v) in enumerate(zip(dtypes, values), start=2 + narrays):
            d = np.dtype(d)
            word = view[k:k + 1].view(np.uint8)
            assert word[d.itemsize:].tolist() == [0] * (8 - d.itemsize), "a stale byte above the value"
            got = word[:d.itemsize].view(d)[0]
            assert got == d.type(v), (d, v, got)          # the same rounding as NumPy's
        assert int(view[-1]) == seed


def test_call_words_convert_a_float_beyond_float32_as_numpy_does():
    from loopkern.dispatch.plan import CallWords
    cw = CallWords(1, ["float32", "float64", "float32"])
    buf = (ctypes.c_uint64 * cw.nwords)()
    view = np.frombuffer(buf, np.uint64)
    cw.fill(buf, view, 5, 7, [1234], [1e39, 1e300, -3.4e38 * 10], 99)
    assert view.view(np.int64)[:3].tolist() == [5, 7, 1234]
    f32 = view[3:4].view(np.float32)
    assert np.isposinf(f32[0]) and f32[1] == 0
    assert view[4:5].view(np.float64)[0] == 1e300
    assert np.isneginf(view[5:6].view(np.float32)[0])
    assert int(view[6]) == 99
