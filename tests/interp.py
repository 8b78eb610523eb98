"""A plain-Python reference interpreter of a loopkern step: the reference the differential tests
(tests/test_fuzz.py, tests/test_chunks.py, tests/gpu/test_fuzz_gpu.py) compare every backend with.

It runs the step's own source as ordinary Python and NumPy on ONE thread, with a reference ``lk``
namespace in place of loopkern's markers, and loops the steps the way README.md and
/work/shared/DESIGN.md define them:

- ``lk.range(a[, b[, c]])`` is ``range`` over the whole range; ``lk.grid(...)`` is
  ``itertools.product`` of ranges (each argument ``stop`` or ``(start, stop)``), yielding tuples;
  indices and ``t`` are ``np.int64`` (Numba's types), so mixed arithmetic promotes as it does there;
- ``lk.sync()`` does nothing; ``lk.sum/max/min(x)`` return ``x`` (one thread): a float keeps its
  float type, integers and bools become ``np.int64``;
- ``lk.thread_id()`` is 0 and ``lk.num_threads()`` 1;
- ``lk.atomic.add/max/min(a, index, value)`` read, modify and write ``a[index]``, returning the old
  value;
- ``lk.random.uniform/normal(key[, subkey])``: Philox4x32-10 written here again in plain Python
  integers (checked against Random123's known-answer vectors), fed with (seed, t, key, subkey, call
  site), the call sites numbered 1, 2, ... in source order of the step;
- Python floats take the arrays' precision (NumPy 2 / JAX weak typing): when every float array is
  float32, float literals in the step and its helpers and Python-float arguments become float32;
- ``return cond``: the loop continues while ``cond`` is true, up to the step count; no return (or
  a bare ``return``) means continue;
- ``swap`` pairs exchange names after every step; at the end of a call each name holds what it
  refers to after that many renames (after an odd count the two buffers' contents are exchanged).

Nothing here imports loopkern's code generator, compiler or runtime: the only thing taken from
loopkern is the identity of its marker objects (to find ``lk`` in the step's globals).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import math
import textwrap
import types
from dataclasses import dataclass

import numpy as np

# ------------------------------------------------------------------------ Philox4x32-10
_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_SITE_MUL = 0x85EBCA6B


def philox4x32_10(ctr, key):
    """Random123's Philox4x32-10 on a 4-word counter and a 2-word key (Python ints)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0 = _PHILOX_M0 * c0
        p1 = _PHILOX_M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> 32) ^ c3 ^ k1) & _MASK32, \
            p0 & _MASK32
        k0 = (k0 + _PHILOX_W0) & _MASK32
        k1 = (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def philox_words(seed, t, key, subkey, site):
    """The four words of one draw: counter (key lo, key hi, subkey, step), key (seed lo, seed hi
    mixed with the call site)."""
    seed, t, key, subkey, site = int(seed), int(t), int(key), int(subkey), int(site)
    ctr = (key & _MASK32, (key >> 32) & _MASK32, subkey & _MASK32, t & _MASK32)
    k = (seed & _MASK32, ((seed >> 32) ^ (site * _SITE_MUL)) & _MASK32)
    return philox4x32_10(ctr, k)


def ref_uniform(seed, t, key, subkey, site):
    a, b, _, _ = philox_words(seed, t, key, subkey, site)
    return ((a >> 5) * 67108864 + (b >> 6)) / 9007199254740992.0


def ref_normal(seed, t, key, subkey, site):
    _, _, c, d = philox_words(seed, t, key, subkey, site)
    u1 = (c + 1.0) / 4294967296.0
    u2 = d / 4294967296.0
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


# ------------------------------------------------------------------------ the reference lk
def _range(*args):
    return map(np.int64, range(*(int(a) for a in args)))


def _grid(*dims):
    ranges = []
    for d in dims:
        if isinstance(d, tuple):
            ranges.append(range(int(d[0]), int(d[1])))
        else:
            ranges.append(range(int(d)))
    return (tuple(np.int64(k) for k in idx) for idx in itertools.product(*ranges))


def _reduce(x):
    if isinstance(x, (bool, np.bool_, int, np.integer)):
        return np.int64(x)
    return x          # a float keeps its type (float, np.float32 or np.float64)


def _atomic(op):
    def f(a, index, value):
        old = a[index]
        a[index] = op(old, value)
        return old
    f.__name__ = op.__name__
    return f


def _not_here(name):
    def f(*args, **kwargs):
        raise AssertionError(f"interp: {name} should have been rewritten (a call site outside the step?)")
    return f


def make_lk():
    """The reference namespace that replaces ``loopkern`` in a step's globals."""
    return types.SimpleNamespace(
        range=_range, grid=_grid, sync=lambda: None,
        sum=_reduce, max=_reduce, min=_reduce,
        thread_id=lambda: 0, num_threads=lambda: 1,
        random=types.SimpleNamespace(uniform=_not_here("lk.random.uniform"), normal=_not_here("lk.random.normal")),
        atomic=types.SimpleNamespace(add=_atomic(lambda a, b: a + b), max=_atomic(lambda a, b: max(a, b)),
                                     min=_atomic(lambda a, b: min(a, b))),
    )


# ------------------------------------------------------------------------ rebuilding the step
def _loopkern_objects():
    import loopkern
    objs = {id(loopkern): "lk", id(loopkern.random): "random"}
    for name in ("range", "grid", "sync", "sum", "max", "min", "thread_id", "num_threads"):
        objs[id(getattr(loopkern, name))] = name
    for name in ("uniform", "normal"):
        objs[id(getattr(loopkern.random, name))] = "random." + name
    atomic = getattr(loopkern, "atomic", None)
    if atomic is not None:
        objs[id(atomic)] = "atomic"
        for name in ("add", "max", "min"):
            if hasattr(atomic, name):
                objs[id(getattr(atomic, name))] = "atomic." + name
    return objs


def _resolve(path, lk_ref):
    obj = lk_ref
    for part in path.split("."):
        obj = getattr(obj, part) if part != "lk" else lk_ref
    return obj


class _Transform(ast.NodeTransformer):
    """Float literals -> np.float32 (weak typing with float32 arrays); lk.random calls ->
    ``_lk_ref_draw(kind, t, key, subkey, site)``."""

    def __init__(self, float32, random_names, step_index):
        self.float32 = float32
        self.random_names = random_names     # dotted source text -> "uniform"/"normal"
        self.step_index = step_index
        self.sites = {}                      # (lineno, col) -> site number

    def visit_Constant(self, node):
        if self.float32 and isinstance(node.value, float):
            call = ast.Call(func=ast.Attribute(value=ast.Name(id="_lk_ref_np", ctx=ast.Load()), attr="float32",
                                               ctx=ast.Load()), args=[node], keywords=[])
            return ast.copy_location(call, node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        kind = self.random_names.get(ast.unparse(node.func))
        if kind is None:
            return node
        if self.step_index is None:
            raise AssertionError("interp: lk.random in a helper (loopkern rejects that)")
        args = list(node.args) + ([ast.Constant(0)] if len(node.args) == 1 else [])
        site = self.sites[(node.lineno, node.col_offset)]
        call = ast.Call(func=ast.Name(id="_lk_ref_draw", ctx=ast.Load()),
                        args=[ast.Constant(kind), ast.Name(id=self.step_index, ctx=ast.Load())] + args +
                             [ast.Constant(site)], keywords=[])
        return ast.copy_location(call, node)


class _Builder:
    """Rebuilds the step (and, recursively, the plain functions it calls) from source, with the
    reference ``lk`` in place of loopkern, one new globals dict per module."""

    def __init__(self, lk_ref, float32, seed):
        self.lk_ref = lk_ref
        self.float32 = float32
        self.seed = seed
        self.objs = _loopkern_objects()
        self.module_globals = {}     # id(original globals) -> new globals
        self.done = {}               # id(original function) -> rebuilt function

    def _draw(self, kind, t, key, subkey, site):
        f = ref_uniform if kind == "uniform" else ref_normal
        assert int(key) >= 0 and 0 <= int(subkey) < 2 ** 32, (key, subkey)
        return f(self.seed, t, key, subkey, site)

    def globals_for(self, g):
        new = self.module_globals.get(id(g))
        if new is None:
            new = dict(g)
            for name, val in g.items():
                path = self.objs.get(id(val))
                if path is not None:
                    new[name] = _resolve(path, self.lk_ref)
            new["_lk_ref_np"] = np
            new["_lk_ref_draw"] = self._draw
            self.module_globals[id(g)] = new
        return new

    def function(self, fn, is_step):
        if id(fn) in self.done:
            return self.done[id(fn)]
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
        fdef = tree.body[0]
        assert isinstance(fdef, ast.FunctionDef), src
        fdef.decorator_list = []
        g = self.globals_for(fn.__globals__)
        ns = dict(g)
        orig = dict(fn.__globals__)
        if fn.__closure__:
            cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
            orig.update(cells)
            ns.update({k: (_resolve(self.objs[id(v)], self.lk_ref) if id(v) in self.objs else v)
                       for k, v in cells.items()})
        # the spellings that reach lk.random: 'lk.random.uniform', 'random.uniform', ...
        random_names = {}
        for node in ast.walk(fdef):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                text = ast.unparse(node.func)
                try:
                    obj = eval(text, orig)
                except Exception:
                    continue
                path = self.objs.get(id(obj))
                if path in ("random.uniform", "random.normal"):
                    random_names[text] = path.split(".")[1]
        calls = sorted((n for n in ast.walk(fdef) if isinstance(n, ast.Call) and ast.unparse(n.func) in random_names),
                       key=lambda n: (n.lineno, n.col_offset))
        tr = _Transform(self.float32, random_names, fdef.args.args[0].arg if is_step else None)
        tr.sites = {(n.lineno, n.col_offset): k + 1 for k, n in enumerate(calls)}
        tree = ast.fix_missing_locations(tr.visit(tree))
        # helpers: plain functions the body calls, rebuilt the same way
        for node in ast.walk(fdef):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id != fdef.name:
                val = orig.get(node.id)
                if isinstance(val, types.FunctionType):
                    ns[node.id] = self.function(val, False)
        filename = fn.__code__.co_filename
        exec(compile(tree, filename, "exec"), ns)
        new = ns[fdef.name]
        self.done[id(fn)] = new
        return new


# ------------------------------------------------------------------------ running steps
@dataclass
class Result:
    steps: int
    stopped: str          # "steps" or "condition"
    next_start: int


def _float32_only(args):
    floats = {a.dtype for a in args if isinstance(a, np.ndarray) and a.dtype.kind == "f"}
    return floats == {np.dtype(np.float32)}


def _step_function(fn):
    # a MegaKernel: the decorated function
    for attr in ("fn", "_fn", "__wrapped__"):
        f = getattr(fn, attr, None)
        if isinstance(f, types.FunctionType):
            return f
    spec = getattr(fn, "spec", None)
    f = getattr(spec, "fn", None)
    if isinstance(f, types.FunctionType):
        return f
    if isinstance(fn, types.FunctionType):
        return fn
    raise TypeError(f"interp.run: expected a step function, got {type(fn).__name__}")


def run(fn, args, steps, start=0, swap=(), seed=0):
    """Run ``steps`` steps of ``fn`` (a step function or a MegaKernel) from step index ``start``
    on ``args`` (the parameters after ``t``, in order; NumPy arrays are updated in place), the
    way a kernel call ``kernel(*args, steps=steps, start=start, seed=seed)`` with ``swap`` pairs
    (parameter names) would. Returns a :class:`Result`."""
    fn = _step_function(fn)
    params = list(inspect.signature(fn).parameters)[1:]
    assert len(params) == len(args), (params, len(args))
    float32 = _float32_only(args)
    vals = []
    for a in args:
        if isinstance(a, bool):
            vals.append(np.bool_(a))
        elif isinstance(a, int):
            vals.append(np.int64(a))
        elif isinstance(a, float):
            vals.append(np.float32(a) if float32 else np.float64(a))
        else:
            vals.append(a)
    step = _Builder(make_lk(), float32, seed).function(fn, True)
    pairs = [(params.index(a), params.index(b)) for a, b in swap]
    cur = list(vals)
    done, stopped = 0, "steps"
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        while done < steps:
            out = step(np.int64(start + done), *cur)
            done += 1
            for a, b in pairs:
                cur[a], cur[b] = cur[b], cur[a]
            if out is not None and not bool(out):
                stopped = "condition"
                break
    if done % 2 == 1:
        for a, b in pairs:
            tmp = vals[a].copy()
            vals[a][...] = vals[b]
            vals[b][...] = tmp
    return Result(done, stopped, start + done)
