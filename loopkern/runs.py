"""A megakernel run in flight: waiting, progress, cancellation, timeouts and the watchdog.

:class:`RunHandle` is what ``kernel.start(...)`` returns; a blocking ``kernel(...)`` call is
``start`` followed by :meth:`RunHandle.wait`. The kernel and the host talk through the run's
control block (``host``, int64, layout in ``runtime/cuda_rt.py``): the kernel publishes its
step count and, when it ends, why it stopped; the host writes a request (cancel, or a timeout
on the CPU backend) that the kernel reads at a step boundary.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .errors import BoundsError, HangError, LaunchError

#: Run.stopped for each stop code the kernel writes
STOPPED = ("steps", "condition", "cancelled", "timeout", "error")
CANCEL, TIMEOUT = 2, 3
# control block slots
STEPS, REQUEST, WHY, DONE, TIMEOUT_NS = 0, 1, 2, 3, 4
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
        scope: ``"grid"``, ``"block"``, ``"thread"`` or ``"cpu"``.
        blocks: blocks launched (1 on the CPU).
        threads: threads per block (1 on the CPU).
        start: the step index ``t`` of the run's first step (the call's ``start=``).
    """

    steps: int
    stopped: str
    backend: str
    scope: str
    blocks: int
    threads: int
    start: int = 0

    @property
    def next_start(self) -> int:
        """The step index after the last step run: pass it as ``start=`` to continue."""
        return self.start + self.steps


class EventWaiter:
    """A launch on a CUDA stream: done when the kernel has marked its control block done, or
    when the event recorded after it has completed (a kernel that faulted never marks it)."""

    QUERY_EVERY_S = 0.05

    def __init__(self, event, host):
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
        return self._event_done()

    def _event_done(self) -> bool:
        # the driver binding directly: Numba's Event.query logs CUDA_ERROR_NOT_READY as an error
        from cuda.bindings import driver
        (err,) = driver.cuEventQuery(self.event.handle)
        if err == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        return True      # done, or failed: finish() synchronizes and raises the failure

    def finish(self):
        self.event.synchronize()


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


class RunHandle:
    """A run started by ``kernel.start(...)``.

    The kernel runs while Python goes on. ``wait()`` returns the :class:`Run` (and copies NumPy
    inputs back); ``cancel()`` asks every thread to stop at the next step boundary, all at the
    same step. Host arrays passed as NumPy arrays are only updated when ``wait()`` returns.
    """

    def __init__(self, *, name, host, waiter, backend, plan, reporter=None, deadline=None,
                 on_finish=None, watchdog=None, describe_error=None, start=0):
        self.name = name
        self._host = host                  # a NumPy view of the control block
        self._waiter = waiter
        self._backend = backend
        self._plan = plan
        self._reporter = reporter
        self._deadline = deadline          # host-side deadline (CPU backend), monotonic seconds
        self._on_finish = on_finish        # copy back, release buffers: once, after the kernel
        self._describe_error = describe_error
        self._start = start
        self._watchdog = watchdog
        self._result = None
        self._error = None                 # a BoundsError, raised by every wait() once finished
        self._lock = threading.Lock()
        self._last_steps = -1
        self._last_change = time.monotonic()
        self._tick_lock = threading.Lock()
        if reporter is not None:
            reporter.update(0)

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
            return self._wait(timeout)
        except KeyboardInterrupt as exc:
            self.cancel()
            run = self._wait(None, watchdog=False)
            exc.loopkern_run = run
            if hasattr(exc, "add_note"):
                exc.add_note(f"loopkern: {self.name} was cancelled after {run.steps} steps; the arrays hold the "
                             f"state after those steps")
            raise

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
            # spin briefly (short runs return fast), then sleep a little longer each time
            if now - start > 1e-3:
                pause = min(max(pause * 1.5, 1e-4), 2e-3)
                time.sleep(pause if timeout is None else max(0.0, min(pause, timeout - (now - start))))

    def _tick(self, watchdog) -> float:
        """Progress, the host-side deadline and (in a blocking wait) the watchdog."""
        now = time.monotonic()
        steps = int(self._host[STEPS])
        with self._tick_lock:
            if self._reporter is not None:
                self._reporter.update(max(steps, 0))
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

    def _stalled(self, steps, idle):
        """The watchdog fired: cancel, give the kernel a grace period, then report."""
        self.cancel()
        grace = WATCHDOG_GRACE_S
        watchdog, self._watchdog = self._watchdog, None    # it reports once
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if self._waiter.is_done():
                run = self._finish()
                raise HangError(
                    f"{self.name}: the watchdog saw no progress for {idle:.1f} s (watchdog={watchdog} s) at "
                    f"step {steps}, so it cancelled the run; the kernel stopped after {run.steps} steps, so a step "
                    f"takes longer than the watchdog interval. The arrays hold the state after {run.steps} steps. "
                    f"Pass a larger watchdog= (or watchdog=None) for steps this slow.", run=run)
            time.sleep(1e-3)
        raise HangError(
            f"{self.name}: the watchdog saw no progress for {idle:.1f} s (watchdog={watchdog} s) at step "
            f"{steps}, and the kernel did not stop within {grace:.1f} s of being cancelled: a step never "
            f"finishes (e.g. a while loop whose condition stays true). The {self._backend} device is still "
            f"running it; it cannot be stopped from here, so the process must exit to free it.", run=None)

    def _finish(self) -> Run:
        try:
            self._waiter.finish()
        except Exception as exc:
            self._close()
            if isinstance(exc, LaunchError) or not type(exc).__module__.startswith("numba"):
                raise
            raise LaunchError(f"{self.name}: the kernel failed while running: {exc}") from exc
        steps, why = int(self._host[STEPS]), int(self._host[WHY])
        try:
            if self._on_finish is not None:
                self._on_finish()
        finally:
            self._close(steps)
        if why == 4 and self._describe_error is not None:
            self._error = BoundsError(self._describe_error(steps))
            raise self._error
        plan = self._plan
        self._result = Run(steps, STOPPED[why], self._backend, plan.scope, plan.blocks, plan.threads, self._start)
        return self._result

    def _close(self, steps=None):
        with self._tick_lock:
            if self._reporter is not None:
                if steps is not None:
                    self._reporter.update(steps, final=True)
                self._reporter.close()
                self._reporter = None
