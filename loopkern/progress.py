"""Live progress of a running megakernel: a tqdm bar, a plain-text line, or a callback.

The kernel publishes its step count to the run's control block (see ``runtime/cuda_rt.py``);
the thread waiting for the run reads it and feeds one of these reporters at most
``REFRESH_S`` apart, plus once at the end with the final count.
"""

from __future__ import annotations

import inspect
import sys
import time

from .errors import ArgumentError

REFRESH_S = 0.1


def check_progress(progress):
    """``progress=`` as given (False, True or a callable), or an ArgumentError (also for a
    callable whose signature cannot take the two arguments, checked before anything runs)."""
    if progress is None or isinstance(progress, bool):
        return bool(progress)
    if callable(progress):
        try:
            sig = inspect.signature(progress)
        except (TypeError, ValueError):     # a builtin without a signature: trusted
            return progress
        try:
            sig.bind(0, 0)
        except TypeError as exc:
            raise ArgumentError(f"progress={progress!r}: it is called as f(steps_done, total), but its signature "
                                f"{sig} cannot take that ({exc}); add the parameter, e.g. "
                                f"lambda done, total: ...") from None
        return progress
    raise ArgumentError(f"progress={progress!r}: expected True, False or a callable receiving "
                        f"(steps_done, total)")


def make_reporter(progress, total: int | None, name: str):
    """A reporter for ``progress`` (None when it is False).

    Args:
        progress: True (a tqdm bar if tqdm is installed, else a text line on stderr) or a
            callable ``f(steps_done, total)``.
        total: the step count, or None for a step that returns a condition (then only the
            count and the rate are shown).
        name: the step's name, shown with the bar.
    """
    if progress is False:
        return None
    if callable(progress) and progress is not True:
        return _Callback(progress, total)
    try:
        import tqdm
    except ImportError:
        return _Text(total, name)
    return _Tqdm(tqdm, total, name)


class _Reporter:
    def __init__(self, total):
        self.total = total
        self.shown = -1
        self.last = 0.0

    def update(self, steps: int, final: bool = False):
        """Report ``steps`` done (rate-limited unless ``final``); counts never go backwards."""
        now = time.monotonic()
        if steps <= self.shown and not final:
            return
        if not final and now - self.last < REFRESH_S:
            return
        self.last = now
        steps = max(steps, self.shown)
        self.show(steps, final)
        self.shown = steps

    def show(self, steps, final):
        raise NotImplementedError

    def close(self):
        pass


class _Callback(_Reporter):
    def __init__(self, fn, total):
        super().__init__(total)
        self.fn = fn

    def show(self, steps, final):
        if steps != self.shown:
            self.fn(steps, self.total)


class _Tqdm(_Reporter):
    def __init__(self, tqdm, total, name):
        super().__init__(total)
        self.tqdm, self.name, self.bar = tqdm, name, None

    def show(self, steps, final):
        if self.bar is None:    # made at the first report, so compile time does not count as run time
            self.bar = self.tqdm.tqdm(total=self.total, desc=self.name, unit="step", unit_scale=True,
                                      dynamic_ncols=True)
        self.bar.update(steps - self.bar.n)

    def close(self):
        if self.bar is not None:
            self.bar.close()


class _Text(_Reporter):
    def __init__(self, total, name):
        super().__init__(total)
        self.name = name
        self.start = None
        self.printed = False

    def show(self, steps, final):
        if self.start is None:  # the first report comes when the kernel has been launched
            self.start = time.monotonic()
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = steps / elapsed
        done = f"{steps}/{self.total} steps ({100.0 * steps / self.total:.0f}%)" if self.total else f"{steps} steps"
        sys.stderr.write(f"\r{self.name}: {done}, {rate:,.0f} steps/s, {elapsed:.1f} s")
        sys.stderr.flush()
        self.printed = True

    def close(self):
        if self.printed:
            sys.stderr.write("\n")
            sys.stderr.flush()
