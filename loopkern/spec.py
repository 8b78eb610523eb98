"""StepSpec: the frozen contract between the front end and the code generator.

The bodies held here are *normalized* ASTs: every global name has been resolved, every call of
the in-step API is a call of a marker name (``__lk_sync``, ``__lk_sum``, ``__lk_range``, ...),
math functions read ``_lk_math.<name>``, NumPy casts ``_lk_np.<dtype>``, helper calls the
helper's generated symbol, and global numbers are inlined. Line numbers are the user's.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field
from functools import cached_property

#: marker-name prefix for in-step API calls in a normalized body
INTRINSIC_PREFIX = "__lk_"
#: prefix of every name the code generator introduces; user code may not use it
RESERVED_PREFIX = "_lk_"

#: prefix of a helper function's generated symbol (``_lk_fn_<name>``)
HELPER_PREFIX = RESERVED_PREFIX + "fn_"

ARRAY = "array"
SCALAR = "scalar"
ANY = "any"


def marker_of(node) -> str | None:
    """The in-step API name a normalized call stands for (``__lk_max(x)`` -> ``"max"``), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith(INTRINSIC_PREFIX):
        return node.func.id[len(INTRINSIC_PREFIX):]
    return None


def flat_targets(targets) -> list:
    """Assignment targets with tuples, lists and starred names unpacked (``v[i + 1], x = ...``
    stores ``v[i + 1]`` and binds ``x``)."""
    out = []
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            out += flat_targets(t.elts)
        elif isinstance(t, ast.Starred):
            out += flat_targets([t.value])
        else:
            out.append(t)
    return out


def binding_counts(stmts) -> dict:
    """How many times each name is bound in ``stmts`` and the statements inside them
    (assignments, augmented ones, loop targets; a store ``v[n - 1] = ...`` binds no name)."""
    counts: dict = {}
    for node in ast.walk(ast.Module(body=list(stmts), type_ignores=[])):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For)) else []
        for t in flat_targets(targets):
            if isinstance(t, ast.Name):
                counts[t.id] = counts.get(t.id, 0) + 1
    return counts


def index_offset(e):
    """``(base, c)`` for ``base + c``, ``base - c`` or ``c + base`` (c an integer literal), else ``(e, 0)``."""
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
        r = int_constant(e.right)
        if r is not None:
            return e.left, r if isinstance(e.op, ast.Add) else -r
        left = int_constant(e.left)
        if left is not None and isinstance(e.op, ast.Add):
            return e.right, left
    return e, 0


def split_tuple_assignments(stmts) -> list:
    """``stmts`` (and the bodies of their loops and ifs) with each ``a, b = x, y`` whose right
    side reads none of its targets written as ``a = x; b = y``: the same meaning, in the form
    the analyses and the derivative rules follow."""
    out = []
    for s in stmts:
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Tuple) \
                and isinstance(s.value, ast.Tuple) and len(s.targets[0].elts) == len(s.value.elts) \
                and all(isinstance(t, ast.Name) for t in s.targets[0].elts):
            names = {t.id for t in s.targets[0].elts}
            if not any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(s.value)):
                out += [ast.copy_location(ast.Assign(targets=[t], value=v), s)
                        for t, v in zip(s.targets[0].elts, s.value.elts)]
                continue
        if isinstance(s, (ast.For, ast.While, ast.If)):
            s = copy.copy(s)
            s.body, s.orelse = split_tuple_assignments(s.body), split_tuple_assignments(s.orelse)
        out.append(s)
    return out


def int_constant(e) -> int | None:
    """The value of an integer literal (``3``, ``-3``) in a normalized body, else None."""
    if isinstance(e, ast.Constant) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return e.value
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        c = int_constant(e.operand)
        return -c if c is not None else None
    return None


def is_helper_call(node) -> bool:
    """A call of one of the step's helper functions (by its generated symbol)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith(HELPER_PREFIX)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the step after the step index.

    Attributes:
        name: the parameter's name.
        kind: ``"array"``, ``"scalar"`` or ``"any"`` (never used, so anything valid goes).
        min_ndim: the most indices the step (or a helper) uses on it, e.g. 2 for ``u[i, j]``:
            an array with fewer dimensions cannot work.
        min_ndim_line: the line of that use, for the error message.
        written: the step (or a helper) assigns into its elements (``lk.atomic`` updates
            included).
        atomic: the step (or a helper) updates it with ``lk.atomic.add/max/min``: its dtype
            must be one of :data:`loopkern.dsl.ATOMIC_DTYPES`.
        max_ndim: the fewest indices an element access of the step (or of a helper, through
            its own deepest use) gives it, 0 if none: an array of more dimensions would make
            that access a row (a store fills it, a load is no number).
        max_ndim_line: the line of that access.
        integer_line: a line where the step takes the parameter's value as an integer (a loop
            bound, an ``lk.random`` key), 0 if none: a float passed for it is refused.
        index_line: a line where the step indexes an array with the parameter's value, 0 if
            none: a float or a bool passed for it is refused (NumPy reads a bool index as a
            mask, Numba does not compile one).
        shape_ndim: ``k + 1`` for the largest ``a.shape[k]`` (literal ``k``) the step reads of
            it, 0 if none: an array of fewer dimensions has no such extent.
        shape_line: the line of that read.
    """

    name: str
    kind: str
    min_ndim: int = 0
    min_ndim_line: int = 0
    written: bool = False
    atomic: bool = False
    max_ndim: int = 0
    max_ndim_line: int = 0
    integer_line: int = 0
    index_line: int = 0
    shape_ndim: int = 0
    shape_line: int = 0


@dataclass(frozen=True)
class FunctionSpec:
    """A validated function: the step itself or a helper it calls.

    Attributes:
        name: the user's name for it.
        symbol: the name the generated code gives it.
        params: parameter names, in order.
        body: normalized statements (see module docstring).
        filename: the user's file, for line comments.
        lineno: the line of its ``def``.
        thread_varying: its result can differ between threads for equal arguments
            (it loads from arrays, or uses the thread index or a parallel loop).
        array_params: indices of params it uses as arrays.
        written_params: indices of array params it assigns into (``lk.atomic`` updates included).
        param_arity: param index -> the most indices it uses on that param.
        atomic_params: indices of array params it updates with ``lk.atomic.*``.
        has_parallel_loop: it runs an ``lk.range``/``lk.grid`` loop, itself or through a helper
            it calls: every thread must call it together (not inside a parallel loop, nor
            under thread-varying control flow).
        updates: the read-modify-writes of array elements it makes outside any parallel loop
            of its own and outside an ``if lk.thread_id() == ...`` guard, which are safe only
            if each thread that calls it updates its own elements. Each is
            ``(array param index or None, dims, line)``; each dim is ``("param", k, c)`` (the
            helper's parameter ``k`` plus the integer ``c``), ``("tid", c)``
            (``lk.thread_id() + c``, or a name that strides from it by ``lk.num_threads()``) or
            None (anything else). The caller substitutes its arguments (see
            ``validate._Uniformity``).
    """

    name: str
    symbol: str
    params: tuple[str, ...]
    body: tuple[ast.stmt, ...]
    filename: str
    lineno: int
    thread_varying: bool
    array_params: frozenset[int]
    written_params: frozenset[int] = frozenset()
    param_arity: dict = field(default_factory=dict)
    atomic_params: frozenset[int] = frozenset()
    has_parallel_loop: bool = False
    updates: tuple = ()


@dataclass(frozen=True)
class StepSpec:
    """Everything the code generator needs to know about one step function.

    Attributes:
        name: the step function's name.
        filename: the file it was defined in.
        lineno: the line of its ``def``.
        index_param: name of the step-index parameter (``t``).
        params: the other parameters, in call order.
        step: the step body as a :class:`FunctionSpec`.
        helpers: helper functions, callees before callers.
        returns_condition: the step returns ``cond``: a device-side while loop.
        swap: pairs of indices into ``params`` whose buffers exchange roles after each step.
        uses_barrier: the body calls ``lk.sync`` or a reduction.
        parallel: the step (or a helper) uses any of lk.range, lk.grid, lk.thread_id,
            lk.num_threads, lk.sync or a reduction; a step that uses none is sequential code
            that one thread runs with no barrier (scope "thread"). ``lk.atomic`` and
            ``lk.random`` do not count: in a sequential step the one thread makes the update,
            and a draw does not depend on the thread.
    """

    name: str
    filename: str
    lineno: int
    index_param: str
    params: tuple[ParamSpec, ...]
    step: FunctionSpec
    helpers: tuple[FunctionSpec, ...]
    returns_condition: bool
    swap: tuple[tuple[int, int], ...]
    uses_barrier: bool
    parallel: bool = True

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @cached_property
    def light_elements(self) -> bool:
        """Each parallel loop's body is straight-line work per element (no loop inside it, and
        no call of a helper that loops; no parallel loop in a helper): a stencil, not an
        all-pairs sum. Such steps are cheap per element, so one block can hold a small problem
        (scope="auto"). A helper without loops (``max`` written out, say) is straight-line too:
        calling it costs no more than writing its body in place."""
        def is_parallel(n):
            return isinstance(n, ast.For) and marker_of(n.iter) in ("range", "grid")
        for h in self.helpers:
            if any(is_parallel(n) for st in h.body for n in ast.walk(st)):
                return False
        by_symbol = {h.symbol: h for h in self.helpers}
        looping: dict = {}

        def loops_in(nodes, seen) -> bool:
            for n in (m for st in nodes for m in ast.walk(st)):
                if isinstance(n, (ast.For, ast.While)):
                    return True
                if is_helper_call(n):
                    h = by_symbol.get(n.func.id)
                    if h is None or n.func.id in seen:
                        return True           # unknown, or a call back into itself: not straight-line
                    if n.func.id not in looping:
                        looping[n.func.id] = loops_in(h.body, seen | {n.func.id})
                    if looping[n.func.id]:
                        return True
            return False
        for loop in (n for st in self.step.body for n in ast.walk(st) if is_parallel(n)):
            if loops_in(loop.body, frozenset()):
                return False
        return True
