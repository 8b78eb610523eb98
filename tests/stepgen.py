"""Random VALID step programs from loopkern's restricted grammar, as source text (a hypothesis
strategy), for the differential tests against the reference interpreter (tests/interp.py).

A program is a module: ``import``s, a few helper functions, and one step function ``step``. It
uses 1-D or 2-D arrays of one dtype (int64, float64 or float32); parallel loops (``lk.range``
with starts, stops and strides, ``lk.grid`` with ``(start, stop)`` dimensions) that read at
constant offsets, wrapped indices (``(i + 1) % n``), negative ones (``u[i - 1]`` with ``i`` from
0 reads the last element), mirrored, clamped and data-dependent ones; plain ``range`` and
``while`` loops inside parallel loops; ``if``/``else``, ``continue`` and conditional expressions
on loaded values; helper calls; ``lk.random`` draws; scatters with ``lk.atomic`` and permutation
stores; several phases separated by ``lk.sync()`` or by a reduction (each phase reads what the
earlier ones wrote at other indices, so the barrier matters); reductions (``lk.sum/max/min`` of
per-thread accumulators that start at the identity) used in later phases, in ``hist[t]`` records
written by thread 0, in uniform ``if``s and conditional expressions, under short-circuit
``and``/``or`` and in early and final ``return``s; swap pairs of one- and two-level schemes.

Some programs have no parallel construct (plain ``range`` loops): CUDA runs them on one thread.

Race-free by construction, so every launch shape must give the interpreter's result:
- within a phase every array has one role: read-only (any index), written (every access of the
  phase at ``loop index + c``, one constant ``c`` per dimension, so each element belongs to one
  iteration), permutation-written (stored once at a bijective index, not read), or scattered into
  with one ``lk.atomic`` operation (not read; add, max and min do not commute with each other);
- another thread's writes are read only after an unconditional ``lk.sync()`` or reduction, or
  in the next step; step-level code writes only under ``if lk.thread_id() == 0:`` (``hist[t]``),
  after a barrier;
- a per-thread value leaves its thread only through a reduction of an accumulator that starts at
  the operation's identity (the result does not depend on how the indices are shared out), or
  as the old value of an atomic on the iteration's own element;
- integer values are bounded (``% 1009`` on every store, products only of bounded operands), so
  int64 never overflows and integer programs match bit for bit;
- float stores are scaled by a power of two and clamped to [-2, 2]; uniform conditions use only
  reductions whose value does not depend on the order of the operations (max, min, integer
  sums; a final return may compare a float64 sum); float32 programs have no float sums and no
  float atomic adds. So float programs match to a tight tolerance (the GPU contracts a*b+c into
  an FMA, and float64 sums are added in another order).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

M = 1009                   # integer stores are taken modulo M
INT_LOAD = 64 * M          # a bound on |a[...]| for integer arrays (stores, += and atomics included)
FLOAT_LOAD = 4.0           # ... for float field arrays (stores clamp to [-2, 2]; += adds at most 1/8)
FLOAT_BINS = 256.0         # ... for float atomic bins
BIG = 2 ** 50              # products whose bound exceeds this wrap an operand first
FIELDS = ("a", "b", "c", "d")

HELPERS = {
    "int": '''
def imix(x, y):
    return (3 * x + y) % 1009


def ipick(x, y):
    if x > y:
        return x - y
    return y - x
''',
    "float": '''
def fblend(x, y):
    return 0.75 * x + 0.25 * y


def fsoft(x):
    if x < 0.0:
        return x / (1.0 - x)
    return x / (1.0 + x)
''',
    "array": '''
def nbsum(a, i, n):
    return a[(i + 1) % n] + a[(i + n - 1) % n]
''',
}


@dataclass
class Program:
    """One generated program and how to call it."""
    source: str
    kind: str                       # "int", "float64" or "float32"
    dtype: str
    params: list                    # parameter names after t
    arrays: dict                    # name -> (shape, dtype, how to fill: "data", "zeros", "bins")
    scalars: dict                   # name -> value
    swap: list
    steps: int
    start: int
    seed: int
    data_seed: int
    sequential: bool = False        # no parallel construct: CUDA runs it on one thread
    features: frozenset = field(default_factory=frozenset)

    @property
    def exact(self) -> bool:
        return self.kind == "int"

    @property
    def shape(self):
        return self.arrays["a"][0]

    def args(self, shape=None):
        """Fresh arguments, in parameter order (the same values every time). ``shape``: another
        shape for the field arrays (the step reads its sizes from ``a.shape``; a 1-D size should
        be prime, or at least coprime with 2, 3, 5 and 7, for the permutation stores)."""
        rng = np.random.default_rng(self.data_seed)
        out = []
        for p in self.params:
            if p in self.scalars:
                out.append(self.scalars[p])
                continue
            shape_, dtype, fill = self.arrays[p]
            if shape is not None and p in FIELDS:
                shape_ = shape
            if fill == "data":
                if np.dtype(dtype).kind == "i":
                    a = rng.integers(-M, M, shape_).astype(dtype)
                else:
                    a = rng.uniform(-1.0, 1.0, shape_).astype(dtype)
            else:
                a = np.zeros(shape_, dtype)
            out.append(a)
        return out

    def tolerance(self):
        """(rtol, atol) for comparing float results with the interpreter's."""
        return {"int": (0, 0), "float64": (1e-9, 1e-9), "float32": (2e-4, 2e-4)}[self.kind]

    def __repr__(self):
        return (f"Program(kind={self.kind}, steps={self.steps}, start={self.start}, seed={self.seed}, "
                f"data_seed={self.data_seed}, swap={self.swap}, scalars={self.scalars},\n"
                f"arrays={ {k: v[:2] for k, v in self.arrays.items()} },\nsource=\n{self.source})")


# ------------------------------------------------------------------------------ loading
_DIR = None


def load(prog: Program):
    """Write the program to a file (loopkern reads a step's source with inspect) and import it;
    returns the step function."""
    global _DIR
    if _DIR is None:
        _DIR = tempfile.mkdtemp(prefix="lkfuzz_")
    digest = hashlib.sha1(prog.source.encode()).hexdigest()[:16]
    name = f"lkfuzz_{digest}"
    mod = sys.modules.get(name)
    if mod is None:
        path = os.path.join(_DIR, name + ".py")
        with open(path, "w") as f:
            f.write(prog.source)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod.step


# ------------------------------------------------------------------------------ generation
def _pow2_scale(bound, target=2.0):
    """A power of two s with bound * s <= target (exact scaling)."""
    if bound <= target:
        return 1.0
    return 2.0 ** -math.ceil(math.log2(bound / target))


def _flit(x):
    return repr(float(x))


class _Phase:
    """What the phase being generated may touch and how."""

    def __init__(self):
        self.loop_vars = []         # ["i"] or ["i", "j"]
        self.dims = []              # per dim: (size name, lo, hi, full, stride)
        self.read = []              # read-only arrays
        self.write = {}             # written array -> offsets tuple
        self.perm = None            # (array, index text)
        self.atomic = None          # the lk.atomic operation bins take in this phase, if any
        self.accs = []              # (name, op) of this phase
        self.seq_var = None         # (name, bound) of a plain loop's variable while inside it


class Gen:
    """Draws one program. ``draw`` is hypothesis's."""

    def __init__(self, draw, *, atomics, sequential_ok, max_phases, kinds=None):
        self.draw = draw
        self.kinds = kinds
        self.atomics = atomics
        self.lines = []
        self.features = set()
        self.locals = []            # (name, bound) scalars valid at this point (uniform or per-iteration)
        self.uniform = []           # (name, bound, exact_order) uniform scalars: reductions, step-level temps
        self.n_tmp = 0
        self.n_acc = 0
        self.helpers_used = set()
        self.max_phases = max_phases
        self.sequential_ok = sequential_ok

    # -- choices ------------------------------------------------------------------------
    def choice(self, options):
        return self.draw(st.sampled_from(options))

    def pick(self, weights):
        """A key of ``weights`` ({option: percent}, summing to 100)."""
        x = self.percent()
        for k, w in weights.items():
            if x < w:
                return k
            x -= w
        return k

    def percent(self):
        return self.draw(st.integers(0, 99))

    def chance(self, p):
        return self.percent() < int(p * 100)

    def emit(self, depth, text):
        self.lines.append("    " * depth + text)

    def tmp(self, prefix="s"):
        self.n_tmp += 1
        return f"{prefix}{self.n_tmp}"

    # -- the whole program ------------------------------------------------------------------
    def program(self):
        d = self.draw
        self.kind = self.choice(list(self.kinds) if self.kinds else ["int", "float32", "float64", "int", "float64"])
        self.is_int = self.kind == "int"
        self.dtype = {"int": "int64", "float64": "float64", "float32": "float32"}[self.kind]
        self.sequential = self.sequential_ok and self.chance(0.12)
        self.ndim = self.choice([1, 1, 2])
        if self.ndim == 1:
            # mostly fewer elements than threads; sometimes more than 4 per thread of 32 (the
            # CUDA path's unrolled loop)
            n = d(st.integers(3, 24)) if not self.chance(0.12) else d(st.integers(129, 150))
            self.shape = (n,)
        else:
            self.shape = (d(st.integers(3, 7)), d(st.integers(3, 7)))
        self.nelem = int(np.prod(self.shape))
        nfield = d(st.integers(2, 4))
        self.fields = ["a", "b", "c", "d"][:nfield]
        swap_kind = self.choice(["none", "one", "one", "two"] if nfield == 4 else ["none", "one", "one"])
        self.swap = {"none": [], "one": [("a", "b")], "two": [("a", "b"), ("c", "d")]}[swap_kind]
        if self.swap:
            self.features.add("swap")
        self.steps = 0 if self.chance(0.05) else d(st.integers(1, 5))
        self.start = self.choice([0, 0, 0, 1, 2, 5])
        if self.start:
            self.features.add("start")
        self.seed = d(st.integers(0, 2 ** 64 - 1))
        self.data_seed = d(st.integers(0, 2 ** 32 - 1))
        self.use_hist = self.chance(0.5)
        self.use_bins = self.atomics and self.chance(0.8)
        self.nbins = d(st.integers(1, 5))
        self.scalars = {"c0": (d(st.integers(0, 50)) if self.is_int else
                               d(st.floats(-1.0, 1.0, allow_nan=False, width=32)))}
        self.bounds = {a: (INT_LOAD if self.is_int else FLOAT_LOAD) for a in self.fields}
        self.bounds["bins"] = INT_LOAD if self.is_int else FLOAT_BINS
        self.scalar_bounds = {"c0": 50 if self.is_int else 1.0}

        params = list(self.fields)
        if self.use_hist:
            params.append("hist")
        if self.use_bins:
            params.append("bins")
        params.append("c0")
        self.params = params

        body_start = len(self.lines)
        self.emit(1, "n = a.shape[0]")
        if self.ndim == 2:
            self.emit(1, "m = a.shape[1]")
        self.returns = self.chance(0.5)
        nphases = d(st.integers(1, self.max_phases))
        self.pending_accs = []      # accumulators not reduced yet: (name, op)
        returned_early = False
        for p in range(nphases):
            last = p == nphases - 1
            self.phase(last)
            if not last:
                self.separate()
                if not returned_early and self.chance(0.2):
                    self.early_return()
                    returned_early = True
        self.final()
        body = self.lines[body_start:]
        helpers = "".join(HELPERS[h] for h in sorted(self.helpers_used))
        header = "import math\n\nimport numpy as np\n\nimport loopkern as lk\n"
        source = (header + helpers + "\n\ndef step(t, " + ", ".join(params) + "):\n" + "\n".join(body) + "\n")
        arrays = {f: (self.shape, self.dtype, "data") for f in self.fields}
        if self.use_hist:
            arrays["hist"] = ((self.start + self.steps, 2), self.dtype, "zeros")
        if self.use_bins:
            arrays["bins"] = ((self.nbins,), self.dtype, "zeros")
        scalars = {"c0": self.scalars["c0"]}
        return Program(source=source, kind=self.kind, dtype=self.dtype, params=params, arrays=arrays,
                       scalars=scalars, swap=self.swap, steps=self.steps, start=self.start, seed=self.seed,
                       data_seed=self.data_seed, sequential=self.sequential, features=frozenset(self.features))

    # -- phases -----------------------------------------------------------------------------
    def phase(self, last):
        d = self.draw
        ph = _Phase()
        self.ph = ph
        self.reduced_unconditionally = False
        depth = 1
        wrapped = not self.sequential and not last and self.chance(0.15)
        if wrapped:
            # a whole phase under uniform control (its barrier too)
            self.emit(depth, f"if {self.uniform_cond()}:")
            depth += 1
            self.features.add("uniform_if")
        # loop shape
        if self.ndim == 1:
            form = self.choice(["full", "full", "trim", "trim", "stride", "reverse"])
            lo, hi, stride = 0, 0, 1
            if form == "trim":
                lo, hi = d(st.integers(0, 2)), d(st.integers(0, 2))
            elif form == "stride":
                lo, hi, stride = d(st.integers(0, 1)), d(st.integers(0, 1)), d(st.integers(2, 3))
            rng = self.range_text(lo, hi, stride, form)
            ph.dims = [("n", lo, hi, form in ("full", "reverse"), stride)]
            ph.loop_vars = ["i"]
            header = f"for i in {rng}:"
        else:
            dims = []
            parts = []
            for size in ("n", "m"):
                if self.chance(0.5):
                    dims.append((size, 0, 0, True, 1))
                    parts.append(size)
                else:
                    lo, hi = d(st.integers(0, 1)), d(st.integers(0, 1))
                    dims.append((size, lo, hi, lo == 0 and hi == 0, 1))
                    parts.append(f"({lo}, {size}{f' - {hi}' if hi else ''})")
            ph.dims = dims
            ph.loop_vars = ["i", "j"]
            header = f"for i, j in {'range_2d' if self.sequential else 'lk.grid'}({', '.join(parts)}):"
            if self.sequential:
                header = None
        # roles
        arrays = list(self.fields)
        roles = {}
        for a in arrays:
            roles[a] = self.choice(["r", "r", "w", "w", "x"])
        if "w" not in roles.values():
            roles[self.choice(arrays)] = "w"
        full_1d = self.ndim == 1 and ph.dims[0][3] and ph.dims[0][4] == 1
        if full_1d and self.chance(0.25):
            cand = [a for a in arrays if roles[a] == "r"]
            if cand:
                pa = self.choice(cand)
                roles[pa] = "p"
        # two-level schemes: with a swap pair, the second array is written from the first and
        # read at its own index (leapfrog), or the first read only (one-level)
        for (u, v) in self.swap:
            if self.chance(0.4):
                roles[u], roles[v] = "r", "w"
        for a, role in roles.items():
            if role == "r":
                ph.read.append(a)
            elif role == "w":
                ph.write[a] = tuple(self.write_offset(dim) for dim in ph.dims)
            elif role == "p":
                ph.perm = (a, self.perm_index())
        if self.use_bins:
            if self.chance(0.6):
                # one operation per phase: add, max and min do not commute with each other
                ph.atomic = self.choice(["add", "add", "max", "min"] if self.kind != "float32" else ["max", "min"])
                self.features.add("atomic")
            else:
                ph.read.append("bins")
        # accumulators for reductions
        # the final return's reduction: an accumulator of the last phase, so that what the step
        # wrote last is what the next step reads (whether the step barrier is kept matters)
        self.ret_acc = None
        want_ret = last and self.returns and not self.sequential and self.chance(0.8)
        if not self.sequential and not wrapped:
            for _ in range(max(d(st.integers(0, 2)), 1 if want_ret else 0)):
                self.n_acc += 1
                name = f"acc{self.n_acc}"
                # float32 sums depend on the order of the additions: no float32 sums
                op = self.choice(["sum", "sum", "max", "min", "count"] if self.kind != "float32" else
                                 ["max", "min", "count"])
                ph.accs.append((name, op))
                self.emit(depth, f"{name} = {self.identity(op)}")
        # the loop
        if header is None:   # sequential 2-D: two plain loops
            (n0, lo0, hi0, _, _), (n1, lo1, hi1, _, _) = ph.dims
            self.emit(depth, f"for i in range({lo0}, {n0} - {hi0}):")
            self.emit(depth + 1, f"for j in range({lo1}, {n1} - {hi1}):")
            body_depth = depth + 2
        else:
            if self.sequential:
                header = header.replace("lk.range", "range")
            self.emit(depth, header)
            body_depth = depth + 1
        saved_locals = list(self.locals)
        self.loop_body(body_depth, ph)
        self.locals = saved_locals
        # reduce this phase's accumulators now, or leave them for later
        if want_ret:
            self.ret_acc = ph.accs[0]
        for name, op in ph.accs:
            if (name, op) == self.ret_acc:
                continue
            if last or self.chance(0.6):
                self.reduce(depth, name, op)
            else:
                self.pending_accs.append((name, op))
        self.wrapped = wrapped
        if wrapped:
            # the barrier after a wrapped phase, inside its if (uniform)
            self.emit(depth, "lk.sync()")

    def range_text(self, lo, hi, stride, form):
        r = "range" if self.sequential else "lk.range"
        if form == "full":
            return f"{r}(n)"
        if form == "reverse":
            return f"{r}(n - 1, -1, -1)"
        stop = f"n - {hi}" if hi else "n"
        if stride == 1:
            return f"{r}({lo}, {stop})"
        return f"{r}({lo}, {stop}, {stride})"

    def write_offset(self, dim):
        _, lo, hi, _, stride = dim
        if self.chance(0.8):
            return 0
        return self.draw(st.integers(-lo, hi))

    def perm_index(self):
        n = self.shape[0]
        forms = ["(i + {c}) % n", "n - 1 - i", "(n - 1 - i + {c}) % n"]
        coprime = [q for q in (2, 3, 5, 7) if math.gcd(q, n) == 1]
        if coprime:
            forms.append("(i * {q}) % n")
        f = self.choice(forms)
        return f.format(c=self.draw(st.integers(1, 3)), q=self.choice(coprime) if coprime else 1)

    def identity(self, op):
        if op in ("sum", "count"):
            return "0" if self.is_int or op == "count" else "0.0"
        if op == "max":
            return "-1000000000000000" if self.is_int else "-1e30"
        return "1000000000000000" if self.is_int else "1e30"

    def reduce(self, depth, acc, op, name=None):
        """``r = lk.op(acc)``, a uniform scalar."""
        name = name or self.tmp("r")
        lkop = "sum" if op == "count" else op
        if op == "count":
            bound, exact = self.nelem * 4, True
        elif op == "sum":
            bound, exact = (M if self.is_int else 1.0) * self.nelem * 4, self.is_int
        else:
            bound, exact = 10 ** 15 if self.is_int else 1e30, True
        cond = not self.sequential and self.chance(0.2)
        if cond:
            # a reduction that only some steps evaluate (uniform condition): no barrier then
            zero = "0" if (self.is_int or op == "count") else "0.0"
            self.emit(depth, f"{name} = lk.{lkop}({acc}) if {self.step_cond()} else {zero}")
            self.features.add("cond_reduction")
        else:
            self.emit(depth, f"{name} = lk.{lkop}({acc})")
            self.reduced_unconditionally = True
        self.uniform.append((name, bound, exact))
        self.features.add("reduction")
        return name

    def separate(self):
        """What orders this phase's writes before the next phase's reads."""
        depth = 1
        if self.sequential:
            return
        if getattr(self, "wrapped", False):
            self.wrapped = False
            if self.chance(0.5):
                return            # the wrapped phase synced; skipping it wrote nothing
        # pending accumulators may be reduced here: an unconditional reduction is a barrier (so
        # is one right after the phase's loop)
        for name, op in list(self.pending_accs):
            if self.chance(0.5):
                self.reduce(depth, name, op)
                self.pending_accs.remove((name, op))
        if not self.reduced_unconditionally or self.chance(0.3):
            self.emit(depth, "lk.sync()")
            self.features.add("sync")
        else:
            self.features.add("reduction_barrier")
        # some uniform step-level arithmetic
        if self.uniform and self.chance(0.4):
            name = self.tmp("u")
            text, bound, exact = self.uniform_expr()
            self.emit(depth, f"{name} = {text}")
            self.uniform.append((name, bound, exact))

    def early_return(self):
        self.features.add("early_return")
        cond = self.uniform_cond()
        self.emit(1, f"if {cond}:")
        if self.returns:
            self.emit(2, f"return {self.choice(['True', 'False', self.uniform_cond()])}")
        else:
            self.emit(2, "return")

    def final(self):
        d = self.draw
        # reduce what is left (maybe keeping one accumulator for the return)
        ret_acc = self.ret_acc
        if ret_acc is None and self.returns and self.pending_accs and self.chance(0.7):
            ret_acc = self.pending_accs.pop()
        # (the last phase's own reductions, right after its loop, count as its barrier too)
        for name, op in self.pending_accs:
            self.reduce(1, name, op)
        barrier_done = self.reduced_unconditionally
        if self.use_hist:
            if not barrier_done and not self.sequential:
                self.emit(1, "lk.sync()")
            self.features.add("hist")
            guard = 1
            if not self.sequential:
                self.emit(1, "if lk.thread_id() == 0:")
                guard = 2
            for col in range(2):
                what = self.choice(["uniform", "load", "t"])
                if what == "uniform" and self.uniform:
                    text, _, _ = self.uniform_expr()
                elif what == "load" or (what == "uniform" and not self.uniform):
                    idx = ", ".join(str(d(st.integers(-s, s - 1))) for s in self.shape)
                    text = f"{self.choice(self.fields)}[{idx}]"
                else:
                    text = "t"
                self.emit(guard, f"hist[t, {col}] = {text}")
        if self.returns:
            self.features.add("return")
            self.emit(1, f"return {self.return_expr(ret_acc)}")
        elif self.sequential or self.chance(0.7):
            pass
        else:
            self.emit(1, "return")

    def return_expr(self, acc):
        d = self.draw
        K = self.start + d(st.integers(0, max(self.steps, 1)))
        if acc is not None:
            name, op = acc
            # (a float sum's value depends on the order of the additions: a verdict on it could
            # in principle flip; with float64 and these thresholds it does not in practice)
            lkop = "sum" if op == "count" else op
            red = f"lk.{lkop}({name})"
            cmp = self.choice([">", "<", ">=", "<="])
            tol = self.threshold(op)
            verdict = f"{red} {cmp} {tol}"
            form = self.pick({"ifexp": 10, "or": 10, "and": 15, "plain": 20, "ifexp_else": 20, "not": 25})
            self.features.add("return_" + form)
            if form == "plain":
                return verdict
            if form == "or":
                return f"t < {K} or {verdict}"
            if form == "and":
                return f"t < {K} and {verdict}"
            if form == "ifexp":
                return f"{verdict} if t > {K} else True"
            if form == "ifexp_else":
                return f"t < {K} if t % 2 == 0 else {verdict}"
            return f"not ({verdict})"
        form = self.choice(["count", "uniform"] if self.uniform else ["count"])
        if form == "count":
            return f"t + 1 < {K}"
        return self.uniform_cond()

    def threshold(self, op):
        d = self.draw
        if op == "count":
            return str(d(st.integers(0, self.nelem)))
        if self.is_int:
            return str(d(st.integers(-M, 4 * M)))
        return _flit(d(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5])))

    # -- uniform (step-level) values -------------------------------------------------------
    def step_cond(self):
        K = self.start + self.draw(st.integers(0, max(self.steps, 1)))
        return self.choice([f"t < {K}", f"t >= {K}", "t % 2 == 0", f"t != {K}"])

    def uniform_cond(self):
        exact = [(n, b) for n, b, e in self.uniform if e]
        if exact and self.chance(0.6):
            name, bound = self.choice(exact)
            tol = self.draw(st.integers(0, int(min(bound, 4 * M)))) if self.is_int else \
                self.choice([0.0, 0.25, 0.5, 1.0])
            c = f"{name} > {tol}"
            if self.chance(0.5):
                c = f"{self.step_cond()} {self.choice(['and', 'or'])} {c}"
            return c
        return self.step_cond()

    def uniform_expr(self):
        name, bound, exact = self.choice(self.uniform)
        if self.is_int:
            form = self.choice(["plain", "mod", "plus_t"])
            if form == "mod":
                return f"{name} % {M}", M, exact
            if form == "plus_t":
                return f"({name} % {M} + t)", M + 32, exact
            return name, bound, exact
        return name, bound, exact

    # -- the loop body ----------------------------------------------------------------------
    def own_index(self, arr):
        offs = self.ph.write[arr]
        parts = []
        for var, c in zip(self.ph.loop_vars, offs):
            parts.append(var if c == 0 else f"{var} + {c}" if c > 0 else f"{var} - {-c}")
        return ", ".join(parts)

    def read_index_dim(self, k):
        """An index expression for dimension k of a read-only array, and whether it needs data."""
        var = self.ph.loop_vars[k]
        size, lo, hi, full, stride = self.ph.dims[k]
        d = self.draw
        forms = ["own", "own", "offset", "wrap", "neg", "mirror", "clamp", "step"]
        if self.ph.seq_var:
            forms += ["seq", "seq"]
        if self.is_int and self.ph.read:
            forms.append("data")
        f = self.choice(forms)
        if f == "own":
            return var
        if f == "offset":
            if lo == 0 and hi == 0:
                return var
            c = d(st.integers(-lo, hi))
            return var if c == 0 else f"{var} + {c}" if c > 0 else f"{var} - {-c}"
        if f == "wrap":
            c = d(st.integers(1, 3))
            return self.choice([f"({var} + {c}) % {size}", f"({var} + {size} - {c}) % {size}",
                                f"({var} - {c}) % {size}"])
        if f == "neg":
            # a negative index reads from the end, as in Python
            return f"{var} - {d(st.integers(1, 2))}" if self.shape[k] >= 2 else var
        if f == "mirror":
            return f"{size} - 1 - {var}"
        if f == "clamp":
            c = d(st.integers(1, 3))
            return self.choice([f"min({var} + {c}, {size} - 1)", f"max({var} - {c}, 0)"])
        if f == "step":
            return self.choice([f"t % {size}", f"(t + {var}) % {size}", f"({var} * 3 + 1) % {size}",
                                f"{var} // 2"])
        if f == "seq":
            sv = self.ph.seq_var[0]
            return self.choice([f"({var} + {sv}) % {size}", f"({var} + {size} - {sv}) % {size}"])
        # data-dependent: the value of an int array read at the own index
        src = self.choice(self.ph.read) if self.ph.read else None
        if src is None or src == "bins":
            return var
        own = ", ".join(self.ph.loop_vars)
        return f"{src}[{own}] % {size}"

    def load(self):
        """A load the phase may do: (text, bound) or None."""
        ph = self.ph
        opts = [a for a in ph.read] + list(ph.write)
        if not opts:
            return None
        arr = self.choice(opts)
        if arr in ph.write:
            return f"{arr}[{self.own_index(arr)}]", self.bounds[arr]
        if arr == "bins":
            if self.is_int or self.chance(0.5):
                return f"bins[{self.draw(st.integers(0, self.nbins - 1))}]", self.bounds["bins"]
            return f"bins[{ph.loop_vars[0]} % {self.nbins}]", self.bounds["bins"]
        idx = ", ".join(self.read_index_dim(k) for k in range(self.ndim))
        return f"{arr}[{idx}]", self.bounds[arr]

    def leaf(self):
        d = self.draw
        kinds = ["load", "load", "load", "const", "var", "t", "c0"]
        if self.locals:
            kinds += ["local", "local"]
        if self.uniform:
            kinds.append("uniform")
        k = self.choice(kinds)
        if k == "load":
            got = self.load()
            if got:
                return got
            k = "const"
        if k == "local" and self.locals:
            return self.choice(self.locals)
        if k == "uniform" and self.uniform:
            text, bound, _ = self.uniform_expr()
            if not self.is_int:
                s = _pow2_scale(bound, 1.0)
                return (f"{text} * {_flit(s)}" if s != 1.0 else text), bound * s
            return text, bound
        if k == "var":
            var = self.choice(self.ph.loop_vars + ([self.ph.seq_var[0]] if self.ph.seq_var else []))
            if self.is_int:
                return var, max(self.shape) + 4
            return f"{var} * 0.0625", max(self.shape) * 0.0625
        if k == "t":
            if self.is_int:
                return "t", self.start + self.steps + 1
            return "t * 0.125", (self.start + self.steps + 1) * 0.125
        if k == "c0":
            return "c0", self.scalar_bounds["c0"]
        if self.is_int:
            v = d(st.integers(0, 9))
            return str(v), v
        v = d(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 0.1, 2.0]))
        return _flit(v), v

    def expr(self, depth):
        """(text, bound) of an expression over what this point of the loop body may read."""
        if depth <= 0 or self.chance(0.3):
            return self.leaf()
        if self.is_int:
            return self.int_op(depth)
        return self.float_op(depth)

    def int_op(self, depth):
        op = self.choice(["+", "+", "-", "*", "%", "//", "abs", "minmax", "ifexp", "and7", "shift", "helper"])
        if op in ("+", "-"):
            (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)
            return f"({a} {op} {b})", ba + bb
        if op == "*":
            (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)
            if ba * bb > BIG:
                a, ba = f"({a} % 31)", 31
                if ba * bb > BIG:
                    b, bb = f"({b} % {M})", M
            return f"({a} * {b})", ba * bb
        if op == "%":
            a, ba = self.expr(depth - 1)
            k = self.choice([2, 3, 7, 31, M, "n"])
            return f"({a} % {k})", (self.shape[0] if k == "n" else k)
        if op == "//":
            a, ba = self.expr(depth - 1)
            return f"({a} // {self.choice([2, 3, 5])})", ba
        if op in ("abs", "minmax", "ifexp"):
            return self.shared_op(op, depth)
        if op == "and7":
            a, ba = self.expr(depth - 1)
            return f"({a} & 7)", 7
        if op == "shift":
            a, ba = self.expr(depth - 1)
            return f"({a} >> 1)", ba
        (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)
        if self.chance(0.5):
            self.helpers_used.add("int")
            return f"imix({a}, {b})", M
        self.helpers_used.add("int")
        return f"ipick({a}, {b})", ba + bb

    def shared_op(self, op, depth):
        """The operations integer and float expressions share: (text, bound on |value|)."""
        if op == "abs":
            a, ba = self.expr(depth - 1)
            return f"abs({a})", ba
        if op == "minmax":
            (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)
            return f"{self.choice(['min', 'max'])}({a}, {b})", max(ba, bb)
        (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)     # ifexp
        return f"({a} if {self.cond(depth - 1)} else {b})", max(ba, bb)

    def float_op(self, depth):
        ops = ["+", "+", "-", "*", "scale", "abs", "minmax", "ifexp", "helper", "div"]
        if self.kind == "float64":
            ops += ["math", "math"]
        op = self.choice(ops)
        if op in ("+", "-"):
            (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)
            return f"({a} {op} {b})", ba + bb
        if op == "*":
            (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)
            return f"({a} * {b})", ba * bb
        if op == "scale":
            a, ba = self.expr(depth - 1)
            c = self.choice([0.5, 0.25, -0.75, 1.25])
            return f"{_flit(c)} * {a}", abs(c) * ba
        if op in ("abs", "minmax", "ifexp"):
            return self.shared_op(op, depth)
        if op == "div":
            (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)
            return f"({a} / (1.0 + abs({b})))", ba
        if op == "helper":
            if self.ndim == 1 and self.ph.read and "bins" not in self.ph.read[:1] and self.chance(0.3):
                arr = self.choice([r for r in self.ph.read if r != "bins"] or [None])
                if arr is not None:
                    self.helpers_used.add("array")
                    return f"nbsum({arr}, {self.ph.loop_vars[0]}, n)", 2 * self.bounds[arr]
            self.helpers_used.add("float")
            if self.chance(0.5):
                (a, ba), (b, bb) = self.expr(depth - 1), self.expr(depth - 1)
                return f"fblend({a}, {b})", max(ba, bb)
            a, ba = self.expr(depth - 1)
            return f"fsoft({a})", 1.0
        a, ba = self.expr(depth - 1)
        fn = self.choice(["sin", "cos", "sqrt", "exp", "tanh"])
        if fn == "sqrt":
            return f"math.sqrt(abs({a}))", math.sqrt(ba) + 1
        if fn == "exp":
            return f"math.exp(-abs({a}))", 1.0
        return f"math.{fn}({a})", 1.0

    def cond(self, depth):
        if self.chance(0.2) and depth > 0:
            c1, c2 = self.cond(depth - 1), self.cond(depth - 1)
            return self.choice([f"({c1} and {c2})", f"({c1} or {c2})", f"not ({c1})"])
        (a, _), (b, _) = self.expr(max(depth - 1, 0)), self.expr(max(depth - 1, 0))
        if self.is_int:
            f = self.choice(["<", ">=", "!=", "==", "mod2", "chain"])
            if f == "mod2":
                return f"{a} % 2 == 0"
            if f == "chain":
                c, _ = self.expr(0)
                return f"{a} <= {b} < {c}"
            return f"{a} {f} {b}"
        return f"{a} {self.choice(['<', '>', '<=', '>='])} {b}"

    # -- statements ---------------------------------------------------------------------------
    def store_value(self, arr, depth):
        text, bound = self.expr(depth)
        if self.is_int:
            return f"({text}) % {M}"
        s = _pow2_scale(bound)
        scaled = f"({text}) * {_flit(s)}" if s != 1.0 else text
        return f"min(max({scaled}, -2.0), 2.0)"

    def store(self, depth, arr):
        d = self.draw
        idx = self.own_index(arr)
        form = self.choice(["=", "=", "=", "+=", "atomic"] if self.atomics else
                           ["=", "=", "=", "+="])
        edepth = d(st.integers(0, 3))
        if form == "=":
            self.emit(depth, f"{arr}[{idx}] = {self.store_value(arr, edepth)}")
        elif form == "+=":
            text, bound = self.expr(edepth)
            if self.is_int:
                self.emit(depth, f"{arr}[{idx}] += ({text}) % 16")
            else:
                s = _pow2_scale(bound, 1.0) * 0.125
                self.emit(depth, f"{arr}[{idx}] += min(max(({text}) * {_flit(s)}, -0.125), 0.125)")
            self.features.add("augassign")
        else:
            # an atomic on the iteration's own element: the old value is the element's
            text, bound = self.expr(edepth)
            op = self.choice(["add", "max", "min"])
            val = f"({text}) % 16" if self.is_int else f"min(max(({text}) * {_flit(_pow2_scale(bound, 1.0))}, -1.0), 1.0)"
            if op != "add":
                val = f"({text}) % {M}" if self.is_int else \
                    f"min(max(({text}) * {_flit(_pow2_scale(bound, 2.0))}, -2.0), 2.0)"
            name = self.tmp("o")
            self.emit(depth, f"{name} = lk.atomic.{op}({arr}, ({idx}), {val})")
            self.locals.append((name, self.bounds[arr]))
            self.features.add("atomic_own")

    def acc_update(self, depth, acc, op):
        text, bound = self.expr(self.draw(st.integers(0, 2)))
        if op == "sum":
            if self.is_int:
                self.emit(depth, f"{acc} += ({text}) % {M}")
            else:
                s = _pow2_scale(bound, 1.0)
                self.emit(depth, f"{acc} += min(max({text} * {_flit(s)}, -1.0), 1.0)")
        elif op == "count":
            self.emit(depth, f"if {self.cond(1)}:")
            self.emit(depth + 1, f"{acc} += 1")
        else:
            if self.is_int:
                self.emit(depth, f"{acc} = {op}({acc}, ({text}) % {M})")
            else:
                self.emit(depth, f"{acc} = {op}({acc}, abs({text}))")

    def scatter(self, depth):
        """An atomic update of a bin any iteration may hit."""
        text, bound = self.expr(self.draw(st.integers(0, 2)))
        if self.is_int:
            idx = f"({text}) % {self.nbins}"
        else:
            idx = f"int(abs({text}) * 4.0) % {self.nbins}"
        vt, vb = self.expr(self.draw(st.integers(0, 1)))
        op = self.ph.atomic
        if self.is_int:
            val = f"({vt}) % 5" if op == "add" else f"({vt}) % {M}"
        else:
            val = f"min(max({vt} * {_flit(_pow2_scale(vb, 1.0))}, -1.0), 1.0) * 0.125"
        if op == "add" or self.chance(0.5):
            self.emit(depth, f"lk.atomic.{op}(bins, {idx}, {val})")
        else:
            self.emit(depth, f"{self.tmp('z')} = lk.atomic.{op}(bins, {idx}, {val})")   # old value unused
        self.features.add("scatter")

    def loop_body(self, depth, ph):
        d = self.draw
        n_random = 0
        # random draws first (one statement each)
        if self.chance(0.3):
            for _ in range(d(st.integers(1, 2))):
                name = self.tmp("q")
                key = ph.loop_vars[0] if self.ndim == 1 else "i * m + j"
                fn = "uniform" if self.is_int or self.chance(0.6) else "normal"
                args = key if self.chance(0.6) else f"{key}, {d(st.integers(0, 3))}"
                self.emit(depth, f"{name} = lk.random.{fn}({args})")
                if self.is_int:
                    self.emit(depth, f"{name}i = int({name} * 8.0)")
                    self.locals.append((f"{name}i", 8))
                elif fn == "normal":
                    self.emit(depth, f"{name} = min(max({name}, -3.0), 3.0)")
                    self.locals.append((name, 3.0))
                else:
                    self.locals.append((name, 1.0))
                n_random += 1
                self.features.add("random")
        if self.chance(0.15):
            self.emit(depth, f"if {self.cond(1)}:")
            self.emit(depth + 1, "continue")
            self.features.add("continue")
        todo = list(ph.write)            # every written array is stored at least once
        accs = list(ph.accs)
        nstmt = d(st.integers(1, 4))
        for _ in range(nstmt):
            kind = self.choice(["tmp", "store", "store", "if", "seq", "acc", "scatter", "perm"])
            if kind == "tmp":
                name = self.tmp()
                text, bound = self.expr(d(st.integers(1, 3)))
                if not self.is_int and bound > 64:
                    s = _pow2_scale(bound, 4.0)
                    text, bound = f"min(max({text} * {_flit(s)}, -4.0), 4.0)", 4.0
                elif self.is_int and bound > BIG:
                    text, bound = f"({text}) % {M}", M
                self.emit(depth, f"{name} = {text}")
                self.locals.append((name, bound))
            elif kind == "store" and ph.write:
                arr = todo.pop(0) if todo else self.choice(list(ph.write))
                self.store(depth, arr)
            elif kind == "if":
                self.features.add("if")
                self.emit(depth, f"if {self.cond(2)}:")
                self.branch(depth + 1, ph, accs)
                if self.chance(0.6):
                    self.emit(depth, "else:")
                    self.branch(depth + 1, ph, accs)
            elif kind == "seq":
                self.seq_loop(depth, ph)
            elif kind == "acc" and accs:
                acc, op = accs.pop(0)
                self.acc_update(depth, acc, op)
            elif kind == "scatter" and ph.atomic:
                self.scatter(depth)
            elif kind == "perm" and ph.perm:
                arr, idx = ph.perm
                self.emit(depth, f"{arr}[{idx}] = {self.store_value(arr, d(st.integers(0, 2)))}")
                ph.perm = None
                self.features.add("perm")
        for arr in todo:
            self.store(depth, arr)
        for acc, op in accs:
            self.acc_update(depth, acc, op)
        if ph.perm:
            arr, idx = ph.perm
            self.emit(depth, f"{arr}[{idx}] = {self.store_value(arr, 1)}")
            self.features.add("perm")
        if ph.atomic and self.chance(0.7):
            self.scatter(depth)

    def branch(self, depth, ph, accs):
        saved = list(self.locals)
        self._branch(depth, ph, accs)
        self.locals = saved        # names first assigned in a branch are not defined after it

    def _branch(self, depth, ph, accs):
        kind = self.choice(["store", "acc", "scatter"])
        if kind == "acc" and accs:
            acc, op = accs.pop(0)
            self.acc_update(depth, acc, op)
        elif kind == "scatter" and ph.atomic:
            self.scatter(depth)
        elif ph.write:
            self.store(depth, self.choice(list(ph.write)))
        else:
            self.emit(depth, "pass")

    def seq_loop(self, depth, ph):
        d = self.draw
        self.features.add("seq_loop")
        name = self.tmp()
        trip = self.choice(["const", "const", "t", "data"] if self.is_int else ["const", "const", "t"])
        if trip == "const":
            bound_text, trips = str(d(st.integers(0, 3))), 3
        elif trip == "t":
            bound_text, trips = "t % 3", 2
        else:
            got = self.load()
            bound_text, trips = (f"abs({got[0]}) % 3", 2) if got else ("2", 2)
        zero = "0" if self.is_int else "0.0"
        self.emit(depth, f"{name} = {zero}")
        use_while = self.chance(0.25)
        if use_while:
            self.emit(depth, "k = 0")
            self.emit(depth, f"while k < {bound_text}:")
        else:
            self.emit(depth, f"for k in range({bound_text}):")
        ph.seq_var = ("k", 3)
        saved = list(self.locals)
        text, bound = self.expr(d(st.integers(0, 2)))
        if self.is_int:
            self.emit(depth + 1, f"{name} = ({name} + {text}) % {M}")
            nb = M
        else:
            s = _pow2_scale(bound, 1.0)
            self.emit(depth + 1, f"{name} = 0.5 * {name} + min(max({text} * {_flit(s)}, -1.0), 1.0)")
            nb = 2.0
        if ph.write and self.chance(0.3):
            self.store(depth + 1, self.choice(list(ph.write)))
        if use_while:
            self.emit(depth + 1, "k += 1")
        ph.seq_var = None
        self.locals = saved + [(name, nb)]


@st.composite
def programs(draw, atomics=False, sequential_ok=True, max_phases=3, kinds=None):
    """A random valid step program (a :class:`Program`), sized for the simulator (1-D mostly up
    to 24 elements, sometimes 129-150; 2-D up to 7x7); ``Program.args(shape)`` runs it bigger.

    atomics: use ``lk.atomic`` (scatters into bins, atomics on own elements).
    sequential_ok: sometimes a step with no parallel construct (CUDA runs it on one thread).
    kinds: the value kinds to draw from ("int", "float64", "float32"; default all three).
    """
    return Gen(draw, atomics=atomics, sequential_ok=sequential_ok, max_phases=max_phases, kinds=kinds).program()


# ------------------------------------------------------------------------------ test support
def assert_same_result(prog: Program, run, want, got, ref):
    """``run`` (a loopkern Run) and ``got`` (its arrays) against the interpreter's ``want``
    (interp.Result) and ``ref``: integers bit for bit, floats to the program's tolerance."""
    assert run.steps == want.steps, f"steps: kernel {run.steps}, interpreter {want.steps}"
    assert run.stopped == want.stopped, f"stopped: kernel {run.stopped!r}, interpreter {want.stopped!r}"
    assert run.next_start == want.next_start, (run.next_start, want.next_start)
    rtol, atol = prog.tolerance()
    for name, g, e in zip(prog.params, got, ref):
        if not isinstance(e, np.ndarray):
            continue
        g = np.asarray(g)
        assert g.dtype == e.dtype and g.shape == e.shape, name
        if prog.exact:
            np.testing.assert_array_equal(g, e, err_msg=f"array '{name}'")
        else:
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"array '{name}'")


def check_program(prog: Program, configs, shape=None):
    """Run ``prog`` with ``kernel(...)`` under each of ``configs`` ((backend, scope, threads,
    blocks) tuples) on fresh arguments, and with the interpreter once; assert they agree. A step
    without parallel constructs runs on CUDA's thread scope ("grid") or "auto" (any other)."""
    import interp
    import loopkern as lk
    from hypothesis import note
    fn = load(prog)
    kernel = lk.megakernel(fn, swap=prog.swap)
    ref = prog.args(shape)
    want = interp.run(fn, ref, prog.steps, start=prog.start, swap=prog.swap, seed=prog.seed)
    note(f"the program ({prog.kind}, {prog.steps} steps from {prog.start}, seed {prog.seed}, shape "
         f"{shape or prog.shape}):\n{prog.source}")
    for backend, scope, threads, blocks in configs:
        if prog.sequential and backend == "cuda":
            scope, threads, blocks = ("thread" if scope == "grid" else "auto"), None, None
        note(f"running on {backend} scope={scope} threads={threads} blocks={blocks}")
        got = prog.args(shape)
        opts = {} if backend == "cpu" else dict(scope=scope, threads=threads, blocks=blocks)
        run = kernel(*got, max_steps=prog.steps, start=prog.start, seed=prog.seed, backend=backend, **opts)
        if prog.sequential and backend == "cuda":
            assert run.scope == "thread", run.scope
        assert_same_result(prog, run, want, got, ref)
    return want


def fuzz_settings(default_examples):
    """Hypothesis settings for the fuzz tests: ``default_examples`` programs (or
    $LOOPKERN_FUZZ_EXAMPLES), derandomized (or $LOOPKERN_FUZZ_SEED), no example database, no
    deadline, shrinking only with $LOOPKERN_FUZZ_SHRINK=1 (each candidate compiles a kernel)."""
    from hypothesis import HealthCheck, Phase, seed, settings
    n = int(os.environ.get("LOOPKERN_FUZZ_EXAMPLES", default_examples))
    phases = [Phase.explicit, Phase.generate]
    if os.environ.get("LOOPKERN_FUZZ_SHRINK", "") not in ("", "0"):
        phases.append(Phase.shrink)
    fixed = os.environ.get("LOOPKERN_FUZZ_SEED")
    s = settings(max_examples=n, deadline=None, database=None, derandomize=fixed is None, phases=phases,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.large_base_example, HealthCheck.filter_too_much],
                 print_blob=False)
    if fixed is None:
        return s
    return lambda f: seed(int(fixed))(s(f))


_COUNTS: dict = {}
_REPORTER = []


class _Report:
    """Adds 'loopkern fuzzing' (programs run per test) to pytest's terminal summary."""

    def pytest_terminal_summary(self, terminalreporter):
        if not _COUNTS:
            return
        terminalreporter.write_sep("-", "loopkern fuzzing: examples run")
        for key in sorted(_COUNTS):
            c = _COUNTS[key]
            kinds = ", ".join(f"{k} {c[k]}" for k in ("int", "float64", "float32") if c.get(k))
            terminalreporter.write_line(f"{key}: {c['programs']} runs{f' ({kinds})' if kinds else ''}, "
                                        f"{c['seconds']:.1f} s")


def _write_counts(path):
    import json
    with open(path, "w") as f:
        json.dump(_COUNTS, f, indent=1, sort_keys=True)


try:
    import pytest

    @pytest.fixture(scope="session")
    def fuzz_counter(request, tmp_path_factory):
        """``count(key, prog)``: records one program run under ``key`` (and the time since the
        last count); the totals go to the terminal summary and to fuzz_counts.json."""
        import time
        if not _REPORTER:
            _REPORTER.append(_Report())
            request.config.pluginmanager.register(_REPORTER[0], "loopkern-fuzz-report")
        last = [time.monotonic()]

        def count(key, prog=None, seconds=None):
            now = time.monotonic()
            c = _COUNTS.setdefault(key, {"programs": 0, "seconds": 0.0})
            c["programs"] += 1
            c["seconds"] += seconds if seconds is not None else now - last[0]
            if prog is not None:
                c[prog.kind] = c.get(prog.kind, 0) + 1
            last[0] = now
        yield count
        _write_counts(tmp_path_factory.getbasetemp() / "fuzz_counts.json")
except ImportError:       # pragma: no cover - stepgen without pytest
    pass


# ------------------------------------------------------------------------------ PTX (no GPU)
def compile_programs_to_ptx(count, atomics, seed=None):
    """Generate ``count`` programs and compile each one's CUDA kernels (grid and block scope;
    thread scope for a sequential step) to PTX with NVVM, in THIS process, which must not have
    imported numba with the simulator on. A stand-in device reporting compute capability 9.0
    stands in for a GPU, as in tests/ptx_check.py, whose kernel signature this repeats. Prints
    one JSON line per kernel: CUDA-only compile errors (IR that NVVM rejects, say) show up on a
    machine without a GPU, where the simulator runs Python instead."""
    import json

    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    import numba.cuda.api as _api
    import numba.cuda.dispatcher as _disp
    from numba import cuda, typeof, types

    class _Device:
        compute_capability = (9, 0)
        id = 0
        name = b"stand-in for compiling only"

    _api.get_current_device = _disp.get_current_device = lambda: _Device()
    import loopkern as lk
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from loopkern import codegen
    from loopkern.compile import compile_kernel

    scratch = (types.float64[:, ::1], types.int64[:, ::1], types.uint32[::1])
    control = (types.int64[::1], types.int64[::1])
    progs = []

    for kind in ("float32", "int", "float64"):     # as many of each (float32 mixes widths most)
        @settings(max_examples=max(count // 3, 1), derandomize=seed is None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck), deadline=None)
        @given(programs(atomics=atomics, kinds=(kind,)))
        def collect(prog):
            progs.append(prog)

        (hseed(seed)(collect) if seed is not None else collect)()
    for prog in progs:
        args = prog.args()
        floats = {a.dtype for a in args if isinstance(a, np.ndarray) and a.dtype.kind == "f"}
        float_type = "float32" if floats == {np.dtype(np.float32)} else None
        params = []
        for a in args:
            if isinstance(a, np.ndarray):
                params.append(typeof(a))
            elif isinstance(a, float):
                params.append(types.float32 if float_type else types.float64)
            else:
                params.append(typeof(a))
        sig = (types.int64, types.int64, *params, *scratch, types.uint64, *control)
        kernel = lk.megakernel(load(prog), swap=prog.swap)
        for scope in (("thread",) if prog.sequential else ("grid", "block")):
            rec = dict(scope=scope, kind=prog.kind)
            try:
                src = codegen.render_kernel(kernel.spec, "cuda", scope, cache=False, float_type=float_type)
                cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))
                rec.update(ok=True)
            except Exception as exc:
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:1500], source=prog.source)
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    # python tests/stepgen.py ptx COUNT [atomics] [SEED]
    if len(sys.argv) >= 3 and sys.argv[1] == "ptx":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        compile_programs_to_ptx(int(sys.argv[2]), atomics="atomics" in sys.argv[3:],
                                seed=int(sys.argv[4]) if len(sys.argv) > 4 else None)
