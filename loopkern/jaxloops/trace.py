"""Trace a JAX loop body to a flat program: every ``jit``/``pjit``, ``custom_jvp_call`` and
``custom_vjp_call`` inlined, each ``cond`` (``lax.cond``/``lax.switch``) turned into its
inlined branches and a ``select_n`` per result, each ``argmax``/``argmin`` into two
reductions (:func:`_arg_reduction`), every value a :class:`Var` (shape, dtype,
weak type, defining equation, use count) or a :class:`Lit` (a scalar constant).

Only JAX is imported here (at call time); nothing is compiled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

#: primitives whose sub-jaxpr is inlined (the parameter holding it)
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
          "custom_lin": None}


@dataclass(eq=False)
class Var:
    """One array value of the program."""
    shape: tuple
    dtype: np.dtype
    weak: bool
    id: int
    eqn: "Eqn | None" = None
    uses: int = 0

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self):
        return f"v{self.id}:{self.dtype}{list(self.shape)}"


@dataclass(eq=False)
class Lit:
    """A scalar constant (a jaxpr literal, or a small concrete constant)."""
    value: np.ndarray
    shape: tuple = ()

    @property
    def dtype(self):
        return self.value.dtype


@dataclass(eq=False)
class Eqn:
    prim: str
    params: dict
    ins: list
    outs: list
    where: str = ""


@dataclass(eq=False)
class Program:
    """A flat program: inputs, equations in order, outputs, and the closed-over constants.

    ``consts`` are (Var, value) pairs: arrays (or tracers) the body closed over; their values
    are passed to the kernel as parameters.
    """
    invars: list
    eqns: list
    outs: list
    consts: list = field(default_factory=list)


class Unsupported(Exception):
    """An equation outside the supported subset: ``prim`` and ``where`` (its source line:
    a :class:`Where`, or a string)."""

    def __init__(self, prim: str, where, reason: str = ""):
        self.prim, self.where, self.reason = prim, where, reason
        super().__init__(f"{prim} at {where}" + (f": {reason}" if reason else ""))


@dataclass(frozen=True)
class Where:
    """The user's line an equation comes from."""
    file: str
    line: int
    col: int
    function: str
    text: str

    def __str__(self):
        return self.text


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _where(eqn):
    try:
        from jax._src import source_info_util
        text = source_info_util.summarize(eqn.source_info)
        frame = source_info_util.user_frame(eqn.source_info.traceback) if hasattr(
            source_info_util, "user_frame") else None
        if frame is not None and frame.file_name.startswith(_PACKAGE):
            # loopkern's own wrapping of the body (the carry's keys made keys again)
            return Where("<carry>", 0, 0, "", "the loop's carry (or scan's xs)")
        if frame is not None:
            return Where(frame.file_name, int(frame.start_line), int(getattr(frame, "start_column", 0) or 0),
                         frame.function_name, text)
        return Where("<unknown>", 0, 0, "", text)
    except Exception:   # pragma: no cover - a JAX without it
        return Where("<unknown>", 0, 0, "", "<unknown>")


def _arg_reduction(name, x, axis, index_dtype, where, emit):
    """``argmax``/``argmin`` of ``x`` along ``axis`` in primitives the lowering supports: the
    extreme value ``m`` (a reduction), then the least index whose element equals ``m`` (a second
    one), so ties give the first index, as in JAX; with a NaN present the extreme is NaN and
    the first NaN's index is returned, as JAX does."""
    shape = x.shape
    kept = [d for d in range(len(shape)) if d != axis]
    rest = tuple(shape[d] for d in kept)
    extreme = emit("reduce_max" if name == "argmax" else "reduce_min", {"axes": (axis,), "out_sharding": None}, [x],
                   rest, x.dtype, where)
    spread = emit("broadcast_in_dim", {"shape": shape, "broadcast_dimensions": tuple(kept), "sharding": None},
                  [extreme], shape, x.dtype, where)
    hit = emit("eq", {}, [x, spread], shape, np.bool_, where)
    if x.dtype.kind == "f":
        x_nan = emit("ne", {}, [x, x], shape, np.bool_, where)
        m_nan = emit("ne", {}, [spread, spread], shape, np.bool_, where)
        both = emit("and", {}, [x_nan, m_nan], shape, np.bool_, where)
        hit = emit("or", {}, [hit, both], shape, np.bool_, where)
    index = emit("iota", {"dtype": index_dtype, "shape": shape, "dimension": axis, "sharding": None}, [], shape,
                 index_dtype, where)
    past = Lit(np.asarray(shape[axis], dtype=index_dtype))
    chosen = emit("select_n", {}, [hit, past, index], shape, index_dtype, where)
    return emit("reduce_min", {"axes": (axis,), "out_sharding": None}, [chosen], rest, index_dtype, where)


def take(emit, x, axis: int, k: int, where):
    """Index ``k`` of ``x`` along ``axis`` (a slice and a squeeze, emitted by ``emit`` as in
    :func:`flatten`): a Var of x's shape without that axis, x's weak type kept."""
    lo = tuple(k if d == axis else 0 for d in range(len(x.shape)))
    hi = tuple(k + 1 if d == axis else n for d, n in enumerate(x.shape))
    part = emit("slice", {"start_indices": lo, "limit_indices": hi, "strides": None}, [x],
                tuple(h - a for a, h in zip(lo, hi)), x.dtype, where)
    one = emit("squeeze", {"dimensions": (axis,)}, [part], tuple(n for d, n in enumerate(x.shape) if d != axis),
               x.dtype, where)
    one.weak = x.weak
    return one


def _is_literal(a) -> bool:
    return type(a).__name__ == "Literal"


def flatten(closed) -> Program:
    """The :class:`Program` of a ``ClosedJaxpr``, calls inlined."""
    counter = [0]

    from . import conv, prng

    def new_var(aval, where=None):
        """A new Var of ``aval``'s shape and type; for a PRNG key array, the :class:`prng.Keys`
        of two new Vars (its words)."""
        if prng.key_impl(aval) is not None:
            shape = prng.check_impl(aval, where if where is not None else "the loop's carry")
            counter[0] += 2
            return prng.Keys(Var(shape, prng.U32, False, counter[0] - 1), Var(shape, prng.U32, False, counter[0]),
                             shape)
        try:
            dtype = np.dtype(aval.dtype)
        except TypeError:       # another of JAX's extended types
            raise Unsupported(f"values of type {aval.dtype}", where if where is not None else "the loop's carry",
                              "loopkern compiles numbers, arrays of numbers and jax.random keys") from None
        counter[0] += 1
        return Var(tuple(int(d) for d in aval.shape), dtype, bool(getattr(aval, "weak_type", False)), counter[0])

    eqns: list = []
    consts: list = []
    const_vals: dict = {}       # Var -> the closed-over value (to fold a convolution's kernel)
    sink = [eqns]       # where equations go: the program, or the body of a nested loop

    def atom(env, a):
        if _is_literal(a):
            return Lit(np.asarray(a.val, dtype=a.aval.dtype))
        return env[a]

    def run(jaxpr, env, outer=None):
        for e in jaxpr.eqns:
            name = e.primitive.name
            where = _where(e)
            if outer is not None and (not where.line or not where.text):
                where = outer
            if name in prng.PRNG_PRIMS:
                outs = prng.lower_prng(e, [atom(env, a) for a in e.invars], emit, where)
                for o, nv in zip(e.outvars, outs):
                    if type(o).__name__ != "DropVar":
                        env[o] = nv
                continue
            if name == "random_gamma":
                # gamma and the draws built on it (beta, dirichlet, chisquare, t, loggamma):
                # JAX's own sampler, inlined
                outs = inline(prng.gamma_jaxpr(e, where), [atom(env, a) for a in e.invars], where)
                env.update(zip(e.outvars, outs))
                continue
            if name == "conv_general_dilated":
                env[e.outvars[0]] = conv.lower_conv(e, [atom(env, a) for a in e.invars], emit, where, const_vals)
                continue
            if name == "unstack":
                # lax.unstack (how some JAX versions iterate over an array: ``a, b = keys``):
                # one slice and squeeze per result, on the value as the program holds it (a key
                # array's words keep their trailing axis)
                x, axis = atom(env, e.invars[0]), int(e.params["axis"])
                for k, o in enumerate(e.outvars):
                    if type(o).__name__ != "DropVar":
                        env[o] = (prng.Keys(*(take(emit, w, axis, k, where) for w in x.words),
                                            tuple(n for d, n in enumerate(x.shape) if d != axis))
                                  if isinstance(x, prng.Keys) else take(emit, x, axis, k, where))
                continue
            if name in _CALLS and _CALLS[name] is not None and _CALLS[name] in e.params:
                outs = inline(e.params[_CALLS[name]], [atom(env, a) for a in e.invars], where)
                env.update(zip(e.outvars, outs))
                continue
            if name in ("argmax", "argmin") and len(e.params["axes"]) == 1:
                env[e.outvars[0]] = _arg_reduction(name, atom(env, e.invars[0]), e.params["axes"][0],
                                                   np.dtype(e.params["index_dtype"]), where, emit)
                continue
            if name == "cond":
                # lax.cond / lax.switch: every branch inlined, each result a select_n on the
                # branch index. The branches are pure functions of the operands, so computing
                # the one not taken changes nothing but the work done (a branch's own
                # unsupported primitive still falls back, naming itself) -- except a
                # while_loop in it, which need not end for the operands of a branch not
                # taken: it runs while its branch is the one taken (guards below)
                which = atom(env, e.invars[0])
                taken = []
                for k, br in enumerate(e.params["branches"]):
                    guards.append(branch_guard(which, k, where))
                    try:
                        taken.append(inline(br, [atom(env, a) for a in e.invars[1:]], where))
                    finally:
                        guards.pop()
                picks = prng.flat(results(e, env))
                for k, nv in enumerate(picks):
                    eq = Eqn("select_n", {}, [which] + [prng.flat(outs_of)[k] for outs_of in taken], [nv], where)
                    nv.eqn = eq
                    sink[-1].append(eq)
                continue
            if nested_loop(e, env, where):
                continue
            if name == "custom_linear_solve":
                # the forward value is the solve function applied to b (the other three
                # functions are for derivatives, which run through jax.lax anyway)
                lens = e.params["const_lengths"]
                ins = [atom(env, a) for a in e.invars]
                start = lens.matvec + lens.vecmat
                outs = inline(e.params["jaxprs"].solve, ins[start:start + lens.solve] + ins[sum(lens):], where)
                env.update(zip(e.outvars, outs))
                continue
            ins = [atom(env, a) for a in e.invars]
            if any(prng.key_impl(v.aval) is not None for v in list(e.invars) + list(e.outvars)):
                for o, nv in zip(e.outvars, prng.on_keys(e, ins, emit, where)):
                    if type(o).__name__ != "DropVar":
                        env[o] = nv
                continue
            outs = results(e, env)
            eq = Eqn(name, dict(e.params), ins, outs, where)
            for nv in outs:
                nv.eqn = eq
            sink[-1].append(eq)

    guards: list = []       # per enclosing cond branch: the Var that is true where it is taken

    def branch_guard(which, k, where):
        """What says that branch ``k`` of a cond on ``which`` is taken (and so are the branches
        around it); :func:`guard_var` emits it as a bool Var where a while_loop reads it."""
        return (which, k, guards[-1] if guards else None, where)

    def guard_var(g):
        which, k, outer, where = g
        mine = emit("eq", {}, [which, Lit(np.asarray(k, dtype=which.dtype))], (), np.bool_, where)
        return mine if outer is None else emit("and", {}, [guard_var(outer), mine], (), np.bool_, where)

    def results(e, env, where=None):
        """New Vars for the results of the jaxpr equation ``e`` (``env`` maps those it names)."""
        outs = []
        for o in e.outvars:
            nv = new_var(o.aval, where if where is not None else _where(e))
            if type(o).__name__ != "DropVar":
                env[o] = nv
            outs.append(nv)
        return outs

    def inline(sub, args, where=None):
        """Run the (Closed)Jaxpr ``sub`` on the atoms ``args`` where equations go now: its
        outputs' atoms."""
        inner = getattr(sub, "jaxpr", sub)
        senv = {v: _const(v, c) for v, c in zip(inner.constvars, getattr(sub, "consts", ()))}
        senv.update(zip(inner.invars, args))
        run(inner, senv, where)
        return [atom(senv, o) for o in inner.outvars]

    def sub_program(closed, consts_in, carries):
        """Run the ClosedJaxpr ``closed`` whose first inputs are the atoms ``consts_in`` and the
        rest the new Vars ``carries`` into a list of its own: its equations and outputs."""
        sink.append([])
        outs = inline(closed, list(consts_in) + list(carries))
        return sink.pop(), outs

    def nested_loop(e, env, where):
        """A ``fori_loop``/``scan`` or a ``while_loop`` inside the body: one ``nested_loop``
        equation holding its body's (and condition's) equations, over Vars of its own for the
        carries (and, for a scan over ``xs``, for the slices of ``xs`` an iteration reads; its
        body's results are the new carries, then the slices of ``ys`` it writes). Its inputs are
        the initial carries, the ``xs``, then every outer Var the body or condition reads (so
        that stages, reductions and uses see them)."""
        name = e.primitive.name
        p = e.params
        # (a key array is its two words throughout: the loop carries each word)
        ins = [atom(env, a) for a in e.invars]
        xs, xs_vars = [], []
        if name == "scan":
            counts = _scan_counts(p)
            if counts is None:
                return False
            nc, nk = counts
            consts_in, inits, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
            inner = p["jaxpr"].jaxpr
            xs_vars = prng.flat(new_var(v.aval) for v in inner.invars[nc + nk:])
        elif name == "while":
            cc, bc = p["cond_nconsts"], p["body_nconsts"]
            consts_in, inits = ins[:cc + bc], ins[cc + bc:]
        else:
            return False
        carry_avals = [v.aval for v in e.outvars[:len(inits)]]
        carries = prng.flat(new_var(a) for a in carry_avals)
        inits, xs = prng.flat(inits), prng.flat(xs)
        if name == "scan":
            xs_avals = [v.aval for v in inner.invars[nc + nk:]]
            body, outs = sub_program(p["jaxpr"], consts_in,
                                     prng.unflat(carry_avals, carries) + prng.unflat(xs_avals, xs_vars))
            cond, test = [], None
        else:
            guard = guard_var(guards[-1]) if guards else None
            body, outs = sub_program(p["body_jaxpr"], consts_in[cc:], prng.unflat(carry_avals, carries))
            cond, (test,) = sub_program(p["cond_jaxpr"], consts_in[:cc], prng.unflat(carry_avals, carries))
            if guard is not None:
                # inside a cond's branch: no iteration where another branch is taken
                sink.append(cond)
                if test.shape:      # (a vmapped while_loop's condition per element)
                    guard = emit("broadcast_in_dim", {"shape": test.shape, "broadcast_dimensions": (),
                                                      "sharding": None}, [guard], test.shape, np.bool_, where)
                test = emit("and", {}, [test, guard], test.shape, np.bool_, where)
                sink.pop()
        inside = set(carries) | set(xs_vars) | {o for q in body + cond for o in q.outs}
        read = [a for q in body + cond for a in q.ins] + outs + [test]
        captured = list(dict.fromkeys(a for a in read if isinstance(a, Var) and a not in inside))
        outs = prng.flat(outs)
        res = prng.flat(results(e, env))
        eq = Eqn("nested_loop", {"kind": name, "length": p.get("length"), "carries": carries, "body": body,
                                 "outs": outs, "cond": cond, "test": test, "n_inits": len(inits),
                                 "xs_vars": xs_vars, "n_xs": len(xs), "n_ys": len(res) - len(inits),
                                 "reverse": bool(p.get("reverse", False))},
                 inits + xs + captured, res, where)
        for nv in res:
            nv.eqn = eq
        sink[-1].append(eq)
        return True

    def _const(v, c):
        if prng.key_impl(v.aval) is not None:
            # a closed-over key array: its words stacked as one uint32 constant (the launch
            # passes jax.random.key_data of it), split at the top of the program
            shape = prng.check_impl(v.aval, "a closed-over value")
            counter[0] += 1
            nv = Var(shape + (2,), prng.U32, False, counter[0])
            consts.append((nv, c))
            sink.append(eqns)
            try:
                return prng.unpack(nv, emit, "a closed-over value")
            finally:
                sink.pop()
        nv = new_var(v.aval)
        consts.append((nv, c))
        const_vals[nv] = c
        return nv

    def emit(prim, params, ins, shape, dtype, where):
        """A new equation of one result (``shape``, ``dtype``): its Var."""
        counter[0] += 1
        nv = Var(tuple(shape), np.dtype(dtype), False, counter[0])
        eq = Eqn(prim, params, list(ins), [nv], where)
        nv.eqn = eq
        sink[-1].append(eq)
        return nv

    env = {}
    jaxpr = closed.jaxpr
    for v, c in zip(jaxpr.constvars, closed.consts):
        env[v] = _const(v, c)
    invars = []
    for v in jaxpr.invars:
        if prng.key_impl(v.aval) is not None:       # (the loops pass keys as their words)
            raise Unsupported(f"values of type {v.aval.dtype}", "the loop's carry",
                              "an input of PRNG keys (pass jax.random.key_data(keys))")
        nv = new_var(v.aval)
        env[v] = nv
        invars.append(nv)
    run(jaxpr, env)
    outs = [atom(env, o) for o in jaxpr.outvars]
    if any(isinstance(o, prng.Keys) for o in outs):
        raise Unsupported("random_wrap", "the loop's results", "a result of PRNG keys (return "
                                                              "jax.random.key_data(keys))")
    prog = Program(invars, eqns, outs, consts)
    count_uses(prog)
    return prog


def _scan_counts(p):
    """(constants, carries) of a ``scan`` equation's inputs: JAX up to 0.10 names the counts
    (``num_consts``, ``num_carry``), JAX 0.11 gives a flat tree of the groups (``ft_in``, an
    ``FTTuple`` whose ``unpack()`` is constants, carries, xs, one leaf per value); None for any
    other form."""
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    groups = p.get("ft_in")
    if hasattr(groups, "unpack"):       # JAX's FTTuple (its len() counts the leaves)
        groups = groups.unpack()
    if isinstance(groups, tuple) and len(groups) == 3:
        try:
            return len(groups[0]), len(groups[1])
        except TypeError:
            return None
    return None


def walk_eqns(eqns):
    """Every equation, those of nested loops' bodies and conditions too."""
    for e in eqns:
        yield e
        if e.prim == "nested_loop":
            yield from walk_eqns(e.params["body"] + e.params["cond"])


def count_uses(prog: Program):
    """Set the ``uses`` of every Var the program defines (its inputs, constants, equations'
    results, nested loops' carries): the equations that read it, the program's outputs, and a
    nested loop's results (an outer Var that a nested loop reads counts twice: as the loop's
    input and in its body). Vars it reads but does not define (an enclosing program's, for the
    body of a nested loop) keep their counts."""
    every = list(walk_eqns(prog.eqns))
    defined = set(prog.invars) | {v for v, _ in prog.consts}
    for e in every:
        defined.update(e.outs)
        if e.prim == "nested_loop":
            defined.update(e.params["carries"] + e.params["xs_vars"])
    for v in defined:
        v.uses = 0

    def use(a):
        if isinstance(a, Var) and a in defined:
            a.uses += 1
    for e in every:
        for a in e.ins:
            use(a)
        if e.prim == "nested_loop":
            for a in e.params["outs"] + [e.params["test"]]:
                use(a)
    for o in prog.outs:
        use(o)


def clone_eqns(eqns, env: dict, new_id) -> list:
    """Copies of ``eqns`` over new Vars (ids from ``new_id()``), reading ``env[v]`` for each Var
    ``v`` that ``env`` maps; ``env`` gains each old result's copy. Nested loops are copied
    whole, their carries renamed too."""
    out = []
    for e in eqns:
        ins = [env.get(a, a) if isinstance(a, Var) else a for a in e.ins]
        params = dict(e.params)
        if e.prim == "nested_loop":
            carries = [Var(c.shape, c.dtype, c.weak, new_id()) for c in params["carries"]]
            xs_vars = [Var(c.shape, c.dtype, c.weak, new_id()) for c in params["xs_vars"]]
            sub = dict(env)
            sub.update(zip(params["carries"], carries))
            sub.update(zip(params["xs_vars"], xs_vars))
            body = clone_eqns(params["body"], sub, new_id)
            cond = clone_eqns(params["cond"], sub, new_id)
            params.update(carries=carries, xs_vars=xs_vars, body=body, cond=cond,
                          outs=[sub.get(o, o) if isinstance(o, Var) else o for o in params["outs"]],
                          test=sub.get(params["test"], params["test"]) if isinstance(params["test"], Var)
                          else params["test"])
        outs = [Var(o.shape, o.dtype, o.weak, new_id()) for o in e.outs]
        env.update(zip(e.outs, outs))
        q = Eqn(e.prim, params, ins, outs, e.where)
        for o in outs:
            o.eqn = q
        out.append(q)
    return out


def trace(fn, avals):
    """``jax.make_jaxpr(fn)(*avals)`` flattened (see :func:`flatten`); also returns the
    ``ClosedJaxpr`` and the output tree of ``fn``."""
    import jax
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*avals)
    return flatten(closed), closed, out_shape
