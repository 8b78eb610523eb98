"""A megakernel run in flight: waiting, progress, cancellation, timeouts and the watchdog.

The kernel and the host talk through the run's control block (``host``, int64; slots and
stop codes in ``runtime/layout.py``): the kernel publishes its step count and, when it ends,
why it stopped; the host writes a request (cancel, a timeout on the CPU backend, a pause) that
the kernel reads at a step boundary.

- :class:`RunHandle` is what ``kernel.start(...)`` returns (and what a call with
  ``progress=`` waits on): the kernel runs while Python goes on.
- :func:`wait_cuda` is a blocking call's wait on a GPU: it watches the done flag the kernel
  writes into mapped host memory, spinning briefly and then sleeping a little longer each time.
- :func:`run_inline` is a blocking call on the CPU backend: the kernel runs in the calling
  thread. One process-wide :class:`Ticker` thread, idle when no run needs it, writes the
  timeout and watchdog requests, and asks a long run to pause every ``PAUSE_EVERY_S`` so that
  the calling thread can see Ctrl-C; a paused run continues where it stopped (``start=``
  semantics: the result is the same bit for bit).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from dataclasses import dataclass

from .errors import BoundsError, HangError, LaunchError
from .runtime.layout import (CANCEL, DONE, PAUSE, REQUEST, STEPS, STOPPED, TIMEOUT, WHY)
#: when the watchdog fires it cancels the run and gives the kernel this long to reach a step
#: boundary before reporting it as stuck
WATCHDOG_GRACE_S = 5.0


@dataclass(frozen=True)
class Run:
    """What one run of a megakernel did.

    Attributes:
        steps: steps executed.
        stopped: why it stopped: ``"steps"`` (ran the full count), ``"condition"`` (the step
            returned false), ``"cancelled"`` (:meth:`RunHandle.cancel` or Ctrl-C) or
            ``"timeout"`` (``timeout=`` passed). In every case the arrays hold the state after
            exactly ``steps`` steps, with the newest state in the first array of each swap pair.
        backend: ``"cuda"`` or ``"cpu"``.
        scope: ``"grid"``, ``"block"``, ``"thread"``, ``"tile"``, ``"cluster"`` or ``"cpu"``.
        blocks: blocks launched (1 on the CPU).
        threads: threads per block (1 on the CPU).
        start: the step index ``t`` of the run's first step (the call's ``start=``).
        steps_per_exchange: (tile scope) steps each block ran on chip between two exchanges of
            its tile's edge cells (and grid barriers); 1 elsewhere.
    """

    steps: int
    stopped: str
    backend: str
    scope: str
    blocks: int
    threads: int
    start: int = 0
    steps_per_exchange: int = 1

    @classmethod
    def _make(cls, steps, stopped, backend, scope, blocks, threads, start, steps_per_exchange=1):
        """A Run without the frozen dataclass's per-field checks (the call path makes many)."""
        run = object.__new__(cls)
        run.__dict__.update(steps=steps, stopped=stopped, backend=backend, scope=scope, blocks=blocks,
                            threads=threads, start=start, steps_per_exchange=steps_per_exchange)
        return run

    @property
    def next_start(self) -> int:
        """The step index after the last step run: pass it as ``start=`` to continue."""
        return self.start + self.steps


class EventWaiter:
    """A launch on a CUDA stream: done when the kernel has marked its control block done, or
    when the event recorded after it has completed (a kernel that faulted never marks it)."""

    QUERY_EVERY_S = 0.05

    def __init__(self, event: int, host):
        self.event = event
        self.host = host
        self.next_query = time.monotonic() + self.QUERY_EVERY_S

    def is_done(self) -> bool:
        if self.host[DONE] == 1:
            return True
        now = time.monotonic()
        if now < self.next_query:
            return False
        self.next_query = now + self.QUERY_EVERY_S
        from .dispatch import driver
        # done, or failed: finish() synchronizes and raises the failure
        return driver.driver().event_query(self.event) != driver.CUDA_ERROR_NOT_READY

    def finish(self):
        from .dispatch import driver
        r = driver.driver().event_synchronize(self.event)
        if r != driver.CUDA_SUCCESS:
            raise LaunchError(f"the kernel failed while running: {driver.error_name(r)} ({r})")


class ThreadWaiter:
    """A run on a worker thread (the CPU backend, and Numba's simulator, launch synchronously)."""

    def __init__(self, target):
        self.error = None

        def work():
            try:
                target()
            except BaseException as exc:   # re-raised by finish() in the waiting thread
                self.error = exc
        self.thread = threading.Thread(target=work, name="loopkern-run", daemon=True)
        self.thread.start()

    def is_done(self) -> bool:
        return not self.thread.is_alive()

    def finish(self):
        self.thread.join()
        if self.error is not None:
            raise self.error


# runs started with kernel.start() that still hold their arrays: until wait() has finished them
# (NumPy inputs are copied back then). Weakly held: a handle dropped without wait() lets go.
_HOLDING: "weakref.WeakSet[RunHandle]" = weakref.WeakSet()
_HOLDING_LOCK = threading.Lock()


def holding_runs() -> list:
    """The runs started with ``kernel.start()`` that hold arrays now (see ``RunHandle.hold``)."""
    if not _HOLDING:
        return []
    with _HOLDING_LOCK:
        return list(_HOLDING)


class RunHandle:
    """A run started by ``kernel.start(...)``.

    The kernel runs while Python goes on. ``wait()`` returns the :class:`Run` (and copies NumPy
    inputs back); ``cancel()`` asks every thread to stop at the next step boundary, all at the
    same step. Host arrays passed as NumPy arrays are only updated when ``wait()`` returns.
    """

    def __init__(self, *, name, host, waiter, backend, plan, reporter=None, deadline=None,
                 on_finish=None, watchdog=None, describe_error=None, start=0, on_error=None):
        self.name = name
        self._host = host                  # a NumPy view of the control block
        self._waiter = waiter
        self._backend = backend
        self._plan = plan
        self._reporter = reporter
        self._deadline = deadline          # host-side deadline (CPU backend), monotonic seconds
        self._on_finish = on_finish        # copy back, release buffers: once, after the kernel
        # (CPU) an exception from inside a step -> the StepError to raise (None: not one)
        self._on_error = on_error
        self._describe_error = describe_error
        self._start = start
        self._watchdog = watchdog
        self._result = None
        self._error = None                 # a BoundsError, raised by every wait() once finished
        self._lock = threading.Lock()
        self._last_steps = -1
        self._last_change = time.monotonic()
        self._tick_lock = threading.Lock()
        self._callback_error = None        # what the progress callback raised (the run was cancelled)
        self.held = ()                     # the array arguments this run holds (hold())
        if reporter is not None:
            self._report(0)

    def hold(self, arrays):
        """Mark ``arrays`` (the run's array arguments, as classified) as this run's until it is
        finished: a call or start that would use their memory meanwhile is refused."""
        self.held = tuple(arrays)
        if self.held:
            with _HOLDING_LOCK:
                _HOLDING.add(self)

    def monitor(self):
        """Keep the progress report and a host-side deadline going without a ``wait()`` call."""
        if self._reporter is None and self._deadline is None:
            return

        def run():
            while not self.done():
                self._tick(False)
                time.sleep(0.02)
        threading.Thread(target=run, name="loopkern-monitor", daemon=True).start()

    def __repr__(self):
        state = "done" if self._result is not None else "running"
        return f"<loopkern.RunHandle {self.name} {state}, {self.steps_done} steps>"

    @property
    def steps_done(self) -> int:
        """Steps done so far (published by the kernel about every millisecond; exact once done)."""
        if self._result is not None:
            return self._result.steps
        return max(0, int(self._host[STEPS]))

    def done(self) -> bool:
        """True once the kernel has finished (``wait()`` then returns at once)."""
        return self._result is not None or self._error is not None or self._waiter.is_done()

    def cancel(self):
        """Ask the kernel to stop at the next step boundary; returns at once.

        Every thread stops after the same step; ``wait()`` then returns a :class:`Run` with
        ``stopped == "cancelled"`` (unless the run ended first) and the exact step count.
        """
        if self._result is None:
            self._host[REQUEST] = CANCEL

    def wait(self, timeout: float | None = None) -> Run:
        """Wait for the kernel to finish; returns its :class:`Run`.

        Ctrl-C while waiting cancels the kernel, waits for it to stop (the arrays are then
        consistent, NumPy inputs copied back) and re-raises ``KeyboardInterrupt``, whose
        ``loopkern_run`` attribute is the cancelled :class:`Run`. A second Ctrl-C stops waiting.

        Args:
            timeout: seconds to wait at most (None: until it finishes). This is not the run's
                own ``timeout=``: the kernel goes on running if this one expires.

        Raises:
            TimeoutError: the kernel was still running after ``timeout`` seconds.
            HangError: the watchdog saw no progress for longer than ``watchdog=`` seconds.
            BoundsError: a ``debug=True`` run indexed an array out of bounds.
        """
        try:
            run = self._wait(timeout)
        except KeyboardInterrupt as exc:
            self.cancel()
            run = self._wait(None, watchdog=False)
            exc.loopkern_run = run
            if hasattr(exc, "add_note"):
                exc.add_note(f"loopkern: {self.name} was cancelled after {run.steps} steps; the arrays hold the "
                             f"state after those steps")
            raise
        failed, self._callback_error = self._callback_error, None
        if failed is not None:
            # the callback's exception, raised once the run it cancelled has stopped (the
            # arrays then hold the state after run.steps steps, NumPy inputs copied back)
            failed.loopkern_run = run
            if hasattr(failed, "add_note"):
                failed.add_note(f"loopkern: the progress callback raised, so {self.name} was cancelled; it stopped "
                                f"after {run.steps} steps and the arrays hold the state after those steps")
            raise failed
        return run

    def _wait(self, timeout, watchdog=True) -> Run:
        start = time.monotonic()
        pause = 0.0
        while True:
            with self._lock:
                if self._result is not None:
                    return self._result
                if self._error is not None:
                    raise self._error
                if self._waiter.is_done():
                    return self._finish()
            now = self._tick(watchdog)
            if timeout is not None and now - start >= timeout:
                raise TimeoutError(f"{self.name}: still running after {timeout} s "
                                   f"({self.steps_done} steps done); wait() again or cancel()")
            # spin briefly (short runs return fast), then sleep a little longer each time, but
            # never more than SLEEP_FRACTION of the time waited (it bounds how late wait() returns)
            if now - start > 1e-3:
                pause = _next_pause(pause, now - start, 1e-4, 2e-3)
                time.sleep(pause if timeout is None else max(0.0, min(pause, timeout - (now - start))))

    def _tick(self, watchdog) -> float:
        """Progress, the host-side deadline and (in a blocking wait) the watchdog."""
        now = time.monotonic()
        steps = int(self._host[STEPS])
        with self._tick_lock:
            if self._reporter is not None:
                self._report(max(steps, 0))
            if self._deadline is not None and now >= self._deadline and self._host[REQUEST] == 0:
                self._host[REQUEST] = TIMEOUT
            changed = steps != self._last_steps
            if changed:
                self._last_steps, self._last_change = steps, now
        # armed once the kernel has started (a launch may queue behind other work)
        if not changed and watchdog and self._watchdog is not None and steps >= 0 \
                and now - self._last_change > self._watchdog:
            self._stalled(steps, now - self._last_change)
        return now

    def _report(self, steps):
        """Report progress; a callback that raises cancels the run (no further reports) and its
        exception is raised by ``wait()`` once the kernel has stopped, so that nothing is left
        running (and writing the arrays) behind the exception."""
        try:
            self._reporter.update(steps)
        except Exception as exc:
            self._reporter = None
            self._callback_error = exc
            self.cancel()

    def _stalled(self, steps, idle):
        """The watchdog fired: cancel, give the kernel a grace period, then report."""
        self.cancel()
        grace = WATCHDOG_GRACE_S
        watchdog, self._watchdog = self._watchdog, None    # it reports once
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if self._waiter.is_done():
                run = self._finish()
                raise HangError(slow_step_message(self.name, idle, watchdog, steps, run), run=run)
            time.sleep(1e-3)
        raise HangError(stuck_message(self.name, idle, watchdog, steps, grace, self._backend), run=None)

    def _finish(self) -> Run:
        try:
            self._waiter.finish()
        except Exception as exc:
            self._close()
            failed = self._on_error(exc) if self._on_error is not None else None
            if failed is not None:
                self._error = failed
                raise failed from exc
            if isinstance(exc, LaunchError) or not type(exc).__module__.startswith("numba"):
                raise
            raise LaunchError(f"{self.name}: the kernel failed while running: {exc}") from exc
        steps, why = int(self._host[STEPS]), int(self._host[WHY])
        # the debug record is read before on_finish gives the run's buffers back
        message = self._describe_error(steps) if self._describe_error is not None else None
        try:
            if self._on_finish is not None:
                self._on_finish()
        finally:
            self._close(steps)
        if message is not None:
            self._error = BoundsError(message)
            raise self._error
        plan = self._plan
        self._result = Run(steps, STOPPED[why], self._backend, plan.scope, plan.blocks, plan.threads, self._start,
                           plan.depth)
        return self._result

    def _close(self, steps=None):
        with _HOLDING_LOCK:
            _HOLDING.discard(self)
        with self._tick_lock:
            if self._reporter is not None:
                if steps is not None:
                    self._reporter.update(steps, final=True)
                self._reporter.close()
                self._reporter = None


def slow_step_message(name, idle, watchdog, steps, run) -> str:
    """HangError text: the watchdog cancelled a run and it stopped (a step is just slow)."""
    return (f"{name}: the watchdog saw no progress for {idle:.1f} s (watchdog={watchdog} s) at "
            f"step {steps}, so it cancelled the run; the kernel stopped after {run.steps} steps, so a step "
            f"takes longer than the watchdog interval. The arrays hold the state after {run.steps} steps. "
            f"Pass a larger watchdog= (or watchdog=None) for steps this slow.")


def stuck_message(name, idle, watchdog, steps, grace, backend) -> str:
    """HangError text: the watchdog cancelled a run and it did not stop (a step never ends)."""
    return (f"{name}: the watchdog saw no progress for {idle:.1f} s (watchdog={watchdog} s) at step "
            f"{steps}, and the kernel did not stop within {grace:.1f} s of being cancelled: a step never "
            f"finishes (e.g. a while loop whose condition stays true). The {backend} device is still "
            f"running it; it cannot be stopped from here, so the process must exit to free it.")


def note_cancelled(exc: BaseException, name: str, run: Run):
    """Attach the cancelled run to a KeyboardInterrupt (``exc.loopkern_run``) and say so."""
    exc.loopkern_run = run
    if hasattr(exc, "add_note"):
        exc.add_note(f"loopkern: {name} was cancelled after {run.steps} steps; the arrays hold the "
                     f"state after those steps")


# -- a blocking call on a GPU --------------------------------------------------------------------
#: a blocking wait spins this long on the done flag: a run of a few ms returns within µs of its
#: end (as CUDA's own blocking calls spin while the CPU has cores to spare)...
SPIN_S = 1e-2
#: ...then sleeps, a little longer each time, up to this long between looks...
MAX_SLEEP_S = 5e-4
#: ...and never longer than this fraction of the time waited so far: the call returns at most
#: about this fraction (plus the OS's timer slack, ~50 µs on Linux) after the kernel ends. A
#: geometric back-off alone after a 2 ms spin returned a 3 ms Jacobi run ~0.1-0.2 ms late.
SLEEP_FRACTION = 0.02


def _next_pause(pause: float, waited: float, shortest: float, longest: float) -> float:
    """A waiting loop's next sleep: 1.5x its last one, within [shortest, longest], and never
    more than SLEEP_FRACTION of the time ``waited`` (which bounds how late the wait returns)."""
    return min(max(pause * 1.5, shortest), longest, SLEEP_FRACTION * waited)


def wait_cuda(host, event, name: str, watchdog, interruptible=True):
    """Wait until the kernel behind ``host`` (a mapped control block) is done; returns nothing.

    Spins on the done flag for SPIN_S, then sleeps up to MAX_SLEEP_S between looks (at most
    SLEEP_FRACTION of the time waited so far, which bounds how late the call returns) and asks
    every EventWaiter.QUERY_EVERY_S whether the kernel ended without marking itself done (it
    faulted): the launch's ``event``, or with ``event=None`` the legacy default stream it was
    launched on. The watchdog (``watchdog`` seconds without a new step) cancels the run, waits
    WATCHDOG_GRACE_S and raises HangError; Ctrl-C propagates (the caller cancels and waits
    again with ``interruptible=False``). Raises LaunchError if the kernel failed.

    The done flag alone proves the run complete (every thread's writes are fenced before it,
    cuda_rt.finish), so a finished wait synchronizes nothing; with an ``event`` it is still
    synchronized, which costs little once the flag is seen, so that the event is free again.
    """
    d = _driver()
    if host[DONE] != 1:
        query = _query(d, event)
        begin = last_change = time.monotonic()
        spin_end = begin + SPIN_S
        next_query = begin + EventWaiter.QUERY_EVERY_S
        pause, last_steps = 0.0, host[STEPS]
        while host[DONE] != 1:
            now = time.monotonic()
            if now < spin_end:
                continue
            if now >= next_query:
                next_query = now + EventWaiter.QUERY_EVERY_S
                r = query()
                if r != _NOT_READY:
                    if host[DONE] == 1:
                        break
                    _raise_failed(name, r)     # ended without its done flag: it faulted
                steps = host[STEPS]
                if steps != last_steps:
                    last_steps, last_change = steps, now
                elif interruptible and watchdog is not None and steps >= 0 and now - last_change > watchdog:
                    _cuda_stalled(host, query, name, watchdog, int(steps), now - last_change)
            pause = _next_pause(pause, now - begin, 2e-5, MAX_SLEEP_S)
            time.sleep(pause)
    if event is not None:
        r = d.event_synchronize(event)
        if r != 0:
            _raise_failed(name, r)


def _query(d, event):
    """A call returning the kernel's state as a driver code: NOT_READY while it may still run."""
    if event is not None:
        return lambda: d.event_query(event)
    return lambda: d.stream_query(None)


def _raise_failed(name, code):
    from .dispatch import driver
    if code == 0:
        raise LaunchError(f"{name}: the kernel ended without marking the run done")
    raise LaunchError(f"{name}: the kernel failed while running: {driver.error_name(code)} ({code})")


_NOT_READY = 600     # CUDA_ERROR_NOT_READY


_DRIVER: list = []


def _driver():
    if not _DRIVER:
        from .dispatch.driver import driver
        _DRIVER.append(driver())
    return _DRIVER[0]


def _cuda_stalled(host, query, name, watchdog, steps, idle):
    from .dispatch import driver
    host[REQUEST] = CANCEL
    end = time.monotonic() + WATCHDOG_GRACE_S
    while time.monotonic() < end:
        if host[DONE] == 1 or query() != driver.CUDA_ERROR_NOT_READY:
            raise _Stalled(idle, steps)
        time.sleep(1e-3)
    raise HangError(stuck_message(name, idle, watchdog, steps, WATCHDOG_GRACE_S, "cuda"), run=None)


class _Stalled(Exception):
    """The watchdog cancelled a run that then stopped: the caller finishes it and raises HangError."""

    def __init__(self, idle, steps, result=None):
        super().__init__(idle, steps)
        self.idle, self.steps = idle, steps
        self.result = result        # (steps, stop code) of a run in the calling thread


# -- a blocking call on the CPU: the kernel in the calling thread --------------------------------
#: a run in the calling thread is asked to pause (so that Python sees Ctrl-C) this long after it
#: started, and then this often
FIRST_PAUSE_S = 0.25
PAUSE_EVERY_S = 0.5
#: the control block's slot (free in the kernel's layout) where the host notes the step index
#: the current slice started at
SLICE_START = 5


class InlineRun:
    """The host's view of one run in the calling thread; the Ticker reads and writes it."""

    def __init__(self, host, start, deadline, watchdog):
        self.host = host
        self.t_next = start          # the step index the next slice starts at
        self.final = None            # the stop code, once the run has ended
        self.deadline = deadline     # monotonic seconds, or None
        self.watchdog = watchdog
        now = time.monotonic()
        self.next_pause = now + FIRST_PAUSE_S
        self.last_steps, self.last_change = None, now
        self.fired = None            # (steps, idle) once the watchdog cancelled the run
        self.fired_at = 0.0
        self.warned = False

    def absorb(self, lock):
        """Take in a finished slice (idempotent: safe to repeat after an interruption)."""
        h = self.host
        if h[DONE] != 1:
            return
        end = int(h[SLICE_START]) + int(h[STEPS])
        if end > self.t_next:
            self.t_next = end
        why = int(h[WHY])
        if why != PAUSE:
            self.final = why
        else:
            with lock:
                if h[REQUEST] == PAUSE:
                    h[REQUEST] = 0


class Ticker:
    """One daemon thread for every run in a calling thread: it writes the timeout, watchdog and
    pause requests into their control blocks.

    Adding a run does not wake the thread unless the run needs it sooner than it will wake
    anyway: waking another thread costs the calling thread tens of microseconds (the GIL
    changes hands twice), more than a short call. While calls keep coming the thread wakes
    every TICK_S; after IDLE_S without a run it waits until one comes.
    """

    TICK_S = 0.1
    IDLE_S = 2.0

    def __init__(self):
        self.cond = threading.Condition()
        self.runs: dict = {}
        self.thread = None
        self.wakes_at = 0.0          # when the thread looks next (inf: only when notified)

    def add(self, run: InlineRun, name: str, backend: str):
        self.runs[id(run)] = (run, name, backend)       # a dict store is atomic under the GIL
        due = run.next_pause if run.deadline is None else min(run.next_pause, run.deadline)
        if run.watchdog is not None:
            due = min(due, run.last_change + run.watchdog)
        if due >= self.wakes_at and self.thread is not None:
            return
        with self.cond:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="loopkern-ticker", daemon=True)
                self.thread.start()
            if due < self.wakes_at:
                self.wakes_at = due
                self.cond.notify()

    def remove(self, run: InlineRun):
        self.runs.pop(id(run), None)

    def _loop(self):
        idle_since = time.monotonic()
        with self.cond:
            while True:
                now = time.monotonic()
                if not self.runs:
                    if now - idle_since > self.IDLE_S:
                        # announce the long sleep before the last look: an add() that missed
                        # the announcement stored its run before it, so the look sees it
                        self.wakes_at = float("inf")
                        if not self.runs:
                            self.cond.wait()
                        continue
                    wake = now + self.TICK_S
                else:
                    idle_since = now
                    wake = now + self.TICK_S
                    for run, name, backend in list(self.runs.values()):
                        wake = min(wake, self._tick(run, name, backend, now))
                self.wakes_at = wake
                self.cond.wait(max(wake - time.monotonic(), 1e-3))

    @staticmethod
    def _tick(run: InlineRun, name, backend, now) -> float:
        h = run.host
        wake = run.next_pause
        if run.deadline is not None:
            if now >= run.deadline:
                if h[REQUEST] in (0, PAUSE):
                    h[REQUEST] = TIMEOUT
            else:
                wake = min(wake, run.deadline)
        steps = int(h[SLICE_START]) + int(h[STEPS])
        if steps != run.last_steps:
            run.last_steps, run.last_change = steps, now
        if run.watchdog is not None and run.fired is None:
            idle = now - run.last_change
            if idle > run.watchdog:
                run.fired, run.fired_at = (steps, idle), now
                h[REQUEST] = CANCEL
            else:
                wake = min(wake, run.last_change + run.watchdog + 1e-3)
        elif run.fired is not None and not run.warned:
            if now - run.fired_at > WATCHDOG_GRACE_S:
                run.warned = True
                # the calling thread is inside the step and cannot be interrupted: say so
                print(stuck_message(name, run.fired[1], run.watchdog, run.fired[0], WATCHDOG_GRACE_S, backend)
                      + " (It runs in the calling thread; use kernel.start(...) to keep control of a run "
                        "that may hang.)", file=sys.stderr, flush=True)
            else:
                wake = min(wake, run.fired_at + WATCHDOG_GRACE_S + 1e-3)
        if now >= run.next_pause:
            if h[REQUEST] == 0:
                h[REQUEST] = PAUSE
            run.next_pause = now + PAUSE_EVERY_S
            wake = min(wake, run.next_pause)
        return wake


TICKER = Ticker()


def run_inline(call, host, nsteps: int, start: int, *, name, timeout, watchdog, backend="cpu") -> tuple[int, int]:
    """Run a CPU kernel in the calling thread; returns (steps, stop code).

    ``call(n, t0)`` runs at most ``n`` steps from step index ``t0``, writing its step count,
    stop code and done flag into ``host``. The run goes in slices: the Ticker asks for a pause
    every PAUSE_EVERY_S, and the next slice continues at the step after the last one.

    Ctrl-C cancels the run at its next step boundary, waits for it and re-raises
    KeyboardInterrupt with ``_lk_result = (steps, code)``; the watchdog raises HangError
    (``run`` is filled in by the caller) via :class:`_Stalled`.
    """
    deadline = time.monotonic() + timeout if timeout is not None else None
    run = InlineRun(host, start, deadline, watchdog)
    end = start + nsteps
    TICKER.add(run, name, backend)
    try:
        try:
            _slices(call, run, end)
        except KeyboardInterrupt as exc:
            with TICKER.cond:
                host[REQUEST] = CANCEL
            _slices(call, run, end)
            exc._lk_result = (run.t_next - start, run.final)
            raise
    finally:
        TICKER.remove(run)
    if run.fired is not None:
        raise _Stalled(run.fired[1], run.fired[0], (run.t_next - start, run.final))
    return run.t_next - start, run.final


def _slices(call, run: InlineRun, end: int):
    host = run.host
    while True:
        run.absorb(TICKER.cond)
        if run.final is not None:
            return
        t = run.t_next
        host[DONE] = 0
        host[SLICE_START] = t
        call(end - t, t)
