"""Array indices that are provably non-negative, so that their loads and stores can skip
Python's negative-index wraparound.

``a[i - 1]`` means ``a[n - 1]`` when ``i == 0``, so Numba tests the sign of every signed index
and adds the length when it is negative: in a stencil, two to five 64-bit instructions per
access, more than the arithmetic the step does. When the index cannot be negative, an unsigned
index means the same element and Numba emits no test. This module finds those indices with a
small lower-bound analysis over a normalized function body and wraps them in
``_lk_np.uint64(...)``. The analysis is conservative: an index it cannot bound keeps Python's
meaning.

What it knows: integer literals; the step index; ``.shape[k]``, ``.size``, ``len()``; loop
variables of ``range`` / ``lk.range`` (from the start, or from the stop for a negative literal
step) and ``lk.grid``; ``lk.thread_id()``; ``+``, ``-`` of a literal, ``*``, ``//`` and ``%``;
``min``, ``max``, ``abs`` and conditional expressions of those; and local names, as the least
bound over every assignment to them (``+=`` of a non-negative amount keeps a bound). A name
bound in any other way, or through a cycle of assignments, is unbounded.
"""

from __future__ import annotations

import ast
import copy

from .spec import int_constant, marker_of

_KEEPS_BOUND = object()     # a binding that leaves the name's other bindings' bound standing


def mark_nonneg_indices(body, params, array_params, index_name: str | None):
    """A copy of ``body`` where each index into an array parameter that is provably >= 0 is
    wrapped in ``_lk_np.uint64(...)`` (tuple indices element by element).

    Args:
        body: normalized statements of one function.
        params: its parameter names.
        array_params: indices into ``params`` of those used as arrays.
        index_name: the step-index parameter (never negative), or None for a helper.
    """
    body = copy.deepcopy(list(body))
    _Marker(_Bounds(body, params, index_name), {params[i] for i in array_params}).visit(
        ast.Module(body=body, type_ignores=[]))
    return body


class _Marker(ast.NodeVisitor):
    """Wraps the provable indices; inside a loop that does not rebind its variable, the
    variable's bound is the loop's own (other loops may reuse the name for other ranges)."""

    def __init__(self, bounds, arrays):
        self.bounds = bounds
        self.arrays = arrays

    def visit_For(self, node):
        self.visit(node.iter)
        rebound = _assigned_names(node.body)
        loop = {n: low for n, low in self.bounds.loop_bounds(node.target, node.iter).items() if n not in rebound}
        outer = self.bounds.overrides
        self.bounds.set_overrides({**outer, **loop})
        for st in node.body:
            self.visit(st)
        self.bounds.set_overrides(outer)
        for st in node.orelse:
            self.visit(st)

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id in self.arrays:
            if isinstance(node.slice, ast.Tuple):
                node.slice.elts = [_wrap(e, self.bounds) for e in node.slice.elts]
            else:
                node.slice = _wrap(node.slice, self.bounds)


def _assigned_names(stmts) -> set:
    names = set()
    for node in ast.walk(ast.Module(body=list(stmts), type_ignores=[])):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr, ast.For,
                                               ast.comprehension)) else []
        for t in targets:
            names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def is_nonneg_mark(e) -> bool:
    """Whether ``e`` is an index this module wrapped (proven non-negative)."""
    f = e.func if isinstance(e, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr == "uint64" and isinstance(f.value, ast.Name)
            and f.value.id == "_lk_np" and len(e.args) == 1 and not e.keywords)


def _wrap(e, bounds):
    if isinstance(e, (ast.Constant, ast.Slice)):
        return e
    low = bounds.lower(e)
    if low is None or low < 0:
        return e
    func = ast.Attribute(value=ast.Name(id="_lk_np", ctx=ast.Load()), attr="uint64", ctx=ast.Load())
    return ast.copy_location(ast.Call(func=func, args=[e], keywords=[]), e)


class _Bounds:
    """Lower bounds of integer expressions in one function (None: unknown or not an integer)."""

    def __init__(self, body, params, index_name):
        # each binding of a name: an expression, None (anything), ("grow", amount) for a +=, or
        # ("loop", for-node) for a loop variable
        self.bindings: dict[str, list] = {p: [None] for p in params}   # a parameter: anything
        if index_name is not None:
            self.bindings[index_name] = [ast.Constant(0)]
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            self._collect(node)
        self.memo: dict[str, int | None] = {}
        self.visiting: set[str] = set()
        self.overrides: dict[str, int | None] = {}

    def set_overrides(self, overrides):
        """Names whose bound is known from where the expression is (a loop's own variable)."""
        self.overrides = overrides
        self.memo = {}

    def loop_bounds(self, tgt, it) -> dict:
        """The bound of each name a ``for`` loop's target binds, from the loop alone."""
        python_range = isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
        kind = "range" if python_range else marker_of(it)
        if kind == "range" and isinstance(tgt, ast.Name):
            return {tgt.id: self._range_low(it.args)}
        if kind == "grid" and isinstance(tgt, ast.Tuple) and len(tgt.elts) == len(it.args):
            return {t.id: self.lower(a.elts[0]) if isinstance(a, ast.Tuple) and len(a.elts) == 2 else 0
                    for t, a in zip(tgt.elts, it.args) if isinstance(t, ast.Name)}
        return {}

    def _bind(self, name, how):
        self.bindings.setdefault(name, []).append(how)

    def _collect(self, node):
        if isinstance(node, ast.Assign):
            for tgt in node.targets:
                self._bind_target(tgt, node.value)
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name):
                self._bind(node.target.id, ("grow", node.value) if isinstance(node.op, ast.Add) else None)
        elif isinstance(node, ast.For):
            for t in ast.walk(node.target):
                if isinstance(t, ast.Name):
                    self._bind(t.id, ("loop", node))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
            self._bind_target(node.target, node.value)
        elif isinstance(node, ast.comprehension):
            self._bind_target(node.target, None)

    def _bind_target(self, tgt, value):
        if isinstance(tgt, ast.Name):
            self._bind(tgt.id, value)
        elif isinstance(tgt, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(tgt.elts) \
                else [None] * len(tgt.elts)
            for t, v in zip(tgt.elts, values):
                self._bind_target(t, v)
        elif isinstance(tgt, ast.Starred):
            self._bind_target(tgt.value, None)

    def name(self, n):
        if n in self.overrides:
            return self.overrides[n]
        if n in self.memo:
            return self.memo[n]
        if n in self.visiting or n not in self.bindings:
            return None
        self.visiting.add(n)
        lows = [self._binding_low(n, how) for how in self.bindings[n]]
        self.visiting.discard(n)
        lows = [low for low in lows if low is not _KEEPS_BOUND]
        result = min(lows) if lows and None not in lows else None
        self.memo[n] = result
        return result

    def _binding_low(self, n, how):
        """The bound one binding gives ``n`` (None: none; _KEEPS_BOUND: the others' holds)."""
        if how is None:
            return None
        if isinstance(how, tuple) and how[0] == "grow":
            # growing by a known non-negative amount keeps the other bindings' bound
            g = self.lower(how[1])
            return _KEEPS_BOUND if g is not None and g >= 0 else None
        if isinstance(how, tuple):
            loop = how[1]
            return self.loop_bounds(loop.target, loop.iter).get(n)
        return self.lower(how)

    def _range_low(self, args):
        # range() takes integers only (anything else fails to compile), so the stop needs no check
        if len(args) == 1:
            return 0
        step = int_constant(args[2]) if len(args) == 3 else 1
        start, stop = self.lower(args[0]), self.lower(args[1])
        if step is not None and step > 0:
            return start
        # counting down, every value is above the stop; a step of unknown sign: either way
        if stop is None or step is None and start is None:
            return None
        return stop + 1 if step is not None else min(start, stop + 1)

    def lower(self, e) -> int | None:
        """A lower bound of the integer expression ``e``, or None."""
        c = int_constant(e)
        if c is not None:
            return c
        if isinstance(e, ast.Name):
            return self.name(e.id)
        if isinstance(e, ast.Attribute) and e.attr == "size" and isinstance(e.value, ast.Name):
            return 0
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Attribute) and e.value.attr == "shape":
            return 0
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.UAdd):
            return self.lower(e.operand)
        if isinstance(e, ast.BinOp):
            return self._binop(e)
        if isinstance(e, ast.IfExp):
            a, b = self.lower(e.body), self.lower(e.orelse)
            return min(a, b) if a is not None and b is not None else None
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            return self._call(e)
        return None

    def _binop(self, e):
        a, b = self.lower(e.left), self.lower(e.right)
        if a is None or b is None:
            return None
        if isinstance(e.op, ast.Add):
            return a + b
        if isinstance(e.op, ast.Sub):
            c = int_constant(e.right)
            return a - c if c is not None else None
        if isinstance(e.op, ast.Mult):
            return a * b if a >= 0 and b >= 0 else None
        if isinstance(e.op, ast.FloorDiv):
            return 0 if a >= 0 and b >= 1 else None
        if isinstance(e.op, ast.Mod):
            # Python's %: the sign of the divisor (a zero divisor is an error, not an index)
            return 0 if b >= 0 else None
        return None

    def _call(self, e):
        f = e.func.id
        if e.keywords:
            return None
        if marker_of(e) == "thread_id" and not e.args:
            return 0
        if f == "len" and len(e.args) == 1 and isinstance(e.args[0], ast.Name):
            return 0
        lows = [self.lower(a) for a in e.args]
        if not lows or None in lows:
            return None
        if f == "min":
            return min(lows)
        if f == "max":
            return max(lows)
        if f == "abs" and len(lows) == 1:
            return max(lows[0], 0)
        return None
