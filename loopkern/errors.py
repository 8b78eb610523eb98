"""The one exception hierarchy of loopkern, and the formatter for errors that point at user code.

Every error that loopkern raises on purpose is a :class:`LoopkernError`. Errors about the step
function's source carry one or more :class:`Diagnostic` records and print as::

    path/to/file.py:12:9: in step 'heat': what is wrong
        v[i] = lk.sum(u[i])
               ^
      what to do instead
"""

from __future__ import annotations

from dataclasses import dataclass


class LoopkernError(Exception):
    """Base class of every error loopkern raises on purpose."""


class StepSyntaxError(LoopkernError):
    """The step function (or a helper it calls) is not valid restricted Python.

    Attributes:
        diagnostics: every violation found, in source order.
    """

    def __init__(self, diagnostics: list["Diagnostic"]):
        self.diagnostics = list(diagnostics)
        n = len(self.diagnostics)
        head = f"{n} problem{'s' if n != 1 else ''} in the step function:\n" if n > 1 else ""
        super().__init__(head + "\n".join(d.format() for d in self.diagnostics))


class CompileError(LoopkernError):
    """Numba could not compile the generated kernel; the message points at the user's line."""


class ArgumentError(LoopkernError, TypeError):
    """A call passed a bad argument (count, kind, dtype, shape, device or option)."""


class LaunchError(LoopkernError):
    """The requested launch configuration cannot run (e.g. the grid cannot be co-resident)."""


class HangError(LaunchError):
    """The watchdog of a blocking call saw a kernel stop advancing its step counter.

    The call then cancels the run and waits a little for the kernel to stop.

    Attributes:
        run: the :class:`~loopkern.Run` when the kernel stopped after that cancel (a step is
            merely slower than the watchdog: ``run.steps`` says how far it got, and the arrays
            hold the state after that many steps), else None (a step never finishes, e.g. a
            ``while`` loop whose condition stays true; the kernel is still running and cannot
            be stopped from Python).
    """

    def __init__(self, message, run=None):
        super().__init__(message)
        self.run = run


class BoundsError(LoopkernError, IndexError):
    """A ``debug=True`` run indexed an array outside its shape; the message points at the
    access and says at which step, by which thread, with which index. The access was not
    made (a load read element 0, a store was skipped) and the run stopped soon after."""


class StepError(LoopkernError):
    """The step raised an exception while the kernel ran (CPU backend: e.g. a ``debug=True``
    kernel, which keeps Python's error model, dividing by zero). The run stopped there.

    Attributes:
        run: the :class:`~loopkern.Run` of the steps completed before the failing one
            (``stopped == "error"``): each swap pair's first array holds the state after
            ``run.steps`` steps; arrays the step writes in place may hold part of the failing
            step. None where the count is unknown (a kernel compiled with ``control=False``).
        loopkern_run: the same Run (the attribute Ctrl-C and a raising progress callback set).

    The step's own exception is the ``__cause__``.
    """

    def __init__(self, message, run=None):
        super().__init__(message)
        self.run = self.loopkern_run = run


class BackendError(LoopkernError):
    """The requested backend is not usable on this machine."""


@dataclass(frozen=True)
class Diagnostic:
    """One problem at one place in the user's source.

    Attributes:
        filename: the user's file.
        line: 1-based line in that file.
        col: 1-based column in that file.
        step: name of the step function being compiled.
        message: what is wrong.
        hint: what to do instead.
        source_line: the text of that line, as in the file.
        where: extra context such as "in helper 'lap'" (may be empty).
    """

    filename: str
    line: int
    col: int
    step: str
    message: str
    hint: str = ""
    source_line: str = ""
    where: str = ""

    def format(self) -> str:
        where = f" {self.where}:" if self.where else ""
        out = [f"{self.filename}:{self.line}:{self.col}: in step '{self.step}':{where} {self.message}"]
        if self.source_line:
            text = self.source_line.rstrip("\n").expandtabs(1)
            out.append("    " + text)
            out.append("    " + " " * max(self.col - 1, 0) + "^")
        if self.hint:
            out.append("  " + self.hint)
        return "\n".join(out)
