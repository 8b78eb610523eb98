"""Forward-mode differentiation of a step: the tangent step, source to source.

``tangent_function(parsed, active)`` turns a step ``def step(t, u, v, alpha)`` into
``def step_jvp(t, u, u_dot, v, v_dot, alpha, alpha_dot)`` (a tangent parameter right after
each active parameter: float arrays and float scalars the caller differentiates) whose body
runs the primal statements and, before each, the statement that carries their derivative:

- ``x = e`` gets ``x_dot = de`` (``0.0`` where ``e`` does not depend on an active value but
  ``x`` is active elsewhere); ``a[i] = e`` on an active array gets ``a_dot[i] = de``;
- ``x += e`` / ``-=`` / ``*=`` / ``/=``, ``a[i] += e`` likewise;
- arithmetic, ``**``, ``math``'s functions, ``abs``, ``min``, ``max``, ``float``, conditional
  expressions, ``lk.sum`` (the sum of the tangents) and ``lk.atomic.add`` (the tangent added
  to the tangent array) have rules; comparisons, ``int()``, shapes and indices carry none;
- ``lk.random`` draws have no tangent (a draw is a fixed function of the seed, the step
  index, its key and subkey and its call site); the tangent step's draws name their sites in
  the step (``validate.tag_random_sites``), so they draw the same numbers wherever they are
  copied.

The result is a :class:`~loopkern.frontend.ParsedFunction` whose nodes keep the user's line
numbers, so the tangent step validates, compiles and reports errors like the step itself.
``lk.max(m)``/``lk.min(m)`` of a running extremum (``m`` set before the loops, updated in them
only as ``m = max(m, e)``) has the tangent JAX gives its max/min reductions: the mean of the
tangents of the values equal to the result (each thread counts its ties; the start value is
not one). A helper in expression form (assignments to locals, then one ``return``) is
inlined first (``loopkern/inline.py``). What has no rule here (``lk.max``/``lk.min`` of
anything else, other helpers,
``lk.atomic.max``/``min``, a tuple assignment of an active value) raises :class:`~loopkern.errors.StepSyntaxError` at the
line.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import types

from .errors import StepSyntaxError
from .inline import inline_helpers
from .validate import tag_random_sites

_MATH_RULES = {
    # f(x) -> derivative as a function of the argument's AST and the call's AST
    "sqrt": lambda x, f: _div(_num(0.5), f),
    "exp": lambda x, f: f,
    "log": lambda x, f: _div(_num(1.0), x),
    "sin": lambda x, f: _call_like(f, "cos", x),
    "cos": lambda x, f: ast.UnaryOp(op=ast.USub(), operand=_call_like(f, "sin", x)),
    "tan": lambda x, f: _add(_num(1.0), _mul(f, f)),
    "tanh": lambda x, f: _sub(_num(1.0), _mul(f, f)),
    "sinh": lambda x, f: _call_like(f, "cosh", x),
    "cosh": lambda x, f: _call_like(f, "sinh", x),
    "log1p": lambda x, f: _div(_num(1.0), _add(_num(1.0), x)),
    "expm1": lambda x, f: _add(f, _num(1.0)),
    "atan": lambda x, f: _div(_num(1.0), _add(_num(1.0), _mul(x, x))),
}


def _num(v):
    return ast.Constant(v)


# Every builder copies its operands: a node must not appear twice in the tree (validation
# rewrites nodes in place, and would see a shared one twice)
def _add(a, b):
    return ast.BinOp(left=copy.deepcopy(a), op=ast.Add(), right=copy.deepcopy(b))


def _sub(a, b):
    return ast.BinOp(left=copy.deepcopy(a), op=ast.Sub(), right=copy.deepcopy(b))


def _mul(a, b):
    return ast.BinOp(left=copy.deepcopy(a), op=ast.Mult(), right=copy.deepcopy(b))


def _div(a, b):
    return ast.BinOp(left=copy.deepcopy(a), op=ast.Div(), right=copy.deepcopy(b))


def _call_like(call, name, arg):
    """``call``'s function with its last attribute renamed (math.sin -> math.cos) on ``arg``."""
    f = copy.deepcopy(call.func)
    if isinstance(f, ast.Attribute):
        f.attr = name
    else:
        f.id = name
    return ast.Call(func=f, args=[copy.deepcopy(arg)], keywords=[])


def _plus(a, b):
    """a + b where None is zero."""
    if a is None:
        return b
    if b is None:
        return a
    return _add(a, b)


class _Tangent:
    def __init__(self, parsed, active: set):
        self.parsed = parsed
        self.active_params = set(active)
        self.dot = {}                         # active name -> its tangent's name
        used = {n.id for n in ast.walk(parsed.tree) if isinstance(n, ast.Name)} | \
            {a.arg for a in parsed.tree.args.args}
        self.used = used
        self.extrema = {}                     # running extrema reduced by lk.max/min (running_extrema)
        self.ties = {}                        # running extremum -> its local count of tied values

    # -- names -----------------------------------------------------------------------------
    def _companion(self, table, name, suffix):
        """The name of ``name``'s companion local (its tangent, its count of ties), fresh
        the first time, kept in ``table``."""
        if name not in table:
            d = f"{name}_{suffix}"
            while d in self.used:
                d += "_"
            self.used.add(d)
            table[name] = d
        return table[name]

    def dot_name(self, name):
        return self._companion(self.dot, name, "dot")

    def ties_name(self, name):
        return self._companion(self.ties, name, "ties")

    def module_of(self, node):
        """'math', 'lk', 'lk.random', 'lk.atomic', 'np' for attribute bases, else None."""
        import math as _math

        import numpy as _np
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None, None
        found, value = self.parsed.lookup(node.id)
        if not found:
            return None, None
        import loopkern as _lk
        base = {id(_math): "math", id(_lk): "lk", id(_np): "np"}.get(id(value))
        if base is None:
            return None, None
        parts.reverse()
        return ".".join([base] + parts[:-1]), (parts[-1] if parts else None)

    def error(self, node, what, hint=""):
        d = self.parsed.diagnostic(node, self.parsed.name, what, hint)
        return StepSyntaxError([d])

    # -- activity --------------------------------------------------------------------------
    def is_active(self, e, names) -> bool:
        """Whether expression ``e`` depends on an active value (``names``: active locals and
        parameters)."""
        if isinstance(e, ast.Name):
            return e.id in names
        if isinstance(e, ast.Constant):
            return False
        if isinstance(e, ast.Subscript):
            return isinstance(e.value, ast.Name) and e.value.id in names
        if isinstance(e, (ast.Compare, ast.BoolOp)):
            return False
        if isinstance(e, ast.Attribute):
            return False                          # u.shape, np.float32 ...
        if isinstance(e, ast.UnaryOp):
            return not isinstance(e.op, ast.Not) and self.is_active(e.operand, names)
        if isinstance(e, ast.BinOp):
            return self.is_active(e.left, names) or self.is_active(e.right, names)
        if isinstance(e, ast.IfExp):
            return self.is_active(e.body, names) or self.is_active(e.orelse, names)
        if isinstance(e, ast.Call):
            mod, attr = self.module_of(e.func)
            name = e.func.id if isinstance(e.func, ast.Name) else attr
            if name in ("int", "len", "bool", "round") or mod == "lk.random" or (mod == "np" and name in (
                    "int32", "int64", "uint32", "uint64", "int8", "int16", "uint8", "uint16")):
                return False
            if mod == "lk" and name in ("thread_id", "num_threads", "range", "grid"):
                return False
            return any(self.is_active(a, names) for a in e.args)
        if isinstance(e, ast.Tuple):
            return any(self.is_active(x, names) for x in e.elts)
        return False

    def active_names(self, body) -> set:
        names = set(self.active_params)
        changed = True
        while changed:
            changed = False
            for n in ast.walk(ast.Module(body=list(body), type_ignores=[])):
                targets, value = [], None
                if isinstance(n, ast.Assign):
                    targets, value = n.targets, n.value
                elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
                    targets, value = [n.target], n.value
                for tgt in targets:
                    if isinstance(tgt, ast.Name) and tgt.id not in names and self.is_active(value, names):
                        names.add(tgt.id)
                        changed = True
        return names

    # -- derivatives -----------------------------------------------------------------------
    def d(self, e, names):
        """The tangent of expression ``e`` (an AST), or None where it is zero."""
        if not self.is_active(e, names):
            return None
        if isinstance(e, ast.Name):
            return ast.Name(id=self.dot_name(e.id), ctx=ast.Load())
        if isinstance(e, ast.Subscript):
            return ast.Subscript(value=ast.Name(id=self.dot_name(e.value.id), ctx=ast.Load()),
                                 slice=copy.deepcopy(e.slice), ctx=ast.Load())
        if isinstance(e, ast.UnaryOp):
            de = self.d(e.operand, names)
            return None if de is None else (de if isinstance(e.op, ast.UAdd) else ast.UnaryOp(op=ast.USub(), operand=de))
        if isinstance(e, ast.IfExp):
            db, do = self.d(e.body, names), self.d(e.orelse, names)
            return ast.IfExp(test=copy.deepcopy(e.test), body=db or _num(0.0), orelse=do or _num(0.0))
        if isinstance(e, ast.BinOp):
            return self.d_binop(e, names)
        if isinstance(e, ast.Call):
            return self.d_call(e, names)
        raise self.error(e, f"no derivative rule for '{ast.unparse(e)}'")

    def d_binop(self, e, names):
        a, b = copy.deepcopy(e.left), copy.deepcopy(e.right)
        da, db = self.d(e.left, names), self.d(e.right, names)
        op = e.op
        if isinstance(op, ast.Add):
            return _plus(da, db)
        if isinstance(op, ast.Sub):
            if db is None:
                return da
            neg = ast.UnaryOp(op=ast.USub(), operand=db)
            return neg if da is None else _sub(da, db)
        if isinstance(op, ast.Mult):
            return _plus(None if da is None else _mul(da, b), None if db is None else _mul(a, db))
        if isinstance(op, ast.Div):
            return _plus(None if da is None else _div(da, b),
                         None if db is None else ast.UnaryOp(op=ast.USub(), operand=_div(_mul(a, db), _mul(b, b))))
        if isinstance(op, ast.Pow):
            if db is None:          # x ** c: c * x ** (c - 1) * dx
                return _mul(_mul(b, ast.BinOp(left=a, op=ast.Pow(), right=_sub(copy.deepcopy(b), _num(1)))), da)
            raise self.error(e, "no derivative rule for a power with an active exponent yet",
                             "write it with math.exp and math.log")
        raise self.error(e, f"no derivative rule for the operator in '{ast.unparse(e)}'")

    def d_call(self, e, names):
        mod, attr = self.module_of(e.func)
        name = e.func.id if isinstance(e.func, ast.Name) else attr
        args = e.args
        if mod == "math" and name in _MATH_RULES and len(args) == 1:
            dx = self.d(args[0], names)
            return None if dx is None else _mul(_MATH_RULES[name](copy.deepcopy(args[0]), copy.deepcopy(e)), dx)
        if (mod is None and name == "float" or mod == "np" and name in ("float32", "float64")) and len(args) == 1:
            dx = self.d(args[0], names)
            return None if dx is None else ast.Call(func=copy.deepcopy(e.func), args=[dx], keywords=[])
        if mod is None and name == "abs" and len(args) == 1:
            dx = self.d(args[0], names)
            return ast.IfExp(test=ast.Compare(left=copy.deepcopy(args[0]), ops=[ast.GtE()], comparators=[_num(0)]),
                             body=copy.deepcopy(dx), orelse=ast.UnaryOp(op=ast.USub(), operand=copy.deepcopy(dx)))
        if mod is None and name in ("min", "max") and len(args) == 2:
            da, db = self.d(args[0], names) or _num(0.0), self.d(args[1], names) or _num(0.0)
            cmp = ast.LtE() if name == "min" else ast.GtE()
            return ast.IfExp(test=ast.Compare(left=copy.deepcopy(args[0]), ops=[cmp],
                                              comparators=[copy.deepcopy(args[1])]), body=da, orelse=db)
        if mod == "lk" and name == "sum" and len(args) == 1:
            dx = self.d(args[0], names)
            return ast.Call(func=copy.deepcopy(e.func), args=[dx], keywords=[])
        if mod == "lk" and name in ("max", "min") and len(args) == 1:
            m = args[0].id if isinstance(args[0], ast.Name) else None
            op, bad = self.extrema.get(m, (None, e))
            if bad is not None:
                raise self.error(bad, f"lk.{name} has a derivative only of a running {name}: a local set before "
                                      f"the loops and updated in them only as m = {name}(m, e)")
            # the mean of the tangents of the values equal to the result: each thread's sum of
            # its ties' tangents and their count, where its running value is the result
            hit = ast.Compare(left=copy.deepcopy(args[0]), ops=[ast.Eq()], comparators=[copy.deepcopy(e)])
            lk_sum = ast.Attribute(value=copy.deepcopy(e.func.value), attr="sum", ctx=ast.Load())
            dots = ast.Call(func=copy.deepcopy(lk_sum), args=[ast.IfExp(
                test=copy.deepcopy(hit), body=ast.Name(id=self.dot_name(m), ctx=ast.Load()), orelse=_num(0.0))],
                keywords=[])
            count = ast.Call(func=copy.deepcopy(lk_sum), args=[ast.IfExp(
                test=hit, body=ast.Name(id=self.ties_name(m), ctx=ast.Load()), orelse=_num(0.0))], keywords=[])
            return _div(dots, ast.Call(func=ast.Name(id="max", ctx=ast.Load()), args=[count, _num(1.0)],
                                       keywords=[]))
        if isinstance(e.func, ast.Name) and isinstance(self.parsed.lookup(e.func.id)[1], types.FunctionType):
            raise self.error(e, f"no derivative rule for the helper '{e.func.id}': only helpers in expression "
                                f"form are differentiated (inlined)",
                             "write it as assignments to locals and one return, reading only its parameters, "
                             "its locals and names that mean the same in the step's module, and calling only "
                             "math, numpy and builtin functions (loopkern/inline.py)")
        raise self.error(e, f"no derivative rule for '{ast.unparse(e.func)}' yet",
                         "the tangent step covers arithmetic, math's functions, abs, min, max, float, lk.sum, "
                         "lk.max/lk.min of a running max/min, and helpers in expression form")

    # -- statements ------------------------------------------------------------------------
    def body(self, stmts, names):
        out = []
        for s in stmts:
            out += self.stmt(s, names)
        return out

    def stmt(self, s, names):
        loc = s
        if isinstance(s, ast.Assign):
            if len(s.targets) != 1:
                raise self.error(s, "a chained assignment in a step to differentiate", "write one assignment per line")
            tgt = s.targets[0]
            if isinstance(tgt, ast.Name) and tgt.id in self.extrema and self.extrema[tgt.id][1] is None:
                return self.running(tgt.id, s, names) + [s]
            return self.assign(tgt, s.value, s, names) + [s]
        if isinstance(s, ast.AnnAssign) and s.value is not None:
            return self.assign(s.target, s.value, s, names) + [s]
        if isinstance(s, ast.AugAssign):
            return self.aug_assign(s, names) + [s]
        if isinstance(s, (ast.For, ast.While)):
            s = copy.copy(s)
            s.body = self.body(s.body, names)
            return [s]
        if isinstance(s, ast.If):
            s = copy.copy(s)
            s.body = self.body(s.body, names)
            s.orelse = self.body(s.orelse, names)
            return [s]
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
            mod, attr = self.module_of(s.value.func)
            if mod == "lk.atomic":
                return self.atomic(s.value, attr, s, names) + [s]
            if self.is_active(s.value, names):
                raise self.error(s, "a call whose result is dropped but depends on an active value")
            return [s]
        del loc
        return [s]

    def running(self, m, s, names):
        """A running extremum's statement: at the top level its start (no tied value yet);
        in a loop, m = max(m, e), with the count of the thread's values equal to m and the
        sum of their tangents updated from the value before (a larger e starts them over)."""
        op = self.extrema[m][0]
        e = running_update(s, m, op)
        if e is None:           # the start
            return self.assign(s.targets[0], s.value, s, names) + [self._loc(ast.Assign(
                targets=[ast.Name(id=self.ties_name(m), ctx=ast.Store())], value=_num(0.0)), s)]
        out = [tie_update(self.ties_name(m), m, e, op, _num(1.0), _num(1.0))]
        if m in names:
            de = self.d(e, names) or _num(0.0)
            out.insert(0, tie_update(self.dot_name(m), m, e, op, de, de))
        return [self._loc(x, s) for x in out]

    def _loc(self, new, s):
        for n in ast.walk(new):
            ast.copy_location(n, s)
        return new

    def assign(self, tgt, value, s, names):
        if isinstance(tgt, ast.Tuple):
            if self.is_active(value, names) or any(isinstance(t, ast.Name) and t.id in names for t in tgt.elts):
                raise self.error(s, "a tuple assignment of an active value in a step to differentiate",
                                 "assign each value on its own line")
            return []
        dv = self.d(value, names)
        if isinstance(tgt, ast.Name):
            if tgt.id not in names:
                return []
            dt = ast.Name(id=self.dot_name(tgt.id), ctx=ast.Store())
        elif isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name):
            if tgt.value.id not in names:
                return []
            dt = ast.Subscript(value=ast.Name(id=self.dot_name(tgt.value.id), ctx=ast.Load()),
                               slice=copy.deepcopy(tgt.slice), ctx=ast.Store())
        else:
            raise self.error(s, "an assignment target the tangent step cannot follow")
        return [self._loc(ast.Assign(targets=[dt], value=dv or _num(0.0)), s)]

    def aug_assign(self, s, names):
        tgt = s.target
        active_tgt = (isinstance(tgt, ast.Name) and tgt.id in names) or (
            isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name) and tgt.value.id in names)
        if not active_tgt:
            if self.is_active(s.value, names):
                raise self.error(s, "an active value added into an inactive (integer) variable")
            return []
        if isinstance(s.op, (ast.Add, ast.Sub)) and isinstance(tgt, ast.Name):
            # x += e  gets  x_dot += de: an accumulation stays one (a warp-split loop's
            # accumulator keeps its tangent's accumulation splittable too)
            de = self.d(s.value, names)
            if de is None:
                return []
            new = ast.AugAssign(target=ast.Name(id=self.dot_name(tgt.id), ctx=ast.Store()), op=type(s.op)(),
                                value=de)
            return [self._loc(new, s)]
        load = copy.deepcopy(tgt)
        for n in ast.walk(load):
            if hasattr(n, "ctx"):
                n.ctx = ast.Load()
        # x op= e  is  x = x op e: the same rule, on the value before the update
        value = ast.BinOp(left=load, op=s.op, right=copy.deepcopy(s.value))
        return self.assign(tgt, value, s, names)

    def atomic(self, call, attr, s, names):
        if attr != "add":
            if len(call.args) >= 3 and self.is_active(call.args[2], names):
                raise self.error(s, f"no derivative rule for lk.atomic.{attr} yet")
            return []
        a = call.args[0]
        if not (isinstance(a, ast.Name) and a.id in names):
            return []
        dv = self.d(call.args[2], names) if len(call.args) >= 3 else None
        if dv is None:
            return []
        new = ast.Expr(value=ast.Call(func=copy.deepcopy(call.func),
                                      args=[ast.Name(id=self.dot_name(a.id), ctx=ast.Load()),
                                            copy.deepcopy(call.args[1]), dv], keywords=[]))
        return [self._loc(new, s)]


def running_extrema(tg, body) -> dict:
    """The locals the step reduces with ``lk.max``/``lk.min`` in a top-level statement,
    mapped to ("max"|"min", None if each is a running extremum, else the node that makes it
    not one). A running extremum is set at the top level and updated inside loops only as
    ``m = max(m, e)`` (or ``max(e, m)``; ``min`` for ``lk.min``): its derivative is the mean
    of the tangents of the values equal to the result (each thread counts its ties), as
    JAX's ``max``/``min`` reductions define it; the starting value is not one of them."""
    found = {}
    for s in body:
        # (a returned condition's reductions have no derivative: not looked at)
        if isinstance(s, (ast.For, ast.While, ast.Return)):
            continue
        for n in ast.walk(s):
            if isinstance(n, ast.Call) and len(n.args) == 1 and isinstance(n.args[0], ast.Name):
                mod, attr = tg.module_of(n.func)
                if mod == "lk" and attr in ("max", "min"):
                    found.setdefault(n.args[0].id, (attr, None))
    for s in body:
        inner = isinstance(s, (ast.For, ast.While, ast.If))
        for n in ast.walk(s) if inner else []:
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                tgts = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in tgts:
                    for x in ast.walk(t):
                        if isinstance(x, ast.Name) and x.id in found and found[x.id][1] is None:
                            op = found[x.id][0]
                            if not (isinstance(n, ast.Assign) and running_update(n, x.id, op) is not None):
                                found[x.id] = (op, n)
    return found


def running_update(s, name, op):
    """``e`` of a statement ``name = op(name, e)`` or ``name = op(e, name)`` (builtin max or
    min), else None."""
    v = s.value if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) \
        and s.targets[0].id == name else None
    if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == op and len(v.args) == 2
            and not v.keywords):
        return None
    a, b = v.args
    if isinstance(a, ast.Name) and a.id == name and not _reads(b, name):
        return b
    if isinstance(b, ast.Name) and b.id == name and not _reads(a, name):
        return a
    return None


def tie_update(target, m, e, op, start, add):
    """``target = start if e beats m else (target + add if e == m else target)``, where ``e``
    beats ``m`` when larger (op "max") or smaller ("min"): a thread's bookkeeping of its
    values equal to a running max/min (their count, the sum of their tangents), placed before
    ``m = op(m, e)``."""
    cur = ast.Name(id=target, ctx=ast.Load())
    beats = ast.Compare(left=copy.deepcopy(e), ops=[ast.Gt() if op == "max" else ast.Lt()],
                        comparators=[ast.Name(id=m, ctx=ast.Load())])
    tie = ast.Compare(left=copy.deepcopy(e), ops=[ast.Eq()], comparators=[ast.Name(id=m, ctx=ast.Load())])
    return ast.Assign(targets=[ast.Name(id=target, ctx=ast.Store())], value=ast.IfExp(
        test=beats, body=copy.deepcopy(start), orelse=ast.IfExp(test=tie, body=_add(cur, add), orelse=copy.deepcopy(cur))))


def _reads(e, name) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(e))


def check_active(tree, active):
    """ValueError unless every name in ``active`` is a parameter of the step after ``t``."""
    unknown = set(active) - {a.arg for a in tree.args.args[1:]}
    if unknown:
        raise ValueError(f"not parameters of the step (after t): {sorted(unknown)}")


def generated_step(parsed, name, args, body):
    """A ParsedFunction for a generated step ``name(args)`` with ``body``, placed at the
    user's step (its nodes keep the user's lines)."""
    tree = parsed.tree
    fdef = ast.FunctionDef(name=name, args=ast.arguments(
        posonlyargs=[], args=args, vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=body or [ast.Pass()], decorator_list=[], returns=None, type_params=[])
    ast.copy_location(fdef, tree)
    ast.fix_missing_locations(fdef)
    return dataclasses.replace(parsed, tree=fdef, name=fdef.name)


def tangent_function(parsed, active) -> tuple:
    """(the tangent step as a ParsedFunction, the names of its parameters' tangents in order)
    for the step ``parsed`` differentiated with respect to the parameters named in ``active``
    (see the module docstring)."""
    check_active(parsed.tree, active)
    # the draws keep their sites in the step wherever the tangent statements copy them; a
    # draw is a fixed function of (seed, t, key, subkey, site): no tangent
    parsed = inline_helpers(tag_random_sites(parsed))
    tree = parsed.tree
    params = [a.arg for a in tree.args.args]
    tg = _Tangent(parsed, set(active))
    tg.extrema = running_extrema(tg, tree.body)
    names = tg.active_names(tree.body)
    check_differentiated_stores(tg, tree.body, names)
    body = tg.body(copy.deepcopy(tree.body), names)
    new_args = []
    for a in tree.args.args:
        new_args.append(copy.deepcopy(a))
        if a.arg in active:
            new_args.append(ast.arg(arg=tg.dot_name(a.arg), annotation=None))
    # every active local's tangent starts at zero at the top of the step: a name first assigned
    # inside a branch is then defined on every path
    locals_ = sorted(n for n in names if n not in set(params))
    init = [ast.Assign(targets=[ast.Name(id=tg.dot_name(n), ctx=ast.Store())], value=_num(0.0)) for n in locals_
            if _assigned_in_branch(tree.body, n)]
    for s in init:
        ast.copy_location(s, tree.body[0])
        for n in ast.walk(s):
            ast.copy_location(n, tree.body[0])
    out = generated_step(parsed, f"{tree.name}_jvp", new_args, init + body)
    return out, {a: tg.dot_name(a) for a in params if a in active}


def check_differentiated_stores(tg, body, names):
    """StepSyntaxError at the first store of a value that depends on a differentiated input
    (``names``: ``tg.active_names(body)``) into an array that is not differentiated: the
    dependence would be dropped there, for the tangent and the adjoint alike (a swap pair's
    second array, an intermediate field read later)."""
    for n in ast.walk(ast.Module(body=list(body), type_ignores=[])):
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id not in names \
                        and tg.is_active(n.value, names):
                    raise tg.error(n, f"a value that depends on a differentiated input is stored into "
                                      f"'{t.value.id}', which is not differentiated",
                                   f"differentiate '{t.value.id}' too (name it in tangent(...) / adjoint(...)), "
                                   f"or store int(...) of the value into an integer array")


def _assigned_in_branch(body, name) -> bool:
    """Whether ``name`` is assigned inside an if, loop or conditional block of ``body``."""
    for s in body:
        if isinstance(s, (ast.If, ast.For, ast.While)):
            for n in ast.walk(s):
                if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store):
                    return True
    return False
