"""Which elements of an array a parallel loop's access can touch, as far as the front end can
tell: enough to prove that two loops of one step (with no barrier between them) never touch the
same element, so that one may write what the other reads or writes without a race.

An access ``a[i + c, j]`` in ``for i, j in lk.grid((1, n - 1), m)`` touches, in dimension 0,
the elements from ``1 + c`` to ``n - 2 + c``; ``v[i]`` in ``for i in lk.range(0, n, n - 1)``
touches ``0`` and ``n - 1`` only (the step is the distance between the ends); ``v[n - 1]``
touches one element wherever it stands. Bounds are linear expressions in names that hold one
value for the whole step (parameters, names bound once at its top level, ``x.shape[k]``), and
two bounds compare only when they differ by a constant: ``n - 2 < n - 1`` is proven, ``k < n``
is not. Only indices the front end proved non-negative (``index_bounds``) are used: a negative
index counts from the end, where these intervals would not see it.
"""

from __future__ import annotations

import ast
import math

from .index_bounds import is_nonneg_mark
from .spec import binding_counts, index_offset, int_constant, marker_of


def stable_names(body, params, same_shape=None) -> dict:
    """Names that hold one value for the whole step -- parameters never bound again, and names
    bound exactly once, by a top-level assignment of ``body`` -- each to its affine value where
    it has one (``n = u.shape[0]``), else to itself. ``same_shape``: array name -> the name whose
    shape it has (a swap pair's arrays), so that both write one symbol."""
    counts = binding_counts(body)
    stable = {p: {p: 1} for p in params if p not in counts}
    stable[_SAME_SHAPE] = dict(same_shape or {})
    for st in body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) \
                and counts.get(st.targets[0].id) == 1 and _uniform(st.value, stable):
            name = st.targets[0].id
            stable[name] = affine(st.value, stable) or {name: 1}
    return stable


_SAME_SHAPE = " same shape"
#: calls whose value is the same on every thread when their arguments' are
_UNIFORM_CALLS = {"min", "max", "abs", "int", "float", "bool", "round", "len"}


def _uniform(e, stable) -> bool:
    """Whether ``e`` has one value on every thread, computed from stable names, literals and
    extents only (no element of an array, no thread id: ``k = lk.thread_id()`` is no bound)."""
    calls = {id(n.func) for n in ast.walk(e) if isinstance(n, ast.Call)}
    for n in ast.walk(e):
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in _UNIFORM_CALLS):
            return False
        if isinstance(n, ast.Name) and id(n) not in calls and (n.id not in stable or n.id == _SAME_SHAPE):
            return False
        if isinstance(n, ast.Subscript) and not (isinstance(n.value, ast.Attribute) and n.value.attr == "shape"):
            return False
        if isinstance(n, ast.Attribute) and n.attr != "shape":
            return False
    return True


def shape_symbol(array: str, dim: int, stable) -> str:
    """The symbol of ``array.shape[dim]`` (an extent: never negative)."""
    return f"{stable.get(_SAME_SHAPE, {}).get(array, array)}.shape[{dim}]"


def affine(e, stable) -> dict | None:
    """``e`` as ``{symbol: coefficient}`` with the constant under ``""``, when it is a sum of
    integer literals and multiples of stable names and ``x.shape[k]``; else None."""
    c = int_constant(e)
    if c is not None:
        return {"": c}
    if isinstance(e, ast.Name):
        return dict(stable[e.id]) if e.id in stable and e.id != _SAME_SHAPE else None
    if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Attribute) and e.value.attr == "shape" \
            and isinstance(e.value.value, ast.Name) and e.value.value.id in stable:
        k = int_constant(e.slice)
        return None if k is None else {shape_symbol(e.value.value.id, k, stable): 1}
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        inner = affine(e.operand, stable)
        return None if inner is None else _scaled(inner, -1)
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
        left, right = affine(e.left, stable), affine(e.right, stable)
        if left is None or right is None:
            return None
        return _sum(left, _scaled(right, 1 if isinstance(e.op, ast.Add) else -1))
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult):
        for k, other in ((int_constant(e.left), e.right), (int_constant(e.right), e.left)):
            if k is not None:
                inner = affine(other, stable)
                return None if inner is None else _scaled(inner, k)
    return None


def _scaled(a: dict, k: int) -> dict:
    return {s: v * k for s, v in a.items()}


def _sum(a: dict, b: dict) -> dict:
    out = dict(a)
    for s, v in b.items():
        out[s] = out.get(s, 0) + v
    return {s: v for s, v in out.items() if v or s == ""}


def _difference(a: dict, b: dict) -> int | None:
    """``a - b`` when it is a constant, else None."""
    d = _sum(a, _scaled(b, -1))
    return d.get("", 0) if set(d) <= {""} else None


def _nonneg(d: dict, facts) -> bool:
    """Proven ``d >= 0``: once up to two of ``facts`` (affine values known to be >= 0) are taken
    away, what is left is a non-negative constant plus non-negative multiples of extents."""
    combos = [()] + [(f,) for f in facts] + [(f, g) for k, f in enumerate(facts) for g in facts[k:]]
    for combo in combos:
        rest = d
        for f in combo:
            rest = _sum(rest, _scaled(f, -1))
        if rest.get("", 0) >= 0 and all(v >= 0 and _is_extent(s) for s, v in rest.items() if s):
            return True
    return False


def _is_extent(symbol: str) -> bool:
    return symbol.endswith("]") and ".shape[" in symbol


def _below(a: dict, b: dict, facts=()) -> bool:
    """Proven ``a < b``."""
    return _nonneg(_sum(_sum(b, _scaled(a, -1)), {"": -1}), facts)


def _rebound(loop) -> set:
    """Names the loop's body binds (a loop variable among them names other values)."""
    return set(binding_counts(list(loop.body) + list(loop.orelse)))


def loop_names(loop) -> list:
    """The names a parallel loop binds, in order (for ``lk.grid`` with one target: that name)."""
    return [t.id for t in (loop.target.elts if isinstance(loop.target, ast.Tuple) else [loop.target])
            if isinstance(t, ast.Name)]


def owned_variables(loop) -> list | None:
    """The parallel loop's variables, when they can tell its iterations apart in an index
    (distinct, and not bound again in its body), else None: what :func:`own_key` takes."""
    names = loop_names(loop)
    return None if len(set(names)) != len(names) or set(names) & _rebound(loop) else names


def own_key(loop, names, index):
    """For an access whose (marked) index gives, in some of its dimensions, each of the parallel
    loop's variables ``names`` (:func:`owned_variables`) plus a constant (each variable once,
    proven non-negative): those dimensions as ``((dimension, variable position, constant),
    ...)``. Different iterations of the loop then touch different elements through it, and two
    accesses of equal keys in loops of the same iterations touch one element only from the same
    iteration. None otherwise (``u[k]`` is every iteration's element; a negative index may wrap
    onto another iteration's)."""
    if names is None:
        return None
    if isinstance(index, ast.Name) and isinstance(loop.target, ast.Name) and index.id == loop.target.id \
            and marker_of(loop.iter) == "grid":
        # an lk.grid loop's one target, the tuple of its indices: from starts that are not negative
        starts = [int_constant(a.elts[0]) if isinstance(a, ast.Tuple) else 0 for a in loop.iter.args]
        ok = all(c is not None and c >= 0 for c in starts)
        return tuple((d, d, 0) for d in range(len(starts))) if ok else None
    if isinstance(loop.target, ast.Name) and marker_of(loop.iter) == "grid":
        return None
    key = []
    for dim, d in enumerate(index.elts if isinstance(index, ast.Tuple) else [index]):
        if is_nonneg_mark(d):
            base, c = index_offset(d.args[0])
            if isinstance(base, ast.Name) and base.id in names and base.id not in [names[v] for _, v, _ in key]:
                key.append((dim, names.index(base.id), c))
    return tuple(key) if len(key) == len(names) else None


def loop_bounds(loop) -> list | None:
    """``(start, stop, step)`` expressions per variable of a parallel loop (``step`` None where
    the loop has none: 1), or None for a form other than ``lk.range(stop)``,
    ``lk.range(start, stop[, step])`` and ``lk.grid(extent or (start, stop), ...)``."""
    kind, args = marker_of(loop.iter), loop.iter.args
    if kind == "range" and 1 <= len(args) <= 3:
        return [(ast.Constant(0), args[0], None) if len(args) == 1 else
                (args[0], args[1], args[2] if len(args) == 3 else None)]
    if kind == "grid" and all(not isinstance(a, ast.Tuple) or len(a.elts) == 2 for a in args):
        return [(a.elts[0], a.elts[1], None) if isinstance(a, ast.Tuple) else (ast.Constant(0), a, None)
                for a in args]
    return None


def iteration_key(loop, stable):
    """What decides which thread runs which iteration of a parallel loop: its marker and its
    bounds and steps, as affine values where they are (``lk.range(n)`` is ``lk.range(0, n,
    1)``); None where a bound reads a name that is not stable (it may hold another value at
    another loop: ``s = 1`` between two ``lk.range(s, n)``)."""
    bounds = loop_bounds(loop)
    if bounds is None or not all(_uniform(a, stable) for a in loop.iter.args):
        return None

    def norm(e):
        a = affine(e, stable)
        return ast.dump(e) if a is None else tuple(sorted(a.items()))
    return (marker_of(loop.iter),) + tuple((norm(lo), norm(hi), norm(step or ast.Constant(1)))
                                           for lo, hi, step in bounds)


def loop_pieces(loop, stable) -> dict:
    """Loop variable -> the values it takes as ``(low, high, stride)`` pieces of affine bounds
    (inclusive; the values are ``low`` plus multiples of ``stride``, 0 for ``low`` alone; an
    over-approximation: an empty loop takes none), for the variables whose values this can
    bound and that the loop body never binds again."""
    names, bounds = loop_names(loop), loop_bounds(loop)
    # (one variable per dimension: lk.grid's one-name target, the tuple, has no pieces)
    if bounds is None or len(names) != len(bounds) or len(set(names)) != len(names) or \
            marker_of(loop.iter) == "grid" and not isinstance(loop.target, ast.Tuple):
        return {}
    rebound = _rebound(loop)
    out = {v: _range_pieces(lo, hi, step, stable) for v, (lo, hi, step) in zip(names, bounds)}
    return {v: p for v, p in out.items() if p is not None and v not in rebound}


def loop_facts(pieces: dict) -> list:
    """What holds while the loop runs an iteration (where it runs none, nothing it touches can
    race): for each variable over a range of positive step, its last value is not below its
    first. (``range(a, b, b - a - 1)`` runs ``a`` alone when ``a > b``: no fact.)"""
    return [_sum(p[-1][1], _scaled(p[0][0], -1)) for p in pieces.values() if p[0][2] >= 1]


def _range_pieces(lo, hi, step, stable):
    a, b = affine(lo, stable), affine(hi, stable)
    if a is None or b is None:
        return None
    last = _sum(b, {"": -1})
    s = None if step is None else int_constant(step)
    if step is None or (s is not None and s >= 1):
        return [(a, last, s or 1)]
    # range(a, b, b - a - 1): a and b - 1 only (a alone, or nothing, when b - a < 2)
    st = affine(step, stable)
    if st is not None and _difference(st, _sum(last, _scaled(a, -1))) == 0:
        return [(a, a, 0), (last, last, 0)]
    return None


def index_pieces(array: str, index, pieces: dict, stable) -> list:
    """Per dimension of the index ``index`` into ``array`` (marked by ``index_bounds``), the
    elements it can touch in one loop (``pieces`` from :func:`loop_pieces`): ``(pieces, extent)``
    with ``extent`` the dimension's extent where the index is not proven non-negative (a
    negative index names the element its value plus the extent), else None; or None where
    that is not known."""
    out = []
    for dim, d in enumerate(index.elts if isinstance(index, ast.Tuple) else [index]):
        marked = is_nonneg_mark(d)
        e = d.args[0] if marked else d
        base, c = index_offset(e)
        if isinstance(base, ast.Name) and base.id in pieces:
            got = [(_sum(lo, {"": c}), _sum(hi, {"": c}), m) for lo, hi, m in pieces[base.id]]
        else:
            point = affine(e, stable)
            got = None if point is None else [(point, point, 0)]
        literal = int_constant(e)
        wraps = not marked and not (literal is not None and literal >= 0)
        out.append(None if got is None else (got, {shape_symbol(array, dim, stable): 1} if wraps else None))
    return out


def _may_wrap(dim, facts) -> bool:
    """Whether a dimension's index may be negative (count from the end), given ``facts``."""
    pieces, extent = dim
    return extent is not None and not all(_nonneg(lo, facts) for lo, _, _ in pieces)


def _reached(dim, facts) -> list:
    """A dimension's pieces, with the elements negative values wrap to where they may occur."""
    pieces, extent = dim
    if not _may_wrap(dim, facts):
        return pieces
    top = _sum(extent, {"": -1})
    return pieces + [(_sum(lo, extent), top, 1) for lo, _, _ in pieces]


def never_wraps(elements: list, facts=()) -> bool:
    """Whether an access's :func:`index_pieces` are known in every dimension and proven
    non-negative there (given ``facts``): no index of it counts from the end."""
    return all(d is not None and not _may_wrap(d, list(facts)) for d in elements)


def _apart(p, q, facts) -> bool:
    (l1, h1, m1), (l2, h2, m2) = p, q
    if _below(h1, l2, facts) or _below(h2, l1, facts):
        return True
    # values on different residues of a common stride (odd against even)
    g = math.gcd(m1, m2)
    d = _difference(l1, l2)
    return g >= 2 and d is not None and d % g != 0


def disjoint(x: list, y: list, facts=()) -> bool:
    """Whether two accesses' :func:`index_pieces` are proven apart in some dimension both
    index, given ``facts`` (affine values >= 0 while both loops run: :func:`loop_facts`)."""
    facts = list(facts)
    for dx, dy in zip(x, y):
        if dx is not None and dy is not None and all(_apart(p, q, facts) for p in _reached(dx, facts)
                                                     for q in _reached(dy, facts)):
            return True
    return False
