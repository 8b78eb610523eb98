"""``kernel.sharded(mesh, in_specs)``: a stencil megakernel over fields split across devices.

The fields are split into blocks over a JAX mesh (``jax.shard_map``); every shard runs the same
generated step (``loopkern/sharding.py``) as a ``kernel.jax`` call on a *window*: its block
plus a halo. Between launches of K steps the shards exchange the cells the halos need with
``lax.ppermute``. The windows are the carry of a ``lax.while_loop`` (one per run), so the
halos are updated in place and a block is copied into its window once per run, not per
exchange. Reductions in a returned condition are combined across shards with
``psum``/``pmax``/``pmin`` after each launch and the condition is evaluated on the result, so
every shard stops after the same step.

Placement along a split dimension of P shards with halo h = K*r (r: the step's reach) and
blocks of n cells: periodic dimensions give every shard the window [start - h, end + h) and
exchange h cells with each neighbour; dimensions with edges give the first shard [0, n + 2h),
the last [N - n - 2h, N) and the others [start - h, end + h), so the step's treatment of the
field's edges applies where the field has them, and exchange 2h cells (the edge shards take
their extra cells from one neighbour). ``lo`` (the block's offset in the window) is h, 0 or 2h
accordingly.
"""

from __future__ import annotations

import ast
import operator

import numpy as np

from ..errors import ArgumentError, LoopkernError
from ..sharding import (CPU_COSTS, GPU_COSTS, accumulator_kinds, choose_exchange_every, chunk_step, halo_widths,
                        max_exchange_every, model_step_time, plan_sharding, slab_width)


def _mesh_types():
    import jax
    return jax.sharding.Mesh, jax.sharding.PartitionSpec


def _normalize_specs(mk, mesh, in_specs):
    """Per parameter: a tuple of mesh axis names (or None) per dimension for sharded arrays,
    None for replicated arrays and scalars."""
    Mesh, P = _mesh_types()
    spec = mk.spec
    names = spec.param_names
    if not isinstance(mesh, Mesh):
        raise ArgumentError(f"{spec.name}.sharded(): mesh must be a jax.sharding.Mesh (jax.make_mesh(...)), got "
                            f"{type(mesh).__name__}")
    if isinstance(in_specs, P) or in_specs is None:
        per = {n: in_specs for n, p in zip(names, spec.params) if p.kind == "array"}
    elif isinstance(in_specs, dict):
        unknown = set(in_specs) - set(names)
        if unknown:
            raise ArgumentError(f"in_specs: {sorted(unknown)} are not parameters of '{spec.name}' {list(names)}")
        per = dict(in_specs)
    elif isinstance(in_specs, (tuple, list)):
        if len(in_specs) != len(names):
            raise ArgumentError(f"in_specs: expected one entry per parameter after '{spec.index_param}' "
                                f"({len(names)}: {list(names)}), got {len(in_specs)}")
        per = dict(zip(names, in_specs))
    else:
        raise ArgumentError(f"in_specs: expected a PartitionSpec, or one per parameter (a tuple or a dict by "
                            f"name), got {type(in_specs).__name__}")
    out = {}
    used_by = {}
    for a, (n, p) in enumerate(zip(names, spec.params)):
        s = per.get(n)
        if s is None or (isinstance(s, P) and all(x is None for x in s)):
            continue
        if not isinstance(s, P):
            raise ArgumentError(f"in_specs['{n}']: expected a PartitionSpec or None, got {type(s).__name__}")
        if p.kind != "array":
            raise ArgumentError(f"in_specs['{n}']: '{n}' is a scalar; scalars are replicated (give None or P())")
        axes = []
        for d, x in enumerate(s):
            if isinstance(x, tuple):
                if len(x) != 1:
                    raise ArgumentError(f"in_specs['{n}']: dimension {d} is split over several mesh axes {x}; "
                                        f"split each dimension over at most one")
                x = x[0]
            if x is not None and x not in mesh.axis_names:
                raise ArgumentError(f"in_specs['{n}']: '{x}' is not an axis of the mesh {mesh.axis_names}")
            if x is not None and used_by.setdefault(x, d) != d:
                raise ArgumentError(f"in_specs['{n}']: mesh axis '{x}' splits dimension {used_by[x]} of another "
                                    f"array and dimension {d} here; the fields must be split alike")
            axes.append(x)
        out[a] = tuple(axes)
    if not out:
        raise ArgumentError(f"{spec.name}.sharded(): in_specs splits no array over the mesh")
    return out


class ShardedKernel:
    """A megakernel's step run over fields split across the devices of a mesh.

    Made by :meth:`loopkern.MegaKernel.sharded`; called like ``kernel.jax`` (JAX arrays in, new
    JAX arrays out, eager or inside ``jax.jit``). ``last_plan`` describes the latest call's
    geometry: K, halos, window shape and the cost model's figures.
    """

    def __init__(self, mk, mesh, in_specs, *, exchange_every=None, radius=None, costs=None):
        self.mk, self.mesh = mk, mesh
        self.axes_of = _normalize_specs(mk, mesh, in_specs)
        if exchange_every is not None and (isinstance(exchange_every, bool) or not isinstance(exchange_every, int)
                                           or exchange_every < 1):
            raise ArgumentError(f"exchange_every={exchange_every!r}: expected an int >= 1 (steps between halo "
                                f"exchanges) or None (chosen by the cost model)")
        self.exchange_every = exchange_every
        self.costs = costs
        parsed = mk.parsed
        plan = self.plan = plan_sharding(parsed, mk.spec, self._split_dims(), radius)
        self.axes = tuple(next((axes[k] for axes in self.axes_of.values() if k < len(axes) and axes[k]), None)
                          for k in range(plan.ndim))
        for a, axes in self.axes_of.items():
            full = tuple(axes) + (None,) * (plan.ndim - len(axes))
            if len(axes) > plan.ndim or full != self.axes:
                raise ArgumentError(f"in_specs['{mk.spec.param_names[a]}']: {axes} splits the field differently "
                                    f"from the other sharded arrays {self.axes} (the step's index space has "
                                    f"{plan.ndim} dimensions); split every field alike")
        self.parsed = parsed
        self._calls = {}
        self._chosen = {}       # the cost model's K per (block, parts, itemsize, costs)
        self.last_plan = None

    def _split_dims(self):
        """Per sharded array, whether each dimension of its spec is split."""
        return {a: tuple(x is not None for x in axes) for a, axes in self.axes_of.items()}

    def __repr__(self):
        return f"<sharded megakernel '{self.mk.spec.name}' over mesh axes {self.axes}>"

    # -- calling -------------------------------------------------------------------------------
    def __call__(self, *args, steps=None, max_steps=None, start=0, **kwargs):
        """Run the step over the sharded fields.

        Args:
            *args, **kwargs: the step's parameters after ``t``, as for ``kernel.jax``: JAX arrays
                (global arrays; placed on the mesh as ``in_specs`` says, a copy when they are
                not already) and numbers or 0-d arrays.
            steps / max_steps: the step count (``max_steps`` for a step that returns a
                condition). ints or 0-d integer arrays, traced too.
            start: the index of the first step.

        Returns:
            A tuple with one new array per array parameter, in parameter order (sharded as
            ``in_specs`` says), and, for a step that returns a condition, the number of steps
            run (int32). The condition is checked after every launch of K steps, on the
            values combined across shards: the run stops after the first multiple of K (or at
            ``max_steps``) where it is false. With nothing split (a mesh of one device along
            the split axes) it is the single-device run, checked every step.
        """
        import jax

        from .jax_bridge import _prepare, _step_count
        mk, plan = self.mk, self.plan
        spec = mk.spec
        arrays, values, sig, (nsteps, n_dtype) = _prepare(mk, args, kwargs, steps, max_steps)
        t0, t0_dtype = _step_count("start", start)
        shape = None
        for a in self.axes_of:
            shp = sig[a][0]
            if len(shp) != plan.ndim:
                raise ArgumentError(f"argument '{spec.param_names[a]}': the step's index space has {plan.ndim} "
                                    f"dimensions, the array {len(shp)}; kernel.sharded splits arrays of that many")
            if shape is None:
                shape = shp
            elif shp != shape:
                raise ArgumentError(f"argument '{spec.param_names[a]}': shape {shp} differs from the other sharded "
                                    f"arrays' {shape}; the sharded fields must have one shape")
        parts = tuple(self.mesh.shape[x] if x is not None else 1 for x in self.axes)
        for k, (n, p) in enumerate(zip(shape, parts)):
            if n % p:
                raise ArgumentError(f"the sharded arrays' dimension {k} has {n} cells, not a multiple of the "
                                    f"{p} shards of mesh axis '{self.axes[k]}'")
        block = tuple(n // p for n, p in zip(shape, parts))
        itemsize = max(np.dtype(sig[a][1]).itemsize for a in self.axes_of)
        platform = self._platform()
        costs = self.costs or (GPU_COSTS if platform == "cuda" else CPU_COSTS)
        split = any(p > 1 for p in parts)
        top = max_exchange_every(plan, block, parts)
        if not split:
            k_steps = None
        elif self.exchange_every is not None:
            k_steps = self.exchange_every
            if top is not None and k_steps > top:
                raise ArgumentError(f"exchange_every={k_steps}: blocks of {block} cells allow at most {top} steps "
                                    f"between exchanges (a neighbour must hold the {self._slab_text()} it sends)")
        elif top is not None and top < 1:
            k_steps = 0
        else:
            # up to thousands of model evaluations: once per geometry, not per call
            got = (block, parts, itemsize, costs)
            if got not in self._chosen:
                self._chosen[got] = choose_exchange_every(plan, block, parts, itemsize, costs)
            k_steps = self._chosen[got]
        if k_steps == 0:
            r = max(plan.radius)
            raise ArgumentError(f"blocks of {block} cells are thinner than one step's halo exchange needs "
                                f"({self._slab_text()} of radius {r}); use fewer shards or a larger field")
        halo = halo_widths(plan, k_steps, parts) if split else (0,) * plan.ndim
        self.last_plan = dict(
            exchange_every=k_steps, parts=parts, block=block, halo=halo,
            window=tuple(n + 2 * h for n, h in zip(block, halo)), radius=plan.radius, periodic=plan.periodic,
            modelled_step_s=model_step_time(plan, block, parts, k_steps, itemsize, costs) if split else None)
        kinds = {a: np.dtype(dt).kind for a, (_, dt) in enumerate(sig)}
        key = (sig, n_dtype, t0_dtype, k_steps, parts)
        fn = self._calls.get(key)
        if fn is None:
            fn = self._calls[key] = self._build(sig, block, parts, halo, k_steps, kinds)
        inputs = [jax.numpy.asarray(nsteps, n_dtype), jax.numpy.asarray(t0, t0_dtype)]
        for a, v in enumerate(values):
            inputs.append(self._place(v, a) if a in arrays else jax.numpy.asarray(v, sig[a][1]))
        return fn(*inputs)

    def _slab_text(self):
        return "slab of twice the halo" if not all(self.plan.periodic) else "halo"

    def _platform(self):
        plats = {d.platform for d in self.mesh.devices.flat}
        if len(plats) != 1:
            raise ArgumentError(f"the mesh mixes platforms {sorted(plats)}")
        p = plats.pop()
        return "cuda" if p in ("gpu", "cuda") else p

    def _spec_of(self, a):
        _, P = _mesh_types()
        axes = self.axes_of.get(a)
        return P(*axes) if axes is not None else P()

    def _place(self, x, a):
        import jax
        from jax.sharding import NamedSharding
        want = NamedSharding(self.mesh, self._spec_of(a))
        explicit = any(str(t).endswith("Explicit") for t in getattr(self.mesh, "axis_types", ()))
        if explicit:
            return jax.reshard(x, want)
        if isinstance(x, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(x, want)
        return x if x.sharding == want else jax.device_put(x, want)

    # -- building --------------------------------------------------------------------------------
    def _build(self, sig, block, parts, halo, k_steps, kinds):
        import jax
        import jax.numpy as jnp
        from jax import lax

        _, P = _mesh_types()
        mk, plan, mesh = self.mk, self.plan, self.mesh
        spec = mk.spec
        nparams = len(spec.params)
        arr_idx = [a for a in range(nparams) if sig[a][0] is not None]
        sharded = sorted(self.axes_of)
        slot_kinds = accumulator_kinds(plan, spec, kinds)
        cond = plan.condition
        with_count = bool(spec.returns_condition)
        axes = self.axes
        split_axes = tuple(x for x, p in zip(axes, parts) if p > 1)
        in_specs = (P(), P()) + tuple(self._spec_of(a) if a in self.axes_of else P() for a in range(nparams))
        out_specs = tuple(self._spec_of(a) for a in arr_idx) + ((P(),) if with_count else ())

        if k_steps is None:
            # nothing is split: every shard holds the whole field; the step runs as it is
            def local(n, t0, *vals):
                return tuple(mk.jax(*vals, start=t0, **{"max_steps" if with_count else "steps": n}))
            fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
            return jax.jit(fn)

        ck = _chunk_kernel(mk, self.parsed, plan, slot_kinds)
        float_dt = _float_dtype(sig, sharded)
        int_dt = jnp.dtype(jax.dtypes.canonicalize_dtype(np.int64))
        nslots = max(len(plan.slots), 1)
        win = Windows(plan, block, halo, parts, axes)

        combine = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}

        def local(n, t0, *vals):
            lo = win.offsets()
            wins = {a: win.to_window(vals[a], lo) for a in sharded}
            for a in plan.fixed:
                wins[a] = win.exchange(wins[a], lo)
            bounds = []
            for k in range(plan.ndim):
                bounds += [lo[k], lo[k] + block[k]]
            state = list(plan.state)

            def body(carry):
                done, _, ws = carry
                cur = dict(zip(state, ws))
                for a in state:
                    cur[a] = win.exchange(cur[a], lo)
                kk = jnp.minimum(jnp.asarray(k_steps, n.dtype), n - done)
                argv = [cur.get(a, wins.get(a, vals[a])) if a in self.axes_of else vals[a] for a in range(nparams)]
                argv += bounds
                if cond is not None:
                    argv += [jnp.zeros((nslots,), float_dt), jnp.zeros((nslots,), int_dt)]
                outs = ck.jax(*argv, steps=kk, start=t0 + done)
                new = dict(zip(arr_idx + ([nparams, nparams + 1] if cond is not None else []), outs))
                go = jnp.bool_(True)
                if cond is not None:
                    env = {p.name: vals[a] for a, p in enumerate(spec.params) if p.kind == "scalar"}
                    env[spec.index_param] = t0 + done + kk - 1
                    for j, ((op, _), name) in enumerate(zip(plan.slots, plan.slot_names)):
                        buf = new[nparams + 1] if slot_kinds[j] == "i" else new[nparams]
                        v = buf[j]
                        env[name] = combine[op](v, split_axes) if split_axes else v
                    go = jnp.asarray(_evaluate(cond, env)).astype(bool).reshape(())
                return done + kk, go, tuple(new[a] for a in state)

            def more(carry):
                done, go, _ = carry
                return (done < n) & go

            done, _, ws = lax.while_loop(more, body, (jnp.zeros((), n.dtype), jnp.bool_(True),
                                                      tuple(wins[a] for a in state)))
            final = dict(zip(state, ws))
            outs = tuple(win.from_window(final[a], lo) if a in final else vals[a] for a in arr_idx)
            return outs + ((done.astype(jnp.int32),) if with_count else ())

        fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        return jax.jit(fn)


class Windows:
    """A shard's window along the split dimensions: where its block sits in it, and the halo
    exchange (see the module docstring). ``permute(x, axis, pairs)`` and ``index(axis)`` default
    to ``lax.ppermute`` and ``lax.axis_index`` (inside ``shard_map``); bench/sharded.py passes
    stand-ins to time one shard's work on one device."""

    def __init__(self, plan, block, halo, parts, axes, permute=None, index=None):
        from jax import lax
        self.plan, self.block, self.halo, self.parts, self.axes = plan, block, halo, parts, axes
        self.window = tuple(n + 2 * h for n, h in zip(block, halo))
        self.permute = permute or lax.ppermute
        self.index = index or lax.axis_index

    def offsets(self):
        """Per dimension, the block's offset in the window (traced: it depends on the shard)."""
        import jax.numpy as jnp
        out = []
        for k, (h, p) in enumerate(zip(self.halo, self.parts)):
            if not h:
                out.append(jnp.int32(0))
            elif self.plan.periodic[k]:
                out.append(jnp.int32(h))
            else:
                i = self.index(self.axes[k])
                out.append(jnp.where(i == 0, 0, jnp.where(i == p - 1, 2 * h, h)).astype(jnp.int32))
        return out

    def exchange(self, win, lo):
        """``win`` with its halos refreshed from the neighbours' blocks."""
        import jax.numpy as jnp
        from jax import lax
        plan = self.plan
        for k, (h, p) in enumerate(zip(self.halo, self.parts)):
            if not h:
                continue
            w = slab_width(plan, k, h)
            n, size = self.block[k], self.window[k]
            first = lax.dynamic_slice_in_dim(win, lo[k], w, axis=k)
            last = lax.dynamic_slice_in_dim(win, lo[k] + n - w, w, axis=k)
            right = [(i, i + 1) for i in range(p - 1)] + ([(p - 1, 0)] if plan.periodic[k] else [])
            left = [(i + 1, i) for i in range(p - 1)] + ([(0, p - 1)] if plan.periodic[k] else [])
            from_left = self.permute(last, self.axes[k], right)      # the left neighbour's last cells
            from_right = self.permute(first, self.axes[k], left)     # the right neighbour's first cells
            below = jnp.concatenate([from_left, first], axis=k)     # [start - w, start + w)
            above = jnp.concatenate([last, from_right], axis=k)     # [end - w, end + w)
            win = lax.dynamic_update_slice_in_dim(win, lax.dynamic_slice_in_dim(below, w - lo[k], w, axis=k),
                                                  0, axis=k)
            win = lax.dynamic_update_slice_in_dim(win, lax.dynamic_slice_in_dim(above, size - n - lo[k], w,
                                                                                axis=k), size - w, axis=k)
        return win

    def to_window(self, x, lo):
        import jax.numpy as jnp
        from jax import lax
        return lax.dynamic_update_slice(jnp.zeros(self.window, x.dtype), x, tuple(lo))

    def from_window(self, win, lo):
        from jax import lax
        return lax.dynamic_slice(win, tuple(lo), self.block)


def _float_dtype(sig, sharded):
    """The float type the generated step's float locals take: the sharded arrays' (loopkern's
    weak floats), the canonical float otherwise."""
    import jax
    for a in sharded:
        dt = np.dtype(sig[a][1])
        if dt.kind == "f":
            return dt
    return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))


def _chunk_kernel(mk, parsed, plan, kinds):
    """The MegaKernel of the shard's step (:func:`loopkern.sharding.chunk_step`), cached on
    ``mk`` per plan and slot kinds."""
    from ..api import MegaKernel
    cache = mk.__dict__.setdefault("_chunk_kernels", {})
    key = (plan, tuple(kinds))
    if key not in cache:
        step, _, _, _ = chunk_step(parsed, plan, kinds)
        names = mk.spec.param_names
        d = mk.dispatcher.defaults
        cache[key] = MegaKernel(step, swap=[(names[a], names[b]) for a, b in mk.spec.swap], backend=d["backend"],
                                scope=d["scope"], threads=d["threads"], blocks=d["blocks"])
    return cache[key]


_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq,
        ast.NotEq: operator.ne}


def _evaluate(e, env):
    """The returned condition (checked by ``plan_sharding``: numbers, names, arithmetic,
    comparisons, ``and``/``or``/``not``, conditional expressions, abs/min/max/int/float/bool)
    evaluated on JAX values."""
    import jax.numpy as jnp
    if isinstance(e, ast.Constant):
        return e.value
    if isinstance(e, ast.Name):
        return env[e.id]
    if isinstance(e, ast.BinOp):
        return _BIN[type(e.op)](_evaluate(e.left, env), _evaluate(e.right, env))
    if isinstance(e, ast.UnaryOp):
        v = _evaluate(e.operand, env)
        if isinstance(e.op, ast.Not):
            return jnp.logical_not(v)
        return -v if isinstance(e.op, ast.USub) else v
    if isinstance(e, ast.Compare):
        out, left = None, _evaluate(e.left, env)
        for op, c in zip(e.ops, e.comparators):
            right = _evaluate(c, env)
            r = _CMP[type(op)](left, right)
            out = r if out is None else jnp.logical_and(out, r)
            left = right
        return out
    if isinstance(e, ast.BoolOp):
        vals = [jnp.asarray(_evaluate(v, env)).astype(bool) for v in e.values]
        f = jnp.logical_and if isinstance(e.op, ast.And) else jnp.logical_or
        out = vals[0]
        for v in vals[1:]:
            out = f(out, v)
        return out
    if isinstance(e, ast.IfExp):
        return jnp.where(_evaluate(e.test, env), _evaluate(e.body, env), _evaluate(e.orelse, env))
    if isinstance(e, ast.Call):
        args = [_evaluate(a, env) for a in e.args]
        f = e.func.id
        if f == "abs":
            return jnp.abs(args[0])
        if f in ("min", "max"):
            out = args[0]
            for a in args[1:]:
                out = (jnp.minimum if f == "min" else jnp.maximum)(out, a)
            return out
        if isinstance(args[0], (int, float, bool)):
            return {"bool": bool, "float": float, "int": int}[f](args[0])
        return jnp.asarray(args[0]).astype({"bool": bool, "float": float, "int": int}[f])
    raise LoopkernError(f"kernel.sharded: internal error: cannot evaluate {ast.dump(e)}")

