"""Launch plans: what the first call with a signature decided, kept so that later calls only
fill in pointers and numbers and launch.

A :class:`LaunchPlan` is made by :func:`make_plan` after the full checks of a call have
passed. It holds the specialised kernel, the grid, and a free list of :class:`Slot`\\ s: per
run in flight, the scratch buffers, the control block, the debug buffer, device copies of
NumPy arguments and (on a GPU) the kernel's parameter words with everything but the per-call
values already written. Plans are cached per call signature (``signature.call_key`` plus the
call options) by :class:`PlanCache`.

Running a plan:

- CPU, blocking: the kernel runs in the calling thread (``runs.run_inline``).
- CPU, ``start()`` or ``progress=``: the kernel runs on a worker thread (``runs.ThreadWaiter``).
- CUDA: the launch goes through the driver (:meth:`LaunchPlan.launch`) with the slot's parameter
  words; a blocking call then waits for the kernel's done flag in the mapped control block
  (``runs.wait_cuda``), ``start()`` returns a handle on the launch's event.
- Numba's CUDA simulator: the launch goes through Numba's dispatcher on a worker thread.
"""

from __future__ import annotations

import ctypes
import linecache
import math
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import ArgumentError, Diagnostic, LaunchError
from ..runtime.layout import (DBG_FLAG, DBG_INDEX, DBG_NDIM, DBG_SHAPE, DBG_SITE, DBG_SIZE, DBG_STEP, DBG_THREAD, DONE,
                              REQUEST, STEPS, TIMEOUT_NS)
from . import buffers
from .args import ArrayArg, byte_extent, c_strides
from .config import LaunchConfig
from .signature import INT64_MAX, INT64_MIN, _cai_ptr, probe

#: struct codes of the numbers a kernel parameter can be (little-endian, by dtype.str)
_STRUCT_CODES = {"b1": "?", "i1": "b", "u1": "B", "i2": "h", "u2": "H", "i4": "i", "u4": "I", "i8": "q",
                 "u8": "Q", "f2": "e", "f4": "f", "f8": "d"}

#: plans kept per kernel (least recently used dropped first)
PLANS_PER_KERNEL = 64


class LRUCache:
    """Entries by key, the least recently used dropped beyond ``size``. Lookups take no lock
    (a dict read and a move are atomic under the GIL); stores do."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        entry = self._entries.get(key)
        if entry is not None and len(self._entries) > 1:
            try:
                self._entries.move_to_end(key)
            except KeyError:       # dropped by another thread meanwhile
                pass
        return entry

    def put(self, key, entry):
        with self._lock:
            self._entries[key] = entry
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def keys(self):
        return list(self._entries)

    def values(self):
        return list(self._entries.values())

    def clear(self):
        with self._lock:
            self._entries.clear()

    def __len__(self):
        return len(self._entries)


class PlanCache(LRUCache):
    """Plans of one kernel by call signature."""

    def __init__(self, size: int = PLANS_PER_KERNEL):
        super().__init__(size)


@dataclass
class Param:
    """One step parameter as the plan passes it.

    Attributes:
        kind: ``"array"`` (the user's array is passed as it is: NumPy on the CPU, a GPU array on
            CUDA), ``"host"`` (a NumPy array on CUDA: copied to a slot's device buffer and back)
            or ``"scalar"``.
        dtype: the element or value type the kernel sees.
        shape, strides: an array's (strides in bytes, as the kernel sees them).
        word: CUDA: the index of the parameter's first word (an array's data pointer is at
            ``word + 4``).
        ptr: a GPU array's pointer getter.
        extent: a GPU array's [lo, hi) byte range relative to its pointer.
    """

    kind: str
    name: str
    dtype: np.dtype
    shape: tuple = ()
    strides: tuple = ()
    word: int = 0
    ptr: object = None
    extent: tuple = (0, 0)
    writable_host: bool = False


class Slot:
    """The buffers of one run in flight (see the module docstring)."""

    def __init__(self, plan):
        from ..compile import simulator_enabled
        self.block, self.view = buffers.control_block(plan.backend)
        self.dbg = None
        self.dev = {}                   # param index -> device buffer of a NumPy argument
        self.scratch = ()
        self.halo = None
        self.params = None
        self.event = None
        self.cpu_args = None
        if plan.backend == "cpu":
            if plan.debug:
                self.dbg = np.zeros(DBG_SIZE, np.int64)
            return
        from numba import cuda
        self.scratch = buffers.cuda_scratch(plan.config.blocks)
        # a tile-mode kernel of rounds of steps exchanges its edge cells through this
        self.halo = cuda.device_array(plan.config.halo, plan.params[plan.spec.swap[0][0]].dtype) \
            if plan.config.halo else None
        if plan.debug:
            self.dbg = cuda.to_device(np.zeros(DBG_SIZE, np.int64))
        for i, p in enumerate(plan.params):
            if p.kind == "host":
                first = plan.same_as.get(i, i)
                self.dev[i] = self.dev[first] if first in self.dev else cuda.device_array(p.shape, p.dtype)
        if simulator_enabled():
            return
        from . import driver
        self.event = driver.new_event()
        self.params = driver.ParamBlock(plan.nwords)
        # the words a call changes live in one buffer of their own, in plan.call_words order, so
        # that one struct.pack_into writes them all; the launch finds each through its pointer
        self.call_words = (ctypes.c_uint64 * len(plan.call_words))()
        base = ctypes.addressof(self.call_words)
        for k, word in enumerate(plan.call_words):
            self.params.params[word] = base + 8 * k
        self.call_view = np.frombuffer(self.call_words, np.uint64)
        w = self.params.words
        for i, p in enumerate(plan.params):
            if p.kind == "scalar":
                continue
            nd = len(p.shape)
            w[p.word:p.word + 5] = (0, 0, math.prod(p.shape), p.dtype.itemsize, 0)
            w[p.word + 5:p.word + 5 + nd] = p.shape
            w[p.word + 5 + nd:p.word + 5 + 2 * nd] = np.array(p.strides, np.int64).view(np.uint64)
            if p.kind == "host":
                w[p.word + 4] = self.dev[i].device_ctypes_pointer.value or 0
        for word, buf in zip(plan.tail_words, self.tail_arrays()):
            nd = buf.ndim
            w[word:word + 5] = (0, 0, buf.size, buf.dtype.itemsize, buf.device_ctypes_pointer.value or 0)
            w[word + 5:word + 5 + nd] = buf.shape
            w[word + 5 + nd:word + 5 + 2 * nd] = buf.strides

    def tail_arrays(self) -> list:
        """The array parameters after the user's, in kernel order, except the seed (a number)."""
        redf, redi, bar, info = self.scratch
        return [redf, redi, bar, info, self.block] + ([self.dbg] if self.dbg is not None else []) + \
            ([self.halo] if self.halo is not None else [])


class CallWords:
    """The parameter words a CUDA call fills in, in one buffer: the step count, the start, each
    GPU array's data pointer, each number parameter (in the low bytes of its word, as the
    kernel declares it) and the seed."""

    def __init__(self, narrays: int, scalar_dtypes):
        self.dtypes = [np.dtype(d) for d in scalar_dtypes]
        self.nwords = 3 + narrays + len(self.dtypes)
        self._pack = struct.Struct("<qq" + "Q" * narrays + "".join(
            _STRUCT_CODES[d.str[1:]] + "x" * (8 - d.itemsize) for d in self.dtypes) + "Q").pack_into

    def fill(self, buffer, view, nsteps, start, ptrs, scalars, seed):
        """Write the words into ``buffer`` (``view``: the same memory as a uint64 array).

        One ``struct.pack_into`` writes them all. It refuses a float beyond float32's range,
        which NumPy's conversion (the kernel's own rule for arrays) rounds to infinity: such a
        call writes each number through NumPy instead, so both convert alike."""
        try:
            self._pack(buffer, 0, nsteps, start, *ptrs, *scalars, seed)
        except (struct.error, OverflowError):
            view[:2] = np.array([nsteps, start], np.int64).view(np.uint64)
            view[2:2 + len(ptrs)] = ptrs
            for k, (dtype, v) in enumerate(zip(self.dtypes, scalars), start=2 + len(ptrs)):
                view[k] = 0
                view[k:k + 1].view(np.uint8)[:dtype.itemsize].view(dtype)[0] = v
            view[-1] = seed


class LaunchPlan:
    """Everything a call with one signature needs, decided once (see the module docstring).

    Attributes:
        backend: ``"cuda"`` or ``"cpu"``.
        config: the grid (:class:`~loopkern.dispatch.config.LaunchConfig`).
        compiled: the :class:`~loopkern.compile.CompiledKernel`.
        kernel: what runs: the compiled overload's entry point (CPU), Numba's compiled kernel
            (CUDA) or the dispatcher (simulator).
        params: a :class:`Param` per step parameter.
        debug: bounds-checked kernel.
    """

    def __init__(self, *, spec, backend, config, compiled, kernel, params, debug, staged, same_as, simulator):
        self.spec = spec
        self.name = spec.name
        self.backend = backend
        self.config = config
        self.compiled = compiled
        self.kernel = kernel
        self.params = params
        self.debug = debug
        self.staged = staged
        self.same_as = same_as           # param index -> index of the same NumPy object, passed earlier
        self.simulator = simulator
        self.func = 0
        self.nwords = 0
        self.tail_words = ()
        self.seed_word = 0
        self.int_scalars = [i for i, p in enumerate(params) if p.kind == "scalar" and p.dtype.kind in "iu"]
        self.devices = [i for i, p in enumerate(params) if p.kind == "array" and backend == "cuda"]
        self.hosts = [i for i, p in enumerate(params) if p.kind == "host"]
        host = {i for i, p in enumerate(params) if p.kind != "scalar" and (backend == "cpu" or p.kind == "host")}
        # the pairs that must not share memory, each with its error: a swap pair's two arrays,
        # and an array the step writes with any other (a NumPy pair on the GPU path is two
        # copies, unless it is one object: a new signature)
        refused = refused_pairs(spec)
        self.host_refused = [(a, b, msg) for a, b, msg in refused if a in host and b in host]
        self.device_ptrs = [(i, params[i].ptr) for i in self.devices]
        self.device_refused = self._pointer_pairs(refused)
        swapped = {frozenset(pair) for pair in spec.swap}
        self.device_staged = self._pointer_pairs(
            [(i, j, None) for i in staged for j in self.devices if j != i and (j not in staged or i < j)
             and frozenset((i, j)) not in swapped])
        self.scalars = [i for i, p in enumerate(params) if p.kind == "scalar"]
        self.call_words = ()
        if backend == "cuda" and not simulator:
            self._layout_words()
            self.call_words = (0, 1, *(params[i].word + 4 for i in self.devices),
                               *(params[i].word for i in self.scalars), self.seed_word)
            self.packer = CallWords(len(self.devices), [params[i].dtype for i in self.scalars])
            from . import driver
            self.func = driver.kernel_handle(kernel)
            c = config
            self._launch = driver.make_launcher(self.func, c.blocks, c.threads, c.shared, c.scope in ("grid", "tile"),
                                                cluster=c.scope == "cluster")
            self._event_record = driver.driver().event_record
        self.slots = buffers.FreeList(lambda: Slot(self))

    # -- the parameter words (CUDA) ---------------------------------------------------------
    def _layout_words(self):
        w = 2                                       # nsteps, start
        for p in self.params:
            p.word = w
            w += 1 if p.kind == "scalar" else 5 + 2 * len(p.shape)
        tail = []
        for ndim in (2, 2, 1):                      # redf, redi, bar
            tail.append(w)
            w += 5 + 2 * ndim
        self.seed_word = w                          # the seed, a number, comes between bar and info
        w += 1
        # info, host (the control block), then dbg or a tile-mode kernel's halo scratch
        for _ in range(3 if self.debug or self.config.halo else 2):
            tail.append(w)
            w += 7
        self.tail_words = tuple(tail)
        self.nwords = w

    # -- per call ---------------------------------------------------------------------------
    def check_values(self, values):
        """Per-call checks that depend on values, not on the signature: integers that must fit
        int64, and pointers (swap pairs that share memory: ArgumentError).

        Returns the GPU arrays' pointers (in ``self.devices`` order, for :meth:`fill_words`), or
        None if the plan does not apply to these values (a staged array shares memory with
        another argument), so the call must take the full path.
        """
        for i in self.int_scalars:
            v = values[i]
            if type(v) is int and not INT64_MIN <= v <= INT64_MAX:
                raise ArgumentError(f"argument '{self.params[i].name}': integer {v} does not fit in int64")
        for a, b, msg in self.host_refused:
            x, y = values[a], values[b]
            if x is y or np.may_share_memory(x, y):
                raise ArgumentError(msg)
        if not self.devices:
            return ()
        ptrs = [ptr(values[i]) for i, ptr in self.device_ptrs]
        for ka, kb, lo_a, hi_a, lo_b, hi_b, msg in self.device_refused:
            if ptrs[ka] + lo_a < ptrs[kb] + hi_b and ptrs[kb] + lo_b < ptrs[ka] + hi_a:
                raise ArgumentError(msg)
        for ka, kb, lo_a, hi_a, lo_b, hi_b, _ in self.device_staged:
            if ptrs[ka] + lo_a < ptrs[kb] + hi_b and ptrs[kb] + lo_b < ptrs[ka] + hi_a:
                return None
        return ptrs

    def _pointer_pairs(self, pairs) -> list:
        """(position of a and b among the GPU arrays, their extents, what goes with the pair) for
        the pairs ``(a, b, what)`` of GPU arrays."""
        at = {i: k for k, i in enumerate(self.devices)}
        out = []
        for a, b, what in pairs:
            if a in at and b in at:
                pa, pb = self.params[a], self.params[b]
                out.append((at[a], at[b], pa.extent[0], pa.extent[1], pb.extent[0], pb.extent[1], what))
        return out

    def kernel_args(self, values, slot, nsteps, start, seed) -> tuple:
        """The full argument tuple for a launch through Numba (CPU, simulator)."""
        args = [np.int64(nsteps), np.int64(start)]
        for i, p in enumerate(self.params):
            v = values[i]
            if p.kind == "scalar":
                if self.simulator and p.dtype.kind in "iu" and p.dtype.itemsize < 8:
                    # Numba computes with a narrow integer parameter in 64 bits (int8 + int64 is
                    # int64); the simulator's NumPy scalar would keep 8 bits, and the loops' own
                    # lo + tid * step wrapped (an int8 range visited indices past 127)
                    args.append(np.int64(v))
                else:
                    args.append(p.dtype.type(v))
            elif p.kind == "host":
                args.append(slot.dev[i])
            else:
                args.append(v)
        if self.backend == "cpu":
            args += [np.uint64(seed), slot.block]
            if self.debug:
                args.append(slot.dbg)
            return tuple(args)
        redf, redi, bar, info = slot.scratch
        args += [redf, redi, bar, np.uint64(seed), info, slot.block]
        if self.debug:
            args.append(slot.dbg)
        if slot.halo is not None:
            args.append(slot.halo)
        return tuple(args)

    def cpu_args(self, values, slot, seed) -> list:
        """The CPU kernel's arguments, step count and start left to fill (slots 0 and 1).

        The compiled entry point converts Python numbers itself (a float to float32 rounds to
        nearest, as NumPy does), so they are passed as they are."""
        args = slot.cpu_args
        if args is None:
            args = slot.cpu_args = list(self.kernel_args(values, slot, 0, 0, seed))
        args[2:2 + len(values)] = values
        args[2 + len(values)] = seed
        return args

    def fill_words(self, values, ptrs, slot, nsteps, start, seed):
        """Write this call's values into the slot's parameter words (CUDA); ``ptrs`` are the GPU
        arrays' pointers from :meth:`check_values`."""
        self.packer.fill(slot.call_words, slot.call_view, nsteps, start, ptrs, [values[i] for i in self.scalars],
                         seed)

    def launch(self, slot, record=True):
        """Launch on the legacy default stream with the slot's parameter words (CUDA, through the
        driver), and record the slot's event after it if ``record``: a blocking call needs no
        event, since the kernel's done flag is written after all its writes (cuda_rt.finish)."""
        r = self._launch(slot.params.params)
        if r == 0:
            if not record:
                return
            r = self._event_record(slot.event, None)
            if r == 0:
                return
        from . import driver
        raise LaunchError(f"launching the megakernel failed: {driver.error_name(r)} ({r})"
                          + ("; a cooperative launch needs every block resident at once" if r == 720 else ""))

    def read_dbg(self, slot):
        """The slot's debug buffer as a NumPy array (copied from the GPU on CUDA)."""
        return slot.dbg if self.backend == "cpu" else slot.dbg.copy_to_host()

    def bounds_error(self, slot, steps, start) -> str | None:
        """The BoundsError message of a finished debug run whose kernel recorded an offence,
        else None. The record is read whatever stopped the run: an offence in its last step
        has no later step boundary at which to stop it."""
        dbg = self.read_dbg(slot)
        return self.describe_bounds(dbg, steps, start) if dbg[DBG_FLAG] != 0 else None

    def describe_bounds(self, dbg, steps, start) -> str:
        """The BoundsError message for the offence a debug kernel recorded in ``dbg``."""
        site = self.compiled.source.sites[int(dbg[DBG_SITE])]
        n = int(dbg[DBG_NDIM])
        index = tuple(int(v) for v in dbg[DBG_INDEX:DBG_INDEX + n])
        shape = tuple(int(v) for v in dbg[DBG_SHAPE:DBG_SHAPE + n])
        for p in self.params:
            if p.kind != "scalar" and p.name == site.array:
                shape = tuple(p.shape)
        verb = "load from" if site.kind == "load" else "store to"
        what = "the load read element 0 instead" if site.kind == "load" else "the store was skipped"
        d = Diagnostic(site.filename, site.line, site.col, self.name,
                       f"out-of-bounds {verb} '{site.array}' at step t={int(dbg[DBG_STEP])} by thread "
                       f"{int(dbg[DBG_THREAD])}: index {index} is outside shape {shape}",
                       hint=f"valid indices of a dimension of length n are -n to n - 1. {what.capitalize()}, and "
                            f"debug=True stopped the run at the first step boundary where every thread could "
                            f"stop together (up to two steps after the bad access): this call ran {steps} "
                            f"step(s), t={start} to t={start + steps - 1}, and the arrays hold the state after "
                            f"them",
                       source_line=linecache.getline(site.filename, site.line),
                       where="" if site.function == self.name else f"in helper '{site.function}'")
        return d.format()

    def prepare_slot(self, slot, timeout):
        """Ready a slot's control block (and debug buffer) for a new run."""
        view = slot.view
        view[REQUEST] = 0            # WHY is written before DONE, so it needs no reset
        view[DONE] = 0
        view[STEPS] = -1             # until the kernel has started
        # (a timeout beyond 30 years is no timeout; the slot holds int64 nanoseconds, and 0 means
        # none: a timeout below a nanosecond is one nanosecond, not none)
        view[TIMEOUT_NS] = max(1, int(min(timeout, 1e9) * 1e9)) if timeout is not None and self.backend == "cuda" \
            else 0
        if self.debug:
            if self.backend == "cpu":
                slot.dbg[:] = 0
            else:
                slot.dbg.copy_to_device(np.zeros(DBG_SIZE, np.int64))

    def copy_in(self, values, slot):
        """NumPy arguments into the slot's device buffers (CUDA)."""
        for i in self.hosts:
            if self.same_as.get(i, i) != i:
                continue
            host = np.ascontiguousarray(values[i])
            dev = slot.dev[i]
            if self.simulator:
                dev.copy_to_device(host)
            else:
                from . import driver
                driver.check(driver.driver().memcpy_htod(dev.device_ctypes_pointer.value or 0, host.ctypes.data,
                                                         host.nbytes), "copying a NumPy argument to the GPU")

    def copy_out(self, values, slot):
        """The slot's device buffers back into writable NumPy arguments (CUDA)."""
        for i in self.hosts:
            p = self.params[i]
            if not p.writable_host or self.same_as.get(i, i) != i:
                continue
            host, dev = values[i], slot.dev[i]
            if self.simulator:
                dev.copy_to_host(host) if host.flags.c_contiguous else host.__setitem__(Ellipsis, dev.copy_to_host())
                continue
            from . import driver
            target = host if host.flags.c_contiguous else np.empty(host.shape, host.dtype)
            driver.check(driver.driver().memcpy_dtoh(target.ctypes.data, dev.device_ctypes_pointer.value or 0,
                                                     target.nbytes), "copying a result back from the GPU")
            if target is not host:
                host[...] = target


def written_pairs(spec) -> list:
    """(i, j): each array parameter ``i`` the step writes (swap pairs' arrays included) with
    every other array parameter ``j`` (a swap pair itself left out: it has its own check); the
    two must not share memory."""
    swapped = {i for pair in spec.swap for i in pair}
    written = [i for i, p in enumerate(spec.params) if p.kind == "array" and (p.written or i in swapped)]
    pairs = {frozenset(pair) for pair in spec.swap}
    out = []
    for i in written:
        for j, q in enumerate(spec.params):
            if j != i and q.kind == "array" and frozenset((i, j)) not in pairs and not (j in written and j < i):
                out.append((i, j))
    return out


def refused_pairs(spec) -> list:
    """(i, j, the error): the array parameters that must not share memory, checked on the full
    path (``Dispatcher.classify``) and on cached plans (``LaunchPlan.check_values``): each swap
    pair's two arrays, and each array the step writes with every other (``written_pairs``)."""
    out = []
    for i, j in spec.swap:
        a, b = spec.params[i].name, spec.params[j].name
        out.append((i, j, f"swap pair ('{a}', '{b}'): the two arrays share memory (arrays whose address ranges "
                                f"overlap count as sharing, interleaved views such as x[::2] and x[1::2] too); pass "
                                f"two separate buffers"))
    for i, j in written_pairs(spec):
        a, b = spec.params[i].name, spec.params[j].name
        out.append((i, j, f"argument '{b}' shares memory with argument '{a}', which step '{spec.name}' writes: its "
                          f"threads would race on that memory (and the CPU backend, which runs the iterations in "
                          f"order, would compute something else than a GPU); pass separate arrays, e.g. a copy "
                          f"of '{b}' (arrays whose address ranges overlap count as sharing, interleaved views such "
                          f"as y[::2] and y[1::2] included)"))
    return out


def make_plan(spec, backend, argv, compiled, kernel, config: LaunchConfig, *, debug, staged, simulator) -> LaunchPlan:
    """A plan for calls like the one whose checked arguments are ``argv`` (after the full path
    has classified and checked them, compiled ``kernel`` and chosen ``config``)."""
    params, same_as, ids = [], {}, {}
    for i, a in enumerate(argv):
        if not isinstance(a, ArrayArg):
            params.append(Param("scalar", a.name, np.asarray(a.value).dtype))
            continue
        on_host = a.where == "host"
        if on_host and backend == "cuda":
            first = ids.setdefault(id(a.value), i)
            if first != i:
                same_as[i] = first
            params.append(Param("host", a.name, a.dtype, tuple(a.shape), c_strides(a.shape, a.dtype.itemsize),
                                writable_host=not a.readonly))
            continue
        strides = tuple(a.strides) if a.strides else c_strides(a.shape, a.dtype.itemsize)
        ptr = (probe(type(a.value))[1] or _cai_ptr) if not on_host else None
        params.append(Param("array", a.name, a.dtype, tuple(a.shape), strides, ptr=ptr,
                            extent=byte_extent(a.shape, strides, a.dtype.itemsize)))
    return LaunchPlan(spec=spec, backend=backend, config=config, compiled=compiled, kernel=kernel, params=params,
                      debug=debug, staged=staged, same_as=same_as, simulator=simulator)


def now() -> float:
    return time.monotonic()
