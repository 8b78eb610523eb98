"""Helper calls inlined into a step, for the steps generated from it (tangent and adjoint).

The derivative rules (``loopkern/tangent.py``, ``loopkern/adjoint.py``) work on one function's
expressions. A helper in expression form, a function whose body is assignments to locals and
then one ``return`` (``def flux(a, b): d = b - a; return 0.5 * (a + b) - c * d``), is replaced
at each call by its returned expression, with the call's arguments and the locals' values put
in for their names. Its expressions are pure (no draws, no atomic updates), so putting an
argument in twice only computes it twice. The primal kernel still calls the helper; only the
generated steps see the inlined form. Any other helper stays a call, and the derivative rules
refuse it at its line as before.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import types

from .errors import StepSyntaxError

#: helpers calling helpers are inlined to at most this depth
MAX_DEPTH = 8


def inline_helpers(parsed):
    """``parsed`` (a ParsedFunction) with every call of a helper in expression form replaced
    by the helper's returned expression (see the module docstring)."""
    tree = copy.deepcopy(parsed.tree)
    tree.body = [_Inliner(parsed, 0).visit(st) for st in tree.body]
    ast.fix_missing_locations(tree)
    return dataclasses.replace(parsed, tree=tree)


class _Inliner(ast.NodeTransformer):
    def __init__(self, parsed, depth):
        self.parsed = parsed
        self.depth = depth
        # the caller's own names: a helper's global that one of them shadows would mean
        # something else once inlined
        self.caller_locals = {a.arg for a in parsed.tree.args.args} | {
            n.id for n in ast.walk(parsed.tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

    def visit_Call(self, node):
        self.generic_visit(node)            # the arguments' own helper calls first
        if not isinstance(node.func, ast.Name) or node.keywords or self.depth >= MAX_DEPTH or \
                any(isinstance(a, ast.Starred) for a in node.args):
            return node
        found, fn = self.parsed.lookup(node.func.id)
        if not found or not isinstance(fn, types.FunctionType) or (fn.__module__ or "").startswith("loopkern"):
            return node
        form = _expression_form(fn, self.parsed, self.depth, self.caller_locals)
        if form is None or len(form[0]) != len(node.args):
            return node
        params, expr = form
        if any(_calls_lk_atomic(a) for a in node.args):
            return node
        out = _substitute(expr, dict(zip(params, node.args)))
        for n in ast.walk(out):             # errors in what was inlined point at the call
            ast.copy_location(n, node)
        return out


def _expression_form(fn, parsed, depth, caller_locals):
    """(parameter names, the returned expression in terms of them) of helper ``fn``, or None
    when it is not in expression form, reads a global that means something else where it is
    called (another object in the caller's module, or a local of the caller), or calls
    anything but pure functions."""
    from .frontend import parse_helper
    try:
        helper = parse_helper(parsed, fn)
    except (StepSyntaxError, OSError, TypeError):
        return None
    a = helper.tree.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.defaults or a.posonlyargs:
        return None
    params = [p.arg for p in a.args]
    body = helper.tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]                                             # a docstring
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    inlined = [_Inliner(helper, depth + 1).visit(copy.deepcopy(st)) for st in body]
    local_names = set(params)
    env = {p: ast.Name(id=p, ctx=ast.Load()) for p in params}
    for st in inlined[:-1]:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
            return None
        if not _pure(helper, st.value, local_names, parsed, caller_locals):
            return None
        env[st.targets[0].id] = _substitute(st.value, env)
        local_names.add(st.targets[0].id)
    ret = inlined[-1].value
    if not _pure(helper, ret, local_names, parsed, caller_locals):
        return None
    return params, _substitute(ret, env)


def _pure(helper, e, local_names, parsed, caller_locals) -> bool:
    """Whether ``e`` (in ``helper``) reads only its locals and globals that mean the same
    object where it is called (``parsed``'s module, not shadowed by ``caller_locals``), and
    calls only functions of ``math``, ``numpy`` or builtins."""
    for n in ast.walk(e):
        if isinstance(n, (ast.NamedExpr, ast.Lambda, ast.Await, ast.Yield, ast.YieldFrom)):
            return False
        if isinstance(n, ast.Name) and n.id not in local_names:
            if n.id in caller_locals:
                return False
            found, value = helper.lookup(n.id)
            if not found:
                return False
            if (n.id not in parsed.read and n.id not in parsed.closure and n.id not in helper.closure
                    and helper.globals is parsed.globals):
                # the caller reads the same module global and has not read it yet: it will read
                # it as the helper did (at the decorator), not as the module holds it now
                parsed.read[n.id] = value
            found_here, value_here = parsed.lookup(n.id)
            if not found_here or value is not value_here:
                return False
        if isinstance(n, ast.Call):
            root = n.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if not isinstance(root, ast.Name):
                return False
            _, value = helper.lookup(root.id)
            module = getattr(value, "__name__", "") if isinstance(value, types.ModuleType) else \
                getattr(value, "__module__", None) or ""
            if not (module in ("math", "builtins") or module == "numpy" or module.startswith("numpy.")):
                return False
    return True


def _calls_lk_atomic(e) -> bool:
    """Whether ``e`` calls an ``lk.atomic`` update (an argument put in twice would update twice)."""
    for n in ast.walk(e):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("add", "max", "min") \
                and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "atomic":
            return True
    return False


def _substitute(e, env):
    """A copy of ``e`` with each load of a name in ``env`` replaced by a copy of its value."""
    class Sub(ast.NodeTransformer):
        def visit_Name(self, node):
            if isinstance(node.ctx, ast.Load) and node.id in env:
                return copy.deepcopy(env[node.id])
            return node
    return Sub().visit(copy.deepcopy(e))
