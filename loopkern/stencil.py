"""Which steps are stencils: the analysis that on-chip residency is built on.

A step can keep its arrays on chip across steps (each block owning one tile of the index
space for the whole run, exchanging only the cells at its tile's edge) when every element a
thread reads of a swap pair's arrays lies at a *constant offset* from the element it writes.
This module decides that from the normalized step, and reports the offsets:

- every parallel loop (``lk.range`` / ``lk.grid``) iterates over one index space of ``d``
  dimensions (its loop variables ``x_0 .. x_{d-1}``), and every resident array has ``d``
  dimensions, dimension ``k`` indexed by ``x_k``;
- inside those loops, dimension ``k`` of an access to a resident array is ``x_k + c`` with
  ``c`` an integer known at compile time: a literal, a sum of literals, or the variable of a
  plain ``range`` loop with literal bounds (``for di in range(-1, 2)``); or, periodic,
  ``(x_k + c) % E`` / ``(x_k + c + E) % E`` / ``(x_k + E - c) % E`` with ``E`` the array's extent ``a.shape[k]``
  (or a name bound once to it), or the neighbour written as a conditional expression
  (``x_k - 1 if x_k > 0 else E - 1``, ``x_k + 1 if x_k < E - 1 else 0`` and their mirrored
  forms); an index may also be a name bound once, at the top of the loop body, to such an
  expression of loop variables, literals and extents; ``x_k - c`` in a loop that may start
  below ``c`` is a negative index, which in Python counts from the end of the dimension: that
  access wraps around too (dimension ``k`` is periodic), unless the front end proves the index
  non-negative where it is read (``index_bounds``: under ``if i >= c``, say);
- a resident array that the step writes is written and read only at offset 0 in every
  dimension (a thread's own cell): the halo comes from arrays the step only reads, so no
  thread reads a cell another thread writes in the same step;
- resident arrays are not touched outside the parallel loops, nor passed to helpers.

Arrays the step never writes and that are not in a swap pair may be read anywhere (they stay in
global memory); arrays that are neither (``hist[t] = x``) are simply not resident, as long as
they are not swap arrays. Anything else makes the step "not a stencil", with the reason and
the line, and it runs as today.

This module is pure analysis (no Numba, no JAX): it reads a :class:`~loopkern.spec.StepSpec`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .index_bounds import is_nonneg_mark, mark_nonneg_indices
from .spec import binding_counts, flat_targets, int_constant, is_helper_call, marker_of


@dataclass(frozen=True)
class Stencil:
    """A step that is a stencil (see the module docstring).

    Attributes:
        ndim: dimensions of the index space.
        halo: per dimension, (cells read below, cells read above) the written cell: the
            largest negative and positive offsets of any read of a resident array.
        periodic: per dimension, whether some read wraps around the array's extent.
        resident: indices (into the step's parameters) of the arrays that may stay on chip:
            the swap pairs' arrays and any other array accessed only at offset 0.
        offsets: per resident array, the set of offset tuples it is read at.
        reads, writes: per array (resident or not) accessed inside the parallel loops at
            constant offsets, the set of offset tuples it is read (written) at.
        irregular: per array, the line of its first access that is not at a constant offset
            from the loop indices (or is outside the parallel loops); what sharding needs.
        wraps: per array, the dimensions along which some access of it wraps around.
        row_shifts: names bound once at the top of a parallel loop's body to an index of
            dimension 0 that is always the loop's own index plus one constant, wrapping
            around or not (``up = i - 1 if i > 0 else n - 1``): name -> that constant. In a
            tile that holds the rows around its own (the halo across the wrap included), the
            row such a name indexes is the cell's row plus the constant.
        min_rows: the fewest cells the swap pairs' arrays must have along the first dimension
            for every parallel loop that names them to run inside them (tile mode runs each
            loop's indices in the tiles only; ``lk.range(1, 5)`` needs 5).
    """

    ndim: int
    halo: tuple[tuple[int, int], ...]
    periodic: tuple[bool, ...]
    resident: frozenset[int]
    offsets: dict = field(hash=False, compare=False)   # what the kernel depends on is above
    reads: dict = field(default_factory=dict, hash=False, compare=False)
    writes: dict = field(default_factory=dict, hash=False, compare=False)
    irregular: dict = field(default_factory=dict, hash=False, compare=False)
    wraps: dict = field(default_factory=dict, hash=False, compare=False)
    row_shifts: dict = field(default_factory=dict, hash=False, compare=False)
    min_rows: int = field(default=0, hash=False, compare=False)


@dataclass(frozen=True)
class NotStencil:
    """Why a step is not a stencil: the reason and the user's line it is about."""

    reason: str
    line: int


def find_stencil(spec, need_resident: bool = True) -> Stencil | NotStencil:
    """Decide whether ``spec``'s step is a stencil; see the module docstring. With
    ``need_resident=False`` a step none of whose arrays could stay on chip still gets its
    accesses described (``reads``, ``writes``, ``irregular``: what sharding needs)."""
    return _Analysis(spec, need_resident).run()


class _Reject(Exception):
    def __init__(self, reason, node):
        super().__init__(reason)
        self.reason, self.line = reason, getattr(node, "lineno", 0)


_WHOLE = object()     # an offset that is not a compile-time constant


class _Analysis:
    def __init__(self, spec, need_resident=True):
        self.spec, self.need_resident = spec, need_resident
        self.names = [p.name for p in spec.params]
        self.arrays = {p.name: i for i, p in enumerate(spec.params) if p.kind == "array"}
        self.swapped = {i for pair in spec.swap for i in pair}
        self.ndim = None
        self.reads: dict = {}        # array index -> {offset tuple}
        self.writes: dict = {}       # array index -> {offset tuple}
        self.outside: dict = {}      # array index -> first node touching it outside a parallel loop
        self.extent_names: dict = {}     # name -> (array index, dim) for n = a.shape[k]
        self.bindings = binding_counts(spec.step.body)
        self.wraps: dict = {}            # array index -> dimensions some access of it wraps around
        self.aliases: dict = {}          # name -> the index expression it names (inside a loop)
        self._wrapped: set = set()       # the dimensions the access being read wraps
        self.lows: dict = {}             # dimension -> the parallel loop's first index, if a literal
        self.shifts: dict = {}           # alias name -> the offset sets its dimension-0 uses gave
        self.loops: list = []            # the parallel loops (For nodes)
        self.int_names: dict = {}        # name -> the integer literal it is bound to once, at the top

    def run(self):
        try:
            step = self.spec.step
            # indices the front end proves non-negative arrive wrapped (index_bounds): such an
            # index never counts from the end of its dimension, whatever the loop's start
            self._function(mark_nonneg_indices(step.body, step.params, step.array_params,
                                               step.params[0] if step.params else None))
            return self._result()
        except _Reject as r:
            return NotStencil(r.reason, r.line)

    # -- the walk ------------------------------------------------------------------------------
    def _function(self, body):
        for st in body:
            self._statement(st, loop=None, offsets={})

    def _statement(self, st, loop, offsets):
        if isinstance(st, ast.For):
            kind = marker_of(st.iter)
            if kind in ("range", "grid"):
                if loop is not None:
                    raise _Reject("a parallel loop inside another", st)
                self._parallel(st, kind)
                return
            if loop is not None and isinstance(st.target, ast.Name) and _literal_range(st.iter) is not None:
                # a sequential loop over literal bounds: its variable is a set of offsets, unless
                # the body binds it again (d = d * 5 reads other offsets than the range's)
                if binding_counts(st.body + st.orelse).get(st.target.id):
                    raise _Reject(f"the variable '{st.target.id}' of a sequential loop is assigned in its body", st)
                inner = dict(offsets)
                inner[st.target.id] = frozenset(_literal_range(st.iter))
                self._expressions(st.iter, loop, offsets)
                for s in st.body + st.orelse:
                    self._statement(s, loop, inner)
                return
            self._expressions(st.iter, loop, offsets)
            for s in st.body + st.orelse:
                self._statement(s, loop, offsets)
            return
        if isinstance(st, ast.Assign) and loop is None and len(st.targets) == 1:
            for name, value in _named_values(st.targets[0], st.value, self.arrays):
                # (a name bound again elsewhere, n = n - 3, holds the extent only for a while)
                if self.bindings.get(name) != 1:
                    continue
                if isinstance(value, tuple):
                    self.extent_names[name] = value
                elif _extent_of(value, self.arrays) is not None:
                    self.extent_names[name] = _extent_of(value, self.arrays)
                elif int_constant(value) is not None:
                    self.int_names[name] = int_constant(value)
        if isinstance(st, (ast.Assign, ast.AugAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            for tgt in flat_targets(targets):
                if isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name) and tgt.value.id in self.arrays:
                    self._access(tgt, loop, offsets, write=True)
                    if isinstance(st, ast.AugAssign):
                        self._access(tgt, loop, offsets, write=False)
                    self._expressions(tgt.slice, loop, offsets)
                elif loop is not None and isinstance(tgt, ast.Name) and tgt.id in loop:
                    raise _Reject(f"the loop variable '{tgt.id}' is assigned in the loop", st)
                else:
                    self._expressions(tgt, loop, offsets)
            self._expressions(st.value, loop, offsets)
            return
        for child in ast.iter_child_nodes(st):
            if isinstance(child, ast.stmt):
                self._statement(child, loop, offsets)
            else:
                self._expressions(child, loop, offsets)

    def _parallel(self, st, kind):
        targets = st.target.elts if isinstance(st.target, ast.Tuple) else [st.target]
        if not all(isinstance(t, ast.Name) for t in targets):
            raise _Reject("a parallel loop whose variables are not plain names", st)
        ndim = len(st.iter.args) if kind == "grid" else 1
        if kind == "grid" and len(targets) != ndim:
            raise _Reject("lk.grid with one variable for several dimensions", st)
        if self.ndim is None:
            self.ndim = ndim
        elif self.ndim != ndim:
            raise _Reject(f"parallel loops over {self.ndim} and {ndim} dimensions", st)
        self._expressions(st.iter, None, {})
        self.loops.append(st)
        self.lows = _first_indices(st.iter, kind, ndim)
        loop = {t.id: k for k, t in enumerate(targets)}
        # neighbour indices named once at the top of the loop body (up = i - 1 if i > 0 else
        # n - 1): an access through the name is analysed as the expression it names
        assigned = binding_counts(self.spec.step.body)
        self.aliases = {}
        for s in st.body:
            if not (isinstance(s, ast.Assign) and len(s.targets) == 1):
                continue
            for name, value in _named_values(s.targets[0], s.value, self.arrays):
                if (isinstance(value, ast.expr) and assigned.get(name) == 1 and name not in loop
                        # only loop variables, extents and arrays (a.shape[k]): nothing that can change
                        and all(n.id in loop or n.id in self.extent_names or n.id in self.arrays
                                for n in ast.walk(value) if isinstance(n, ast.Name))):
                    self.aliases[name] = value
        for s in st.body + st.orelse:
            self._statement(s, loop, {})
        self.aliases = {}

    def _expressions(self, node, loop, offsets):
        for n in ast.walk(node):
            if is_helper_call(n) and any(isinstance(a, ast.Name) and a.id in self.arrays for a in n.args):
                raise _Reject("an array is passed to a helper function", n)
            m = marker_of(n)
            if m is not None and m.startswith("atomic_") and n.args and isinstance(n.args[0], ast.Name) \
                    and n.args[0].id in self.arrays:
                # lk.atomic.add(a, index, value): a write that other threads may share
                a = self.arrays[n.args[0].id]
                if loop is None:
                    self.outside.setdefault(a, n)
                else:
                    self.writes.setdefault(a, []).append((_WHOLE, n))
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in self.arrays:
                self._access(n, loop, offsets, write=False)
            elif isinstance(n, ast.Name) and n.id in self.arrays and isinstance(n.ctx, ast.Load):
                # a whole array used as a value (a.shape, len(a), a reduction's argument...)
                pass

    def _access(self, node, loop, offsets, write):
        a = self.arrays[node.value.id]
        if loop is None:
            self.outside.setdefault(a, node)
            return
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if len(elts) != self.ndim:
            off = _WHOLE
        else:
            off = []
            proven = [is_nonneg_mark(e) for e in elts]
            for k, e in enumerate(elts):
                if proven[k]:
                    e = e.args[0]
                o = self._offset(e, k, loop, offsets, a)
                if k == 0 and isinstance(e, ast.Name) and e.id in self.aliases:
                    self.shifts.setdefault(e.id, set()).add(o)
                if o is _WHOLE:
                    off = _WHOLE
                    break
                off.append(o)
            off = _WHOLE if off is _WHOLE else tuple(off)
        (self.writes if write else self.reads).setdefault(a, []).append((off, node))
        if off is not _WHOLE:
            for k, o in enumerate(off):
                # x_k + c with c < 0 may be a negative index, which in Python counts from the end
                # of the dimension (as the grid scope's kernel reads it): the access wraps
                # around unless the loop starts at -c or above; so does x_k itself in a loop
                # whose literal start is negative (a start computed at run time is taken as
                # non-negative: README, Backends, scope "tile")
                low = self.lows.get(k)
                if not proven[k] and ((min(o) < 0 and low is None) or (low is not None and low + min(o) < 0)):
                    self._wrapped.add(k)
                    if write and a in self.swapped and low is not None:
                        # the block that runs the index holds a copy of that cell, not the cell
                        raise _Reject(f"'{node.value.id}' is written at a negative index (counted from the "
                                      f"end of the array in Python)", node)
            for k in self._wrapped:
                self.wraps.setdefault(a, set()).add(k)
        self._wrapped = set()

    def _offset(self, e, k, loop, offsets, a):
        """The set of constant offsets ``e`` is from loop variable ``x_k`` (a frozenset of
        ints), or _WHOLE. A periodic form marks dimension ``k`` periodic."""
        if isinstance(e, ast.Name) and e.id in self.aliases:
            e = self.aliases[e.id]
        if isinstance(e, ast.IfExp):
            got = self._wrapped_neighbour(e, k, loop, a)
            if got is None:
                return _WHOLE
            self._wrapped.add(k)
            return got
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mod):
            extent = self._extent(e.right, a, k)
            if extent:
                # (x + c + E) % E, (x + E - 1) % E: a multiple of E added only keeps the left
                # side non-negative
                terms = _terms(e.left)
                if terms is not None:
                    terms = [(sg, t) for sg, t in terms if not self._extent(t, a, k)]
                got = self._linear_terms(terms, k, loop, offsets)
                if got is not _WHOLE:
                    self._wrapped.add(k)
                return got
            return _WHOLE
        return self._linear(e, k, loop, offsets)

    def _linear(self, e, k, loop, offsets):
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "uint64" and len(e.args) == 1:
            e = e.args[0]
        return self._linear_terms(_terms(e), k, loop, offsets)

    def _linear_terms(self, terms, k, loop, offsets):
        if terms is None:
            return _WHOLE
        var, total = None, frozenset([0])
        for sign, t in terms:
            if isinstance(t, ast.Name) and t.id in loop:
                if var is not None or sign < 0 or loop[t.id] != k:
                    return _WHOLE
                var = t.id
                continue
            c = int_constant(t)
            vals = frozenset([c]) if c is not None else offsets.get(t.id) if isinstance(t, ast.Name) else None
            if vals is None:
                return _WHOLE
            total = frozenset(x + sign * v for x in total for v in vals)
        return total if var is not None else _WHOLE

    def _wrapped_neighbour(self, e, k, loop, a):
        """{-1} or {+1} for the periodic neighbour written as a conditional expression:
        ``x - 1 if x > 0 else E - 1`` (or ``x >= 1``; or ``E - 1 if x == 0 else x - 1``) and
        ``x + 1 if x < E - 1 else 0`` (or ``x + 1 < E``; or ``0 if x == E - 1 else x + 1``);
        {-s} or {+s} for one ``s`` away: ``x - s if x >= s else x - s + E`` and
        ``x + s if x < E - s else x + s - E`` (the drop-in loops' ``jnp.roll(v, ±s)``), ``E``
        the extent of ``a`` along ``k``; None for anything else."""
        def lin(node):
            got = self._linear(node, k, loop, {})
            return None if got is _WHOLE or len(got) != 1 else next(iter(got))

        def extent_less(node, c):
            # E - c
            t = _terms(node)
            return (t is not None and len(t) == 2 and t[0][0] == 1 and self._extent(t[0][1], a, k)
                    and t[1][0] == -1 and int_constant(t[1][1]) == c)

        test = e.test
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
            return None
        left, op, right = test.left, test.ops[0], test.comparators[0]
        var = [n for n, kk in loop.items() if kk == k]
        if not var:
            return None
        x = var[0]

        def is_x(node):
            return isinstance(node, ast.Name) and node.id == x

        def wrapped(node, c, sign):
            # x + c + sign * E: the loop variable once, the extent once with that sign, and
            # literals summing to c
            t = _terms(node)
            if t is None:
                return False
            xs = [sg for sg, u in t if is_x(u)]
            es = [sg for sg, u in t if not is_x(u) and self._extent(u, a, k)]
            rest = [sg * int_constant(u) if int_constant(u) is not None else None for sg, u in t
                    if not is_x(u) and not self._extent(u, a, k)]
            return xs == [1] and es == [sign] and None not in rest and sum(rest) == c

        if lin(e.body) == -1 and extent_less(e.orelse, 1) and is_x(left) and (
                isinstance(op, ast.Gt) and int_constant(right) == 0 or isinstance(op, ast.GtE) and int_constant(right) == 1):
            return frozenset([-1])
        if lin(e.orelse) == -1 and extent_less(e.body, 1) and is_x(left) and isinstance(op, ast.Eq) \
                and int_constant(right) == 0:
            return frozenset([-1])
        if lin(e.body) == 1 and int_constant(e.orelse) == 0 and isinstance(op, ast.Lt) and (
                is_x(left) and extent_less(right, 1) or lin(left) == 1 and self._extent(right, a, k)):
            return frozenset([1])
        if lin(e.orelse) == 1 and int_constant(e.body) == 0 and isinstance(op, ast.Eq) and is_x(left) \
                and extent_less(right, 1):
            return frozenset([1])
        # a neighbour s > 1 away: x - s if x >= s else x - s + E, x + s if x < E - s else x + s - E
        # (both exact for E >= s, which tile mode's tiles, each at least a halo long, ensure)
        s = lin(e.body)
        if s is None or s == 0 or not is_x(left):
            return None
        if s < 0 and isinstance(op, ast.GtE) and int_constant(right) == -s and wrapped(e.orelse, s, 1):
            return frozenset([s])
        if s > 0 and isinstance(op, ast.Lt) and extent_less(right, s) and wrapped(e.orelse, s, -1):
            return frozenset([s])
        return None

    def _extent(self, e, a, k) -> bool:
        """Whether ``e`` is array ``a``'s (or its swap partner's) extent along dimension ``k``."""
        got = _extent_of(e, self.arrays)
        if got is None and isinstance(e, ast.Name):
            got = self.extent_names.get(e.id)
        if got is None:
            return False
        b, dim = got
        return dim == k and (b == a or any({a, b} == set(pair) for pair in self.spec.swap))

    # -- the verdict ---------------------------------------------------------------------------
    def _result(self):
        if self.ndim is None:
            raise _Reject("the step has no parallel loop", self.spec.step)
        written = set(self.writes)
        resident = set()
        for a in sorted(set(self.reads) | written | self.swapped):
            accesses = self.reads.get(a, []) + self.writes.get(a, [])
            name = self.names[a]
            whole = next((n for off, n in accesses if off is _WHOLE), None)
            away = next((n for off, n in accesses if off is not _WHOLE and any(o != frozenset([0]) for o in off)),
                        None)
            if a not in self.swapped:
                # another array stays in global memory unless the step writes it and every
                # access is a thread's own cell
                if a in written and a not in self.outside and whole is None and away is None:
                    resident.add(a)
                continue
            if a in self.outside:
                raise _Reject(f"'{name}' is accessed outside the parallel loops", self.outside[a])
            if whole is not None:
                raise _Reject(f"an access to '{name}' is not its loop index plus a constant", whole)
            if a in written and away is not None:
                raise _Reject(f"'{name}' is written by the step and accessed away from the written cell", away)
            if self.spec.params[a].min_ndim > self.ndim:
                raise _Reject(f"'{name}' has more dimensions than the parallel loops", self.spec.step)
            resident.add(a)
        if not resident and self.need_resident:
            raise _Reject("no array can stay on chip (no swap pair, nor an array written only at its own cells)",
                          self.spec.step)
        min_rows = self._loops_within_the_tiles() if self.need_resident else 0
        halo = [[0, 0] for _ in range(self.ndim)]
        offsets = {}
        for a in resident:
            seen = set()
            for off, _ in self.reads.get(a, []):
                for combo in _product(off):
                    seen.add(combo)
                    for k, o in enumerate(combo):
                        halo[k][0] = max(halo[k][0], -o)
                        halo[k][1] = max(halo[k][1], o)
            offsets[self.names[a]] = frozenset(seen)
        periodic = tuple(any(k in self.wraps.get(a, ()) for a in resident) for k in range(self.ndim))
        return Stencil(ndim=self.ndim, halo=tuple(tuple(h) for h in halo), periodic=periodic,
                       resident=frozenset(resident), offsets=offsets, reads=self._regular(self.reads),
                       writes=self._regular(self.writes), irregular=self._irregular(),
                       wraps={a: frozenset(d) for a, d in self.wraps.items()},
                       row_shifts=self._row_shifts(), min_rows=min_rows)

    def _loops_within_the_tiles(self) -> int:
        """Each block of tile mode runs the indices of its own tile of the first dimension of
        the swap pairs' arrays, in every parallel loop that names one of them (``codegen``'s
        ``clip_of``): such a loop must run inside that extent, or its other indices would run
        nowhere (their stores lost, silently). A bound that is a literal, or the extent plus a
        literal, is checked; _Reject for any other. Returns the fewest cells the arrays must
        have for every such loop to stay inside them (a literal stop of 5 needs 5)."""
        names = {self.names[a] for a in self.swapped}
        need = 0
        for st in self.loops:
            touched = sorted({n.id for n in ast.walk(st) if isinstance(n, ast.Name)} & names)
            if not touched:
                continue
            got = self._rows_needed(st.iter)
            if isinstance(got, str):
                a = self.names[min(self.swapped)]
                raise _Reject(f"this parallel loop reads or writes '{touched[0]}', kept on chip in tile mode, "
                              f"and {got}; each block runs only the indices of its own tile of the first "
                              f"dimension, so the loop must run inside [0, {a}.shape[0]): bound it by literals "
                              f"and {a}.shape[0] plus or minus a literal, e.g. lk.range(1, {a}.shape[0] - 1)", st)
            need = max(need, got)
        return need

    def _rows_needed(self, it) -> int | str:
        """The fewest cells along the first dimension of the swap pairs' arrays for which the
        first dimension of the parallel loop ``it`` (an ``lk.range``/``lk.grid`` call) runs
        inside them, or what may take it outside (a string)."""
        kind = marker_of(it)
        if kind == "range":
            args = list(it.args)
        else:
            first = it.args[0]
            args = list(first.elts) if isinstance(first, ast.Tuple) else [first]
        start, stop = (None, args[0]) if len(args) == 1 else (args[0], args[1])
        step = self._int_value(args[2]) if len(args) > 2 else 1
        if step is None and self._extent_minus(args[2]) is not None:
            # lk.range(0, n, n - 1), the two boundary cells: a step of the extent minus a
            # literal counts as positive (zero or negative only for arrays too short to have
            # those boundaries)
            step = 1
        if step is None:
            return "its step is neither a literal nor the arrays' extent minus a literal"
        # counting up the indices lie in [start, stop), counting down in (stop, start]
        low, high, floor, ceiling = (start, stop, 0, 0) if step > 0 else (stop, start, -1, -1)
        need = 0
        if low is not None:
            v, less = self._int_value(low), self._extent_minus(low)
            if v is not None and v < floor:
                return f"its {'start' if step > 0 else 'stop'} is below {floor}"
            if v is None and less is None:
                return f"its {'start' if step > 0 else 'stop'} may be below {floor}"
            if v is None:
                need = max(need, floor - less)      # n + less >= floor
        v, less = self._int_value(high), self._extent_minus(high)
        if v is not None:
            need = max(need, v - ceiling)           # v <= n + ceiling
        elif less is None or less > ceiling:
            return f"its {'stop' if step > 0 else 'start'} may lie beyond the arrays' extent"
        return need

    def _extent_minus(self, e) -> int | None:
        """``c`` when ``e`` is the swap pairs' first extent plus the literal ``c`` (``n - 1``,
        ``u.shape[0]``), else None."""
        terms = _terms(e)
        ext = [t for sg, t in terms or () if sg > 0 and any(self._extent(t, a, 0) for a in self.swapped)]
        rest = [(sg, self._int_value(t)) for sg, t in terms or () if not any(t is x for x in ext)]
        if len(ext) != 1 or any(v is None for _, v in rest):
            return None
        return sum(sg * v for sg, v in rest)

    def _int_value(self, e) -> int | None:
        """An integer literal, or a name bound once at the step's top level to one."""
        c = int_constant(e)
        if c is None and isinstance(e, ast.Name):
            c = self.int_names.get(e.id)
        return c

    def _row_shifts(self):
        shifts = {}
        for name, sets in self.shifts.items():
            (o, *others) = sets
            if not others and o is not _WHOLE and len(o) == 1:
                shifts[name] = next(iter(o))
        return shifts

    @staticmethod
    def _regular(accesses):
        return {a: frozenset(c for off, _ in acc if off is not _WHOLE for c in _product(off))
                for a, acc in accesses.items()}

    def _irregular(self):
        out = {a: getattr(n, "lineno", 0) for a, n in self.outside.items()}
        for acc in (self.reads, self.writes):
            for a, lst in acc.items():
                for off, n in lst:
                    if off is _WHOLE:
                        out.setdefault(a, getattr(n, "lineno", 0))
        return out


def _terms(e, sign=1):
    """``e`` as a list of (sign, term) for a chain of + and -, or None for anything else."""
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
        left = _terms(e.left, sign)
        right = _terms(e.right, sign if isinstance(e.op, ast.Add) else -sign)
        return None if left is None or right is None else left + right
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub) and int_constant(e) is None:
        return _terms(e.operand, -sign)
    return [(sign, e)]


def _literal_range(it):
    """The values of ``range(a[, b[, s]])`` with literal arguments, else None."""
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"):
        return None
    args = [int_constant(a) for a in it.args]
    if not args or any(a is None for a in args) or len(args) > 3 or (len(args) == 3 and args[2] == 0):
        return None
    return list(range(*args))


def _named_values(target, value, arrays) -> list:
    """(name, value) for each name ``target`` binds: ``n = e``, ``n, m = e1, e2`` and
    ``n, m = a.shape`` (whose values are (array index, dim) tuples)."""
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if not isinstance(target, ast.Tuple) or not all(isinstance(t, ast.Name) for t in target.elts):
        return []
    if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
        return [(t.id, v) for t, v in zip(target.elts, value.elts)]
    if (isinstance(value, ast.Attribute) and value.attr == "shape" and isinstance(value.value, ast.Name)
            and value.value.id in arrays):
        return [(t.id, (arrays[value.value.id], k)) for k, t in enumerate(target.elts)]
    return []


def _extent_of(e, arrays):
    """(array index, dim) if ``e`` is ``a.shape[k]`` (or ``len(a)``, dim 0) of an array parameter."""
    if (isinstance(e, ast.Subscript) and isinstance(e.value, ast.Attribute) and e.value.attr == "shape"
            and isinstance(e.value.value, ast.Name) and e.value.value.id in arrays):
        k = int_constant(e.slice)
        if k is not None and k >= 0:
            return arrays[e.value.value.id], k
    if (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "len" and len(e.args) == 1
            and isinstance(e.args[0], ast.Name) and e.args[0].id in arrays):
        return arrays[e.args[0].id], 0
    return None


def _product(off):
    out = [()]
    for vals in off:
        out = [p + (v,) for p in out for v in sorted(vals)]
    return out


def _first_indices(it: ast.Call, kind: str, ndim: int) -> dict:
    """Per dimension of a parallel loop, its first index when it is an integer literal and the
    loop counts up (``lk.range(n)``, ``lk.range(1, n - 1)``, ``lk.grid(n, (1, m))``): the
    lowest index it takes."""
    if kind == "range":
        args = it.args
        if len(args) == 1:
            return {0: 0}
        step = 1 if len(args) == 2 else int_constant(args[2])
        if step is not None and step > 0:
            low = int_constant(args[0])
            return {} if low is None else {0: low}
        return {}
    lows = {}
    for k, a in enumerate(it.args[:ndim]):
        low = int_constant(a.elts[0]) if isinstance(a, ast.Tuple) else 0
        if low is not None:
            lows[k] = low
    return lows


def split_exchange_refusal(spec, stencil: Stencil) -> NotStencil | None:
    """Why tile mode cannot split the grid barrier of ``spec``'s halo exchange (one step per
    exchange), or None if it can.

    With the barrier split, a block computes the next step's rows that read no halo row
    before the other blocks have published their edges, then waits, gathers its halo and
    computes its remaining rows: each step runs in three windows of the block's tile. That is
    sound under :func:`fused_steps_refusal`'s conditions but the last (a step's effect on
    memory is a function of the cells it reads; it writes only its swap pairs, so nothing it
    writes is read by another block before the barrier, and it neither returns a stop
    decision nor needs every block at once): each cell is computed once, by the same rules,
    in some window. A stencil that wraps around along the first dimension may split: its
    halo rows come through the exchange like any other. There must be an exchange (a halo
    and a written array)."""
    if not any(stencil.halo[0]):
        return NotStencil("the stencil has no halo along its first dimension (nothing to exchange)", spec.lineno)
    return fused_steps_refusal(spec, stencil, wrap=True)


def fused_steps_refusal(spec, stencil: Stencil, wrap: bool = False) -> NotStencil | None:
    """Why tile mode cannot run several of ``spec``'s steps per halo exchange, or None if it can.

    Running ``K`` steps between exchanges (temporal blocking) widens each block's halo to ``K``
    times the stencil's and recomputes the cells of that halo redundantly, each step on a
    range one stencil width narrower, so the block's own cells end the ``K`` steps exactly as
    the grid scope leaves them. That is only sound when a step's effect on memory is a function
    of the cells it reads and nothing else:

    - no ``return`` of a condition (a stop decision is per step, and every thread must see it);
    - no ``lk.sync()``, reduction, ``lk.atomic``, ``lk.thread_id`` or ``lk.num_threads`` (in
      the step or its helpers): they depend on which thread runs an iteration, or need every
      block at once (``lk.random`` draws may stay: each is a function of the seed, the step
      index, its key and its call site, so a recomputed cell draws the same numbers);
    - the only arrays the step writes are the swap pairs' (``hist[t] = x`` would be written
      twice by blocks that recompute a cell, and may be read by none);
    - ``stencil`` already holds (every read of a swap pair's array is its loop index plus a
      constant; a written array is accessed only at its own cell);
    - the stencil does not wrap around along its first dimension (a halo widened across the
      wrap is not built), unless ``wrap`` (:func:`split_exchange_refusal`, which widens no halo).
    """
    if spec.returns_condition:
        return NotStencil("the step returns a condition (a stop decision every step)", spec.lineno)
    if stencil.periodic[0] and not wrap:
        return NotStencil("the stencil wraps around along its first dimension", spec.lineno)
    swapped = {i for pair in spec.swap for i in pair}
    for i, p in enumerate(spec.params):
        if p.written and i not in swapped:
            return NotStencil(f"the step writes '{p.name}', which is not in a swap pair", spec.lineno)
    for fn in (spec.step,) + tuple(spec.helpers):
        for node in (n for st in fn.body for n in ast.walk(st)):
            m = marker_of(node)
            if m is not None and m not in ("range", "grid", "random_uniform", "random_normal"):
                name = m.replace("_", ".", 1) if m.startswith("atomic_") else m
                return NotStencil(f"the step calls lk.{name}", getattr(node, "lineno", spec.lineno))
    return None
