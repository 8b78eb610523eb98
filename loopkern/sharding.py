"""Which steps can run sharded over a mesh of devices, and the step each shard runs.

``kernel.sharded(mesh, in_specs)`` (``loopkern/interop/sharded.py``) runs a stencil step over
fields split into blocks, one per device. Each shard runs K steps per launch on a *window*: its
block plus a halo of K*r cells on each side of every split dimension (r: how far a step reads
from the cell it writes), then the shards exchange halos. A cell's value after k steps depends
only on cells within k*r of it, so after K steps every cell of the block is right, although
the halo's outer cells were computed from cells the window does not hold. That holds for a step
only if the step treats every cell alike except by its distance to the array's edge, which this
module checks on the step's source (for the dimensions that are split):

- the step is a stencil (``loopkern/stencil.py``): every access to a sharded array inside the
  parallel loops is its loop index plus a constant (or a periodic wrap of it), and none is
  outside them;
- an array the step writes is read and written only at the written cell: a step moves
  information at most r cells (no cell reads another cell written in the same step);
- the parallel loops' bounds along a split dimension are measured from the array's edges
  (``lk.range(1, n - 1)`` with ``n = u.shape[0]``); along a periodic dimension (one some
  access wraps around) they cover the whole extent;
- the loop indices and the extents of split dimensions appear only inside the indices of
  sharded arrays and in loop bounds: a shard sees its window, so ``x = i * dx`` or
  ``dx = 1.0 / n`` would silently change meaning; an array replicated on every shard is never
  written and never indexed by a split dimension's loop index;
- no ``lk.thread_id()``, ``lk.num_threads()`` or ``lk.random`` (they number the shard's
  threads and cells, not the field's);
- reductions (``lk.sum/max/min``) reduce a local accumulated in the parallel loops
  (``err = max(err, ...)``) and feed only the returned condition. Each shard reduces the cells
  of its block (the generated step masks the accumulators' updates outside it), the shards'
  values are combined with ``psum``/``pmax``/``pmin`` at each exchange, and the condition is
  evaluated on the combined values; a local carried from cell to cell is used for nothing
  else.

Where the global field has an edge that is not periodic, the window of the shard at that edge
is placed against it (the window of the first shard starts at the field's first cell), so the
step's own treatment of the edge (cells it does not update, one-sided formulas) applies there
unchanged.

:func:`plan_sharding` checks a step and describes it (:class:`ShardPlan`);
:func:`chunk_step` generates the step each shard runs. Pure analysis and source-to-source
transformation: no Numba, no JAX.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from dataclasses import dataclass

from .errors import ArgumentError, StepSyntaxError
from .spec import binding_counts, marker_of, split_tuple_assignments
from .adjoint import _fresh, _lk_alias
from .stencil import NotStencil, _extent_of, find_stencil
from .tangent import generated_step

REDUCTIONS = ("sum", "max", "min")
_THREAD_MARKERS = ("thread_id", "num_threads")
_COND_NODES = (ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.IfExp, ast.Constant, ast.Name, ast.Call,
               ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.Load, ast.expr_context)
_COND_CALLS = ("abs", "min", "max", "float", "int", "bool")


@dataclass(frozen=True)
class ShardPlan:
    """What sharding needs to know about a step (see the module docstring).

    Attributes:
        ndim: dimensions of the step's index space (and of its sharded arrays).
        radius: per dimension, the most cells a step reads away from the cell it writes.
        periodic: per dimension, whether the field wraps around (some access wraps).
        state: indices (into the step's parameters) of the sharded arrays whose contents change
            from step to step: written ones and swap pairs'. Their halos are exchanged.
        fixed: the sharded arrays the step only reads; their halos are filled once.
        accumulators: the locals the parallel loops accumulate (reduced for the condition).
        slots: per reduction in the returned condition, (operation, accumulator).
        condition: the returned condition with each reduction replaced by the name
            ``slot_names[k]`` (an expression of those, the scalar parameters, ``t`` and
            numbers), or None when the step returns nothing.
        slot_names: the names standing for the reductions' values in ``condition``.
        inlined: top-level names the condition was written with (``m = lk.max(err)``),
            substituted into it.
    """

    ndim: int
    radius: tuple[int, ...]
    periodic: tuple[bool, ...]
    state: tuple[int, ...]
    fixed: tuple[int, ...]
    accumulators: tuple[str, ...]
    slots: tuple[tuple[str, str], ...]
    condition: ast.expr | None
    slot_names: tuple[str, ...]
    inlined: frozenset = frozenset()


def _error(parsed, spec, at, what, hint=""):
    """A StepSyntaxError at ``at``: a node (its line and column) or a line number."""
    node = at
    if not isinstance(at, ast.AST):
        node = ast.Module(body=[], type_ignores=[])
        node.lineno, node.col_offset = at or spec.lineno, 0
    return StepSyntaxError([parsed.diagnostic(node, spec.name, what, hint)])


def _walk_with_parents(node):
    parents = {}
    for p in ast.walk(node):
        for c in ast.iter_child_nodes(p):
            parents[c] = p
    return parents


def _is_parallel(st) -> bool:
    return isinstance(st, ast.For) and marker_of(st.iter) in ("range", "grid")


def _loop_targets(st) -> list[str]:
    return [t.id for t in (st.target.elts if isinstance(st.target, ast.Tuple) else [st.target])]


def _loop_bounds(st) -> list[tuple]:
    """(start, stop, step) expressions per dimension of a parallel loop (None: the default)."""
    if marker_of(st.iter) == "range":
        a = st.iter.args
        if len(a) == 1:
            return [(None, a[0], None)]
        return [(a[0], a[1], a[2] if len(a) > 2 else None)]
    out = []
    for a in st.iter.args:
        if isinstance(a, ast.Tuple):
            out.append((a.elts[0], a.elts[1], None))
        else:
            out.append((None, a, None))
    return out


def _untupled(spec):
    """``spec`` with its tuple assignments split (``spec.split_tuple_assignments``), so that
    names bound to extents and neighbour indices that way are seen by the stencil analysis."""
    return dataclasses.replace(spec, step=dataclasses.replace(
        spec.step, body=tuple(split_tuple_assignments(spec.step.body))))


def plan_sharding(parsed, spec, sharded: dict, radius=None) -> ShardPlan:
    """Check that ``spec``'s step can run sharded and describe it.

    Args:
        parsed: the step's :class:`~loopkern.frontend.ParsedFunction` (for error positions).
        spec: its :class:`~loopkern.spec.StepSpec`.
        sharded: parameter index -> per dimension, whether that array is split along it, for
            every sharded array (the others are replicated).
        radius: None (inferred), an int or a tuple of ints per dimension: the halo per step,
            at least what the step reads.

    Raises:
        StepSyntaxError: at the line that makes the step unfit for sharding.
        ArgumentError: for a ``radius`` below what the step reads, or arrays of the wrong kind.
    """
    spec = _untupled(spec)
    st = find_stencil(spec, need_resident=False)
    if isinstance(st, NotStencil):
        raise _error(parsed, spec, st.line, f"kernel.sharded needs a stencil step: {st.reason}",
                     "see 'Sharded runs' in the README for the steps that can be split across devices")
    names = spec.param_names
    ndim = st.ndim
    # a spec shorter than the index space leaves the last dimensions whole (as in JAX)
    sharded = {a: tuple(dims) + (False,) * (ndim - len(dims)) for a, dims in sharded.items()}
    for a, dims in sharded.items():
        if spec.params[a].kind != "array":
            raise ArgumentError(f"in_specs: '{names[a]}' is a scalar; give scalars P() or None")
        if len(dims) != ndim:
            raise ArgumentError(f"in_specs: '{names[a]}' has a spec of {len(dims)} dimensions, but the step's "
                                f"parallel loops have {ndim}")
        if a in st.irregular:
            raise _error(parsed, spec, st.irregular[a],
                         f"'{names[a]}' is sharded but accessed other than at its loop index plus a constant "
                         f"(or outside the parallel loops)",
                         "index sharded arrays only as a[i + c] inside lk.range/lk.grid loops, or replicate the "
                         "array (in_specs P())")
    split = tuple(any(dims[k] for dims in sharded.values()) for k in range(ndim))
    swapped = {i for pair in spec.swap for i in pair}
    written = {a for a in range(len(names)) if spec.params[a].written}
    for a in sharded:
        if a in written:
            away = sorted(o for o in st.reads.get(a, frozenset()) | st.writes.get(a, frozenset()) if any(o))
            if away:
                raise _error(parsed, spec, spec.lineno,
                             f"'{names[a]}' is written by the step and also accessed at offset {away[0]} in the "
                             f"same step, so a step can carry a value further than one stencil radius",
                             "read the previous state from another array (a swap pair)")
    for a, p in enumerate(spec.params):
        if p.kind == "array" and a not in sharded and (a in written or a in swapped):
            raise ArgumentError(f"in_specs: '{names[a]}' is replicated (P()) but the step writes it (or swaps it); "
                                f"each shard would write its own copy. Shard it with the field")
    reach = [0] * ndim
    for a in sharded:
        for off in st.reads.get(a, ()):
            for k, o in enumerate(off):
                reach[k] = max(reach[k], abs(o))
    if radius is not None:
        given = (radius,) * ndim if isinstance(radius, int) else tuple(radius)
        if len(given) != ndim or any(not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in given):
            raise ArgumentError(f"radius={radius!r}: expected an int >= 0 or a tuple of {ndim}")
        low = [k for k in range(ndim) if given[k] < reach[k]]
        if low:
            raise ArgumentError(f"radius={radius!r}: the step reads {reach[low[0]]} cells away along dimension "
                                f"{low[0]}; the halo must be at least that")
        reach = list(given)
    periodic = tuple(any(k in st.wraps.get(a, ()) for a in sharded) for k in range(ndim))
    _Invariance(parsed, spec, sharded, split, periodic).run()
    accs, slots, cond, slot_names, inlined = _Reductions(parsed, spec).run()
    state = tuple(a for a in sorted(sharded) if a in written or a in swapped)
    fixed = tuple(a for a in sorted(sharded) if a not in state)
    return ShardPlan(ndim=ndim, radius=tuple(reach), periodic=periodic, state=state, fixed=fixed,
                     accumulators=accs, slots=slots, condition=cond, slot_names=slot_names,
                     inlined=inlined)


class _Invariance:
    """The checks that a step treats every cell alike along the split dimensions."""

    def __init__(self, parsed, spec, sharded, split, periodic):
        self.parsed, self.spec, self.sharded, self.split, self.periodic = parsed, spec, sharded, split, periodic
        self.names = spec.param_names
        self.arrays = {p.name: i for i, p in enumerate(spec.params) if p.kind == "array"}
        self.body = ast.Module(body=list(spec.step.body), type_ignores=[])
        self.parents = _walk_with_parents(self.body)

    def error(self, node, what, hint):
        return _error(self.parsed, self.spec, node, what, hint)

    def extent_dim(self, e):
        """k if ``e`` is ``a.shape[k]`` (or ``len(a)``) of a sharded array, else None."""
        got = _extent_of(e, self.arrays)
        if got is not None and got[0] in self.sharded:
            return got[1]
        if isinstance(e, ast.Name):
            return self.extent_names.get(e.id)
        return None

    def run(self):
        spec = self.spec
        for fn in (spec.step,) + tuple(spec.helpers):
            for n in ast.walk(ast.Module(body=list(fn.body), type_ignores=[])):
                m = marker_of(n)
                if m in _THREAD_MARKERS or (m or "").startswith("random"):
                    raise self.error(n, f"lk.{m}() numbers a shard's threads or cells, not the field's: it cannot "
                                        f"be used in a sharded step", "pass what it computes in an array sharded "
                                                                      "with the field")
        # names bound (once, at the top level) to the extent of a split dimension
        self.extent_names = {}
        for s in spec.step.body:
            if isinstance(s, ast.Assign) and len(s.targets) == 1:
                tgt, val = s.targets[0], s.value
                pairs = list(zip(tgt.elts, val.elts)) if isinstance(tgt, ast.Tuple) and isinstance(val, ast.Tuple) \
                    and len(tgt.elts) == len(val.elts) else [(tgt, val)]
                for t, v in pairs:
                    if isinstance(t, ast.Name):
                        k = self.extent_dim(v)
                        if k is not None and self.split[k]:
                            self.extent_names[t.id] = k
        loops = [n for n in ast.walk(self.body) if _is_parallel(n)]
        # name -> what it is, for the message
        watched = {n: f"the extent along dimension {k}, which is split across devices"
                   for n, k in self.extent_names.items()}
        bound_nodes = set()
        for loop in loops:
            targets = _loop_targets(loop)
            for k, (start, stop, step) in enumerate(_loop_bounds(loop)):
                for e in (start, stop, step):
                    if e is not None:
                        bound_nodes |= set(ast.walk(e))
                if k < len(self.split) and self.split[k]:
                    self.check_bounds(loop, k, start, stop, step)
            for k, name in enumerate(targets):
                if k < len(self.split) and self.split[k]:
                    watched[name] = f"an index along dimension {k}, which is split across devices"
            # neighbour indices named in the loop body (up = (i + n - 1) % n): a name whose
            # value uses an index other than to index an array is checked where it is used
            for s in ast.walk(loop):
                if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                    src = self.index_valued(s.value, watched)
                    if src and s.targets[0].id not in watched:
                        watched[s.targets[0].id] = f"computed from '{src}', {watched[src].split(' (')[0]}"
        for n in ast.walk(self.body):
            if not (isinstance(n, ast.Name) and n.id in watched):
                continue
            if isinstance(n.ctx, ast.Store) or n in bound_nodes:
                continue
            self.check_use(n, watched)

    def index_valued(self, e, watched):
        """The first watched name ``e`` uses other than inside an array's index, else None."""
        def walk(node, in_index):
            if isinstance(node, ast.Name):
                return node.id if not in_index and node.id in watched else None
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in self.arrays:
                return walk(node.slice, True)
            return next((got for c in ast.iter_child_nodes(node) if (got := walk(c, in_index))), None)
        return walk(e, False)

    def check_bounds(self, loop, k, start, stop, step):
        def const(e):
            return isinstance(e, ast.Constant) and isinstance(e.value, int) and not isinstance(e.value, bool)
        ok_start = start is None or (const(start) and start.value >= 0)
        ok_step = step is None or (const(step) and step.value == 1)
        ok_stop = False
        if self.extent_dim(stop) == k:
            ok_stop = True
        elif isinstance(stop, ast.BinOp) and isinstance(stop.op, ast.Sub) and const(stop.right) \
                and stop.right.value >= 0 and self.extent_dim(stop.left) == k:
            ok_stop = True
        if not (ok_start and ok_step and ok_stop):
            raise self.error(loop, f"along dimension {k}, which is split across devices, the loop's bounds must be "
                                   f"measured from the array's edges (a shard sees its own window of the field)",
                             "write lk.range(c, n - c) or lk.grid(..., (c, m - c)) with n = u.shape[0]")
        if self.periodic[k] and not (start is None or start.value == 0) or self.periodic[k] and stop is not None \
                and isinstance(stop, ast.BinOp) and stop.right.value != 0:
            raise self.error(loop, f"dimension {k} wraps around (periodic) but the loop does not cover its whole "
                                   f"extent", "loop over the whole extent of a periodic dimension")

    def check_use(self, n, watched):
        """``n`` (a split dimension's loop index, extent or a name derived from them) must sit
        inside the index of a sharded array, or define a neighbour-index name."""
        node = n
        while node in self.parents:
            parent = self.parents[node]
            if isinstance(parent, ast.Subscript) and node is parent.slice and isinstance(parent.value, ast.Name):
                arr = self.arrays.get(parent.value.id)
                if arr in self.sharded:
                    return
                if arr is not None:
                    raise self.error(n, f"'{parent.value.id}' is replicated on every shard but indexed by '{n.id}', "
                                        f"an index along a dimension split across devices",
                                     f"shard '{parent.value.id}' with the field (in_specs)")
            if isinstance(parent, ast.Subscript) and isinstance(parent.value, ast.Attribute) \
                    and parent.value.attr == "shape":
                return     # a.shape[k]: k is not an index of cells
            if isinstance(parent, ast.Assign) and node is parent.value and len(parent.targets) == 1 \
                    and isinstance(parent.targets[0], ast.Name) and parent.targets[0].id in watched:
                return     # a neighbour-index or extent name: checked where it is used
            if isinstance(parent, ast.Assign) and isinstance(parent.value, ast.Tuple) and node in parent.value.elts:
                tgt = parent.targets[0]
                k = parent.value.elts.index(node)
                if isinstance(tgt, ast.Tuple) and k < len(tgt.elts) and isinstance(tgt.elts[k], ast.Name) \
                        and tgt.elts[k].id in watched:
                    return
            if isinstance(parent, (ast.stmt,)):
                break
            node = parent
        raise self.error(n, f"'{n.id}' ({watched[n.id]}) is used outside an index of "
                            f"a sharded array: a shard sees its own window of the field, so its value there is "
                            f"not the field's",
                         "pass sizes and positions as scalar parameters or as arrays sharded with the field")


class _Reductions:
    """Accumulators, reductions and the returned condition (see the module docstring)."""

    def __init__(self, parsed, spec):
        self.parsed, self.spec = parsed, spec
        self.scalars = {p.name for p in spec.params if p.kind == "scalar"} | {spec.index_param}

    def error(self, node, what, hint):
        return _error(self.parsed, self.spec, node, what, hint)

    def run(self):
        body = list(self.spec.step.body)
        module = ast.Module(body=body, type_ignores=[])
        parents = _walk_with_parents(module)
        loops = [n for n in ast.walk(module) if _is_parallel(n)]
        inside = {id(n) for lp in loops for s in lp.body for n in ast.walk(s)}
        assigned_in, assigned_out = set(), set()
        for n in ast.walk(module):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                (assigned_in if id(n) in inside else assigned_out).add(n.id)
        loop_vars = {v for lp in loops for v in _loop_targets(lp)}
        accs = sorted((assigned_in & assigned_out) - loop_vars)
        # inside the loops an accumulator only updates itself
        for n in ast.walk(module):
            if isinstance(n, ast.Name) and n.id in accs and isinstance(n.ctx, ast.Load) and id(n) in inside:
                stmt = n
                while not isinstance(stmt, ast.stmt):
                    stmt = parents[stmt]
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, ast.AugAssign) else []
                if not (len(targets) == 1 and isinstance(targets[0], ast.Name) and targets[0].id == n.id
                        and n is not targets[0] and self._in_value(n, stmt)):
                    raise self.error(n, f"'{n.id}' carries a value from one cell to the next; under kernel.sharded "
                                        f"a local accumulated in a parallel loop may only update itself and be "
                                        f"reduced (lk.sum/max/min) for the returned condition",
                                     "compute per-cell values into locals assigned inside the loop body")
        ret = body[-1] if body and isinstance(body[-1], ast.Return) and body[-1].value is not None else None
        if any(isinstance(n, ast.Return) and n is not ret for n in ast.walk(module)):
            node = next(n for n in ast.walk(module) if isinstance(n, ast.Return) and n is not ret)
            raise self.error(node, "under kernel.sharded a step returns its condition once, as its last statement",
                             "compute the condition into a local and 'return' it at the end")
        # top-level names feeding the condition (m = lk.max(err); return m > tol)
        counts = binding_counts(body)
        defs = {}
        for s in body[:-1] if ret is not None else body:
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) \
                    and counts.get(s.targets[0].id) == 1 and s.targets[0].id not in accs:
                defs.setdefault(s.targets[0].id, []).append(s)
        inlined: set = set()
        slots, slot_names = [], []
        cond = None
        if ret is not None:
            cond = self._inline(copy.deepcopy(ret.value), defs, inlined, set())
            cond = self._slots(cond, accs, slots, slot_names)
            for n in ast.walk(cond):
                if not isinstance(n, _COND_NODES):
                    raise self.error(ret, f"under kernel.sharded the returned condition may use reductions "
                                          f"(lk.sum/max/min), scalar parameters, t and numbers only; it has "
                                          f"{type(n).__name__.lower()}", "")
                if isinstance(n, ast.Name) and n.id not in self.scalars and n.id not in slot_names \
                        and n.id not in _COND_CALLS:
                    raise self.error(ret, f"under kernel.sharded the returned condition may use reductions, scalar "
                                          f"parameters, t and numbers only; '{n.id}' is a local of the step "
                                          f"(each shard computes it from its own window)",
                                     "return an expression of lk.sum/max/min of accumulators and scalars")
                if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in _COND_CALLS):
                    raise self.error(ret, "under kernel.sharded the returned condition may call only "
                                          f"{', '.join(_COND_CALLS)} besides the reductions", "")
        # every other reduction is an error: its value would be the shard's, not the field's
        for n in ast.walk(module):
            m = marker_of(n)
            if m in REDUCTIONS and not self._feeds_condition(n, parents, ret, inlined):
                raise self.error(n, f"lk.{m}()'s value is used by the step itself; under kernel.sharded each shard "
                                    f"reduces only its own cells between exchanges, so a reduction may only feed "
                                    f"the returned condition", "")
        return tuple(accs), tuple(slots), cond, tuple(slot_names), frozenset(inlined)

    @staticmethod
    def _in_value(n, stmt):
        return any(m is n for m in ast.walk(stmt.value))

    def _inline(self, e, defs, inlined, seen):
        class Sub(ast.NodeTransformer):
            def visit_Name(s, node):
                if isinstance(node.ctx, ast.Load) and node.id in defs and len(defs[node.id]) == 1 \
                        and node.id not in seen:
                    inlined.add(node.id)
                    return self._inline(copy.deepcopy(defs[node.id][0].value), defs, inlined, seen | {node.id})
                return node
        return Sub().visit(e)

    def _slots(self, cond, accs, slots, slot_names):
        class Sub(ast.NodeTransformer):
            def visit_Call(s, node):
                m = marker_of(node)
                if m in REDUCTIONS:
                    arg = node.args[0] if node.args else None
                    if not (isinstance(arg, ast.Name) and arg.id in accs):
                        raise self.error(node, f"under kernel.sharded lk.{m}() reduces a local accumulated in the "
                                               f"parallel loops", "write err = max(err, ...) in the loop and "
                                                                  "return lk.max(err) > tol")
                    name = f"_lk_r{len(slots)}"
                    slots.append((m, arg.id))
                    slot_names.append(name)
                    return ast.copy_location(ast.Name(id=name, ctx=ast.Load()), node)
                s.generic_visit(node)
                return node
        return Sub().visit(cond)

    @staticmethod
    def _feeds_condition(n, parents, ret, inlined):
        node = n
        while node in parents:
            node = parents[node]
            if node is ret:
                return True
            if isinstance(node, ast.Assign):
                return len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and node.targets[0].id in inlined and node.value is n
        return False


def accumulator_kinds(plan: ShardPlan, spec, dtypes: dict) -> tuple[str, ...]:
    """'i' or 'f' per slot of ``plan``: whether the accumulator it reduces holds an integer,
    from the step's assignments (``dtypes``: parameter index -> NumPy dtype kind, 'i', 'u',
    'b' or 'f'). A local is an integer when every value assigned to it is one."""
    body = ast.Module(body=list(spec.step.body), type_ignores=[])
    names = spec.param_names
    int_params = {names[a] for a, k in dtypes.items() if k in "iub" and spec.params[a].kind == "scalar"}
    int_arrays = {names[a] for a, k in dtypes.items() if k in "iub" and spec.params[a].kind == "array"}
    values: dict = {}
    loop_vars = set()
    for n in ast.walk(body):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    values.setdefault(t.id, []).append(n.value)
                elif isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                    for tt, vv in zip(t.elts, n.value.elts):
                        if isinstance(tt, ast.Name):
                            values.setdefault(tt.id, []).append(vv)
                elif isinstance(t, ast.Tuple):
                    for tt in t.elts:
                        if isinstance(tt, ast.Name):
                            values.setdefault(tt.id, []).append(None)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            values.setdefault(n.target.id, []).append(
                None if isinstance(n.op, (ast.Div, ast.Pow)) else n.value)
        elif isinstance(n, ast.For):
            for t in ast.walk(n.target):
                if isinstance(t, ast.Name):
                    loop_vars.add(t.id)
    ints = set(values) | loop_vars | int_params | {spec.index_param}

    def is_int(e) -> bool:
        if e is None:
            return False
        if isinstance(e, ast.Constant):
            return isinstance(e.value, (int, bool))
        if isinstance(e, ast.Name):
            return e.id in ints
        if isinstance(e, ast.Subscript):
            if isinstance(e.value, ast.Name):
                return e.value.id in int_arrays
            return isinstance(e.value, ast.Attribute) and e.value.attr == "shape"
        if isinstance(e, ast.BinOp):
            return not isinstance(e.op, (ast.Div, ast.Pow)) and is_int(e.left) and is_int(e.right)
        if isinstance(e, ast.UnaryOp):
            return is_int(e.operand)
        if isinstance(e, (ast.Compare, ast.BoolOp)):
            return True
        if isinstance(e, ast.IfExp):
            return is_int(e.body) and is_int(e.orelse)
        if isinstance(e, ast.Call):
            f = e.func.id if isinstance(e.func, ast.Name) else None
            if f in ("int", "len", "bool"):
                return True
            if f in ("abs", "min", "max") or marker_of(e) in REDUCTIONS:
                return all(is_int(a) for a in e.args)
        return False

    changed = True
    while changed:      # a fixpoint: a local stays an integer while all its values are
        changed = False
        for name in list(ints):
            if name in values and not all(is_int(v) for v in values[name]):
                ints.discard(name)
                changed = True
    return tuple("i" if acc in ints else "f" for _, acc in plan.slots)


# ------------------------------------------------------------------------------ the generated step
def _lk_name(parsed, func) -> str | None:
    """'range', 'grid', 'max', ... when ``func`` is loopkern's function of that name."""
    import loopkern as _lk
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        found, value = parsed.lookup(func.value.id)
        if found and value is _lk:
            return func.attr
        return None
    if isinstance(func, ast.Name):
        found, value = parsed.lookup(func.id)
        for name in ("range", "grid") + REDUCTIONS:
            if found and value is getattr(_lk, name, None):
                return name
    return None


def chunk_step(parsed, plan: ShardPlan, kinds=()) -> tuple:
    """The step a shard runs: ``name_shard(t, <params>, lo_0, hi_0, ..., redf, redi)``.

    ``lo_k <= i < hi_k`` is the shard's block inside its window along dimension k. Inside each
    parallel loop, an update of an accumulator outside the block leaves it unchanged
    (``err = (max(err, d) if own else err)``), so a reduction covers the block only. A returned
    condition becomes stores of its reductions' values (``redf[k]`` for float accumulators,
    ``redi[k]`` for integer ones, by thread 0: the same on every thread) and the step returns
    nothing: every shard runs the same number of steps, and the driver evaluates the condition
    on the values combined across shards. ``kinds``: 'i' or 'f' per slot
    (:func:`accumulator_kinds`). Returns (ParsedFunction, names of lo/hi per
    dimension as [(lo, hi), ...], name of redf, name of redi)."""
    tree = parsed.tree
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for a in tree.args.args}
    lk = None
    if plan.slots:
        try:
            lk = _lk_alias(parsed)
        except ValueError:
            raise _error(parsed, parsed, tree.lineno, "the step's module must import loopkern under a name "
                         "(import loopkern as lk) for kernel.sharded to generate its step", "") from None
    bounds = [(_fresh(used, f"lo{k}"), _fresh(used, f"hi{k}")) for k in range(plan.ndim)]
    own = _fresh(used, "own")
    redf, redi = _fresh(used, "redf"), _fresh(used, "redi")
    accs = set(plan.accumulators)
    body = copy.deepcopy(tree.body)
    at = tree.body[0]

    def place(node):
        for n in ast.walk(node):
            ast.copy_location(n, at)
        return node

    def guard(stmts):
        out = []
        for s in stmts:
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) \
                    and s.targets[0].id in accs:
                x = s.targets[0].id
                s.value = ast.copy_location(ast.IfExp(test=ast.Name(id=own, ctx=ast.Load()), body=s.value,
                                                      orelse=ast.Name(id=x, ctx=ast.Load())), s.value)
            elif isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name) and s.target.id in accs:
                x = s.target.id
                new = ast.BinOp(left=ast.Name(id=x, ctx=ast.Load()), op=s.op, right=s.value)
                s = ast.copy_location(ast.Assign(targets=[ast.Name(id=x, ctx=ast.Store())], value=ast.IfExp(
                    test=ast.Name(id=own, ctx=ast.Load()), body=new, orelse=ast.Name(id=x, ctx=ast.Load()))), s)
            for field in ("body", "orelse"):
                if hasattr(s, field) and isinstance(getattr(s, field), list):
                    setattr(s, field, guard(getattr(s, field)))
            out.append(s)
        return out

    class Loops(ast.NodeTransformer):
        def visit_For(self, node):
            if isinstance(node.iter, ast.Call) and _lk_name(parsed, node.iter.func) in ("range", "grid"):
                if accs:
                    names = _loop_targets(node)
                    test = " and ".join(f"{bounds[k][0]} <= {v} < {bounds[k][1]}" for k, v in enumerate(names))
                    head = ast.parse(f"{own} = {test}").body[0]
                    for n in ast.walk(head):
                        ast.copy_location(n, node)
                    node.body = [head] + guard(node.body)
                return node
            self.generic_visit(node)
            return node

    body = [Loops().visit(s) for s in body]
    if plan.condition is not None:
        block = []
        stores = []
        for k, (m, acc) in enumerate(plan.slots):
            v = _fresh(used, f"r{k}")
            block.append(place(ast.parse(f"{v} = {lk}.{m}({acc})").body[0]))
            stores.append(f"    {redi if kinds[k] == 'i' else redf}[{k}] = {v}")
        if stores:
            block.append(place(ast.parse(f"if {lk}.thread_id() == 0:\n" + "\n".join(stores)).body[0]))
        # the assignments the condition inlined are not needed any more (each holds a
        # reduction: a barrier per step)
        body = [s for s in body[:-1] if not (isinstance(s, ast.Assign) and len(s.targets) == 1
                                              and isinstance(s.targets[0], ast.Name)
                                              and s.targets[0].id in plan.inlined)] + block
    args = [copy.deepcopy(a) for a in tree.args.args]
    for lo, hi in bounds:
        args += [ast.arg(arg=lo, annotation=None), ast.arg(arg=hi, annotation=None)]
    if plan.condition is not None:
        args += [ast.arg(arg=redf, annotation=None), ast.arg(arg=redi, annotation=None)]
    return generated_step(parsed, f"{tree.name}_shard", args, body), bounds, redf, redi


# ------------------------------------------------------------------------------ the cost model
@dataclass(frozen=True)
class ExchangeCosts:
    """The machine figures the choice of K (steps between halo exchanges) is made from.

    Attributes:
        launch_s: fixed cost of one launch of the shard's kernel (the custom call and the
            kernel's start).
        collective_s: latency of one collective (a ``ppermute`` or the condition's reduction).
        link_bytes_s: bandwidth of one halo transfer between neighbouring devices.
        memory_bytes_s: the device's memory bandwidth (the step's traffic and the copies that
            place received halos into the window).
        step_floor_s: the least a step costs whatever its size (the grid barrier).
        launch_passes: the cost of each launch beyond its steps, in passes over the
            changing arrays' windows (read and written), measured: on the H200 at a 16K x 16K
            float32 block, kernel.jax in launches of 183 steps costs 19 us/step more than in
            one launch (about 3.5 ms per launch; bench/sharded.py, bench-results/session11),
            about three passes over the two 1 GiB windows. Its cause is not identified:
            XLA's compiled loop copies no window (bench/sharded_hlo_probe.py).
    """

    launch_s: float
    collective_s: float
    link_bytes_s: float
    memory_bytes_s: float
    step_floor_s: float
    launch_passes: float = 3.0


#: H200 figures: launch and barrier from bench-results (kernel.jax call overhead, the 1-D heat
#: step at 4K), device copy 3.95 TB/s measured; the link is NCCL's point-to-point over NVLink
#: taken at a third of NVLink 4's 450 GB/s per direction, latency ~25 us (NCCL's published
#: small-message figures); conservative, so K errs on the large side.
GPU_COSTS = ExchangeCosts(launch_s=12e-6, collective_s=25e-6, link_bytes_s=150e9, memory_bytes_s=3.9e12,
                          step_floor_s=1.0e-6)
#: JAX's CPU backend (a host callback per launch; devices are threads of one process).
CPU_COSTS = ExchangeCosts(launch_s=100e-6, collective_s=30e-6, link_bytes_s=5e9, memory_bytes_s=10e9,
                          step_floor_s=2e-6)


def halo_widths(plan: ShardPlan, k_steps: int, parts) -> tuple[int, ...]:
    """Per dimension, the halo of K steps (``parts``: shards along each dimension; a dimension
    that is not split, or read at no offset, has none)."""
    return tuple(k_steps * r if p > 1 and r > 0 else 0 for r, p in zip(plan.radius, parts))


def slab_width(plan: ShardPlan, k: int, halo: int) -> int:
    """Cells exchanged with each neighbour along dimension ``k``: the halo, or twice it where the
    field has edges (the shard at an edge places its window against it and takes all of its
    extra cells from its one neighbour)."""
    return halo if plan.periodic[k] else 2 * halo


def max_exchange_every(plan: ShardPlan, block, parts) -> int | None:
    """The most steps between exchanges that blocks of shape ``block`` allow (a neighbour must
    hold the slab it sends), or None when nothing needs exchanging."""
    limits = []
    for k, (n, p) in enumerate(zip(block, parts)):
        r = plan.radius[k]
        if p > 1 and r > 0:
            limits.append(n // (r * (1 if plan.periodic[k] else 2)))
    return min(limits) if limits else None


def model_step_time(plan: ShardPlan, block, parts, k_steps: int, itemsize: int, costs: ExchangeCosts) -> float:
    """Modelled seconds per step when each shard (block shape ``block``, ``parts`` shards per
    dimension) runs ``k_steps`` steps between exchanges (see :class:`ExchangeCosts`)."""
    halo = halo_widths(plan, k_steps, parts)
    window = [n + 2 * h for n, h in zip(block, halo)]
    cells = 1
    for w in window:
        cells *= w
    arrays = len(plan.state) + len(plan.fixed)
    step = max(costs.step_floor_s, cells * itemsize * (arrays + 1) / costs.memory_bytes_s)
    chunk = costs.launch_s + k_steps * step
    moved = 0
    for k, h in enumerate(halo):
        if h:
            face = cells // window[k]
            moved += 2 * slab_width(plan, k, h) * face * itemsize * len(plan.state)
            chunk += 2 * costs.collective_s
    # sent over the link, and sliced, concatenated and placed on both sides
    chunk += moved / costs.link_bytes_s + 4 * moved / costs.memory_bytes_s
    if moved:
        chunk += costs.launch_passes * 2 * cells * itemsize * len(plan.state) / costs.memory_bytes_s
    if plan.condition is not None:
        chunk += costs.collective_s
    return chunk / k_steps


def choose_exchange_every(plan: ShardPlan, block, parts, itemsize: int, costs: ExchangeCosts,
                          limit: int = 4096) -> int:
    """The K (1 .. the blocks' limit) with the least modelled time per step: redundant work on
    the growing halo against the fixed cost of each exchange."""
    top = max_exchange_every(plan, block, parts)
    top = limit if top is None else min(top, limit)
    best, best_t = 1, None
    for k in range(1, max(top, 1) + 1):
        t = model_step_time(plan, block, parts, k, itemsize, costs)
        if best_t is None or t < best_t * (1 - 1e-9):
            best, best_t = k, t
    return best
