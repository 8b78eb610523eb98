"""Reverse-mode differentiation of a step: the adjoint step, source to source.

``adjoint_function(parsed, active)`` turns ``def step(t, u, v, alpha)`` into
``def step_vjp(t, u, u_bar, v, v_bar, alpha, alpha_bar)``: one step of the reverse sweep. Given
the state before the step (``u``, ``v``) and the adjoints of the state after it (``u_bar``,
``v_bar``; a float scalar's adjoint is a 1-element array that the step adds into), it leaves in
the ``_bar`` arrays the adjoints of the state before the step. A driver runs it backwards over
the steps (``loopkern/interop/jax_bridge.py`` under ``jax.grad``), renaming swap pairs' adjoints
as the forward run renamed the arrays: for each segment of the run, :func:`recorder_function`'s
step records the states and :func:`segment_adjoint_function`'s step runs the adjoint step over
them in reverse, each as one megakernel.

Each parallel loop's iteration recomputes its locals (renamed so that each assignment has
its own name), then walks its statements backwards: a store ``a[i] = e`` takes ``g =
a_bar[i]``, sets ``a_bar[i] = 0`` and adds ``g`` times the partial derivative of ``e`` to the
adjoint of each active value ``e`` reads (``lk.atomic.add`` for array elements and scalar
parameters, which other iterations may share; a plain ``+=`` for locals). The partial
derivatives come from the tangent rules of ``loopkern/tangent.py``. In the gather form (the
default, :func:`_gather_updates`) the additions into an array's adjoint at the loop's index
plus constant offsets become one loop over that adjoint's elements, first in its phase, that
sums each element's terms in one thread, followed by a barrier.

The loops' adjoints run in reverse order, with the step's ``lk.sync()`` barriers mirrored
between them. Each reads the primal values as its loop saw them: the state before the step,
or, for an array an earlier loop stored into (the phase before an ``lk.sync()``, or the
elements a thread stored itself), a version recomputed first into a scratch array (a copy of
the version before, then the loop again with its stores redirected there); the scratch
arrays are extra parameters of the adjoint step, one per version.

Covered for now: steps whose top level holds assignments (before the loops; one that depends
on the differentiated values is walked backwards after the loops, each thread adding its
share of the adjoint), ``lk.sync()`` between loops, and parallel loops (``lk.range``/``lk.grid``) whose bodies are
straight-line assignments and stores (conditional expressions included, and ``if``
statements whose branches assign locals defined before them and store array elements: each
becomes guarded assignments ``x = (e if taken else x)``, and each element stored one store of
the branch's value or, where no branch stores it, its own), where an array the loop stores
into is read in that loop only at the index it is stored at, and not after the store.
``lk.sum`` reductions are covered in the form ``r = f(lk.sum(acc))`` after the loop that
adds into ``acc`` (``acc += e``, also inside ``if``; ``acc`` starting at a value nothing
differentiated reaches): the adjoint step recomputes ``r`` (the loop again, then the sum),
and backwards sums the threads' shares of ``r``'s adjoint with ``lk.sum``, gives every
thread's ``acc`` the total times ``df/dS``, and each addend of each iteration that adjoint.
``r = f(lk.max(m))`` (``lk.min``) of a running max (``m = max(m, e)``, the only update of
``m`` in the loop before): the recomputation also counts each thread's values equal to its
``m``, and backwards every ``e`` equal to the result takes ``df/dS`` times the total over
their count (JAX's rule for its max reductions; the tangent step's, ``tangent.py``).
``lk.random`` draws have no derivative and draw what the step's draws drew.
``lk.atomic.add(a, k, e)`` (its old value unused; inside an ``if``, where the branch runs) gives ``e`` the
adjoint ``a_bar[k]``, which passes through. A scalar parameter's adjoint is summed in each
thread and added once at the end of the adjoint step. Where, within a phase of the adjoint
step, a single loop touches an adjoint array and only at its own index (a pointwise update),
its additions are plain ``+=`` instead of atomics (:func:`_own_element_updates`). An inner
``for k in range(...)`` loop with constant bounds is unrolled (up to
``UNROLL_MAX_STATEMENTS``); one with computed bounds is kept as a loop when its body assigns
locals (:meth:`_Adjoint.accumulating_loop`): where it only adds into locals assigned before it
(``s += e``: sums over neighbours, bodies, a radius given as an argument), the adjoint loop
recomputes each iteration and hands each addend its sum's adjoint; where it carries another
value (a recurrence, ``z = z + h * f(z)``), the adjoint walks the iterations backwards,
recomputing the carried values at the start of each from the loop's start (time quadratic in
the count, no memory). Anything else (other inner loops, other uses of ``lk.max``/``lk.min``,
``lk.atomic.max``/``min``, helpers other than in expression form (those are inlined first,
``loopkern/inline.py``), a ``return`` other than the last statement) raises
:class:`~loopkern.errors.StepSyntaxError` at its line. A step that returns a condition is
differentiated with its executed step count held: the adjoint step drops the ``return`` and
every assignment only it used (Jacobi's error and its ``lk.max``).
"""

from __future__ import annotations

import ast
import copy

from .tangent import (_mul, _Tangent, check_active, check_differentiated_stores, generated_step, running_extrema,
                      running_update, tie_update)
from .inline import inline_helpers
from .spec import int_constant, split_tuple_assignments
from .validate import tag_random_sites


#: the forms of an adjoint step (:func:`adjoint_function`): "gather" gives each element of a
#: stencil's adjoint the sum of its terms in one thread (:func:`_gather_updates`), the same
#: order in every run; "scatter" adds each term into the element it belongs to with atomics
ADJOINT_FORMS = ("gather", "scatter")

#: reverse mode unrolls an inner ``range`` loop with constant bounds into at most this many
#: statements
UNROLL_MAX_STATEMENTS = 256


class _Partial(_Tangent):
    """The tangent rules with one leaf (a Name or Subscript node, by identity) as the only
    active value, whose tangent is 1: ``d(e)`` is then the partial derivative of ``e``."""

    def __init__(self, base: _Tangent, focus):
        self.__dict__.update(base.__dict__)
        self.focus = focus

    def is_active(self, e, names) -> bool:
        if isinstance(e, (ast.Name, ast.Subscript)):
            return e is self.focus
        return super().is_active(e, names)

    def d(self, e, names):
        if e is self.focus:
            return ast.Constant(1.0)
        return super().d(e, names)


def _leaves(tg: _Tangent, e, names):
    """The active leaves of ``e`` (loads of active locals, parameters and array elements)."""
    out = []

    def walk(n):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in names:
            out.append(n)
        elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in names:
            out.append(n)
            return                                  # the index is an integer expression
        elif isinstance(n, ast.Call):
            if not tg.is_active(n, names):
                return                              # int(), lk.random draws, shapes ...
            for a in n.args:
                walk(a)
            return
        elif isinstance(n, (ast.Compare, ast.BoolOp)):
            return                                  # comparisons carry no derivative
        for c in ast.iter_child_nodes(n):
            walk(c)
    walk(e)
    return out


class _Adjoint:
    def __init__(self, parsed, active: set):
        self.parsed = parsed
        self.tg = _Tangent(parsed, active)
        self.active = set(active)
        self.bar = {}
        self.counter = 0
        self.flags = set()          # the locals holding an if branch's "taken" flag
        self.guarded = set()        # the locals holding a store's value inside a branch (guarded)
        self.scratch = []           # (scratch array parameter, the array it holds a version of)
        self.accumulators = set()   # locals the loops add into for an lk.sum after them
        self.scalar_acc = {}        # active scalar parameter -> the thread's local sum of its adjoint
        self.extrema = {}           # running extrema of the step (tangent.running_extrema)
        self.extremum_red = {}      # a running extremum an lk.max/min reduces -> that reduction
        self.ndims = _index_counts(parsed.tree)

    def error(self, node, what):
        return self.tg.error(node, f"reverse mode: {what}",
                             "the adjoint step covers parallel loops of straight-line assignments and stores")

    def bar_name(self, name):
        if name not in self.bar:
            b = f"{name}_bar"
            while b in self.tg.used:
                b += "_"
            self.tg.used.add(b)
            self.bar[name] = b
        return self.bar[name]

    def fresh(self, base):
        while True:
            self.counter += 1
            n = f"{base}_{self.counter}"
            if n not in self.tg.used:
                self.tg.used.add(n)
                return n

    def is_parallel(self, s):
        if not isinstance(s, ast.For) or not isinstance(s.iter, ast.Call):
            return False
        mod, attr = self.tg.module_of(s.iter.func)
        return mod == "lk" and attr in ("range", "grid")

    def is_sync(self, s):
        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and not s.value.args):
            return False
        mod, attr = self.tg.module_of(s.value.func)
        return mod == "lk" and attr == "sync"

    # -- the step --------------------------------------------------------------------------
    def step(self, body):
        """The adjoint step's body: the top-level assignments recomputed (every thread computes
        the same values), their adjoints zeroed, the values later loops read recomputed (see
        :meth:`versions`; ``lk.sum`` results too), the parallel loops' and reductions' adjoints
        in reverse order with the step's ``lk.sync()`` barriers mirrored between them, then the
        active top-level assignments walked backwards (each thread adds its share)."""
        fwd, items, assigned = [], [], []
        active = set(self.active)
        self.extrema = running_extrema(self.tg, body)
        for s in body:
            if self.is_parallel(s):
                items.append(("loop", s))
            elif self.is_sync(s):
                items.append(("sync", s))
            elif isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                name = s.targets[0].id
                if items:
                    calls = {self.tg.module_of(n.func) for n in ast.walk(s.value) if isinstance(n, ast.Call)}
                    in_loops = {n.id for kind, x in items if kind == "loop" for n in ast.walk(x)
                                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                    later = {r["name"] for kind, r in items if kind == "reduce"} | set(active) | in_loops
                    if not any(mod and mod.startswith("lk") for mod, _ in calls) and not _reads_any(s.value, later):
                        # a value that nothing differentiated reaches (a later accumulator's
                        # start, q = 0.0): recomputed where it stands, no adjoint
                        items.append(("plain", s))
                        continue
                    items.append(("reduce", self.reduction(s, items, fwd)))
                    continue
                if name in assigned and (name in active or self.tg.is_active(s.value, active)):
                    raise self.error(s, f"'{name}' is assigned twice at the top level of the step")
                assigned.append(name)
                if self.tg.is_active(s.value, active):
                    active.add(name)
                fwd.append(copy.deepcopy(s))
            elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant):
                continue                                # a docstring
            else:
                raise self.error(s, "this statement has no adjoint yet")
        loops = [s for kind, s in items if kind == "loop"]
        # a reduction's result is active if its accumulator (updated in a loop that reads
        # active values) or the rest of its expression is
        for kind, red in items:
            if kind == "reduce":
                # (an over-estimate: the loop reads something active)
                if _reads_any(red["loop"], active):
                    active.add(red["acc"])
                    active.add(red["sum"])
                if red["acc"] in active or self.tg.is_active(red["value"], active):
                    active.add(red["name"])
        tops = [s for s in fwd if s.targets[0].id in active]
        reduced = [red for kind, red in items if kind == "reduce" and red["name"] in active]
        zero = [_at(ast.Assign(targets=[ast.Name(id=self.bar_name(n), ctx=ast.Store())], value=ast.Constant(0.0)),
                    at) for n, at in [(s.targets[0].id, s) for s in tops] + [(r["name"], r["node"]) for r in reduced]]
        accumulating = {loops.index(red["loop"]) for kind, red in items if kind == "reduce"}
        chunks, reads_as = self.versions(loops, accumulating)
        for kind, red in items:
            if kind == "reduce" and red["op"] != "sum":
                # the recomputation counts each thread's values equal to its running max/min
                j = loops.index(red["loop"])
                for st in chunks[j]:
                    _count_ties(st, red["acc"], red["op"], red["ties"])
                zero.append(_at(ast.Assign(targets=[ast.Name(id=red["ties"], ctx=ast.Store())],
                                           value=ast.Constant(0.0)), red["node"]))
        recompute, j = [], 0
        for kind, s in items:
            if kind == "loop":
                recompute += chunks[j]
                j += 1
            elif kind == "reduce":
                recompute += s["recompute"]
            elif kind == "plain":
                recompute.append(copy.deepcopy(s))
        # The adjoints run in reverse order: a loop that stores an element an earlier loop read
        # (or also stored) takes that element's adjoint first, as the chain rule does; each
        # reads the primal values as they were when its loop ran (reads_as)
        back, j = [], len(loops)
        for kind, s in reversed(items):
            if kind == "sync":
                back.append(_at(self.sync_stmt(), s))
                continue
            if kind == "reduce":
                if s["name"] in active:
                    back += self.reduction_adjoint(s, active)
                continue
            if kind == "plain":
                continue
            j -= 1
            back.append(_read_versions(self.loop(s, active), reads_as[j]))
        for s in reversed(tops):
            g = ast.Name(id=self.bar_name(s.targets[0].id), ctx=ast.Load())
            back += self.scatter(s.value, g, active, s)
        # each thread's share of a scalar parameter's adjoint, added once at the top level
        # (where the CUDA backend sums a block's shares before updating: codegen.block_aggregated)
        at = body[-1]
        for name, acc in self.scalar_acc.items():
            zero.append(_at(ast.Assign(targets=[ast.Name(id=acc, ctx=ast.Store())], value=ast.Constant(0.0)), at))
            back.append(_at(self.atomic_add_stmt(self.bar_name(name), ast.Constant(0),
                                                 ast.Name(id=acc, ctx=ast.Load())), at))
        return fwd + zero + recompute + back

    def reduction(self, s, items, fwd):
        """A top-level assignment after the loops: ``r = f(lk.sum(acc))``, where ``acc`` starts
        at a value that does not depend on what is differentiated and only the loop just before
        updates it, as ``acc += e`` (an accumulator of the sum). Returns what the adjoint needs:
        the recomputation (``S = lk.sum(acc)``; ``r = f(S)``), the loop, the names."""
        sums = [n for n in ast.walk(s.value) if isinstance(n, ast.Call)
                and self.tg.module_of(n.func) in (("lk", "sum"), ("lk", "max"), ("lk", "min"))]
        loops = [x for kind, x in items if kind == "loop"]
        if len(sums) != 1 or len(sums[0].args) != 1 or not isinstance(sums[0].args[0], ast.Name) or not loops:
            raise self.error(s, "a top-level assignment after a parallel loop has an adjoint only as "
                                "r = f(lk.sum(acc)) (or lk.max/lk.min), acc a local the loop before updates")
        acc = sums[0].args[0].id
        op = self.tg.module_of(sums[0].func)[1]
        if op != "sum":
            kind, bad = self.extrema.get(acc, (op, sums[0]))
            if bad is not None:
                raise self.error(bad, f"lk.{op} has an adjoint only of a running {op}: a local set before the "
                                      f"loops and updated in them only as {acc} = {op}({acc}, e)")
        init = [x for x in fwd if x.targets[0].id == acc] + [x for kind, x in items
                                                             if kind == "plain" and x.targets[0].id == acc]
        if not init or self.tg.is_active(init[-1].value, set(self.active)):
            raise self.error(sums[0], f"'{acc}' must be set before the loops to a value that does not depend on "
                                      f"what is differentiated (e.g. {acc} = 0.0)")
        updating = [x for x in loops if acc in {n.id for n in ast.walk(x) if isinstance(n, ast.Name)
                                                and isinstance(n.ctx, ast.Store)}]
        if len(updating) != 1 or updating[0] is not loops[-1] or items[-1][0] != "loop" or \
                any(kind == "plain" and x.targets[0].id == acc for kind, x in items[items.index(("loop", loops[-1])):]):
            raise self.error(sums[0], f"'{acc}' must be added into by one loop, the one just before this "
                                      f"reduction")
        name = s.targets[0].id
        total = self.fresh(f"{acc}_sum")
        value = _replace_node(copy.deepcopy(s.value), sums[0], ast.Name(id=total, ctx=ast.Load()))
        lk = self.lk_name()
        rec = [_at(ast.Assign(targets=[ast.Name(id=total, ctx=ast.Store())], value=ast.Call(
                   func=ast.Attribute(value=ast.Name(id=lk, ctx=ast.Load()), attr="sum", ctx=ast.Load()),
                   args=[ast.Name(id=acc, ctx=ast.Load())], keywords=[])), s),
               _at(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=value), s)]
        self.accumulators.add(acc)
        red = dict(node=s, name=name, acc=acc, sum=total, value=value, loop=loops[-1], recompute=rec, op=op)
        if op != "sum":
            # the values equal to the result share its adjoint evenly (JAX's rule for its max
            # and min reductions): their count, from each thread's count of its ties
            red["ties"], red["count"] = self.fresh(f"{acc}_ties"), self.fresh(f"{acc}_count")
            rec[0].value.func.attr = op
            hit = ast.Compare(left=ast.Name(id=acc, ctx=ast.Load()), ops=[ast.Eq()],
                              comparators=[ast.Name(id=total, ctx=ast.Load())])
            rec.insert(1, _at(ast.Assign(targets=[ast.Name(id=red["count"], ctx=ast.Store())], value=ast.Call(
                func=ast.Attribute(value=ast.Name(id=lk, ctx=ast.Load()), attr="sum", ctx=ast.Load()),
                args=[ast.IfExp(test=hit, body=ast.Name(id=red["ties"], ctx=ast.Load()), orelse=ast.Constant(0.0))],
                keywords=[])), s))
            self.extremum_red[acc] = red
        return red

    def reduction_adjoint(self, red, active):
        """``r = f(S)``, ``S = lk.sum(acc)``, backwards: the threads' shares of r's adjoint are
        summed (a reduction: every thread computed the same r), S's adjoint is that total times
        df/dS, and every thread's accumulator gets it (dS/dacc = 1 for each thread's acc); the
        rest of f's inputs get each thread's share."""
        lk = self.lk_name()
        node, name, acc, total, value = red["node"], red["name"], red["acc"], red["sum"], red["value"]
        tot = self.fresh(f"{name}_bar_total")
        out = [_at(ast.Assign(targets=[ast.Name(id=tot, ctx=ast.Store())], value=ast.Call(
            func=ast.Attribute(value=ast.Name(id=lk, ctx=ast.Load()), attr="sum", ctx=ast.Load()),
            args=[ast.Name(id=self.bar_name(name), ctx=ast.Load())], keywords=[])), node)]
        out.append(_at(ast.Assign(targets=[ast.Name(id=self.bar_name(total), ctx=ast.Store())],
                                  value=ast.Constant(0.0)), node))
        out += self.scatter(value, ast.Name(id=tot, ctx=ast.Load()), active, node, only={total})
        out += self.scatter(value, ast.Name(id=self.bar_name(name), ctx=ast.Load()), active, node,
                            exclude={total})
        share = ast.Name(id=self.bar_name(total), ctx=ast.Load())
        if red["op"] != "sum":
            # each value equal to the max/min takes S's adjoint over their count
            red["share"] = self.fresh(f"{acc}_share")
            share = ast.BinOp(left=share, op=ast.Div(), right=ast.Call(
                func=ast.Name(id="max", ctx=ast.Load()), args=[ast.Name(id=red["count"], ctx=ast.Load()),
                                                             ast.Constant(1.0)], keywords=[]))
            out.append(_at(ast.Assign(targets=[ast.Name(id=red["share"], ctx=ast.Store())], value=share), node))
            return out
        out.append(_at(ast.Assign(targets=[ast.Name(id=self.bar_name(acc), ctx=ast.Store())], value=share), node))
        return out

    def sync_stmt(self):
        lk = self.lk_name()
        return ast.Expr(value=ast.Call(func=ast.Attribute(value=ast.Name(id=lk, ctx=ast.Load()), attr="sync",
                                                          ctx=ast.Load()), args=[], keywords=[]))

    def versions(self, loops, accumulating=frozenset()):
        """(statements recomputing what later loops read, per loop the scratch array to read
        for each array it reads as an earlier loop of the step left it).

        Each loop's adjoint recomputes its values from the state before the step (the arguments,
        or the recorded states). Where a loop reads an array that an earlier loop stored into
        (the next phase after ``lk.sync()``, or an element the same thread stored), that
        version is recomputed first into a scratch array of its own: a copy of the version
        before (the loop may store only some elements), then the loop run again with its stores
        into that array only (its other stores left out), each part behind ``lk.sync()``. The
        scratch arrays are extra parameters of the adjoint step (:attr:`scratch`)."""
        stores = [_array_stores(s) for s in loops]
        reads = [{name for name, _ in _array_reads(s)} for s in loops]
        needed = set()                               # (loop, array): a version a later loop reads
        for j, rd in enumerate(reads):
            for a in rd:
                last = max((i for i in range(j) if a in stores[i]), default=None)
                if last is not None:
                    needed.add((last, a))
        # a version holds the whole array: every earlier loop's stores into it are recomputed
        # too (the heat step's interior and boundary loops both store v)
        for a in {a for _, a in needed}:
            kmax = max(k for k, b in needed if b == a)
            needed |= {(i, a) for i in range(kmax) if a in stores[i]}
        names, reads_as, current = {}, [], {}
        chunks = []
        for i, s in enumerate(loops):
            reads_as.append(dict(current))
            mine = sorted(a for (k, a) in needed if k == i)
            out = []
            chunks.append(out)
            if not mine:
                if i in accumulating:
                    # the loop again for its accumulators only (an lk.sum after it): no store
                    redo = _read_versions(copy.deepcopy(s), current)
                    out.append(_keep_stores(redo, {}, current))
                for a in stores[i]:
                    current.pop(a, None)             # not read again before another loop stores it
                continue
            for a in mine:
                names[(i, a)] = self.fresh(f"{a}_after")
                self.scratch.append((names[(i, a)], a))
                out.append(_at(self.copy_loop(names[(i, a)], current.get(a, a), a), s))
            out.append(_at(self.sync_stmt(), s))
            redo = _read_versions(copy.deepcopy(s), current)
            _keep_stores(redo, {a: names[(i, a)] for a in mine}, current)
            out.append(redo)                         # (its accumulators too)
            out.append(_at(self.sync_stmt(), s))
            for a in stores[i]:
                if a in mine:
                    current[a] = names[(i, a)]
                else:
                    current.pop(a, None)
        return chunks, reads_as

    def copy_loop(self, dst, src, like):
        """``for k... in lk.grid(like.shape...): dst[k...] = src[k...]``, as many indices as the
        step uses on ``like``."""
        ndim = self.ndims.get(like)
        if ndim is None:
            raise self.error(self.parsed.tree, f"'{like}' is indexed with different numbers of indices")
        lk = self.lk_name()
        ks = [self.fresh("k") for _ in range(ndim)]
        text = (f"for {', '.join(ks)} in {lk}.grid({', '.join(f'{like}.shape[{d}]' for d in range(ndim))}):\n"
                f"    {dst}[{', '.join(ks)}] = {src}[{', '.join(ks)}]") if ndim > 1 else \
            f"for {ks[0]} in {lk}.range({like}.shape[0]):\n    {dst}[{ks[0]}] = {src}[{ks[0]}]"
        return ast.parse(text).body[0]

    def straight(self, stmts, defined, guard=None):
        """``stmts`` as straight-line assignments: ``x op= e`` becomes ``x = x op e``, and an
        ``if`` whose branches assign only locals defined before it becomes guarded assignments
        ``x = (e if c else x)`` (the test kept in a local of its own, evaluated once).

        A store ``a[k] = e`` inside a branch becomes a guarded local ``s = (e if taken else
        a[k])`` where it stands (``e`` evaluated only when the branch runs, with the locals it
        sees there), and after the whole ``if`` one store ``a[k] = (s1 if taken1 else s2)``
        per element stored, chaining the branches that store it: an element no branch taken
        stores keeps its value, as in the step. A branch may store an element once and may not
        read an array after storing into it (the store moves to the end of the ``if``)."""
        out = []
        for st in stmts:
            if isinstance(st, ast.For):
                if self.unrollable(st):
                    out += self.straight(self.unrolled(st), defined, guard)
                else:
                    out.append(self.accumulating_loop(st, defined, guard))
                continue
            if isinstance(st, ast.AugAssign):
                load = copy.deepcopy(st.target)
                for n in ast.walk(load):
                    if hasattr(n, "ctx"):
                        n.ctx = ast.Load()
                st = ast.copy_location(ast.Assign(targets=[st.target], value=ast.BinOp(
                    left=load, op=st.op, right=st.value)), st)
            if isinstance(st, ast.If):
                # each branch gets a flag: its test, and the enclosing branch's flag
                for branch, taken in ((st.body, True), (st.orelse, False)):
                    if not branch:
                        continue
                    flag = self.fresh("taken")
                    self.flags.add(flag)
                    test = copy.deepcopy(st.test) if taken else ast.UnaryOp(op=ast.Not(), operand=copy.deepcopy(st.test))
                    if guard is not None:
                        test = ast.BoolOp(op=ast.And(), values=[ast.Name(id=guard, ctx=ast.Load()), test])
                    # the test is evaluated before either branch: both flags come first
                    out.append(_at(ast.Assign(targets=[ast.Name(id=flag, ctx=ast.Store())], value=test), st))
                    defined.add(flag)
                    st_branch = (branch, flag)
                    if taken:
                        then_part = st_branch
                    else:
                        else_part = st_branch
                stores = {}                 # (array, index) -> [(flag, guarded local, store)], in order
                # the stores move to the end of the if: their indices must mean the same there
                assigned_in_if = {n.id for n in ast.walk(st)
                                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                for part in ([then_part] if st.body else []) + ([else_part] if st.orelse else []):
                    branch, flag = part
                    stored_here = set()
                    for b in self.straight(branch, defined, flag):
                        if getattr(b, "_lk_guard", None) is not None:
                            out.append(b)               # an lk.atomic update, guarded by its flag
                            continue
                        tgt = b.targets[0]
                        for n in ast.walk(b.value):
                            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) \
                                    and n.value.id in stored_here:
                                raise self.error(b, f"'{n.value.id}' is read after a store into it in the same "
                                                    f"branch of an 'if'")
                        if isinstance(tgt, ast.Name) and (tgt.id in self.flags or tgt.id in self.guarded):
                            out.append(b)               # a nested if's flag or store value: already guarded
                            continue
                        if isinstance(tgt, ast.Subscript):
                            if not isinstance(tgt.value, ast.Name):
                                raise self.error(b, "a store into something other than a named array")
                            moved = sorted({n.id for n in ast.walk(tgt.slice) if isinstance(n, ast.Name)}
                                           & assigned_in_if)
                            if moved:
                                raise self.error(b, f"the index of a store inside an 'if' uses '{moved[0]}', which "
                                                    f"the 'if' assigns; compute the index before the 'if'")
                            key = (tgt.value.id, ast.dump(tgt.slice))
                            if key in stores and any(f == flag for f, _, _ in stores[key]):
                                raise self.error(b, f"'{tgt.value.id}' is stored twice at one index in one branch "
                                                    f"of an 'if'")
                            local = self.fresh(f"{tgt.value.id}_new")
                            old = ast.Subscript(value=ast.Name(id=tgt.value.id, ctx=ast.Load()),
                                                slice=copy.deepcopy(tgt.slice), ctx=ast.Load())
                            out.append(_at(ast.Assign(targets=[ast.Name(id=local, ctx=ast.Store())], value=ast.IfExp(
                                test=ast.Name(id=flag, ctx=ast.Load()), body=b.value, orelse=old)), b))
                            defined.add(local)
                            self.guarded.add(local)
                            stores.setdefault(key, []).append((flag, local, b))
                            stored_here.add(tgt.value.id)
                            continue
                        if tgt.id not in defined and tgt.id not in self.accumulators:
                            raise self.error(b, f"'{tgt.id}' is first assigned inside an 'if'; assign it before")
                        if not (isinstance(b.value, ast.IfExp) and isinstance(b.value.test, ast.Name)
                                and b.value.test.id == flag):
                            b.value = _at(ast.IfExp(test=ast.Name(id=flag, ctx=ast.Load()), body=b.value,
                                                    orelse=ast.Name(id=tgt.id, ctx=ast.Load())), b)
                        out.append(b)
                for key, chain in stores.items():
                    # the last branch's local falls back to the element itself; each earlier
                    # one is taken where its flag holds (the branches exclude each other)
                    _, last, first_store = chain[-1]
                    value = ast.Name(id=last, ctx=ast.Load())
                    for flag, local, _ in reversed(chain[:-1]):
                        value = ast.IfExp(test=ast.Name(id=flag, ctx=ast.Load()),
                                          body=ast.Name(id=local, ctx=ast.Load()), orelse=value)
                    tgt = copy.deepcopy(chain[0][2].targets[0])
                    out.append(_at(ast.Assign(targets=[tgt], value=value), chain[0][2]))
                continue
            atomic = self.atomic_of(st)
            if atomic is not None:
                if guard is not None:
                    # the update happens where the branch runs: its adjoint is taken there only
                    # (its index may lie outside the array elsewhere)
                    st = copy.deepcopy(st)
                    st._lk_guard = guard
                out.append(st)
                continue
            if not isinstance(st, ast.Assign) or len(st.targets) != 1 or \
                    not isinstance(st.targets[0], (ast.Name, ast.Subscript)):
                raise self.error(st, "this statement inside a parallel loop has no adjoint yet")
            for n in ast.walk(st.value):
                if isinstance(n, ast.Call) and self.tg.module_of(n.func)[0] == "lk.atomic":
                    raise self.error(n, "the old value an lk.atomic update returns has no adjoint yet")
            if guard is None and isinstance(st.targets[0], ast.Name):
                defined.add(st.targets[0].id)
            out.append(st)
        return out

    def unrollable(self, st):
        """Whether ``st`` is ``for k in range(...)`` with constant bounds, small enough to unroll."""
        bounds = _range_args(st)
        return bool(bounds) and all(isinstance(b, ast.Constant) and isinstance(b.value, int) for b in bounds) and \
            len(range(*[b.value for b in bounds])) * len(st.body) <= UNROLL_MAX_STATEMENTS

    def accumulating_loop(self, st, defined, guard):
        """``st``, an inner ``for k in range(...)`` loop that is not unrolled (computed bounds, or
        too many iterations), checked and marked for :meth:`inner_ssa`. Its body assigns locals
        (``x = e``, ``x op= e``) and stores nothing. A local assigned before the loop and again
        in it is carried from one iteration to the next; the others are the iteration's own
        (assigned before they are read, in the same iteration, and read nowhere after the loop).

        When every carried local is a sum (``s += e``, ``s -= e``, not read in the loop
        otherwise), each iteration's terms enter the final sums once, whatever the other
        iterations did: the adjoint loop reruns the iterations and hands each term its sum's
        adjoint, with no record of them. Any other carried value (a recurrence, ``x = x + h *
        f(x)``) makes the adjoint walk the iterations backwards, recomputing the carried values
        at the start of each from the loop's start (k(k+1)/2 iterations for k: no memory, time
        quadratic in the iteration count); then the step must be 1, or a positive constant."""
        it = st.iter
        if not _range_args(st):
            raise self.error(st, "an inner loop has an adjoint only as 'for k in range(...)'")
        if guard is not None:
            raise self.error(st, "an inner loop inside an 'if' has an adjoint only with constant bounds "
                                 f"(unrolled, at most {UNROLL_MAX_STATEMENTS} statements)")
        k = st.target.id
        own, carried, added = set(), set(), set()
        for b in st.body:
            for n in ast.walk(b):
                if isinstance(n, (ast.Break, ast.Continue)):
                    raise self.error(n, "a 'break' or 'continue' in an inner loop has no adjoint yet")
                if isinstance(n, ast.Call) and self.tg.module_of(n.func)[0] == "lk.atomic":
                    raise self.error(n, "an lk.atomic update inside an inner loop has no adjoint yet")
            if isinstance(b, ast.Assign) and len(b.targets) == 1 and isinstance(b.targets[0], ast.Name):
                name = b.targets[0].id
            elif isinstance(b, ast.AugAssign) and isinstance(b.target, ast.Name) and \
                    isinstance(b.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
                name = b.target.id
                if isinstance(b.op, (ast.Add, ast.Sub)):
                    added.add(name)
            else:
                raise self.error(b, "an inner loop whose bounds are not constant has an adjoint when its body "
                                    "assigns locals (x = e, x += e); this statement is neither")
            if name == k:
                raise self.error(b, f"'{k}', the inner loop's counter, is assigned in it")
            if name in self.accumulators:
                raise self.error(b, f"'{name}' adds up values for lk.sum: add into it outside inner loops "
                                    f"whose bounds are not constant")
            if name in defined:
                carried.add(name)
            else:
                reads = {n.id for n in ast.walk(b)
                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                if isinstance(b, ast.AugAssign):
                    reads.add(name)
                if name in reads and name not in own:
                    raise self.error(b, f"'{name}' carries a value from one iteration of the inner loop to the "
                                        f"next: assign it before the loop")
                own.add(name)
        loads = {n.id for b in st.body for n in ast.walk(b.value) if isinstance(n, ast.Name)}
        sums_only = all(isinstance(b, ast.AugAssign) for b in st.body if _target(b) in carried) and \
            carried <= added and not (carried & loads)
        for a in it.args:
            bad = (own | carried | {k}) & {n.id for n in ast.walk(a) if isinstance(n, ast.Name)}
            if bad:
                raise self.error(st, f"the bounds of an inner loop read '{sorted(bad)[0]}', which it assigns")
        if not sums_only and not (len(it.args) <= 2 or (int_constant(it.args[2]) or 0) > 0):
            raise self.error(st, "an inner loop that carries a value other than a sum (s += e) has an adjoint "
                                 "when its step is 1 or a positive constant")
        st = copy.deepcopy(st)
        st._lk_inner = (k, own, carried, not sums_only)
        return st

    def unrolled(self, st):
        """A plain ``for k in range(a[, b[, c]])`` loop with constant bounds inside a parallel
        loop (:meth:`unrollable`), as its body repeated with ``k`` replaced by each value (then
        ``k`` set to the last, as Python leaves it): straight-line code for the backward walk."""
        values = range(*[b.value for b in _range_args(st)])
        for n in ast.walk(st):
            if isinstance(n, (ast.Break, ast.Continue)):
                raise self.error(n, "a 'break' or 'continue' in an inner loop has no adjoint yet")
        k = st.target.id
        out = []
        for v in values:
            for b in st.body:
                b = copy.deepcopy(b)
                for n in ast.walk(b):
                    for field, child in ast.iter_fields(n):
                        if isinstance(child, ast.Name) and child.id == k and isinstance(child.ctx, ast.Load):
                            setattr(n, field, ast.copy_location(ast.Constant(v), child))
                        elif isinstance(child, list):
                            child[:] = [ast.copy_location(ast.Constant(v), c)
                                        if isinstance(c, ast.Name) and c.id == k and isinstance(c.ctx, ast.Load)
                                        else c for c in child]
                out.append(b)
        if values:
            out.append(_at(ast.Assign(targets=[ast.Name(id=k, ctx=ast.Store())], value=ast.Constant(values[-1])),
                           st))
        return out

    def atomic_of(self, st):
        """(array, index, value) of a statement ``lk.atomic.add(array, index, value)``; None for
        any other statement; StepSyntaxError for ``lk.atomic.max``/``min``."""
        if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)):
            return None
        mod, attr = self.tg.module_of(st.value.func)
        if mod != "lk.atomic":
            return None
        if attr != "add":
            raise self.error(st, f"lk.atomic.{attr} has no adjoint yet (lk.atomic.add has)")
        arr, idx, value = st.value.args
        if not isinstance(arr, ast.Name):
            raise self.error(st, "an lk.atomic update of something other than a named array")
        return arr, idx, value

    def loop(self, s, params):
        body = self.straight(s.body, set())
        # SSA: every assignment to a local gets its own name, so the backward walk sees the
        # values each statement used
        version, ssa = {}, []
        stored = {}
        assigned = {b.targets[0].id for b in body
                    if isinstance(b, ast.Assign) and isinstance(b.targets[0], ast.Name)}
        accs = self.accumulators & assigned
        acc_versions = {}                            # an accumulator's versions -> the accumulator
        inner_locals = set()                         # the counters and locals of kept inner loops
        ext_versions = {}                            # a running max/min's versions -> (its reduction, e, flag)
        for st in body:
            st = copy.deepcopy(st)
            if isinstance(st, ast.For):
                ssa.append(("inner", None, self.inner_ssa(st, version, assigned), st))
                inner_locals |= st._lk_inner[1] | {st._lk_inner[0]}
                continue
            after = {n.id for n in ast.walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} \
                & inner_locals
            if after - set(version):
                raise self.error(st, f"'{sorted(after)[0]}' is assigned in an inner loop whose bounds are not "
                                     f"constant and read after it: its value there has no adjoint yet (add what "
                                     f"you need into a local assigned before the loop)")
            atomic = self.atomic_of(st)
            if atomic is not None:
                # a[k] += e from any iteration: e's adjoint is a_bar[k], which passes through
                # unchanged (nothing in this loop may read a: the step would race)
                arr, idx, value = atomic
                stored.setdefault(arr.id, set())
                guard = getattr(st, "_lk_guard", None)
                guard = None if guard is None else _rename_loads(ast.Name(id=guard, ctx=ast.Load()), version)
                ssa.append(("atomic", arr.id, (_rename_loads(idx, version), _rename_loads(value, version), guard),
                            st))
                continue
            tgt = st.targets[0]
            updates = isinstance(tgt, ast.Name) and tgt.id in accs
            for n in ast.walk(st):
                if not (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)):
                    continue
                if n.id in accs and not (updates and n.id == tgt.id):
                    raise self.error(st, f"'{n.id}' adds up values for lk.sum: it may only be added into here "
                                         f"({n.id} += ...), not read")
                # a local the iteration reads before assigning it carries the value this
                # thread's previous iteration left (s = s * 0.5 + x[i]): the recomputation,
                # one iteration at a time, cannot see it
                if n.id in assigned and n.id not in version and n.id not in self.flags and n.id not in accs:
                    raise self.error(st, f"'{n.id}' carries a value from one iteration of the loop to the next "
                                         f"(this thread's previous iteration); assign it in the iteration before "
                                         f"using it")
            extremum = self.extremum_red.get(tgt.id) if updates else None
            if extremum is not None:
                e, flag = _running_value(st, tgt.id, extremum["op"])
                if e is None:
                    raise self.error(st, f"'{tgt.id}' is reduced by lk.{extremum['op']}: update it only as "
                                         f"{tgt.id} = {extremum['op']}({tgt.id}, e)")
            elif updates and _additive_count(st.value, {tgt.id}) != 1:
                raise self.error(st, f"'{tgt.id}' adds up values for lk.sum: update it only as "
                                     f"{tgt.id} += e or {tgt.id} -= e")
            value = _rename_loads(st.value, version)
            if isinstance(tgt, ast.Name):
                new = self.fresh(tgt.id)
                version[tgt.id] = new
                if updates:
                    acc_versions[new] = tgt.id
                    if extremum is not None:
                        ext_versions[new] = (extremum, _rename_loads(e, version),
                                             None if flag is None else _rename_loads(flag, version))
                ssa.append(("local", new, value, st))
            else:
                if not isinstance(tgt.value, ast.Name):
                    raise self.error(st, "a store into something other than a named array")
                idx = _rename_loads(tgt.slice, version)
                stored.setdefault(tgt.value.id, set()).add(ast.dump(idx))
                ssa.append(("store", tgt.value.id, (idx, value), st))
        # an array stored into is read in this loop only at the index it is stored at, and not
        # after the store (the recomputation reads the state before the step)
        stored_so_far = set()
        for kind, name, payload, st in ssa:
            value = payload if kind == "local" else payload["node"] if kind == "inner" else payload[1]
            for n in ast.walk(value):
                if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in stored:
                    if ast.dump(n.slice) not in stored[n.value.id]:
                        raise self.error(st, f"'{n.value.id}' is stored into in this loop and read at another index")
                    if n.value.id in stored_so_far:
                        raise self.error(st, f"'{n.value.id}' is read after this loop stored into it")
            if kind in ("store", "atomic"):
                stored_so_far.add(name)
        active = set(params)
        for kind, name, payload, st in ssa:
            if kind == "local" and self.tg.is_active(payload, active):
                active.add(name)
            elif kind == "inner" and "general" in payload:
                payload["live"] = self.carried_activity(payload["general"], active)
                active |= {payload["general"]["carried"][c][1] for c in payload["live"]}
            elif kind == "inner":
                inner = set(active)
                for b in payload["node"].body:
                    name = _target(b)
                    if self.tg.is_active(b.value, inner) or \
                            isinstance(b, ast.AugAssign) and payload["old"][name] in active:
                        inner.add(name)
                payload["active"] = inner
                active |= inner & set(payload["old"])
        fwd, back = [], []
        for kind, name, payload, st in ssa:
            if kind == "local":
                fwd.append(_at(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=payload), st))
            elif kind == "inner":
                for new_v, old_v in payload["old"].items():
                    fwd.append(_at(ast.Assign(targets=[ast.Name(id=new_v, ctx=ast.Store())],
                                              value=ast.Name(id=old_v, ctx=ast.Load())), st))
                fwd.append(copy.deepcopy(payload["node"]))
                # the sums' adjoints start at 0 like the locals' (the statements after the loop add in)
                fwd += [_at(ast.Assign(targets=[ast.Name(id=self.bar_name(v), ctx=ast.Store())],
                                       value=ast.Constant(0.0)), st) for v in payload["old"] if v in active]
        for name in [n for k, n, _, _ in ssa if k == "local" and n in active and n not in ext_versions]:
            # every version of an accumulator has the adjoint of its final value (the sum's
            # share for this thread): each addend enters the final value once
            start = ast.Name(id=self.bar_name(acc_versions[name]), ctx=ast.Load()) if name in acc_versions \
                else ast.Constant(0.0)
            fwd.append(_at(ast.Assign(targets=[ast.Name(id=self.bar_name(name), ctx=ast.Store())], value=start), s))
        for kind, name, payload, st in reversed(ssa):
            if kind == "inner":
                back += self.inner_adjoint(payload, active, st)
                continue
            if name not in active:
                continue
            if name in ext_versions:
                # m = max(m, e): e takes the share of the result's adjoint if it equals the
                # result (and, inside an if, its branch ran); nothing passes to the m before
                red, e, flag = ext_versions[name]
                hit = ast.Compare(left=copy.deepcopy(e), ops=[ast.Eq()],
                                  comparators=[ast.Name(id=red["sum"], ctx=ast.Load())])
                if flag is not None:
                    hit = ast.BoolOp(op=ast.And(), values=[copy.deepcopy(flag), hit])
                g = ast.IfExp(test=hit, body=ast.Name(id=red["share"], ctx=ast.Load()), orelse=ast.Constant(0.0))
                back += self.scatter(e, g, active, st)
                continue
            if kind == "local":
                g = ast.Name(id=self.bar_name(name), ctx=ast.Load())
                back += self.scatter(payload, g, active, st,
                                     exclude=set(acc_versions) | set(acc_versions.values()) if name in acc_versions
                                     else frozenset())
                continue
            # a store a[k] = e takes g = a_bar[k] and zeroes it (the old a[k] is overwritten); an
            # lk.atomic.add leaves it (the old a[k] passes through); either hands g to e
            idx, value = payload[0], payload[1]
            guard = payload[2] if kind == "atomic" else None
            gname = self.fresh("g")
            part = [_at(ast.Assign(targets=[ast.Name(id=gname, ctx=ast.Store())], value=ast.Subscript(
                value=ast.Name(id=self.bar_name(name), ctx=ast.Load()), slice=copy.deepcopy(idx),
                ctx=ast.Load())), st)]
            if kind == "store":
                part.append(_at(ast.Assign(targets=[ast.Subscript(
                    value=ast.Name(id=self.bar_name(name), ctx=ast.Load()), slice=copy.deepcopy(idx),
                    ctx=ast.Store())], value=ast.Constant(0.0)), st))
            part += self.scatter(value, ast.Name(id=gname, ctx=ast.Load()), active, st)
            back += part if guard is None else [_at(ast.If(test=guard, body=part, orelse=[]), st)]
        new = copy.copy(s)
        new.body = fwd + back or [_at(ast.Pass(), s)]
        return new

    def inner_ssa(self, st, version, assigned):
        """The SSA form of an inner loop that :meth:`accumulating_loop` accepted: its counter and
        locals get fresh names, the locals of the iteration it reads their current versions,
        and each sum it adds into a new version that starts as the one before the loop.
        Returns {"node": the renamed loop, "old": {new version: the version before}}."""
        k, own, sums, general = st._lk_inner
        fresh = {k: self.fresh(k)}
        for n in ast.walk(st):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in assigned \
                    and n.id not in version and n.id not in own | {k}:
                raise self.error(st, f"'{n.id}' carries a value from one iteration of the loop to the next "
                                     f"(this thread's previous iteration); assign it in the iteration before "
                                     f"using it")
        old, new = {}, {}
        for a in sorted(sums):
            if a not in version:
                raise self.error(st, f"'{a}' is added into in an inner loop: assign it in the iteration "
                                     f"before the loop")
            new[a] = self.fresh(a)
            old[new[a]] = version[a]
        node = copy.deepcopy(st)
        node.target.id = fresh[k]
        for a in node.iter.args:
            for n in ast.walk(a):
                if isinstance(n, ast.Name) and n.id in version:
                    n.id = version[n.id]
        if general:
            # the forward loop as written, the carried locals renamed to their versions after
            # the loop (starting as the versions before), the iteration's own to names of its own
            info = {"body": copy.deepcopy(st.body), "k": k, "own": own, "args": node.iter.args,
                    "carried": {c: (version[c], new[c]) for c in sums}, "version": dict(version)}
            names = {**{c: new[c] for c in sums}, **{o: self.fresh(o) for o in sorted(own)}, k: fresh[k]}
            node.body = [self.renamed_body(b, names, version) for b in node.body]
            for c in sums:
                version[c] = new[c]
            return {"node": node, "old": old, "general": info}
        current = {k: fresh[k]}                 # each assignment of the iteration's own locals:
        for b in node.body:                     # a name of its own (q = q * 0.5 reads the q before)
            _read_as(b.value, current, version)
            tgt = b.target if isinstance(b, ast.AugAssign) else b.targets[0]
            if tgt.id in new:
                tgt.id = new[tgt.id]
            else:
                current[tgt.id] = tgt.id = self.fresh(tgt.id)
        for a in sums:
            version[a] = new[a]
        return {"node": node, "old": old}

    def renamed_body(self, b, names, version):
        """A copy of statement ``b`` of an inner loop, its names renamed by ``names`` (loads and
        stores), then the loop's outer locals to their ``version``."""
        b = copy.deepcopy(b)
        for n in ast.walk(b):
            if isinstance(n, ast.Name):
                n.id = names.get(n.id) or (version.get(n.id, n.id) if isinstance(n.ctx, ast.Load) else n.id)
        return b

    def carried_activity(self, info, active):
        """The carried locals of a recurrence loop (:meth:`inner_ssa`) that depend on active
        values at the end of an iteration: those active before the loop, and, to a fixed point,
        those an iteration makes active."""
        body, own, carried = info["body"], info["own"], info["carried"]
        outer = {n.id for b in body for n in ast.walk(b) if isinstance(n, ast.Name)} - own - set(carried)
        outside = {n for n in outer if info["version"].get(n, n) in active}
        live = {c for c, (old, _) in carried.items() if old in active}
        while True:
            cur = set(live)
            for b in body:
                t = _target(b)
                if self.tg.is_active(b.value, cur | outside) or isinstance(b, ast.AugAssign) and t in cur:
                    cur.add(t)
                else:
                    cur.discard(t)
            grown = live | (cur & set(carried))
            if grown == live:
                return live
            live = grown

    def recurrence_adjoint(self, payload, active, st):
        """The backward form of an inner loop that carries a recurrence (:meth:`inner_ssa`):
        the carried locals' adjoints start as those of their versions after the loop; the
        iterations are walked from the last, each recomputing the carried values at its start
        from the loop's start, then itself in SSA form, then backwards, leaving the adjoints of
        the values it started from; after the first, those pass to the versions before."""
        info = payload["general"]
        live = payload["live"]
        if not live:
            return []
        carried, version, k = info["carried"], info["version"], info["k"]
        args = [ast.unparse(a) for a in info["args"]]
        lo, hi = ("0", args[0]) if len(args) == 1 else (args[0], args[1])
        step = args[2] if len(args) == 3 else "1"
        n_iter, kk, kv, k2 = self.fresh("n_iter"), self.fresh("kk"), self.fresh(k), self.fresh(k)
        carry = {c: self.fresh(f"{c}_carry_bar") for c in sorted(live)}
        start = {c: self.fresh(f"{c}_start") for c in sorted(carried)}
        out = [_parse_stmt(f"{carry[c]} = {self.bar_name(carried[c][1])}", st) for c in sorted(live)]
        out.append(_parse_stmt(f"{n_iter} = max(0, (({hi}) - ({lo}) + ({step}) - 1) // ({step}))", st))
        body = [_parse_stmt(f"{kv} = ({lo}) + {kk} * ({step})", st)]
        body += [_parse_stmt(f"{start[c]} = {carried[c][0]}", st) for c in sorted(carried)]
        names = {**start, **{o: self.fresh(o) for o in sorted(info["own"])}, k: k2}
        redo = _parse_stmt(f"for {k2} in range({lo}, {kv}, {step}):\n    pass", st)
        redo.body = [self.renamed_body(b, names, version) for b in info["body"]]
        body.append(redo)
        # the iteration at kv, each assignment with a name of its own
        cur = {**start, k: kv}
        ssa = []
        for b in info["body"]:
            value = _read_as(copy.deepcopy(b.value), cur, version)
            t = _target(b)
            if isinstance(b, ast.AugAssign):
                value = ast.BinOp(left=ast.Name(id=cur[t], ctx=ast.Load()), op=b.op, right=value)
            cur[t] = self.fresh(t)
            ssa.append((cur[t], _at(value, b), b))
        names_active = set(active) | {start[c] for c in live}
        for name, value, b in ssa:
            if self.tg.is_active(value, names_active):
                names_active.add(name)
        body += [_at(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=value), b)
                 for name, value, b in ssa]
        body += [_parse_stmt(f"{self.bar_name(start[c])} = 0.0", st) for c in sorted(live)]
        body += [_parse_stmt(f"{self.bar_name(name)} = 0.0", b) for name, _, b in ssa if name in names_active]
        body += [_parse_stmt(f"{self.bar_name(cur[c])} = {carry[c]}", st) for c in sorted(live)
                 if cur[c] in names_active]
        for name, value, b in reversed(ssa):
            if name in names_active:
                body += self.scatter(value, ast.Name(id=self.bar_name(name), ctx=ast.Load()), names_active, b)
        body += [_parse_stmt(f"{carry[c]} = {self.bar_name(start[c])}", st) for c in sorted(live)]
        loop = _parse_stmt(f"for {kk} in range({n_iter} - 1, -1, -1):\n    pass", st)
        loop.body = body
        out.append(loop)
        out += [_parse_stmt(f"{self.bar_name(carried[c][0])} += {carry[c]}", st) for c in sorted(live)
                if carried[c][0] in active]
        return out

    def inner_adjoint(self, payload, active, st):
        """The backward form of an inner loop (:meth:`inner_ssa`): each sum's version before the
        loop takes the adjoint of the one after (each addend enters the sum once), then a loop
        over the same iterations recomputes each one's locals and walks its statements
        backwards, each addend taking its sum's adjoint (negated for ``-=``), each local its
        own adjoint (zeroed at the start of the iteration)."""
        if "general" in payload:
            return self.recurrence_adjoint(payload, active, st)
        node, inner = payload["node"], payload["active"]
        out = []
        for new_v, old_v in payload["old"].items():
            if new_v in active and old_v in active:
                out.append(_at(ast.AugAssign(target=ast.Name(id=self.bar_name(old_v), ctx=ast.Store()),
                                             op=ast.Add(), value=ast.Name(id=self.bar_name(new_v), ctx=ast.Load())),
                               st))
        recompute = [copy.deepcopy(b) for b in node.body if isinstance(b, ast.Assign)]
        zero = [_at(ast.Assign(targets=[ast.Name(id=self.bar_name(b.targets[0].id), ctx=ast.Store())],
                               value=ast.Constant(0.0)), b) for b in recompute if b.targets[0].id in inner]
        walk = []
        for b in reversed(node.body):
            name = _target(b)
            if name not in inner:
                continue
            g = ast.Name(id=self.bar_name(name), ctx=ast.Load())
            if isinstance(b, ast.AugAssign) and isinstance(b.op, ast.Sub):
                g = ast.UnaryOp(op=ast.USub(), operand=g)
            walk += self.scatter(b.value, g, inner, b)
        if walk:
            loop = copy.copy(node)
            loop.body = recompute + zero + walk
            out.append(loop)
        return out

    def scatter(self, e, g, active, st, only=None, exclude=frozenset()):
        """Statements adding ``g`` times the partial derivative of ``e`` to the adjoint of each
        active value ``e`` reads (those named in ``only``, if given, and not in ``exclude``)."""
        out = []
        for leaf in _leaves(self.tg, e, active):
            lname = leaf.id if isinstance(leaf, ast.Name) else None
            if (only is not None and lname not in only) or lname in exclude:
                continue
            coef = _Partial(self.tg, leaf).d(e, active)
            if coef is None:
                continue
            amount = _mul(coef, g)
            if isinstance(leaf, ast.Name):
                # a local's adjoint, or a scalar parameter's: that one summed by each thread
                # first, then added to the parameter's adjoint once per thread at the end of
                # the step (one address that every iteration would otherwise update)
                if leaf.id in self.active and leaf.id not in self.scalar_acc:
                    self.scalar_acc[leaf.id] = self.fresh(f"{self.bar_name(leaf.id)}_acc")
                target = self.scalar_acc[leaf.id] if leaf.id in self.active else self.bar_name(leaf.id)
                stmt = ast.AugAssign(target=ast.Name(id=target, ctx=ast.Store()), op=ast.Add(), value=amount)
            else:           # an array element
                stmt = self.atomic_add_stmt(self.bar_name(leaf.value.id), copy.deepcopy(leaf.slice), amount)
                # an element read only where a conditional expression takes its branch (u[i + 1]
                # in `u[i + 1] if i < n - 1 else 0.0`) is touched only there: its index may lie
                # outside the array elsewhere, where its coefficient is 0
                cond = _branch_condition(e, leaf)
                if cond is not None:
                    stmt = ast.If(test=cond, body=[stmt], orelse=[])
            out.append(_at(stmt, st))
        return out

    def atomic_add_stmt(self, array, index, value):
        """The statement ``lk.atomic.add(array, index, value)``."""
        lk = self.lk_name()
        return ast.Expr(value=ast.Call(
            func=ast.Attribute(value=ast.Attribute(value=ast.Name(id=lk, ctx=ast.Load()), attr="atomic",
                                                   ctx=ast.Load()), attr="add", ctx=ast.Load()),
            args=[ast.Name(id=array, ctx=ast.Load()), index, value], keywords=[]))

    def lk_name(self):
        import loopkern as _lk
        for name, value in list(self.parsed.closure.items()) + list(self.parsed.globals.items()):
            if value is _lk:
                return name
        raise self.error(self.parsed.tree, "the step's module does not import loopkern by a name")


def _index_counts(tree):
    """Array name -> the number of indices the step uses on it (None where uses differ)."""
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
            k = len(n.slice.elts) if isinstance(n.slice, ast.Tuple) else 1
            out[n.value.id] = k if out.get(n.value.id, k) == k else None
    return out


def _read_versions(node, reads_as):
    """``node`` with each element read of an array in ``reads_as`` reading the array it names."""
    for n in ast.walk(node):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and isinstance(n.ctx, ast.Load) \
                and n.value.id in reads_as:
            n.value = ast.copy_location(ast.Name(id=reads_as[n.value.id], ctx=ast.Load()), n.value)
    return node


def _keep_stores(loop, into, reads_as):
    """Rewrite ``loop`` (a copy) to store only into the arrays in ``into``, renamed to their
    scratch arrays; every other store becomes ``pass``. ``a[k] op= e`` becomes ``s[k] = r[k]
    op e`` (``r``: the version ``reads_as`` names, else ``a``)."""
    class Keep(ast.NodeTransformer):
        def visit_Assign(self, node):
            t = node.targets[0]
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                if t.value.id not in into:
                    return ast.copy_location(ast.Pass(), node)
                t.value = ast.copy_location(ast.Name(id=into[t.value.id], ctx=ast.Load()), t.value)
            return node

        def visit_Expr(self, node):
            hit = _atomics(node)
            if hit and node.value.args[0] is hit[0][0]:
                a = node.value.args[0]
                if a.id not in into:
                    return ast.copy_location(ast.Pass(), node)
                node.value.args[0] = ast.copy_location(ast.Name(id=into[a.id], ctx=ast.Load()), a)
            return node

        def visit_AugAssign(self, node):
            t = node.target
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                if t.value.id not in into:
                    return ast.copy_location(ast.Pass(), node)
                old = ast.Subscript(value=ast.Name(id=reads_as.get(t.value.id, t.value.id), ctx=ast.Load()),
                                    slice=copy.deepcopy(t.slice), ctx=ast.Load())
                t.value = ast.copy_location(ast.Name(id=into[t.value.id], ctx=ast.Load()), t.value)
                return _at(ast.Assign(targets=[t], value=ast.BinOp(left=old, op=node.op, right=node.value)), node)
            return node
    Keep().visit(loop)
    ast.fix_missing_locations(loop)
    return loop


def _replace_node(tree, old, new):
    """``tree`` (a copy) with the node equal to ``old`` (by its dump and position) replaced by
    ``new``."""
    key = (ast.dump(old), getattr(old, "lineno", None), getattr(old, "col_offset", None))

    class R(ast.NodeTransformer):
        def generic_visit(self, node):
            if (ast.dump(node), getattr(node, "lineno", None), getattr(node, "col_offset", None)) == key:
                return ast.copy_location(new, node)
            return super().generic_visit(node)
    if (ast.dump(tree), getattr(tree, "lineno", None), getattr(tree, "col_offset", None)) == key:
        return ast.copy_location(new, tree)
    return R().visit(tree)


def _live_only(body):
    """``body`` without the assignments to locals that nothing with an effect reads (stores,
    ``lk.atomic`` updates and the values they use, transitively; a condition's ``if`` test
    counts as used): what only a dropped ``return`` needed, e.g. Jacobi's error and its
    ``lk.max``."""
    module = ast.Module(body=body, type_ignores=[])
    live = set()
    while True:
        before = len(live)
        for n in ast.walk(module):
            if isinstance(n, (ast.Assign, ast.AugAssign)):
                tgts = n.targets if isinstance(n, ast.Assign) else [n.target]
                effect = any(not isinstance(t, ast.Name) for t in tgts)
                if effect or any(t.id in live for t in tgts if isinstance(t, ast.Name)):
                    live |= {x.id for x in ast.walk(n) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}
                    if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
                        live.add(n.target.id)
            elif isinstance(n, ast.Expr) or isinstance(n, (ast.If, ast.While, ast.For)):
                part = n.value if isinstance(n, ast.Expr) else (n.test if not isinstance(n, ast.For) else n.iter)
                live |= {x.id for x in ast.walk(part) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}
        if len(live) == before:
            break

    class Drop(ast.NodeTransformer):
        def visit_Assign(self, node):
            if all(isinstance(t, ast.Name) and t.id not in live for t in node.targets):
                return None
            return node

        def visit_AugAssign(self, node):
            if isinstance(node.target, ast.Name) and node.target.id not in live:
                return None
            return node

        def generic_visit(self, node):
            super().generic_visit(node)
            if isinstance(node, (ast.If, ast.For, ast.While)) and not node.body:
                node.body = [ast.copy_location(ast.Pass(), node)]     # everything in it was dropped
            return node
    out = [Drop().visit(s) for s in body]
    return [s for s in out if s is not None]


def _additive_count(e, names):
    """How many times ``e`` adds in a value named in ``names`` on each of its paths (the same
    on every path), or -1: where such a name is used otherwise (multiplied, in a test, on one
    path of a conditional expression only) or the count differs between paths."""
    if isinstance(e, ast.Name) and e.id in names:
        return 1
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
        a = _additive_count(e.left, names)
        b = _additive_count(e.right, names)
        if a < 0 or b < 0 or (isinstance(e.op, ast.Sub) and b):
            return -1
        return a + b
    if isinstance(e, ast.IfExp):
        if _reads_any(e.test, names):
            return -1
        a, b = _additive_count(e.body, names), _additive_count(e.orelse, names)
        return a if a == b else -1
    return -1 if _reads_any(e, names) else 0


def _own_element_updates(body, bars, adj):
    """``body`` with the ``lk.atomic.add(b, k, e)`` updates of an adjoint array ``b`` made
    plain (``b[k] += e``) where no two threads can touch one element of ``b`` at once: within
    the adjoint step's phase (statements between ``lk.sync()`` barriers, the step's end being
    one too) a single parallel loop touches ``b`` (reads, stores, updates), and at the loop's
    own index only (``b[i]`` in ``for i in lk.range(...)``, ``b[i, j]`` in ``lk.grid``'s
    order), so each element belongs to the one thread that runs its iteration. A pointwise
    step's adjoints then need no atomics, and their sums have one order."""
    tg = adj.tg

    def touches(node):
        """bar -> the dumps of the indices it is used at in ``node`` (None: other than indexed)."""
        out = {}
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and tg.module_of(n.func) == ("lk.atomic", "add") and len(n.args) == 3 \
                    and isinstance(n.args[0], ast.Name) and n.args[0].id in bars:
                out.setdefault(n.args[0].id, set()).add(ast.dump(n.args[1]))
            elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in bars:
                out.setdefault(n.value.id, set()).add(ast.dump(n.slice))
        used_bare = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in bars}
        indexed = {n.value.id for n in ast.walk(node) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)}
        atomic = {n.args[0].id for n in ast.walk(node) if isinstance(n, ast.Call) and len(n.args) == 3
                  and tg.module_of(n.func)[0] == "lk.atomic" and isinstance(n.args[0], ast.Name)}
        for b in used_bare - indexed - atomic:
            out[b] = None
        return out

    for phase, _ in _phases(body, adj):
        users = {}
        for s in phase:
            for b, idx in touches(s).items():
                users.setdefault(b, []).append((s, idx))
        for b, uses in users.items():
            if len(uses) != 1 or not adj.is_parallel(uses[0][0]) or uses[0][1] is None:
                continue
            loop, indices = uses[0]
            t = loop.target
            own = ast.dump(ast.Name(id=t.id, ctx=ast.Load())) if isinstance(t, ast.Name) else ast.dump(
                ast.Tuple(elts=[ast.Name(id=e.id, ctx=ast.Load()) for e in t.elts], ctx=ast.Load())) \
                if isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts) else None
            targets = {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            reassigned = any(isinstance(n, ast.Name) and n.id in targets and isinstance(n.ctx, ast.Store)
                             for st in loop.body for n in ast.walk(st))
            if own is None or indices != {own} or reassigned:
                continue
            _plain_updates(loop, b, tg)
    return body


# -- gather form: the neighbour terms of a stencil's adjoint without atomics -------------------
def _offsets(index, names):
    """The constant offset of each dimension of ``index`` from the loop variables ``names``
    (``i``, ``i + 1``, ``i - 2``, ``1 + i``), in order, or None."""
    elts = index.elts if isinstance(index, ast.Tuple) else [index]
    if len(elts) != len(names):
        return None
    out = []
    for e, v in zip(elts, names):
        if isinstance(e, ast.Name) and e.id == v:
            out.append(0)
            continue
        if not isinstance(e, ast.BinOp) or not isinstance(e.op, (ast.Add, ast.Sub)):
            return None
        left, right = e.left, e.right
        if isinstance(e.op, ast.Add) and isinstance(left, ast.Constant):
            left, right = right, left
        c = int_constant(right)
        if not (isinstance(left, ast.Name) and left.id == v) or c is None:
            return None
        out.append(c if isinstance(e.op, ast.Add) else -c)
    return tuple(out)


def _membership(kind, args, names):
    """Source of the test that the values of ``names`` are an iteration of ``lk.range(*args)``
    (``kind`` "range") or ``lk.grid(*args)``."""
    u = ast.unparse
    if kind == "range":
        x = names[0]
        if len(args) == 1:
            return f"(0 <= {x} and {x} < ({u(args[0])}))"
        lo, hi = f"({u(args[0])})", f"({u(args[1])})"
        if len(args) == 2 or int_constant(args[2]) == 1:
            return f"({lo} <= {x} and {x} < {hi})"
        s = f"({u(args[2])})"
        up = f"({lo} <= {x} and {x} < {hi} and ({x} - {lo}) % {s} == 0)"
        if (int_constant(args[2]) or 0) > 0:
            return up
        down = f"({hi} < {x} and {x} <= {lo} and ({lo} - {x}) % (0 - {s}) == 0)"
        return f"(({s} > 0 and {up}) or ({s} < 0 and {down}))"
    tests = []
    for a, x in zip(args, names):
        if isinstance(a, ast.Tuple):
            tests.append(f"({u(a.elts[0])}) <= {x} and {x} < ({u(a.elts[1])})")
        else:
            tests.append(f"0 <= {x} and {x} < ({u(a)})")
    return "(" + " and ".join(tests) + ")"


def _slice_before(stmts, pos, value):
    """The statements of ``stmts[:pos]`` (a loop body) that ``value`` depends on, in order, or
    None where one it needs is other than ``name = e`` or ``name op= e``, where it needs a
    local that the body assigns but not before (carried from the thread's earlier
    iterations), or where one reads an array element that an earlier statement of the body
    stores (the gather form reads each array as it stood when the phase began)."""
    needed = {n.id for n in ast.walk(value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    kept = []
    for st in reversed(stmts[:pos]):
        stored = {n.id for n in ast.walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        if not stored & needed:
            continue
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            needed.discard(st.targets[0].id)
        elif not (isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name)):
            return None
        needed |= {n.id for n in ast.walk(st.value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        kept.insert(0, st)
    body_locals = {n.id for st in stmts for n in ast.walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if needed & body_locals:
        return None         # a value carried from the thread's earlier iterations (an accumulator)
    for st in kept + [ast.Expr(value=value)]:
        at = stmts.index(st) if st in stmts else pos
        earlier = set()
        for prev in stmts[:at]:
            earlier |= _array_stores(prev)
        if any(a in earlier for a, _ in _array_reads(st)):
            return None
    return kept


def _range_args(st):
    """The arguments of ``for k in range(...)`` (a plain ``range`` call, a name as the target,
    no ``else``), or None for any other ``for`` statement."""
    it = st.iter
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" and it.args and \
            not it.keywords and isinstance(st.target, ast.Name) and not st.orelse:
        return it.args
    return None


def _read_as(node, current, version):
    """``node`` with each loaded name read as its entry in ``current`` (an inner loop's own
    names), else in ``version`` (the enclosing iteration's versions), else as itself."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            n.id = current.get(n.id) or version.get(n.id, n.id)
    return node


def _phases(body, adj):
    """(the statements of each phase of ``body``, the ``lk.sync()`` that ends it or None for the
    last): the phases the step's top-level barriers separate."""
    phase = []
    for s in body:
        if adj.is_sync(s):
            yield phase, s
            phase = []
        else:
            phase.append(s)
    yield phase, None


def _target(st):
    """The name an ``x = e`` or ``x op= e`` statement assigns."""
    return st.target.id if isinstance(st, ast.AugAssign) else st.targets[0].id


def _parse_stmt(text, at):
    """The statement ``text``, placed at ``at``'s line."""
    return _at(ast.parse(text).body[0], at)


def _rename_names(node, renamed):
    """A copy of ``node`` with the names in ``renamed`` (loaded or stored) renamed."""
    node = copy.deepcopy(node)
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in renamed:
            n.id = renamed[n.id]
    return node


def _gather_updates(body, bars, adj, params, index_name):
    """``body`` (the adjoint step) with the neighbour terms of stencil adjoints in gather form:
    where, within a phase, every update of an adjoint array ``b`` is an
    ``lk.atomic.add(b, (i + c1, j + c2, ...), e)`` at the top of the body of a parallel loop
    over ``i, j, ...``, or alone under an ``if test:`` there (its term is then ``e if test
    else 0``), with constant offsets ``c`` never below 0 (no index wraps around), one loop over
    ``b``'s elements placed first in the phase gives each element the sum of its terms,
    recomputing each ``e`` at the iteration ``(i, j) = element - c`` when that is one of its
    loop's iterations; an ``lk.sync()`` follows (the loops after it zero the adjoints that
    those terms read) and the atomics go. Each element then has one writer and one order of
    additions: the result does not change from run to run. Anything else keeps its atomics."""
    from .index_bounds import _Bounds
    tg = adj.tg
    bounds = _Bounds(body, params, index_name)
    lk = adj.lk_name()
    out = []
    value_of = {}           # id of an update's call -> its term (under the update's if, if any)

    def flush(phase):
        loops = [s for s in phase if adj.is_parallel(s)]
        # every use of each adjoint array in the phase: (loop, position in its body, offsets, value)
        uses, refused = {}, set()
        for s in phase:
            touched = {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and n.id in bars}
            if not touched:
                continue
            if s not in loops:
                refused |= touched
                continue
            tgt = s.target
            names = [tgt.id] if isinstance(tgt, ast.Name) else [e.id for e in tgt.elts] \
                if isinstance(tgt, ast.Tuple) and all(isinstance(e, ast.Name) for e in tgt.elts) else None
            kind = tg.module_of(s.iter.func)[1]
            rebound = names is None or any(isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Store)
                                           for st in s.body for n in ast.walk(st))
            low = {}
            if not rebound and kind == "range":
                low = {names[0]: bounds._range_low(s.iter.args)}
            elif not rebound and kind == "grid" and len(s.iter.args) == len(names):
                low = {v: bounds.lower(a.elts[0]) if isinstance(a, ast.Tuple) else 0
                       for v, a in zip(names, s.iter.args)}
            direct = {}
            for pos, st in enumerate(s.body):
                # an update, or one under an if (a leaf read only where a conditional expression
                # takes its branch): its term is (e if test else 0), the test taken at the
                # iteration the term belongs to
                test = None
                if isinstance(st, ast.If) and not st.orelse and len(st.body) == 1:
                    test, st = st.test, st.body[0]
                call = st.value if isinstance(st, ast.Expr) else None
                if isinstance(call, ast.Call) and tg.module_of(call.func) == ("lk.atomic", "add") \
                        and len(call.args) == 3 and isinstance(call.args[0], ast.Name) and call.args[0].id in bars:
                    direct[id(call.args[0])] = (pos, call)
                    value_of[id(call)] = call.args[2] if test is None else \
                        _at(ast.IfExp(test=copy.deepcopy(test), body=call.args[2], orelse=ast.Constant(0.0)), call)
            for n in ast.walk(s):
                if not (isinstance(n, ast.Name) and n.id in bars):
                    continue
                b = n.id
                if id(n) not in direct or rebound or kind not in ("range", "grid"):
                    refused.add(b)
                    continue
                pos, call = direct[id(n)]
                off = _offsets(call.args[1], names)
                if off is None or any(low.get(v) is None or low[v] + c < 0 for v, c in zip(names, off)):
                    refused.add(b)
                    continue
                kept = _slice_before(s.body, pos, value_of[id(call)])
                if kept is None or any(tg.module_of(c.func)[0] not in (None, "math")
                                       for st in kept + [value_of[id(call)], call.args[1]] for c in ast.walk(st)
                                       if isinstance(c, ast.Call)):
                    refused.add(b)
                    continue
                uses.setdefault(b, []).append((s, names, kind, off, kept, call))
        # what the gather loops read must stand still while they run: not an adjoint array that
        # one of them writes, an array that a statement of the phase before them stores, or a
        # top-level local that the phase assigns after them
        convert = {b: u for b, u in uses.items() if b not in refused}
        first = min((phase.index(s) for u in convert.values() for s, *_ in u), default=0)
        early = set()
        for s in phase[:first]:
            early |= _array_stores(s)
        late = {n.id for s in phase[first:] if not isinstance(s, ast.For)
                for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

        def reads(u):
            # the recomputed locals, the terms and the loops' bounds (the membership tests)
            return {n.id for s, names, kind, off, kept, call in u for st in kept + [value_of[id(call)], s.iter]
                    for n in ast.walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        while True:
            drop = {b for b, u in convert.items() if reads(u) & (set(convert) | early | late)}
            if not drop:
                break
            for b in drop:
                del convert[b]
        if not convert:
            return phase
        head = []
        for b, u in convert.items():
            el = [adj.fresh("e") for _ in u[0][1]]
            acc = adj.fresh(f"{b}_sum")
            dims = ", ".join(f"{b}.shape[{d}]" for d in range(len(el)))
            it = f"{lk}.range({b}.shape[0])" if len(el) == 1 else f"{lk}.grid({dims})"
            lines = [f"for {', '.join(el)} in {it}:", f"    {acc} = 0.0"]
            groups = {}
            for s, names, kind, off, kept, call in u:
                groups.setdefault((id(s), off), []).append((s, names, kind, off, kept, call))
            for group in groups.values():
                s, names, kind, off = group[0][:4]
                sts = []
                for *_, kept, call in group:
                    sts += [k for k in kept if k not in sts]
                sts.sort(key=s.body.index)
                # the recomputed locals get names of their own, so that the loop's copies of
                # them that only its removed updates read can go
                renamed = {}
                for k in sts:
                    renamed[_target(k)] = renamed.get(_target(k)) or adj.fresh(_target(k))
                lines += [f"    {v} = {e} - ({c})" for v, e, c in zip(names, el, off)]
                lines.append(f"    if {_membership(kind, s.iter.args, names)}:")
                lines += [f"        {ast.unparse(_rename_names(k, renamed))}" for k in sts]
                lines += [f"        {acc} += {ast.unparse(_rename_names(value_of[id(call)], renamed))}"
                          for *_, call in group]
            lines.append(f"    {b}[{', '.join(el)}] += {acc}")
            loop = ast.parse("\n".join(lines)).body[0]
            head.append(_at(loop, u[0][0]))
        head.append(_at(ast.parse(f"{lk}.sync()").body[0], head[0]))
        gone = {id(call) for u in convert.values() for *_, call in u}
        for s in phase:
            if isinstance(s, ast.For):
                for node, field in _statement_lists(s):
                    before = getattr(node, field)
                    stmts = [st for st in before if not (
                        isinstance(st, ast.Expr) and id(st.value) in gone or isinstance(st, ast.If) and not st.orelse
                        and len(st.body) == 1 and isinstance(st.body[0], ast.Expr) and id(st.body[0].value) in gone)]
                    setattr(node, field, stmts or ([_at(ast.Pass(), s)] if before else []))
        return phase[:first] + head + phase[first:]

    for phase, sync in _phases(body, adj):
        out += flush(phase) + ([sync] if sync is not None else [])
    return out


def _statement_lists(tree):
    """(node, field) of every statement list under ``tree``: bodies and else branches."""
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            if isinstance(getattr(node, field, None), list):
                yield node, field


def _plain_updates(loop, bar, tg):
    """``lk.atomic.add(bar, k, e)`` statements in ``loop`` become ``bar[k] += e``."""
    for node, field in _statement_lists(loop):
        stmts = getattr(node, field)
        for j, st in enumerate(stmts):
            call = st.value if isinstance(st, ast.Expr) else None
            if isinstance(call, ast.Call) and tg.module_of(call.func) == ("lk.atomic", "add") and \
                    isinstance(call.args[0], ast.Name) and call.args[0].id == bar:
                stmts[j] = _at(ast.AugAssign(target=ast.Subscript(
                    value=ast.Name(id=bar, ctx=ast.Load()), slice=copy.deepcopy(call.args[1]), ctx=ast.Store()),
                    op=ast.Add(), value=call.args[2]), st)


def _drop_dead_locals(body):
    """``body`` without the assignments to locals inside its loops that nothing reads (the
    primal values a loop's adjoint recomputes but a linear step's adjoint never uses, such as
    Jacobi's ``new``): they would make the reverse sweep record states it does not need.
    Expressions have no side effects here (an lk.atomic update's value is refused, a draw is
    a fixed function of its site), so dropping one changes nothing else."""
    tree = ast.Module(body=body, type_ignores=[])
    while True:
        loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        dropped = False
        for loop in [n for n in ast.walk(tree) if isinstance(n, ast.For)]:
            for node, field in _statement_lists(loop):
                stmts = getattr(node, field)
                keep = [st for st in stmts if not (
                    isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                    and st.targets[0].id not in loaded
                    or isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name)
                    and st.target.id not in loaded)]
                if len(keep) != len(stmts):
                    dropped = True
                    setattr(node, field, keep or [_at(ast.Pass(), stmts[0])])
        if not dropped:
            return tree.body


def _running_value(st, name, op):
    """(e, the branch flag or None) of ``name = op(name, e)``, or of its guarded form
    ``name = (op(name, e) if flag else name)`` that :meth:`_Adjoint.straight` makes inside an
    ``if``; (None, None) for any other statement."""
    v = st.value
    flag = None
    if isinstance(v, ast.IfExp) and isinstance(v.orelse, ast.Name) and v.orelse.id == name:
        flag, v = v.test, v.body
    e = running_update(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=v), name, op)
    return (e, flag) if e is not None else (None, None)


def _count_ties(tree, name, op, ties):
    """Before each ``name = op(name, e)`` in ``tree`` (statement lists at any depth), the
    count of the thread's values equal to its running max/min: 1 where e beats it, one more
    where e ties it."""
    for node, field in _statement_lists(tree):
        out = []
        for st in getattr(node, field):
            e = running_update(st, name, op) if isinstance(st, ast.Assign) else None
            if e is not None:
                out.append(_at(tie_update(ties, name, e, op, ast.Constant(1.0), ast.Constant(1.0)), st))
            out.append(st)
        setattr(node, field, out)


def _reads_any(node, names):
    """Whether ``node`` reads any of ``names`` (as a name or an array)."""
    return any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in names for n in ast.walk(node))


def _array_reads(loop):
    """(array name, the Subscript node) for each element read in ``loop`` (an element updated
    with ``op=`` is read too)."""
    out = []
    for n in ast.walk(loop):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and isinstance(n.ctx, ast.Load):
            out.append((n.value.id, n))
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Subscript) \
                and isinstance(n.target.value, ast.Name):
            out.append((n.target.value.id, n.target))
    return out


def _array_stores(loop):
    """The names of the arrays ``loop`` stores elements into (``lk.atomic`` updates too)."""
    return {n.value.id for n in ast.walk(loop)
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and isinstance(n.ctx, ast.Store)} | \
        {a.id for a, _, _ in _atomics(loop)}


def _atomics(node):
    """(array Name, index, value) of each ``<alias>.atomic.<op>(a, k, v)`` call in ``node``."""
    return [tuple(n.args) for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Attribute)
            and n.func.value.attr == "atomic" and len(n.args) == 3 and isinstance(n.args[0], ast.Name)]


def _branch_condition(e, leaf):
    """The condition under which evaluating ``e`` evaluates ``leaf`` (a node of ``e``, by
    identity) as far as conditional expressions decide it: the tests of the ``IfExp`` nodes on
    the way down, negated where the path takes the ``else``; None where no ``IfExp`` is on it."""
    def path(n):
        if n is leaf:
            return []
        if isinstance(n, ast.IfExp):
            for part, taken in ((n.body, True), (n.orelse, False)):
                p = path(part)
                if p is not None:
                    test = copy.deepcopy(n.test)
                    return [test if taken else ast.UnaryOp(op=ast.Not(), operand=test)] + p
            p = path(n.test)
            return p
        for c in ast.iter_child_nodes(n):
            p = path(c)
            if p is not None:
                return p
        return None
    tests = path(e) or []
    if not tests:
        return None
    return tests[0] if len(tests) == 1 else ast.BoolOp(op=ast.And(), values=tests)


def _rename_loads(e, version):
    e = copy.deepcopy(e)
    for n in ast.walk(e):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in version:
            n.id = version[n.id]
    return e


def _at(new, old):
    for n in ast.walk(new):
        ast.copy_location(n, old)
    return new


def adjoint_function(parsed, active, form: str = "gather") -> tuple:
    """(the adjoint step as a ParsedFunction, the adjoint parameters' names by parameter, its
    scratch array parameters as (name, the parameter whose shape and dtype it takes)) for the
    step ``parsed`` differentiated with respect to the parameters named in ``active``. The
    adjoint step's parameters are the step's, each active one followed by its adjoint, then
    the scratch arrays (one per version of an array that a later loop reads after an earlier
    loop stored into it; their contents on entry do not matter)."""
    if form not in ADJOINT_FORMS:
        raise ValueError(f"form={form!r}: expected one of {ADJOINT_FORMS}")
    check_active(parsed.tree, active)
    # the draws keep their sites in the step wherever the adjoint step copies them (they have
    # no derivative: a draw is a fixed function of seed, step, key, subkey and site)
    parsed = inline_helpers(tag_random_sites(parsed))
    tree = parsed.tree
    params = [a.arg for a in tree.args.args]
    adj = _Adjoint(parsed, set(active))
    body = split_tuple_assignments(copy.deepcopy(tree.body))
    check_differentiated_stores(adj.tg, body, adj.tg.active_names(body))
    if body and isinstance(body[-1], ast.Return):
        # a step that returns a condition is differentiated with its step count held (the
        # condition has no derivative): the adjoint step drops it, and what only it used
        body = _live_only(body[:-1])
    for n in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(n, ast.Return):
            raise adj.error(n, "a 'return' other than the step's last statement has no adjoint yet")
    body = _drop_dead_locals(adj.step(body))
    if form == "gather":
        body = _drop_dead_locals(_gather_updates(body, set(adj.bar.values()), adj, params, params[0]))
    body = _own_element_updates(body, set(adj.bar.values()), adj)
    new_args = []
    for a in tree.args.args:
        new_args.append(copy.deepcopy(a))
        if a.arg in active:
            new_args.append(ast.arg(arg=adj.bar_name(a.arg), annotation=None))
    new_args += [ast.arg(arg=name, annotation=None) for name, _ in adj.scratch]
    return (generated_step(parsed, f"{tree.name}_vjp", new_args, body),
            {a: adj.bar_name(a) for a in params if a in active}, tuple(adj.scratch))


# -- whole segments in one kernel each: the recorder and the adjoint sweep over a segment ------
def _fresh(used, base):
    k = 0
    while f"{base}{k or ''}" in used:
        k += 1
    used.add(f"{base}{k or ''}")
    return f"{base}{k or ''}"


def _lk_alias(parsed):
    import loopkern as _lk
    for name, value in list(parsed.closure.items()) + list(parsed.globals.items()):
        if value is _lk:
            return name
    raise ValueError("the step's module does not import loopkern by a name")


def _parse_expr(text, at):
    e = ast.parse(text, mode="eval").body
    return _at(e, at)


def arrays_read(parsed, names) -> list:
    """Those of ``names`` (arrays) whose elements the step ``parsed`` reads: used other than
    by their shape (``a.shape[d]``). The reverse sweep records only these of the state
    arrays: the adjoint step needs no other's values."""
    shape_uses = set()
    for n in ast.walk(parsed.tree):
        if isinstance(n, ast.Attribute) and n.attr == "shape" and isinstance(n.value, ast.Name):
            shape_uses.add(id(n.value))
    used = {n.id for n in ast.walk(parsed.tree) if isinstance(n, ast.Name) and id(n) not in shape_uses}
    return [a for a in names if a in used]


def recorder_function(parsed, state, ndims) -> tuple:
    """The step with a record of its state: ``step_rec(t, <params>, S_a..., base)`` first
    copies each state array ``a`` (named in ``state``, of ``ndims[a]`` dimensions) to
    ``S_a[t - base]``, then runs the step. An ``lk.sync()`` separates the two only where the
    step stores into (or updates atomically) a recorded array: otherwise the copies and the
    step's loops touch no element in common that either writes (the step only reads what is
    copied, and nothing reads the records), so they need no barrier between them, and the
    barrier at the end of the step orders the copies before the next step's stores. Returns
    (ParsedFunction, {a: the name of S_a}, the name of base)."""
    tree = parsed.tree
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for a in tree.args.args}
    lk = _lk_alias(parsed)
    t = tree.args.args[0].arg
    stacked = {a: _fresh(used, f"{a}_states") for a in state}
    base = _fresh(used, "base")
    head = []
    for a in state:
        idx = [_fresh(used, f"i{d}") for d in range(ndims[a])]
        if ndims[a] == 1:
            loop = f"for {idx[0]} in {lk}.range({a}.shape[0]):\n    {stacked[a]}[{t} - {base}, {idx[0]}] = {a}[{idx[0]}]"
        else:
            dims = ", ".join(f"{a}.shape[{d}]" for d in range(ndims[a]))
            loop = (f"for {', '.join(idx)} in {lk}.grid({dims}):\n"
                    f"    {stacked[a]}[{t} - {base}, {', '.join(idx)}] = {a}[{', '.join(idx)}]")
        head += ast.parse(loop).body
    if set(state) & _array_stores(tree):
        head += ast.parse(f"{lk}.sync()").body
    for s in head:
        _at(s, tree.body[0])
    args = [copy.deepcopy(a) for a in tree.args.args] + [ast.arg(arg=stacked[a], annotation=None) for a in state] + \
        [ast.arg(arg=base, annotation=None)]
    return generated_step(parsed, f"{tree.name}_rec", args, head + copy.deepcopy(tree.body)), stacked, base


def segment_adjoint_function(adjoint_parsed, state) -> tuple:
    """The adjoint step turned into the reverse sweep over one segment, run as a megakernel
    from step 0: ``step_seg(t, S_u, u_bar, ..., top, base)`` reads the state of primal step
    ``base + top - t`` from ``S_a[top - t]`` (recorded by :func:`recorder_function`) instead of
    ``a``, and sees that primal step index as its ``t``. Returns (ParsedFunction,
    {a: the name of S_a}, names of top and base)."""
    tree = adjoint_parsed.tree
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for a in tree.args.args}
    t = tree.args.args[0].arg
    stacked = {a: _fresh(used, f"{a}_states") for a in state}
    top, base = _fresh(used, "top"), _fresh(used, "base")

    class Rewrite(ast.NodeTransformer):
        def visit_Subscript(self, node):
            v = node.value
            if isinstance(v, ast.Name) and v.id in stacked:
                if not isinstance(node.ctx, ast.Load):
                    raise ValueError(f"the adjoint step stores into the state array '{v.id}'")
                node.slice = self.visit(node.slice)
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                j = _parse_expr(f"{top} - {t}", node)
                node.value = _at(ast.Name(id=stacked[v.id], ctx=ast.Load()), node)
                node.slice = _at(ast.Tuple(elts=[j] + list(elts), ctx=ast.Load()), node)
                return node
            if isinstance(v, ast.Attribute) and v.attr == "shape" and isinstance(v.value, ast.Name) \
                    and v.value.id in stacked:
                node.slice = _at(ast.BinOp(left=self.visit(node.slice), op=ast.Add(), right=ast.Constant(1)), node)
                v.value.id = stacked[v.value.id]
                return node
            self.generic_visit(node)
            return node

        def visit_Name(self, node):
            if node.id == t and isinstance(node.ctx, ast.Load):
                return _parse_expr(f"({base} + {top} - {t})", node)
            if node.id in stacked:
                raise ValueError(f"'{node.id}' is used other than indexed or by its shape")
            return node

    body = [Rewrite().visit(copy.deepcopy(s)) for s in tree.body]
    args = []
    for a in tree.args.args:
        args.append(ast.arg(arg=stacked[a.arg], annotation=None) if a.arg in stacked else copy.deepcopy(a))
    args += [ast.arg(arg=top, annotation=None), ast.arg(arg=base, annotation=None)]
    return generated_step(adjoint_parsed, f"{tree.name}_seg", args, body), stacked, (top, base)
