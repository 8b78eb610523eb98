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
step) and ``lk.grid``; ``lk.thread_id()``, ``lk.num_threads()`` and ``lk.num_threads() - c -
lk.thread_id()``; ``+``, ``-`` of a literal, ``*``, ``//`` and ``%``;
``min``, ``max``, ``abs`` and conditional expressions of those; and local names, as the least
bound over every assignment to them (``+=`` of a non-negative amount keeps a bound). A name
bound in any other way, or through a cycle of assignments, is unbounded.

It also knows what holds where an expression is evaluated (its *guards*):

- inside a loop over ``range(a, b)`` (``lk.range``, each axis of ``lk.grid``) the body runs
  only if ``b > a``, so there ``b >= lower(a) + 1``: in ``for i in lk.grid(n, m)``, ``n - 1``
  is a valid row and ``i - 1 if i > 0 else n - 1`` (a periodic neighbour) is never negative;
- in the body of ``if T:``, ``while T:``, of ``x if T else y`` and in the operands after ``T``
  of ``T and ...``, the comparisons that ``T`` (or each operand of an ``and`` in it) makes:
  ``0 <= i - 1 < n`` gives ``i - 1 >= 0``, ``i > 0`` gives ``i >= 1``, ``i >= k`` gives
  ``i >= lower(k)``, ``a == b`` each side the other's bound;
- in the ``else`` of ``if T:`` / ``while T:`` and of ``x if T else y``, where ``T`` is a single
  comparison, its complement: ``i < 2`` false gives ``i >= 2`` (exact for integers), ``i != k``
  false ``i == k``; an ``and``, an ``or``, a ``not`` or a chain gives nothing there (their
  negation is a disjunction, or is not read).

A guard's fact about an expression holds only while none of the expression's names is
assigned again, so a statement guard (loop, ``if``, ``while``) keeps no fact about a name that
its body assigns anywhere. Facts are about pure expressions (names, literals, arithmetic,
shapes) and integers: an index that is a float does not compile, so a comparison of a float
never gives a bound that an index uses. Each assignment's bound is taken where the assignment
is, under its own guards. In a function with an assignment expression (``:=``) no test is
trusted.
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
    bounds = _Bounds(body, params, index_name)
    _Marker(bounds, {params[i] for i in array_params}).stmts(body, ())
    return body


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


class _Walker:
    """Visits a function body with, at each node, its context: the guards that enclose it (a
    tuple of ``(kind, node, names assigned in the guarded body)``, outermost first; kind
    "loop" for a ``for`` statement, "test" for a condition, "else" for one that was false)."""

    def __init__(self, bounds):
        self.bounds = bounds

    def stmts(self, stmts, ctx):
        for st in stmts:
            self.stmt(st, ctx)

    def stmt(self, st, ctx):
        if isinstance(st, ast.For):
            self.expr(st.iter, ctx)
            self.bind_loop(st, ctx)
            self.stmts(st.body, ctx + (("loop", st, frozenset(_assigned_names(st.body))),))
            self.stmts(st.orelse, ctx)
        elif isinstance(st, (ast.If, ast.While)):
            self.expr(st.test, ctx)
            self.stmts(st.body, self.bounds.tested(st.test, ctx, st.body))
            # (a while loop's else runs when its test is false: after a break it does not run)
            self.stmts(st.orelse, self.bounds.tested(st.test, ctx, st.orelse, held=False))
        else:
            self.bind(st, ctx)
            for child in ast.iter_child_nodes(st):
                self.node(child, ctx)

    def node(self, node, ctx):
        """Any node: a statement, an expression, or one that holds them (a keyword argument, a
        comprehension, an exception handler), visited in ``ctx``."""
        if isinstance(node, ast.stmt):
            self.stmt(node, ctx)
        elif isinstance(node, ast.expr):
            self.expr(node, ctx)
        else:
            for child in ast.iter_child_nodes(node):
                self.node(child, ctx)
            self.leaf(node, ctx)

    def expr(self, e, ctx):
        if isinstance(e, ast.IfExp):
            self.expr(e.test, ctx)
            self.expr(e.body, self.bounds.tested(e.test, ctx))
            self.expr(e.orelse, self.bounds.tested(e.test, ctx, held=False))
        elif isinstance(e, ast.BoolOp) and isinstance(e.op, ast.And):
            for v in e.values:
                self.expr(v, ctx)
                ctx = self.bounds.tested(v, ctx)
        else:
            for child in ast.iter_child_nodes(e):
                self.node(child, ctx)
            self.leaf(e, ctx)

    def bind(self, st, ctx):
        """Hook: a statement other than a loop or a condition, in context ``ctx``."""

    def bind_loop(self, st, ctx):
        """Hook: a ``for`` statement (its target is bound in ``ctx``, outside the loop)."""

    def leaf(self, e, ctx):
        """Hook: a node other than a statement, a conditional expression or an ``and``, after
        its children."""


class _Marker(_Walker):
    """Wraps the provable indices of array parameters."""

    def __init__(self, bounds, arrays):
        super().__init__(bounds)
        self.arrays = arrays

    def leaf(self, e, ctx):
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name) and e.value.id in self.arrays:
            if isinstance(e.slice, ast.Tuple):
                e.slice.elts = [self._wrap(x, ctx) for x in e.slice.elts]
            else:
                e.slice = self._wrap(e.slice, ctx)

    def _wrap(self, e, ctx):
        if isinstance(e, (ast.Constant, ast.Slice)) or is_nonneg_mark(e):
            return e
        low = self.bounds.lower(e, ctx)
        if low is None or low < 0:
            return e
        func = ast.Attribute(value=ast.Name(id="_lk_np", ctx=ast.Load()), attr="uint64", ctx=ast.Load())
        return ast.copy_location(ast.Call(func=func, args=[e], keywords=[]), e)


class _Collector(_Walker):
    """Records every binding of a name with the context it is made in."""

    def bind(self, st, ctx):
        b = self.bounds
        if isinstance(st, ast.Assign):
            for tgt in st.targets:
                b.bind_target(tgt, st.value, ctx)
        elif isinstance(st, ast.AugAssign):
            if isinstance(st.target, ast.Name):
                b.bind(st.target.id, ("grow", st.value) if isinstance(st.op, ast.Add) else None, ctx)
        elif isinstance(st, ast.AnnAssign):
            b.bind_target(st.target, st.value, ctx)

    def bind_loop(self, st, ctx):
        for t in ast.walk(st.target):
            if isinstance(t, ast.Name):
                self.bounds.bind(t.id, ("loop", st), ctx)

    def leaf(self, e, ctx):
        if isinstance(e, ast.NamedExpr):
            self.bounds.bind_target(e.target, e.value, ctx)
        elif isinstance(e, ast.comprehension):
            self.bounds.bind_target(e.target, None, ctx)


#: the nodes of an expression whose value a guard's fact may name: the same text names the
#: same integer wherever none of its names was assigned in between
_PURE = (ast.Name, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load, ast.Attribute,
         ast.Subscript)


def _key(e) -> str | None:
    """The text by which facts name ``e``, or None for an expression that facts cannot name
    (a call, an array element: their value may differ between two evaluations)."""
    for n in ast.walk(e):
        if not isinstance(n, _PURE):
            return None
        if isinstance(n, ast.Attribute) and n.attr not in ("shape", "size"):
            return None
        if isinstance(n, ast.Subscript) and not (isinstance(n.value, ast.Attribute) and n.value.attr == "shape"):
            return None
    if isinstance(e, ast.Constant):
        return None
    return ast.dump(e)


def _names(e) -> set:
    return {n.id for n in ast.walk(e) if isinstance(n, ast.Name)}


def _put(facts, key, low, names):
    """Record in ``facts`` that the expression ``key`` (whose names are ``names``) is at least
    ``low``, keeping the greater of two bounds."""
    prev = facts.get(key)
    facts[key] = (max(low, prev[0]) if prev else low, names)


def _loop_kind(it) -> str | None:
    """"range" for a loop over ``range(...)`` or ``lk.range(...)``, "grid" for ``lk.grid``."""
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
        return "range"
    return marker_of(it)


def _grid_axis(a):
    """(start, stop) of one ``lk.grid`` argument, ``(start, stop)`` or ``stop``."""
    return (a.elts[0], a.elts[1]) if isinstance(a, ast.Tuple) and len(a.elts) == 2 else (ast.Constant(0), a)


class _Bounds:
    """Lower bounds of integer expressions in one function (None: unknown or not an integer)."""

    def __init__(self, body, params, index_name):
        self.trust_tests = not any(isinstance(n, ast.NamedExpr)
                                   for n in ast.walk(ast.Module(body=list(body), type_ignores=[])))
        # each binding of a name: (how, context), how an expression, None (anything),
        # ("grow", amount) for a +=, or ("loop", for-node) for a loop variable
        self.bindings: dict[str, list] = {p: [(None, ())] for p in params}   # a parameter: anything
        if index_name is not None:
            self.bindings[index_name] = [(ast.Constant(0), ())]
        _Collector(self).stmts(list(body), ())
        self.memo: dict[str, int | None] = {}
        self.visiting: set[str] = set()
        self.fact_memo: dict = {}

    def bind(self, name, how, ctx):
        self.bindings.setdefault(name, []).append((how, ctx))

    def bind_target(self, tgt, value, ctx):
        if isinstance(tgt, ast.Name):
            self.bind(tgt.id, value, ctx)
        elif isinstance(tgt, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(tgt.elts) \
                else [None] * len(tgt.elts)
            for t, v in zip(tgt.elts, values):
                self.bind_target(t, v, ctx)
        elif isinstance(tgt, ast.Starred):
            self.bind_target(tgt.value, None, ctx)

    # -- facts -----------------------------------------------------------------------------
    def tested(self, test, ctx, body=(), held: bool = True):
        """``ctx`` where ``test`` holds (``held=False``: where it was false), in the statements
        ``body`` (none: an expression), which may assign names; ``ctx`` itself in a function
        whose tests are not trusted."""
        if not self.trust_tests:
            return ctx
        return ctx + (("test" if held else "else", test, frozenset(_assigned_names(body))),)

    def facts(self, ctx) -> dict:
        """{key of an expression: a lower bound that holds for it} in context ``ctx``."""
        if not ctx:
            return {}
        memo = self.fact_memo.get(ctx)
        if memo is not None:
            return memo
        outer = ctx[:-1]
        kind, node, assigned = ctx[-1]
        new = self._loop_facts(node, outer) if kind == "loop" else \
            self._test_facts(node, outer) if kind == "test" else self._false_facts(node, outer)
        facts = dict(self.facts(outer))
        for key, (low, names) in new.items():
            if low is not None and not (names & assigned):
                facts[key] = max(low, facts.get(key, low))
        self.fact_memo[ctx] = facts
        return facts

    def _loop_facts(self, loop, ctx) -> dict:
        """What holds in every iteration of ``loop``: its variables' bounds, and each range's
        stop above its start."""
        out = {}
        for name, low in self.loop_bounds(loop.target, loop.iter, ctx).items():
            out[ast.dump(ast.Name(id=name, ctx=ast.Load()))] = (low, {name})
        it = loop.iter
        kind = _loop_kind(it)
        if kind == "range" and not it.keywords and 1 <= len(it.args) <= 3:
            args = it.args
            step = int_constant(args[2]) if len(args) == 3 else 1
            start, stop = (ast.Constant(0), args[0]) if len(args) == 1 else (args[0], args[1])
            if step is not None and step > 0:
                self._above(out, stop, start, ctx)
            elif step is not None and step < 0:
                self._above(out, start, stop, ctx)
        elif kind == "grid" and not it.keywords:
            for a in it.args:
                lo, hi = _grid_axis(a)
                self._above(out, hi, lo, ctx)
        return out

    def _above(self, out, big, small, ctx, by=1):
        """Record ``big >= lower(small) + by``."""
        key = _key(big)
        low = self.lower(small, ctx)
        if key is not None and low is not None:
            _put(out, key, low + by, _names(big))

    def _test_facts(self, test, ctx) -> dict:
        """What holds where ``test`` was true: its comparisons (each operand of an ``and``)."""
        out = {}
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            # each operand is evaluated where the ones before it held
            for v in test.values:
                for key, (low, names) in self._test_facts(v, ctx).items():
                    _put(out, key, low, names)
                ctx = self.tested(v, ctx)
            return out
        if not isinstance(test, ast.Compare):
            return out
        left = test.left
        for op, right in zip(test.ops, test.comparators):
            if isinstance(op, ast.Lt):
                self._above(out, right, left, ctx)
            elif isinstance(op, ast.LtE):
                self._above(out, right, left, ctx, 0)
            elif isinstance(op, ast.Gt):
                self._above(out, left, right, ctx)
            elif isinstance(op, ast.GtE):
                self._above(out, left, right, ctx, 0)
            elif isinstance(op, ast.Eq):
                self._above(out, left, right, ctx, 0)
                self._above(out, right, left, ctx, 0)
            left = right
        return out

    def _false_facts(self, test, ctx) -> dict:
        """What holds where ``test`` was false: the complement of a single comparison (``i < c``
        false is ``i >= c``; an index is an integer, for which that is exact). Nothing for a
        chain, an ``and`` or anything else (their negation is a disjunction)."""
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
            return {}
        complement = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt, ast.NotEq: ast.Eq}
        op = complement.get(type(test.ops[0]))
        if op is None:
            return {}
        return self._test_facts(ast.Compare(left=test.left, ops=[op()], comparators=test.comparators), ctx)

    # -- bounds ----------------------------------------------------------------------------
    def loop_bounds(self, tgt, it, ctx=()) -> dict:
        """The bound of each name a ``for`` loop's target binds, from the loop alone (its
        range evaluated in context ``ctx``, outside the loop)."""
        kind = _loop_kind(it)
        if kind == "range" and isinstance(tgt, ast.Name):
            return {tgt.id: self._range_low(it.args, ctx)}
        if kind == "grid" and isinstance(tgt, ast.Tuple) and len(tgt.elts) == len(it.args):
            return {t.id: self.lower(_grid_axis(a)[0], ctx) for t, a in zip(tgt.elts, it.args)
                    if isinstance(t, ast.Name)}
        return {}

    def name(self, n):
        """The least bound over every binding of ``n``, each taken in its own context."""
        if n in self.memo:
            return self.memo[n]
        if n in self.visiting or n not in self.bindings:
            return None
        self.visiting.add(n)
        lows = [self._binding_low(n, how, ctx) for how, ctx in self.bindings[n]]
        self.visiting.discard(n)
        lows = [low for low in lows if low is not _KEEPS_BOUND]
        result = min(lows) if lows and None not in lows else None
        self.memo[n] = result
        return result

    def _binding_low(self, n, how, ctx):
        """The bound one binding gives ``n`` (None: none; _KEEPS_BOUND: the others' holds)."""
        if how is None:
            return None
        if isinstance(how, tuple) and how[0] == "grow":
            # growing by a known non-negative amount keeps the other bindings' bound
            g = self.lower(how[1], ctx)
            return _KEEPS_BOUND if g is not None and g >= 0 else None
        if isinstance(how, tuple):
            loop = how[1]
            return self.loop_bounds(loop.target, loop.iter, ctx).get(n)
        return self.lower(how, ctx)

    def _range_low(self, args, ctx=()):
        # range() takes integers only (anything else fails to compile), so the stop needs no check
        if len(args) == 1:
            return 0
        step = int_constant(args[2]) if len(args) == 3 else 1
        start, stop = self.lower(args[0], ctx), self.lower(args[1], ctx)
        if step is not None and step > 0:
            return start
        # counting down, every value is above the stop; a step of unknown sign: either way
        if stop is None or step is None and start is None:
            return None
        return stop + 1 if step is not None else min(start, stop + 1)

    def lower(self, e, ctx=()) -> int | None:
        """A lower bound of the integer expression ``e`` in context ``ctx`` (the guards around
        it, see _Walker), or None."""
        low = self._lower(e, ctx)
        facts = self.facts(ctx)
        if facts:
            key = _key(e)
            fact = facts.get(key) if key is not None else None
            if fact is not None:
                return fact if low is None else max(low, fact)
        return low

    def _lower(self, e, ctx):
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
            return self.lower(e.operand, ctx)
        if isinstance(e, ast.BinOp):
            return self._binop(e, ctx)
        if isinstance(e, ast.IfExp):
            a = self.lower(e.body, self.tested(e.test, ctx))
            b = self.lower(e.orelse, self.tested(e.test, ctx, held=False))
            return min(a, b) if a is not None and b is not None else None
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            return self._call(e, ctx)
        return None

    def _binop(self, e, ctx):
        if isinstance(e.op, ast.Sub) and isinstance(e.right, ast.Call) and marker_of(e.right) == "thread_id" \
                and not e.right.args:
            # lk.num_threads() - c - lk.thread_id(): the thread's index is below the count, so
            # this is at least 1 - c (a count of threads taken from the last one down)
            left, c = e.left, 0
            if isinstance(left, ast.BinOp) and isinstance(left.op, ast.Sub) and int_constant(left.right) is not None:
                left, c = left.left, int_constant(left.right)
            if isinstance(left, ast.Call) and marker_of(left) == "num_threads" and not left.args:
                return 1 - c
        a, b = self.lower(e.left, ctx), self.lower(e.right, ctx)
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

    def _call(self, e, ctx):
        f = e.func.id
        if e.keywords:
            return None
        if marker_of(e) == "thread_id" and not e.args:
            return 0
        if marker_of(e) == "num_threads" and not e.args:
            return 1
        if f == "len" and len(e.args) == 1 and isinstance(e.args[0], ast.Name):
            return 0
        lows = [self.lower(a, ctx) for a in e.args]
        if not lows or None in lows:
            return None
        if f == "min":
            return min(lows)
        if f == "max":
            return max(lows)
        if f == "abs" and len(lows) == 1:
            return max(lows[0], 0)
        return None
