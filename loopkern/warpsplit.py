"""Warp-split parallel loops: a parallel loop with few iterations and a long inner loop.

All-pairs N-body written the natural way gives each thread one body (one ``lk.range``
iteration) and a plain ``range`` loop over all the others that accumulates forces into
scalars. With 1024 bodies that is 1024 busy threads on a GPU that holds hundreds of
thousands. When the parallel loop has few iterations, the CUDA kernel can give each iteration
a whole warp instead: the 32 lanes take every 32nd value of the inner loop, each accumulates
its share, the warp adds the 32 partial sums with shuffles, and lane 0 alone runs what follows
the inner loop. :func:`find_warp_split` decides whether a loop has that shape; the code
generator emits both forms and picks one at run time from the iteration count.

The shape (every other loop keeps one thread per iteration)::

    for i in lk.range(...):        # or lk.range(lo, hi[, step])
        <pre>                      # assignments to local names (no array stores), incl. acc = init
        for j in range(...):       # exactly one plain range loop at the top level
            <inner>                # assignments to local names, `acc += expr`, if, continue
        <post>                     # anything; runs on lane 0 only

- no array is written before or inside the inner loop (each lane would write it), no
  ``lk.*`` call (reductions, ``lk.sync``, ``lk.random``, ``lk.atomic``) and no helper call
  appears before or inside it;
- each accumulator is assigned in ``pre`` and, inside the inner loop, only updated with
  ``+=`` and never read (a lane holds a partial sum; its value from ``pre`` counts once, in
  the group's first lane, the other lanes start from zero); names assigned inside the inner
  loop (and its index) are not used after it (their last value would be a lane's, not the
  loop's), and each trip assigns them before it reads them (a value carried from one trip
  to the next, ``prev = a[j]`` or ``w *= 0.5``, would come from another lane's trip);
- no ``break`` or ``return`` anywhere in the parallel loop's body, no ``continue`` outside the
  inner loop.

Results: integer sums are exact and equal the sequential ones; floating-point sums are added
in another order (each lane's share in order, then a tree across lanes), so they agree with the
sequential sum within floating-point tolerance, not bit for bit.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .spec import HELPER_PREFIX, INTRINSIC_PREFIX

#: lanes that share one iteration of a warp-split loop
WARP = 32


@dataclass(frozen=True)
class WarpSplit:
    """A parallel loop's body split around its inner loop (see the module docstring)."""
    pre: tuple
    inner: ast.For
    post: tuple
    accumulators: tuple


def _calls_outside_math(nodes) -> bool:
    """Whether any ``lk.*`` marker or helper call appears in ``nodes``."""
    for n in nodes:
        for c in ast.walk(n):
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and (
                    c.func.id.startswith(INTRINSIC_PREFIX) or c.func.id.startswith(HELPER_PREFIX)):
                return True
    return False


def _stores_array(nodes) -> bool:
    for n in nodes:
        for c in ast.walk(n):
            if isinstance(c, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = c.targets if isinstance(c, ast.Assign) else [c.target]
                if any(not isinstance(t, ast.Name) for t in targets):
                    return True
    return False


def _has(nodes, kinds) -> bool:
    return any(isinstance(c, kinds) for n in nodes for c in ast.walk(n))


def _names(nodes, ctx) -> set:
    """The names stored (``ast.Store``) or read (``ast.Load``) in ``nodes``."""
    return {c.id for n in nodes for c in ast.walk(n) if isinstance(c, ast.Name) and isinstance(c.ctx, ctx)}


def _is_plain_range(s) -> bool:
    return (isinstance(s, ast.For) and isinstance(s.iter, ast.Call) and isinstance(s.iter.func, ast.Name)
            and s.iter.func.id == "range" and isinstance(s.target, ast.Name) and not s.orelse
            and 1 <= len(s.iter.args) <= 3 and not s.iter.keywords)


def find_warp_split(loop: ast.For) -> WarpSplit | None:
    """The split of a parallel ``lk.range`` loop's body, or None when it does not have the
    shape described in the module docstring."""
    body = loop.body
    inner_at = [k for k, s in enumerate(body) if isinstance(s, (ast.For, ast.While))]
    if len(inner_at) != 1 or not _is_plain_range(body[inner_at[0]]):
        return None
    k = inner_at[0]
    pre, inner, post = tuple(body[:k]), body[k], tuple(body[k + 1:])
    if _has(body, (ast.Break, ast.Return)) or _has(pre + post, ast.Continue):
        return None
    if _stores_array(pre + (inner,)) or _calls_outside_math(pre + (inner,)):
        return None
    if _has(pre, (ast.For, ast.While)):
        return None
    # names the inner loop assigns otherwise than with `+=` are lane-local; the `+=` targets
    # assigned before it are the accumulators
    plain, added = {inner.target.id}, []
    for c in ast.walk(ast.Module(body=list(inner.body), type_ignores=[])):
        if isinstance(c, (ast.Assign, ast.AnnAssign, ast.For, ast.NamedExpr)):
            targets = c.targets if isinstance(c, ast.Assign) else [c.target]
            plain |= {t.id for tt in targets for t in ast.walk(tt) if isinstance(t, ast.Name)}
        elif isinstance(c, ast.AugAssign):
            if isinstance(c.op, ast.Add):
                added.append((c.lineno, c.col_offset, c.target.id))
            else:
                plain.add(c.target.id)
    accs = [a for a in dict.fromkeys(name for _, _, name in sorted(added)) if a not in plain]
    if not accs or any(a not in _names(pre, ast.Store) for a in accs):
        return None                  # an accumulator from before the parallel loop: per-thread state
    if any(a in _names([inner.iter] + list(inner.body), ast.Load) for a in accs):
        return None                  # a partial sum read inside the loop
    if (plain - set(accs)) & _names(post, ast.Load):
        return None                  # a lane's last value used after the loop
    if not _fresh_each_trip(inner.body, {inner.target.id}, plain - {inner.target.id}):
        return None                  # a value carried from one inner iteration to the next
    return WarpSplit(pre, inner, post, tuple(accs))


def _fresh_each_trip(stmts, assigned: set, local: set) -> bool:
    """Whether every read of a name in ``local`` (the names the inner loop assigns) in
    ``stmts`` follows an assignment of it in the same trip, on every path (``assigned``: the
    names assigned so far). A lane runs every 32nd trip only, so a name read before it is
    assigned (``prev = a[j]`` read in the next trip, ``w *= 0.5``) would carry another trip's
    value. Conservative: an assignment inside an ``if`` counts only inside that branch."""
    assigned = set(assigned)
    for st in stmts:
        if isinstance(st, ast.If):
            if _names([st.test], ast.Load) & local - assigned:
                return False
            if not (_fresh_each_trip(st.body, assigned, local) and _fresh_each_trip(st.orelse, assigned, local)):
                return False
            continue
        if isinstance(st, (ast.For, ast.While)):
            head = [st.iter] if isinstance(st, ast.For) else [st.test]
            if _names(head, ast.Load) & local - assigned:
                return False
            inside = assigned | (_names([st.target], ast.Store) if isinstance(st, ast.For) else set())
            # (a nested loop's own trips: what it reads must be assigned earlier in its body)
            if not _fresh_each_trip(st.body, inside, local):
                return False
            continue
        if isinstance(st, ast.AugAssign):
            reads = _names([st.value, st.target], ast.Load) | ({st.target.id} if isinstance(st.target, ast.Name) else set())
            stores = _names([st.target], ast.Store)
        else:
            value = getattr(st, "value", None)
            targets = st.targets if isinstance(st, ast.Assign) else [getattr(st, "target", None)]
            reads = _names([x for x in [value, *targets] if x is not None], ast.Load)
            stores = _names([t for t in targets if t is not None], ast.Store)
        if reads & local - assigned:
            return False
        assigned |= stores
    return True


def step_has_warp_split(fs) -> bool:
    """Whether any parallel ``lk.range`` loop of the step has the warp-split shape."""
    for n in ast.walk(ast.Module(body=list(fs.body), type_ignores=[])):
        if isinstance(n, ast.For) and isinstance(n.iter, ast.Call) and isinstance(n.iter.func, ast.Name) \
                and n.iter.func.id == INTRINSIC_PREFIX + "range" and find_warp_split(n) is not None:
            return True
    return False
