"""Validate a step function against the restricted-Python rules and normalize it.

Two passes over each function:

1. :class:`_Normalizer` walks a copy of the AST with an allow-list. It resolves every free
   name (the in-step API, ``math``, NumPy casts, helper functions, global numbers), rewrites
   them into the normalized form described in :mod:`loopkern.spec`, and records a
   :class:`~loopkern.errors.Diagnostic` for everything that is not allowed.
2. :class:`_Uniformity` tracks which local values can differ between threads. In the step it
   rejects barriers, reductions and ``return`` under control flow that depends on them, since
   some threads would wait at a barrier the others never reach. In the step and in each helper
   it rejects parallel loops (and calls of helpers that run one) that not every thread runs
   the same number of times (nested in another parallel loop, or under thread-varying control
   flow), where some indices would never be visited; and read-modify-writes of array elements
   that several threads could make to one element at once (``lk.atomic`` is the way to make
   those).

Assigning to a parameter of the step is rejected (the value would be lost when the step ends);
a helper may assign to its own parameters, which are its locals, as in Python.

All problems of a function (and its helpers) are reported together in one
:class:`~loopkern.errors.StepSyntaxError`.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import math
import os
import types
from typing import NamedTuple

import numpy as np

from . import dsl
from .disjoint import (disjoint, index_pieces, iteration_key, loop_bounds, loop_facts, loop_names, loop_pieces,
                       never_wraps, own_key, owned_variables, shape_symbol, stable_names)
from .errors import Diagnostic, StepSyntaxError
from .frontend import ParsedFunction, parse_helper, parse_step
from .index_bounds import is_nonneg_mark, mark_nonneg_indices
from .spec import (ANY, ARRAY, HELPER_PREFIX, INTRINSIC_PREFIX, RESERVED_PREFIX, SCALAR, FunctionSpec,
                   ParamSpec, StepSpec, binding_counts, flat_targets, index_offset, int_constant, is_helper_call,
                   marker_of)
from .warpsplit import find_warp_split

_BUILTINS = {"abs", "min", "max", "int", "float", "bool", "len", "range", "round"}
#: positional arguments each builtin takes in step code (min and max of one number, or of an
#: iterable, have no meaning here; int(x, base) and float() are not compiled)
#: (range() is only a loop's iterable, checked there)
_BUILTIN_ARITY = {"abs": (1, 1, "write abs(x)"), "min": (2, 1 << 30, "write min(a, b[, ...]) of numbers"),
                  "max": (2, 1 << 30, "write max(a, b[, ...]) of numbers"), "int": (1, 1, "write int(x)"),
                  "float": (1, 1, "write float(x) (0.0 for a zero)"), "bool": (1, 1, "write bool(x)"),
                  "len": (1, 1, "write len(a) of an array (its first dimension)"),
                  "round": (1, 2, "write round(x) or round(x, n)")}
_BUILTIN_CONSTS = {"True", "False", "None"}
_ARRAY_ATTRS = {"shape", "size", "ndim"}
_NUMPY_CASTS = {"float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                "uint32", "uint64", "bool_", "intp", "uintp"}
_NUMPY_CONSTS = {"pi": "pi", "e": "e", "inf": "inf", "nan": "nan"}
_MATH_CONSTS = {"pi", "e", "inf", "nan", "tau"}
_MATH_FUNCS = {
    "sqrt", "exp", "expm1", "log", "log1p", "log2", "log10", "pow", "sin", "cos", "tan", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "floor", "ceil",
    "trunc", "fabs", "fmod", "hypot", "copysign", "isnan", "isinf", "isfinite", "erf", "erfc",
    "gamma", "lgamma", "degrees", "radians", "ldexp", "remainder",
}
#: the math functions of two arguments (every other one takes one; math.log's base is not
#: compiled: log(x) / log(base))
_MATH_TWO_ARGS = {"atan2", "pow", "fmod", "hypot", "copysign", "ldexp", "remainder"}
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift,
           ast.RShift, ast.BitOr, ast.BitXor, ast.BitAnd)
_CMPOPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_BARRIERS = {"sync", "sum", "max", "min"}
_ATOMICS = {"atomic_add", "atomic_max", "atomic_min"}
_PARALLEL_LOOPS = ("range", "grid")
#: what to import for a module name step code commonly uses without importing it
_IMPORTS = {"math": "import math", "np": "import numpy as np", "numpy": "import numpy", "lk": "import loopkern as lk"}
#: NumPy functions whose scalar equivalent step code can call instead
_NUMPY_EQUIVALENTS = {
    **{f: f"math.{f}(x)" for f in ("sqrt", "exp", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan",
                                   "sinh", "cosh", "tanh", "floor", "ceil", "trunc", "fabs", "isnan", "isinf",
                                   "isfinite", "degrees", "radians")},
    **{f: f"math.{f}(x, y)" for f in ("fmod", "hypot", "copysign", "ldexp")},
    "arcsin": "math.asin(x)", "arccos": "math.acos(x)", "arctan": "math.atan(x)", "arctan2": "math.atan2(y, x)",
    "arcsinh": "math.asinh(x)", "arccosh": "math.acosh(x)", "arctanh": "math.atanh(x)",
    "deg2rad": "math.radians(x)", "rad2deg": "math.degrees(x)", "power": "x ** y", "square": "x * x",
    "abs": "abs(x)", "absolute": "abs(x)", "minimum": "min(x, y)", "maximum": "max(x, y)", "fmin": "min(x, y)",
    "fmax": "max(x, y)", "round": "round(x)", "around": "round(x)", "rint": "round(x)",
}
_REJECTED_STMTS = {
    ast.FunctionDef: ("nested functions are not supported in step code",
                      "define the helper at module level and call it"),
    ast.AsyncFunctionDef: ("async functions are not supported", "use a plain module-level function"),
    ast.ClassDef: ("classes are not supported in step code", "use arrays and scalar arguments"),
    ast.Try: ("exceptions are not supported in GPU code",
              "check the condition and write a flag into an output array instead"),
    ast.Raise: ("exceptions are not supported in GPU code",
                "check the condition and write a flag into an output array instead"),
    ast.Assert: ("assert is not supported in step code",
                 "check the condition and write a flag into an output array instead"),
    ast.With: ("'with' is not supported in step code", "remove the context manager"),
    ast.AsyncWith: ("'async with' is not supported in step code", "remove it"),
    ast.AsyncFor: ("'async for' is not supported in step code", "use a plain for loop"),
    ast.Import: ("imports are not allowed inside step code", "import at module level"),
    ast.ImportFrom: ("imports are not allowed inside step code", "import at module level"),
    ast.Global: ("'global' is not supported: step code cannot change Python state",
                 "pass an array argument and write into it"),
    ast.Nonlocal: ("'nonlocal' is not supported: step code cannot change Python state",
                   "pass an array argument and write into it"),
    ast.Delete: ("'del' is not supported in step code", "remove it"),
}
if hasattr(ast, "Match"):
    _REJECTED_STMTS[ast.Match] = ("'match' is not supported in step code", "use if/elif")
if hasattr(ast, "TryStar"):
    _REJECTED_STMTS[ast.TryStar] = _REJECTED_STMTS[ast.Try]

_REJECTED_EXPRS = {
    ast.List: ("lists are not supported in step code",
               "use an array argument, or separate scalar variables"),
    ast.ListComp: ("list comprehensions are not supported in step code", "use a for loop over an array"),
    ast.Dict: ("dicts are not supported in step code", "use arrays and scalar arguments"),
    ast.DictComp: ("dict comprehensions are not supported in step code", "use a for loop"),
    ast.Set: ("sets are not supported in step code", "use arrays and scalar arguments"),
    ast.SetComp: ("set comprehensions are not supported in step code", "use a for loop"),
    ast.GeneratorExp: ("generator expressions are not supported in step code", "use a for loop"),
    ast.Lambda: ("lambda is not supported in step code",
                 "define a plain helper function at module level and call it"),
    ast.JoinedStr: ("strings are not supported in step code", "remove it; step code cannot format text"),
    ast.NamedExpr: ("the walrus operator ':=' is not supported", "use a separate assignment"),
    ast.Starred: ("'*' unpacking is not supported in step code", "pass the arguments one by one"),
    ast.Yield: ("generators are not supported in step code", "return a condition, or write to arrays"),
    ast.YieldFrom: ("generators are not supported in step code", "write results to arrays"),
    ast.Await: ("await is not supported in step code", "remove it"),
    ast.Slice: ("slices are not supported in step code: they make array views or copies",
                "index one element at a time inside an lk.range/lk.grid loop"),
}


class _Context:
    """State shared while validating one step and all helpers it reaches."""

    def __init__(self, step_name: str):
        self.step_name = step_name
        self.diagnostics: list[Diagnostic] = []
        self.helpers: dict[int, FunctionSpec] = {}     # id(fn) -> spec, in completion order
        self.in_progress: dict[int, str] = {}          # id(fn) -> name, for recursion
        self.symbols: set[str] = set()

    def symbol_for(self, name: str) -> str:
        base = f"{HELPER_PREFIX}{name}"
        sym, k = base, 1
        while sym in self.symbols:
            sym, k = f"{base}_{k}", k + 1
        self.symbols.add(sym)
        return sym


def _marker(name: str, node: ast.AST) -> ast.Name:
    return ast.copy_location(ast.Name(id=INTRINSIC_PREFIX + name, ctx=ast.Load()), node)


def _module_attr(module: str, attr: str, node: ast.AST) -> ast.Attribute:
    base = ast.copy_location(ast.Name(id=f"{RESERVED_PREFIX}{module}", ctx=ast.Load()), node)
    return ast.copy_location(ast.Attribute(value=base, attr=attr, ctx=ast.Load()), node)


def _constant_node(value, node: ast.AST):
    """An AST that evaluates to ``value`` (a Python or NumPy number), or None."""
    if isinstance(value, (bool, np.bool_)):
        return ast.copy_location(ast.Constant(bool(value)), node)
    if isinstance(value, np.generic) and isinstance(value, (np.integer, np.floating)):
        if type(value).__name__ not in _NUMPY_CASTS:       # float16, longdouble: no GPU type
            return None
        inner = _constant_node(value.item(), node)
        return ast.copy_location(ast.Call(func=_module_attr("np", type(value).__name__, node),
                                          args=[inner], keywords=[]), node)
    if isinstance(value, int):
        return ast.copy_location(ast.Constant(value), node)
    if isinstance(value, float):
        if math.isnan(value):
            return _module_attr("math", "nan", node)
        if math.isinf(value):
            inf = _module_attr("math", "inf", node)
            return inf if value > 0 else ast.copy_location(ast.UnaryOp(op=ast.USub(), operand=inf), node)
        return ast.copy_location(ast.Constant(value), node)
    return None


_INT_FOLD_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                 ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b, ast.Pow: lambda a, b: a ** b,
                 ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
                 ast.BitAnd: lambda a, b: a & b, ast.BitOr: lambda a, b: a | b, ast.BitXor: lambda a, b: a ^ b}
_INT_FOLD_UNARY = {ast.USub: lambda a: -a, ast.UAdd: lambda a: a, ast.Invert: lambda a: ~a}


def _integer_constants(node) -> bool:
    """``node`` is integer constants combined by integer operators (what Numba folds in int64)."""
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.BinOp):
        return type(node.op) in _INT_FOLD_OPS and _integer_constants(node.left) and _integer_constants(node.right)
    if isinstance(node, ast.UnaryOp):
        return type(node.op) in _INT_FOLD_UNARY and _integer_constants(node.operand)
    return False


def _wrap64(v: int) -> int:
    return (v + 2 ** 63) % 2 ** 64 - 2 ** 63


def _fold_integer(node):
    """(Python's value of an integer constant expression, None if it is huge; the value 64-bit
    wraparound arithmetic gives, None if that fails), equal when Python itself would raise (a
    zero divisor, a negative count, a negative power), which is left to the compiler."""
    def fold(n, wrap):
        if isinstance(n, ast.Constant):
            return _wrap64(n.value) if wrap else n.value
        if isinstance(n, ast.UnaryOp):
            v = _INT_FOLD_UNARY[type(n.op)](fold(n.operand, wrap))
        else:
            a, b = fold(n.left, wrap), fold(n.right, wrap)
            if isinstance(n.op, ast.Pow) and b > 0 and abs(a) > 1 and b * abs(a).bit_length() > 4096:
                raise OverflowError
            if isinstance(n.op, ast.LShift) and b > 4096:
                raise OverflowError
            v = _INT_FOLD_OPS[type(n.op)](a, b)
            if not isinstance(v, int):
                raise ArithmeticError       # a negative power: a float in Python
        return _wrap64(v) if wrap else v
    try:
        exact = fold(node, False)
    except OverflowError:
        exact = None
    except (ArithmeticError, ValueError):
        return 0, 0
    try:
        return exact, fold(node, True)
    except (ArithmeticError, ValueError):
        return exact, None


def _assigned_names(fn: ast.FunctionDef) -> set[str]:
    names = {a.arg for a in fn.args.args + fn.args.posonlyargs + fn.args.kwonlyargs}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _defined_later(filename, name) -> bool:
    """Whether module ``filename`` defines ``name`` at its top level (a function, class or
    assignment), read from its source."""
    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return False
    for st in tree.body:
        if isinstance(st, (ast.FunctionDef, ast.ClassDef)) and st.name == name:
            return True
        if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in st.targets):
            return True
    return False


def _floaty(e, float_locals) -> bool:
    """Whether ``e`` is a float by its syntax alone: a float literal, a true division, a call
    of ``float`` or of a ``math`` function (other than ``floor``/``ceil``/``trunc``), or
    arithmetic on such a value or on a local assigned one. Loads, shapes, arguments and
    ``int(...)`` are not (their types are not known here)."""
    if isinstance(e, ast.Constant):
        return isinstance(e.value, float)
    if isinstance(e, ast.Name):
        return e.id in float_locals
    if isinstance(e, ast.BinOp):
        return isinstance(e.op, ast.Div) or _floaty(e.left, float_locals) or _floaty(e.right, float_locals)
    if isinstance(e, ast.UnaryOp):
        return _floaty(e.operand, float_locals)
    if isinstance(e, ast.IfExp):
        return _floaty(e.body, float_locals) or _floaty(e.orelse, float_locals)
    if isinstance(e, ast.Call):
        f = e.func
        if isinstance(f, ast.Name):
            return f.id == "float" or (f.id in ("min", "max", "abs") and any(_floaty(a, float_locals)
                                                                             for a in e.args))
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math":
            return f.attr not in ("floor", "ceil", "trunc", "isnan", "isinf", "isfinite", "comb", "perm",
                                  "factorial", "gcd", "lcm", "isqrt")
    return False


class _Normalizer(ast.NodeTransformer):
    """Allow-list check and rewrite of one function body (see module docstring)."""

    def __init__(self, ctx: _Context, parsed: ParsedFunction, is_step: bool):
        self.ctx = ctx
        self.parsed = parsed
        self.is_step = is_step
        self.where = "" if is_step else f"in helper '{parsed.name}'"
        self.locals = _assigned_names(parsed.tree)
        self.params = [a.arg for a in parsed.tree.args.args]
        self.array_uses: dict[str, ast.AST] = {}
        self.arity: dict[str, tuple[int, int]] = {}   # param -> (most indices used, line)
        self.fewest: dict[str, tuple[int, int]] = {}  # param -> (fewest indices used, line)
        self.shape_dims: dict[str, tuple[int, int]] = {}  # param -> (k + 1 of the largest a.shape[k], line)
        self.grid_tuples: dict[str, int] = {}         # an lk.grid's single target name -> its dimensions
        self.float_locals: set[str] = set()            # locals assigned a float expression (see _floaty)
        self.written: set[str] = set()
        self.atomic: set[str] = set()                 # params updated with lk.atomic.*
        self.param_stores: list[ast.Name] = []        # the step's parameters assigned to
        self.rng_sites = 0
        self.site_at: dict = {}                       # (line, col) of each lk.random draw -> its site
        self.scalar_uses: dict[str, ast.AST] = {}
        self.integer_uses: dict[str, ast.AST] = {}    # names in loop bounds and lk.random keys
        self.index_uses: dict[str, ast.AST] = {}      # names in array indices
        self.thread_varying = False

    def _integer_use(self, e, into=None):
        """Record the names whose value ``e`` (a loop bound, an lk.random key; with ``into``
        ``self.index_uses``, an array index) takes as it is: a float passed for such a
        parameter is refused at the call (``ParamSpec.integer_line``, ``index_line``). A name
        under a call other than min/max/abs (``int(m)``) or inside a subscript does not count."""
        into = self.integer_uses if into is None else into
        if isinstance(e, ast.Name):
            into.setdefault(e.id, e)
        elif isinstance(e, ast.BinOp):
            self._integer_use(e.left, into)
            self._integer_use(e.right, into)
        elif isinstance(e, ast.UnaryOp):
            self._integer_use(e.operand, into)
        elif isinstance(e, ast.IfExp):
            self._integer_use(e.body, into)
            self._integer_use(e.orelse, into)
        elif isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id in ("min", "max", "abs"):
            for a in e.args:
                self._integer_use(a, into)

    # -- reporting -------------------------------------------------------------------------
    def error(self, node, message, hint=""):
        self.ctx.diagnostics.append(self.parsed.diagnostic(node, self.ctx.step_name, message, hint, self.where))

    def reject(self, node, message, hint=""):
        self.error(node, message, hint)
        return ast.copy_location(ast.Constant(0), node) if isinstance(node, ast.expr) else None

    # -- statements ------------------------------------------------------------------------
    def visit_body(self, stmts):
        out = []
        for i, s in enumerate(stmts):
            if (i == 0 and isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                    and isinstance(s.value.value, str)):
                continue  # docstring
            r = self.visit(s)
            if r is None:
                continue
            out.extend(r if isinstance(r, list) else [r])
        return out or [ast.copy_location(ast.Pass(), stmts[0]) if stmts else ast.Pass()]

    def generic_visit(self, node):
        for cls, (msg, hint) in list(_REJECTED_STMTS.items()) + list(_REJECTED_EXPRS.items()):
            if isinstance(node, cls):
                return self.reject(node, msg, hint)
        if isinstance(node, ast.stmt):
            return self.reject(node, f"'{type(node).__name__}' statements are not supported in step code",
                               "use assignments, if/for/while, and calls of lk.*, math.* or helper functions")
        if isinstance(node, ast.expr):
            return self.reject(node, f"'{type(node).__name__}' expressions are not supported in step code",
                               "use arithmetic on numbers and array elements")
        return super().generic_visit(node)

    def visit_Pass(self, node):
        return node

    def visit_Break(self, node):
        return node

    def visit_Continue(self, node):
        return node

    def visit_Expr(self, node):
        v = node.value
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            return None  # a bare string is a comment
        if isinstance(v, (ast.Yield, ast.YieldFrom, ast.Await)):
            self.error(node, "generators and coroutines are not supported in step code",
                       "write the step as a plain function; loop with for/while inside it")
            return None
        if not isinstance(v, ast.Call):
            self.error(node, "an expression statement has no effect in step code", "assign it or remove it")
            return None
        node.value = self.visit(v)
        return node

    def _check_store(self, target):
        if isinstance(target, ast.Name):
            self._check_name_allowed(target)
            if self.is_step and target.id in self.params:
                # reported by validate_step, which knows whether it is an array, a number or 't'.
                # A helper's parameters are its own locals (as in Python), so it may reassign them.
                self.param_stores.append(target)
            return target
        if isinstance(target, ast.Tuple):
            target.elts = [self._check_store(e) for e in target.elts]
            return target
        if isinstance(target, ast.Subscript):
            if not isinstance(target.value, ast.Name):
                return self.reject(target, "only a named array can be assigned into",
                                   "write 'a[i] = ...' where 'a' is an array argument")
            if target.value.id not in self.locals:
                return self.reject(target, f"'{target.value.id}' is not {'an argument of the step' if self.is_step else 'a parameter of the helper'}: "
                                           f"step code writes only the arrays passed to it",
                                   f"pass '{target.value.id}' as an argument")
            self._use_array(target.value)
            self._indexed(target.value.id, target.slice, target)
            if target.value.id in self.params:
                self.written.add(target.value.id)
            target.slice = self._index(target.slice)
            return target
        if isinstance(target, ast.Attribute):
            return self.reject(target, "attributes cannot be assigned in step code", "assign array elements instead")
        return self.reject(target, "this cannot be assigned to in step code", "assign to a name or an array element")

    def visit_Assign(self, node):
        if _floaty(node.value, self.float_locals):
            self.float_locals.update(t.id for t in node.targets if isinstance(t, ast.Name))
        node.targets = [self._check_store(t) for t in node.targets]
        node.value = self.visit(node.value)
        return node

    def visit_AugAssign(self, node):
        node.target = self._check_store(node.target)
        if isinstance(node.target, ast.Name) and (isinstance(node.op, ast.Div)
                                                   or _floaty(node.value, self.float_locals)):
            self.float_locals.add(node.target.id)      # n += 0.5, n /= 2: a float from here on
        if isinstance(node.op, ast.MatMult):
            self.error(node, "'@=' is not supported in step code", "write the matrix product as loops")
        node.value = self.visit(node.value)
        return node

    def visit_AnnAssign(self, node):
        if node.value is None:
            return None
        new = ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)
        return self.visit_Assign(new)

    def visit_If(self, node):
        node.test = self.visit(node.test)
        node.body = self.visit_body(node.body)
        node.orelse = self.visit_body(node.orelse) if node.orelse else []
        return node

    def visit_While(self, node):
        if node.orelse:
            self.error(node.orelse[0], "'while ... else' is not supported in step code", "use a flag variable")
        node.test = self.visit(node.test)
        node.body = self.visit_body(node.body)
        node.orelse = []
        return node

    def visit_For(self, node):
        if node.orelse:
            self.error(node.orelse[0], "'for ... else' is not supported in step code", "use a flag variable")
            node.orelse = []
        it = node.iter
        kind = self._loop_kind(it)
        if kind is None and isinstance(it, ast.Call) and self._shadows_module(it.func):
            node.body = self.visit_body(node.body)
            return node
        if kind is None:
            self.error(it, "a for loop in step code must iterate over range(...), lk.range(...) or lk.grid(...)",
                       "loop over indices and index the array inside the loop")
            node.body = self.visit_body(node.body)
            return node
        n_args = len(it.args)
        if it.keywords:
            self.error(it, f"{kind}() takes no keyword arguments", "pass start, stop, step positionally")
        if kind in ("range", "lk.range") and not 1 <= n_args <= 3:
            self.error(it, f"{kind}() takes 1 to 3 arguments; got {n_args}", "write range(stop) or range(start, stop[, step])")
        if kind in ("range", "lk.range") and n_args == 3:
            st = it.args[2]
            if isinstance(st, ast.UnaryOp) and isinstance(st.op, (ast.USub, ast.UAdd)):
                st = st.operand
            if isinstance(st, ast.Constant) and not isinstance(st.value, bool) and st.value == 0:
                self.error(it.args[2], f"{kind}() step must not be zero", "use a positive or negative step")
        bounds = [] if kind not in ("range", "lk.range", "lk.grid") else [
            e for a in it.args for e in (a.elts if isinstance(a, ast.Tuple) else [a])]
        for a in bounds:
            self._integer_use(a)
            if _floaty(a, self.float_locals):
                self.error(a, f"{kind}() takes integers; '{ast.unparse(a)}' is a float (Python's range() "
                              f"raises; a GPU loop would run to the next integer above it)",
                           "use an int: '//' instead of '/', or int(...)")
        if kind == "lk.grid":
            if isinstance(node.target, ast.Name) and n_args > 1:
                self.grid_tuples[node.target.id] = n_args      # one name for the index tuple
            if n_args == 0:
                self.error(it, "lk.grid() needs at least one dimension", "write lk.grid(n) or lk.grid(n, (1, m - 1))")
            for a in it.args:
                if isinstance(a, ast.Tuple) and len(a.elts) != 2:
                    self.error(a, "each lk.grid() dimension is 'stop' or '(start, stop)'", "write e.g. lk.grid((1, n - 1), m)")
            tgt = node.target
            if isinstance(tgt, ast.Tuple) and len(tgt.elts) != n_args:
                self.error(tgt, f"lk.grid() over {n_args} dimension(s) yields {n_args} indices; "
                                f"the loop unpacks {len(tgt.elts)}", "unpack one name per dimension, or use a single name")
        if kind != "lk.grid" and not isinstance(node.target, ast.Name):
            self.error(node.target, f"the loop variable of {kind}() must be a single name", "write 'for i in ...'")
        if isinstance(node.target, ast.Tuple) and not all(isinstance(e, ast.Name) for e in node.target.elts):
            self.error(node.target, "loop variables must be plain names", "write 'for i, j in lk.grid(n, m)'")
        node.target = self._check_store(node.target)
        if kind in ("lk.range", "lk.grid"):
            self.thread_varying = True
            node.iter = ast.copy_location(ast.Call(func=_marker(kind[3:], it), args=[
                self._grid_dim(a) if kind == "lk.grid" else self._scalar(a) for a in it.args], keywords=[]), it)
            for s in ast.walk(ast.Module(body=node.body, type_ignores=[])):
                if isinstance(s, ast.Break) and not self._inside_inner_loop(node, s):
                    self.error(s, f"'break' out of a {kind}() loop is not supported: which indices run "
                                  f"would depend on the number of threads",
                               "use 'continue' to skip an index, or loop over range() instead")
        else:
            node.iter = ast.copy_location(ast.Call(func=ast.Name(id="range", ctx=ast.Load()),
                                                   args=[self._scalar(a) for a in it.args], keywords=[]), it)
        node.body = self.visit_body(node.body)
        return node

    @staticmethod
    def _inside_inner_loop(outer, target):
        for inner in ast.walk(ast.Module(body=outer.body, type_ignores=[])):
            if isinstance(inner, (ast.For, ast.While)) and inner is not outer:
                if any(n is target for n in ast.walk(inner)):
                    return True
        return False

    def _grid_dim(self, a):
        if isinstance(a, ast.Tuple):
            a.elts = [self._scalar(e) for e in a.elts]
            return a
        return self._scalar(a)

    def _loop_kind(self, it):
        if not isinstance(it, ast.Call):
            return None
        target = self._resolve_callee(it.func)
        if target is dsl.range:
            return "lk.range"
        if target is dsl.grid:
            return "lk.grid"
        if target is builtins.range:
            return "range"
        return None

    def visit_Return(self, node):
        if node.value is not None:
            # a step returns its loop condition, a number: `return u` is an array used as one
            node.value = self._scalar(node.value) if self.is_step else self.visit(node.value)
        return node

    # -- expressions -----------------------------------------------------------------------
    def _scalar(self, e):
        e = self.visit(e)
        if isinstance(e, ast.Name) and e.id in self.params:
            self.scalar_uses.setdefault(e.id, e)
        return e

    def visit_BinOp(self, node):
        if not isinstance(node.op, _BINOPS):
            return self.reject(node, f"operator '{type(node.op).__name__}' is not supported in step code",
                               "write it with loops over array elements")
        node.left, node.right = self._scalar(node.left), self._scalar(node.right)
        return node

    def visit_UnaryOp(self, node):
        node.operand = self._scalar(node.operand)
        return node

    def visit_BoolOp(self, node):
        node.values = [self._scalar(v) for v in node.values]
        return node

    def visit_Compare(self, node):
        for op in node.ops:
            if not isinstance(op, _CMPOPS):
                sym = {ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}.get(type(op), "?")
                self.error(node, f"the '{sym}' comparison is not supported in step code",
                           "compare numbers with ==, !=, <, <=, >, >=")
        node.left = self._scalar(node.left)
        node.comparators = [self._scalar(c) for c in node.comparators]
        return node

    def visit_IfExp(self, node):
        node.test, node.body, node.orelse = self._scalar(node.test), self.visit(node.body), self.visit(node.orelse)
        return node

    def visit_Constant(self, node):
        if isinstance(node.value, (bool, int, float)):
            return node
        if node.value is None:
            return self.reject(node, "None is not a value in step code", "use a number")
        if isinstance(node.value, complex):
            return self.reject(node, "complex numbers are not supported in step code",
                               "keep real and imaginary parts in separate variables")
        return self.reject(node, f"{type(node.value).__name__} constants are not supported in step code",
                           "step code works on numbers and arrays only; it cannot print or format text")

    def visit_Tuple(self, node):
        node.elts = [self.visit(e) for e in node.elts]
        return node

    def _check_name_allowed(self, node):
        if node.id.startswith(RESERVED_PREFIX) or node.id.startswith(INTRINSIC_PREFIX):
            self.error(node, f"names starting with '{RESERVED_PREFIX}' are reserved for generated code",
                       "rename the variable")

    def visit_Name(self, node):
        if node.id in self.locals or node.id in _BUILTIN_CONSTS:
            if node.id == "None":
                return self.reject(node, "None is not a value in step code", "use a number")
            return node
        found, value = self.parsed.lookup(node.id)
        if not found:
            return self.reject(node, f"name '{node.id}' is not defined",
                               self._define_hint(node.id, "it", "define it before the step, or pass it as an argument"))
        const = _constant_node(value, node)
        if const is not None:
            return const
        what = self._describe(value)
        if isinstance(value, np.generic):
            return self.reject(node, f"'{node.id}' is a numpy.{type(value).__name__} number; step code has no "
                                     f"{type(value).__name__} type", "convert it before the step, e.g. "
                                     f"{node.id} = np.float32({node.id}) or np.float64({node.id})")
        hint = "pass it as an argument of the step instead"
        if isinstance(value, (list, dict, set, tuple, np.ndarray)) or hasattr(value, "__dict__"):
            return self.reject(node, f"'{node.id}' is {what} from the enclosing Python scope; closures over "
                                     f"Python objects are not supported", hint)
        return self.reject(node, f"'{node.id}' ({what}) cannot be used as a value in step code", hint)

    @staticmethod
    def _describe(value):
        if isinstance(value, types.ModuleType):
            return f"the module '{value.__name__}'"
        return f"a {type(value).__name__}"

    def _resolve_path(self, node):
        """Resolve ``a.b.c`` made of free names to a Python object; (ok, value)."""
        if isinstance(node, ast.Name):
            if node.id in self.locals:
                return False, None
            return self.parsed.lookup(node.id)
        if isinstance(node, ast.Attribute):
            ok, base = self._resolve_path(node.value)
            # modules, and namespaces of the in-step API such as lk.atomic
            if ok and isinstance(base, (types.ModuleType, dsl.Namespace)) and hasattr(base, node.attr):
                return True, getattr(base, node.attr)
        return False, None

    def _undefined_root(self, node):
        """The name ``a`` of ``a.b.c`` when it is neither a local nor defined where the function
        is (typically a module used without its import), else None."""
        while isinstance(node, ast.Attribute):
            node = node.value
        if isinstance(node, ast.Name) and node.id not in self.locals and not self.parsed.lookup(node.id)[0]:
            return node.id
        return None

    def _reject_undefined(self, node, root):
        where = "the step's module" if self.is_step else f"the module of helper '{self.parsed.name}'"
        fix = _IMPORTS.get(root)
        hint = (f"add `{fix}` at the top of {os.path.basename(self.parsed.filename)}" if fix else
                "import or define it at module level, or pass the value as an argument of the step")
        if not fix:
            hint = self._define_hint(root, "it", hint)
        return self.reject(node, f"name '{root}' is not defined in {where}", hint)

    def _define_hint(self, name, what, otherwise=None):
        """What to do about an undefined ``name``: its module defines it further down (the step
        is checked when the decorator runs, before that line), or ``otherwise``."""
        if _defined_later(self.parsed.filename, name):
            return (f"'{name}' is defined further down {os.path.basename(self.parsed.filename)}, after the step: "
                    f"the step is checked when @lk.megakernel runs, so define (or import) {what} above the step")
        return otherwise or f"define {what} at module level, above the step"

    def _resolve_callee(self, func):
        ok, value = self._resolve_path(func)
        return value if ok else None

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id in self.locals:
            if node.attr in _ARRAY_ATTRS:
                self._use_array(node.value)
                return node
            return self.reject(node, f"attribute '.{node.attr}' is not supported in step code",
                               "arrays support .shape, .size and .ndim")
        root = self._undefined_root(node)
        if root is not None:
            return self._reject_undefined(node, root)
        ok, base = self._resolve_path(node.value)
        if ok and base is math:
            if node.attr in _MATH_CONSTS:
                return _module_attr("math", node.attr, node)
            return self.reject(node, f"math.{node.attr} is not a value", "call it, e.g. math.sqrt(x)")
        if ok and base is np and node.attr in _NUMPY_CONSTS:
            return _module_attr("math", _NUMPY_CONSTS[node.attr], node)
        ok, value = self._resolve_path(node)
        if ok:
            const = _constant_node(value, node)
            if const is not None:
                return const
            return self.reject(node, f"'{ast.unparse(node)}' ({self._describe(value)}) cannot be used in step code",
                               "pass the value as an argument of the step")
        return self.reject(node, f"'{ast.unparse(node)}' cannot be used in step code",
                               "arrays support .shape, .size and .ndim; modules: math and numpy casts")

    def visit_Subscript(self, node):
        if isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            base, k = node.value.value, int_constant(node.slice)
            if isinstance(base, ast.Name) and base.id in self.params and k is not None and k >= 0 \
                    and k + 1 > self.shape_dims.get(base.id, (0, 0))[0]:
                # an array of fewer dimensions has no such extent: refused at the call
                self.shape_dims[base.id] = (k + 1, node.lineno)
            node.value = self.visit(node.value)
            node.slice = self._index(node.slice)
            return node
        if isinstance(node.value, (ast.List, ast.ListComp, ast.Tuple, ast.Dict, ast.Set, ast.Constant)):
            return self.reject(node, f"{type(node.value).__name__.lower().replace('comp', ' comprehension')}s "
                                     f"are not supported in step code", "index an array argument")
        if not isinstance(node.value, ast.Name) or node.value.id not in self.locals:
            return self.reject(node, "only arrays (arguments or local names) can be indexed in step code",
                               "pass the array as an argument of the step")
        self._use_array(node.value)
        self._indexed(node.value.id, node.slice, node)
        self.thread_varying = True
        node.slice = self._index(node.slice)
        return node

    def _indexed(self, name, idx, node, arity=None):
        if name in self.params:
            k = arity if arity is not None else (len(idx.elts) if isinstance(idx, ast.Tuple) else
                                                 self.grid_tuples.get(idx.id, 1) if isinstance(idx, ast.Name) else 1)
            if k > self.arity.get(name, (0, 0))[0]:
                self.arity[name] = (k, node.lineno)
            if k < self.fewest.get(name, (k + 1, 0))[0]:
                self.fewest[name] = (k, node.lineno)

    def _index(self, idx):
        for e in (idx.elts if isinstance(idx, ast.Tuple) else [idx]):
            self._integer_use(e, self.index_uses)
        if isinstance(idx, ast.Tuple):
            idx.elts = [self._scalar(e) for e in idx.elts]
            return idx
        return self._scalar(idx)

    def check_array_names(self):
        """Reject an assignment that gives an array parameter another name (``g = h``,
        ``src = a if t % 2 == 0 else b``, ``a, b = b, a``): which arrays a step writes, stages,
        keeps on chip or races on is worked out from the parameters' own names, so a store
        through the new name would go unseen (block and tile scope silently dropped it)."""
        subscripted = {n.value.id for n in ast.walk(self.parsed.tree)
                       if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)}

        def leaves(e):
            if isinstance(e, ast.Name):
                return [e.id]
            if isinstance(e, ast.IfExp):
                return leaves(e.body) + leaves(e.orelse)
            if isinstance(e, (ast.Tuple, ast.List)):
                return [x for el in e.elts for x in leaves(el)]
            return []
        for node in ast.walk(self.parsed.tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            # (a parameter assigned to is an error of its own)
            # (the names bound, not those indexed: `GA[0] = x` names no array 'GA')
            named = {t.id for t in flat_targets(targets) if isinstance(t, ast.Name)} - set(self.params)
            for leaf in leaves(value) if named else ():
                if leaf in self.params and (leaf in self.array_uses or named & subscripted):
                    self.error(node, f"array '{leaf}' cannot be given another name in step code: the step's "
                                     f"writes, staging and races are worked out from the arrays' own names, so a "
                                     f"store through another name would go unseen",
                               f"index '{leaf}' directly; for two arrays that exchange roles every step, pass "
                               f"swap=[('a', 'b')] to lk.megakernel")
                    break

    def check_integer_constants(self, body):
        """Reject an integer expression of constants (``2**64``, ``10**20 // 3``, a global
        holding such a number) whose value int64 arithmetic, which the kernel does, cannot give:
        Numba folds it with 64-bit wraparound (``a[i] + 2**64`` added 0, even to a float array).
        A literal from 2**63 to 2**64 - 1 on its own is a uint64 and stays allowed."""
        def walk(node):
            if isinstance(node, (ast.BinOp, ast.UnaryOp)) and _integer_constants(node):
                exact, wrapped = _fold_integer(node)
                if exact is None or exact != wrapped:
                    value = "too large to compute" if exact is None else f"{exact}"
                    numba = "not compute it" if wrapped is None else f"compute {wrapped}"
                    where = ("" if exact is None or not -2 ** 63 <= exact < 2 ** 63 else
                             "; the value fits, but a step of it does not, e.g. a product before a division")
                    self.error(node, f"this integer expression is {value}, which the kernel's int64 arithmetic "
                                     f"cannot represent (Numba would {numba}{where})",
                               "write it as a float (2.0 ** 64), or keep integer values within -2**63 .. 2**63 - 1; "
                               "for a bit pattern, write the number itself (0x8000000000000000 is a uint64)")
                return
            if isinstance(node, ast.Constant) and type(node.value) is int and not -2 ** 63 <= node.value < 2 ** 64:
                self.error(node, f"the integer {node.value} does not fit in 64 bits",
                           "write it as a float (1e20), or keep integer values within -2**63 .. 2**64 - 1")
                return
            for child in ast.iter_child_nodes(node):
                walk(child)
        for st in body:
            walk(st)

    def check_definite_assignment(self):
        """Reject a read of a local that some path reaches without assigning it (assigned only
        under an ``if``, or only inside a loop that may run no iteration, or read before its
        assignment in a loop body): Python raises UnboundLocalError there, while a compiled
        kernel would read whatever the variable last held (another element's value, on the CPU)."""
        local = _assigned_names(self.parsed.tree) - set(self.params)
        reported = set()
        parallel_index = {}        # name -> the lk.range/lk.grid loop (line) that last set it

        def reads(node, defined):
            for n in ast.walk(node):
                if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in local
                        and n.id not in defined and n.id not in reported):
                    reported.add(n.id)
                    if n.id in parallel_index:
                        self.error(n, f"'{n.id}' is read after the parallel loop at line {parallel_index[n.id]} "
                                      f"whose index it is: there it holds the last index this thread ran, which "
                                      f"depends on the number of threads", f"assign '{n.id}' again before reading it")
                        continue
                    self.error(n, f"local '{n.id}' may be read before it is assigned: some path reaches this "
                                  f"line without assigning it (Python would raise UnboundLocalError; a kernel "
                                  f"would read a leftover value)",
                               f"assign '{n.id}' on every path first, e.g. '{n.id} = 0.0' before the 'if' or "
                               f"the loop that assigns it")

        def stored(target):
            return {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

        def block(stmts, defined):
            # the names assigned on every path through 'stmts', or None if none falls through
            d = set(defined)
            for st in stmts:
                d = statement(st, d)
                if d is None:
                    return None
            return d

        def statement(st, d):
            if isinstance(st, (ast.Assign, ast.AnnAssign)):
                if st.value is not None:
                    reads(st.value, d)
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                for t in targets:
                    reads(t, d)             # the array and index of a store a[i] = ...
                return d | set().union(*(stored(t) for t in targets)) if st.value is not None else d
            if isinstance(st, ast.AugAssign):
                if isinstance(st.target, ast.Name) and st.target.id in local and st.target.id not in d:
                    reads(ast.Name(id=st.target.id, ctx=ast.Load(), lineno=st.lineno, col_offset=st.col_offset,
                                   end_lineno=st.target.end_lineno, end_col_offset=st.target.end_col_offset), d)
                reads(st.target, d)
                reads(st.value, d)
                return d | stored(st.target)
            if isinstance(st, ast.If):
                reads(st.test, d)
                a, b = block(st.body, d), block(st.orelse, d)
                if a is None or b is None:
                    return b if a is None else a
                return a & b
            if isinstance(st, (ast.For, ast.While)):
                reads(st.iter if isinstance(st, ast.For) else st.test, d)
                block(st.body, d | (stored(st.target) if isinstance(st, ast.For) else set()))
                # the body may run no iteration: what it assigns is not assigned after it
                after = block(st.orelse, d) if st.orelse else d
                after = d if after is None else after
                if isinstance(st, ast.For) and self._loop_kind(st.iter) in ("lk.range", "lk.grid"):
                    parallel_index.update((name, st.lineno) for name in stored(st.target))
                    after = after - stored(st.target)
                return after
            if isinstance(st, (ast.Return, ast.Break, ast.Continue)):
                if isinstance(st, ast.Return) and st.value is not None:
                    reads(st.value, d)
                return None
            reads(st, d)
            return d
        block(self.parsed.tree.body, set(self.params))

    def _use_array(self, name_node):
        if name_node.id in self.params:
            self.array_uses.setdefault(name_node.id, name_node)

    def _shadows_module(self, func) -> bool:
        """``func`` is ``lk.x``/``math.x``/``np.x`` where a parameter or local variable hides the
        module's name: report that (True) rather than a confusing error about the call."""
        base = func.value if isinstance(func, ast.Attribute) else None
        if not (isinstance(base, ast.Name) and base.id in self.locals and base.id in ("lk", "math", "np", "numpy")):
            return False
        what = "parameter" if base.id in self.params else "local variable"
        self.error(func, f"'{base.id}' is a {what} here, so '{ast.unparse(func)}' is not the module's",
                   f"rename the {what} '{base.id}'")
        return True

    def visit_Call(self, node):
        for kw in node.keywords:
            self.error(kw.value if kw.arg else node, "keyword arguments are not supported in step code"
                       if kw.arg else "'**' unpacking is not supported in step code", "pass arguments positionally")
        node.keywords = []
        if isinstance(node.func, ast.Name) and node.func.id in self.locals:
            return self.reject(node, f"'{node.func.id}' is a local variable, not a function",
                               "rename the variable or the function")
        if not isinstance(node.func, (ast.Name, ast.Attribute)):
            return self.reject(node, "only named functions can be called in step code", "call a module-level function")
        ok, target = self._resolve_path(node.func)
        label = ast.unparse(node.func)
        if not ok:
            root = self._undefined_root(node.func)
            if isinstance(node.func, ast.Attribute) and root is not None:
                return self._reject_undefined(node, root)
            base = node.func.value if isinstance(node.func, ast.Attribute) else None
            if self._shadows_module(node.func):
                return ast.copy_location(ast.Constant(0), node)
            if isinstance(base, ast.Name) and base.id not in self.locals:
                found, module = self.parsed.lookup(base.id)
                if found and isinstance(module, types.ModuleType):
                    return self.reject(node, f"the module '{module.__name__}' has no function '{node.func.attr}' that "
                                             f"step code can call", "see the README's list of what step code may call")
            if isinstance(node.func, ast.Attribute) and isinstance(base, ast.Attribute):
                ok_base, owner = self._resolve_path(base)
                if ok_base and isinstance(owner, dsl.Namespace):
                    # lk.atomic.sub: name what the namespace has
                    return self.reject(node, f"{owner.display} has no function '{node.func.attr}'",
                                       f"it has {', '.join(owner.display + '.' + n for n in dir(owner))}")
            if isinstance(node.func, ast.Attribute):
                return self.reject(node, f"method calls such as '{label}(...)' are not supported in step code",
                                   "use the allowed builtins, math.*, lk.* or a helper function")
            return self.reject(node, f"name '{label}' is not defined", self._define_hint(label, "the function"))
        if isinstance(target, dsl.Intrinsic):
            return self._intrinsic_call(node, target, label)
        if target is print:
            return self.reject(node, "print() is not supported in step code", "write values into an output array")
        if isinstance(target, types.BuiltinFunctionType) and getattr(target, "__module__", None) == "math" \
                or (getattr(target, "__self__", None) is math):
            if target.__name__ not in _MATH_FUNCS:
                return self.reject(node, f"math.{target.__name__} is not supported in step code",
                                   f"supported: {', '.join(sorted(_MATH_FUNCS))}")
            name, want = target.__name__, 2 if target.__name__ in _MATH_TWO_ARGS else 1
            hint = ("write math.log(x) / math.log(base)" if name == "log" and len(node.args) == 2 else
                    f"write math.{name}({'x, y' if want == 2 else 'x'})")
            if not self._arity_ok(node, want, want):
                return self._reject_arity(node, f"math.{name}", want, want, hint)
            node.func = _module_attr("math", target.__name__, node)
            node.args = [self._scalar(a) for a in node.args]
            return node
        if isinstance(target, type) and issubclass(target, np.generic):
            name = "bool_" if target is np.bool_ else target.__name__     # NumPy 2 names it 'bool'
            if name not in _NUMPY_CASTS:
                return self.reject(node, f"numpy.{name} is not supported in step code",
                                   f"use one of: {', '.join(sorted(_NUMPY_CASTS))}")
            if len(node.args) != 1:
                return self.reject(node, f"numpy.{name}() takes one argument in step code", f"write numpy.{name}(x)")
            node.func = _module_attr("np", name, node)
            node.args = [self._scalar(a) for a in node.args]
            return node
        if _is_numpy_function(target):
            name = getattr(target, "__name__", label.rsplit(".", 1)[-1])
            instead = _NUMPY_EQUIVALENTS.get(name)
            return self.reject(node, f"'{label}' is a NumPy function; NumPy functions are not supported in step "
                                     f"code (step code works on one number at a time)",
                               f"use {instead} instead" if instead else
                               "write it with a loop over elements; math.* has the scalar functions")
        if isinstance(node.func, ast.Name) and node.func.id in _BUILTINS and target is getattr(builtins, node.func.id):
            if target is builtins.range:
                return self.reject(node, "range() can only be the iterable of a for loop", "write 'for k in range(...):'")
            lo, hi, hint = _BUILTIN_ARITY[node.func.id]
            if not self._arity_ok(node, lo, hi):
                return self._reject_arity(node, node.func.id, lo, hi, hint)
            node.args = [self._scalar(a) if target is not len else self.visit(a) for a in node.args]
            if target is len and node.args and isinstance(node.args[0], ast.Name):
                self._use_array(node.args[0])
            return node
        if target is builtins.sum:
            return self.reject(node, "sum() cannot be called in step code (it takes a sequence, and step code "
                                     "works on one number at a time)",
                               "accumulate in a loop ('s = 0.0', then 'for k in range(n): s += a[k]'); "
                               "lk.sum(x) adds one value from every thread of a parallel step")
        if isinstance(target, types.BuiltinFunctionType) or isinstance(target, type):
            return self.reject(node, f"'{label}' ({self._describe(target)}) cannot be called in step code",
                               "allowed: arithmetic, math.*, abs/min/max/int/float/bool/len, NumPy casts, "
                               "lk.*, and plain helper functions")
        if isinstance(target, types.FunctionType):
            return self._helper_call(node, target, label)
        return self.reject(node, f"'{label}' ({self._describe(target)}) cannot be called in step code",
                           "call plain Python functions that are themselves valid step code")

    @staticmethod
    def _arity_ok(node, lo, hi) -> bool:
        """``lo`` to ``hi`` positional arguments, none starred, no keywords."""
        return lo <= len(node.args) <= hi and not node.keywords and not any(isinstance(a, ast.Starred)
                                                                           for a in node.args)

    def _reject_arity(self, node, name, lo, hi, hint):
        want = f"{lo}" if lo == hi else f"{lo} or {hi}" if hi == lo + 1 else f"{lo} or more"
        return self.reject(node, f"{name}() takes {want} positional argument{'s' if hi > 1 else ''} in step code, "
                                 f"got {len(node.args)}" + (" and keywords" if node.keywords else ""), hint)

    def _intrinsic_call(self, node, target, label):
        name = target.name
        if name in ("random_uniform", "random_normal"):
            return self._random_call(node, target)
        if name in _ATOMICS:
            return self._atomic_call(node, target)
        if name in ("range", "grid"):
            return self.reject(node, f"lk.{name}() can only be the iterable of a for loop",
                               f"write 'for i in lk.{name}(...):'")
        if not self.is_step and name in _BARRIERS:
            return self.reject(node, f"lk.{name}() can only be called in the step function itself, "
                                     f"not in a helper", "call it in the step and pass the result to the helper")
        expected = 1 if name in ("sum", "max", "min") else 0
        if len(node.args) != expected:
            return self.reject(node, f"lk.{name}() takes {expected} argument{'s' if expected != 1 else ''}, "
                                     f"got {len(node.args)}", f"write lk.{name}({'x' if expected else ''})")
        if name == "thread_id":
            self.thread_varying = True
        node.func = _marker(name, node)
        node.args = [self._scalar(a) for a in node.args]
        return node

    def _atomic_call(self, node, target):
        """``lk.atomic.add/max/min(array, index, value)``: the array is a parameter's name,
        counted as written and indexed like ``array[index]``. Not a barrier, so
        helpers may use it too."""
        disp = target.display
        if len(node.args) != 3:
            return self.reject(node, f"{disp}() takes 3 arguments (array, index, value), got {len(node.args)}",
                               f"write {disp}(a, i, x), or {disp}(a, (i, j), x) for a 2-D array")
        arr, idx, value = node.args
        # (an array is always a parameter: giving one another name is refused, so a local
        # name holds a number)
        if not (isinstance(arr, ast.Name) and arr.id in self.params):
            return self.reject(arr, f"the first argument of {disp}() must be an array: a parameter of the "
                                    f"{'step' if self.is_step else 'helper'}",
                               f"write {disp}(a, i, x) where 'a' is an array argument")
        self._use_array(arr)
        self._indexed(arr.id, idx, node)
        if arr.id in self.params:
            self.written.add(arr.id)
            self.atomic.add(arr.id)
        node.args = [arr, self._index(idx), self._scalar(value)]
        self.thread_varying = True      # the old value it returns is the thread's own
        node.func = _marker(target.name, node)
        return node

    def _random_call(self, node, target):
        if not self.is_step:
            return self.reject(node, f"{target.display}() can only be called in the step function itself, not in "
                                     f"a helper", "draw in the step and pass the number to the helper")
        if self.parsed.explicit_sites:
            # a generated step: each draw (and each copy of it) names its site in the user's
            # step and its step index (which a generated step may compute: the reverse sweep
            # runs the steps backwards)
            if len(node.args) != 4 or not isinstance(node.args[2], ast.Constant):
                return self.reject(node, "a generated step's lk.random draw must name its site and step",
                                   "generated steps tag their draws with tag_random_sites")
            args = [self._scalar(a) for a in node.args[:2]] + [node.args[2], self._scalar(node.args[3])]
            node.func = _marker(target.name, node)
            node.args = args
            return node
        if not 1 <= len(node.args) <= 2:
            return self.reject(node, f"{target.display}() takes a key and an optional subkey, got "
                                     f"{len(node.args)} arguments", f"write {target.display}(i) or {target.display}(i, k)")
        for a, what in zip(node.args, ("key", "subkey")):
            self._integer_use(a)
            if _floaty(a, self.float_locals):
                # (converted to an integer it would be truncated: keys 1.2 and 1.9 draw the same)
                self.error(a, f"the {what} of {target.display}() is a float ('{ast.unparse(a)}'): keys and subkeys "
                              f"are non-negative integers", "pass an integer, e.g. the loop index, or int(...)")
        args = [self._scalar(a) for a in node.args]
        if len(args) == 1:
            args.append(ast.copy_location(ast.Constant(0), node))
        self.rng_sites += 1    # each call site draws its own numbers
        self.site_at[(node.lineno, node.col_offset)] = self.rng_sites
        args.append(ast.copy_location(ast.Constant(self.rng_sites), node))
        node.func = _marker(target.name, node)
        node.args = args
        return node

    def _helper_call(self, node, fn, label):
        spec = validate_helper(fn, self.ctx, node, self)
        node.args = [self.visit(a) for a in node.args]
        if spec is None:
            return node
        if len(node.args) != len(spec.params):
            self.error(node, f"helper '{label}' takes {len(spec.params)} argument(s), got {len(node.args)}",
                       f"pass {', '.join(spec.params)}")
        for i, a in enumerate(node.args):
            if isinstance(a, ast.Name) and i in spec.array_params:
                self._use_array(a)
                if a.id in self.params:
                    if i in spec.written_params:
                        self.written.add(a.id)
                    if i in spec.atomic_params:
                        self.atomic.add(a.id)
                    if spec.param_arity.get(i):
                        self._indexed(a.id, None, node, arity=spec.param_arity[i])
        if spec.thread_varying:
            self.thread_varying = True
        node.func = ast.copy_location(ast.Name(id=spec.symbol, ctx=ast.Load()), node.func)
        node.helper = spec  # read by the uniformity pass
        return node


def _is_numpy_function(target) -> bool:
    """A NumPy function or ufunc (``np.sqrt``, ``np.sum``), not a scalar type such as ``np.float32``."""
    if isinstance(target, type):
        return False
    if isinstance(target, np.ufunc):
        return True
    module = getattr(target, "__module__", None) or ""
    return callable(target) and (module == "numpy" or module.startswith("numpy."))


#: the keyword options of kernel(...), kernel.start(...) and kernel.jax(...): a step parameter of
#: one of these names could not be passed by keyword
CALL_OPTIONS = frozenset({"steps", "max_steps", "start", "backend", "scope", "threads", "blocks", "seed", "progress",
                          "timeout", "debug", "watchdog", "checkpoint_every", "adjoint_form"})


def _check_signature(parsed: ParsedFunction, ctx: _Context, is_step: bool):
    a = parsed.tree.args
    where = "" if is_step else f"in helper '{parsed.name}'"
    bad = []
    if a.vararg or a.kwarg:
        bad.append((a.vararg or a.kwarg, "*args and **kwargs are not supported", "list every parameter by name"))
    if a.kwonlyargs:
        bad.append((a.kwonlyargs[0], "keyword-only parameters are not supported", "make them positional"))
    if a.defaults:
        bad.append((a.defaults[0], "default parameter values are not supported in step code",
                    "pass every argument at the call"))
    if a.posonlyargs:
        bad.append((a.posonlyargs[0], "positional-only parameters ('/') are not supported", "remove the '/'"))
    for arg in a.args:
        if arg.arg.startswith(RESERVED_PREFIX):
            bad.append((arg, f"names starting with '{RESERVED_PREFIX}' are reserved for generated code",
                        "rename the parameter"))
    if is_step:
        for arg in a.args[1:]:
            if arg.arg in CALL_OPTIONS:
                bad.append((arg, f"parameter '{arg.arg}' has the name of an option of the call ({arg.arg}=): "
                                 f"kernel({arg.arg}=...) would set the option, not this parameter",
                            "rename the parameter"))
    for node, msg, hint in bad:
        ctx.diagnostics.append(parsed.diagnostic(node, ctx.step_name, msg, hint, where))
    if is_step and not a.args:
        ctx.diagnostics.append(parsed.diagnostic(parsed.tree, ctx.step_name,
                                                 "a step function takes the step index as its first parameter",
                                                 "write 'def step(t, ...):'"))


def validate_helper(fn, ctx: _Context, call_node=None, caller=None) -> FunctionSpec | None:
    """Validate a helper called from step code; returns its spec (None if it cannot be used)."""
    key = id(fn)
    if key in ctx.helpers:
        return ctx.helpers[key]
    if key in ctx.in_progress:
        caller.error(call_node, f"recursive call of '{fn.__name__}': recursion is not supported on the GPU",
                     "rewrite it as a loop")
        return None
    try:
        parsed = parse_helper(caller.parsed, fn) if caller is not None else parse_step(fn)
    except StepSyntaxError as exc:
        d = exc.diagnostics[0]
        caller.error(call_node, f"cannot use helper '{fn.__name__}': {d.message}", d.hint)
        return None
    ctx.in_progress[key] = fn.__name__
    _check_signature(parsed, ctx, is_step=False)
    norm = _Normalizer(ctx, parsed, is_step=False)
    tree = copy.deepcopy(parsed.tree)
    body = norm.visit_body(tree.body)
    norm.check_array_names()
    norm.check_definite_assignment()
    norm.check_integer_constants(body)
    params = tuple(norm.params)
    # the helper's own nesting of parallel loops and its element updates; its parameters are
    # taken as the same on every thread (calls with thread-varying arguments to a helper that
    # runs a parallel loop are rejected where they are made)
    uniformity = _Uniformity(ctx, parsed, helper_params=params, where=norm.where)
    uniformity.run(body)
    has_parallel_loop = any(marker_of(n.iter) in _PARALLEL_LOOPS if isinstance(n, ast.For) else
                            getattr(getattr(n, "helper", None), "has_parallel_loop", False)
                            for st in body for n in ast.walk(st))
    spec = FunctionSpec(fn.__name__, ctx.symbol_for(fn.__name__), params, tuple(body), parsed.filename,
                        parsed.tree.lineno, norm.thread_varying,
                        frozenset(i for i, p in enumerate(params) if p in norm.array_uses),
                        frozenset(i for i, p in enumerate(params) if p in norm.written),
                        {i: norm.arity[p][0] for i, p in enumerate(params) if p in norm.arity},
                        atomic_params=frozenset(i for i, p in enumerate(params) if p in norm.atomic),
                        has_parallel_loop=has_parallel_loop, updates=tuple(uniformity.updates))
    del ctx.in_progress[key]
    ctx.helpers[key] = spec
    return spec


class _Why(NamedTuple):
    """Why a place is not reached the same way by every thread.

    Attributes:
        text: completes "<construct> ...", e.g. "is under an 'if' at line 4 whose condition
            differs between threads".
        hint: what to do about a barrier there.
        kind: ``"parallel"`` (inside a parallel loop), ``"if"``, ``"ifexp"``, ``"shortcircuit"``,
            ``"bounds"`` (a loop whose bounds differ), ``"while"`` or ``"exit"`` (a loop some
            threads leave early).
    """

    text: str
    hint: str
    kind: str


_UPDATE_HINT = ("several iterations may update the same element at once: use lk.atomic.add(a, idx, x) "
                "(or lk.atomic.max/min)")
_GUARD_HINT = ("guard it with `if lk.thread_id() == 0:` so that one thread makes it, or use "
               "lk.atomic.add(a, idx, x) (or lk.atomic.max/min)")
_CONDITION_INSIDE = ("move the condition inside the loop: run `for i in lk.range(n):` on every thread and test "
                     "it per index with `if ...:` in the loop's body")


def _stored_names(stmts) -> set:
    """Names bound anywhere in ``stmts`` (assignments and loop targets)."""
    return {n.id for st in stmts for n in ast.walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _strided_names(body, params) -> dict:
    """Local names that always hold ``lk.thread_id() + c + k * lk.num_threads()`` for one constant
    ``c`` and some ``k >= 0`` (the grid-stride idiom ``i = lk.thread_id()`` ...
    ``i += lk.num_threads()``): name -> c. Two threads never hold the same value in such a name.

    Flow-insensitive: every binding of the name must be ``lk.thread_id() + c`` (the same ``c``)
    or an increase by ``lk.num_threads()``.
    """
    binds: dict[str, list] = {}
    for node in ast.walk(ast.Module(body=list(body), type_ignores=[])):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        binds.setdefault(n.id, []).append(node.value if t is n else None)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            grows = isinstance(node.op, ast.Add) and marker_of(node.value) == "num_threads"
            binds.setdefault(node.target.id, []).append("stride" if grows else None)
        elif isinstance(node, ast.For):
            for n in ast.walk(node.target):
                if isinstance(n, ast.Name):
                    binds.setdefault(n.id, []).append(None)
    out = {}
    for name, values in binds.items():
        if name in params:
            continue
        starts = set()
        for v in values:
            if v == "stride":
                continue
            if isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add) and \
                    {marker_of(v.left), marker_of(v.right)} == {"num_threads", None} and \
                    any(isinstance(x, ast.Name) and x.id == name for x in (v.left, v.right)):
                continue          # i = i + lk.num_threads()
            base, c = index_offset(v) if isinstance(v, ast.expr) else (None, 0)
            if marker_of(base) != "thread_id":
                break
            starts.add(c)
        else:
            if len(starts) == 1:
                out[name] = starts.pop()
    return out


def _index_dims(idx) -> list:
    return list(idx.elts) if isinstance(idx, ast.Tuple) else [idx]


def _subscript_targets(target):
    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
        yield target
    elif isinstance(target, ast.Tuple):
        for t in target.elts:
            yield from _subscript_targets(t)


class _Uniformity:
    """Which values may differ between threads, and what must not depend on them.

    A value is thread-varying if it depends on the thread index, a parallel loop index, an
    array load, an ``lk.atomic`` result or a thread-varying helper result, or was assigned
    under thread-varying control flow. Reductions return the same value on every thread. In a
    step generated from a drop-in loop's body (``ParsedFunction.uniform_loads``) so does a load,
    at an index the same on every thread, from an array the step never writes (``read_only``:
    a carry's old buffer, ``c1[0]``): its elements do not change during the step.
    Checked with that:

    * (the step) barriers, reductions and ``return`` are reached by every thread together;
    * a parallel loop (``lk.range``/``lk.grid``), or a call of a helper that runs one, is
      reached by every thread the same number of times: not inside another parallel loop, not
      under thread-varying control flow, and (a helper) not with thread-varying arguments. A
      thread runs only its own share of such a loop's indices, so where threads run it
      different numbers of times some indices are never visited;
    * a read-modify-write of an array element (``a[k] += x``, or ``a[k]`` read and then
      written with the same index expression ``k``) that several threads could make to the
      same element at once, losing updates. Inside a parallel loop ``k`` must be the
      iteration's own element: in some dimension each index variable of the loop (``v``,
      ``v + c`` or ``v - c``, ``c`` an integer literal; the other dimensions may be anything),
      or the thread's own (``lk.thread_id() + c`` or a grid-stride name, see
      :func:`_strided_names`); every update of one array in the loop with the same offsets, so
      that iteration ``v`` and ``v + 1`` do not meet at one element. Outside parallel loops, in
      a step with parallel constructs, every thread runs the update: it must be at the
      thread's own element or under ``if lk.thread_id() == <uniform>:``. A helper's own such
      updates are recorded in ``updates`` (its parameters standing for the index variables)
      and checked at each call with the call's arguments substituted. Sequential steps (one
      thread) are not checked. Indices are assumed in bounds: an index that wraps around
      (``a[v - 1]`` at ``v == 0`` over a loop as long as the array) is not seen.
    """

    def __init__(self, ctx: _Context, parsed: ParsedFunction, *, parallel: bool = True,
                 helper_params: tuple | None = None, where: str = "", read_only: frozenset = frozenset()):
        self.ctx = ctx
        self.read_only = read_only             # the step's arrays that no thread writes during it
        self.parsed = parsed
        self.where = where
        self.parallel = parallel               # the step has parallel constructs: many threads run it
        self.helper_params = helper_params     # a helper's parameter names (None: the step)
        self.seen: set[tuple] = set()
        self.loops: list[dict] = []
        self.region: dict | None = None        # the innermost enclosing parallel loop
        self.top = {"reads": set(), "patterns": {}}   # outside parallel loops
        self.guard = 0                         # inside `if lk.thread_id() == <uniform>:`
        self.strided: dict[str, int] = {}
        self.own_params: set[str] = set()
        self.updates: list[tuple] = []         # a helper's unguarded top-level updates

    def run(self, body):
        params = [a.arg for a in self.parsed.tree.args.args]
        self.strided = _strided_names(body, params)
        if self.helper_params is not None:
            self.own_params = set(self.helper_params) - _stored_names(body)
        return self.block(body, set(), None)

    def error(self, node, message, hint):
        key = (node.lineno, node.col_offset)   # the first (most direct) reason wins
        if key not in self.seen:
            self.seen.add(key)
            self.ctx.diagnostics.append(self.parsed.diagnostic(node, self.ctx.step_name, message, hint, self.where))

    def text(self, node) -> str:
        """The user's source text of ``node`` (normalized names would show markers)."""
        p = self.parsed
        if getattr(node, "end_lineno", None) == getattr(node, "lineno", -1) and node.end_col_offset is not None:
            seg = p.source_line(node.lineno)[node.col_offset + p.col_shift:node.end_col_offset + p.col_shift]
            if seg.strip():
                return seg
        return ast.unparse(node)

    # -- expressions -----------------------------------------------------------------------
    def varying(self, e, state) -> bool:
        if isinstance(e, ast.Name):
            return e.id in state
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            name = e.func.id
            if name == INTRINSIC_PREFIX + "thread_id" or marker_of(e) in _ATOMICS:
                return True
            if name[len(INTRINSIC_PREFIX):] in _BARRIERS and name.startswith(INTRINSIC_PREFIX):
                return False
            helper = getattr(e, "helper", None)
            if helper is not None and helper.thread_varying:
                return True
            return any(self.varying(a, state) for a in e.args)
        if isinstance(e, ast.Subscript):
            if isinstance(e.value, ast.Attribute):   # x.shape[k]
                return self.varying(e.slice, state)
            if isinstance(e.value, ast.Name) and e.value.id in self.read_only:
                # an element of an array the step never writes: the same on every thread
                # wherever the index is
                return self.varying(e.slice, state)
            return True                              # an array load
        if isinstance(e, ast.Attribute):
            return False                             # x.shape, module constants
        return any(self.varying(c, state) for c in ast.iter_child_nodes(e) if isinstance(c, ast.expr))

    def check_barriers(self, e, state, reason):
        """Report barriers/reductions in ``e`` that not every thread would reach, and calls of
        helpers that run a parallel loop or update elements where that is not safe."""
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id.startswith(INTRINSIC_PREFIX):
            name = e.func.id[len(INTRINSIC_PREFIX):]
            if name in _BARRIERS and reason is not None:
                self.error(e, f"lk.{name}() {reason[0]}: threads that skip it would leave the others "
                              f"waiting forever (deadlock)", reason[1])
        if is_helper_call(e) and getattr(e, "helper", None) is not None:
            self.helper_call(e, state, reason)
        if isinstance(e, ast.IfExp):
            self.check_barriers(e.test, state, reason)
            r = reason or (_Why("is in a conditional expression whose test differs between threads",
                                "compute it unconditionally before the expression", "ifexp")
                           if self.varying(e.test, state) else None)
            self.check_barriers(e.body, state, r)
            self.check_barriers(e.orelse, state, r)
            return
        if isinstance(e, ast.BoolOp):
            r = reason
            for v in e.values:
                self.check_barriers(v, state, r)
                if r is None and self.varying(v, state):
                    r = _Why("is on the short-circuit side of 'and'/'or' after a thread-varying operand",
                             "compute it unconditionally first", "shortcircuit")
            return
        for c in ast.iter_child_nodes(e):
            if isinstance(c, ast.expr):
                self.check_barriers(c, state, reason)

    def note_reads(self, e):
        """Remember the array elements ``e`` reads, for the read-then-write test."""
        reads = (self.region or self.top)["reads"]
        for n in ast.walk(e):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and isinstance(n.ctx, ast.Load):
                reads.add((n.value.id, ast.dump(n.slice)))

    # -- parallel loops and updates --------------------------------------------------------
    def nested_parallel(self, s, reason):
        what = f"lk.{marker_of(s.iter)}()"
        if reason.kind == "parallel":
            self.error(s, f"this {what} loop is inside the parallel loop at line {self.region['line']}: each "
                          f"thread would run only its share of it inside its share of the outer loop (threads run "
                          f"different numbers of iterations), so most index pairs would never be visited",
                       "use one lk.grid over both dimensions: `for i, j in lk.grid(n, m):`")
            return
        hint = _CONDITION_INSIDE if reason.kind in ("if", "ifexp", "shortcircuit") else reason.hint
        self.error(s, f"this {what} loop {reason.text}: threads would run different numbers of its iterations "
                      f"(each thread runs only its own share of the indices), so some indices would never be "
                      f"visited", hint)

    def helper_call(self, e, state, reason):
        h = e.helper
        if h.has_parallel_loop:
            why = f"helper '{h.name}' runs a parallel loop (lk.range/lk.grid)"
            if reason is not None and reason.kind == "parallel":
                self.error(e, f"{why}, and this call is inside the parallel loop at line {self.region['line']}: "
                              f"each thread would run only its share of the helper's loop in each of its own "
                              f"iterations, so most indices would never be visited",
                           "call it outside the parallel loop, on every thread (or make the two loops one lk.grid "
                           "over both dimensions: `for i, j in lk.grid(n, m):`)")
            elif reason is not None:
                hint = ("call it on every thread and move the condition inside the helper's loop"
                        if reason.kind in ("if", "ifexp", "shortcircuit") else reason.hint)
                self.error(e, f"{why}, and this call {reason.text}: threads would run different numbers of its "
                              f"iterations, so some indices would never be visited", hint)
            else:
                for k, a in enumerate(e.args):
                    if self.varying(a, state):
                        self.error(e, f"{why}, but argument {k + 1} of this call ('{self.text(a)}') differs "
                                      f"between threads: its loop could run differently on different threads, "
                                      f"so some indices would never be visited",
                                   "pass values that are the same on every thread (arrays, the step index, "
                                   "scalar arguments, reduction results)")
                        break
        if h.updates and not self.guard:
            self.helper_updates(e, h)

    def context_vars(self) -> set:
        """The names whose distinct values make updates distinct here: the enclosing parallel
        loop's index variables, or a helper's parameters at its top level."""
        if self.region is not None:
            return self.region["vars"]
        return self.own_params if self.helper_params is not None else set()

    def dim(self, e, names):
        """One index dimension: ``("var", name, c)`` for ``name + c`` with ``name`` in
        ``names``, ``("tid", None, c)`` for the thread's own ``lk.thread_id() + c``, else None."""
        base, c = index_offset(e)
        if isinstance(base, ast.Name) and base.id in names:
            return ("var", base.id, c)
        if marker_of(base) == "thread_id" and not base.args:
            return ("tid", None, c)
        if isinstance(base, ast.Name) and base.id in self.strided:
            return ("tid", None, c + self.strided[base.id])
        return None

    @staticmethod
    def owned(dims, names) -> bool:
        if any(d is not None and d[0] == "tid" for d in dims):
            return True
        return bool(names) and set(names) <= {d[1] for d in dims if d is not None and d[0] == "var"}

    def consistent(self, node, arr, dims):
        """Every update of ``arr`` here uses the same offsets: ``a[i] += 1`` and ``a[i + 1] += 1``
        in one loop meet at one element in iterations ``i`` and ``i + 1``."""
        pattern = tuple(dims)
        first, line = (self.region or self.top)["patterns"].setdefault(arr, (pattern, node.lineno))
        if first != pattern:
            self.error(node, f"'{arr}' is updated here at other offsets than at line {line}: iterations a few "
                             f"indices apart would update the same element", _UPDATE_HINT)

    def record(self, arr, dims, text):
        """A helper's update at its top level, for its callers to check."""
        params = list(self.helper_params)
        out = [("param", params.index(d[1]), d[2]) if d is not None and d[0] == "var" else d for d in dims]
        self.updates.append((params.index(arr) if arr in self.own_params else None, tuple(out), text))

    def check_update(self, target):
        """``target`` (``a[k]``) is read and written by this thread: fine only where no other
        thread can update the same element at once."""
        if self.guard:
            return
        arr = target.value.id
        names = self.context_vars()
        dims = [self.dim(e, names) for e in _index_dims(target.slice)]
        what = f"'{self.text(target)}'"
        if self.region is not None:
            if self.owned(dims, names):
                self.consistent(target, arr, dims)
                return
            loop_vars = " and ".join(f"'{v}'" for v in sorted(names)) or "the loop's index"
            rebound = self.region.get("rebound")
            why = (f"; the loop assigns its variable {' and '.join(repr(v) for v in rebound)} in its body, so "
                   f"it is not the iteration's index anywhere in the loop" if rebound else "")
            self.error(target, f"{what} is read and written (updated) in the parallel loop at line "
                               f"{self.region['line']}, at an element that is not provably this iteration's own "
                               f"(its index would be {loop_vars}, plus or minus a constant, in some dimension{why})",
                       "give the changed index another name (j = i + 1) and keep the loop variable as it is"
                       if rebound else _UPDATE_HINT)
        elif self.helper_params is not None:
            self.record(arr, dims, f"{what} at line {target.lineno}")
        elif self.parallel:
            if self.owned(dims, names):
                self.consistent(target, arr, dims)
                return
            self.error(target, f"{what} is read and written (updated) outside any parallel loop of a step that "
                               f"runs on many threads: every thread makes this update, and updates of one element "
                               f"made at once are lost", _GUARD_HINT)

    def helper_updates(self, e, h):
        """Check helper ``h``'s own updates at this call, its arguments substituted."""
        if self.region is None and self.helper_params is None and not self.parallel:
            return      # a sequential step: one thread
        names = self.context_vars()
        for arr_k, dims, text in h.updates:
            arg = e.args[arr_k] if arr_k is not None and arr_k < len(e.args) else None
            arr = arg.id if isinstance(arg, ast.Name) else None
            sub = []
            for d in dims:
                if d is None or d[0] == "tid":
                    sub.append(d)
                    continue
                a = e.args[d[1]] if d[1] < len(e.args) else None
                x = self.dim(a, names) if a is not None else None
                sub.append(None if x is None else (x[0], x[1], x[2] + d[2]))
            if self.region is None and self.helper_params is not None:
                if arr is not None:
                    self.record(arr, sub, text)
                else:
                    self.updates.append((None, tuple(sub), text))
                continue
            if arr is not None and self.owned(sub, names):
                self.consistent(e, arr, sub)
                continue
            if self.region is not None:
                where = (f"called in the parallel loop at line {self.region['line']} with these arguments, that "
                         f"element is not provably this iteration's own")
                hint = (f"pass the loop index ({' and '.join(sorted(names))}, plus or minus a constant) for the "
                        f"index parameter, or use lk.atomic.add(a, idx, x) (or lk.atomic.max/min) in the helper")
            else:
                where = "this call is outside any parallel loop of a step that runs on many threads"
                hint = _GUARD_HINT.replace("guard it", "guard the call")
            self.error(e, f"helper '{h.name}' updates {text} (a read, then a write of one element); {where}: "
                          f"several threads may update the same element at once", hint)

    def single_thread(self, test, state) -> bool:
        """``test`` is true on one thread at most: ``lk.thread_id() == <uniform value>`` (or a
        grid-stride name in its place), alone or as one operand of ``and``."""
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return any(self.single_thread(v, state) for v in test.values)
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            return False
        for a, b in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
            d = self.dim(a, set())
            if d is not None and d[0] == "tid" and not self.varying(b, state):
                return True
        return False

    # -- statements ------------------------------------------------------------------------
    def block(self, stmts, state: set, reason):
        for s in stmts:
            state = self.stmt(s, state, reason)
        return state

    def assign(self, target, vary, state, reason):
        if isinstance(target, ast.Name):
            if vary or reason is not None:
                state.add(target.id)
            else:
                state.discard(target.id)
        elif isinstance(target, ast.Tuple):
            for t in target.elts:
                self.assign(t, vary, state, reason)

    def stmt(self, s, state, reason):
        state = set(state)
        if isinstance(s, ast.Assign):
            self.check_barriers(s.value, state, reason)
            self.note_reads(s.value)
            for t in s.targets:
                for sub in _subscript_targets(t):
                    self.check_barriers(sub.slice, state, reason)
                    self.note_reads(sub.slice)
            reads = (self.region or self.top)["reads"]
            for t in s.targets:
                for sub in _subscript_targets(t):
                    if (sub.value.id, ast.dump(sub.slice)) in reads:
                        self.check_update(sub)
            for t in s.targets:
                if isinstance(t, ast.Tuple) and isinstance(s.value, ast.Tuple) and len(t.elts) == len(s.value.elts):
                    flags = [self.varying(v, state) for v in s.value.elts]
                    for tt, f in zip(t.elts, flags):
                        self.assign(tt, f, state, reason)
                else:
                    self.assign(t, self.varying(s.value, state), state, reason)
        elif isinstance(s, ast.AugAssign):
            self.check_barriers(s.value, state, reason)
            self.note_reads(s.value)
            if isinstance(s.target, ast.Name):
                self.assign(s.target, s.target.id in state or self.varying(s.value, state), state, reason)
            elif isinstance(s.target, ast.Subscript) and isinstance(s.target.value, ast.Name):
                self.check_barriers(s.target.slice, state, reason)
                self.note_reads(s.target.slice)
                self.check_update(s.target)
        elif isinstance(s, ast.Expr):
            self.check_barriers(s.value, state, reason)
            self.note_reads(s.value)
        elif isinstance(s, ast.Return):
            if s.value is not None:
                self.check_barriers(s.value, state, reason)
                self.note_reads(s.value)
            if self.helper_params is not None:
                pass        # a helper's return only ends the helper
            elif reason is not None:
                self.error(s, f"'return' {reason[0]}: every thread must stop at the same step",
                           "compute the condition with a reduction (e.g. lk.max) and return it at the top level")
            elif s.value is not None and self.parallel and self.varying(s.value, state):
                # (a sequential step runs on one thread: its return may read its arrays)
                self.error(s.value, "the step's return value can differ between threads; the loop must "
                                    "continue or stop on every thread together",
                           "reduce it first, e.g. 'return lk.max(err) > tol'")
        elif isinstance(s, ast.If):
            self.check_barriers(s.test, state, reason)
            self.note_reads(s.test)
            r = reason
            if r is None and self.varying(s.test, state):
                r = _Why(f"is under an 'if' at line {s.lineno} whose condition differs between threads",
                         "move it out of the 'if' (compute on every thread, use the result conditionally)", "if")
            guard = int(self.single_thread(s.test, state))
            self.guard += guard
            a = self.block(s.body, state, r)
            self.guard -= guard
            b = self.block(s.orelse, state, r)
            state = a | b
        elif isinstance(s, (ast.For, ast.While)):
            state = self.loop(s, state, reason)
        elif isinstance(s, (ast.Break, ast.Continue)):
            if self.loops and reason is not None and self.loops[-1]["reason"] is None:
                self.loops[-1]["varying_exit"] = True
        return state

    def loop(self, s, state, reason):
        own = None
        region = None
        if isinstance(s, ast.For):
            self.check_barriers(s.iter, state, reason)
            self.note_reads(s.iter)
            if marker_of(s.iter) in _PARALLEL_LOOPS:
                if reason is not None:
                    self.nested_parallel(s, reason)
                else:
                    for a in s.iter.args:
                        if self.varying(a, state):
                            what = f"lk.{marker_of(s.iter)}()"
                            self.error(a, f"this {what} bound ('{self.text(a)}') differs between threads: each "
                                          f"thread takes its share of the range it sees, so some indices would be "
                                          f"visited twice and others never",
                                       "use bounds that are the same on every thread (array shapes, scalar "
                                       "arguments, the step index, reduction results: for a bound read from an "
                                       "array, `n = lk.max(a[0])` first)")
                            break
                own = _Why(f"is inside the parallel loop at line {s.lineno}, where threads run different "
                           f"numbers of iterations",
                           "move it after the loop (the loop is each thread's share of the work)", "parallel")
                index_vars = {n.id for n in ast.walk(s.target) if isinstance(n, ast.Name)}
                region = {"vars": index_vars - _stored_names(s.body), "line": s.lineno, "reads": set(),
                          "patterns": {}, "rebound": sorted(index_vars & _stored_names(s.body))}
            elif any(self.varying(a, state) for a in s.iter.args):
                own = _Why(f"is inside a loop at line {s.lineno} whose bounds differ between threads",
                           "loop over bounds that are the same on every thread", "bounds")
        targets = [] if isinstance(s, ast.While) else (
            [s.target] if isinstance(s.target, ast.Name) else list(s.target.elts))
        early_exit = None
        cur = set(state)
        while True:   # to a fixpoint: the varying set and the reasons only grow
            if isinstance(s, ast.While):
                self.check_barriers(s.test, cur, reason)
                self.note_reads(s.test)
                if own is None and self.varying(s.test, cur):
                    own = _Why(f"is inside a while loop at line {s.lineno} whose condition differs between threads",
                               "reduce the condition first (e.g. with lk.max)", "while")
            r = reason or own or early_exit
            body_in = set(cur)
            for t in targets:
                (body_in.add if r else body_in.discard)(t.id)
            frame = {"reason": r, "varying_exit": False}
            self.loops.append(frame)
            outer_region = self.region
            if region is not None:
                self.region = region
            out = self.block(s.body, body_in, r)
            self.region = outer_region
            self.loops.pop()
            new = cur | out
            changed = new != cur
            cur = new
            if frame["varying_exit"] and early_exit is None:
                early_exit = _Why("is inside a loop that some threads leave early (break/continue under a "
                                  "thread-varying condition)", "make the exit condition the same on every thread",
                                  "exit")
                changed = True
            if isinstance(s, ast.While) and own is None and self.varying(s.test, cur):
                changed = True
            if not changed:
                return cur


def _returns(body):
    for node in ast.walk(ast.Module(body=list(body), type_ignores=[])):
        if isinstance(node, ast.Return):
            yield node


def tag_random_sites(parsed):
    """``parsed`` (a user's step) with each ``lk.random`` draw given its site number and the
    step index as third and fourth arguments (its subkey, 0 by default, as the second), for
    generating steps from it: the generated step's draws, wherever they are moved or copied
    (and whatever the generated step's own index means), draw what the step's draws do.
    Returns a ParsedFunction with ``explicit_sites`` set."""
    ctx = _Context(parsed.name)
    norm = _Normalizer(ctx, parsed, is_step=True)
    norm.visit_body(copy.deepcopy(parsed.tree).body)
    tree = copy.deepcopy(parsed.tree)
    for n in ast.walk(tree):
        site = norm.site_at.get((getattr(n, "lineno", None), getattr(n, "col_offset", None)))
        if site is not None and isinstance(n, ast.Call):
            if len(n.args) == 1:
                n.args.append(ast.copy_location(ast.Constant(0), n))
            n.args.append(ast.copy_location(ast.Constant(site), n))
            n.args.append(ast.copy_location(ast.Name(id=tree.args.args[0].arg, ctx=ast.Load()), n))
    return dataclasses.replace(parsed, tree=tree, explicit_sites=True)


def _check_phases(parsed, ctx, body, params, array_params, index_name, swap_pairs):
    """Two parallel loops of one block with no barrier between them (``lk.sync()`` or a
    reduction, reached on every path) where one writes an array element that the other reads
    or writes: unless both loops run the same iterations and the two accesses give each
    iteration its own element (one thread's in both loops; not for a warp-split loop, whose
    iteration is a group of threads), or the elements the two accesses can touch are proven
    apart (``disjoint.py``: a stencil's interior loop and its boundary loop), another thread may
    write the element before or after it is read or written (a race on a GPU; the CPU backend
    runs the loops in order). Array accesses outside parallel loops, which every thread runs,
    count as a loop of their own, checked against itself too (statements that use
    ``lk.thread_id()`` are left out: one thread's work, or each thread's own elements). Two atomic updates
    of one kind (adds, maxima or minima) commute, and two stores of one value (the same literal,
    or a copy of one element of an array neither writes) do not race in the result."""
    marked_body = mark_nonneg_indices(body, params, array_params, index_name)
    stable = stable_names(body, params, {b: a for a, b in swap_pairs})
    by_thread = _thread_dependent_names(body)

    class Unit:
        """A parallel loop, or the array accesses of statements outside parallel loops."""
        def __init__(self, node, marked, loop: bool):
            self.node, self.loop = node, loop
            pieces = loop_pieces(marked, stable) if loop else {}
            # (what holds while a loop runs an iteration holds for its body's accesses; its
            # bounds are evaluated, and read, whether it runs any: a unit of their own)
            self.facts = loop_facts(pieces)
            self.iterations = iteration_key(node, stable) if loop else None
            self.split = loop and marker_of(node.iter) == "range" and find_warp_split(node) is not None
            self.accesses = {}      # array -> [(kind: "r", "w" or an atomic's name, own key, node, elements, value)]
            found = []
            trees = (node, marked) if not loop else \
                [ast.Module(body=list(x.body) + list(x.orelse), type_ignores=[]) for x in (node, marked)]
            for tree in trees:
                seen = []
                updated = {id(n.target) for n in ast.walk(tree) if isinstance(n, ast.AugAssign)}
                for n in _walk_unmarked(tree):
                    if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                        seen.append((n.value.id, "w" if isinstance(n.ctx, ast.Store) else "r", n))
                        if id(n) in updated:        # a[i] += x reads the element too
                            seen.append((n.value.id, "r", n))
                    elif marker_of(n) in _ATOMICS and n.args and isinstance(n.args[0], ast.Name):
                        seen.append((n.args[0].id, marker_of(n), n))
                found.append(seen)
            values = {id(st.targets[0]): _stored_value(st) for st in ast.walk(trees[0])
                      if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Subscript)}
            owned = owned_variables(marked) if loop and not self.split else None
            for (name, kind, n), (_, _, m) in zip(*found):
                sub = isinstance(m, ast.Subscript)
                elements = index_pieces(name, m.slice, pieces, stable) if sub else [None]
                own = own_key(marked, owned, m.slice) if sub else None
                self.accesses.setdefault(name, []).append((kind, own, n, elements,
                                                           values.get(id(n)) if kind == "w" else None))

    def same_shape(x, y):
        return shape_symbol(x, 0, stable) == shape_symbol(y, 0, stable)

    def conflict(ka, kb):
        if ka == "r" and kb == "r":
            return False
        return not (ka in _ATOMICS and ka == kb)

    def compare(a, b):
        # (a is b: a statement outside the parallel loops against itself, which every thread runs)
        same_iterations = a.iterations is not None and a.iterations == b.iterations
        facts = a.facts + b.facts
        written = {name for unit in (a, b) for name, uses in unit.accesses.items() if any(u[0] != "r" for u in uses)}
        for name in sorted(set(a.accesses) & set(b.accesses)):
            for ka, own_a, node_a, elems_a, value_a in a.accesses[name]:
                for kb, own_b, node, elems_b, value_b in b.accesses[name]:
                    if not conflict(ka, kb) or a is b and node is node_a and ka == kb:
                        continue
                    if same_iterations and {ka, kb} <= {"r", "w"} and own_a is not None and own_a == own_b:
                        continue
                    if disjoint(elems_a, elems_b, facts):
                        continue
                    # two stores of one value into an element both reach (a boundary's corners):
                    # the same literal, or copies v[x] = w[x] from an array neither writes, of v's
                    # shape or through indices that do not wrap
                    if value_a is not None and value_a == value_b and (
                            value_a[0] == "literal" or value_a[1] not in written and (
                                same_shape(value_a[1], name) or never_wraps(elems_a + elems_b, facts))):
                        continue
                    first = "written" if ka != "r" else "read"
                    then = "read" if kb == "r" else "written"
                    what = {("written", "read"): "another thread may write the element while (or after) this "
                                                 "one reads it",
                            ("read", "written"): "this may overwrite an element before another thread has "
                                                 "read it above",
                            ("written", "written"): "both may store one element, and which store lands last is "
                                                    "a race"}[first, then]
                    where = f"the parallel loop at line {a.node.lineno}" if a.loop else \
                        "this statement, which every thread runs," if a is b else f"line {a.node.lineno}"
                    here = "this parallel loop" if b.loop else "here" if a is b else \
                        "this statement, outside the parallel loops,"
                    ctx.diagnostics.append(parsed.diagnostic(
                        node, ctx.step_name,
                        f"'{name}' is {first} in {where} and {then} in {here} with no lk.sync() between them: "
                        f"{what} (on a GPU; the CPU backend runs the step's statements one after the other)",
                        "put lk.sync() between them (loopkern could not prove that they touch different elements: "
                        "bounds it compares differ by a constant, such as 1 and n - 2)"))
                    return

    def plain(st, mst, pending) -> list:
        """The statement (or expression) ``st`` outside the parallel loops, after ``pending``:
        checked against them and against itself; the units pending after it."""
        if any(marker_of(n) in ("thread_id", "num_threads") or isinstance(n, ast.Name) and n.id in by_thread
               for n in ast.walk(st)):
            # (statements of one thread, or of each thread's own elements, as lk.thread_id()
            # picks them: not checked)
            return pending
        unit = Unit(st, mst, loop=False)
        for other in pending:
            compare(other, unit)
        compare(unit, unit)
        if _barrier_on_every_path(st):
            return [unit]       # its accesses may come before or after the barrier: both checked
        return pending + [unit] if unit.accesses else pending

    def expression(e, me, pending) -> list:
        return plain(ast.copy_location(ast.Expr(value=e), e), ast.copy_location(ast.Expr(value=me), me), pending)

    def block(stmts, marked):
        pending = []
        for st, mst in zip(stmts, marked):
            if isinstance(st, ast.For) and marker_of(st.iter) in _PARALLEL_LOOPS:
                pending = expression(st.iter, mst.iter, pending)
                unit = Unit(st, mst, loop=True)
                for other in pending:
                    compare(other, unit)
                pending.append(unit)
            elif any(isinstance(n, ast.For) and marker_of(n.iter) in _PARALLEL_LOOPS for n in ast.walk(st)):
                # a block holding parallel loops: its test or range is read here; its loops are
                # checked among themselves; a barrier in it may not run, so it separates nothing
                head = getattr(st, "test", None) or getattr(st, "iter", None)
                if head is not None:
                    pending = expression(head, getattr(mst, "test", None) or getattr(mst, "iter", None), pending)
                for field_name in ("body", "orelse"):
                    sub = getattr(st, field_name, None)
                    if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                        block(sub, getattr(mst, field_name))
            else:
                pending = plain(st, mst, pending)
    block(body, marked_body)


def _thread_dependent_names(body) -> set:
    """Names some assignment gives a value computed from ``lk.thread_id()``/``lk.num_threads()``
    or from such a name."""
    assigns = [n for n in ast.walk(ast.Module(body=list(body), type_ignores=[]))
               if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value is not None]
    found: set = set()
    while True:
        more = set()
        for a in assigns:
            if any(marker_of(n) in ("thread_id", "num_threads") or isinstance(n, ast.Name) and n.id in found
                   for n in ast.walk(a.value)):
                targets = a.targets if isinstance(a, ast.Assign) else [a.target]
                more |= {t.id for t in flat_targets(targets) if isinstance(t, ast.Name)} - found
        if not more:
            return found
        found |= more


def _stored_value(st):
    """What a store ``a[x] = ...`` stores, where two such stores store one value into an element
    both reach: ("literal", value) or ("copy", array) for ``a[x] = w[x]`` (the same index)."""
    v = st.value
    if isinstance(v, ast.Constant) and isinstance(v.value, (int, float)) and not isinstance(v.value, bool):
        return ("literal", repr(v.value))
    if isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and ast.dump(v.slice) == ast.dump(st.targets[0].slice):
        return ("copy", v.value.id)
    return None


def _barrier_on_every_path(st) -> bool:
    """Whether the statement reaches a barrier (``lk.sync()``, a reduction) whenever it runs:
    not under an ``if``, a loop, a conditional expression or the right side of ``and``/``or``."""
    if not isinstance(st, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return)) or st.value is None:
        return False

    def reached(e):
        if marker_of(e) in _BARRIERS:
            return True
        if isinstance(e, ast.IfExp):
            return reached(e.test)
        if isinstance(e, ast.BoolOp):
            return reached(e.values[0])
        if isinstance(e, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return False
        return any(reached(c) for c in ast.iter_child_nodes(e))
    return reached(st.value)


def _walk_unmarked(node):
    """The nodes under ``node`` in one fixed order, seeing through ``index_bounds``' marks (a
    marked copy of a tree lists the nodes of the tree in the same order)."""
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _walk_unmarked(child.args[0] if is_nonneg_mark(child) else child)


def _check_neighbour_writes(parsed, ctx, body):
    """A parallel loop that stores ``a[i]`` and reads ``a[i - 1]`` (each index the loop's own
    plus a constant, the constants differing): the element read is another iteration's, which
    that iteration's thread may be storing at the same time -- the in-place stencil, which the
    CPU backend runs in order (Gauss-Seidel) and a GPU runs racing. Left alone: a store under a
    condition with ``%`` or ``&`` (red-black orderings store and read disjoint elements), loops
    with a step other than 1, offsets further apart than a literal range is long, and indices
    through other expressions (a name bound once to the index plus a constant is followed)."""

    def steps_of_one(loop):
        # the loop variables whose step is 1: lk.range(a, b) or lk.range(a, b, 1); lk.grid's all
        names = loop_names(loop)
        if marker_of(loop.iter) == "range":
            args = loop.iter.args
            if len(args) == 3 and int_constant(args[2]) != 1:
                return set()
            return set(names[:1])
        return set(names) if isinstance(loop.target, ast.Tuple) else set()

    def literal_lengths(loop):
        # variable -> the number of iterations of its dimension, where its bounds are literals
        out = {}
        for name, (lo, hi, _) in zip(loop_names(loop), loop_bounds(loop) or []):
            lo, hi = int_constant(lo), int_constant(hi)
            if lo is not None and hi is not None:
                out[name] = max(hi - lo, 0)
        return out

    def parts(index, unit):
        # ((variable, offset) per dimension) when every index is a step-1 loop variable plus a constant
        dims = index.elts if isinstance(index, ast.Tuple) else [index]
        out = []
        for d in dims:
            base, c = index_offset(d)
            if not (isinstance(base, ast.Name) and base.id in unit):
                return None
            var, shift = unit[base.id]
            out.append((var, shift + c))
        return tuple(out)

    def named_offsets(loop, unit):
        # the loop variables (each itself, offset 0) and the names the loop body binds once, at
        # its top, to one of them plus a constant (ip = i + 1); none if a loop variable is
        # rebound in the body (its indices then name other elements)
        bound = binding_counts(loop.body)
        if any(v in bound for v in unit):
            return {}
        out = {v: (v, 0) for v in unit}
        for st in loop.body:
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) \
                    and bound.get(st.targets[0].id) == 1:
                base, c = index_offset(st.value)
                if isinstance(base, ast.Name) and base.id in unit:
                    out[st.targets[0].id] = (base.id, c)
        return out

    def parity_guarded(chain):
        return any(isinstance(n, (ast.Mod, ast.BitAnd)) for test in chain for n in ast.walk(test))

    def scan(stmts, unit, chain, stores, loads):
        for st in stmts:
            own = st.iter if isinstance(st, ast.For) else st.test if isinstance(st, (ast.If, ast.While)) else st
            for n in ast.walk(own):
                if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                    key = parts(n.slice, unit)
                    # (an element updated in place, a[i + 1] += x, is the racing-update check's)
                    if key is not None:
                        (stores if isinstance(n.ctx, ast.Store) else loads).append((n.value.id, key, n, chain))
            if isinstance(st, ast.If):
                scan(st.body, unit, chain + [st.test], stores, loads)
                scan(st.orelse, unit, chain + [st.test], stores, loads)
            elif isinstance(st, (ast.For, ast.While)):
                test = [st.test] if isinstance(st, ast.While) else []
                scan(st.body, unit, chain + test, stores, loads)
                scan(st.orelse, unit, chain + test, stores, loads)

    def check(loop):
        unit = named_offsets(loop, steps_of_one(loop))
        if not unit:
            return
        stores, loads = [], []
        scan(loop.body, unit, [], stores, loads)
        lengths = literal_lengths(loop)

        def apart(a, b):
            # a dimension whose literal range is shorter than the offsets' distance: the
            # elements stored and those read never meet (a[i] = a[i + 4] over lk.range(4))
            return any(v in lengths and abs(ca - cb) >= lengths[v] for (v, ca), (_, cb) in zip(a, b))
        for name, key, node, chain in sorted(loads, key=lambda ld: (ld[2].lineno, ld[2].col_offset)):
            for sname, skey, snode, schain in stores:
                if sname != name or parity_guarded(schain) or len(skey) != len(key):
                    continue
                if [v for v, _ in skey] == [v for v, _ in key] and skey != key and not apart(skey, key):
                    ctx.diagnostics.append(parsed.diagnostic(
                        node, ctx.step_name,
                        f"'{name}' is stored at another element in this parallel loop (line {snode.lineno}): the "
                        f"element read here is another iteration's, which its thread may be storing at the same "
                        f"time (a race on a GPU; the CPU backend runs the iterations in order)",
                        "write the new values into a second array (swap=[(...)] exchanges the two every step), "
                        "or store and read in two loops with lk.sync() between them"))
                    return

    for node in ast.walk(ast.Module(body=list(body), type_ignores=[])):
        if isinstance(node, ast.For) and marker_of(node.iter) in _PARALLEL_LOOPS:
            check(node)


def _raise_diagnostics(ctx, parsed):
    """StepSyntaxError with every problem found so far (the step's file first), if any."""
    if ctx.diagnostics:
        ctx.diagnostics.sort(key=lambda d: (d.filename != parsed.filename, d.filename, d.line, d.col))
        raise StepSyntaxError(ctx.diagnostics)


def validate_step(fn, swap=()) -> StepSpec:
    """Check ``fn`` against the restricted-Python rules and build its :class:`StepSpec`.

    Args:
        fn: the step function (first parameter: the step index).
        swap: pairs of parameter names whose buffers exchange roles after every step.

    Raises:
        StepSyntaxError: with every problem found in ``fn`` and the helpers it calls.
    """
    parsed = parse_step(fn)
    ctx = _Context(parsed.name)
    _check_signature(parsed, ctx, is_step=True)
    norm = _Normalizer(ctx, parsed, is_step=True)
    tree = copy.deepcopy(parsed.tree)
    body = norm.visit_body(tree.body)
    # what the allow-list refused can leave nodes the later analyses do not expect (a loop over
    # an array has no range call): report it first
    _raise_diagnostics(ctx, parsed)
    norm.check_array_names()
    norm.check_definite_assignment()
    norm.check_integer_constants(body)
    names = list(norm.params)
    index_param = names[0] if names else "t"
    params = names[1:]

    if index_param in norm.array_uses:
        ctx.diagnostics.append(parsed.diagnostic(norm.array_uses[index_param], ctx.step_name,
                                                 f"'{index_param}' is the step index (an integer), not an array",
                                                 "the first parameter of a step is the step index"))
    swap_idx = _check_swap(parsed, ctx, params, swap)
    swapped = {params[i] for pair in swap_idx for i in pair}
    kinds = []
    for p in params:
        if p in norm.array_uses and p in norm.scalar_uses:
            node = norm.scalar_uses[p]
            ctx.diagnostics.append(parsed.diagnostic(
                node, ctx.step_name, f"'{p}' is used as an array (line {norm.array_uses[p].lineno}) and here "
                                     f"as a number: whole-array arithmetic is not supported in step code",
                "index it, e.g. inside 'for i in lk.range(n)'"))
        elif p in swapped and p in norm.scalar_uses:
            # (a swap pair exchanges two arrays' buffers; a number has none)
            ctx.diagnostics.append(parsed.diagnostic(
                norm.scalar_uses[p], ctx.step_name, f"'{p}' is in a swap pair, so it must be an array, but the "
                                                     f"step uses it here as a number",
                f"name two array parameters in swap=, or index '{p}' (e.g. {p}[i])"))
        kinds.append(ARRAY if p in norm.array_uses or p in swapped else SCALAR if p in norm.scalar_uses else ANY)

    rets = list(_returns(body))
    with_value = [r for r in rets if r.value is not None]
    for r in rets:
        if r.value is None and with_value:
            ctx.diagnostics.append(parsed.diagnostic(
                r, ctx.step_name, f"this 'return' has no value, but the return at line {with_value[0].lineno} "
                                  f"returns a condition", "return the condition (True to continue) on every path"))
    _report_param_stores(parsed, ctx, norm, index_param, swapped)

    def markers(stmts):
        return {n.func.id[len(INTRINSIC_PREFIX):] for n in ast.walk(ast.Module(body=list(stmts), type_ignores=[]))
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id.startswith(INTRINSIC_PREFIX)}
    used = markers(body).union(*(markers(h.body) for h in ctx.helpers.values()))
    # lk.atomic and lk.random do not make a step parallel (the spec's definition): in a
    # sequential step the one thread updates, and its draws do not depend on the thread
    parallel = bool(used - _ATOMICS - {"random_uniform", "random_normal"})
    # (a drop-in loop's step, parsed.uniform_loads) an array no statement of the step writes
    # (nor a helper it passes it to, nor lk.atomic) holds the same elements for every thread
    # all through a step: a barrier separates its last writes, as the other array of a swap
    # pair, from this step, and the drop-in loops pass no two arguments that share memory
    read_only = frozenset(p for p in names if (p in norm.array_uses or p in swapped) and p not in norm.written) \
        if parsed.uniform_loads else frozenset()
    _Uniformity(ctx, parsed, parallel=parallel, read_only=read_only).run(body)
    if not parsed.explicit_sites:
        # (a generated step -- tangent, adjoint -- comes from a user's step that passed, and its
        # generator places its own barriers: the adjoint of an interior loop reads what the
        # adjoint of the boundary loop before it wrote, at elements this check cannot tell apart)
        if parallel and not ctx.diagnostics:
            # (a sequential step runs on one thread; on a step with other errors the findings
            # would only add to them: it reasons about bounds and indices they may be about)
            _check_phases(parsed, ctx, body, names, sorted(i for i, p in enumerate(names)
                                                          if p in norm.array_uses or p in swapped), index_param,
                          [(params[a], params[b]) for a, b in swap_idx])
        _check_neighbour_writes(parsed, ctx, body)

    _raise_diagnostics(ctx, parsed)
    uses_barrier = bool(used & _BARRIERS)
    step = FunctionSpec(parsed.name, f"{RESERVED_PREFIX}step", tuple(names), tuple(body), parsed.filename,
                        parsed.tree.lineno, norm.thread_varying,
                        frozenset(i for i, p in enumerate(names) if p in norm.array_uses),
                        frozenset(i for i, p in enumerate(names) if p in norm.written),
                        {i: norm.arity[p][0] for i, p in enumerate(names) if p in norm.arity},
                        atomic_params=frozenset(i for i, p in enumerate(names) if p in norm.atomic),
                        has_parallel_loop=any(isinstance(n, ast.For) and marker_of(n.iter) in _PARALLEL_LOOPS
                                              for st in body for n in ast.walk(st)))
    return StepSpec(
        name=parsed.name, filename=parsed.filename, lineno=parsed.tree.lineno, index_param=index_param,
        params=tuple(ParamSpec(p, k, norm.arity.get(p, (0, 0))[0], norm.arity.get(p, (0, 0))[1], p in norm.written,
                               p in norm.atomic, *norm.fewest.get(p, (0, 0)),
                               integer_line=norm.integer_uses[p].lineno if p in norm.integer_uses else 0,
                               index_line=norm.index_uses[p].lineno if p in norm.index_uses else 0,
                               shape_ndim=norm.shape_dims.get(p, (0, 0))[0],
                               shape_line=norm.shape_dims.get(p, (0, 0))[1])
                     for p, k in zip(params, kinds)), step=step,
        helpers=tuple(ctx.helpers.values()), returns_condition=bool(with_value), swap=tuple(swap_idx),
        uses_barrier=uses_barrier, parallel=parallel)


def _report_param_stores(parsed, ctx, norm, index_param, swapped):
    """A value assigned to one of the step's parameters is lost when the step ends (each step
    gets the arguments again), so such an assignment is a mistake: say what to do instead."""
    for node in norm.param_stores:
        name = node.id
        if name == index_param:
            msg = (f"'{name}' is the step index, a parameter of the step: parameters are inputs, and a value "
                   f"assigned to it is lost when the step ends (the loop counts the steps itself)")
            hint = f"use a new local name, e.g. `k = {name} + 1`"
        elif name in norm.array_uses or name in swapped:
            msg = (f"'{name}' is a parameter of the step: parameters are inputs, and assigning to it rebinds the "
                   f"name for the rest of this step only (the caller's array is unchanged)")
            hint = f"write into its elements instead (`{name}[i] = ...`), or use a new local name"
        else:
            msg = (f"'{name}' is a parameter of the step: parameters are inputs, and a value assigned to it is "
                   f"lost when the step ends")
            hint = (f"to return a number, pass a 1-element array and write `{name}[0] = ...` (guarded by "
                    f"`if lk.thread_id() == 0:`)")
        ctx.diagnostics.append(parsed.diagnostic(node, ctx.step_name, msg, hint))


def _check_swap(parsed, ctx, params, swap):
    def bad(msg, hint="name two array parameters of the step, e.g. swap=[('u', 'v')]"):
        ctx.diagnostics.append(parsed.diagnostic(parsed.tree, ctx.step_name, f"swap={swap!r}: {msg}", hint))

    out, used = [], set()
    try:
        pairs = list(swap or ())
    except TypeError:
        bad("expected a list of (name, name) pairs")
        return []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            bad(f"{pair!r} is not a pair of parameter names")
            continue
        a, b = pair
        missing = [x for x in pair if x not in params]
        if missing:
            bad(f"'{missing[0]}' is not a parameter of the step (parameters after the step index: "
                f"{', '.join(params) or 'none'})")
            continue
        if a == b:
            bad(f"a pair must name two different parameters, got ('{a}', '{b}')")
            continue
        if a in used or b in used:
            bad(f"'{a if a in used else b}' appears in more than one swap pair")
            continue
        used.update(pair)
        out.append((params.index(a), params.index(b)))
    return out
