"""Render a :class:`~loopkern.spec.StepSpec` into kernel source text for one backend.

Pure text work: no numba, no jax. The normalized body is lowered per backend (in-step API
markers become runtime calls or loops), each statement is printed with ``ast.unparse`` and
ends with ``# line N``, and the pieces fill a template from ``templates/``. The returned
:class:`KernelSource` maps every generated line back to the user's file and line, so compiler
errors can point at the user's code.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import re
import string
from dataclasses import dataclass, field
from importlib import resources

from .errors import LoopkernError
from .index_bounds import is_nonneg_mark, mark_nonneg_indices
from .warpsplit import WARP, find_warp_split
from .spec import INTRINSIC_PREFIX, RESERVED_PREFIX, FunctionSpec, StepSpec, int_constant, is_helper_call, marker_of

BACKENDS = ("cuda", "cpu")
SCOPES = ("grid", "block", "thread")
_INDENT = "    "
_P = RESERVED_PREFIX


@dataclass(frozen=True)
class KernelSource:
    """Generated kernel source for one backend and scope.

    Attributes:
        text: the Python source of a module defining ``_lk_kernel``.
        backend: ``"cuda"`` or ``"cpu"``.
        scope: ``"grid"``, ``"block"`` or ``"thread"`` (``"grid"`` for the CPU backend).
        line_map: generated line number -> (user file, user line, user column).
        step_name: the user's step function name.
        debug: bounds-checked array access (``debug=True``).
        sites: for a debug kernel, the :class:`Site` of each checked access, by site number.
    """

    text: str
    backend: str
    scope: str
    step_name: str
    line_map: dict = field(repr=False, compare=False)
    debug: bool = False
    sites: tuple = field(default=(), repr=False, compare=False)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Site:
    """One bounds-checked array access in a debug kernel.

    Attributes:
        array: the array's name in the user's code.
        kind: ``"load"`` or ``"store"``.
        filename, line, col: where it is (1-based line and column).
        function: the step or helper it is in.
    """

    array: str
    kind: str
    filename: str
    line: int
    col: int
    function: str


class _Sites:
    """Numbers the checked accesses of one kernel as they are generated."""

    def __init__(self):
        self.sites: list[Site] = []

    def add(self, array, kind, filename, node, function) -> int:
        self.sites.append(Site(array, kind, filename, node.lineno, node.col_offset + 1, function))
        return len(self.sites) - 1


_DEBUG_CTX = (f"{_P}dbg", f"{_P}dt")


def load_template(name: str) -> string.Template:
    """Read the template ``name`` from the package ``loopkern.templates``.

    The ``templates/`` folder is installed as that package (setup.cfg's ``package_dir``); an
    editable install (``pip install -e .``) maps it too. A bare checkout on ``sys.path`` does
    not: loopkern must be installed.

    Raises:
        LoopkernError: the package or the template is missing.
    """
    try:
        folder = resources.files("loopkern.templates")
    except ModuleNotFoundError as exc:
        raise LoopkernError(
            f"loopkern's kernel templates (the package 'loopkern.templates', needed for '{name}') are not "
            f"importable: loopkern is used from a source folder that is not installed, or from a broken "
            f"install. Install the package (pip install ., or pip install -e . for a checkout) "
            f"instead of putting the checkout on PYTHONPATH") from exc
    try:
        text = folder.joinpath(name).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise LoopkernError(
            f"loopkern's kernel template '{name}' is missing from the package 'loopkern.templates' "
            f"({folder}): the install is incomplete or out of date; reinstall loopkern (pip install .)") from exc
    return string.Template(text)


class _Lines:
    """Collects generated lines, each tagged with the user's line it comes from."""

    def __init__(self, filename: str, home: str):
        self.filename = filename
        self.tag = "line " if filename == home else f"{filename}:"
        self.lines: list[str] = []
        self.memo_slots = 0     # a step's: slots of its state array after the first (parallel_grid)

    def add(self, depth: int, text: str, node: ast.AST | None = None):
        if node is not None and getattr(node, "lineno", None):
            self.lines.append(f"{_INDENT * depth}{text}  # {self.tag}{node.lineno}")
        else:
            self.lines.append(f"{_INDENT * depth}{text}")


#: the float constants of ``math`` (and NumPy's of the same names, which the front end reads
#: from ``math``)
_FLOAT_CONSTANTS = frozenset({"pi", "e", "tau", "inf", "nan"})


class _Lower(ast.NodeTransformer):
    """Replace in-step API markers in expressions with backend code."""

    def __init__(self, backend: str, scope: str, index_name: str = "t", sites: "_Sites | None" = None,
                 filename: str = "", function: str = "", float_type: str | None = None,
                 arrays: frozenset = frozenset(), index_bits: int | None = None,
                 tile_arrays: frozenset = frozenset(), shared_arrays: frozenset = frozenset(),
                 stencil=None):
        self.float_type = float_type
        # tile mode: names bound to the cell's row plus a constant (Stencil.row_shifts), whose
        # accesses are addressed from the cell's row (in its unrolled copies too)
        self.row_shifts = stencil.row_shifts if stencil is not None else {}
        # tile mode of a stencil that wraps around along dimension 0: a tile's first and last
        # rows have neighbours at the far end of the array, which its halo holds; such an
        # access's row is found modulo the extent (runtime cuda_rt.tile_row)
        self.tile_wrap = stencil is not None and stencil.periodic[0]
        # tile mode (on-chip residency): these arrays are the block's tile in shared memory,
        # whose element k holds the array's element _lk_tb + k
        self.tile_arrays = tile_arrays
        # tile mode, inside a parallel loop: the names of its indices (row, column in 2-D), by
        # which a 2-D tile's accesses are addressed (see _tile_flat) and an access is known
        # not to wrap around (_own_row); None elsewhere
        self.tile_cell = None
        # arrays in shared memory (tiles, block scope's staged arrays): their accesses with
        # indices proven non-negative go through runtime/arrays.py's ld.shared/st.shared
        self.shared_arrays = shared_arrays | tile_arrays
        # loopkern's own element accesses (runtime/arrays.py) for these array parameters, with
        # offsets of this many bits; None: Numba's indexing everywhere
        self.arrays = arrays
        self.access = None if index_bits is None else ("", "32")[index_bits == 32]
        self.backend = backend
        self.scope = scope
        self.index_name = index_name
        self.sites = sites          # None unless debug: then array loads are bounds-checked
        self.filename = filename
        self.function = function

    def visit_Constant(self, node):
        if self.float_type and isinstance(node.value, float):
            # a Python float takes the arrays' precision (NumPy 2 and JAX weak typing)
            func = ast.Attribute(value=ast.Name(id="_lk_np", ctx=ast.Load()), attr=self.float_type, ctx=ast.Load())
            return ast.copy_location(ast.Call(func=func, args=[node], keywords=[]), node)
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if (self.float_type and isinstance(node.value, ast.Name) and node.value.id == f"{_P}math"
                and node.attr in _FLOAT_CONSTANTS):
            # math.pi (np.pi, math.e, ...) is a Python float too: the arrays' precision, as a
            # literal (NumPy 2); in float64 it made float32 expressions round differently
            func = ast.Attribute(value=ast.Name(id="_lk_np", ctx=ast.Load()), attr=self.float_type, ctx=ast.Load())
            return ast.copy_location(ast.Call(func=func, args=[node], keywords=[]), node)
        return node

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id in self.tile_arrays:
            self._shift_row(node)
            flat = self._tile_flat(node)
            if flat is not None and isinstance(node.ctx, ast.Load):
                return _rt_call("sloadf", [node.value, flat], node)
            # (a store's flat offset is kept for visit_Assign; an augmented store keeps the slice)
            node.lk_flat = flat
            # the tile holds a range of the first dimension: only that index moves
            wrap = node.value.id if self._may_wrap(node) else None
            if isinstance(node.slice, ast.Tuple):
                node.slice.elts = [_tile_index(node.slice.elts[0], wrap)] + node.slice.elts[1:]
            else:
                node.slice = _tile_index(node.slice, wrap)
            if isinstance(node.ctx, ast.Load) and self._shared_access(node):
                return _rt_call("sload", [node.value, node.slice], node)
            return node
        if not isinstance(node.ctx, ast.Load) or not isinstance(node.value, ast.Name):
            return node
        if node.value.id in self.shared_arrays and self._shared_access(node):
            return _rt_call("sload", [node.value, node.slice], node)
        if self.sites is None:
            if self._own_access(node):
                return _rt_call(f"load{self.access}", [node.value, node.slice], node)
            return node
        site = self.sites.add(node.value.id, "load", self.filename, node, self.function)
        node.slice = check_call("checked", node.value.id, node.slice, site, node)
        return node

    def _tile_flat(self, node):
        """The flat offset into a 2-D tile of ``u[E0, E1]`` inside a 2-D ``lk.grid`` loop over
        ``(i, j)`` (``tile_cell``), both indices proven non-negative: written as the cell's
        offset plus the access's own, ``((i - tb) * m + j) + ((E0 - i) * m + (E1 - j))``, which
        is ``(E0 - tb) * m + E1``: the cell's part is the same expression in every access of the
        cell (LLVM computes it once) and ``E0 - i`` folds to the stencil's constant offset, so a
        neighbour costs an add instead of a row-major multiply (runtime/arrays.py ``sloadf``).
        None for any other access."""
        cell, sl = self.tile_cell, node.slice
        if (cell is None or len(cell) != 2 or self.sites is not None or not isinstance(sl, ast.Tuple)
                or len(sl.elts) != 2
                or not all(is_nonneg_mark(e) for e in sl.elts)):
            return None
        (e0, e1), (c0, c1) = [e.args[0] for e in sl.elts], cell
        m = f"{node.value.id}.shape[1]"
        if self._may_wrap(node):
            # a row that may lie across the wrap: found modulo the extent, from no shared base
            row = f"{_P}rt.tile_row(({_src(e0)}) - {_P}tb, {node.value.id}.shape[0])"
            text = f"{row} * {m} + ({_src(e1)})"
        else:
            text = f"(({c0} - {_P}tb) * {m} + {c1}) + ((({_src(e0)}) - {c0}) * {m} + (({_src(e1)}) - {c1}))"
        off = ast.parse(text, mode="eval").body
        mark = ast.Attribute(value=ast.Name(id="_lk_np", ctx=ast.Load()), attr="uint64", ctx=ast.Load())
        return ast.copy_location(ast.Call(func=mark, args=[off], keywords=[]), node)

    def _shift_row(self, node):
        """Index dimension 0 of a tile access through a name of ``row_shifts`` by the cell's
        row plus the name's constant instead: the tile holds that row (across the wrap too, in
        its halo), so the access shares the cell's address and needs no wrap-around test."""
        if self.tile_cell is None:
            return
        first = _first_index(node)
        x = first.args[0] if is_nonneg_mark(first) else first
        name = x.id if isinstance(x, ast.Name) else None
        if name is not None and name not in self.row_shifts:
            m = _COPY_NAME.match(name)
            name = m.group(1) if m else None
        if name not in self.row_shifts:
            return
        shift = self.row_shifts[name]
        row = ast.parse(f"{self.tile_cell[0]} {'-' if shift < 0 else '+'} {abs(shift)}", mode="eval").body
        if is_nonneg_mark(first):
            # (only ever used less the tile's base, which is then non-negative)
            first = copy.copy(first)
            first.args = [row]
        else:
            first = row
        ast.copy_location(row, x)
        if isinstance(node.slice, ast.Tuple):
            node.slice.elts = [first] + node.slice.elts[1:]
        else:
            node.slice = first

    def _may_wrap(self, node) -> bool:
        """Whether tile access ``node`` may read a row across the wrap of a stencil that wraps
        around along dimension 0: a load whose row is not the cell's own plus a literal (the
        stencil analysis bounds the literal by the halo). A store is at the thread's own cell
        (the stencil analysis checked), never wrapped."""
        if not self.tile_wrap or not isinstance(node.ctx, ast.Load):
            return False
        if self.tile_cell is None:
            return True
        e = _first_index(node)
        return not _row_offset(e.args[0] if is_nonneg_mark(e) else e, self.tile_cell[0])

    def _own_access(self, node) -> bool:
        """An access that runtime/arrays.py lowers: an array parameter indexed by indices all
        proven non-negative (wrapped in uint64 by index_bounds) or non-negative literals, in a
        kernel that asked for it."""
        if self.access is None or not isinstance(node.value, ast.Name) or node.value.id not in self.arrays:
            return False
        return _unsigned_literals(node) or _nonneg_indices(node)

    def _shared_access(self, node) -> bool:
        """An access to an array in shared memory (a tile's index already shifted) that
        runtime/arrays.py lowers to the shared state space: every index proven non-negative
        (or, outside a tile, a non-negative literal)."""
        if self.sites is not None:
            return False
        if isinstance(node.value, ast.Name) and node.value.id not in self.tile_arrays and _unsigned_literals(node):
            return True
        return _nonneg_indices(node)

    def visit_Assign(self, node):
        self.generic_visit(node)
        tgt = node.targets[0]
        if len(node.targets) == 1 and isinstance(tgt, ast.Subscript) and self.sites is None and self._own_access(tgt):
            return ast.copy_location(ast.Expr(_rt_call(f"store{self.access}", [tgt.value, tgt.slice, node.value],
                                                       node)), node)
        if len(node.targets) == 1 and isinstance(tgt, ast.Subscript) and getattr(tgt, "lk_flat", None) is not None:
            return ast.copy_location(ast.Expr(_rt_call("sstoref", [tgt.value, tgt.lk_flat, node.value], node)), node)
        if (len(node.targets) == 1 and isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name)
                and tgt.value.id in self.shared_arrays and self._shared_access(tgt)):
            return ast.copy_location(ast.Expr(_rt_call("sstore", [tgt.value, tgt.slice, node.value], node)), node)
        return node

    def _cpu_power(self) -> bool:
        """``**`` goes through ``cpu_rt.power`` (Numba's CPU ``0.0 ** -n`` raises where the GPU
        gives an infinity); a debug kernel keeps Python's error model, so it keeps ``**``."""
        return self.backend == "cpu" and self.sites is None

    def _rt_op(self, op) -> str | None:
        """The runtime function a binary operator goes through, if any: ``power`` on the CPU
        backend (see :meth:`_cpu_power`), ``lshift``/``rshift`` on every backend (a count outside
        0..63 gives NumPy's 0 or sign, where LLVM's shift is poison: see runtime/shifts.py)."""
        if isinstance(op, ast.Pow):
            return "power" if self._cpu_power() else None
        if isinstance(op, (ast.LShift, ast.RShift)):
            return "lshift" if isinstance(op, ast.LShift) else "rshift"
        return None

    def visit_BinOp(self, node):
        self.generic_visit(node)
        fn = self._rt_op(node.op)
        return _rt_call(fn, [node.left, node.right], node) if fn else node

    def visit_AugAssign(self, node):
        tgt = node.target
        via_rt = self._rt_op(node.op) is not None
        if isinstance(tgt, ast.Name) and via_rt:
            value = ast.copy_location(ast.BinOp(left=ast.Name(id=tgt.id, ctx=ast.Load()), op=node.op,
                                                right=node.value), node)
            assign = ast.copy_location(ast.Assign(targets=[ast.Name(id=tgt.id, ctx=ast.Store())], value=value), node)
            return self.visit_Assign(ast.fix_missing_locations(assign))
        # a[i] += x becomes store(a, i, load(a, i) + x), which evaluates the index twice: only
        # for an index without calls (but the non-negative marks). a[i] <<= n (>>=, and **= on
        # the CPU backend) takes that form everywhere, so that it goes through the runtime as
        # x << n does
        simple = isinstance(tgt, ast.Subscript) and all(not isinstance(n, ast.Call) or is_nonneg_mark(n)
                                                        for n in ast.walk(tgt.slice))
        if simple and (via_rt or (self.sites is None and self._own_access(tgt))):
            load = ast.copy_location(ast.Subscript(value=copy.deepcopy(tgt.value), slice=copy.deepcopy(tgt.slice),
                                                   ctx=ast.Load()), tgt)
            assign = ast.copy_location(ast.Assign(targets=[tgt], value=ast.copy_location(
                ast.BinOp(left=load, op=node.op, right=node.value), node)), node)
            return self.visit_Assign(ast.fix_missing_locations(assign))
        self.generic_visit(node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Name) and f.id.startswith(INTRINSIC_PREFIX):
            name = f.id[len(INTRINSIC_PREFIX):]
            if name == "thread_id":
                return ast.copy_location(ast.Name(id=f"{_P}tid", ctx=ast.Load()), node)
            if name == "num_threads":
                return ast.copy_location(ast.Name(id=f"{_P}nt", ctx=ast.Load()), node)
            if name == "sync":
                if self.backend == "cpu":
                    return ast.copy_location(ast.Constant(None), node)
                return _rt_call(f"{self.scope}_sync", [ast.Name(id=f"{_P}bar", ctx=ast.Load())], node)
            if name in ("random_uniform", "random_normal"):
                seed = ast.Name(id=f"{_P}seed", ctx=ast.Load())
                step = ast.Name(id=self.index_name, ctx=ast.Load())
                args = node.args
                if len(args) == 4:
                    # a generated step's draw names the step index it draws for
                    # (validate.tag_random_sites)
                    args, step = args[:3], args[3]
                return _rt_call(name, [seed, step] + args, node)
            if name in ("sum", "max", "min"):
                if self.backend == "cpu":
                    return _rt_call(f"reduce_{name}", node.args, node)
                extra = [ast.Name(id=f"{_P}{n}", ctx=ast.Load()) for n in ("redf", "redi", "st", "bar", "shf", "shi")]
                return _rt_call(f"{self.scope}_{name}", node.args + extra, node)
            if name in ("atomic_add", "atomic_max", "atomic_min"):
                # the runtime casts the value to the array's dtype and returns the old value
                if self.sites is None:
                    return _rt_call(name, node.args, node)
                # debug: an index outside the array skips the update (it returns 0) and is
                # recorded as an out-of-bounds store
                site = self.sites.add(node.args[0].id, "store", self.filename, node, self.function)
                ctx = [ast.Name(id=f"{_P}dbg", ctx=ast.Load()), ast.Constant(site),
                       ast.Name(id=f"{_P}dt", ctx=ast.Load()), ast.Name(id=f"{_P}tid", ctx=ast.Load())]
                return _rt_call(f"{name}_checked", node.args + ctx, node)
            raise AssertionError(f"unexpected marker {f.id}")  # validate only emits the ones above
        if is_helper_call(node):
            ctx = [f"{_P}tid", f"{_P}nt"] + (list(_DEBUG_CTX) if self.sites is not None else [])
            node.args = node.args + [ast.Name(id=c, ctx=ast.Load()) for c in ctx]
        return node


def _nonneg_indices(node) -> bool:
    """Whether every index of subscript ``node`` is proven non-negative (wrapped by index_bounds)."""
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return all(is_nonneg_mark(e) for e in elts)


def _unsigned_literals(node) -> bool:
    """When every index of subscript ``node`` is proven non-negative or is a non-negative integer
    literal, and at least one is such a literal: wrap the literals in uint64 as index_bounds wraps
    the proven ones (the same element; runtime/arrays.py lowers only unsigned indices) and return
    True (the rim of a split drop-in loop reads ``u[0, j]``; a step stores ``hist[t, 0]``)."""
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    literal = [isinstance(e, ast.Constant) and type(e.value) is int and e.value >= 0 for e in elts]
    if not any(literal) or not all(k or is_nonneg_mark(e) for k, e in zip(literal, elts)):
        return False
    wrapped = [ast.copy_location(ast.Call(func=ast.Attribute(value=ast.Name(id=f"{_P}np", ctx=ast.Load()),
                                                             attr="uint64", ctx=ast.Load()),
                                          args=[e], keywords=[]), e) if k else e for k, e in zip(literal, elts)]
    if isinstance(node.slice, ast.Tuple):
        node.slice.elts = wrapped
    else:
        node.slice = wrapped[0]
    return True


def check_call(fn: str, array: str, index, site: int, node):
    """``_lk_rt.<fn>(array, index, _lk_dbg, site, _lk_dt, _lk_tid)``: a bounds check."""
    args = [ast.Name(id=array, ctx=ast.Load()), index, ast.Name(id=f"{_P}dbg", ctx=ast.Load()), ast.Constant(site),
            ast.Name(id=f"{_P}dt", ctx=ast.Load()), ast.Name(id=f"{_P}tid", ctx=ast.Load())]
    return _rt_call(fn, args, node)


def _rt_call(fn: str, args, node):
    func = ast.Attribute(value=ast.Name(id=f"{_P}rt", ctx=ast.Load()), attr=fn, ctx=ast.Load())
    return ast.copy_location(ast.Call(func=func, args=list(args), keywords=[]), node)


def _src(e: ast.AST) -> str:
    return ast.unparse(e)


class _BodyWriter:
    """Prints a lowered body statement by statement, expanding parallel loops."""

    def __init__(self, out: _Lines, backend: str, scope: str, is_step: bool, fn_body=(), index_name="t",
                 sites: "_Sites | None" = None, function: str = "", float_type: str | None = None,
                 arrays: frozenset = frozenset(), index_bits: int | None = None,
                 tile_arrays: frozenset | None = None, shared_arrays: frozenset = frozenset(),
                 stencil=None, clip: tuple = (f"{_P}tlo", f"{_P}thi")):
        self.out = out
        self.tile = tile_arrays is not None
        self.clip = clip
        self.fn_body = list(fn_body)
        self.backend = backend
        self.sites = sites
        self.function = function
        self.lower = _Lower(backend, scope, index_name, sites, out.filename, function, float_type, arrays,
                            index_bits, tile_arrays or frozenset(), shared_arrays, stencil)
        self.is_step = is_step
        self.loop_id = 0
        self.memo_slots = 0
        self.memo_loops = 0
        self.temp_id = 0

    def body(self, stmts, depth):
        for s in stmts:
            self.stmt(s, depth)

    def stmt(self, s, depth):
        out = self.out
        if isinstance(s, ast.If):
            out.add(depth, f"if {_src(self.lower.visit(s.test))}:", s)
            self.body(s.body, depth + 1)
            if s.orelse:
                out.add(depth, "else:", s.orelse[0])
                self.body(s.orelse, depth + 1)
        elif isinstance(s, ast.While):
            out.add(depth, f"while {_src(self.lower.visit(s.test))}:", s)
            self.body(s.body, depth + 1)
        elif isinstance(s, ast.For):
            self.for_loop(s, depth)
        elif isinstance(s, ast.Return):
            out.add(depth, self.return_text(s), s)
        elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
            if depth == 1 and self.block_aggregated(s.value):
                args = [self.lower.visit(x) for x in s.value.args]
                extra = [f"{_P}{n}" for n in ("redf", "redi", "st", "bar", "shf", "shi")]
                out.add(depth, f"{_P}rt.atomic_add_block({', '.join(_src(x) for x in args)}, {', '.join(extra)})", s)
                return
            v = self.lower.visit(s.value)
            out.add(depth, "pass" if isinstance(v, ast.Constant) else _src(v), s)
        elif self.sites is not None and self.guarded_store(s, depth):
            pass
        else:
            out.add(depth, _src(self.lower.visit(s)), s)

    def clip_of(self, loop) -> tuple:
        """Tile mode: the bounds a block clips ``loop``'s first dimension to. A loop over a
        tile's cells keeps to the tile; any other (over another array's extent, from a
        negative start) to ``self.clip``, which a depth-1 kernel widens for the first and last
        blocks so that every index runs (render_kernel)."""
        if any(isinstance(n, ast.Name) and n.id in self.lower.tile_arrays for n in ast.walk(loop)):
            return f"{_P}tlo", f"{_P}thi"
        return self.clip

    def block_aggregated(self, call) -> bool:
        """Whether ``call``, a statement at the top level of a CUDA step, is an
        ``lk.atomic.add`` of a constant index (its result unused): every thread of the grid
        runs the step's top level (a ``return`` before it stops every thread alike), so every
        thread of a block makes the same update and the block can sum its values first and
        update once (runtime ``atomic_add_block``), instead of each thread updating one
        address, which the GPU serializes. Not in debug kernels (their updates are checked)."""
        f = call.func
        if not (self.is_step and self.backend == "cuda" and self.sites is None and isinstance(f, ast.Name)
                and f.id == INTRINSIC_PREFIX + "atomic_add" and len(call.args) == 3):
            return False
        idx = call.args[1]
        if is_nonneg_mark(idx):
            idx = idx.args[0]
        elts = idx.elts if isinstance(idx, ast.Tuple) else [idx]
        return all(isinstance(e, ast.Constant) and type(e.value) is int for e in elts)

    def guarded_store(self, s, depth) -> bool:
        """Debug kernels: a store to ``a[index]`` runs only if the index is inside ``a``."""
        tgt = s.targets[0] if isinstance(s, ast.Assign) and len(s.targets) == 1 else \
            s.target if isinstance(s, ast.AugAssign) else None
        if not (isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name)):
            return False
        self.temp_id += 1
        ix = f"{_P}ix{self.temp_id}"
        index = self.lower.visit(tgt.slice)
        value = self.lower.visit(s.value)
        site = self.sites.add(tgt.value.id, "store", self.out.filename, tgt, self.function)
        self.out.add(depth, f"{ix} = {_src(index)}", s)
        self.out.add(depth, f"if {_src(check_call('in_bounds', tgt.value.id, ast.Name(id=ix, ctx=ast.Load()), site, s))}:", s)
        store = ast.Subscript(value=ast.Name(id=tgt.value.id, ctx=ast.Load()), slice=ast.Name(id=ix, ctx=ast.Load()),
                              ctx=ast.Store())
        guarded = ast.Assign(targets=[store], value=value) if isinstance(s, ast.Assign) else \
            ast.AugAssign(target=store, op=s.op, value=value)
        self.out.add(depth + 1, _src(ast.fix_missing_locations(guarded)), s)
        return True

    def return_text(self, s):
        if not self.is_step:
            return "return" if s.value is None else f"return {_src(self.lower.visit(s.value))}"
        if s.value is None:
            return "return True"
        return f"return bool({_src(self.lower.visit(s.value))})"

    def for_loop(self, s, depth):
        it = s.iter
        name = it.func.id
        args = [self.lower.visit(a) for a in it.args]
        if name == "range":
            self.out.add(depth, f"for {_src(s.target)} in range({', '.join(_src(a) for a in args)}):", s)
            self.body(s.body, depth + 1)
        elif name == INTRINSIC_PREFIX + "range":
            self.parallel_range(s, args, depth)
        else:
            self.parallel_grid(s, args, depth)

    def _bind(self, depth, var, expr, node):
        """Bind ``expr`` to ``var`` unless it is already a name or a constant; returns the text."""
        if isinstance(expr, (ast.Name, ast.Constant)):
            return _src(expr)
        self.out.add(depth, f"{var} = {_src(expr)}", node)
        return var

    def parallel_range(self, s, args, depth):
        k = self.loop_id = self.loop_id + 1
        lo, hi, st = (ast.Constant(0), args[0], ast.Constant(1)) if len(args) == 1 else \
            (args[0], args[1], args[2] if len(args) == 3 else ast.Constant(1))
        target = _src(s.target)
        if self.backend == "cpu":
            if isinstance(st, ast.Constant) or _is_one(st):
                rng = f"{_src(lo)}, {_src(hi)}" + ("" if _is_one(st) else f", {_src(st)}")
            else:
                # a zero step runs nothing, as on the GPU (Python's range would raise mid-run)
                st_t = self._bind(depth, f"{_P}r{k}_st", st, s)
                rng = f"{_src(lo)}, {_src(hi)} if {st_t} != 0 else {_src(lo)}, {st_t} if {st_t} != 0 else 1"
            self.out.add(depth, f"for {target} in range({rng}):", s)
            self.body(s.body, depth + 1)
            return
        lo_t = self._bind(depth, f"{_P}r{k}_lo", lo, s)
        hi_t = self._bind(depth, f"{_P}r{k}_hi", hi, s)
        cur = f"{_P}u{k}"
        split = None if self.tile or not _is_one(st) else find_warp_split(s)
        if split is not None:
            depth = self.warp_split_loop(s, split, k, lo_t, hi_t, depth)
        if self.tile:
            # tile mode: this block's threads take the range's values inside its tile
            st_t = self._bind(depth, f"{_P}r{k}_st", st, s)
            first, stop = f"{_P}r{k}_first", f"{_P}r{k}_stop"
            clo, chi = self.clip_of(s)
            self.out.add(depth, f"{first}, {stop} = {_P}rt.tile_range({lo_t}, {hi_t}, {st_t}, {clo}, {chi})", s)
            # the cell's own index (_Lower._own_row: an access at it plus a literal never wraps)
            outer = self.lower.tile_cell
            if _is_one(st):
                def take_tile(c, rn):
                    return [f"{rn(target)} = {cur}" + (f" + {c} * {_P}bnt" if c else "")]
                rest = self.unrolled(s, [target], depth, k, cur, f"{first} + {_P}btid", stop, take_tile,
                                     stride=f"{_P}bnt", cells=lambda rn: (rn(target),))
                if rest is None:
                    self.out.add(depth, f"{cur} = {first} + {_P}btid", s)
                self.lower.tile_cell = (target,)
                self.strided_loop(s, depth, f"{cur} < {stop}", [f"{target} = {cur}", f"{cur} += {_P}bnt"], rest)
                self.lower.tile_cell = outer
                return
            self.out.add(depth, f"{cur} = {first} + {_P}btid * {st_t}", s)
            test = f"({cur} < {stop}) if {st_t} > 0 else ({cur} > {stop} if {st_t} < 0 else False)"
            self.lower.tile_cell = (target,)
            self.strided_loop(s, depth, test, [f"{target} = {cur}", f"{cur} += {_P}bnt * {st_t}"])
            self.lower.tile_cell = outer
            return
        if not _is_one(st):
            st_t = self._bind(depth, f"{_P}r{k}_st", st, s)
            self.out.add(depth, f"{cur} = {lo_t} + {_P}tid * {st_t}", s)
            # the step's sign decides the test; a zero step runs nothing (it would never end)
            test = f"({cur} < {hi_t}) if {st_t} > 0 else ({cur} > {hi_t} if {st_t} < 0 else False)"
            self.strided_loop(s, depth, test, [f"{target} = {cur}", f"{cur} += {_P}nt * {st_t}"])
            return
        start = f"{_P}tid" if _is_zero(lo) else f"{lo_t} + {_P}tid"

        def take(c, rn):
            return [f"{rn(target)} = {cur}" + (f" + {c} * {_P}nt" if c else "")]
        rest = self.unrolled(s, [target], depth, k, cur, start, hi_t, take)
        if rest is None:
            self.out.add(depth, f"{cur} = {start}", s)
        self.strided_loop(s, depth, f"{cur} < {hi_t}", [f"{target} = {cur}", f"{cur} += {_P}nt"], rest)

    def warp_split_loop(self, s, split, k, lo_t, hi_t, depth) -> int:
        """The warp-split form of a parallel loop (``loopkern/warpsplit.py``), taken at run
        time when the loop has at most one iteration per warp of the launch; returns the
        depth at which the caller emits the usual form, under the ``else``.

        Each group of 1, 2, 4 or 8 warps (``rt.group_shift``: as many as the grid has lanes
        for) takes one iteration at a time; its lanes take every 32nd (64th, ...) value of the
        inner loop, the accumulators are summed across each warp with shuffles and across the
        group's warps through the block's per-warp slots (in warp order), and the group's
        first lane alone runs the statements after the inner loop. The loop over iterations is
        the same for every thread of a block (the group exchange has block barriers): a group
        without an iteration in the last round computes the range's last one again and
        discards it. The split form renders copies of the body: lowering rewrites the nodes
        it visits.
        """
        target, lane, cur = _src(s.target), f"{_P}lane{k}", f"{_P}ws{k}"
        gs, gme, glane, it = f"{_P}gs{k}", f"{_P}gme{k}", f"{_P}gl{k}", f"{_P}wi{k}"
        accs = split.accumulators
        self.out.add(depth, f"if ({hi_t} - {lo_t}) * {WARP} <= {_P}nt:", s)
        d = depth + 1
        self.out.add(d, f"{gs} = {_P}rt.group_shift({hi_t} - {lo_t}, {_P}nt, {len(accs)})", s)
        self.out.add(d, f"{lane} = {_P}tid & {WARP - 1}", s)
        self.out.add(d, f"{cur}, {gme}, {glane} = {_P}rt.group_base({_P}tid, {gs})", s)
        if lo_t != "0":
            self.out.add(d, f"{cur} += {lo_t}", s)
        self.out.add(d, f"while {cur} < {hi_t}:", s)
        self.out.add(d + 1, f"{it} = {cur} + {gme}", s)
        self.out.add(d + 1, f"{cur} += {_P}nt >> {gs}", s)
        self.out.add(d + 1, f"{target} = {it} if {it} < {hi_t} else {hi_t} - 1", s)
        self.body(copy.deepcopy(list(split.pre)), d + 1)
        # every lane ran the statements before the inner loop: the accumulators' first values
        # count once, in the group's first lane; the others start from zero
        self.out.add(d + 1, f"if {glane} != 0:", s)
        for acc in accs:
            self.out.add(d + 2, f"{acc} = {_P}rt.zero_of({acc})", s)
        inner = copy.deepcopy(split.inner)
        args = [self.lower.visit(a) for a in inner.iter.args]
        a, b, c = (ast.Constant(0), args[0], ast.Constant(1)) if len(args) == 1 else \
            (args[0], args[1], args[2] if len(args) == 3 else ast.Constant(1))
        if _is_one(c):
            rng = f"{_src(a)} + {glane}, {_src(b)}, 1 << {gs}"
        else:
            step = self._bind(d + 1, f"{_P}j{k}_st", c, inner)
            rng = f"{_src(a)} + {glane} * {step}, {_src(b)}, {step} << {gs}"
        self.out.add(d + 1, f"for {_src(inner.target)} in range({rng}):", inner)
        self.body(inner.body, d + 2)
        for acc in accs:
            self.out.add(d + 1, f"{acc} = {_P}rt.warp_sum({acc})", inner)
        # across the group's warps: the first barrier keeps the slots until every thread has
        # read what was last put there (a reduction's or the previous round's values)
        self.out.add(d + 1, f"if {gs} > {WARP.bit_length() - 1}:", inner)
        self.out.add(d + 2, f"{_P}rt.block_barrier()", inner)
        self.out.add(d + 2, f"if {lane} == 0:", inner)
        for n, acc in enumerate(accs):
            self.out.add(d + 3, f"{_P}rt.group_put({acc}, {n}, {_P}shf, {_P}shi)", inner)
        self.out.add(d + 2, f"{_P}rt.block_barrier()", inner)
        for n, acc in enumerate(accs):
            self.out.add(d + 2, f"{acc} = {_P}rt.group_get({acc}, {n}, {gs}, {_P}shf, {_P}shi)", inner)
        if split.post:
            self.out.add(d + 1, f"if {glane} == 0 and {it} < {hi_t}:", s)
            self.body(copy.deepcopy(list(split.post)), d + 2)
        # after the loop, what a later reduction writes to the slots must wait for the reads
        self.out.add(d, f"if {gs} > {WARP.bit_length() - 1}:", s)
        self.out.add(d + 1, f"{_P}rt.block_barrier()", s)
        self.out.add(depth, "else:", s)
        return depth + 1

    def strided_loop(self, s, depth, test, head, body=None):
        """A grid-stride loop as ``while``: ``for ... in range(a, b, stride)`` would make Numba
        divide (a 64-bit division, tens of instructions) to count the trips each time the loop
        starts. ``head`` binds the index and advances the counter before the body, so a
        ``continue`` in the body still advances. ``body``: statements to run instead of the
        loop's own (the unrolled form's, see :meth:`unrolled`)."""
        self.out.add(depth, f"while {test}:", s)
        for line in head:
            self.out.add(depth + 1, line, s)
        self.body(s.body if body is None else body, depth + 1)

    def parallel_grid(self, s, args, depth):
        """This thread's share of an n-D index space, flattened and grid-strided.

        The per-dimension indices are kept as digits and advanced by the stride's digits with
        carries, so no iteration divides (64-bit division costs tens of instructions on a GPU).
        The advance happens before the body, so 'continue' in the body is safe.
        """
        k = self.loop_id = self.loop_id + 1
        dims = [(a.elts[0], a.elts[1]) if isinstance(a, ast.Tuple) else (ast.Constant(0), a) for a in args]
        tid, nt = (f"{_P}btid", f"{_P}bnt") if self.tile else (f"{_P}tid", f"{_P}nt")
        if self.tile:
            # tile mode: this block's threads take the rows of its tile
            lo0, hi0 = dims[0]
            clo, chi = self.clip_of(s)
            dims[0] = (ast.Call(func=ast.Name(id="max", ctx=ast.Load()),
                                args=[lo0, ast.Name(id=clo, ctx=ast.Load())], keywords=[]),
                       ast.Call(func=ast.Name(id="min", ctx=ast.Load()),
                                args=[hi0, ast.Name(id=chi, ctx=ast.Load())], keywords=[]))
        nd = len(dims)
        single = isinstance(s.target, ast.Name)
        names = [f"{_P}g{k}_i{d}" for d in range(nd)] if single else [_src(e) for e in s.target.elts]
        if self.backend == "cpu":
            for d, (lo, hi) in enumerate(dims):
                self.out.add(depth + d, f"for {names[d]} in range({_src(lo)}, {_src(hi)}):", s)
            if single:
                self.out.add(depth + nd, f"{_src(s.target)} = ({', '.join(names)},)", s)
            self.body(s.body, depth + nd)
            return
        los, ns = [], []
        for d, (lo, hi) in enumerate(dims):
            lo_t = self._bind(depth, f"{_P}g{k}_lo{d}", lo, s)
            span = f"({_src(hi)}) - {lo_t}" if not _is_zero(lo) else _src(hi)
            self.out.add(depth, f"{_P}g{k}_n{d} = max({span}, 0)", s)
            los.append(lo_t)
            ns.append(f"{_P}g{k}_n{d}")
        if self.tile and nd == 2:
            self.tile_rows(s, k, depth, names, los, ns, single)
            return
        total = f"{_P}g{k}_total"
        self.out.add(depth, f"{total} = {' * '.join(ns)}", s)
        cs = [f"{_P}g{k}_c{d}" for d in range(nd)]
        ss = [f"{_P}g{k}_s{d}" for d in range(nd)]
        # the digits of this thread's first index and of the stride depend only on the thread
        # and on the extents after the first: a step's kernel keeps them in its state array
        # (_lk_st, one per thread for the whole launch) with the extents they were computed
        # for, and divides again only when those change (the divisions, tens of dependent
        # instructions each, were a sixth of Jacobi 256²'s stall samples). Only the step's first
        # MEMO_LOOPS such loops: each holds 3 * nd - 1 int64 values per thread, registers once
        # the compiler promotes them
        memo = self.is_step and self.backend == "cuda" and nd > 1 and self.memo_loops < MEMO_LOOPS
        at = depth
        if memo:
            base = 1 + self.memo_slots
            self.memo_slots += (nd - 1) + 2 * nd
            self.memo_loops += 1
            keys = [f"{_P}st[{base + d - 1}]" for d in range(1, nd)]
            kept = [f"{_P}st[{base + nd - 1 + i}]" for i in range(2 * nd)]
            self.out.add(depth, f"if {' and '.join(f'{key} == {ns[d + 1]}' for d, key in enumerate(keys))}:", s)
            for name, slot in zip(cs + ss, kept):
                self.out.add(depth + 1, f"{name} = {slot}", s)
            self.out.add(depth, "else:", s)
            at = depth + 1
        for digits, x in ((cs, tid), (ss, nt)):
            rest = f"{_P}g{k}_x"
            self.out.add(at, f"{rest} = {x}", s)
            for d in range(nd - 1, 0, -1):
                safe = f"max({ns[d]}, 1)"   # an empty dimension: no iteration runs, avoid / 0
                self.out.add(at, f"{digits[d]} = {rest} % {safe}", s)
                self.out.add(at, f"{rest} = {rest} // {safe}", s)
            self.out.add(at, f"{digits[0]} = {rest}", s)
        if memo:
            for d, key in enumerate(keys):
                self.out.add(at, f"{key} = {ns[d + 1]}", s)
            for name, slot in zip(cs + ss, kept):
                self.out.add(at, f"{slot} = {name}", s)

        def take(c, rn):
            lines = [f"{rn(names[d])} = {cs[d]}" if los[d] == "0" else f"{rn(names[d])} = {los[d]} + {cs[d]}"
                     for d in range(nd)]
            if single:
                lines.append(f"{rn(_src(s.target))} = ({', '.join(rn(n) for n in names)},)")
            lines.append(f"{cs[-1]} += {ss[-1]}")
            for d in range(nd - 1, 0, -1):
                lines += [f"if {cs[d]} >= {ns[d]}:", f"{_INDENT}{cs[d]} -= {ns[d]}", f"{_INDENT}{cs[d - 1]} += 1",
                          f"{cs[d - 1]} += {ss[d - 1]}"]
            return lines
        cur = f"{_P}g{k}"
        index_names = names + ([_src(s.target)] if single else [])
        start = tid
        # a 2-D tile's accesses by the cell's row and column (_Lower._tile_flat)
        cells = (lambda rn: (rn(names[0]), rn(names[1]))) if self.tile and nd == 2 and not single else None
        outer = self.lower.tile_cell
        rest = self.unrolled(s, index_names, depth, k, cur, start, total, take, stride=nt, cells=cells)
        if rest is None:
            self.out.add(depth, f"{cur} = {start}", s)
        self.lower.tile_cell = cells(lambda n: n) if cells else outer
        self.strided_loop(s, depth, f"{cur} < {total}", take(0, lambda n: n) + [f"{cur} += {nt}"], rest)
        self.lower.tile_cell = outer

    def tile_rows(self, s, k, depth, names, los, ns, single):
        """A 2-D ``lk.grid`` over a tile's rows: each of the block's threads keeps a column and
        takes it in every ``rows``-th row of the tile (``rt.tile_columns``), so no cell pays the
        flattened loop's carry between row and column digits, and a cell's neighbours in the
        shared tile are the same offsets from one address that advances by a constant.

        Every thread has at most twice the cells of the flattened split (a row narrower than
        the block leaves at most half of its threads idle; a wider one gives each thread at
        most one column more than its share), and a cell costs a third of the instructions.
        """
        r0, c, rows, width = (f"{_P}g{k}_{x}" for x in ("r0", "c", "rows", "width"))
        col, cur = f"{_P}g{k}_j", f"{_P}g{k}"
        self.out.add(depth, f"{r0}, {c}, {rows}, {width} = {_P}rt.tile_columns({ns[1]}, {_P}bnt, {_P}btid)", s)
        self.out.add(depth, f"while {c} < {ns[1]}:", s)
        d = depth + 1
        self.out.add(d, f"{col} = {c}" if los[1] == "0" else f"{col} = {los[1]} + {c}", s)
        self.out.add(d, f"{c} += {width}", s)

        def take(q, rn):
            row = cur + (f" + {q} * {rows}" if q else "")
            lines = [f"{rn(names[0])} = {row}" if los[0] == "0" else f"{rn(names[0])} = {los[0]} + {row}",
                     f"{rn(names[1])} = {col}"]
            if single:
                lines.append(f"{rn(_src(s.target))} = ({rn(names[0])}, {rn(names[1])})")
            return lines
        index_names = names + ([_src(s.target)] if single else [])
        cells = (lambda rn: (rn(names[0]), rn(names[1]))) if not single else None
        outer = self.lower.tile_cell
        rest = self.unrolled(s, index_names, d, k, cur, r0, ns[0], take, stride=rows, cells=cells)
        if rest is None:
            self.out.add(d, f"{cur} = {r0}", s)
        self.lower.tile_cell = cells(lambda n: n) if cells else outer
        self.strided_loop(s, d, f"{cur} < {ns[0]}", take(0, lambda n: n) + [f"{cur} += {rows}"], rest)
        self.lower.tile_cell = outer

    def unrolled(self, s, index_names, depth, k, cur, start, stop, take, stride: str = f"{_P}nt", cells=None):
        """Emit an unrolled loop over this thread's indices when that cannot change the result.

        Iterations of a parallel loop must be independent (threads run them concurrently), so
        the loads of several iterations may be issued before their stores. The compiler cannot
        prove that itself (arrays may alias), so for straight-line bodies the loop is unrolled
        here with each statement interleaved across the copies and stores split from the
        values they store: several loads in flight per thread instead of one. Returns None
        when it emitted nothing, else the statements for the remainder loop (the body in the
        unrolled form, its temporaries renamed apart from other loops'), which starts where
        ``cur`` then holds. ``stride``:
        the distance between a thread's indices (the grid's threads, or in tile mode the
        block's). ``cells``: given a renaming, the (row, column) index names of a 2-D tile's
        cell (``_Lower.tile_cell``).
        """
        if self.sites is not None:   # debug: keep each access where the user wrote it
            return None
        # (on copies: the hoisting below rewrites statements in place, which a second emission
        # of the same loop would read back)
        plan = _unroll_plan(copy.deepcopy(list(s.body)), index_names, self.outside_names(s))
        if plan is None:
            return None
        temps, split = plan
        # only in the step itself: the dispatcher's guarantee that a written array shares no
        # memory with another argument is about the step's arguments; a helper may be passed
        # one array for two of its parameters
        if HOIST_LOADS and self.is_step:
            split, hoisted = _hoist_loads(split, temps)
            temps = temps | hoisted
        self.out.add(depth, f"{cur} = {start}", s)
        # UNROLL copies while that many iterations remain, then (TAIL_PAIR) two while two do:
        # a thread with two or three iterations left (at most one such trip) issues the loads
        # of two at once instead of one after the other, which at a few iterations per thread
        # (a 256² Jacobi at 132 x 256 threads: two) is most of its loads' latency. Not in tile
        # mode, whose threads take a tile's cells (tens each at the sizes it runs): there the
        # two more copies would only lengthen the compile (by about 40% for a 1-D heat step)
        groups = [(UNROLL, 0)] + ([(2, UNROLL)] if TAIL_PAIR and not self.tile else [])
        outer = self.lower.tile_cell
        for width, first in groups:
            self.out.add(depth, f"while {cur} + {width - 1} * {stride} < {stop}:", s)
            for c in range(width):
                for line in take(c, lambda n, c=c: _rename(n, first + c, k)):
                    self.out.add(depth + 1, line, s)
            for stmt in split:
                for c in range(first, first + width):
                    if cells is not None:
                        self.lower.tile_cell = cells(lambda n, c=c: _rename(n, c, k))
                    self.stmt(_Renamer({n: _rename(n, c, k) for n in temps}).visit(copy.deepcopy(stmt)), depth + 1)
            self.lower.tile_cell = outer
            self.out.add(depth + 1, f"{cur} += {width} * {stride}", s)
        made = {n: _rename(n, "r", k) for n in temps - set(index_names) if n.startswith(_P)}
        return [_Renamer(made).visit(copy.deepcopy(st)) for st in split]

    def outside_names(self, loop):
        """Names the function uses outside ``loop`` (those must keep their meaning after it).

        A use inside the target or body of another ``for`` loop that binds the same name does
        not count: that loop rebinds the name before its body can read it (and a loop that
        runs no iteration reads nothing), so ``for i in ...`` twice still unrolls the first.
        """
        fn = ast.Module(body=self.fn_body, type_ignores=[])
        skip = {id(n) for n in ast.walk(loop)}
        for other in ast.walk(fn):
            if isinstance(other, ast.For) and other is not loop:
                bound = {n.id for n in ast.walk(other.target) if isinstance(n, ast.Name)}
                for part in [other.target, *other.body]:
                    skip |= {id(n) for n in ast.walk(part) if isinstance(n, ast.Name) and n.id in bound}
        return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and id(n) not in skip}


UNROLL = 4
#: after the unrolled loop, a loop of two copies (see ``_BodyWriter.unrolled``)
TAIL_PAIR = True
#: loads that follow a store in an unrolled body are issued before it (``_hoist_loads``)
HOIST_LOADS = True
MEMO_LOOPS = 4      # n-D parallel loops per step whose index digits the kernel keeps (parallel_grid)


def _rename(name: str, copy_index: int, k: int) -> str:
    return f"{_P}u{k}_{copy_index}_{name}"


_COPY_NAME = re.compile(rf"^{_P}u\d+_\d+_(.+)$")     # a name _rename made: the user's name


class _Renamer(ast.NodeTransformer):
    def __init__(self, mapping):
        self.mapping = mapping

    def visit_Name(self, node):
        if node.id in self.mapping:
            return ast.copy_location(ast.Name(id=self.mapping[node.id], ctx=node.ctx), node)
        return node


def _loaded(e) -> set:
    return {n.id for n in ast.walk(e) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _unroll_plan(body, index_names, outside):
    """For a straight-line body: (names private to one iteration, the index names included,
    and the statements with stores split from their values).

    Returns None when unrolling could change the result: control flow (but a guarded store,
    ``if T: a[i] = x`` without ``else``), a value carried from one iteration to the next other
    than by a single self-update (``acc = max(acc, x)``), or a per-iteration name that is used
    after the loop.

    A guarded store stays one statement, its test and value evaluated under it as written
    (its value may read an element only the test keeps in bounds); like a plain store it moves
    after the statements before it in the other copies, which only reorders iterations.
    """
    assigned = set()
    for st in body:
        if _guarded_store(st):
            continue
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], (ast.Name, ast.Subscript)):
            tgt = st.targets[0]
        elif isinstance(st, ast.AugAssign) and isinstance(st.target, (ast.Name, ast.Subscript)):
            tgt = st.target
        else:
            return None
        if isinstance(tgt, ast.Subscript) and not isinstance(tgt.value, ast.Name):
            return None
        if isinstance(tgt, ast.Name):
            assigned.add(tgt.id)
    temps, carried, uses = set(index_names), set(), {}
    for i, st in enumerate(body):
        if _guarded_store(st):
            tgt = None      # (stores an element: binds no name)
            reads = _loaded(st.test) | _loaded(st.body[0].value) | _loaded(st.body[0].targets[0].slice)
        else:
            tgt = _stmt_target(st)
            reads = _loaded(st.value) | (_loaded(tgt.slice) | {tgt.value.id} if isinstance(tgt, ast.Subscript)
                                         else set())
            if isinstance(st, ast.AugAssign) and isinstance(tgt, ast.Name):
                reads.add(tgt.id)
        for r in reads & assigned:
            if r not in temps:
                carried.add(r)
            uses.setdefault(r, set()).add(i)
        if isinstance(tgt, ast.Name):
            uses.setdefault(tgt.id, set()).add(i)
            if tgt.id not in carried:
                temps.add(tgt.id)
    for c in carried:
        writes_in = {i for i, st in enumerate(body) if _binds(st, {c})}
        if len(uses[c]) != 1 or uses[c] != writes_in:
            return None
    if temps & outside or temps & carried:
        return None
    split = []
    for j, st in enumerate(body):
        if _guarded_store(st):
            split.append(st)
            continue
        tgt = _stmt_target(st)
        if isinstance(tgt, ast.Subscript):
            value = st.value if isinstance(st, ast.Assign) else ast.copy_location(
                ast.BinOp(left=ast.Subscript(value=tgt.value, slice=tgt.slice, ctx=ast.Load()), op=st.op,
                          right=st.value), st)
            tmp = f"{_P}v{j}"
            temps.add(tmp)
            split.append(ast.copy_location(ast.Assign(targets=[ast.Name(id=tmp, ctx=ast.Store())], value=value), st))
            split.append(ast.copy_location(ast.Assign(targets=[tgt], value=ast.Name(id=tmp, ctx=ast.Load())), st))
        else:
            split.append(st)
    for st in split:
        ast.fix_missing_locations(st)
    return temps, split


def _stmt_target(st):
    """The name or element a statement of an unroll plan's body assigns (None: a guarded store)."""
    if isinstance(st, ast.Assign):
        return st.targets[0]
    return st.target if isinstance(st, ast.AugAssign) else None


def _written_in(body) -> set:
    """Names of what a straight-line body may write to memory through: arrays it stores into,
    and every name passed to a call or whose method it calls (a helper or an ``lk.atomic``
    may write it), plus the names it assigns (an array name rebound is another array)."""
    out = set()
    for st in body:
        for node in ast.walk(st):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
                out.add(node.value.id)
            elif isinstance(node, ast.Call):
                out |= {a.id for a in node.args if isinstance(a, ast.Name)}
                out |= {kw.value.id for kw in node.keywords if isinstance(kw.value, ast.Name)}
                f = node.func
                while isinstance(f, ast.Attribute):
                    f = f.value
                if isinstance(f, ast.Name) and isinstance(node.func, ast.Attribute):
                    out.add(f.id)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
    return out


def _unconditional_loads(e, out):
    """The element loads ``name[index]`` that evaluating ``e`` always performs, innermost first:
    not those under a conditional expression's branches, after the first operand of ``and`` /
    ``or`` or the first comparison of a chain, or inside a lambda or comprehension."""
    if isinstance(e, ast.IfExp):
        _unconditional_loads(e.test, out)
        return out
    if isinstance(e, ast.BoolOp):
        _unconditional_loads(e.values[0], out)
        return out
    if isinstance(e, ast.Compare):
        _unconditional_loads(e.left, out)
        _unconditional_loads(e.comparators[0], out)
        return out
    if isinstance(e, (ast.Lambda, ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp, ast.NamedExpr)):
        return out
    for child in ast.iter_child_nodes(e):
        _unconditional_loads(child, out)
    if isinstance(e, ast.Subscript) and isinstance(e.ctx, ast.Load) and isinstance(e.value, ast.Name):
        out.append(e)
    return out


def _hoist_loads(split, temps):
    """Issue the loads of an unrolled body that follow a store before it.

    A GPU thread keeps issuing loads while earlier ones are in flight, but not past a store the
    compiler cannot tell apart from them (arrays may alias, as far as it knows): in a Jacobi
    step (``v[i, j] = new``, then ``err = max(err, abs(new - u[i, j]))``) the load of ``u[i, j]``
    waited for the neighbours' loads, the arithmetic and the store, a second trip to memory per
    iteration. An element of an array that the body never writes (no store, no call taking
    it) cannot change within the iteration, and no other iteration writes what this one reads
    (iterations of a parallel loop are independent, and an array the step writes never shares
    memory with another argument: the dispatcher refuses the call), so such a load that the
    statement always evaluates reads the same value anywhere after its index's names are bound.
    Each one that a store or call precedes moves into a temporary right after the last
    statement binding a name its index reads (or to the top), only when that is before the
    first store or call that precedes it; loads that no store precedes stay where they are.
    An index that reads a name carried from one iteration to the next (``acc = f(acc,
    a[acc])``), or one the statement itself or a later one assigns, keeps its load in place:
    the copies of an unrolled loop run each statement in turn, so such a name has another
    value at the top than where the load was (an adversarial trial's wrong answer).

    Only for the step's own body (see ``unrolled``). ``temps``: the names private to one
    iteration (``_unroll_plan``). Returns the new statements and the temporaries' names.
    """
    written = _written_in(split)
    assigned = {t.id for st in split for t in [_stmt_target(st)] if isinstance(t, ast.Name)}
    carried = assigned - temps
    body, hoisted = list(split), set()
    serial = 0
    j = 0
    while j < len(body):
        st = body[j]
        # the first statement that stores or calls, before this one (split stores are plain
        # assignments: an element's augmented store became a value and a store)
        first_write = next((i for i in range(j) if _writes_memory(body[i])), None)
        if first_write is None or _guarded_store(st):
            j += 1
            continue
        target = _stmt_target(st)
        for e in [st.value] + ([target.slice] if isinstance(target, ast.Subscript) else []):
            for load in _unconditional_loads(e, []):
                if load.value.id in written or not _pure_index(load.slice):
                    continue
                reads = _loaded(load.slice)
                if reads & carried or any(_binds(later, reads) for later in body[j:]):
                    continue
                at = max([i + 1 for i in range(j) if _binds(body[i], reads)], default=0)
                if at > first_write:
                    continue
                name = f"{_P}ld{serial}"
                serial += 1
                hoisted.add(name)
                tmp = ast.copy_location(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                                   value=copy.deepcopy(load)), st)
                ast.fix_missing_locations(tmp)
                _replace_node(st, load, ast.copy_location(ast.Name(id=name, ctx=ast.Load()), load))
                body.insert(at, tmp)
                j += 1
                first_write += 1        # (at <= first_write: the store moved down one)
        j += 1
    return body, hoisted


_PURE_CALLS = {"min", "max", "abs", "int", "float", "bool"}


def _pure_index(e) -> bool:
    """An index made of names, constants, arithmetic and conversions (``_lk_np.uint64(i - 1)``,
    ``min``, ``abs``): no element load and no call that could touch memory."""
    return not any(isinstance(n, ast.Subscript) or (isinstance(n, ast.Call) and not _pure_call(n))
                   for n in ast.walk(e))


def _pure_call(call) -> bool:
    """A call of a builtin that only computes (``min``, ``abs``, ...) or a NumPy scalar type."""
    f = call.func
    return ((isinstance(f, ast.Name) and f.id in _PURE_CALLS)
            or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == f"{_P}np"))


def _writes_memory(st) -> bool:
    """A statement of an unroll plan's body that stores an element or calls something other
    than arithmetic and conversions."""
    return (_guarded_store(st) or isinstance(_stmt_target(st), ast.Subscript)
            or any(isinstance(n, ast.Call) and not _pure_call(n) for n in ast.walk(st)))


def _binds(st, names) -> bool:
    t = _stmt_target(st)
    return isinstance(t, ast.Name) and t.id in names


def _replace_node(tree, old, new):
    """Replace the node ``old`` (by identity) inside ``tree``."""
    for parent in ast.walk(tree):
        for attr, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, attr, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return


def _guarded_store(st) -> bool:
    """``if T: a[...] = x`` with no ``else``: one store to an array element under a test."""
    return (isinstance(st, ast.If) and not st.orelse and len(st.body) == 1 and isinstance(st.body[0], ast.Assign)
            and len(st.body[0].targets) == 1 and isinstance(st.body[0].targets[0], ast.Subscript)
            and isinstance(st.body[0].targets[0].value, ast.Name))


def _is_one(e):
    return isinstance(e, ast.Constant) and e.value == 1 and not isinstance(e.value, bool)


def _is_zero(e):
    return isinstance(e, ast.Constant) and e.value == 0 and not isinstance(e.value, bool)


def _render_function(fs: FunctionSpec, home: str, backend: str, scope: str, is_step: bool,
                     ctx_params: list[str], decorator: str, sites: _Sites | None = None,
                     float_type: str | None = None, index_bits: int | None = None,
                     tile_arrays: frozenset | None = None, shared_arrays: frozenset = frozenset(),
                     stencil=None, before: dict | None = None, clip: tuple | None = None,
                     param_names: dict | None = None) -> _Lines:
    """The lines of a step or helper function. ``before``: {k: lines} puts ``lines`` (source
    text, indented for the top level) before the function's top-level statement ``k``.
    ``clip``: (tile mode) the names of the bounds a block's parallel loops are clipped to
    (``_lk_tlo``, ``_lk_thi`` by default). ``param_names``: {parameter: name} renames
    parameters in the ``def`` line only (the body binds the old names itself, see
    :func:`_scalar_reads_at_use`)."""
    out = _Lines(fs.filename, home)
    if sites is None:
        body = mark_nonneg_indices(fs.body, fs.params, fs.array_params, fs.params[0] if is_step else None)
    else:   # debug: the bounds checks see the index as written
        body = copy.deepcopy(list(fs.body))
    params = [(param_names or {}).get(p, p) for p in fs.params] + ctx_params
    out.add(0, decorator)
    out.add(0, f"def {fs.symbol}({', '.join(params)}):", ast.Pass(lineno=fs.lineno, col_offset=0))
    w = _BodyWriter(out, backend, scope, is_step, body, fs.params[0] if fs.params else "t", sites, fs.name,
                    float_type, frozenset(fs.params[i] for i in fs.array_params), index_bits, tile_arrays,
                    shared_arrays, stencil, clip or (f"{_P}tlo", f"{_P}thi"))
    for k, st in enumerate(body):
        for line in (before or {}).get(k, ()):
            out.add(0, line, st)
        w.stmt(st, 1)
    if is_step and not (body and isinstance(body[-1], ast.Return)):
        out.add(1, "return True")
    out.memo_slots = w.memo_slots
    return out


def _scalar_reads_at_use(fs: FunctionSpec, names: list[str]) -> tuple[dict, dict]:
    """Where a step reads the scalars it is passed by reference (``kernel.jax``'s 1-element
    buffers): before each of its top-level statements that uses one, rather than once in the
    kernel's prologue.

    A value read in the prologue holds a register through the whole kernel, every step's
    parallel loops included; the direct call's scalars are kernel parameters, which live in the
    constant bank and hold none. That register cost loads in flight: with the Jacobi step's
    tolerance (used only after its loop) and step count read up front, ptxas 13.0 gave the
    kernel 80 registers instead of 96 and issued 14 of the interior loop's 20 loads after its
    first sums, two more trips to memory per pass (H100, 2026-12-07: 23.6 against 17.4 µs per
    step at 2048², bench-results/session40). Read before each statement that uses it, a
    scalar's register lives through that statement only. The buffers are inputs the kernel
    never writes, and a step never assigns to its parameters (``validate_step`` refuses it),
    so every read gives the value the name has throughout the step.

    Returns:
        ({statement index: lines that read the scalars it uses}, {parameter: the name the
        step's ``def`` gives the buffer}).
    """
    reads = {}
    for k, st in enumerate(fs.body):
        used = {n.id for n in ast.walk(st) if isinstance(n, ast.Name)}
        lines = [f"{_INDENT}{n} = {_P}ref_{n}[0]" for n in names if n in used]
        if lines:
            reads[k] = lines
    return reads, {n: f"{_P}ref_{n}" for n in names}


def _jit_options(backend: str, cache: bool, debug: bool = False) -> tuple[str, str]:
    """(device function options, kernel options) as text inside the decorator's parentheses."""
    if backend == "cuda":
        # (link-time optimisation is turned off by compile.compile_kernel, not here: the
        # decorator form drops an lto= argument)
        return ("", "cache=True" if cache else "")
    # NumPy's error model, as Numba-CUDA compiles GPU kernels without debug: a float divided
    # by zero is an infinity or NaN and an integer one 0, on both backends (Python's model,
    # Numba's CPU default, raised ZeroDivisionError out of the CPU kernel where the GPU went
    # on); debug=True keeps Python's, as the GPU's debug kernels do
    opts = ["cache=True"] * cache + ([] if debug else ["error_model='numpy'"])
    # nogil: the kernel runs on a worker thread while the caller's thread reports progress,
    # enforces the timeout and turns Ctrl-C into a cancellation
    return (", ".join(opts), ", ".join(opts + ["nogil=True"]))


def render_kernel(spec: StepSpec, backend: str, scope: str = "grid", *, cache: bool = True,
                  fingerprint: str = "", by_ref: frozenset | None = None, debug: bool = False,
                  staged: tuple = (), control: bool = True, float_type: str | None = None,
                  index_bits: int | None = None, tile=None, cluster: bool = False,
                  depth: int = 1, tiles: int = 0, launch_bounds: tuple | None = None,
                  split: bool = False) -> KernelSource:
    """Render the kernel module for ``spec``.

    Args:
        spec: the validated step.
        backend: ``"cuda"`` or ``"cpu"``.
        scope: ``"grid"`` (all blocks, grid barrier), ``"block"`` (one block,
            ``syncthreads``) or ``"thread"`` (one thread, no barrier: only for a step with no
            parallel construct); ignored for the CPU backend.
        cache: let Numba cache the compiled kernel on disk.
        fingerprint: text mixed into the source (e.g. runtime version) so stale caches miss.
        by_ref: (CUDA) None for the kernel that ``kernel(...)`` launches; else the indices of
            scalar parameters that arrive as 1-element device arrays and are read on the
            device, and the step count and the first step index arrive the same way.
            ``kernel.jax`` uses this, since its scalars and step count may be traced values
            that live on the device.
        debug: bounds-check every array access of the step and its helpers (see
            ``runtime/bounds.py``): an index outside the array is never used, the first one is
            recorded with its step and thread, and the run stops at the next step boundary.
        staged: (CUDA block scope) indices of array parameters that are copied into the
            block's dynamic shared memory (all of one dtype, laid out one after another) before
            the first step and back after the last: the steps then run on shared memory. The
            launch must provide the bytes.
        control: poll for cancellation, timeouts and progress once per step (the default; a
            one-thread CUDA kernel polls every few steps, see ``cuda_rt.poll_strided``);
            False only to measure what that costs.
        float_type: ``"float32"`` to give float literals in the step that precision (when the
            arrays are float32: see ``dispatch.args.weak_float_type``); ``"float64"`` writes
            them as float64 values (for the CUDA simulator, which runs the kernel as Python,
            where a bare float beside a float32 would be float32); None leaves them bare.
        index_bits: (CUDA, not with ``debug`` or ``staged``) 64 or 32 to lower element accesses
            with indices proven non-negative through ``runtime/arrays.py`` (global-space loads
            and stores, addresses from the shape; 32: offsets in 32 bits, for arrays of fewer
            than 2**31 elements); None leaves every access to Numba.
        tile: (CUDA grid scope) a
            :class:`~loopkern.stencil.Stencil` of ``spec`` over one or two dimensions that
            does not wrap around along the first: each block keeps its tile of the swap pairs'
            arrays (all of one dtype and shape) in dynamic shared memory for the whole run,
            ``(T + halo) * row * itemsize`` bytes per array with ``T = ceil(n / blocks)`` rows
            (cells in 1-D) of ``row`` elements and ``halo`` both sides' widths along the first
            dimension, which the launch must provide; only edge rows go through global memory
            (see ``_tile_lines``). ``T`` must be at least the halo on either side.
        depth: (tile mode, not a cluster) steps run on chip between halo exchanges: above 1,
            the step must pass :func:`~loopkern.stencil.fused_steps_refusal`, each tile's halo
            is ``depth`` times the stencil's (the launch provides that much more shared memory
            and ``T`` must be at least ``depth`` halos), the edge cells go through a scratch
            array the kernel takes last (``_lk_halo``: ``2 * blocks * arrays * depth * (halo
            below + above) * row`` elements of the tiles' dtype), and one grid barrier ends
            each round of ``depth`` steps (see ``_tile_round_lines``).
        tiles: (tile mode, not a cluster) 0 keeps one tile per block on chip for the whole
            run; above 0, a field too large for that: each block owns ``tiles`` tiles of
            ``ceil(n / (blocks * tiles))`` rows and brings each on chip once per round of
            ``depth`` steps (see ``_tile_stream_lines``); the launch provides shared memory for
            one tile and a halo scratch of ``2 * blocks * tiles * arrays * depth * (halo below
            + above) * row`` elements. The step must pass ``fused_steps_refusal``.
        cluster: (tile mode only) the grid is launched as one thread-block cluster (compute
            capability 9.0+, ``scope="cluster"``): every barrier, the ones inside grid
            reductions and ``lk.sync()`` included, is the cluster's hardware barrier
            (``cuda_rt.cluster_sync``) instead of the grid barrier.
        launch_bounds: (CUDA grid scope, not tile mode or debug) (threads per block, blocks
            per SM) for ``cuda.jit``'s ``launch_bounds``: the kernel then runs at most that
            many threads per block, and ptxas gives each thread up to 65536 / (threads *
            blocks) registers. The dispatcher asks for ``dispatch.kernels.LAUNCH_BOUNDS`` where
            it sizes a grid launch itself: without bounds ptxas 13.0 leaves the 2-D heat kernel
            at 72 registers with its interior loop's 20 loads in four waits, and with (256, 2)
            at 94 with all 20 issued first (``bench/sass_loops.py ... bounds=256/2``).

        split: (tile mode, one step per exchange) split each step's grid barrier in two and
            work between the halves: after a step a block publishes its edge rows and arrives
            at the barrier, computes the next step's rows that read no halo row, then waits,
            gathers its halo and computes the rest (``cuda_tile_split_kernel.py.tmpl``). Only
            for steps whose effect is a function of the cells they read
            (``stencil.split_exchange_refusal``).

    Returns:
        The :class:`KernelSource`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if float_type not in (None, "float32", "float64"):
        raise ValueError(f"float_type must be None, 'float32' or 'float64', got {float_type!r}")
    if backend == "cpu":
        scope = "grid"
    elif scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    elif scope == "thread" and spec.parallel:
        raise ValueError(f"scope='thread' runs one thread without barriers; step '{spec.name}' uses "
                         f"parallel loops, lk.thread_id/num_threads, lk.sync or reductions")
    dev_opts, ker_opts = _jit_options(backend, cache, debug)
    if launch_bounds is not None:
        if (backend != "cuda" or scope != "grid" or tile is not None or debug or len(launch_bounds) != 2
                or not all(isinstance(x, int) and x > 0 for x in launch_bounds) or launch_bounds[0] > 1024):
            raise ValueError(f"launch_bounds is (threads <= 1024, blocks per SM) for CUDA grid-scope kernels "
                             f"without tile mode or debug; got {launch_bounds!r} for {backend} {scope}")
        ker_opts = ", ".join(o for o in (ker_opts, f"launch_bounds={tuple(launch_bounds)!r}") if o)
    dbg_ctx = list(_DEBUG_CTX) if debug else []
    ctx_params = [f"{_P}tid", f"{_P}nt"] + ([f"{_P}redf", f"{_P}redi", f"{_P}st", f"{_P}bar", f"{_P}shf", f"{_P}shi"]
                                          if backend == "cuda"
                                          else []) + [f"{_P}seed"] + dbg_ctx
    helper_ctx = [f"{_P}tid", f"{_P}nt"] + dbg_ctx
    device_deco = "@cuda.jit(device=True)" if backend == "cuda" else f"@numba.njit({dev_opts})"
    sites = _Sites() if debug else None

    if index_bits not in (None, 32, 64):
        raise ValueError(f"index_bits must be None, 32 or 64, got {index_bits!r}")
    if index_bits is not None and (backend != "cuda" or debug or staged):
        # debug kernels check every index as written; staged arrays live in shared memory
        raise ValueError("index_bits is for CUDA kernels without debug and without staged arrays")
    resident = []
    if tile is not None:
        if not hasattr(tile, "halo"):
            raise ValueError(f"tile mode needs a stencil; the step is not a stencil: {tile}")
        if backend != "cuda" or scope != "grid" or debug or staged or index_bits is not None:
            raise ValueError("tile mode is for CUDA grid-scope kernels without debug, staging or index_bits")
        if tile.ndim not in (1, 2):
            raise ValueError("tile mode covers one- and two-dimensional stencils")
        if tile.periodic[0] and (depth != 1 or cluster or tiles):
            raise ValueError("a stencil that wraps around along the first dimension runs in tile mode with one "
                             "step per halo exchange, without a cluster or streamed tiles")
        resident = sorted(i for pair in spec.swap for i in pair)
        if not resident or not set(resident) <= set(tile.resident):
            raise ValueError("tile mode keeps the swap pairs' arrays on chip: the stencil must make them resident")
        ctx_params = ctx_params + [f"{_P}{n}" for n in _TILE_CTX]
    if cluster and tile is None:
        raise ValueError("cluster launches exist for tile mode only")
    if not isinstance(depth, int) or depth < 1 or (depth > 1 and (tile is None or cluster)):
        raise ValueError(f"depth must be 1, or more in tile mode without a cluster; got {depth!r}")
    if not isinstance(tiles, int) or tiles < 0 or (tiles and (tile is None or cluster)):
        raise ValueError(f"tiles must be 0, or more in tile mode without a cluster; got {tiles!r}")
    if split:
        from .stencil import split_exchange_refusal
        if tile is None or depth != 1 or tiles or cluster or not control:
            raise ValueError("split is for tile mode with one step per halo exchange, without a cluster or "
                             "streamed tiles, with run control")
        refusal = split_exchange_refusal(spec, tile)
        if refusal is not None:
            raise ValueError(f"step '{spec.name}' cannot split its exchange: {refusal.reason} (line {refusal.line})")
    if depth > 1 or tiles:
        from .stencil import fused_steps_refusal
        refusal = fused_steps_refusal(spec, tile)
        if refusal is not None:
            what = f"run {depth} steps per halo exchange" if depth > 1 else "stream its tiles"
            raise ValueError(f"step '{spec.name}' cannot {what}: {refusal.reason} (line {refusal.line})")
    # the runtime's barrier and reductions: a cluster's own, else the scope's
    sync = "cluster" if cluster else scope
    tile_names = frozenset(spec.params[i].name for i in resident) if tile is not None else None
    pieces: list[_Lines] = []
    for h in spec.helpers:
        pieces.append(_render_function(h, spec.filename, backend, sync, False, helper_ctx, device_deco, sites,
                                       float_type, index_bits))
    staged_names = frozenset(spec.params[i].name for i in staged) if backend == "cuda" else frozenset()
    n = len(spec.params)
    kparams = [f"{_P}a{i}" for i in range(n)]
    # the step's statement whose reduction passes its last barrier (None: none does)
    reduced_at = reduction_barrier_at(spec.step, swap_partners(spec))
    tile_parts, edge_params, before, clip = None, [], {}, None
    if tile is not None and depth == 1 and not tiles:
        written = [i for i in resident if spec.params[i].written]
        fused_at = _fused_exchange_at(spec, tile, written, reduced_at)
        tile_parts = _tile_lines(tile, kparams, resident, written, sync,
                                 {i: spec.params[i].name for i in resident} if fused_at is not None else None,
                                 tuple(spec.swap))
        # a block's loops take the indices in its tile; in a loop that touches no tile the
        # first block also takes those below 0 and the last those from n on, so a loop over
        # another array's extent, or from a negative start, runs every index as the grid scope
        # does (_BodyWriter.clip_of)
        clip = (f"{_P}clo", f"{_P}chi")
        before[0] = [f"{_INDENT}{_P}clo = {_P}tlo if cuda.blockIdx.x > 0 else _lk_np.int64(-(1 << 62))",
                     f"{_INDENT}{_P}chi = {_P}thi if cuda.blockIdx.x < cuda.gridDim.x - 1 else "
                     f"_lk_np.int64(1 << 62)"]
        if fused_at is not None:
            # the step publishes its edge cells before its last reduction (see _tile_lines)
            before[fused_at] = before.get(fused_at, []) + tile_parts[3]
            edge_params = [f"{_P}e{i}" for i in written]
    if by_ref is not None and backend != "cuda":
        raise ValueError("by_ref kernels exist for the CUDA backend only")
    refs = sorted(by_ref or ())
    reads, step_refs = _scalar_reads_at_use(spec.step, [spec.params[i].name for i in refs])
    for k, lines in reads.items():
        before[k] = lines + before.get(k, [])
    step_lines = _render_function(spec.step, spec.filename, backend, sync, True, ctx_params + edge_params, "", sites,
                                  float_type, index_bits, tile_names, staged_names, tile, before=before, clip=clip,
                                  param_names=step_refs)
    sig_params = [f"{k}_ref" if i in refs else k for i, k in enumerate(kparams)]
    prologue = []
    if by_ref is not None:
        # the seed arrives as two uint32 words (JAX without x64 has no uint64); the scalars
        # are read where the step uses them (_scalar_reads_at_use)
        prologue = [f"{_INDENT}{_P}nsteps = {_P}nsteps_ref[0]",
                    f"{_INDENT}{_P}t0 = {_P}t0_ref[0]",
                    # a traced negative start runs no step, as a negative step count does
                    f"{_INDENT}{_P}nsteps = {_P}nsteps if {_P}t0 >= 0 else 0",
                    f"{_INDENT}{_P}seed = _lk_np.uint64(_lk_seed_ref[0]) | (_lk_np.uint64(_lk_seed_ref[1]) << "
                    f"_lk_np.uint64(32))"]
    staged = sorted(staged)
    if staged and (backend != "cuda" or scope != "block"):
        raise ValueError("staging in shared memory exists for the CUDA block scope only")
    # the names the loop works on: the arguments, or their shared-memory copies
    work = [f"{_P}w{i}" if i in staged or i in resident else f"{k}_ref" if i in refs else k
            for i, k in enumerate(kparams)]
    if staged:
        prologue += _staging_lines(staged, kparams)
    swap_lines = [f"{_INDENT * 2}{work[a]}, {work[b]} = {work[b]}, {work[a]}" for a, b in spec.swap]
    tile_barrier = ""
    rounds = None
    copy_r = []
    if tiles:
        rounds = _tile_stream_lines(tile, kparams, resident, depth, tiles)
        rounds["prologue"] = "\n".join(prologue + [rounds["prologue"]])
        rounds.update(depth=str(depth), tiles=str(tiles), halo_lo=str(tile.halo[0][0]),
                      halo_hi=str(tile.halo[0][1]), halo_lo_wide=str(depth * tile.halo[0][0]))
    elif depth > 1:
        prologue_r, publish, gather, copy_r = _tile_round_lines(tile, kparams, resident, depth)
        prologue += prologue_r
        rounds = dict(publish="\n".join(publish) or f"{_INDENT * 2}pass",
                      gather="\n".join(gather) or f"{_INDENT * 2}pass", depth=str(depth),
                      halo_lo=str(tile.halo[0][0]), halo_hi=str(tile.halo[0][1]))
    elif tile is not None:
        tile_pro, tile_barrier, tile_copy = tile_parts[:3]
        prologue += tile_pro
        # the global buffers the edge cells go through swap with the tiles
        swap_lines += [f"{_INDENT * 2}{_P}e{a}, {_P}e{b} = {_P}e{b}, {_P}e{a}" for a, b in spec.swap]
    # The end of a run is a rename: after k steps each parameter's buffer holds what its name
    # refers to after k swaps (the first the newest state, the second the one before), so a
    # run split into calls continues exactly. After an odd count the names point at each
    # other's buffers; the contents are exchanged in place, each thread its share. The
    # exchange reads elements other threads wrote in the last step, so a barrier comes first
    # whatever the step's own barrier was (it may have been elided, see reduction_barrier_at).
    copy_lines = []
    swapped = {i for pair in spec.swap for i in pair}
    fence = f"{_INDENT * 2}{_P}rt.{sync}_sync({_P}bar)" if backend == "cuda" and scope != "thread" else ""
    if staged:
        # shared-memory copies: each parameter's array is written from the copy its name
        # now refers to, so no exchange is needed
        copy_lines.append(f"{_INDENT}cuda.syncthreads()")
        for i in staged:
            if spec.params[i].written or i in swapped:
                copy_lines += _flat_copy(kparams[i], work[i], 1, count_of=kparams[i])
    if rounds is not None:
        copy_lines += copy_r
    elif tile is not None:
        # the tiles are written back by the rename rule: no exchange
        copy_lines += tile_copy
    pairs = [(a, b) for a, b in spec.swap if a not in staged and a not in resident]
    if pairs:
        copy_lines.append(f"{_INDENT}if _lk_t % 2 == 1:")
        if fence:
            copy_lines.append(fence)
        for a, b in pairs:
            copy_lines += _flat_exchange(work[a], work[b], 2, f"{_P}x{a}")
    state = f"{_P}code, {_P}pc, {_P}pn, {_P}pd"
    poll = (f"{state} = {_P}rt.poll{'_debug' if debug else ''}({_P}t, {_P}host, {_P}pc, {_P}pn, {_P}pd, "
            f"{_P}code{', ' + _P + 'dbg' if debug else ''})")
    # the one-thread CUDA template polls between bursts of steps: thread_poll is its line
    thread_poll = ""
    if not control:
        control_lines = [f"{_INDENT * 2}{_P}seen = 0"]
        thread_poll = f"{_P}ps = {_P}nsteps"        # one burst, never polled
    elif backend == "cpu":
        # one thread: its own decision takes effect after this step
        control_lines = [f"{_INDENT * 2}{poll}", f"{_INDENT * 2}{_P}seen = {_P}code"]
    elif scope == "thread":
        # the burst length adapts (cuda_rt.poll_strided); debug polls before every step, so a
        # bad access stops the run at the next step boundary
        control_lines = []
        thread_poll = poll if debug else (f"{state}, {_P}ps = {_P}rt.poll_strided({_P}t, {_P}host, {_P}pc, "
                                          f"{_P}pn, {_P}pd, {_P}code, {_P}ps)")
    else:
        # the leader's decision before step t reaches every thread through the barrier after
        # it; each thread reads it during step t + 1 and stops after that step, all at the same
        # one. Two slots: slot t % 2 is rewritten before step t + 2, after everyone read it.
        # One block keeps them in shared memory, a grid in global memory.
        slots = f"{_P}info" if scope == "grid" else f"{_P}sd"
        if scope == "block":
            prologue.append(f"{_INDENT}{_P}sd = cuda.shared.array(2, _lk_np.int64)")
        # (a kernel of rounds of steps takes the decision per round: one grid barrier each)
        at_ = f"{_P}round" if rounds is not None else f"{_P}t"
        control_lines = [f"{_INDENT * 2}{_P}seen = {slots}[({at_} + 1) & 1] if {at_} > 0 else 0",
                         f"{_INDENT * 2}if {_P}lead:",
                         f"{_INDENT * 3}{poll}",
                         f"{_INDENT * 3}{slots}[{at_} & 1] = {_P}code"]
    if backend == "cuda" and scope == "thread":
        # a sequential step: one thread, no barrier between steps
        thread_index, thread_count, barrier = "0", "1", ""
    elif backend == "cuda":
        thread_index = "cuda.grid(1)" if scope == "grid" else "cuda.threadIdx.x"
        thread_count = "cuda.gridsize(1)" if scope == "grid" else "cuda.blockDim.x"
        # a step that ends by returning a reduction's verdict already passed a barrier after
        # its last array access: the one inside the reduction
        barrier = "" if reduced_at is not None else f"{_P}rt.{sync}_sync({_P}bar)"
        if tile is not None:
            # never elided: the halo exchange needs a grid barrier between the publish and the
            # gather (the reduction's, when the step publishes before it: _tile_lines)
            barrier = tile_barrier
    else:
        thread_index = thread_count = barrier = ""

    helpers_text = []
    for p in pieces:
        helpers_text.extend(p.lines + [""])
    # The step's decorator line is in the template; drop the empty one rendered above.
    step_def, step_body = step_lines.lines[1], step_lines.lines[2:]
    mapping = dict(
        name=spec.name, filename=spec.filename, lineno=str(spec.lineno), scope=sync,
        fingerprint=fingerprint, helpers="\n".join(helpers_text),
        device_options=(", " + dev_opts if dev_opts and backend == "cuda" else dev_opts),
        kernel_options=ker_opts,
        step_params=step_def[step_def.index("(") + 1:step_def.rindex(")")],
        step_body="\n".join(step_body), kernel_params="".join(f"{k}, " for k in sig_params),
        nsteps_param=f"{_P}nsteps_ref" if by_ref is not None else f"{_P}nsteps", prologue="\n".join(prologue),
        start_param=f"{_P}t0_ref" if by_ref is not None else f"{_P}t0",
        seed_param=f"{_P}seed_ref" if by_ref is not None else f"{_P}seed",
        step_args="".join(f"{k}, " for k in work), thread_index=thread_index, thread_count=thread_count,
        barrier=barrier or "pass", swap="\n".join(swap_lines) or f"{_INDENT * 2}pass",
        copy_back="\n".join(copy_lines) or f"{_INDENT}pass", control="\n".join(control_lines),
        state=_state_lines(step_lines.memo_slots),
        debug_param=f", {_P}dbg" if debug else "", extra_args=(f", {_P}dbg, {_P}t0 + {_P}t" if debug else
                    "".join(f", {_P}{n}" for n in _TILE_CTX) + "".join(f", {e}" for e in edge_params)
                    if tile is not None else ""),
    )
    if tiles:
        mapping.update(rounds, swap="\n".join(_INDENT * 2 + line for line in swap_lines))
        template = load_template("cuda_tile_stream_kernel.py.tmpl")
    elif rounds is not None:
        # the stop decision's slots go by round: one grid barrier per round
        mapping.update(rounds, swap="\n".join(_INDENT + line for line in swap_lines))
        template = load_template("cuda_tile_rounds_kernel.py.tmpl")
    elif split:
        mapping.update(publish="\n".join(_INDENT * 2 + ln for ln in tile_parts[4]["publish"]) or f"{_INDENT * 2}pass",
                       gather="\n".join(_INDENT * 3 + ln for ln in tile_parts[4]["gather"]),
                       reach=str(max(tile.halo[0])), poll=poll,
                       # wrapping around, a row is found modulo the array's extent
                       # (rt.tile_row), and a tile longer than the extent less its lower halo
                       # finds some of its own rows in their copies in the halo: all its rows
                       # then wait for the gather
                       interior=f"{_P}T + {tile.halo[0][0]} <= {_P}n" if tile.periodic[0] else "True",
                       step_call=f"{_P}step({_P}t0 + {_P}t, {mapping['step_args']}{_P}tid, {_P}nt, {_P}redf, "
                                 f"{_P}redi, {_P}st, {_P}bar, {_P}shf, {_P}shi, {_P}seed")
        template = load_template("cuda_tile_split_kernel.py.tmpl")
    elif backend == "cuda" and scope == "thread":
        mapping["poll"] = thread_poll
        mapping["swap"] = "\n".join(_INDENT + line for line in swap_lines)
        template = load_template("cuda_thread_kernel.py.tmpl")
    else:
        template = load_template(f"{backend}_kernel.py.tmpl")
    text = template.substitute(mapping)
    line_map = _build_line_map(text, spec.filename)
    return KernelSource(text, backend, scope, spec.name, line_map, debug, tuple(sites.sites) if sites else ())


def _state_lines(memo_slots: int) -> str:
    """The kernel's per-thread state array (``_lk_st``): slot 0 counts the step's reductions
    (their slot parity), the rest keep grid loops' index digits (``parallel_grid``), marked
    unset by an extent no loop has (-1)."""
    lines = [f"{_INDENT}{_P}st = cuda.local.array({1 + memo_slots}, _lk_np.int64)", f"{_INDENT}{_P}st[0] = 0"]
    if memo_slots:
        lines.append(f"{_INDENT}for {_P}si in range(1, {1 + memo_slots}):")
        lines.append(f"{_INDENT * 2}{_P}st[{_P}si] = -1")
    return "\n".join(lines)


def swap_partners(spec) -> dict:
    """Each swapped array parameter's name -> its partner's name."""
    out = {}
    for i, j in spec.swap:
        a, b = spec.params[i].name, spec.params[j].name
        out[a], out[b] = b, a
    return out


def reduction_barrier_at(fs: FunctionSpec, partners: dict | None = None) -> int | None:
    """The index of the step's top-level statement whose evaluation passes a reduction's
    barrier after the step's last access of memory that another thread of the run reads or
    writes (every thread, every step), or None.

    Then the barrier inside that reduction orders every array access of the step before every
    access of the next, as the barrier between steps would, and that one is left out (Jacobi
    to tolerance: one grid barrier per step instead of two). The stop decision's slots and
    the reductions' own two-slot protocol only need one barrier per step.

    The proof must hold on every path. The step's only ``return`` is its last statement and
    reads no array and calls no helper; a reduction is reached unconditionally
    (:func:`always_reduces`): ``return t < 5 or lk.max(err) > tol`` skips the reduction on steps
    0-4, so it keeps the step barrier. Either the returned value reduces, or a top-level
    assignment of a reduction comes before it and everything between the two is
    (:func:`_register_tail`) assignments of locals and stores of them into *write-only* arrays
    (the form ``lk.while_loop`` lowers a carried reduction to): ``r = lk.max(e)``, then
    ``for q in lk.range(1): err_next[0] = r``, then ``return r > tol``. A write-only array, and
    its swap partner, appears nowhere else in the step, so no thread ever reads it during the
    run; its element is stored by the same iteration, so the same thread, every step (constant
    bounds and indices), so stores of different steps are in that thread's program order; the
    exchange after an odd step count has its own barrier (render_kernel).
    """
    body = list(fs.body)
    returns = [n for st in body for n in ast.walk(st) if isinstance(n, ast.Return)]
    if len(returns) != 1 or not body or body[-1] is not returns[0] or returns[0].value is None:
        return None
    value = returns[0].value
    if _touches_memory(value):
        return None
    if always_reduces(value):
        return len(body) - 1
    for k in range(len(body) - 2, -1, -1):
        st = body[k]
        if (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                and not _touches_memory(st.value) and always_reduces(st.value)):
            return k if _register_tail(body[:k + 1], body[k + 1:-1], partners or {}) else None
    return None


#: tile mode: a step whose last barrier is a reduction's publishes its edge cells before it
#: (_fused_exchange_at); False keeps a barrier of the exchange's own after the step (only to
#: measure the difference: bench/tile_probe.py fuse=1,0)
FUSE_EXCHANGE_WITH_REDUCTION = True


def _fused_exchange_at(spec, tile, written, at: int | None) -> int | None:
    """Tile mode, one step per exchange: the top-level statement of the step before which it
    can publish its edge cells so that a reduction's grid barrier is also the exchange's
    (:func:`_tile_lines`), or None. ``at``: the step's :func:`reduction_barrier_at`.

    That statement passes the step's last barrier (:func:`reduction_barrier_at`: every
    thread, every step, after the step's last access of memory another thread reads or
    writes), so the tiles are final there; the statements from it on store into no tile (a
    carried reduction's write-only array may be stored, never a resident one). The gather
    after the step then writes only the halo cells of the arrays the step wrote, which no
    thread touches again before the barrier after the gather."""
    if at is None or not FUSE_EXCHANGE_WITH_REDUCTION or not written or not any(tile.halo[0]):
        return None
    tiles = {spec.params[i].name for i in tile.resident}
    for st in list(spec.step.body)[at:]:
        for node in ast.walk(st):
            if isinstance(node, ast.Name) and node.id in tiles:
                return None
    return at


def _touches_memory(e) -> bool:
    """``e`` reads an array element, updates one (``lk.atomic``) or calls a helper (which may)."""
    return any(is_helper_call(n) or isinstance(n, ast.Subscript) or (marker_of(n) or "").startswith("atomic")
               for n in ast.walk(e))


def _register_tail(before: list, tail: list, partners: dict) -> bool:
    """``tail`` (the statements after a step's last reduction, before its return) touches no
    memory another thread reads or writes (see :func:`reduction_barrier_at`): assignments of
    locals from locals, and ``lk.range`` loops with constant bounds whose bodies only store
    such values into write-only arrays at constant indices or the loop index."""
    stored = set()
    for st in tail:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            if _touches_memory(st.value):
                return False
            continue
        if not (isinstance(st, ast.For) and marker_of(st.iter) == "range" and isinstance(st.target, ast.Name)
                and not st.orelse and all(isinstance(a, ast.Constant) and type(a.value) is int
                                          for a in st.iter.args)):
            return False
        var = st.target.id
        for store in st.body:
            if not (isinstance(store, ast.Assign) and len(store.targets) == 1
                    and isinstance(store.targets[0], ast.Subscript)
                    and isinstance(store.targets[0].value, ast.Name)):
                return False
            target = store.targets[0]
            index = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
            if not all(isinstance(i, ast.Constant) and type(i.value) is int
                       or isinstance(i, ast.Name) and i.id == var for i in index):
                return False
            if _touches_memory(store.value):
                return False
            stored.add(target.value.id)
    # write-only: the stored arrays and their partners appear nowhere but as those targets
    names = stored | {partners[a] for a in stored if a in partners}
    targets = {id(st.targets[0].value) for loop in tail if isinstance(loop, ast.For) for st in loop.body}
    for st in before + tail:
        for n in ast.walk(st):
            if isinstance(n, ast.Name) and n.id in names and id(n) not in targets:
                return False
    return True


def always_reduces(e: ast.expr) -> bool:
    """Evaluating ``e`` always evaluates a reduction (``lk.sum/max/min``), on every path.

    Only operands Python evaluates unconditionally count: the first operand of ``and``/``or``
    (the others may be short-circuited), the test of a conditional expression (or both of its
    branches, when each reduces), the first two terms of a comparison chain (``a < b < c``
    skips ``c`` when ``a < b`` is false), and every operand of arithmetic and of a call.
    """
    if marker_of(e) in ("sum", "max", "min"):
        return True
    if isinstance(e, ast.BoolOp):
        return always_reduces(e.values[0])
    if isinstance(e, ast.IfExp):
        return always_reduces(e.test) or (always_reduces(e.body) and always_reduces(e.orelse))
    if isinstance(e, ast.Compare):
        return always_reduces(e.left) or always_reduces(e.comparators[0])
    if isinstance(e, ast.BinOp):
        return always_reduces(e.left) or always_reduces(e.right)
    if isinstance(e, ast.UnaryOp):
        return always_reduces(e.operand)
    if isinstance(e, ast.Call):
        return any(always_reduces(a) for a in e.args)
    if isinstance(e, ast.Tuple):
        return any(always_reduces(x) for x in e.elts)
    return False   # names, constants, attributes: nothing is evaluated that reduces


#: what a tile-mode step receives besides the usual context: its block's tile [tlo, thi), the
#: tile's base (element 0 of a shared tile is element tb of the array), and the thread's
#: index and count within the block
_TILE_CTX = ("tlo", "thi", "tb", "btid", "bnt")


def _tile_index(e, wrap: str | None = None):
    """``e`` (an index into a tile-mode array) shifted by the tile's base; an index proven
    non-negative stays so (an access inside the tile or its halo is at or above the base).
    ``wrap``: the array's name when the stencil wraps around along this dimension; the row is
    then taken modulo its extent (``rt.tile_row``), which is never negative."""
    base = ast.Name(id=f"{_P}tb", ctx=ast.Load())

    def shifted(x):
        d = ast.BinOp(left=x, op=ast.Sub(), right=base)
        if wrap is None:
            return d
        extent = ast.parse(f"{wrap}.shape[0]", mode="eval").body
        return _rt_call("tile_row", [d, extent], x)
    if is_nonneg_mark(e):
        e = copy.copy(e)
        e.args = [shifted(e.args[0])]
        return e
    return shifted(e)


def _first_index(node):
    """The index of dimension 0 of subscript ``node``."""
    return node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice


def _row_offset(e, row: str) -> bool:
    """Whether ``e`` is ``row``, ``row + c`` or ``row - c`` with ``c`` an integer literal: an
    access that cannot wrap around (the stencil analysis bounds ``c`` by the halo)."""
    if isinstance(e, ast.Name):
        return e.id == row
    return (isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)) and isinstance(e.left, ast.Name)
            and e.left.id == row and int_constant(e.right) is not None)


def _tile_lines(tile, kparams, resident, written, sync: str = "grid",
                step_names: dict | None = None, swap: tuple = ()) -> tuple[list, str, list, list, dict]:
    """(prologue lines, the step barrier's text, copy-back lines, publish lines for the step,
    the split exchange's lines) of a tile-mode kernel.

    Each block keeps its tile of every resident array in shared memory for the whole run: one
    contiguous range of the first dimension (cells of a 1-D array, whole rows of a 2-D one),
    with the stencil's halo along that dimension on each side. After each step the block
    publishes the edge cells (rows) of the arrays the step wrote to their global buffer (the
    one of this step's parity), passes the grid barrier, and reads its neighbours' edge cells
    into its halo. At the end every tile is written back to the global array its name refers
    to (the rename rule of swap pairs). A 2-D tile holds whole rows, so the second dimension
    needs no exchange (and may wrap around: it is all on chip). A stencil that wraps around
    along the first dimension fills the first tile's lower halo from the array's last rows and
    the last tile's upper halo from its first rows; the step finds such a row in the tile
    modulo the extent (``rt.tile_row``).

    The barrier is ``sync``'s: the grid's, or a cluster's (a grid launched as one cluster). A
    barrier among neighbouring blocks only (per-block step counts with release/acquire, and a
    stop plan reaching every block within blocks + 1 steps) measured slower on the H200 (1M
    heat, 512 threads: 3.02 µs/step against 2.80; bench-results/session7) and was taken out
    (commit 5595242 has it).

    The split exchange's lines (render_kernel's ``split``) are the publish alone, and the
    gather as it runs after the names of each swap pair (``swap``) were exchanged: into the
    halo of each written array's partner, which then names the step's result.

    ``step_names`` (array index -> the step's parameter name) fuses the exchange into a step
    whose last barrier is a reduction's (:func:`reduction_barrier_at`): the step publishes its
    edge cells just before that reduction (the returned publish lines, inside the step, where
    ``_lk_e<i>`` are parameters), the reduction's grid barrier orders them before every
    block's gather, and the barrier text keeps only the gather: one grid barrier per step
    instead of two (Jacobi to a tolerance).
    """
    (hl, hr) = tile.halo[0]
    tt = _TileText(tile, kparams, resident, 1)
    cells, get, put = tt.cells, tt.get, tt.put
    wrap = tile.periodic[0]
    k0 = kparams[resident[0]]
    i1, i2 = _INDENT, _INDENT * 2
    pro = [f"{i1}{_P}n = {k0}.shape[0]",
           f"{i1}{_P}T = ({_P}n + cuda.gridDim.x - 1) // cuda.gridDim.x",
           f"{i1}{_P}tlo = min(cuda.blockIdx.x * {_P}T, {_P}n)",
           f"{i1}{_P}thi = min({_P}tlo + {_P}T, {_P}n)",
           f"{i1}{_P}tb = {_P}tlo - {hl}",
           f"{i1}{_P}W = {_P}T + {hl + hr}",
           f"{i1}{_P}btid = cuda.threadIdx.x",
           f"{i1}{_P}bnt = cuda.blockDim.x",
           f"{i1}{_P}m = {k0}.shape[1]" if tt.two else f"{i1}{_P}m = 1",
           f"{i1}{_P}sh = cuda.shared.array(0, {k0}.dtype)"]
    for j, i in enumerate(resident):
        pro.append(f"{i1}{_P}w{i} = {_P}rt.tile_like({_P}sh, {j} * {_P}W * {_P}m, {_P}W * {_P}m, {kparams[i]})")
        # (wrapping around, every row of the tile: its halo's taken across the wrap)
        first, guard = (f"({_P}tb + {_P}r) % max({_P}n, 1)", "True") if wrap else \
            (f"{_P}tb + {_P}r", f"0 <= {_P}c < {_P}n")
        pro += cells(1, f"{_P}W", first, guard, [put(f"{_P}w{i}", f"{_P}r", get(kparams[i], f"{_P}c", False), True)])
        pro.append(f"{i1}{_P}e{i} = {kparams[i]}")
    pro.append(f"{i1}cuda.syncthreads()")

    def publish(depth, tiles):
        return cells(depth, hl + hr, f"{_P}tlo + {_P}r if {_P}r < {hr} else {_P}thi - {hl} + ({_P}r - {hr})",
                     f"{_P}tlo <= {_P}c < {_P}thi",
                     [put(f"{_P}e{i}", f"{_P}c", get(tiles[i], f"{_P}c - {_P}tb", True), False) for i in written])
    in_step = []
    # (split exchange, see render_kernel: the publish before the barrier's arrival, and the
    # gather after its wait, which comes after the names were swapped)
    edges = publish(0, {i: f"{_P}w{i}" for i in written}) if hl + hr and written else []
    split = {"publish": edges, "gather": []}
    if step_names is not None:
        if not (hl + hr and written):
            raise ValueError("fusing the exchange into the step needs a halo and an array the step writes")
        # (the edge cells were written by other threads of the block)
        in_step = [f"{i1}cuda.syncthreads()"]
        if tt.two:
            in_step.append(f"{i1}{_P}m = {step_names[written[0]]}.shape[1]")
        in_step += publish(1, step_names)
        bar = []
    else:
        bar = ["cuda.syncthreads()"] + edges + [f"{_P}rt.{sync}_sync({_P}bar)"]
    if hl + hr and written:
        # the halo rows, from the neighbours' edges; wrapping around along dimension 0, the
        # first tile's lower halo is the last rows of the array and the last tile's upper halo
        # its first rows (every one of them some tile's edge: each tile is at least a halo long)
        guard = "True" if wrap else f"0 <= {_P}c < {_P}n and not ({_P}tlo <= {_P}c < {_P}thi)"
        row = f"{_P}c % max({_P}n, 1)" if wrap else f"{_P}c"
        first = f"{_P}tb + {_P}r if {_P}r < {hl} else {_P}thi + ({_P}r - {hl})"
        # a row outside the array (the first tile's lower halo, the last one's upper) is read
        # from the nearest row in it and not kept: every load of a 2-D gather is unconditional
        safe = row if wrap else f"min(max({_P}c, 0), {_P}n - 1)"

        def gather(arrays):
            if tt.two:
                return tt.gather_rows(hl + hr, first, guard, safe, arrays)
            return cells(0, hl + hr, first, guard,
                         [put(f"{_P}w{i}", f"{_P}c - {_P}tb", get(f"{_P}e{i}", row, False), True) for i in arrays])
        bar += gather(written) + ["cuda.syncthreads()"]
        partner = {a: b for pair in swap for a, b in (pair, pair[::-1])}
        split["gather"] = gather([partner.get(i, i) for i in written]) + ["cuda.syncthreads()"]
    barrier = ("\n" + i2).join(bar)
    copy_back = [f"{i1}cuda.syncthreads()"] + tt.copy_rows(1, f"{_P}thi - {_P}tlo", f"{_P}tlo + {_P}r", "True",
                                                          to_shared=False)
    return pro, barrier, copy_back, in_step, split


class _TileText:
    """Lines that move a tile's rows (cells in 1-D, rows in 2-D) between shared memory, the
    user's arrays and the halo scratch, for the tile-mode kernels (``_tile_lines`` with
    ``depth`` 1, ``_tile_round_lines``, ``_tile_stream_lines``).

    A tile is rows ``[tlo, thi)`` of the first dimension; its shared copy of array ``i``
    (``_lk_w<i>``) holds rows ``[tb, tb + W)``, ``tb = tlo - depth * halo_lo``. Its slots in
    ``_lk_halo`` (per parity, tile and resident array, ``_lk_hs`` elements) hold its first
    ``depth * halo_hi`` rows (what the tile below reads) then its last ``depth * halo_lo``
    (what the tile above reads).
    """

    def __init__(self, tile, kparams, resident, depth):
        (hl, hr) = tile.halo[0]
        self.el, self.er = depth * hl, depth * hr        # the widened halo, below and above
        self.two = tile.ndim == 2
        self.kparams, self.resident = kparams, resident
        self.nres = len(resident)

    def geometry(self, tile_len: str) -> list[str]:
        """Prologue lines: the tiles' length, the shared copies and the slots' sizes."""
        i1, k0 = _INDENT, self.kparams[self.resident[0]]
        pro = [f"{i1}{_P}n = {k0}.shape[0]",
               f"{i1}{_P}T = {tile_len}",
               f"{i1}{_P}W = {_P}T + {self.el + self.er}",
               f"{i1}{_P}btid = cuda.threadIdx.x",
               f"{i1}{_P}bnt = cuda.blockDim.x",
               f"{i1}{_P}m = {k0}.shape[1]" if self.two else f"{i1}{_P}m = 1",
               f"{i1}{_P}sh = cuda.shared.array(0, {k0}.dtype)",
               f"{i1}{_P}hs = {self.el + self.er} * {_P}m"]
        for j, i in enumerate(self.resident):
            pro.append(f"{i1}{_P}w{i} = {_P}rt.tile_like({_P}sh, {j} * {_P}W * {_P}m, {_P}W * {_P}m, "
                       f"{self.kparams[i]})")
        return pro

    def cells(self, depth, count, first, guard, body):
        """Lines running ``body`` for the rows ``_lk_c = first`` (``_lk_r`` in range(count))
        that pass ``guard``: in 1-D the block's threads take the cells, in 2-D each row's
        columns (``_lk_j``). Strided ``while`` loops: ``range(btid, m, bnt)`` would make Numba
        divide (64-bit, tens of instructions) to count the trips, for every row of every
        exchange."""
        ind, i1, i2 = _INDENT * depth, _INDENT, _INDENT * 2
        if self.two:
            return [f"{ind}for {_P}r in range({count}):", f"{ind}{i1}{_P}c = {first}",
                    f"{ind}{i1}if {guard}:", f"{ind}{i2}{_P}j = {_P}btid",
                    f"{ind}{i2}while {_P}j < {_P}m:"] + \
                [f"{ind}{_INDENT * 3}{b}" for b in body] + [f"{ind}{_INDENT * 3}{_P}j += {_P}bnt"]
        return [f"{ind}{_P}r = {_P}btid", f"{ind}while {_P}r < {count}:", f"{ind}{i1}{_P}c = {first}",
                f"{ind}{i1}if {guard}:"] + [f"{ind}{i2}{b}" for b in body] + [f"{ind}{i1}{_P}r += {_P}bnt"]

    def gather_rows(self, count, first, guard, safe, written) -> list[str]:
        """Lines (at the step barrier's indentation) copying the 2-D halo rows ``_lk_c =
        first`` (``_lk_r`` in range(count)) that pass ``guard`` from the global buffers
        ``_lk_e<i>`` (``i`` in ``written``) into the shared tiles, every load of a trip issued
        before any store: a trip that stored each value before loading the next waited on L2
        once per row and column stride, just after the grid barrier, where every block waits
        for its slowest trip. Each row is read at ``safe`` (a row inside the array, equal to
        ``_lk_c`` where ``guard`` holds; nothing is read from an array without rows) and kept
        only where ``guard`` holds, so no load is behind a branch. One column per trip: two
        (four loads in flight for the 5-point stencil) gave the device's ptxas (13.0) a kernel
        of 80 registers instead of 47 whose step loop waits on shared memory more often
        (``bench/sass_loops.py heat2d tile``: load waves [6, 7, 4, 3] against [10, 7, 3])."""
        i1, i2 = _INDENT, _INDENT * 2
        lines = []
        for r in range(count):
            lines += [f"{_P}r = {r}", f"{_P}c = {first}", f"{_P}hr{r} = {_P}c", f"{_P}hk{r} = {guard}",
                      f"{_P}hq{r} = {safe}"]
        lines += [f"{_P}hm = {_P}m if {_P}n > 0 else 0", f"{_P}j = {_P}btid", f"while {_P}j < {_P}hm:"]
        stores = []
        for r in range(count):
            for i in written:
                v = f"{_P}hv{r}_{i}"
                lines.append(f"{i1}{v} = {_P}rt.load({_P}e{i}, (_lk_np.uint64({_P}hq{r}), _lk_np.uint64({_P}j)))")
                stores.append(f"{i2}{_P}rt.sstore({_P}w{i}, (_lk_np.uint64({_P}hr{r} - {_P}tb), "
                              f"_lk_np.uint64({_P}j)), {v})")
        for r in range(count):
            lines.append(f"{i1}if {_P}hk{r}:")
            lines += stores[r * len(written):(r + 1) * len(written)]
        lines.append(f"{i1}{_P}j += {_P}bnt")
        return lines

    def _index(self, row):
        # every index these lines use is proven in range by the guards around them: unsigned,
        # so the access skips Python's negative-index test (runtime/arrays.py)
        return f"(_lk_np.uint64({row}), _lk_np.uint64({_P}j))" if self.two else f"_lk_np.uint64({row})"

    def get(self, name, row, shared: bool) -> str:
        """The element of row ``row`` (and column ``_lk_j`` in 2-D) of an array in shared
        memory (a tile) or in global memory (the user's arrays)."""
        return f"{_P}rt.{'sload' if shared else 'load'}({name}, {self._index(row)})"

    def put(self, name, row, value, shared: bool) -> str:
        return f"{_P}rt.{'sstore' if shared else 'store'}({name}, {self._index(row)}, {value})"

    def slot_get(self, base, j, row) -> str:
        return f"{_P}rt.load({_P}halo, _lk_np.uint64({self._slot(base, j, row)}))"

    def slot_put(self, base, j, row, value) -> str:
        return f"{_P}rt.store({_P}halo, _lk_np.uint64({self._slot(base, j, row)}), {value})"

    def _slot(self, base, j, row):
        return f"{base} + {j} * {_P}hs + ({row}) * {_P}m" + (f" + {_P}j" if self.two else "")

    def copy_rows(self, depth, count, first, guard, to_shared: bool) -> list[str]:
        """Rows between the user's arrays and the shared copies (``to_shared``: into them)."""
        body = []
        for i in self.resident:
            glob, shared, row = self.kparams[i], f"{_P}w{i}", f"{_P}c - {_P}tb"
            body.append(self.put(shared, row, self.get(glob, f"{_P}c", False), True) if to_shared
                        else self.put(glob, f"{_P}c", self.get(shared, row, True), False))
        return self.cells(depth, count, first, guard, body)

    def publish(self, depth, from_shared: bool = True) -> list[str]:
        """The tile's edge rows into its slots at ``_lk_hb`` (from the shared copies, or from
        the user's arrays before the first step)."""
        el, er = self.el, self.er
        if not el + er:
            return []

        def src(i):
            return self.get(f"{_P}w{i}", f"{_P}c - {_P}tb", True) if from_shared else \
                self.get(self.kparams[i], f"{_P}c", False)
        return self.cells(depth, el + er, f"{_P}tlo + {_P}r if {_P}r < {er} else {_P}thi - {el} + ({_P}r - {er})",
                          f"{_P}tlo <= {_P}c < {_P}thi",
                          [self.slot_put(f"{_P}hb", j, f"{_P}r", src(i)) for j, i in enumerate(self.resident)])

    def gather(self, depth, below: str, above: str) -> list[str]:
        """The halo rows from the slots of the tiles below and above (their bases ``below``,
        ``above``), into the shared copies."""
        el, er = self.el, self.er
        if not el + er:
            return []
        ind = _INDENT * depth
        return [f"{ind}{_P}hlo = {below}", f"{ind}{_P}hhi = {above}"] + self.cells(
            depth, el + er, f"{_P}tb + {_P}r if {_P}r < {el} else {_P}thi + ({_P}r - {el})",
            f"0 <= {_P}c < {_P}n and not ({_P}tlo <= {_P}c < {_P}thi)",
            [f"{_P}hsrc = {_P}hlo if {_P}r < {el} else {_P}hhi",
             f"{_P}hrow = {er} + {_P}r if {_P}r < {el} else {_P}r - {el}"]
            + [self.put(f"{_P}w{i}", f"{_P}c - {_P}tb", self.slot_get(f"{_P}hsrc", j, f"{_P}hrow"), True)
               for j, i in enumerate(self.resident)])


def _tile_round_lines(tile, kparams, resident, depth: int) -> tuple[list, list, list, list]:
    """(prologue, publish, gather, copy-back lines) of a tile-mode kernel that runs ``depth``
    steps per halo exchange (``fused_steps_refusal`` allows it) with one tile per block kept on
    chip for the whole run.

    Each block keeps its tile of every resident array in shared memory with a halo ``depth``
    times the stencil's on either side (see :class:`_TileText`). After a round of steps, its
    edge rows of both buffers of each pair go to its slots in ``_lk_halo`` (the round's
    parity picks one of two sets, so a block that runs ahead never overwrites what a
    neighbour is still reading); after the grid barrier the block reads its neighbours' slots
    into its halo. The user's arrays are read once, into the tiles, and written once, from
    them (the rename rule of swap pairs); nothing else touches them, so no barrier is needed
    around either. A block's halo comes from its two neighbours only, so a tile must be at
    least ``depth`` stencil widths long (``config.tile_config`` checks it).
    """
    tt = _TileText(tile, kparams, resident, depth)
    i1 = _INDENT
    pro = tt.geometry(f"({_P}n + cuda.gridDim.x - 1) // cuda.gridDim.x") + [
        f"{i1}{_P}tlo = min(cuda.blockIdx.x * {_P}T, {_P}n)",
        f"{i1}{_P}thi = min({_P}tlo + {_P}T, {_P}n)",
        f"{i1}{_P}tb = {_P}tlo - {tt.el}",
        f"{i1}{_P}hown = cuda.blockIdx.x * {tt.nres} * {_P}hs",
        f"{i1}{_P}hpar = cuda.gridDim.x * {tt.nres} * {_P}hs"]
    pro += tt.copy_rows(1, f"{_P}W", f"{_P}tb + {_P}r", f"0 <= {_P}c < {_P}n", to_shared=True)
    pro.append(f"{i1}cuda.syncthreads()")
    publish, gather = [], []
    if tt.el + tt.er:
        i2 = _INDENT * 2
        publish = [f"{i2}{_P}hb = ({_P}round & 1) * {_P}hpar + {_P}hown"] + tt.publish(2)
        gather = [f"{i2}{_P}hb = ({_P}round & 1) * {_P}hpar"] + tt.gather(
            2, f"{_P}hb + {_P}hown - {tt.nres} * {_P}hs", f"{_P}hb + {_P}hown + {tt.nres} * {_P}hs")
        gather.append(f"{i2}cuda.syncthreads()")
    copy_back = tt.copy_rows(1, f"{_P}thi - {_P}tlo", f"{_P}tlo + {_P}r", "True", to_shared=False)
    return pro, publish, gather, copy_back


def _tile_stream_lines(tile, kparams, resident, depth: int, tiles: int) -> dict:
    """The pieces of a tile-mode kernel for a field too large to stay on chip: each block owns
    ``tiles`` tiles of the first dimension and, every round, brings each one on chip with its
    widened halo, runs up to ``depth`` steps on it, and writes its rows back to the user's
    arrays (only its owner ever reads or writes them) and its edge rows out to its slots in
    ``_lk_halo`` (see :class:`_TileText`). A tile's halo comes from its neighbours' slots of
    the previous round's parity (before the first round, from slots filled from the arrays
    and a grid barrier), so a block that runs ahead never reads a row a neighbour has already
    advanced. One grid barrier per round. Returns the template's ``prologue``,
    ``publish_initial``, ``load`` and ``store``.
    """
    tt = _TileText(tile, kparams, resident, depth)
    i1 = _INDENT
    per = f"cuda.gridDim.x * {tiles}"
    pro = tt.geometry(f"max(({_P}n + {per} - 1) // ({per}), 1)") + [
        f"{i1}{_P}ntiles = ({_P}n + {_P}T - 1) // {_P}T",
        f"{i1}{_P}hx = {tt.nres} * {_P}hs",
        f"{i1}{_P}hpar = {per} * {_P}hx"]
    init = tt.publish(2, from_shared=False) or [f"{_INDENT * 2}pass"]
    d = 3
    ind = _INDENT * d
    load = tt.copy_rows(d, f"{_P}thi - {_P}tlo", f"{_P}tlo + {_P}r", "True", to_shared=True)
    load += [f"{ind}{_P}hb = (({_P}round + 1) & 1) * {_P}hpar"] + tt.gather(
        d, f"{_P}hb + ({_P}x - 1) * {_P}hx", f"{_P}hb + ({_P}x + 1) * {_P}hx")
    store = tt.copy_rows(d, f"{_P}thi - {_P}tlo", f"{_P}tlo + {_P}r", "True", to_shared=False)
    store += [f"{ind}{_P}hb = ({_P}round & 1) * {_P}hpar + {_P}x * {_P}hx"] + tt.publish(d)
    return dict(prologue="\n".join(pro), publish_initial="\n".join(init), load="\n".join(load),
                store="\n".join(store))


def _staging_lines(staged, kparams) -> list[str]:
    """Copy the staged arguments into one dynamic shared-memory array, one after another."""
    first = kparams[staged[0]]
    lines = [f"{_INDENT}{_P}sh = cuda.shared.array(0, {first}.dtype)", f"{_INDENT}{_P}off = 0"]
    for i in staged:
        k = kparams[i]
        lines += [f"{_INDENT}{_P}s{i} = {_P}rt.shared_like({_P}sh, {_P}off, {k})",
                  f"{_INDENT}{_P}off += {k}.size"]
        lines += _flat_copy(f"{_P}s{i}", k, 1)
        lines.append(f"{_INDENT}{_P}w{i} = {_P}s{i}")
    lines.append(f"{_INDENT}cuda.syncthreads()")
    return lines


def _flat_exchange(a: str, b: str, depth: int, tmp: str) -> list[str]:
    """Each thread exchanges its share of the elements of ``a`` and ``b`` (same size)."""
    return [f"{_INDENT * depth}for {_P}k in range({_P}tid, {a}.size, {_P}nt):",
            f"{_INDENT * (depth + 1)}{tmp} = {a}.flat[{_P}k]",
            f"{_INDENT * (depth + 1)}{a}.flat[{_P}k] = {b}.flat[{_P}k]",
            f"{_INDENT * (depth + 1)}{b}.flat[{_P}k] = {tmp}"]


def _flat_copy(dst: str, src: str, depth: int, count_of: str | None = None) -> list[str]:
    """Each thread copies its share of ``src`` into ``dst`` (same size), element by element;
    ``count_of`` names the array whose size bounds the loop (default ``src``)."""
    return [f"{_INDENT * depth}for {_P}k in range({_P}tid, {count_of or src}.size, {_P}nt):",
            f"{_INDENT * (depth + 1)}{dst}.flat[{_P}k] = {src}.flat[{_P}k]"]


def _build_line_map(text: str, filename: str) -> dict:
    """Generated line -> (file, user line, col), read back from the '# line N' comments."""
    out = {}
    for i, line in enumerate(text.splitlines(), start=1):
        pos = line.rfind("  # ")
        if pos < 0 or line.lstrip().startswith("#"):
            continue
        tag = line[pos + 4:]
        where, _, num = (filename, "", tag[5:]) if tag.startswith("line ") else tag.rpartition(":")
        if not num.isdigit():
            continue
        code = line[:pos]
        out[i] = (where, int(num), len(code) - len(code.lstrip()) + 1)
    return out
