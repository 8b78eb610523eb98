"""Parse a step function: its source text, AST and where it sits in the user's file.

Only :mod:`ast` and :mod:`inspect` are used here; nothing is compiled.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import linecache
import textwrap
import types
from dataclasses import dataclass, field

from .errors import Diagnostic, StepSyntaxError


@dataclass(frozen=True)
class ParsedFunction:
    """A function's source and AST, positioned in its file.

    Attributes:
        fn: the Python function object.
        name: its ``__name__``.
        filename: the file it was defined in.
        tree: its ``ast.FunctionDef`` with decorators removed; line numbers are absolute
            (lines of ``filename``) and columns are relative to the dedented source.
        col_shift: columns removed by dedenting, to add back for the user's real column.
        lines: the file's lines (for showing the offending line).
        namespace: names the body may read that are not its locals: closure cells first,
            then the function's globals, then builtins.
    """

    fn: types.FunctionType
    name: str
    filename: str
    tree: ast.FunctionDef
    col_shift: int
    lines: tuple[str, ...] = field(repr=False)
    closure: dict = field(repr=False)
    globals: dict = field(repr=False)
    #: a generated step (tangent, adjoint), which moves and copies the step's ``lk.random``
    #: draws: each draw names its site in the user's step as a third argument (see
    #: validate's ``_random_call``), so that it draws the same numbers there
    explicit_sites: bool = field(default=False, repr=False, compare=False)
    #: a step loopkern generates from a drop-in loop's body (``loopkern.jaxloops``), whose
    #: array arguments never share memory: a load, at an index the same on every thread, from
    #: an array the step never writes (a carry's old buffer: ``c1[0]``) counts as the same on
    #: every thread. In a user's step every array load counts as thread-varying (the contract)
    uniform_loads: bool = field(default=False, repr=False, compare=False)
    #: the free names resolved so far and their values: a name is read once, so the steps
    #: generated from this one later (tangent, adjoint: they share this dict) see the values
    #: the decorator saw, not a global or helper reassigned since
    read: dict = field(default_factory=dict, repr=False, compare=False)
    #: the helpers called from this step (and from its helpers), each parsed once: shared by
    #: the step, its helpers and the steps generated from it, so that a helper's free names
    #: also keep the values the decorator saw (parse_helper)
    helper_parses: dict = field(default_factory=dict, repr=False, compare=False)

    def lookup(self, name: str):
        """Resolve a free name the way Python would (the first time; the same value after);
        returns (found, value)."""
        if name in self.read:
            return True, self.read[name]
        if name in self.closure:
            value = self.closure[name]
        elif name in self.globals:
            value = self.globals[name]
        elif hasattr(builtins, name):
            value = getattr(builtins, name)
        else:
            return False, None
        self.read[name] = value
        return True, value

    def source_line(self, line: int) -> str:
        return self.lines[line - 1] if 0 < line <= len(self.lines) else ""

    def diagnostic(self, node: ast.AST, step: str, message: str, hint: str = "",
                   where: str = "") -> Diagnostic:
        """A :class:`Diagnostic` at ``node``, in the user's file coordinates."""
        line = getattr(node, "lineno", self.tree.lineno)
        col = getattr(node, "col_offset", 0) + self.col_shift + 1
        return Diagnostic(self.filename, line, col, step, message, hint,
                          self.source_line(line), where)


def parse_step(fn) -> ParsedFunction:
    """Return the source, AST and position of ``fn``.

    Raises:
        StepSyntaxError: ``fn`` is not a plain Python function whose source can be read.
    """
    if isinstance(fn, ParsedFunction):
        return fn
    if not isinstance(fn, types.FunctionType):
        raise StepSyntaxError([Diagnostic("<unknown>", 0, 0, getattr(fn, "__name__", repr(fn)),
                                          f"expected a plain Python function, got {type(fn).__name__}",
                                          "decorate a 'def' function with @lk.megakernel")])
    name = fn.__name__
    try:
        src_lines, first = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    except (OSError, TypeError) as exc:
        raise StepSyntaxError([Diagnostic(fn.__code__.co_filename, fn.__code__.co_firstlineno, 1, name,
                                          f"cannot read the source of '{name}' ({exc})",
                                          "define the step in a file (not in an interactive prompt or exec)")]) from None
    raw = "".join(src_lines)
    dedented = textwrap.dedent(raw)
    first_indent = len(src_lines[0]) - len(src_lines[0].lstrip())
    col_shift = first_indent - (len(dedented.splitlines()[0]) - len(dedented.splitlines()[0].lstrip()))
    try:
        module = ast.parse(dedented)
    except SyntaxError:        # the lines of a lambda inside a statement: not a 'def' on its own
        module = ast.Module(body=[], type_ignores=[])
    ast.increment_lineno(module, first - 1)
    node = next((n for n in module.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if node is None or isinstance(node, ast.AsyncFunctionDef):
        raise StepSyntaxError([Diagnostic(filename, first, 1, name, f"'{name}' is not a plain 'def' function",
                                          "write the step as a 'def' function")])
    node.decorator_list = []
    lines = tuple(linecache.getlines(filename)) or tuple(src_lines)
    if len(lines) < first:
        # Source came from somewhere linecache does not know: pad so line numbers still index.
        lines = ("\n",) * (first - 1) + tuple(src_lines)
    closure = {}
    if fn.__closure__:
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__):
            try:
                closure[var] = cell.cell_contents
            except ValueError:
                pass
    return ParsedFunction(fn, name, filename, node, col_shift, lines, closure, fn.__globals__)


def parse_helper(caller: ParsedFunction, fn) -> ParsedFunction:
    """``fn``, a helper called by ``caller``, parsed once for ``caller``'s step: the validator
    (at the decorator) and the derivative generators (later) see one ParsedFunction, whose
    free names resolve to the values they had when first read.

    Raises:
        StepSyntaxError: as :func:`parse_step`.
    """
    cache = caller.helper_parses
    parsed = cache.get(fn)
    if parsed is None:
        parsed = dataclasses.replace(parse_step(fn), helper_parses=cache)
        cache[fn] = parsed
    return parsed
