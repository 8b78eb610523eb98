"""Validate a step function against the restricted-Python rules and normalize it.

Two passes over each function:

1. :class:`_Normalizer` walks a copy of the AST with an allow-list. It resolves every free
   name (the in-step API, ``math``, NumPy casts, helper functions, global numbers), rewrites
   them into the normalized form described in :mod:`loopkern.spec`, and records a
   :class:`~loopkern.errors.Diagnostic` for everything that is not allowed.
2. :class:`_Uniformity` (the step only) tracks which local values can differ between threads
   and rejects barriers, reductions and ``return`` under control flow that depends on them,
   since some threads would wait at a barrier the others never reach.

All problems of a function (and its helpers) are reported together in one
:class:`~loopkern.errors.StepSyntaxError`.
"""

from __future__ import annotations

import ast
import builtins
import copy
import math
import types

import numpy as np

from . import dsl
from .errors import Diagnostic, StepSyntaxError
from .frontend import ParsedFunction, parse_step
from .spec import (ANY, ARRAY, HELPER_PREFIX, INTRINSIC_PREFIX, RESERVED_PREFIX, SCALAR, FunctionSpec,
                   ParamSpec, StepSpec)

_BUILTINS = {"abs", "min", "max", "int", "float", "bool", "len", "range", "round"}
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
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift,
           ast.RShift, ast.BitOr, ast.BitXor, ast.BitAnd)
_CMPOPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_BARRIERS = {"sync", "sum", "max", "min"}
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


def _assigned_names(fn: ast.FunctionDef) -> set[str]:
    names = {a.arg for a in fn.args.args + fn.args.posonlyargs + fn.args.kwonlyargs}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


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
        self.written: set[str] = set()
        self.rng_sites = 0
        self.scalar_uses: dict[str, ast.AST] = {}
        self.thread_varying = False

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
        if not isinstance(v, ast.Call):
            self.error(node, "an expression statement has no effect in step code", "assign it or remove it")
            return None
        node.value = self.visit(v)
        return node

    def _check_store(self, target):
        if isinstance(target, ast.Name):
            self._check_name_allowed(target)
            return target
        if isinstance(target, ast.Tuple):
            target.elts = [self._check_store(e) for e in target.elts]
            return target
        if isinstance(target, ast.Subscript):
            if not isinstance(target.value, ast.Name):
                return self.reject(target, "only a named array can be assigned into",
                                   "write 'a[i] = ...' where 'a' is an array argument")
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
        node.targets = [self._check_store(t) for t in node.targets]
        node.value = self.visit(node.value)
        return node

    def visit_AugAssign(self, node):
        node.target = self._check_store(node.target)
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
        if kind == "lk.grid":
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
            node.value = self.visit(node.value)
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
                               "define it before the step, or pass it as an argument")
        const = _constant_node(value, node)
        if const is not None:
            return const
        what = self._describe(value)
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
            if ok and isinstance(base, types.ModuleType) and hasattr(base, node.attr):
                return True, getattr(base, node.attr)
        return False, None

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
            node.value = self.visit(node.value)
            node.slice = self._index(node.slice)
            return node
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
            k = arity if arity is not None else (len(idx.elts) if isinstance(idx, ast.Tuple) else 1)
            if k > self.arity.get(name, (0, 0))[0]:
                self.arity[name] = (k, node.lineno)

    def _index(self, idx):
        if isinstance(idx, ast.Tuple):
            idx.elts = [self._scalar(e) for e in idx.elts]
            return idx
        return self._scalar(idx)

    def _use_array(self, name_node):
        if name_node.id in self.params:
            self.array_uses.setdefault(name_node.id, name_node)

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
            if isinstance(node.func, ast.Attribute):
                return self.reject(node, f"method calls such as '{label}(...)' are not supported in step code",
                                   "use the allowed builtins, math.*, lk.* or a helper function")
            return self.reject(node, f"name '{label}' is not defined", "define the function at module level")
        if isinstance(target, dsl.Intrinsic):
            return self._intrinsic_call(node, target, label)
        if target is print:
            return self.reject(node, "print() is not supported in step code", "write values into an output array")
        if isinstance(target, types.BuiltinFunctionType) and getattr(target, "__module__", None) == "math" \
                or (getattr(target, "__self__", None) is math):
            if target.__name__ not in _MATH_FUNCS:
                return self.reject(node, f"math.{target.__name__} is not supported in step code",
                                   f"supported: {', '.join(sorted(_MATH_FUNCS))}")
            node.func = _module_attr("math", target.__name__, node)
            node.args = [self._scalar(a) for a in node.args]
            return node
        if isinstance(target, type) and issubclass(target, np.generic):
            name = target.__name__
            if name not in _NUMPY_CASTS:
                return self.reject(node, f"numpy.{name} is not supported in step code",
                                   f"use one of: {', '.join(sorted(_NUMPY_CASTS))}")
            if len(node.args) != 1:
                return self.reject(node, f"numpy.{name}() takes one argument in step code", f"write numpy.{name}(x)")
            node.func = _module_attr("np", name, node)
            node.args = [self._scalar(a) for a in node.args]
            return node
        if isinstance(node.func, ast.Name) and node.func.id in _BUILTINS and target is getattr(builtins, node.func.id):
            if target is builtins.range:
                return self.reject(node, "range() can only be the iterable of a for loop", "write 'for k in range(...):'")
            node.args = [self._scalar(a) if target is not len else self.visit(a) for a in node.args]
            if target is len and node.args and isinstance(node.args[0], ast.Name):
                self._use_array(node.args[0])
            return node
        if isinstance(target, types.BuiltinFunctionType) or isinstance(target, type):
            return self.reject(node, f"'{label}' ({self._describe(target)}) cannot be called in step code",
                               "allowed: arithmetic, math.*, abs/min/max/int/float/bool/len, NumPy casts, "
                               "lk.*, and plain helper functions")
        if isinstance(target, types.FunctionType):
            return self._helper_call(node, target, label)
        return self.reject(node, f"'{label}' ({self._describe(target)}) cannot be called in step code",
                           "call plain Python functions that are themselves valid step code")

    def _intrinsic_call(self, node, target, label):
        name = target.name
        if name in ("random_uniform", "random_normal"):
            return self._random_call(node, target)
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

    def _random_call(self, node, target):
        if not self.is_step:
            return self.reject(node, f"{target.display}() can only be called in the step function itself, not in "
                                     f"a helper", "draw in the step and pass the number to the helper")
        if not 1 <= len(node.args) <= 2:
            return self.reject(node, f"{target.display}() takes a key and an optional subkey, got "
                                     f"{len(node.args)} arguments", f"write {target.display}(i) or {target.display}(i, k)")
        args = [self._scalar(a) for a in node.args]
        if len(args) == 1:
            args.append(ast.copy_location(ast.Constant(0), node))
        self.rng_sites += 1    # each call site draws its own numbers
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
                    if spec.param_arity.get(i):
                        self._indexed(a.id, None, node, arity=spec.param_arity[i])
        if spec.thread_varying:
            self.thread_varying = True
        node.func = ast.copy_location(ast.Name(id=spec.symbol, ctx=ast.Load()), node.func)
        node.helper = spec  # read by the uniformity pass
        return node


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
        parsed = parse_step(fn)
    except StepSyntaxError as exc:
        d = exc.diagnostics[0]
        caller.error(call_node, f"cannot use helper '{fn.__name__}': {d.message}", d.hint)
        return None
    ctx.in_progress[key] = fn.__name__
    _check_signature(parsed, ctx, is_step=False)
    norm = _Normalizer(ctx, parsed, is_step=False)
    tree = copy.deepcopy(parsed.tree)
    body = norm.visit_body(tree.body)
    params = tuple(norm.params)
    spec = FunctionSpec(fn.__name__, ctx.symbol_for(fn.__name__), params, tuple(body), parsed.filename,
                        parsed.tree.lineno, norm.thread_varying,
                        frozenset(i for i, p in enumerate(params) if p in norm.array_uses),
                        frozenset(i for i, p in enumerate(params) if p in norm.written),
                        {i: norm.arity[p][0] for i, p in enumerate(params) if p in norm.arity})
    del ctx.in_progress[key]
    ctx.helpers[key] = spec
    return spec


class _Uniformity:
    """Which values may differ between threads, and where barriers would deadlock.

    A value is thread-varying if it depends on the thread index, a parallel loop index, an
    array load, or a thread-varying helper result, or was assigned under thread-varying
    control flow. Reductions return the same value on every thread.
    """

    def __init__(self, ctx: _Context, parsed: ParsedFunction):
        self.ctx = ctx
        self.parsed = parsed
        self.seen: set[tuple] = set()
        self.loops: list[dict] = []

    def error(self, node, message, hint):
        key = (node.lineno, node.col_offset)   # the first (most direct) reason wins
        if key not in self.seen:
            self.seen.add(key)
            self.ctx.diagnostics.append(self.parsed.diagnostic(node, self.ctx.step_name, message, hint))

    # -- expressions -----------------------------------------------------------------------
    def varying(self, e, state) -> bool:
        if isinstance(e, ast.Name):
            return e.id in state
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            name = e.func.id
            if name == INTRINSIC_PREFIX + "thread_id":
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
            return True                              # an array load
        if isinstance(e, ast.Attribute):
            return False                             # x.shape, module constants
        return any(self.varying(c, state) for c in ast.iter_child_nodes(e) if isinstance(c, ast.expr))

    def check_barriers(self, e, state, reason):
        """Report barriers/reductions in ``e`` that not every thread would reach."""
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id.startswith(INTRINSIC_PREFIX):
            name = e.func.id[len(INTRINSIC_PREFIX):]
            if name in _BARRIERS and reason is not None:
                self.error(e, f"lk.{name}() {reason[0]}: threads that skip it would leave the others "
                              f"waiting forever (deadlock)", reason[1])
        if isinstance(e, ast.IfExp):
            self.check_barriers(e.test, state, reason)
            r = reason or (("is in a conditional expression whose test differs between threads",
                            "compute it unconditionally before the expression") if self.varying(e.test, state) else None)
            self.check_barriers(e.body, state, r)
            self.check_barriers(e.orelse, state, r)
            return
        if isinstance(e, ast.BoolOp):
            r = reason
            for v in e.values:
                self.check_barriers(v, state, r)
                if r is None and self.varying(v, state):
                    r = ("is on the short-circuit side of 'and'/'or' after a thread-varying operand",
                         "compute it unconditionally first")
            return
        for c in ast.iter_child_nodes(e):
            if isinstance(c, ast.expr):
                self.check_barriers(c, state, reason)

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
            for t in s.targets:
                if isinstance(t, ast.Tuple) and isinstance(s.value, ast.Tuple) and len(t.elts) == len(s.value.elts):
                    flags = [self.varying(v, state) for v in s.value.elts]
                    for tt, f in zip(t.elts, flags):
                        self.assign(tt, f, state, reason)
                else:
                    if isinstance(t, ast.Subscript):
                        self.check_barriers(t.slice, state, reason)
                    self.assign(t, self.varying(s.value, state), state, reason)
        elif isinstance(s, ast.AugAssign):
            self.check_barriers(s.value, state, reason)
            if isinstance(s.target, ast.Name):
                self.assign(s.target, s.target.id in state or self.varying(s.value, state), state, reason)
        elif isinstance(s, ast.Expr):
            self.check_barriers(s.value, state, reason)
        elif isinstance(s, ast.Return):
            if s.value is not None:
                self.check_barriers(s.value, state, reason)
            if reason is not None:
                self.error(s, f"'return' {reason[0]}: every thread must stop at the same step",
                           "compute the condition with a reduction (e.g. lk.max) and return it at the top level")
            elif s.value is not None and self.varying(s.value, state):
                self.error(s.value, "the step's return value can differ between threads; the loop must "
                                    "continue or stop on every thread together",
                           "reduce it first, e.g. 'return lk.max(err) > tol'")
        elif isinstance(s, ast.If):
            self.check_barriers(s.test, state, reason)
            r = reason
            if r is None and self.varying(s.test, state):
                r = (f"is under an 'if' at line {s.lineno} whose condition differs between threads",
                     "move it out of the 'if' (compute on every thread, use the result conditionally)")
            a = self.block(s.body, state, r)
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
        if isinstance(s, ast.For):
            self.check_barriers(s.iter, state, reason)
            if s.iter.func.id in (INTRINSIC_PREFIX + "range", INTRINSIC_PREFIX + "grid"):
                own = (f"is inside the parallel loop at line {s.lineno}, where threads run different "
                       f"numbers of iterations", "move it after the loop (the loop is each thread's share of the work)")
            elif any(self.varying(a, state) for a in s.iter.args):
                own = (f"is inside a loop at line {s.lineno} whose bounds differ between threads",
                       "loop over bounds that are the same on every thread")
        targets = [] if isinstance(s, ast.While) else (
            [s.target] if isinstance(s.target, ast.Name) else list(s.target.elts))
        early_exit = None
        cur = set(state)
        while True:   # to a fixpoint: the varying set and the reasons only grow
            if isinstance(s, ast.While):
                self.check_barriers(s.test, cur, reason)
                if own is None and self.varying(s.test, cur):
                    own = (f"is inside a while loop at line {s.lineno} whose condition differs between threads",
                           "reduce the condition first (e.g. with lk.max)")
            r = reason or own or early_exit
            body_in = set(cur)
            for t in targets:
                (body_in.add if r else body_in.discard)(t.id)
            frame = {"reason": r, "varying_exit": False}
            self.loops.append(frame)
            out = self.block(s.body, body_in, r)
            self.loops.pop()
            new = cur | out
            changed = new != cur
            cur = new
            if frame["varying_exit"] and early_exit is None:
                early_exit = ("is inside a loop that some threads leave early (break/continue under a "
                              "thread-varying condition)", "make the exit condition the same on every thread")
                changed = True
            if isinstance(s, ast.While) and own is None and self.varying(s.test, cur):
                changed = True
            if not changed:
                return cur


def _returns(body):
    for node in ast.walk(ast.Module(body=list(body), type_ignores=[])):
        if isinstance(node, ast.Return):
            yield node


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
        kinds.append(ARRAY if p in norm.array_uses or p in swapped else SCALAR if p in norm.scalar_uses else ANY)

    rets = list(_returns(body))
    with_value = [r for r in rets if r.value is not None]
    for r in rets:
        if r.value is None and with_value:
            ctx.diagnostics.append(parsed.diagnostic(
                r, ctx.step_name, f"this 'return' has no value, but the return at line {with_value[0].lineno} "
                                  f"returns a condition", "return the condition (True to continue) on every path"))
    _Uniformity(ctx, parsed).block(body, set(), None)

    if ctx.diagnostics:
        ctx.diagnostics.sort(key=lambda d: (d.filename != parsed.filename, d.filename, d.line, d.col))
        raise StepSyntaxError(ctx.diagnostics)
    def markers(stmts):
        return {n.func.id[len(INTRINSIC_PREFIX):] for n in ast.walk(ast.Module(body=list(stmts), type_ignores=[]))
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id.startswith(INTRINSIC_PREFIX)}
    used = markers(body).union(*(markers(h.body) for h in ctx.helpers.values()))
    uses_barrier = bool(used & _BARRIERS)
    step = FunctionSpec(parsed.name, f"{RESERVED_PREFIX}step", tuple(names), tuple(body), parsed.filename,
                        parsed.tree.lineno, norm.thread_varying,
                        frozenset(i for i, p in enumerate(names) if p in norm.array_uses))
    return StepSpec(
        name=parsed.name, filename=parsed.filename, lineno=parsed.tree.lineno, index_param=index_param,
        params=tuple(ParamSpec(p, k, norm.arity.get(p, (0, 0))[0], norm.arity.get(p, (0, 0))[1], p in norm.written)
                     for p, k in zip(params, kinds)), step=step,
        helpers=tuple(ctx.helpers.values()), returns_condition=bool(with_value), swap=tuple(swap_idx),
        uses_barrier=uses_barrier, parallel=bool(used))


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
