"""Lower a flat loop-body program (``trace.py``) to the source text of a restricted-Python step.

Every array value is an *index function*: given one index expression per dimension it gives a
scalar expression in restricted Python. Elementwise operations compose expressions; static and
dynamic slices, pads, concatenations, reversals, transposes, broadcasts and reshapes rewrite the
indices; ``select_n``, ``pad``, ``concatenate`` and ``scatter`` become conditional expressions
whose conditions are simplified against the known ranges of the indices (inside a heat body's
``u.at[1:-1].set(...)`` loop the condition is statically true and disappears). Scalars are
computed once per thread at the top of the step. Whole-array reductions become ``lk.sum`` /
``lk.max`` / ``lk.min`` over a parallel loop (a grid reduction, which is a barrier: later
statements see everything written before it); partial reductions and small ``dot_general``\\ s
become sequential ``range`` loops per element.

The work of a step is grouped by *stage* (the number of reductions a value depends on in
sequence): each stage runs one parallel loop per index space, in which it writes the new
carries (into the second buffer of a swap pair, so the old carry can be read while the new one
is written), the scan outputs ``ys[t]`` and the per-thread partial reductions. A carry that is
its own old value with a static window replaced (``u.at[1:-1].set(...)``) is written over that
window only (both buffers start equal and the cells outside are never written). An integer
scalar carry that only counts (``k + 1``) is not stored at all: it is computed from the step
index, which also keeps a condition that reads it the same on every thread.

Nothing here imports numba or jax.
"""

from __future__ import annotations

import ast
import math
import threading
from dataclasses import dataclass, field

import numpy as np

from ..dsl import ATOMIC_DTYPES
from .trace import Eqn, Lit, Program, Unsupported, Var, clone_eqns, count_uses, walk_eqns

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
INTS = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                   np.uint64))
BOOL = np.dtype(np.bool_)
OK_DTYPES = FLOATS + INTS + (BOOL,)
SCATTERS = ("scatter", "scatter-add", "scatter_add")
#: a nested loop that is not elementwise in its array carries runs unrolled, up to this count
UNROLL_MAX = 16
#: the longest rows ``sort`` handles (each element counts the row's smaller ones: O(n^2) work)
SORT_MAX = 4096
#: the largest matrix ``lu`` / ``triangular_solve`` handle (one thread: O(n^3) work)
LINALG_MAX = 64
LINALG = ("lu", "triangular_solve", "cholesky")
#: a parallel loop whose rim (Lowering.split_loop) has more slabs than this is not split
MAX_RIM_SLABS = 8
#: a rim that only reads and reduces issues its first cell's loads before the interior loop
#: (Lowering._prefetch_rim) when its loop has more than PREFETCH_RIM_MIN_CELLS cells; False only
#: to measure what that saves
PREFETCH_RIM = True
#: at most this many cells, scope="auto" runs a light step in one block with its arrays staged
#: in shared memory (dispatch.config.AUTO_BLOCK_SCOPE_MAX_ELEMENTS; the lowering imports nothing
#: of the call path): there the early loads bought nothing and cost time. The drop-in Jacobi body
#: (H100, bench.py run of 2026-12-07 21:53 UTC, same rounds): 64x64 (block scope) 2.235 µs/step
#: with them, 2.043 without; 256x256 (grid scope) 3.065 with, 3.158 without
PREFETCH_RIM_MIN_CELLS = 4096
_UNROLL_HINT = (f"(a nested loop runs per element when it updates its array carries elementwise, and unrolled "
                f"when its count is static and at most {UNROLL_MAX})")

HELPERS = '''
def jl_fmax(a, b):
    return a if (a > b or a != a) else b


def jl_fmin(a, b):
    return a if (a < b or a != a) else b


def jl_fmaximum(a, b):
    if a > b or a != a:
        return a
    if b > a or b != b:
        return b
    return a if (a != 0 or math.copysign(1.0, a) > 0) else b


def jl_fminimum(a, b):
    if a < b or a != a:
        return a
    if b < a or b != b:
        return b
    return a if (a != 0 or math.copysign(1.0, a) < 0) else b


def jl_fdiv32(a, b):
    if b != 0:
        return a / b
    if a != a or a == 0:
        return np.float32(math.nan)
    return np.float32(math.copysign(math.inf, a) * math.copysign(1.0, b))


def jl_fdiv64(a, b):
    if b != 0:
        return a / b
    if a != a or a == 0:
        return np.float64(math.nan)
    return np.float64(math.copysign(math.inf, a) * math.copysign(1.0, b))


def jl_wadd(a, b):
    # int64 arithmetic that wraps as XLA's does: Numba marks signed arithmetic "no signed wrap",
    # so LLVM may fold a comparison of an overflowed sum as if it had not wrapped
    return np.int64(np.uint64(np.int64(a)) + np.uint64(np.int64(b)))


def jl_wsub(a, b):
    return np.int64(np.uint64(np.int64(a)) - np.uint64(np.int64(b)))


def jl_wmul(a, b):
    return np.int64(np.uint64(np.int64(a)) * np.uint64(np.int64(b)))


def jl_wabs(a):
    return a if a >= 0 else jl_wsub(0, a)


def jl_idiv(a, b):
    # XLA's integer division: truncated, x / 0 = -1, MIN / -1 = MIN (the negation wraps in the
    # cast); the floor division below never meets 0 or -1, so nothing overflows, and nothing
    # takes abs() of MIN (which stays negative)
    if b == 0:
        return -1
    if b == -1:
        return jl_wsub(0, a)
    q = a // b
    return q + 1 if q * b != a and (a < 0) != (b < 0) else q


def jl_udiv(a, b, ones):
    # XLA's unsigned division: x / 0 has every bit set (``ones``, of the operands' type, so that
    # the two returns unify to that type: a literal -1 made Numba return a float)
    return ones if b == 0 else a // b


def jl_irem(a, b):
    # XLA's remainder: the sign of the dividend, x rem 0 = x, MIN rem -1 = 0
    if b == 0:
        return a
    if b == -1 or b == 1:
        return a - a
    r = a % b
    return r - b if r != 0 and (r < 0) != (a < 0) else r


def jl_sign(a):
    return a if (a != a or a == 0) else (1 if a > 0 else -1)


def jl_whole(r, a):
    return float(r) if r != 0 else math.copysign(0.0, a)


def jl_floor(a):
    if not abs(a) < 4503599627370496.0:
        return a
    return jl_whole(math.floor(a), a)


def jl_ceil(a):
    if not abs(a) < 4503599627370496.0:
        return a
    return jl_whole(math.ceil(a), a)


def jl_round_even(a):
    if not abs(a) < 4503599627370496.0:
        return a
    f = math.floor(a)
    d = a - f
    return jl_whole(f + 1 if d > 0.5 or (d == 0.5 and f % 2 != 0) else f, a)


def jl_round_away(a):
    if not abs(a) < 4503599627370496.0:
        return a
    f = math.floor(abs(a))
    r = f + 1 if abs(a) - f >= 0.5 else f
    return jl_whole(r if a >= 0 else -r, a)


def jl_nan_side(a):
    return 0 if a == a else (-1 if math.copysign(1.0, a) < 0 else 1)


def jl_shl(a, s, n):
    return np.int64(a) << s if 0 <= s < n else np.int64(0)


def jl_sra(a, s, n):
    return np.int64(a) >> (s if 0 <= s < n else n - 1)


def jl_sra_unsigned(a, s, n):
    v = np.int64(a)
    return jl_sra(v - (1 << n) if v >= (1 << (n - 1)) else v, s, n)


def jl_srl(a, s, n):
    return (np.int64(a) & ((1 << n) - 1)) >> s if 0 <= s < n else np.int64(0)


def jl_srl64(a, s):
    # a logical right shift of a 64-bit value's bits (int64 or uint64) in int64 arithmetic: the
    # arithmetic shift with the copies of the sign bit masked off (jl_srl's mask needs 65 bits)
    i = np.int64(a)
    if s == 0:
        return i
    if 0 < s < 64:
        return (i >> s) & ~(np.int64(-1) << (64 - s))
    return np.int64(0)


def jl_cbrt(a):
    return math.copysign(abs(a) ** (1.0 / 3.0), a)


def jl_exp2(a):
    return 2.0 ** a


def jl_lt_to(a, b):
    ca = jl_nan_side(a)
    cb = jl_nan_side(b)
    if ca != cb:
        return ca < cb
    if ca != 0:
        return False
    if a == b:
        return math.copysign(1.0, a) < math.copysign(1.0, b)
    return a < b


def jl_le_to(a, b):
    return not jl_lt_to(b, a)


def jl_erfinv32(x):
    # M. Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011): the
    # single-precision polynomial XLA's erf_inv evaluates, in float32 as there
    if not (x > -1 and x < 1):
        return np.float32(math.copysign(math.inf, x)) if (x == 1 or x == -1) else np.float32(math.nan)
    w = -math.log1p(-x * x)
    if w < np.float32(5):
        w = w - np.float32(2.5)
        p = np.float32(2.81022636e-08)
        p = np.float32(3.43273939e-07) + p * w
        p = np.float32(-3.5233877e-06) + p * w
        p = np.float32(-4.39150654e-06) + p * w
        p = np.float32(0.00021858087) + p * w
        p = np.float32(-0.00125372503) + p * w
        p = np.float32(-0.00417768164) + p * w
        p = np.float32(0.246640727) + p * w
        p = np.float32(1.50140941) + p * w
    else:
        w = math.sqrt(w) - np.float32(3)
        p = np.float32(-0.000200214257)
        p = np.float32(0.000100950558) + p * w
        p = np.float32(0.00134934322) + p * w
        p = np.float32(-0.00367342844) + p * w
        p = np.float32(0.00573950773) + p * w
        p = np.float32(-0.0076224613) + p * w
        p = np.float32(0.00943887047) + p * w
        p = np.float32(1.00167406) + p * w
        p = np.float32(2.83297682) + p * w
    return np.float32(p * x)


def jl_erfinv64(x):
    # Giles' single-precision estimate, then Newton steps to float64 precision: on erf(z) - |x|
    # below 0.5, on log(erfc(z)) - log(1 - |x|) above (where erf(z) - |x| cancels and the
    # estimate is far off near 1, e.g. 12% at 1 - 2**-53); at most four steps
    if not (x > -1 and x < 1):
        return np.float64(math.copysign(math.inf, x)) if (x == 1 or x == -1) else np.float64(math.nan)
    a = abs(np.float64(x))
    if a == 0:
        return np.float64(x)
    z = np.float64(abs(jl_erfinv32(np.float32(a)))) if a < 0.999999 else np.float64(5.0)
    lq = math.log(1.0 - a)
    for _ in range(4):
        d = 1.1283791670955126 * math.exp(-z * z)
        if a < 0.5:
            dz = -(math.erf(z) - a) / d
        else:
            c = math.erfc(z)
            dz = (math.log(c) - lq) * c / d
        z = z + dz
        if abs(dz) <= 1e-15 * z:
            break
    return np.float64(math.copysign(z, x))


def jl_from_fields(neg, e, m, top, mbits, lowest):
    # the float of sign neg, biased exponent field e (top: all ones) and mantissa field m of
    # mbits bits, whose smallest subnormal is 2**lowest: exact (a NaN's payload is not kept)
    if e == top:
        v = math.inf if m == 0 else math.nan
    elif e == 0:
        v = math.ldexp(np.float64(m), lowest)
    else:
        v = math.ldexp(np.float64(m + (1 << mbits)), int(e + lowest - 1))
    return -v if neg else v


def jl_bits_f32(b):
    # the float32 whose bits are the 32-bit integer b (step code has no bit reinterpretation)
    u = np.int64(b) & 0xFFFFFFFF
    return np.float32(jl_from_fields(u >= 0x80000000, (u >> 23) & 0xFF, u & 0x7FFFFF, 255, 23, -149))


def jl_nextafter(x, y, mbits, lowest):
    # IEEE nextafter in a format of mbits mantissa bits whose smallest subnormal is 2**lowest,
    # from the spacing at x (step code has no bit reinterpretation, nor frexp); in float64,
    # where a float32 subnormal is a normal number
    if x != x or y != y:
        return x + y
    if x == y:
        return y
    one = np.float64(1.0)
    if x == 0:
        tiny = math.ldexp(one, lowest)
        return tiny if y > 0 else -tiny
    a = np.float64(abs(x))
    if a == math.inf:
        return math.copysign(math.ldexp(np.float64(2.0) - math.ldexp(one, -mbits), 1 - lowest - mbits), x)
    e = int(math.floor(math.log2(a)))
    if math.ldexp(one, e) > a:          # (log2 rounded up across a power of two)
        e -= 1
    elif math.ldexp(one, e + 1) <= a:
        e += 1
    up = (y > x) == (x > 0)
    k = e - mbits                       # the spacing in [2**e, 2**(e + 1))
    if not up and a == math.ldexp(one, e):
        k -= 1                          # below a power of two the spacing halves
    # scaled to [1, 2) and back, so that no operand of the add is subnormal (a thread that
    # reads subnormal operands as zeros, as XLA's CPU threads do, still gets it right)
    m = math.ldexp(a, -e)
    d = math.ldexp(one, max(k, lowest) - e)
    return math.copysign(math.ldexp(m + d if up else m - d, e), x)


def jl_bits_f64(b):
    # the float64 whose bits are the 64-bit integer b
    i = np.int64(b)
    return np.float64(jl_from_fields(i < 0, (i >> 52) & 0x7FF, i & 0xFFFFFFFFFFFFF, 2047, 52, -1074))
'''


# ----------------------------------------------------------------------------- indices
@dataclass(frozen=True)
class Ix:
    """An index expression: ``base + off`` (``base`` None: the constant ``off``), or an opaque
    ``text``; ``lo``/``hi`` bound its value (inclusive)."""
    base: str | None
    off: int
    lo: int
    hi: int
    text: str | None = None

    @property
    def expr(self) -> str:
        if self.text is not None:
            return self.text
        if self.base is None:
            return str(self.off)
        if self.off == 0:
            return self.base
        return f"{self.base} + {self.off}" if self.off > 0 else f"{self.base} - {-self.off}"

    def shift(self, k: int) -> "Ix":
        if k == 0:
            return self
        if self.text is not None:
            return Ix(None, 0, self.lo + k, self.hi + k, f"({self.text}) + {k}" if k > 0 else f"({self.text}) - {-k}")
        return Ix(self.base, self.off + k, self.lo + k, self.hi + k)

    def narrow(self, lo: int, hi: int) -> "Ix":
        return Ix(self.base, self.off, max(self.lo, lo), min(self.hi, hi), self.text)


def as_index(text: str, atom) -> str:
    """The Python int of an index value ``text`` of ``atom`` (a start index, a gathered index):
    ``int(x)``, but a uint64 goes through ``np.int64`` first, saturating, since Numba makes a
    uint64 mixed with an int64 a float64, which cannot index an array."""
    if isinstance(atom, tuple):          # ("ind", index array, position)
        atom = atom[1]
    if np.dtype(atom.dtype) == np.uint64:
        return f"np.int64(min({text}, np.uint64({2 ** 63 - 1})))"
    return f"int({text})"


def const_ix(k: int) -> Ix:
    return Ix(None, int(k), int(k), int(k))


def opaque(text: str, lo: int, hi: int) -> Ix:
    return Ix(None, 0, lo, hi, text)


class _CutLog(threading.local):
    """Where :func:`range_cond` records the conditions it leaves to run time (see
    ``Lowering.split_loop``); None: nowhere."""
    found = None


_cut_log = _CutLog()


def range_cond(ix: Ix, a: int, b: int):
    """The condition ``a <= ix < b``: True/False when the range of ``ix`` decides it, else its text."""
    need_lo = ix.lo < a
    need_hi = ix.hi >= b
    if ix.hi < a or ix.lo >= b:
        return False
    if not need_lo and not need_hi:
        return True
    if _cut_log.found is not None and ix.text is None and ix.base is not None:
        # the loop index values where the condition changes: ix.base + ix.off reaches a and b
        _cut_log.found.append((ix.base, a - ix.off, b - ix.off))
    e = ix.expr
    if need_lo and need_hi:
        return f"{a} <= {e} < {b}"
    return f"{e} >= {a}" if need_lo else f"{e} < {b}"


# ----------------------------------------------------------------------------- literals
def literal(value, dtype) -> str:
    dtype = np.dtype(dtype)
    v = np.asarray(value, dtype)[()]
    if dtype == BOOL:
        return "True" if bool(v) else "False"
    if dtype.kind == "f":
        f = float(v)
        if math.isnan(f):
            s = "math.nan"
        elif math.isinf(f):
            s = "math.inf" if f > 0 else "-math.inf"
        else:
            s = repr(f)
        return f"np.{dtype.name}({s})"
    return f"np.{dtype.name}({int(v)})"


def cast(expr: str, dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == BOOL:
        return f"bool({expr})"
    return f"np.{dtype.name}({expr})"


def zero(dtype) -> str:
    return literal(0, dtype)


# ----------------------------------------------------------------------------- blocks
@dataclass(eq=False)
class Block:
    """Statements at one place of the step: the top of a stage (``loop`` None) or the body of a
    parallel loop."""
    stage: int
    indent: str
    lines: list = field(default_factory=list)
    memo: dict = field(default_factory=dict)
    loop: "Loop | None" = None
    parent: "Block | None" = None   # a nested loop's body: the block the loop is in

    def find(self, key):
        """A value already computed here, or before the nested loop this block is the body of."""
        b = self
        while b is not None:
            if key in b.memo:
                return b.memo[key]
            b = b.parent
        return None


@dataclass(eq=False)
class Loop:
    stage: int
    space: tuple            # the index space's shape
    box: tuple = ()         # (lo, hi) per dimension: the bounding box of the items
    items: list = field(default_factory=list)
    body: Block | None = None
    names: tuple = ()
    # split (Lowering.split_loop): the loops that run instead, each (header, body lines)
    pieces: list = field(default_factory=list)


@dataclass(eq=False)
class Item:
    """Work of a parallel loop: a store (``target`` params, index maker) or a reduction."""
    kind: str               # "store" | "reduce" | "scatter" | "sort" (atom: the scatter's or sort's Eqn)
    atom: object            # the value
    box: tuple              # the cells it covers
    target: str = ""        # the array stored into
    index: object = None    # fn(loop Ix tuple) -> list of index texts of the store
    op: str = ""            # reduce: sum | max | min | or | and
    acc: str = ""           # reduce: the per-thread accumulator's name
    result: str = ""        # reduce: the reduced value's name


@dataclass
class CarryPlan:
    """How the step keeps one carry leaf."""
    kind: str               # "pair" (two buffers), "inplace" (one buffer, updated in place),
    #                         "same" (unchanged), "count" (integer counter: k0 + c*t)
    name: str = ""
    next_name: str = ""
    step: int = 0           # "count": the increment


@dataclass
class StepPlan:
    source: str
    name: str
    params: list            # (name, role, payload) in parameter order
    swap: list
    carries: list           # CarryPlan per carry leaf
    returns_condition: bool
    sequential: bool
    # the step without split loops (Lowering.split_loop), when ``source`` has some: a stencil
    # that tile mode can keep on chip stays one loop
    plain_source: str | None = None


class Lowering:
    """Build the step of one program. ``roles`` gives each input Var its role:
    ("index",) the loop index, ("carry", k), ("x", k) (scan: xs leaf k at the scan position);
    ``out_roles`` each output's: ("carry", k), ("y", k), ("cond",)."""

    #: whether parallel loops are split into interior and rim (split_loop)
    splits = True

    def __init__(self, prog: Program, roles: list, out_roles: list, *, ys_shapes=(), scan_length=None,
                 reverse=False, name="jl_step"):
        self.prog, self.roles, self.out_roles = prog, roles, out_roles
        self.ys_shapes = ys_shapes
        self.scan_length = scan_length
        self.reverse = reverse
        self.name = name
        self.counter = 0
        self.input_role = {v: r for v, r in zip(prog.invars, roles)}
        self.const_names = {}
        self.params: list = []
        self.carries: dict[int, CarryPlan] = {}
        self._start(prog)

    def _start(self, prog: Program, load_vars=()):
        """The state of lowering ``prog`` (an enclosing program's ``Lowering`` and a nested
        loop's ``PhaseLowering`` alike); then its nested loops are unrolled or marked."""
        self.prog = prog
        self.scalar_names = {}      # Var -> top-level name
        self.stage_memo = {}
        self.pre: dict[int, Block] = {}
        self.loops: list[Loop] = []
        self.post: dict[int, list] = {}
        self.load_vars = set(load_vars)     # top-level names read from arrays (not the same on every thread)
        self.load_dtypes = {}       # the name of each plain load (load_input) -> its dtype
        self.final: list = []       # (target text, value text) single-thread stores at the end
        self.uses_t = False
        self.scratch = {}           # Var -> the buffer a scatter to computed indices is built in
        self.syncs = set()          # stages whose loops end with a barrier (lk.sync())
        self.sub_env = {}           # a nested loop's carry Var -> its name, while its body is lowered
        self.inner_vars = set()     # every Var a nested loop's body or condition defines
        self.inner_blocks = []      # the blocks of the nested loop bodies being lowered
        self.nested_checked = set()
        self.serial, self.serial_text = [], []     # (stage, eqn): one thread's work (lu, ...)
        self.phased_marked = set()  # the nested loops that run in phases
        self.phased = {}            # ... -> its PhasedLoop
        self.phased_text = {}       # ... -> its statements (generated with the parallel loops)
        self.unroll_nested()
        for e in walk_eqns(self.prog.eqns):
            if e.prim == "nested_loop":
                self.inner_vars.update(o for q in walk_eqns(e.params["body"] + e.params["cond"]) for o in q.outs)

    # ---------------------------------------------------------------- helpers
    def fresh(self, prefix="a") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def top(self, stage: int) -> Block:
        if stage not in self.pre:
            self.pre[stage] = Block(stage, "    ")
        return self.pre[stage]

    def unsupported(self, eqn: Eqn, reason=""):
        prim = f"{eqn.params['kind']} (a nested loop)" if eqn.prim == "nested_loop" else eqn.prim
        raise Unsupported(prim, eqn.where, reason)

    def unroll_nested(self):
        """Unroll each nested loop of the program that cannot run per element (it reads other
        elements of an array carry: a stencil, a reduction, a gather) and has a static count of
        at most :data:`UNROLL_MAX` iterations: its body once per iteration, each iteration's new
        array carries materialised in buffers of their own (``materialize``: stored in one
        stage, read after a barrier), so that iteration k + 1 reads what iteration k wrote.
        Any other nested loop that cannot run per element runs in phases (:class:`PhasedLoop`)."""
        ids = [-1]

        def new_id():
            ids[0] -= 1
            return ids[0]
        changed = True
        while changed:
            changed = False
            for pos, e in enumerate(self.prog.eqns):
                if e.prim != "nested_loop" or e in self.phased_marked:
                    continue
                sequences = e.params["n_xs"] or e.params["n_ys"]
                if not sequences:
                    try:
                        self.check_nested(e)
                        continue
                    except Unsupported as why:
                        if e.params["test"] is not None and e.params["test"].shape:
                            # a vmapped while_loop (one condition per element, XLA selecting each
                            # element's new carry while its own condition holds) is each element's
                            # own loop only when it runs per element
                            raise Unsupported("while", e.where, f"a while_loop with one condition per element "
                                                                f"(bool{list(e.params['test'].shape)}: a vmapped "
                                                                f"while_loop) that cannot run per element: "
                                                                f"{why.reason}") from None
                if e.params["kind"] == "scan" and e.params["length"] <= UNROLL_MAX:
                    self.prog.eqns[pos:pos + 1] = self._unrolled(e, new_id)
                    changed = True
                    break
                if not sequences:       # (a longer scan over xs or with ys: check_nested says why not)
                    self.phased_marked.add(e)
        count_uses(self.prog)

    def _unrolled(self, e: Eqn, new_id) -> list:
        p = e.params
        n, nk = int(p["length"]), p["n_inits"]
        cur = list(e.ins[:nk])
        xs = e.ins[nk:nk + p["n_xs"]]
        eqns, ys = [], [None] * n
        for it in range(n):
            pos = n - 1 - it if p["reverse"] else it
            env = dict(zip(p["carries"], cur))
            for xv, xa in zip(p["xs_vars"], xs):      # the iteration's slice of xs: xs[pos]
                row = Var((1,) + tuple(xv.shape), xv.dtype, xv.weak, new_id())
                cut = Eqn("slice", {"start_indices": (pos,) + (0,) * len(xv.shape),
                                    "limit_indices": (pos + 1,) + tuple(xv.shape), "strides": None},
                          [xa], [row], e.where)
                one = Var(tuple(xv.shape), xv.dtype, xv.weak, new_id())
                drop = Eqn("squeeze", {"dimensions": (0,)}, [row], [one], e.where)
                row.eqn, one.eqn = cut, drop
                eqns += [cut, drop]
                env[xv] = one
            made = clone_eqns(p["body"], env, new_id)
            eqns += made
            fresh = {o for q in made for o in q.outs}
            ys[pos] = [env.get(o, o) if isinstance(o, Var) else o for o in p["outs"][nk:]]
            cur = []
            for o in p["outs"][:nk]:
                a = env.get(o, o) if isinstance(o, Var) else o
                if isinstance(a, Var) and a.shape and a in fresh:
                    m = Var(a.shape, a.dtype, a.weak, new_id())
                    q = Eqn("materialize", {}, [a], [m], e.where)
                    m.eqn = q
                    eqns.append(q)
                    a = m
                cur.append(a)
        for out, a in zip(e.outs, cur):     # the loop's results, read where they were before
            q = Eqn("copy", {}, [a], [out], e.where)
            out.eqn = q
            eqns.append(q)
        for k, out in enumerate(e.outs[nk:]):       # ys: the iterations' slices, stacked
            q = Eqn("stack", {"axis": 0}, [ys[pos][k] for pos in range(n)], [out], e.where)
            out.eqn = q
            eqns.append(q)
        return eqns

    def check_dtypes(self):
        for v in self.prog.invars:
            if v.dtype not in OK_DTYPES:
                raise Unsupported(f"dtype {v.dtype}", "the loop's carry (or scan's xs)",
                                  "float32, float64, ints and bool only")
        # an array the body closes over (a kernel parameter) is named where it is used
        closed_over = {v for v, _ in self.prog.consts if v.dtype not in OK_DTYPES}
        for e in walk_eqns(self.prog.eqns):
            for x in e.ins if closed_over else ():
                if x in closed_over:
                    self.unsupported(e, f"an array it closes over of dtype {x.dtype}")
            for o in e.outs:
                if o.dtype not in OK_DTYPES:
                    self.unsupported(e, f"dtype {o.dtype}")
            if e.prim not in RULES and e.prim not in REDUCTIONS + SCATTERS + LINALG + ("materialize", "sort"):
                self.unsupported(e)

    # ---------------------------------------------------------------- stages
    def stage(self, a) -> int:
        if not isinstance(a, Var) or a.eqn is None:
            return 0
        if a in self.stage_memo:
            return self.stage_memo[a]
        e = a.eqn
        s = max([self.stage(x) for x in e.ins] or [0])
        if e.prim in ("materialize", "sort") + LINALG or e in self.phased_marked:
            s += 1      # stored in the stage of its operands (or inputs), read after a barrier
        elif self.computed_scatter(e):
            # the operand is copied into the buffer in its own stage, the updates go in after a
            # barrier, and the result is read after another
            x, ind, upd = e.ins
            s = max(self.stage(x) + 1, self.stage(ind), self.stage(upd)) + 1
        elif e.prim.startswith("reduce_") and len(e.params.get("axes", ())) == len(e.ins[0].shape) and e.ins[0].shape:
            s += 1
        elif e.prim == "dot_general" and not a.shape and e.ins[0].shape:
            s += 1
        self.stage_memo[a] = s
        return s

    # ---------------------------------------------------------------- expressions
    def E(self, a, idx: tuple, ctx, B: Block) -> str:
        """The expression of ``a`` at ``idx`` (Ix per dimension) in block ``B`` under the
        condition ``ctx`` (text, or None)."""
        if isinstance(a, Lit):
            return literal(a.value, a.value.dtype)
        if a in self.sub_env:
            return self.sub_env[a]
        if not a.shape:
            return self.S(a, B)
        if len(idx) == len(a.shape):
            # an extent of 1 is read at index 0 whatever the index: JAX's binary primitives
            # stretch a size-1 operand themselves (``c[:1] + c`` is ``add f32[1] f32[6]``, no
            # broadcast_in_dim), and 0 is the only index that such a dimension has. An index
            # already known to be 0 stays as it is (``v[:1]`` in a concatenation, read at the
            # loop's index there: the stencil analysis sees the loop index plus a constant)
            idx = tuple(const_ix(0) if n == 1 and (i.lo, i.hi) != (0, 0) else i for n, i in zip(a.shape, idx))
        if a.eqn is None or a in self.scratch:
            return self.load_input(a, idx, ctx, B)
        key = (a, tuple(i.expr for i in idx), ctx)
        found = B.find(key)
        if found is not None:
            return found
        e = a.eqn
        text = RULES[e.prim](self, e, a, idx, ctx, B)
        if a.uses > 1 and not _trivial(text):
            text = self.bind(text, a.dtype, ctx, B)
        B.memo[key] = text
        return text

    def bind(self, text, dtype, ctx, B) -> str:
        name = self.fresh()
        B.lines.append(f"{name} = {text}" if ctx is None else f"{name} = {text} if {ctx} else {zero(dtype)}")
        if self._varying(text) or (ctx is not None and self._varying(ctx)):
            self.load_vars.add(name)
        return name

    def S(self, a, B: Block | None = None) -> str:
        """A scalar value: a name (or literal) computed at the top of its stage."""
        if isinstance(a, Lit):
            return literal(a.value, a.value.dtype)
        if a in self.sub_env:
            return self.sub_env[a]
        if a in self.inner_vars:        # changes from one iteration of its nested loop to the next
            return self.inner_scalar(a, B if B is not None else self.inner_blocks[-1])
        if a in self.scalar_names:
            return self.scalar_names[a]
        if a.eqn is None:
            name = self.scalar_input(a)
            self.scalar_names[a] = name
            return name
        st = self.stage(a)
        T = self.top(st)
        e = a.eqn
        if (e.prim in REDUCTIONS and e.ins[0].shape) or (e.prim == "dot_general" and e.ins[0].shape):
            text = self.full_reduction(e, a)
        else:
            text = RULES[e.prim](self, e, a, (), None, T)
        if _trivial(text):
            self.scalar_names[a] = text
            return text
        name = self.fresh("s")
        T.lines.append(f"{name} = {text}")
        if self._varying(text):
            self.load_vars.add(name)
        self.scalar_names[a] = name
        return name

    # ---------------------------------------------------------------- inputs
    def add_param(self, name, role, payload=None):
        self.params.append((name, role, payload))
        return name

    def load_input(self, a, idx, ctx, B) -> str:
        key = (a, tuple(i.expr for i in idx), ctx)
        found = B.find(key)
        if found is not None:
            return found
        role = self.input_role.get(a)
        if a in self.scratch:
            text = f"{self.scratch[a]}[{', '.join(i.expr for i in idx)}]"
        elif role is None:      # a closed-over constant array
            name = self.const_names[a]
            text = f"{name}[{', '.join(i.expr for i in idx)}]"
        elif role[0] == "carry":
            text = f"{self.carries[role[1]].name}[{', '.join(i.expr for i in idx)}]"
        elif role[0] == "x":
            text = f"{self.x_names[role[1]]}[{', '.join([self.scan_pos()] + [i.expr for i in idx])}]"
        else:   # pragma: no cover
            raise AssertionError(role)
        if ctx is None:
            name = self.fresh("l")
            B.lines.append(f"{name} = {text}")
            self.load_vars.add(name)        # a load is not the same on every thread, to the validator
            self.load_dtypes[name] = a.dtype
            text = name
        B.memo[key] = text
        return text

    def scan_pos(self) -> str:
        self.uses_t = True
        return f"{self.scan_length - 1} - t" if self.reverse else "t"

    def scalar_input(self, a) -> str:
        role = self.input_role.get(a)
        T = self.top(0)
        if role is None:
            return self.const_names[a]
        if role[0] == "index":
            self.uses_t = True
            name = "ti"
            T.lines.insert(0, f"ti = {cast('lo_ + t', a.dtype)}")
            return name
        if role[0] == "carry":
            plan = self.carries[role[1]]
            if plan.kind == "count":
                self.uses_t = True
                name = self.fresh("m")
                T.lines.append(f"{name} = {cast(f'{plan.name} + {plan.step} * t', a.dtype)}")
                return name
            name = self.fresh("w")
            T.lines.append(f"{name} = {plan.name}[0]")
            self.load_vars.add(name)
            return name
        if role[0] == "x":
            name = self.fresh("z")
            T.lines.append(f"{name} = {self.x_names[role[1]]}[{self.scan_pos()}]")
            self.load_vars.add(name)
            return name
        raise AssertionError(role)   # pragma: no cover

    # ---------------------------------------------------------------- loops
    def loop_for(self, stage: int, space: tuple) -> Loop:
        for L in self.loops:
            if L.stage == stage and L.space == space:
                return L
        L = Loop(stage, space)
        self.loops.append(L)
        return L

    def add_item(self, stage: int, space: tuple, item: Item):
        L = self.loop_for(stage, space)
        if L.body is not None:
            raise Unsupported("internal", "", "work added to a loop already generated")
        L.items.append(item)

    def full_reduction(self, e: Eqn, out: Var) -> str:
        """A reduction of a whole array (reduce_* over every axis, or a full dot): a per-thread
        accumulator in the loop of the input's stage, then the grid reduction."""
        if e.prim == "dot_general":
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
            x, y = e.ins
            if lb or rb or len(lc) != len(x.shape) or len(rc) != len(y.shape):
                self.unsupported(e, "a dot to a scalar over every axis only")
            op, src = "sum", ("dot", x, y, tuple(lc), tuple(rc))
            space = tuple(x.shape[d] for d in lc)
            st = max(self.stage(x), self.stage(y))
        else:
            op = e.prim[len("reduce_"):]
            src = e.ins[0]
            space = tuple(src.shape)
            st = self.stage(src)
        if op not in ("sum", "max", "min", "or", "and"):
            self.unsupported(e)
        acc = self.fresh("acc")
        res = self.fresh("r")
        dt = out.dtype
        self.add_item(st, space, Item("reduce", src, tuple((0, n) for n in space), op=op, acc=acc, result=res))
        T = self.top(st)
        if op == "sum":
            init = zero(np.float64 if dt.kind == "f" else dt if dt != BOOL else np.int64)
        elif op in ("max", "min"):
            if dt.kind == "f":
                init = literal(-np.inf if op == "max" else np.inf, dt)
            elif dt == BOOL:
                init = "False" if op == "max" else "True"
            else:
                info = np.iinfo(dt)
                init = literal(info.min if op == "max" else info.max, dt)
        else:
            init = "0" if op == "or" else "1"
        T.lines.append(f"{acc} = {init}")
        fn = {"sum": "lk.sum", "max": "lk.max", "min": "lk.min", "or": "lk.max", "and": "lk.min"}[op]
        if op in ("or", "and") or dt == BOOL:
            expr = f"{fn}({acc}) > 0"
        elif dt.kind == "f":
            expr = cast(f"{fn}({acc})", dt)
        else:
            expr = cast(f"{fn}({acc})", dt)
        self.post.setdefault(st, []).append(f"{res} = {expr}")
        return res

    # ---------------------------------------------------------------- the program
    def plan_carries(self, carry_in: dict, carry_out: dict, sequential_hint: bool):
        for k, vin in carry_in.items():
            vout = carry_out[k]
            shape = vin.shape
            if vout is vin:
                self.carries[k] = CarryPlan("same", self.add_param(f"c{k}", "carry", k))
                continue
            if (not shape and vin.dtype.kind in "iu" and isinstance(vout, Var) and vout.eqn is not None
                    and vout.eqn.prim in ("add", "sub") and vout.eqn.ins[0] is vin
                    and isinstance(vout.eqn.ins[1], Lit)):
                c = int(vout.eqn.ins[1].value)
                self.carries[k] = CarryPlan("count", self.add_param(f"c{k}", "count", k),
                                            step=c if vout.eqn.prim == "add" else -c)
                continue
            if (shape and vin.uses == 1 and isinstance(vout, Var) and vout.eqn is not None and vout.uses == 1
                    and vout.eqn.ins[0] is vin and vout.eqn.prim in ("scatter", "dynamic_update_slice")
                    and self.dynamic_window(vout.eqn) is not None):
                self.carries[k] = CarryPlan("inplace", self.add_param(f"c{k}", "carry", k))
                continue
            a = self.add_param(f"c{k}", "carry", k)
            b = self.add_param(f"c{k}n", "carry_next", k)
            self.carries[k] = CarryPlan("pair", a, b)

    def dynamic_window(self, e: Eqn):
        """(start index atoms per operand dim, update var) of a scatter/dynamic_update_slice
        that writes one window whose start is a scalar expression, or None."""
        if e.prim == "dynamic_update_slice":
            return list(e.ins[2:]), e.ins[1], "clamp"
        dn = e.params["dimension_numbers"]
        op, ind, upd = e.ins
        if getattr(dn, "operand_batching_dims", ()) or ind.shape != (len(dn.scatter_dims_to_operand_dims),):
            return None
        starts = [None] * len(op.shape)
        for pos, d in enumerate(dn.scatter_dims_to_operand_dims):
            starts[d] = ("ind", ind, pos)
        # mode=clip moves the window into the operand, as dynamic_update_slice does; the other
        # modes drop a window that does not fit (before session 28 clip was dropped too, in the
        # in-place store of a carry: silently other values than lax)
        return starts, upd, "clamp" if "CLIP" in str(e.params.get("mode")) else "drop"

    def owns(self, v) -> bool:
        """Whether this lowering computes ``v`` (a nested loop's body reads the enclosing
        program's values from the enclosing lowering)."""
        return True

    def computed_from(self, roots):
        """Every Var this lowering computes that ``roots`` depend on (each once)."""
        seen, stack = set(), [r for r in roots if isinstance(r, Var)]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v.eqn is not None and self.owns(v):
                yield v
                stack += [x for x in v.eqn.ins if isinstance(x, Var)]

    def reachable_reductions(self, roots):
        order = [v for v in self.computed_from(roots) if not v.shape and v.eqn.ins and isinstance(v.eqn.ins[0], Var)
                 and v.eqn.ins[0].shape and (v.eqn.prim in REDUCTIONS or v.eqn.prim == "dot_general")]
        return sorted(order, key=self.stage)

    def build(self, carry_in, carry_out, xs_in, ys_out, cond, consts) -> StepPlan:
        self.check_dtypes()
        self.x_names = {}
        for k in sorted(xs_in):
            self.x_names[k] = self.add_param(f"x{k}", "x", k)
        self.plan_carries(carry_in, carry_out, False)
        self.y_names = {k: self.add_param(f"y{k}", "y", k) for k in sorted(ys_out)}
        for i, (v, val) in enumerate(consts):
            name = f"g{i}"
            self.const_names[v] = self.add_param(name, "const" if v.shape else "const_scalar", i)
        self.add_param("lo_", "lo")
        roots = list(carry_out.values()) + list(ys_out.values()) + [cond]
        # a scatter or materialised value that is only a new carry is built in the carry's
        # second buffer (an unrolled nested loop's result is a copy of its last materialisation)
        direct = {}
        for k, p in self.carries.items():
            v = carry_out[k]
            if p.kind != "pair" or not isinstance(v, Var) or v.uses != 1:
                continue
            if v.eqn is not None and v.eqn.prim == "copy" and isinstance(v.eqn.ins[0], Var) and \
                    v.eqn.ins[0].uses == 1 and v.eqn.ins[0].eqn is not None and \
                    v.eqn.ins[0].eqn.prim == "materialize":
                v = v.eqn.ins[0]
            direct[v] = p.next_name
        self.materialize(roots, direct)
        # every whole-array reduction first (their loops must exist before loops are rendered)
        for v in self.reachable_reductions(roots):
            self.S(v)
        # the carries
        for k, plan in self.carries.items():
            vout = carry_out[k]
            vin = carry_in[k]
            shape = vin.shape
            if plan.kind in ("same", "count"):
                continue
            if not shape:
                val = self.S(vout) if isinstance(vout, Var) else literal(vout.value, vin.dtype)
                self.final.append((plan, "[0]", val, self.stage(vout)))
                continue
            if plan.kind == "inplace":
                self.inplace_store(plan, vout.eqn)
                continue
            built = vout.eqn.ins[0] if vout.eqn is not None and vout.eqn.prim == "copy" else vout
            if self.scratch.get(vout) == plan.next_name or self.scratch.get(built) == plan.next_name:
                continue        # built there by materialize
            if isinstance(vout, Lit):
                val = Var(shape, vin.dtype, False, -1)   # pragma: no cover - literals are scalars
            self.store_carry(vout, vin, plan.next_name)
        for k, v in ys_out.items():
            name = self.y_names[k]
            if not v.shape:
                val = self.S(v) if isinstance(v, Var) else literal(v.value, v.dtype)
                self.final.append((None, f"{name}[{self.scan_pos()}]", val, self.stage(v)))
                continue
            self.add_item(self.stage(v), v.shape, Item("store", v, tuple((0, n) for n in v.shape), target=name,
                                                         index=_row_index(self.scan_pos())))
        cond_text = None
        if cond is not None:
            cond_text = self.S(cond) if isinstance(cond, Var) else literal(cond.value, BOOL)
        return self.render(cond_text, cond)

    def store_carry(self, vout, vin, target):
        """Store the new carry ``vout`` into ``target``: only over the windows where it differs
        from the old carry ``vin`` (both buffers start equal), else everywhere."""
        windows = self.identity_windows(vout, vin)
        for box in windows if windows is not None else [tuple((0, n) for n in vin.shape)]:
            self.add_item(self.stage(vout), vin.shape, Item("store", vout, box, target=target, index=_own_index))

    def store_whole(self, stage: int, value, shape: tuple, target: str):
        """Store every element of ``value`` into the buffer ``target`` in the loops of ``stage``."""
        self.add_item(stage, shape, Item("store", value, tuple((0, n) for n in shape), target=target,
                                         index=_own_index))

    def new_buffer(self, shape, dtype) -> str:
        """A ``scratch`` parameter: a buffer of ``shape`` the step writes before it reads it."""
        return self.add_param(self.fresh("h"), "scratch", (tuple(shape), dtype))

    def identity_windows(self, vout, vin):
        """The static boxes outside which ``vout`` equals ``vin`` (a chain of scatters with
        constant indices onto ``vin``), or None."""
        boxes = []
        v = vout
        while isinstance(v, Var) and v is not vin:
            e = v.eqn
            if e is None or e.prim not in SCATTERS + ("dynamic_update_slice",):
                return None
            if v is not vout and v.uses != 1:
                return None
            w = self.static_window(e)
            if w is None:
                return None
            boxes.append(w)
            v = e.ins[0]
        if v is not vin or not boxes:
            return None
        return boxes

    def static_window(self, e: Eqn):
        """The box a scatter/dynamic_update_slice with constant start indices writes, or None
        (dynamic start, or a window that is dropped)."""
        r = self.dynamic_window(e)
        if r is None:
            return None
        starts, upd, mode = r
        op = e.ins[0]
        sizes = self.window_sizes(e, op, upd)
        box = []
        for d, n in enumerate(op.shape):
            s = starts[d]
            if s is None:
                st = 0
            else:
                c = self.const_int(s)
                if c is None:
                    return None
                st = c
            if mode == "clamp":
                st = min(max(st, 0), n - sizes[d])
            elif st < 0 or st + sizes[d] > n:
                return None
            box.append((st, st + sizes[d]))
        return tuple(box)

    def window_sizes(self, e, op, upd):
        if e.prim == "dynamic_update_slice":
            return list(upd.shape)
        dn = e.params["dimension_numbers"]
        sizes = [1] * len(op.shape)
        batching = getattr(dn, "operand_batching_dims", ())
        rest = [d for d in range(len(op.shape)) if d not in dn.inserted_window_dims and d not in batching]
        if len(rest) != len(dn.update_window_dims):
            self.unsupported(e, "scatter layout")
        for d, ud in zip(rest, dn.update_window_dims):
            sizes[d] = upd.shape[ud]
        return sizes

    def const_int(self, s):
        """The value of a start index given as an atom or ("ind", indices var, position), if constant."""
        if isinstance(s, tuple):
            _, ind, pos = s
            vals = self.const_value(ind)
            return None if vals is None else int(np.asarray(vals).reshape(-1)[pos])
        v = self.const_value(s)
        return None if v is None else int(v)

    def const_value(self, a, depth=0):
        if isinstance(a, Lit):
            return a.value
        if not isinstance(a, Var) or a.eqn is None or depth > 8 or a.size > 64:
            return None
        e = a.eqn
        vals = [self.const_value(x, depth + 1) for x in e.ins]
        if any(v is None for v in vals):
            return None
        p = e.params
        try:
            if e.prim == "broadcast_in_dim":
                return np.broadcast_to(np.asarray(vals[0]).reshape(
                    [a.shape[d] if d in p["broadcast_dimensions"] and np.ndim(vals[0]) else 1
                     for d in range(len(a.shape))]), a.shape).astype(a.dtype)
            if e.prim == "concatenate":
                return np.concatenate([np.atleast_1d(v) for v in vals], axis=p["dimension"]).astype(a.dtype)
            if e.prim in ("convert_element_type", "reshape", "squeeze", "copy", "copy_p", "stop_gradient"):
                return np.asarray(vals[0]).astype(a.dtype).reshape(a.shape)
            if e.prim in ("add", "sub", "mul"):
                f = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[e.prim]
                return f(vals[0], vals[1]).astype(a.dtype)
        except Exception:
            return None
        return None

    def scatter_index(self, s, B) -> str:
        """The text of a (possibly dynamic) start index, computed at the top of the step."""
        if isinstance(s, tuple):
            _, ind, pos = s
            c = self.const_value(ind)
            if c is not None:
                return str(int(np.asarray(c).reshape(-1)[pos]))
            return self.E(ind, (const_ix(pos),), None, B)
        return self.S(s)

    def inplace_store(self, plan: CarryPlan, e: Eqn):
        starts, upd, mode = self.dynamic_window(e)
        op = e.ins[0]
        sizes = self.window_sizes(e, op, upd)
        st = max(self.stage(upd), max([self.stage(s if not isinstance(s, tuple) else s[1]) for s in starts
                                         if s is not None] or [0]))
        T = self.top(st)
        names, conds = [], []
        for d, n in enumerate(op.shape):
            s = starts[d]
            if s is None:
                names.append("0")
                continue
            text = self.scatter_index(s, T)
            nm = self.fresh("p")
            if mode == "clamp":
                T.lines.append(f"{nm} = min(max({as_index(text, s)}, 0), {n - sizes[d]})")
            else:
                T.lines.append(f"{nm} = {as_index(text, s)}")
                conds.append(f"0 <= {nm} <= {n - sizes[d]}")
            names.append(nm)
        guard = " and ".join(conds) if conds else None
        if e.prim == "dynamic_update_slice":
            umap = list(range(len(op.shape)))
        else:
            dn = e.params["dimension_numbers"]
            rest = [d for d in range(len(op.shape)) if d not in dn.inserted_window_dims]
            umap = [None] * len(op.shape)
            for d, ud in zip(rest, dn.update_window_dims):
                umap[d] = ud
        add = e.prim in ("scatter-add", "scatter_add")
        if not upd.shape:
            val = self.S(upd) if isinstance(upd, Var) else literal(upd.value, upd.dtype)
            target = f"{plan.name}[{', '.join(names)}]"
            if add:
                val = f"{target} + {val}"
            self.final.append((None, target, val, st, guard))
            return

        def index(ix, names=names, umap=umap, nd=len(op.shape)):
            out = []
            for d in range(nd):
                out.append(names[d] if umap[d] is None else (ix[umap[d]].expr if names[d] == "0"
                                                              else f"{names[d]} + {ix[umap[d]].expr}"))
            return out
        if add:
            self.unsupported(e, "an in-place scatter-add of an array")
        self.add_item(st, upd.shape, Item("store", upd, tuple((0, n) for n in upd.shape), target=plan.name,
                                            index=index, op=guard or ""))

    # ---------------------------------------------------------------- scatters to computed indices
    def computed_scatter(self, e: Eqn) -> bool:
        """Whether ``e`` scatters one window per index vector of an index array known only at
        run time (``h.at[idx].add(w)``, ``jax.ops.segment_sum``, ``m.at[i, j].set(v)``). Such a
        scatter is no index function: :meth:`materialize` builds its result in a buffer."""
        return e.prim in SCATTERS and self.dynamic_window(e) is None and _strided_form(e) is None

    def materialize(self, roots, direct):
        """Give every scatter to computed indices and every ``materialize`` that ``roots`` depend
        on a buffer of its own (a ``scratch`` parameter, one per call). A materialised value is
        stored into it by the loops of its stage and read after a barrier. For a scatter, the
        operand is copied into it by the loops of the operand's stage, then (after a barrier) a
        parallel loop over the updates adds them atomically (``lk.atomic.add``) or stores them,
        and after another barrier later stages read the buffer. The stages are :meth:`stage`'s.
        ``direct`` maps a value that is only a new carry to that carry's second buffer, which is
        then its buffer (nothing else writes it during the step)."""
        found = [v for v in self.computed_from(roots) if v.eqn.prim in ("materialize", "sort") + LINALG or
                 self.computed_scatter(v.eqn) or v.eqn in self.phased_marked]
        for v in sorted(found, key=self.stage):
            e = v.eqn
            if e.prim == "sort":
                if v not in self.scratch:
                    self.materialize_sort(e)
                continue
            if e.prim in LINALG:
                if v not in self.scratch:
                    self.materialize_linalg(e)
                continue
            if e in self.phased_marked:
                if e not in self.phased:
                    self.phased[e] = PhasedLoop(self, e)
                    self.phased_text[e] = []
                continue
            if e.prim == "materialize":
                name = direct.get(v) or self.new_buffer(v.shape, v.dtype)
                self.scratch[v] = name
                x = e.ins[0]
                self.store_whole(self.stage(x), x, tuple(v.shape), name)
                self.syncs.add(self.stage(x))
                continue
            x, ind, upd = e.ins
            if ind.dtype.kind not in "iu":
                self.unsupported(e, f"scatter indices of {ind.dtype}")
            if e.prim != "scatter" and str(v.dtype) not in ATOMIC_DTYPES:
                self.unsupported(e, f"a scatter-add to computed indices of {v.dtype} (it runs as atomic adds, "
                                    f"of {', '.join(ATOMIC_DTYPES)} only)")
            self.window_sizes(e, x, upd)        # an unsupported layout raises here
            name = direct.get(v) or self.new_buffer(v.shape, v.dtype)
            self.scratch[v] = name
            sx, sa = self.stage(x), self.stage(v) - 1
            self.store_whole(sx, x, tuple(v.shape), name)
            self.add_item(sa, tuple(upd.shape), Item("scatter", e, tuple((0, n) for n in upd.shape), target=name))
            self.syncs.update((sx, sa))

    def materialize_sort(self, e: Eqn):
        """``lax.sort`` (``jnp.sort``, ``argsort``) of rows of at most :data:`SORT_MAX` along its
        dimension, one key: each element counts the elements of its row that sort before it
        (JAX's order: NaNs last, ties kept in place) and stores every operand's element at that
        position of the results' buffers, in the operands' stage; read after a barrier."""
        p = e.params
        if p.get("num_keys", 1) != 1:
            self.unsupported(e, "a sort with several keys")
        shape = tuple(e.ins[0].shape)
        if shape[p["dimension"]] > SORT_MAX:
            self.unsupported(e, f"a sort of rows longer than {SORT_MAX} (each element counts its row: n^2 work; "
                                "XLA's sort is faster there)")
        for o in e.outs:
            self.scratch[o] = self.new_buffer(shape, o.dtype)
        st = max(self.stage(a) for a in e.ins)
        self.add_item(st, shape, Item("sort", e, tuple((0, n) for n in shape)))
        self.syncs.add(st)

    def materialize_linalg(self, e: Eqn):
        """``lu`` (partial pivoting, as LAPACK's getrf: the first largest magnitude in the column),
        ``triangular_solve`` (left side) and ``cholesky`` of one matrix of at most
        :data:`LINALG_MAX` (what ``jnp.linalg.solve``, ``inv`` and ``cholesky`` are made of): one
        thread computes each into the results' buffers in the inputs' stage; read after a
        barrier."""
        a = e.ins[0]
        if len(a.shape) != 2 or a.shape[0] != a.shape[1] or a.shape[0] > LINALG_MAX or a.dtype.kind != "f":
            self.unsupported(e, f"one float matrix of at most {LINALG_MAX} x {LINALG_MAX} only")
        if e.prim == "triangular_solve" and (not e.params.get("left_side", False) or len(e.ins[1].shape) != 2):
            self.unsupported(e, "a solve from the left of a 2-D right-hand side only")
        for o in e.outs:
            self.scratch[o] = self.new_buffer(o.shape, o.dtype)
        st = max(self.stage(x) for x in e.ins)
        self.serial.append((st, e))
        self.syncs.add(st)

    def render_linalg(self, e: Eqn, B: Block):
        n = e.ins[0].shape[0]
        i, j, k = self.fresh("r"), self.fresh("c"), self.fresh("k")
        if e.prim == "lu":
            lu, piv, perm = (self.scratch[o] for o in e.outs)
            p, best, v, t, d, f = (self.fresh(x) for x in ("p", "best", "v", "t", "d", "f"))
            self._matrix_into(e.ins[0], B, lu, i, j, per_row=[f"{perm}[{i}] = {i}"])
            B.lines += [
                f"for {k} in range({n}):",
                f"    {p} = {k}",
                f"    {best} = abs({lu}[{k}, {k}])",
                f"    for {i} in range({k} + 1, {n}):",
                f"        {v} = abs({lu}[{i}, {k}])",
                f"        if {v} > {best}:",
                f"            {best} = {v}",
                f"            {p} = {i}",
                f"    {piv}[{k}] = {p}",
                f"    if {p} != {k}:",
                f"        for {j} in range({n}):",
                f"            {t} = {lu}[{k}, {j}]",
                f"            {lu}[{k}, {j}] = {lu}[{p}, {j}]",
                f"            {lu}[{p}, {j}] = {t}",
                f"        {t} = {perm}[{k}]",
                f"        {perm}[{k}] = {perm}[{p}]",
                f"        {perm}[{p}] = {t}",
                f"    {d} = {lu}[{k}, {k}]",
                f"    if {d} != 0:",
                f"        for {i} in range({k} + 1, {n}):",
                f"            {f} = {lu}[{i}, {k}] / {d}",
                f"            {lu}[{i}, {k}] = {f}",
                f"            for {j} in range({k} + 1, {n}):",
                f"                {lu}[{i}, {j}] = {lu}[{i}, {j}] - {f} * {lu}[{k}, {j}]"]
            return
        if e.prim == "cholesky":
            self.render_cholesky(e, B)
            return
        a, b = e.ins
        x = self.scratch[e.outs[0]]
        p = e.params
        lower, trans = bool(p.get("lower")), bool(p.get("transpose_a"))
        forward = lower != trans
        col, acc = self.fresh("col"), self.fresh("acc")
        order = f"range({n})" if forward else f"range({n - 1}, -1, -1)"
        inner = f"range({i})" if forward else f"range({i} + 1, {n})"
        row = Block(B.stage, B.indent, loop=B.loop, parent=B)
        rhs = self.E(b, (Ix(i, 0, 0, n - 1), Ix(col, 0, 0, b.shape[1] - 1)), None, row)
        diag = self.E(a, (Ix(i, 0, 0, n - 1), Ix(i, 0, 0, n - 1)), None, row)
        term = Block(B.stage, B.indent, loop=B.loop, parent=row)
        aij = self.E(a, (Ix(j, 0, 0, n - 1), Ix(i, 0, 0, n - 1)) if trans else (Ix(i, 0, 0, n - 1), Ix(j, 0, 0, n - 1)),
                     None, term)
        B.lines += [f"for {col} in range({b.shape[1]}):", f"    for {i} in {order}:"]
        B.lines += ["        " + ln for ln in row.lines] + [f"        {acc} = {rhs}", f"        for {j} in {inner}:"]
        B.lines += ["            " + ln for ln in term.lines]
        B.lines += [f"            {acc} = {acc} - {aij} * {x}[{j}, {col}]",
                    f"        {x}[{i}, {col}] = {acc}" + ("" if p.get("unit_diagonal") else f" / {diag}")]

    def _matrix_into(self, a, B: Block, target: str, i: str, j: str, per_row=(), lower_only=False):
        """Statements that copy the square matrix ``a`` into the buffer ``target`` (zeros above
        the diagonal with ``lower_only``), with ``per_row`` statements in each row's loop."""
        n = a.shape[0]
        cell = Block(B.stage, B.indent, loop=B.loop, parent=B)
        val = self.E(a, (Ix(i, 0, 0, n - 1), Ix(j, 0, 0, n - 1)), None, cell)
        B.lines += [f"for {i} in range({n}):"] + ["    " + ln for ln in per_row] + [f"    for {j} in range({n}):"]
        B.lines += ["        " + ln for ln in cell.lines]
        B.lines.append(f"        {target}[{i}, {j}] = {val}" + (f" if {i} >= {j} else 0" if lower_only else ""))

    def render_cholesky(self, e: Eqn, B: Block):
        """The lower factor L (zeros above), column by column as LAPACK's potrf; a matrix that is
        not positive definite (a pivot not above zero, or NaN) gives NaN everywhere, as JAX does."""
        n = e.ins[0].shape[0]
        out = self.scratch[e.outs[0]]
        i, j, k = self.fresh("r"), self.fresh("c"), self.fresh("k")
        ok, acc, d = self.fresh("ok"), self.fresh("acc"), self.fresh("d")
        nan = literal(np.nan, e.outs[0].dtype)
        self._matrix_into(e.ins[0], B, out, i, j, lower_only=True)
        B.lines += [
            f"{ok} = True",
            f"for {j} in range({n}):",
            f"    {acc} = {out}[{j}, {j}]",
            f"    for {k} in range({j}):",
            f"        {acc} = {acc} - {out}[{j}, {k}] * {out}[{j}, {k}]",
            f"    if not {acc} > 0:",
            f"        {ok} = False",
            "        break",
            f"    {d} = math.sqrt({acc})",
            f"    {out}[{j}, {j}] = {d}",
            f"    for {i} in range({j} + 1, {n}):",
            f"        {acc} = {out}[{i}, {j}]",
            f"        for {k} in range({j}):",
            f"            {acc} = {acc} - {out}[{i}, {k}] * {out}[{j}, {k}]",
            f"        {out}[{i}, {j}] = {acc} / {d}",
            f"if not {ok}:",
            f"    for {i} in range({n}):",
            f"        for {j} in range({n}):",
            f"            {out}[{i}, {j}] = {nan}"]

    def render_sort(self, it: Item, ix: tuple, B: Block):
        e = it.atom
        d, key = e.params["dimension"], e.ins[0]
        m = key.shape[d]

        def less(a, b):
            if key.dtype.kind == "f":
                return f"({a} < {b} or ({b} != {b} and {a} == {a}))"
            return f"({a} < {b})"
        mine = self.E(key, ix, None, B)
        rank, k = self.fresh("rk"), self.fresh("k")
        row = Block(B.stage, B.indent + "    ", loop=B.loop, parent=B)
        other = self.E(key, ix[:d] + (Ix(k, 0, 0, m - 1),) + ix[d + 1:], None, row)
        row.lines += [f"if {less(other, mine)} or ({k} < {ix[d].expr} and not {less(mine, other)}):",
                      f"    {rank} += 1"]
        B.lines += [f"{rank} = 0", f"for {k} in range({m}):"] + ["    " + ln for ln in row.lines]
        for a, o in zip(e.ins, e.outs):
            sub = [i.expr for i in ix]
            sub[d] = rank
            B.lines.append(f"{self.scratch[o]}[{', '.join(sub)}] = {self.E(a, ix, None, B)}")

    def render_scatter(self, it: Item, ix: tuple, B: Block):
        """The body of a scatter's update loop at update index ``ix``: the window's start from the
        index array (clamped with mode=clip; otherwise a window that does not fit in the operand
        is dropped, as JAX's FILL_OR_DROP does), then the atomic add or the store."""
        e = it.atom
        x, ind, upd = e.ins
        dn = e.params["dimension_numbers"]
        uwd = tuple(dn.update_window_dims)
        scatter_pos = [k for k in range(len(upd.shape)) if k not in uwd]
        # a batched scatter (vmap): along an operand batching dimension, the update's index along
        # the indices' matching dimension
        batching = dict(zip(getattr(dn, "operand_batching_dims", ()), getattr(dn, "scatter_indices_batching_dims", ())))
        rest = [d for d in range(len(x.shape)) if d not in dn.inserted_window_dims and d not in batching]
        window = {d: uwd[j] for j, d in enumerate(rest)}
        sizes = self.window_sizes(e, x, upd)
        clip = "CLIP" in str(e.params.get("mode"))
        batch = tuple(ix[k] for k in scatter_pos)
        starts, conds = {}, []
        for p, d in enumerate(dn.scatter_dims_to_operand_dims):
            text = self.E(ind, batch + (const_ix(p),), None, B)
            nm = self.fresh("p")
            hi = x.shape[d] - sizes[d]
            if clip:
                B.lines.append(f"{nm} = min(max({as_index(text, ind)}, 0), {hi})")
            else:
                B.lines.append(f"{nm} = {as_index(text, ind)}")
                conds.append(f"0 <= {nm} <= {hi}")
            starts[d] = nm
        subs = []
        for d in range(len(x.shape)):
            if d in batching:
                subs.append(ix[scatter_pos[batching[d]]].expr)
                continue
            w = ix[window[d]].expr if d in window else None
            st = starts.get(d)
            subs.append("0" if st is None and w is None else st if w is None else w if st is None
                        else f"{st} + {w}")
        val = self.E(upd, ix, None, B)
        if e.prim == "scatter":
            line = f"{it.target}[{', '.join(subs)}] = {val}"
        else:
            index = subs[0] if len(subs) == 1 else f"({', '.join(subs)})"
            line = f"lk.atomic.add({it.target}, {index}, {val})"
        if conds:
            B.lines += [f"if {' and '.join(conds)}:", "    " + line]
        else:
            B.lines.append(line)

    # ---------------------------------------------------------------- nested loops
    def inner_scalar(self, a, B: Block) -> str:
        """A scalar of a nested loop's body, computed where it is needed (in ``B``)."""
        key = (a, (), None)
        found = B.find(key)
        if found is not None:
            return found
        text = RULES[a.eqn.prim](self, a.eqn, a, (), None, B)
        if not _trivial(text):
            name = self.fresh("s")
            B.lines.append(f"{name} = {text}")
            if self._varying(text):
                self.load_vars.add(name)
            text = name
        B.memo[key] = text
        return text

    def check_nested(self, e: Eqn, outer_dep=frozenset()):
        """A nested loop runs per element of its array carries (a sequential loop in each thread,
        no barrier): every equation that reads an array carry, or a value computed from one, must
        be elementwise (so each element's iterations read that element only), every array carry
        has one shape, and the body holds no whole-array reduction or scatter to computed indices
        (they are barriers). Scalar carries may do anything scalars do. A loop nested in this one
        is held to the same rule, with the values of ``outer_dep`` (those of an enclosing loop's
        array carries it reads) counted as its own array carries."""
        if (e, outer_dep) in self.nested_checked:
            return
        p = e.params
        if p["n_xs"] or p["n_ys"]:
            self.unsupported(e, f"a nested scan over xs or with ys runs unrolled only, for a static count of at "
                                f"most {UNROLL_MAX}")
        dep = {c for c in p["carries"] if c.shape} | set(outer_dep)
        shapes = {c.shape for c in dep}
        if len(shapes) > 1:
            self.unsupported(e, f"a nested loop whose array carries differ in shape {_UNROLL_HINT}")
        test = p.get("test")
        if test is not None and test.shape and ({test.shape} != shapes or any(not c.shape for c in p["carries"])):
            # each element's loop reads its own condition and carries
            self.unsupported(e, f"a vmapped while_loop whose condition (bool{list(test.shape)}) is not of the shape "
                                f"of each of its carries {_UNROLL_HINT}")
        for q in p["body"] + p["cond"]:
            if (q.prim in REDUCTIONS and q.ins[0].shape) or (q.prim == "dot_general" and not q.outs[0].shape) or (
                    q.prim in SCATTERS and self.computed_scatter(q)):
                self.unsupported(q, "a whole-array reduction or a scatter to computed indices inside a nested loop "
                                    f"{_UNROLL_HINT}")
            if any(isinstance(a, Var) and a in dep for a in q.ins):
                if q.prim == "nested_loop":
                    self.check_nested(q, frozenset(a for a in q.ins if isinstance(a, Var) and a in dep))
                elif not shapes or not _reads_own_element(q, dep, next(iter(shapes))):
                    self.unsupported(q, "inside a nested loop, an operation that reads other elements of an array "
                                        f"carry {_UNROLL_HINT}")
                if q.prim == "nested_loop" and any(o.shape not in shapes for o in q.outs if o.shape):
                    self.unsupported(q, f"a nested loop whose array carries differ in shape {_UNROLL_HINT}")
                dep.update(q.outs)
        self.nested_checked.add((e, outer_dep))

    def nested_loop(self, e: Eqn, idx, ctx, B: Block) -> list:
        """Emit a nested ``fori_loop``/``scan``/``while_loop`` into ``B`` at ``idx`` (None: its
        scalar carries only) as a sequential loop over local names, one per carry; their names
        (None for the array carries left out)."""
        self.check_nested(e)
        p = e.params
        carries, outs = p["carries"], p["outs"]
        names = []
        for c, a in zip(carries, e.ins[:p["n_inits"]]):
            if c.shape and idx is None:
                names.append(None)
                continue
            nm = self.fresh("y")
            init = self.E(a, idx if c.shape else (), ctx, B)
            B.lines.append(f"{nm} = {init}" if ctx is None else f"{nm} = {init} if {ctx} else {zero(c.dtype)}")
            names.append(nm)
        saved = dict(self.sub_env)
        self.sub_env.update({c: nm for c, nm in zip(carries, names) if nm is not None})

        def lower_in(block, atoms):
            self.inner_blocks.append(block)
            try:
                return [self.E(a, idx if a.shape else (), None, block) for a in atoms]
            finally:
                self.inner_blocks.pop()
        try:
            body = Block(B.stage, B.indent + "    ", loop=B.loop, parent=B)
            new = []
            for c, o, nm in zip(carries, outs, names):
                if nm is None:
                    continue
                tmp = self.fresh("v")
                body.lines.append(f"{tmp} = {lower_in(body, [o])[0]}")
                new.append((nm, tmp))
            body.lines += [f"{nm} = {tmp}" for nm, tmp in new]
            if p["kind"] == "scan":
                loop = [f"for {self.fresh('j')} in range({int(p['length'])}):"]
            else:   # the test before the loop and again after each iteration
                go = self.fresh("go")
                first = Block(B.stage, B.indent, loop=B.loop, parent=B)
                test = lower_in(first, [p["test"]])[0]
                loop = first.lines + [f"{go} = {test}", f"while {go}:"]
                again = Block(B.stage, B.indent, loop=B.loop, parent=B)    # not body: its values are of the old carries
                test = lower_in(again, [p["test"]])[0]
                body.lines += again.lines + [f"{go} = {test}"]
            loop += ["    " + ln for ln in body.lines]
        finally:
            self.sub_env = saved
        if ctx is not None:
            loop = [f"if {ctx}:"] + ["    " + ln for ln in loop]
        B.lines += loop
        if any("[" in ln for ln in loop):       # it reads arrays: not the same on every thread
            self.load_vars.update(nm for nm in names if nm is not None)
        return names

    # ---------------------------------------------------------------- rendering
    def render(self, cond_text, cond) -> StepPlan:
        self.generate_loops()
        plain = self.render_text(cond_text, cond, split=False)
        if not any(L.pieces for L in self.loops):
            return plain
        plan = self.render_text(cond_text, cond, split=True)
        plan.plain_source = plain.source
        return plan

    def render_text(self, cond_text, cond, split: bool) -> StepPlan:
        """The step's source, its parallel loops split (split_loop) when ``split``."""
        sequential = not self.loops and (cond is None or not self._varying(cond_text))
        out = [f"def {self.name}({', '.join(['t'] + [p[0] for p in self.params])}):"]
        out += self.stage_lines(split)
        # finals (single-thread stores at the end): scalar carries, scalar ys, in-place stores
        finals = []
        for f in self._finals_in_order():
            plan, target, val = f[0], f[1], f[2]
            guard = f[4] if len(f) > 4 else None
            if plan is not None:     # a scalar carry
                target = f"{(plan.name if sequential or plan.kind != 'pair' else plan.next_name)}{target}"
            line = f"{target} = {val}"
            finals.append(line if guard is None else f"if {guard}:\n    {line}")
        if finals:
            if sequential:
                out += ["    " + ln for f in finals for ln in f.split("\n")]
            else:
                out.append("    for q_ in lk.range(1):")
                out += ["        " + ln for f in finals for ln in f.split("\n")]
        if cond_text is not None:
            if self._varying(cond_text):
                out.append(f"    return lk.max(1 if {cond_text} else 0) > 0")
            else:
                out.append(f"    return {cond_text}")
        if len(out) == 1:
            out.append("    pass")
        swap = []
        if not sequential:
            swap = [(p.name, p.next_name) for p in self.carries.values() if p.kind == "pair"]
        else:
            # one thread: scalar carries are updated in place
            for k, p in self.carries.items():
                if p.kind == "pair" and not self.param_shape(k):
                    p.kind = "inplace"
            swap = [(p.name, p.next_name) for p in self.carries.values() if p.kind == "pair"]
            self.params = [q for q in self.params if not (q[1] == "carry_next" and self.carries[q[2]].kind == "inplace")]
            out[0] = f"def {self.name}({', '.join(['t'] + [p[0] for p in self.params])}):"
        source = "\n".join(out) + "\n"
        return StepPlan(source, self.name, self.params, swap, [self.carries[k] for k in sorted(self.carries)],
                        cond is not None, sequential)

    def ends_with_barrier(self) -> bool:
        """Whether the statements of :meth:`stage_lines` end with a grid reduction (a barrier)
        after the last parallel loop."""
        stages = ({s for s, b in self.pre.items() if b.lines} | {L.stage for L in self.loops} | set(self.post)
                  | {p.stage for p in self.phased.values()} | {st for st, _ in self.serial})
        last = max(stages, default=None)
        return last is not None and bool(self.post.get(last)) and last not in {p.stage for p in self.phased.values()}

    def stage_lines(self, split: bool = False) -> list:
        """The step's statements stage by stage (indented for the step's body): each stage's
        scalars, its parallel loops (the pieces of the split ones when ``split``), its
        reductions, the barrier it ends with if any, and the nested loops that run in phases
        after it."""
        out = []
        stages = sorted(set(self.pre) | {L.stage for L in self.loops} | set(self.post) |
                        {f[3] for f in self.final} | {p.stage for p in self.phased.values()} |
                        {st for st, _ in self.serial})
        synced = False      # the barrier a stage's loops end with goes before the next stage
        for s in stages:
            if synced:
                out.append("    lk.sync()")
                synced = False
            if s in self.pre:
                out += ["    " + ln for ln in self.pre[s].lines]
            for L in self.loops:
                if L.stage != s:
                    continue
                for head, body in (L.pieces if split and L.pieces else
                                   [(_parallel_for(L.names, L.box), L.body.lines)]):
                    out.append("    " + head)
                    if body is not None:        # (None: a statement, not a loop)
                        out += ["        " + ln for ln in body or ["pass"]]
            for st, lines in self.serial_text:      # one thread's work (a factorisation)
                if st == s:
                    out += ["    if lk.thread_id() == 0:"] + ["        " + ln for ln in lines]
            post = self.post.get(s, [])
            out += ["    " + ln for ln in post]
            synced = s in self.syncs and not post      # a grid reduction is a barrier already
            for e, lines in self.phased_text.items():
                if self.phased[e].stage == s:
                    if synced:
                        out.append("    lk.sync()")
                        synced = False
                    out += ["    " + ln for ln in lines]
        return out

    def generate_loops(self):
        """Generate every parallel loop's body (every item was registered by build), then the
        text of the nested loops that run in phases."""
        for L in list(self.loops):
            nd = len(L.space)
            boxes = [it.box for it in L.items]
            L.box = tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(nd))
            li = self.fresh("i")
            L.names = tuple(f"{li}_{d}" for d in range(nd))
            L.body = Block(L.stage, "        ", loop=L)
            ix = tuple(Ix(n, 0, lo, hi - 1) for n, (lo, hi) in zip(L.names, L.box))
            before = self._registered()
            cuts = []
            _cut_log.found = cuts
            try:
                self.render_items(L, ix, L.body)
            finally:
                _cut_log.found = None
            if self.splits and self._registered() == before:
                self.split_loop(L, li, cuts)
        for e, lines in self.phased_text.items():
            lines += self.phased[e].text()
        for st, e in self.serial:
            block = Block(st, "", parent=None)
            self.render_linalg(e, block)
            self.serial_text.append((st, block.lines))

    def render_items(self, L: Loop, ix: tuple, B: Block) -> int:
        """The work of loop ``L``'s items at the cell ``ix`` (Ix per dimension) into ``B``;
        returns how many stores it wrote there."""
        stores = 0
        for it in L.items:
            if it.kind == "scatter":
                self.render_scatter(it, ix, B)
                continue
            if it.kind == "sort":
                self.render_sort(it, ix, B)
                continue
            if it.kind == "reduce":
                if isinstance(it.atom, tuple):   # a full dot
                    _, x, y, lc, rc = it.atom
                    xi = [None] * len(x.shape)
                    yi = [None] * len(y.shape)
                    for p, (a, b) in enumerate(zip(lc, rc)):
                        xi[a] = ix[p]
                        yi[b] = ix[p]
                    val = self.mul_text(self.E(x, tuple(xi), None, B), self.E(y, tuple(yi), None, B), x.dtype)
                else:
                    val = self.E(it.atom, ix, None, B)
                B.lines.append(self.accumulate(it, val))
                continue
            val = self.E(it.atom, ix, None, B)
            guard = [range_cond(i, lo, hi) for i, (lo, hi) in zip(ix, it.box)]
            guard = [g for g in guard if g is not True]
            if it.op:
                guard.append(it.op)
            store = f"{it.target}[{', '.join(it.index(ix))}] = {val}"
            if any(g is False for g in guard):
                continue
            stores += 1
            if guard:
                B.lines.append(f"if {' and '.join(guard)}:")
                B.lines.append("    " + store)
            else:
                B.lines.append(store)
        return stores

    def _registered(self) -> tuple:
        """How much rendering has registered beyond a loop's body (loops, phases, parameters,
        buffers, one thread's work): split_loop renders a body again only when it registered
        nothing, so that a second rendering cannot register anything twice."""
        return (len(self.loops), len(self.phased), len(self.params), len(self.scratch), len(self.serial),
                sum(len(b) for b in self.post.values()))

    def split_loop(self, L: Loop, li: str, cuts: list):
        """Split loop ``L`` into an interior loop whose conditions are decided and a rim loop.

        ``cuts`` are the conditions the body of ``L`` tests at run time, as (index name, a, b):
        the condition holds for index values in ``[a, b)`` (a pad, a ``u.at[1:-1].set``
        window, a concatenation's pieces, a reduction over more cells than a store covers).
        Along each dimension those values cut the loop's range into segments on which every
        such condition is constant; the box of the longest segments is the *interior*, where
        the body is rendered again with the indices narrowed to it, so the conditions fold
        away (and the stores outside their window with them): one trip of the 64x64 Jacobi
        body's unrolled element loop went from 196 to 155 SASS instructions for four cells
        (``bench/sass_loops.py jacobi_lowered block``). The other cells, the *rim*, run in one
        more loop over slabs: for each dimension d and each index value c of d outside the
        interior, the cells with index c along d, interior along the dimensions before d and
        anything along those after (a partition of the rim). Each slab is rendered with its
        indices narrowed in the same way; its index along d is the constant c, which the race
        check sees is outside the interior loop's range.

        A rim that only reads and reduces is taken by the last threads, from the last one down:
        when the threads do not divide the interior, those are the ones with one interior cell
        less, so splitting adds no cell to the busiest thread. A rim that stores is a parallel
        loop over ``interior + rim`` values that takes only those past the interior's count
        (the same threads, without the race check having to follow thread indices).

        Iterations of one parallel loop are independent (each thread runs some of them, in no
        set order), so any partition of its cells into loops without a barrier between them
        computes the same values; only the order in which a thread adds to a reduction changes.
        Nothing is split when the interior is less than half the cells, the rim has more than
        MAX_RIM_SLABS slabs (a loop of several index spaces costs more than the conditions), or
        a store at another index than the cell's own reaches the rim (see below).
        """
        if any(it.kind in ("scatter", "sort") for it in L.items):
            return
        nd = len(L.box)
        total = math.prod(hi - lo for lo, hi in L.box)
        if total == 0:
            return
        inner = []
        for d, (lo, hi) in enumerate(L.box):
            points = sorted({lo, hi} | {x for name, a, b in cuts if name == L.names[d] for x in (a, b)
                                        if lo < x < hi})
            segs = list(zip(points, points[1:]))
            inner.append(max(segs, key=lambda ab: ab[1] - ab[0]))
        inside = math.prod(b - a for a, b in inner)
        slabs = []
        for d, (lo, hi) in enumerate(L.box):
            for c in [*range(lo, inner[d][0]), *range(inner[d][1], hi)]:
                slabs.append(tuple(inner[k] if k < d else (c, c + 1) if k == d else L.box[k] for k in range(nd)))
        if not slabs or inside * 2 < total or len(slabs) > MAX_RIM_SLABS:
            return
        for it in L.items:
            # a store at another index than the cell's own (an in-place window at a run-time
            # start) that reaches the rim: the race check cannot tell the rim's store
            # (start + 11) apart from the interior's (start + j), so none is split; a scan
            # output's row ys[t] keeps the cell's indices and is split
            if it.kind == "store" and not getattr(it.index, "own_cell", False) and \
                    any(lo < a or hi > b for (lo, hi), (a, b) in zip(it.box, inner)):
                return
        body = Block(L.stage, "        ", loop=L)
        self.render_items(L, tuple(Ix(n, 0, a, b - 1) for n, (a, b) in zip(L.names, inner)), body)
        pieces = [(_parallel_for(L.names, tuple(inner)), body.lines or ["pass"])]
        v = f"{li}_v"
        names = tuple(f"{li}_r{d}" for d in range(nd))
        cells, first, stores = [], 0, 0     # per slab: the end of its run of rim cells, its decode, its work
        for box in slabs:
            count = math.prod(b - a for a, b in box)
            decode, q = [], f"{v} - {first}" if first else v
            moving = [d for d, (a, b) in enumerate(box) if b - a > 1]
            for j, d in enumerate(reversed(moving)):
                a, b = box[d]
                if j == len(moving) - 1:
                    decode.append(f"{names[d]} = {a} + {q}" if a else f"{names[d]} = {q}")
                else:
                    decode.append(f"{names[d]} = {a} + ({q}) % {b - a}" if a else f"{names[d]} = ({q}) % {b - a}")
                    q = f"({q}) // {b - a}"
            ix = tuple(const_ix(a) if b - a == 1 else Ix(names[d], 0, a, b - 1) for d, (a, b) in enumerate(box))
            slab = Block(L.stage, "        ", loop=L)
            stores += self.render_items(L, ix, slab)
            cells.append((first + count, decode, slab.lines))
            first += count
        rim = _chain(v, [(end, decode + (lines or ["pass"])) for end, decode, lines in cells])
        if stores:
            # cells stored into: a parallel loop, whose stores the race check proves apart from
            # the interior's (a slab's index along its dimension is a constant outside it)
            pieces.append((f"for {v}_ in lk.range({inside + first}):",
                           [f"if {v}_ >= {inside}:", f"    {v} = {v}_ - {inside}"] + ["    " + ln for ln in rim]))
        else:
            # only reads and reductions: the last threads take the rim, from the last one down
            # (they are those with one interior cell less when the threads do not divide it)
            start = (f"{v} = lk.num_threads() - 1 - lk.thread_id()", None)
            stored = {it.target for it in L.items if it.kind == "store"}
            big = total > PREFETCH_RIM_MIN_CELLS
            early = self._prefetch_rim(v, cells, stored) if PREFETCH_RIM and big else None
            if early is None:
                pieces += [start, (f"while {v} < {first}:", rim + [f"{v} += lk.num_threads()"])]
            else:
                defaults, loads, uses = early
                pieces[:0] = [start] + [(ln, None) for ln in defaults] + [(f"if {v} < {first}:", loads)]
                pieces += [(f"if {v} < {first}:", uses + [f"{v} += lk.num_threads()"]),
                           (f"while {v} < {first}:", rim + [f"{v} += lk.num_threads()"])]
        L.pieces = pieces

    def _prefetch_rim(self, v: str, cells: list, stored: set):
        """A reads-only rim's first cell per thread with its loads issued before the interior
        loop: (default assignments, the loads' branch chain, the rest's branch chain), or None
        when no load can move. ``cells``: per slab, the end of its run of rim cells, the lines
        decoding a cell's indices, and the cell's work.

        A thread that takes rim cells (the last ones, each with one interior cell or two) ran
        them after its interior cells: the rim's loads waited for the interior's to come back,
        two trips to memory in a row on the path to the step's barrier (the lowered Jacobi step
        took 1.12x the hand-written one's time per step at 256², session 39). Issued before the
        interior loop and used after it, they are in flight together.

        Why moving them is safe: the cells of one parallel loop are independent (each thread
        takes some in no set order), so a rim cell's loads may run before the interior cells';
        this rim stores nothing, and a load moves only when it reads an array that the loop
        does not store into (``stored``, the interior's targets) at an index that reads nothing
        but the cell's decoded indices (and literals), so it needs nothing the rest of the cell
        computes. The rest of the cell (its reductions, in the same order) still runs after
        the interior loop. Each moved name gets a zero of its type first, so that the
        validator (and Numba) sees it assigned on every path; the chain that uses it takes
        the same branch as the one that loaded it.
        """
        moved, early, late = {}, [], []
        for end, decode, lines in cells:
            known = {ln.split(" = ", 1)[0] for ln in decode}
            pre, rest = list(decode), []
            for ln in lines:
                # (a nested line starts with spaces, so its name is no load's)
                name = ln.split(" = ", 1)[0]
                if name in self.load_dtypes and _loads_only_at(ln, known, stored):
                    pre.append(ln)
                    moved[name] = zero(self.load_dtypes[name])
                else:
                    rest.append(ln)
            for ln in decode:
                moved.setdefault(ln.split(" = ", 1)[0], "0")
            early.append((end, pre))
            late.append((end, rest or ["pass"]))
        if not any(name in self.load_dtypes for name in moved):
            return None
        return [f"{n} = {d}" for n, d in moved.items()], _chain(v, early), _chain(v, late)

    def _finals_in_order(self) -> list:
        """The final stores, the scalar carries' last. A carry is read back at the start of the
        next step; with its store after every other store of the step, nothing between the two
        may alias it, so the compiler keeps the value in a register from one step to the next
        (one thread's scan then runs at the speed of its arithmetic, not of a memory round
        trip: y[t] written after c[0] made LLVM reload c[0]). The order is kept when a final's
        value reads a carry's array (it never does today: values are computed names)."""
        import re
        carries = [f for f in self.final if f[0] is not None]
        others = [f for f in self.final if f[0] is None]
        names = {f[0].name for f in carries} | {f[0].next_name for f in carries}
        if any(set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", str(f[2]))) & names for f in self.final):
            return list(self.final)
        return others + carries

    def param_shape(self, k):
        for v, r in self.input_role.items():
            if r == ("carry", k):
                return v.shape
        return ()

    def _varying(self, text: str) -> bool:
        import re
        names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))
        return bool(names & self.load_vars) or "[" in text

    def accumulate(self, it: Item, val: str) -> str:
        a = it.acc
        if it.op == "sum":
            return f"{a} = {a} + {val}"
        if it.op in ("or", "and"):
            return f"{a} = max({a}, 1 if {val} else 0)" if it.op == "or" else f"{a} = min({a}, 1 if {val} else 0)"
        if self._acc_float(it):
            return f"{a} = jl_f{it.op}({a}, {val})"
        return f"{a} = {it.op}({a}, {val})"

    def _acc_float(self, it):
        a = it.atom
        dt = a[1].dtype if isinstance(a, tuple) else a.dtype
        return dt.kind == "f"

    def mul_text(self, x, y, dt):
        return _arith("*", x, y, dt)


class PhaseLowering(Lowering):
    """The body (or the condition) of a nested loop that runs in phases, lowered as a part of
    the enclosing step: array carries are read from their buffer A (their new values written to
    B), scalar carries are local names (``local`` plans), and every value of the enclosing
    program comes from the enclosing lowering (computed before the loop)."""

    splits = False      # (its loops run inside a sequential loop: kept as they are)

    def __init__(self, outer: Lowering, eqns, outs, carries, plans: dict, varying=()):
        self.outer = outer
        self.roles, self.out_roles = [("carry", k) for k in range(len(carries))], []
        self.input_role = {c: ("carry", k) for k, c in enumerate(carries)}
        self.const_names = outer.const_names
        self.params = outer.params
        self.carries = plans
        self._start(Program(list(carries), list(eqns), list(outs), []), varying)
        self.own = set(carries) | _defined(self.prog.eqns)
        self.check_dtypes()

    def fresh(self, prefix="a") -> str:
        return self.outer.fresh(prefix)

    def add_param(self, name, role, payload=None):
        return self.outer.add_param(name, role, payload)

    def owns(self, v) -> bool:
        return v in self.own

    def stage(self, a) -> int:
        return super().stage(a) if isinstance(a, Var) and a in self.own else 0

    def E(self, a, idx: tuple, ctx, B: Block) -> str:
        if isinstance(a, Var) and a not in self.own and a not in self.sub_env:
            return self.outer.E(a, idx, ctx, B)
        return super().E(a, idx, ctx, B)

    def S(self, a, B: Block | None = None) -> str:
        if isinstance(a, Var) and a not in self.own and a not in self.sub_env:
            return self.outer.S(a)
        return super().S(a, B)

    def scalar_input(self, a) -> str:
        return self.carries[self.input_role[a][1]].name         # a local name

    def build_phase(self) -> dict:
        """Register the work of one iteration: the new array carries stored into their B
        buffers, the new scalar carries computed; returns the latter's texts by carry."""
        outs, carries = self.prog.outs, self.prog.invars
        self.materialize(outs, {})
        for v in self.reachable_reductions(outs):
            self.S(v)
        new = {}
        for k, plan in self.carries.items():
            vout, vin = outs[k], carries[k]
            if plan.kind == "local":
                new[k] = self.S(vout) if isinstance(vout, Var) else literal(vout.value, vin.dtype)
            elif vout is vin:
                plan.kind = "same"
            else:
                self.store_carry(vout, vin, plan.next_name)
        return new

    def condition(self) -> tuple:
        """(statements, text) of the loop's condition, the same on every thread."""
        test = self.prog.outs[0]
        for v in self.reachable_reductions([test]):
            self.S(v)
        text = self.S(test) if isinstance(test, Var) else literal(test.value, BOOL)
        self.generate_loops()
        lines = [ln[4:] for ln in self.stage_lines()]
        if self._varying(text):
            text = f"lk.max(1 if {text} else 0) > 0"
        return lines, text


def _defined(eqns) -> set:
    """Every Var that ``eqns`` define: their results, nested loops' carries and slices of xs."""
    out = set()
    for e in walk_eqns(eqns):
        out.update(e.outs)
        if e.prim == "nested_loop":
            out.update(e.params["carries"] + e.params["xs_vars"])
    return out


def _reads_own_element(q: Eqn, dep, lead: tuple) -> bool:
    """Whether the element at index ``(i, j)`` of each result of ``q`` reads, of each operand in
    ``dep`` (the values computed from a per-element loop's array carries, whose shapes start with
    the carries' shape ``lead``), only elements at ``(i, ...)``: the same index ``i`` of ``lead``.
    So a loop running per element ``i`` may compute it: elementwise operations on operands of one
    shape, and broadcasts, slices, squeezes, reshapes, transposes, reversals and concatenations
    that keep the leading ``lead`` axes where they are (the words of ``jax.random.split(key, 3)``
    taken apart, one element's key at a time)."""
    r = len(lead)
    operands = [a for a in q.ins if isinstance(a, Var) and a in dep]
    if any(tuple(a.shape[:r]) != lead for a in operands) or any(tuple(o.shape[:r]) != lead for o in q.outs):
        return False
    p = q.params
    if q.prim in ELEMENTWISE:
        return all(a.shape == q.outs[0].shape for a in operands)
    if q.prim == "broadcast_in_dim":
        return tuple(p["broadcast_dimensions"][:r]) == tuple(range(r))
    if q.prim == "slice":
        strides = p.get("strides") or (1,) * len(q.outs[0].shape)
        return (all(v == 0 for v in p["start_indices"][:r]) and tuple(p["limit_indices"][:r]) == lead
                and all(v == 1 for v in strides[:r]))
    if q.prim in ("squeeze", "rev"):
        return all(d >= r for d in p["dimensions"])
    if q.prim == "reshape":
        return p.get("dimensions") in (None, ())
    if q.prim == "transpose":
        return tuple(p["permutation"][:r]) == tuple(range(r))
    if q.prim == "concatenate":
        return p["dimension"] >= r
    return False


class PhasedLoop:
    """A nested loop that reads other elements of its array carries with a count known only at
    run time (or above :data:`UNROLL_MAX`): a sequential ``for``/``while`` loop at the top of
    the step whose every iteration runs the body's stages as parallel phases.

    Each array carry has two buffers (``scratch``), A and B, both starting as the initial value
    (copied in the stage of the loop's inputs, then a barrier); iterations alternate between
    reading A and writing B and the reverse, each ending with a barrier, and after an odd
    number B is copied into A. Scalar carries are
    local names that every thread computes alike. The loop's results are A and the local names,
    read from the next stage on. A while loop's condition is evaluated before the loop and after
    each iteration, made the same on every thread (a grid reduction) when it reads arrays."""

    def __init__(self, outer: Lowering, e: Eqn):
        self.outer, self.e = outer, e
        p = e.params
        self.stage = max([outer.stage(a) for a in e.ins] or [0])
        self.plans = {}
        inits = e.ins[:p["n_inits"]]
        for k, (c, out, init) in enumerate(zip(p["carries"], e.outs, inits)):
            if c.shape:
                a, b = outer.new_buffer(c.shape, c.dtype), outer.new_buffer(c.shape, c.dtype)
                self.plans[k] = CarryPlan("pair", a, b)
                outer.scratch[out] = a
                for target in (a, b):
                    outer.store_whole(self.stage, init, tuple(c.shape), target)
                outer.syncs.add(self.stage)
            else:
                self.plans[k] = CarryPlan("local", outer.fresh("y"))
                outer.scalar_names[out] = self.plans[k].name
        self.varying = self._varying_locals()
        outer.load_vars.update(self.varying)

    def _varying_locals(self) -> set:
        """The scalar carries that may differ between threads: an initial value that does, or a
        new value computed from one that does or from an array's element (a grid reduction's
        result is the same everywhere)."""
        p = self.e.params
        inits = self.e.ins[:p["n_inits"]]
        local = {c: self.plans[k].name for k, c in enumerate(p["carries"]) if self.plans[k].kind == "local"}
        varying = set()
        for k, (c, init) in enumerate(zip(p["carries"], inits)):
            if c in local and isinstance(init, Var) and self.outer._varying(self.outer.S(init)):
                varying.add(local[c])

        def varies(a, memo):
            if not isinstance(a, Var):
                return False
            if a in local:
                return local[a] in varying
            if a not in self._own:      # the enclosing program's: an array's element, or its scalar
                return bool(a.shape) or self.outer._varying(self.outer.S(a))
            if a in memo:
                return memo[a]
            e = a.eqn
            if (e.prim in REDUCTIONS and e.ins[0].shape) or (e.prim == "dot_general" and not a.shape):
                r = False
            else:
                r = any(isinstance(x, Var) and x.shape for x in e.ins) or any(varies(x, memo) for x in e.ins)
            memo[a] = r
            return r
        self._own = set(p["carries"]) | _defined(p["body"] + p["cond"])
        while True:
            grown = False
            for k, (c, o) in enumerate(zip(p["carries"], p["outs"])):
                if c in local and local[c] not in varying and varies(o, {}):
                    varying.add(local[c])
                    grown = True
            if not grown:
                return varying

    def _plans(self, flipped: bool) -> dict:
        """Carry plans for an iteration that reads A and writes B (or, flipped, the reverse)."""
        return {k: CarryPlan("pair", pl.next_name, pl.name) if pl.kind == "pair" and flipped else
                CarryPlan(pl.kind, pl.name, pl.next_name) for k, pl in self.plans.items()}

    def _iteration(self, flipped: bool) -> list:
        """The statements of one iteration: the body's phases, a barrier unless they end with
        one, the scalar carries' new values."""
        outer, p = self.outer, self.e.params
        body = PhaseLowering(outer, p["body"], p["outs"], p["carries"], self._plans(flipped), self.varying)
        new = body.build_phase()
        body.generate_loops()
        lines = [ln[4:] for ln in body.stage_lines()]
        if body.loops and not body.ends_with_barrier():
            lines.append("lk.sync()")   # what it wrote is read by the next iteration or the condition
        temps = []
        for k, text in new.items():
            tmp = outer.fresh("v")
            lines.append(f"{tmp} = {text}")
            temps.append((self.plans[k].name, tmp))
        return lines + [f"{name} = {tmp}" for name, tmp in temps]

    def _condition(self, go: str, flipped: bool) -> list:
        p = self.e.params
        lines, test = PhaseLowering(self.outer, p["cond"], [p["test"]], p["carries"], self._plans(flipped),
                                    self.varying).condition()
        return lines + [f"{go} = {test}"]

    def _copy_back(self) -> list:
        """B copied into A, then a barrier (after an odd number of iterations)."""
        lines = []
        for pl, c in zip(self.plans.values(), self.e.params["carries"]):
            if pl.kind == "pair":
                q = [self.outer.fresh("q") for _ in c.shape]
                lines += [_parallel_for(q, [(0, n) for n in c.shape]),
                          f"    {pl.name}[{', '.join(q)}] = {pl.next_name}[{', '.join(q)}]"]
        return lines + ["lk.sync()"] if lines else []

    def text(self) -> list:
        """The loop's statements, at the step's top level (without its indentation). Iterations
        alternate between reading A and writing B and the reverse (two copies of the body), so
        no iteration copies; after an odd number, B is copied into A once."""
        outer, p = self.outer, self.e.params
        lines = []
        for k, init in enumerate(self.e.ins[:p["n_inits"]]):
            if self.plans[k].kind == "local":
                value = outer.S(init) if isinstance(init, Var) else literal(init.value, init.dtype)
                lines.append(f"{self.plans[k].name} = {value}")
        ahead, back = self._iteration(False), self._iteration(True)

        def indent(block):
            return ["    " + ln for ln in (block or ["pass"])]
        if p["kind"] == "scan":
            n = int(p["length"])
            j = outer.fresh("j")
            loop = [f"for {j} in range({n // 2}):"] + indent(ahead + back)
            if n % 2:
                loop += ahead + self._copy_back()
            return lines + loop
        go, odd = outer.fresh("go"), outer.fresh("odd")
        lines += self._condition(go, False) + [f"{odd} = False"]
        second = back + self._condition(go, False) + [f"{odd} = False"]
        loop = [f"while {go}:"] + indent(ahead + self._condition(go, True) + [f"{odd} = True", f"if {go}:"]
                                         + indent(second))
        copy = self._copy_back()
        return lines + loop + ([f"if {odd}:"] + indent(copy) if copy else [])


def _loads_only_at(line: str, names: set, stored: set) -> bool:
    """Whether ``line`` is ``x = array[index]`` for an array not in ``stored`` and an index
    that reads no name outside ``names`` (only literals besides)."""
    node = ast.parse(line).body[0]
    return (isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript)
            and isinstance(node.value.value, ast.Name) and node.value.value.id not in stored
            and {n.id for n in ast.walk(node.value.slice) if isinstance(n, ast.Name)} <= names)


def _chain(v: str, branches: list) -> list:
    """The lines of one branch per slab of a rim: ``branches`` is (the end of its run of rim
    cells, its lines) in order, chosen by the rim cell's number ``v``."""
    out = []
    for k, (end, lines) in enumerate(branches):
        if len(branches) == 1:
            out += lines
        else:
            test = "else:" if k == len(branches) - 1 else f"{'if' if k == 0 else 'elif'} {v} < {end}:"
            out += [test] + ["    " + ln for ln in lines]
    return out


def _parallel_for(names, box) -> str:
    """The header of a parallel loop over ``box`` ((lo, hi) per dimension) with index names."""
    if len(names) == 1:
        (lo, hi), = box
        return f"for {names[0]} in lk.range({lo}, {hi}):" if lo else f"for {names[0]} in lk.range({hi}):"
    dims = ", ".join(f"({lo}, {hi})" if lo else f"{hi}" for lo, hi in box)
    return f"for {', '.join(names)} in lk.grid({dims}):"


def _own_index(ix) -> list:
    """The index texts of a store at the loop's own cell."""
    return [i.expr for i in ix]


_own_index.own_cell = True      # (split_loop: the cell's indices are the store's, unchanged)


def _row_index(pos: str):
    """The index maker of a store at the loop's own cell in row ``pos`` (a scan's ``ys[t]``)."""
    def index(ix):
        return [pos] + _own_index(ix)
    index.own_cell = True       # (split_loop: the cell's indices are the store's, unchanged)
    return index


def _trivial(text: str) -> bool:
    return text.replace("_", "").isalnum() or (text.startswith("np.") and text.count("(") == 1
                                                and text.endswith(")") and " " not in text)


_WRAPPING = {"+": "jl_wadd", "-": "jl_wsub", "*": "jl_wmul"}


def _arith(op, x, y, dt):
    dt = np.dtype(dt)
    if dt == np.dtype(np.int64):
        return f"{_WRAPPING[op]}({x}, {y})"
    t = f"({x} {op} {y})"
    if dt.kind in "iu":
        return cast(t, dt)
    if dt == BOOL:
        return f"bool({t})"
    return t


# ----------------------------------------------------------------------------- rules
RULES = {}


def rule(*names):
    def deco(f):
        for n in names:
            RULES[n] = f
        return f
    return deco


def _args(L: Lowering, e, idx, ctx, B):
    """The operands at ``idx`` (scalars at no index)."""
    return [L.E(a, idx if a.shape else (), ctx, B) for a in e.ins]


BINOPS = {"add": "+", "sub": "-", "mul": "*"}


@rule("add", "sub", "mul")
def _binop(L, e, out, idx, ctx, B):
    x, y = _args(L, e, idx, ctx, B)
    return _arith(BINOPS[e.prim], x, y, out.dtype)


@rule("div")
def _div(L, e, out, idx, ctx, B):
    x, y = _args(L, e, idx, ctx, B)
    dt = out.dtype
    if dt.kind == "f":
        b = e.ins[1]
        if isinstance(b, Lit) and float(b.value) != 0.0:
            return f"({x} / {y})"
        return _fdiv(x, y, dt)
    if dt.kind == "u":
        return cast(f"jl_udiv({x}, {y}, {literal(np.iinfo(dt).max, dt)})", dt)
    return cast(f"jl_idiv({x}, {y})", dt)


def _fdiv(x, y, dt):
    """``x / y`` in float type ``dt`` as IEEE division: a zero divisor gives an infinity or NaN
    (Python's ``/``, which the CPU backend and the simulator follow, raises instead)."""
    return f"jl_fdiv{np.dtype(dt).itemsize * 8}({x}, {y})"


@rule("rem")
def _rem(L, e, out, idx, ctx, B):
    x, y = _args(L, e, idx, ctx, B)
    dt = out.dtype
    if dt.kind == "f":
        return cast(f"math.fmod({x}, {y})", dt)
    return cast(f"jl_irem({x}, {y})", dt)


@rule("max", "min")
def _maxmin(L, e, out, idx, ctx, B):
    x, y = _args(L, e, idx, ctx, B)
    dt = out.dtype
    if dt.kind == "f":
        # IEEE 754's maximum and minimum, as XLA's: a NaN wins, and +0 is above -0
        return f"jl_f{e.prim}imum({x}, {y})"
    if dt == BOOL:
        return f"({x} or {y})" if e.prim == "max" else f"({x} and {y})"
    return cast(f"{e.prim}({x}, {y})", dt)


@rule("neg")
def _neg(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    if out.dtype == np.dtype(np.int64):
        return f"jl_wsub(0, {x})"
    return f"(-{x})" if out.dtype.kind == "f" else cast(f"-{x}", out.dtype)


@rule("abs")
def _abs(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    if out.dtype == np.dtype(np.int64):
        return f"jl_wabs({x})"          # abs(MIN) is MIN, as in XLA
    return f"abs({x})" if out.dtype.kind == "f" else cast(f"abs({x})", out.dtype)


@rule("sign")
def _sign(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    return cast(f"jl_sign({x})", out.dtype)


MATH1 = {"exp": "math.exp", "log": "math.log", "sin": "math.sin", "cos": "math.cos", "tan": "math.tan",
         "tanh": "math.tanh", "sqrt": "math.sqrt", "log1p": "math.log1p", "expm1": "math.expm1",
         "asin": "math.asin", "acos": "math.acos", "atan": "math.atan", "sinh": "math.sinh", "cosh": "math.cosh",
         "asinh": "math.asinh", "acosh": "math.acosh", "atanh": "math.atanh", "erf": "math.erf",
         "erfc": "math.erfc", "floor": "jl_floor", "ceil": "jl_ceil", "lgamma": "math.lgamma",
         "cbrt": "jl_cbrt", "exp2": "jl_exp2"}


@rule(*MATH1)
def _math1(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    return cast(f"{MATH1[e.prim]}({x})", out.dtype)


@rule("round")
def _round(L, e, out, idx, ctx, B):
    """``jnp.round``/``rint`` (to nearest, ties to even) and ``lax.round``'s default (ties away
    from zero); infinities, NaNs and whole values as they are, the sign of a zero kept. (So do
    ``floor`` and ``ceil``: ``math.floor`` gives an integer, wrong for them.)"""
    x, = _args(L, e, idx, ctx, B)
    even = "EVEN" in str(e.params.get("rounding_method")) or e.params.get("rounding_method") == 1
    return cast(f"jl_round_{'even' if even else 'away'}({x})", out.dtype)


@rule("rsqrt")
def _rsqrt(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    return cast(_fdiv(literal(1, out.dtype), f"math.sqrt({x})", out.dtype), out.dtype)


@rule("logistic")
def _logistic(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    one = literal(1, out.dtype)
    return cast(f"{one} / ({one} + math.exp(-{x}))", out.dtype)


@rule("square")
def _square(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    return _arith("*", x, x, out.dtype)


@rule("atan2", "pow", "nextafter")
def _math2(L, e, out, idx, ctx, B):
    if e.prim == "nextafter":
        # folded when its operands are constants of one value each (jax.random.truncated_normal's
        # bounds nudged inwards: nextafter(lower, inf)); NumPy's is IEEE's
        vals = [L.const_value(a) for a in e.ins]
        if all(v is not None and np.asarray(v).size and np.all(np.asarray(v) == np.asarray(v).flat[0])
               for v in vals):
            first = [np.asarray(v, out.dtype).flat[0] for v in vals]
            return literal(np.nextafter(first[0], first[1]), out.dtype)
    x, y = _args(L, e, idx, ctx, B)
    if e.prim == "nextafter":
        if out.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            L.unsupported(e, f"nextafter of {out.dtype}")
        fmt = (23, -149) if out.dtype == np.dtype(np.float32) else (52, -1074)
        return cast(f"jl_nextafter({x}, {y}, {fmt[0]}, {fmt[1]})", out.dtype)
    if e.prim == "pow":
        if e.ins[1].dtype.kind != "f":
            L.unsupported(e, "an integer exponent array")
        return cast(f"({x} ** {y})", out.dtype)
    return cast(f"math.atan2({x}, {y})", out.dtype)


@rule("integer_pow")
def _ipow(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    y = int(e.params["y"])
    n = abs(y)
    if n > 16:
        L.unsupported(e, "an exponent above 16")
    if n == 0:
        return literal(1, out.dtype)
    # binary exponentiation, as XLA expands it
    acc, base, k = None, x, n
    while True:
        if k & 1:
            acc = base if acc is None else _arith("*", acc, base, out.dtype)
        k >>= 1
        if not k:
            break
        base = _arith("*", base, base, out.dtype)
    if y < 0:
        return cast(_fdiv(literal(1, out.dtype), acc, out.dtype), out.dtype) if out.dtype.kind == "f" \
            else L.unsupported(e)
    return acc


CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


@rule(*CMP)
def _cmp(L, e, out, idx, ctx, B):
    x, y = _args(L, e, idx, ctx, B)
    return f"({x} {CMP[e.prim]} {y})"


@rule("lt_to", "le_to")
def _cmp_total(L, e, out, idx, ctx, B):
    """Comparisons in IEEE 754's total order (``jnp.searchsorted``, ``jnp.sort``'s keys):
    -NaN < -inf < ... < -0.0 < +0.0 < ... < inf < +NaN. NaNs of one sign compare equal (JAX
    also orders them by payload, which no loopkern body can tell apart)."""
    x, y = _args(L, e, idx, ctx, B)
    if e.ins[0].dtype.kind == "f":
        return f"jl_{e.prim}({x}, {y})"
    return f"({x} {'<' if e.prim == 'lt_to' else '<='} {y})"


@rule("and", "or", "xor")
def _logic(L, e, out, idx, ctx, B):
    x, y = _args(L, e, idx, ctx, B)
    op = {"and": "&", "or": "|", "xor": "^"}[e.prim]
    if out.dtype == BOOL:
        return f"bool({x} {op} {y})"
    return cast(f"{x} {op} {y}", out.dtype)


@rule("shift_left", "shift_right_arithmetic", "shift_right_logical")
def _shift(L, e, out, idx, ctx, B):
    """Bit shifts as XLA defines them for an N-bit integer: a shift by N or more (a negative
    count counts as more) gives 0, or for an arithmetic right shift the top bit in every bit;
    an unsigned value's arithmetic shift is that of the signed value of its bits (jl_shl,
    jl_sra, jl_sra_unsigned, jl_srl). The shift runs on the value widened to int64 (a left
    shift wraps when it is cast back). A logical right shift of a 64-bit value and any shift of
    uint64 run on the value's bits as int64, with the count as int64 too (unsigned 64-bit
    arithmetic mixed with int64 is float64 in Numba; a count past 2**63 turns negative, which
    the helpers read as past the width, as XLA does): jl_shl and jl_sra at 64 bits, and
    jl_srl64, whose mask jl_srl cannot make; the result cast back to its type."""
    x, s = _args(L, e, idx, ctx, B)
    dt = np.dtype(out.dtype)
    bits = dt.itemsize * 8
    if dt == np.dtype(np.uint64) or (e.prim == "shift_right_logical" and bits == 64):
        k = f"np.int64({s})"
        text = {"shift_left": f"jl_shl({x}, {k}, 64)", "shift_right_logical": f"jl_srl64({x}, {k})",
                "shift_right_arithmetic": f"jl_sra({x}, {k}, 64)"}[e.prim]
        return cast(text, dt)
    fn = {"shift_left": "jl_shl", "shift_right_logical": "jl_srl",
          "shift_right_arithmetic": "jl_sra_unsigned" if dt.kind == "u" else "jl_sra"}[e.prim]
    return cast(f"{fn}({x}, {s}, {bits})", dt)


@rule("not")
def _not(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    return f"(not {x})" if out.dtype == BOOL else cast(f"~{x}", out.dtype)


@rule("is_finite")
def _isfinite(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    return f"math.isfinite({x})"


@rule("convert_element_type")
def _convert(L, e, out, idx, ctx, B):
    x, = _args(L, e, idx, ctx, B)
    src, dt = e.ins[0].dtype, out.dtype
    if src == dt:
        return x
    if dt == BOOL:
        return f"({x} != 0)"
    if src.kind == "f" and dt.kind in "iu":
        if not _trivial(x):         # the tests below read it four times
            x = L.bind(x, src, ctx, B)
        # JAX: NaN -> 0, out of range saturates; in range truncates toward zero
        info = np.iinfo(dt)
        return (f"({literal(0, dt)} if {x} != {x} else ({literal(info.max, dt)} if {x} >= {float(info.max)} else "
                f"({literal(info.min, dt)} if {x} <= {float(info.min)} else {cast(x, dt)})))")
    return cast(x, dt)


@rule("bitcast_convert_type")
def _bitcast(L, e, out, idx, ctx, B):
    """``lax.bitcast_convert_type`` of an integer to a float or integer of its width (how
    ``jax.random.uniform`` makes floats from random bits): a float from the integer's sign,
    exponent and mantissa fields (jl_bits_f32/64), an integer by a wrapping cast."""
    x, = _args(L, e, idx, ctx, B)
    src, dt = np.dtype(e.ins[0].dtype), np.dtype(out.dtype)
    if src.itemsize != dt.itemsize or BOOL in (src, dt) or src.kind == "f" or dt.itemsize not in (4, 8):
        L.unsupported(e, f"a bitcast from {src} to {dt} (loopkern bitcasts 32- and 64-bit integers to integers "
                         f"or floats of their width)")
    if dt.kind == "f":
        return f"jl_bits_f{dt.itemsize * 8}({x})"
    return cast(x, dt)          # the other integer type of that width: the cast wraps


@rule("erf_inv")
def _erf_inv(L, e, out, idx, ctx, B):
    """``erf_inv`` (``jax.random.normal``'s inverse CDF): in float32 XLA's own polynomial
    (jl_erfinv32), in float64 refined to float64 precision (jl_erfinv64)."""
    x, = _args(L, e, idx, ctx, B)
    if out.dtype not in FLOATS:
        L.unsupported(e, f"erf_inv of {out.dtype}")
    return f"jl_erfinv{out.dtype.itemsize * 8}({x})"


@rule("copy", "copy_p", "optimization_barrier", "reduce_precision_noop", "stop_gradient")
def _copy(L, e, out, idx, ctx, B):
    return L.E(e.ins[0], idx, ctx, B)


@rule("select_n")
def _select(L, e, out, idx, ctx, B):
    pred = e.ins[0]
    p = L.E(pred, idx if pred.shape else (), ctx, B)
    cases = e.ins[1:]
    if pred.dtype == BOOL:
        if len(cases) != 2:
            L.unsupported(e)
        a = L.E(cases[0], idx if cases[0].shape else (), ctx, B)
        b = L.E(cases[1], idx if cases[1].shape else (), ctx, B)
        return f"({b} if {p} else {a})"
    texts = [L.E(c, idx if c.shape else (), ctx, B) for c in cases]
    out_t = texts[-1]
    for k in range(len(texts) - 2, -1, -1):
        out_t = f"({texts[k]} if {p} == {k} else {out_t})"
    return out_t


@rule("clamp")
def _clamp(L, e, out, idx, ctx, B):
    lo, x, hi = _args(L, e, idx, ctx, B)
    if out.dtype.kind == "f":
        return f"jl_fminimum(jl_fmaximum({x}, {lo}), {hi})"
    return cast(f"min(max({x}, {lo}), {hi})", out.dtype)


#: the rules above compute an element from the operands' elements at the same index
ELEMENTWISE = frozenset(RULES)


@rule("iota")
def _iota(L, e, out, idx, ctx, B):
    d = e.params["dimension"]
    return cast(idx[d].expr, out.dtype)


@rule("broadcast_in_dim")
def _bcast(L, e, out, idx, ctx, B):
    x = e.ins[0]
    if not x.shape:
        return L.E(x, (), ctx, B)
    dims = e.params["broadcast_dimensions"]
    sub = tuple(const_ix(0) if x.shape[k] == 1 and out.shape[d] != 1 else idx[d] for k, d in enumerate(dims))
    return L.E(x, sub, ctx, B)


@rule("reshape")
def _reshape(L, e, out, idx, ctx, B):
    x = e.ins[0]
    if e.params.get("dimensions") not in (None, ()):
        L.unsupported(e, "reshape with dimensions")
    if not x.shape:
        return L.E(x, (), ctx, B)
    # only size-1 dimensions added or removed: map the others one to one
    a = [(d, n) for d, n in enumerate(out.shape) if n != 1]
    b = [(d, n) for d, n in enumerate(x.shape) if n != 1]
    if [n for _, n in a] == [n for _, n in b]:
        sub = [const_ix(0)] * len(x.shape)
        for (da, _), (db, _) in zip(a, b):
            sub[db] = idx[da]
        return L.E(x, tuple(sub), ctx, B)
    # general: through the flat index (row-major)
    flat, stride = [], 1
    for d in range(len(out.shape) - 1, -1, -1):
        flat.append(f"({idx[d].expr}) * {stride}" if stride != 1 else f"({idx[d].expr})")
        stride *= out.shape[d]
    f = " + ".join(reversed(flat))
    sub, stride = [], 1
    strides = []
    for d in range(len(x.shape) - 1, -1, -1):
        strides.append(stride)
        stride *= x.shape[d]
    strides.reverse()
    for d, n in enumerate(x.shape):
        sub.append(opaque(f"(({f}) // {strides[d]}) % {n}", 0, n - 1))
    return L.E(x, tuple(sub), ctx, B)


@rule("squeeze")
def _squeeze(L, e, out, idx, ctx, B):
    x = e.ins[0]
    dims = set(d % len(x.shape) for d in e.params["dimensions"])
    sub, k = [], 0
    for d in range(len(x.shape)):
        if d in dims:
            sub.append(const_ix(0))
        else:
            sub.append(idx[k])
            k += 1
    return L.E(x, tuple(sub), ctx, B)


@rule("expand_dims")
def _expand(L, e, out, idx, ctx, B):   # pragma: no cover - JAX emits broadcast_in_dim/reshape
    L.unsupported(e)


@rule("tile")
def _tile(L, e, out, idx, ctx, B):
    """``jnp.tile``: along each repeated dimension, element i reads the operand at i mod its
    extent (an index known to lie in the first copy is kept as it is)."""
    x = e.ins[0]
    sub = []
    for i, n in zip(idx, x.shape):
        sub.append(i if i.hi < n else opaque(f"({i.expr}) % {n}", 0, n - 1))
    return L.E(x, tuple(sub), ctx, B)


@rule("transpose")
def _transpose(L, e, out, idx, ctx, B):
    perm = e.params["permutation"]
    sub = [None] * len(perm)
    for d, p in enumerate(perm):
        sub[p] = idx[d]
    return L.E(e.ins[0], tuple(sub), ctx, B)


@rule("rev")
def _rev(L, e, out, idx, ctx, B):
    x = e.ins[0]
    dims = set(e.params["dimensions"])
    sub = []
    for d, i in enumerate(idx):
        if d in dims:
            n = x.shape[d]
            if i.text is None and i.base is None:
                sub.append(const_ix(n - 1 - i.off))
            else:
                sub.append(opaque(f"{n - 1} - ({i.expr})", n - 1 - i.hi, n - 1 - i.lo))
        else:
            sub.append(i)
    return L.E(x, tuple(sub), ctx, B)


@rule("slice")
def _slice(L, e, out, idx, ctx, B):
    starts = e.params["start_indices"]
    strides = e.params.get("strides") or (1,) * len(starts)
    sub = []
    for i, s, st in zip(idx, starts, strides):
        if st == 1:
            sub.append(i.shift(int(s)))
        else:
            sub.append(opaque(f"{int(s)} + {int(st)} * ({i.expr})", int(s) + int(st) * i.lo, int(s) + int(st) * i.hi))
    return L.E(e.ins[0], tuple(sub), ctx, B)


def _and_ctx(ctx, cond):
    return cond if ctx is None else f"{ctx} and {cond}"


@rule("pad")
def _pad(L, e, out, idx, ctx, B):
    x, pv = e.ins
    cfg = e.params["padding_config"]
    sub, conds = [], []
    for i, (lo, hi, interior), n in zip(idx, cfg, x.shape):
        if int(interior) != 0:
            L.unsupported(e, "interior padding")
        j = i.shift(-int(lo))
        c = range_cond(j, 0, n)
        if c is False:
            return L.E(pv, (), ctx, B)
        if c is not True:
            conds.append(c)
            j = j.narrow(0, n - 1)
        sub.append(j)
    if not conds:
        return L.E(x, tuple(sub), ctx, B)
    cond = " and ".join(conds)
    inner = L.E(x, tuple(sub), _and_ctx(ctx, cond), B)
    return f"({inner} if {cond} else {L.E(pv, (), ctx, B)})"


def _loaded_name(L, v):
    """The name of the array ``v`` is loaded from when it is one the step takes (a carry of the
    loop, or a scratch buffer), else None."""
    if not isinstance(v, Var) or v.eqn is not None or v in L.sub_env or hasattr(L, "outer"):
        return None
    if v in L.scratch:
        return L.scratch[v]
    role = L.input_role.get(v)
    return L.carries[role[1]].name if role is not None and role[0] == "carry" else None


def _sliced_source(e):
    """The one value that every input of concatenation ``e`` is a slice of, else None."""
    srcs = {x.eqn.ins[0] if isinstance(x, Var) and x.eqn is not None and x.eqn.prim == "slice" else None
            for x in e.ins}
    w = srcs.pop() if len(srcs) == 1 else None
    return w if isinstance(w, Var) else None


def _rotated_from(L, v):
    """The name of the array the step takes that ``v`` is, or is a rotation of (``jnp.roll``
    along another axis: a concatenation of slices of one value of ``v``'s shape), else None:
    the array whose extent the wrapped index names, since it is the one that index reads."""
    name = _loaded_name(L, v)
    if name is not None or not isinstance(v, Var) or v.eqn is None or v.eqn.prim != "concatenate":
        return name
    w = _sliced_source(v.eqn)
    return _rotated_from(L, w) if w is not None and w.shape == v.shape else None


def _rolled(L, e, i, d):
    """``jnp.roll(v, s, axis=d)`` (any static shift) of an array the step takes, read at the
    loop index ``i``: (the array, the index of the neighbour with the wrap as a conditional
    expression), else None. Written so that loopkern's stencil analysis sees a periodic
    neighbour (``stencil.py``'s ``_wrapped_neighbour``) of halo ``min(s, n - s)`` (s taken
    modulo n), where the two pieces' plain reads would be offsets about n apart, a halo no
    tile holds."""
    if len(e.ins) != 2 or i.text is not None or i.base is None or i.off != 0:
        return None
    v = _sliced_source(e)
    root = _rotated_from(L, v) if v is not None else None
    if root is None:
        return None
    first, second = e.ins
    n = v.shape[d]
    for x in (first, second):
        p = x.eqn.params
        if any(st != 1 for st in (p.get("strides") or ())):
            return None
        if any((int(a), int(b)) != (0, m) for k, (a, b, m) in
               enumerate(zip(p["start_indices"], p["limit_indices"], v.shape)) if k != d):
            return None
    (a0, b0), (a1, b1) = [(int(x.eqn.params["start_indices"][d]), int(x.eqn.params["limit_indices"][d]))
                          for x in (first, second)]
    extent = f"{root}.shape[{d}]"
    x = i.expr
    # jnp.roll(v, s) is concatenate(v[n - s:], v[:n - s]): out[x] = v[(x + a) mod n] for the
    # pieces (v[a:], v[:a]), read as the nearer of the offsets +a and a - n
    if not (b0 == n and a1 == 0 and b1 == a0 and 0 < a0 < n):
        return None
    a = a0
    if a == n - 1:                                      # roll by +1: out[x] = v[x - 1]
        return v, opaque(f"({x} - 1 if {x} > 0 else {extent} - 1)", 0, n - 1)
    if a == 1:                                          # roll by -1: out[x] = v[x + 1]
        return v, opaque(f"({x} + 1 if {x} < {extent} - 1 else 0)", 0, n - 1)
    if n - a <= a:                                      # roll by +s: out[x] = v[x - s]
        s = n - a
        return v, opaque(f"({x} - {s} if {x} >= {s} else {x} - {s} + {extent})", 0, n - 1)
    return v, opaque(f"({x} + {a} if {x} < {extent} - {a} else {x} + {a} - {extent})", 0, n - 1)


@rule("concatenate")
def _concat(L, e, out, idx, ctx, B):
    d = e.params["dimension"]
    i = idx[d]
    rolled = _rolled(L, e, i, d) if (i.lo, i.hi) == (0, out.shape[d] - 1) else None
    if rolled is not None:
        v, j = rolled
        return L.E(v, idx[:d] + (j,) + idx[d + 1:], ctx, B)
    pieces, off = [], 0
    for x in e.ins:
        n = x.shape[d]
        j = i.shift(-off)
        c = range_cond(j, 0, n)
        if c is not False:
            pieces.append((x, j.narrow(0, n - 1), c, off, n))
        off += n
    if len(pieces) == 1:
        x, j, c, _, _ = pieces[0]
        return L.E(x, idx[:d] + (j,) + idx[d + 1:], ctx, B)
    # nested: the first piece if i is below its end, else the rest
    text = None
    for x, j, c, start, n in reversed(pieces):
        sub = idx[:d] + (j,) + idx[d + 1:]
        inner_ctx = ctx if c is True else _and_ctx(ctx, c)
        if text is None:
            text = L.E(x, sub, inner_ctx, B)
        else:
            text = f"({L.E(x, sub, inner_ctx, B)} if {i.expr} < {start + n} else {text})"
    return text


@rule("stack")
def _stack(L, e, out, idx, ctx, B):
    """``jnp.stack``: along the new axis, position k reads input k at the other indices."""
    d = e.params["axis"]
    i = idx[d]
    rest = idx[:d] + idx[d + 1:]
    live = [k for k in range(len(e.ins)) if range_cond(i, k, k + 1) is not False]
    if len(live) == 1:
        return L.E(e.ins[live[0]], rest, ctx, B)
    text = None
    for k in reversed(live):
        if text is None:
            text = L.E(e.ins[k], rest, ctx if range_cond(i, k, k + 1) is True else _and_ctx(ctx, f"{i.expr} >= {k}"),
                       B)
        else:
            text = f"({L.E(e.ins[k], rest, _and_ctx(ctx, f'{i.expr} == {k}'), B)} if {i.expr} == {k} else {text})"
    return text


@rule("dynamic_slice")
def _dslice(L, e, out, idx, ctx, B):
    x = e.ins[0]
    sizes = e.params["slice_sizes"]
    sub = []
    for d, (i, s) in enumerate(zip(idx, e.ins[1:])):
        n = x.shape[d]
        c = L.const_value(s)
        if c is not None:
            st = min(max(int(c), 0), n - sizes[d])
            sub.append(i.shift(st))
            continue
        st = L.S(s)
        start = f"min(max({as_index(st, s)}, 0), {n - sizes[d]})"
        sub.append(opaque(f"{start} + {i.expr}" if i.expr != "0" else start, 0, n - 1))
    return L.E(x, tuple(sub), ctx, B)


@rule("gather")
def _gather(L, e, out, idx, ctx, B):
    """A gather with computed start indices (``x[idx]``, ``jnp.take``, ``x[:, idx]``, points
    ``m[i, j]``, windows ``m[i, 1:3]``): per element of the result, one read at the start its
    index vector holds plus its offset in the window. XLA clamps a start so that the window fits
    (the ``promise_in_bounds`` and ``clip`` modes; JAX has already made negative indices count
    from the end); ``fill`` gives JAX's fill value where a window does not fit. A batched gather
    (``jnp.take_along_axis``, ``vmap``: ``operand_batching_dims``) reads along each operand batching
    dimension at the result's index along the indices' matching dimension."""
    x, ind = e.ins
    dn = e.params["dimension_numbers"]
    mode = str(e.params.get("mode", "")).rsplit(".", 1)[-1].lower()
    sizes = e.params["slice_sizes"]
    offset = sorted(dn.offset_dims)        # the window's dimensions of the result, in operand order
    batching = dict(zip(getattr(dn, "operand_batching_dims", ()), getattr(dn, "start_indices_batching_dims", ())))
    kept = [d for d in range(len(x.shape)) if d not in dn.collapsed_slice_dims and d not in batching]
    batch = [d for d in range(len(out.shape)) if d not in offset]
    if (not ind.shape or ind.shape[-1] != len(dn.start_index_map)
            or len(ind.shape) - 1 != len(batch) or len(offset) != len(kept)
            or mode not in ("promise_in_bounds", "clip", "fill_or_drop")):
        L.unsupported(e, "a gather whose indices are not one index vector per result element")
    starts = {d: as_index(L.E(ind, tuple(idx[b] for b in batch) + (const_ix(p),), ctx, B), ind)
              for p, d in enumerate(dn.start_index_map)}
    sub, conds = [], []
    for d, n in enumerate(x.shape):
        if d in batching:           # the result's index along the matching indices dimension
            sub.append(idx[batch[batching[d]]])
            continue
        w = idx[offset[kept.index(d)]] if d in kept else None
        if d not in starts:
            sub.append(w if w is not None else const_ix(0))
            continue
        hi = n - sizes[d]
        text = f"min(max({starts[d]}, 0), {hi})"
        sub.append(opaque(text if w is None else f"{text} + {w.expr}", 0, n - 1))
        conds.append(f"0 <= {starts[d]} <= {hi}")
    val = L.E(x, tuple(sub), ctx, B)
    if mode != "fill_or_drop":
        return val
    fill = e.params.get("fill_value")
    dt = out.dtype
    if fill is None:
        fill = (np.nan if dt.kind == "f" else True if dt == BOOL else np.iinfo(dt).min if dt.kind == "i"
                else np.iinfo(dt).max)
    return f"({val} if {' and '.join(conds)} else {literal(fill, dt)})"


@rule("dynamic_update_slice")
def _dus(L, e, out, idx, ctx, B):
    x, upd = e.ins[0], e.ins[1]
    conds, sub = [], []
    for d, (i, s) in enumerate(zip(idx, e.ins[2:])):
        n, m = x.shape[d], upd.shape[d]
        c = L.const_value(s)
        if c is not None:
            st = min(max(int(c), 0), n - m)
            j = i.shift(-st)
            rc = range_cond(j, 0, m)
            if rc is False:
                return L.E(x, idx, ctx, B)
            if rc is not True:
                conds.append(rc)
            sub.append(j.narrow(0, m - 1))
            continue
        st = L.S(s)
        start = f"min(max({as_index(st, s)}, 0), {n - m})"
        j = opaque(f"{i.expr} - {start}", 0, m - 1)
        conds.append(f"0 <= {i.expr} - {start} < {m}")
        sub.append(j)
    if not conds:
        return L.E(upd, tuple(sub), ctx, B)
    cond = " and ".join(conds)
    return f"({L.E(upd, tuple(sub), _and_ctx(ctx, cond), B)} if {cond} else {L.E(x, idx, ctx, B)})"


def _affine_iota(a, depth=0):
    """(c, s) when the integer vector ``a`` is ``c + s * arange(len(a))`` built from iota, literals,
    add, sub, mul, converts and broadcasts (how JAX writes a strided ``x.at[lo:hi:s]``), else None."""
    if depth > 8 or not isinstance(a, Var) or a.eqn is None:
        return None
    e = a.eqn
    if e.prim == "iota" and len(a.shape) == 1:
        return 0, 1
    if e.prim in ("convert_element_type", "copy", "copy_p") or (
            e.prim in ("broadcast_in_dim", "reshape") and e.ins[0].shape and
            int(np.prod(e.ins[0].shape)) == a.size and max(e.ins[0].shape) == a.size):
        return _affine_iota(e.ins[0], depth + 1)
    if e.prim == "rev" and len(a.shape) == 1:
        inner = _affine_iota(e.ins[0], depth + 1)
        return None if inner is None else (inner[0] + inner[1] * (a.shape[0] - 1), -inner[1])
    if e.prim in ("add", "sub", "mul") and len(e.ins) == 2:
        x, y = e.ins
        lit_x = x.value if isinstance(x, Lit) else None
        lit_y = y.value if isinstance(y, Lit) else None
        if lit_x is None and lit_y is None:
            return None
        k = int(lit_y if lit_y is not None else lit_x)
        inner = _affine_iota(x if lit_y is not None else y, depth + 1)
        if inner is None:
            return None
        c, st = inner
        if e.prim == "add":
            return c + k, st
        if e.prim == "mul":
            return c * k, st * k
        return (c - k, st) if lit_y is not None else (k - c, -st)
    return None


def _strided_form(e):
    """(d, c, s, m, scatter position, rest) of a scatter into every s-th element along operand
    dimension d (``x.at[lo:hi:s].set/add``: m updates from c), or None."""
    dn = e.params["dimension_numbers"]
    x, ind, upd = e.ins
    if getattr(dn, "operand_batching_dims", ()) or len(dn.scatter_dims_to_operand_dims) != 1 or \
            len(ind.shape) != 2 or ind.shape[1] != 1 or tuple(dn.inserted_window_dims) != tuple(
                dn.scatter_dims_to_operand_dims):
        return None
    d = dn.scatter_dims_to_operand_dims[0]
    m = ind.shape[0]
    aff = _affine_iota(ind)
    if aff is None or aff[1] == 0:
        return None
    c, st = aff
    rest = [k for k in range(len(x.shape)) if k != d]
    scatter_pos = [k for k in range(len(upd.shape)) if k not in dn.update_window_dims]
    if len(scatter_pos) != 1 or len(rest) != len(dn.update_window_dims) or any(
            upd.shape[ud] != x.shape[k] for k, ud in zip(rest, dn.update_window_dims)):
        return None
    return d, c, st, m, scatter_pos, rest


def _strided_scatter(L, e, out, idx, ctx, B):
    """A scatter into every s-th element along one dimension (``x.at[lo:hi:s].set/add``): the
    element at ``i`` takes update ``(i - c) // s`` when ``(i - c) % s == 0`` and that position is
    one of the m updates; otherwise it keeps ``x[i]``."""
    form = _strided_form(e)
    if form is None:
        return None
    d, c, st, m, scatter_pos, rest = form
    dn = e.params["dimension_numbers"]
    x, ind, upd = e.ins
    i = idx[d]
    if st > 0:      # update j goes to c + st * j: j = (i - c) / st
        # (parenthesised: the index may be an expression, i1_0 + 1, that % and // would split)
        rel = f"({i.expr})" if c == 0 else (f"({i.expr} + {-c})" if c < 0 else f"({i.expr} - {c})")
    else:           # a reversed slice (x.at[::-2]): j = (c - i) / -st
        rel, st = f"({c} - ({i.expr}))", -st
    j = opaque(f"{rel} // {st}" if st != 1 else rel, 0, m - 1)
    cond = f"{rel} % {st} == 0 and 0 <= {rel} // {st} < {m}" if st != 1 else f"0 <= {rel} < {m}"
    usub = [None] * len(upd.shape)
    usub[scatter_pos[0]] = j
    for k, ud in zip(rest, dn.update_window_dims):
        usub[ud] = idx[k]
    inner_ctx = _and_ctx(ctx, cond)
    u = L.E(upd, tuple(usub), inner_ctx, B)
    if e.prim != "scatter":
        u = _arith("+", L.E(x, idx, inner_ctx, B), u, out.dtype)
    return f"({u} if {cond} else {L.E(x, idx, ctx, B)})"


@rule("scatter", "scatter-add", "scatter_add")
def _scatter(L, e, out, idx, ctx, B):
    r = L.dynamic_window(e)
    if r is None:
        strided = _strided_scatter(L, e, out, idx, ctx, B)
        if strided is not None:
            return strided
        L.unsupported(e, "a scatter of more than one window (indices of one index vector or an evenly "
                         "spaced static slice only)")
    if e.params.get("mode") is not None and "CLIP" in str(e.params.get("mode")):
        L.unsupported(e, "mode=clip")
    starts, upd, mode = r
    x = e.ins[0]
    sizes = L.window_sizes(e, x, upd)
    dn = e.params["dimension_numbers"]
    rest = [d for d in range(len(x.shape)) if d not in dn.inserted_window_dims]
    umap = [None] * len(x.shape)
    for d, ud in zip(rest, dn.update_window_dims):
        umap[d] = ud
    conds, usub = [], [None] * len(upd.shape)
    dyn_ok = []
    for d, i in enumerate(idx):
        n, m = x.shape[d], sizes[d]
        s = starts[d]
        c = 0 if s is None else L.const_int(s)
        if c is not None:
            if c < 0 or c + m > n:       # the whole window is dropped
                return L.E(x, idx, ctx, B)
            j = i.shift(-c)
            rc = range_cond(j, 0, m)
            if rc is False:
                return L.E(x, idx, ctx, B)
            if rc is not True:
                conds.append(rc)
            j = j.narrow(0, m - 1)
        else:
            st = L.scatter_index(s, L.top(L.stage(out)) if B.loop is not None else B)
            nm = L.fresh("p")
            T = L.top(L.stage(out)) if B.loop is not None else B
            T.lines.append(f"{nm} = {as_index(st, s)}")
            dyn_ok.append(f"0 <= {nm} <= {n - m}")
            j = opaque(f"{i.expr} - {nm}", 0, m - 1)
            conds.append(f"0 <= {i.expr} - {nm} < {m}")
        if umap[d] is not None:
            usub[umap[d]] = j
    cond = " and ".join(dyn_ok + conds) if (dyn_ok or conds) else None
    inner_ctx = ctx if cond is None else _and_ctx(ctx, cond)
    u = L.E(upd, tuple(usub), inner_ctx, B) if upd.shape else L.E(upd, (), inner_ctx, B)
    if e.prim != "scatter":
        u = _arith("+", L.E(x, idx, inner_ctx, B), u, out.dtype)
    if cond is None:
        return u
    return f"({u} if {cond} else {L.E(x, idx, ctx, B)})"


REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_or", "reduce_and")


def _start_and_update(op, dt):
    """A running ``op``'s start value and its update (``acc = ...``, from the name ``acc`` and
    the next value's text), over values of ``dt``."""
    if op in ("sum", "prod"):
        return (zero(dt) if op == "sum" else literal(1, dt),
                lambda acc, v: f"{acc} = {_arith('+' if op == 'sum' else '*', acc, v, dt)}")
    if op in ("max", "min"):
        if dt.kind == "f":
            # a reduction along an axis runs here whole, so it takes +0 above -0 as XLA does
            return literal(-np.inf if op == "max" else np.inf, dt), lambda acc, v: f"{acc} = jl_f{op}imum({acc}, {v})"
        start = (literal(np.iinfo(dt).min if op == "max" else np.iinfo(dt).max, dt) if dt.kind in "iu"
                 else "False" if op == "max" else "True")
        return start, lambda acc, v: f"{acc} = {cast(f'{op}({acc}, {v})', dt)}"
    if op == "or":
        return "False", lambda acc, v: f"{acc} = {acc} or {v}"
    return "True", lambda acc, v: f"{acc} = {acc} and {v}"


def _running_loop(L, acc, x, sub, ctx, B, op, dt, headers):
    """Emit ``acc = start``, then (only where ``ctx`` holds) the nested loops ``headers``
    (``"for r in range(...):"``, outermost first) whose body reads ``x`` at ``sub`` and updates
    ``acc`` with ``op``; returns ``acc``."""
    start, update = _start_and_update(op, dt)
    inner = Block(B.stage, B.indent, loop=B.loop)
    val = L.E(x, tuple(sub), None, inner)
    _guarded_loops(B, f"{acc} = {start}", ctx, headers, inner.lines + [update(acc, val)])
    return acc


def _guarded_loops(B, first, ctx, headers, body):
    """Append ``first`` to ``B``, then, only where ``ctx`` holds (always if None), the nested
    loops ``headers`` (outermost first) around the lines ``body``."""
    lines = [first]
    pad = ""
    if ctx is not None:
        lines.append(f"if {ctx}:")
        pad = "    "
    for n, header in enumerate(headers):
        lines.append(pad + "    " * n + header)
    lines += [pad + "    " * len(headers) + ln for ln in body]
    B.lines += lines


def _partial_reduce(L, e, out, idx, ctx, B):
    """A reduction over some axes: a sequential loop per element."""
    x = e.ins[0]
    axes = sorted(e.params["axes"])
    acc = L.fresh("q")
    loopvars = [L.fresh("r") for _ in axes]
    sub, k = [], 0
    for d in range(len(x.shape)):
        if d in axes:
            sub.append(Ix(loopvars[axes.index(d)], 0, 0, x.shape[d] - 1))
        else:
            sub.append(idx[k])
            k += 1
    headers = [f"for {loopvars[n]} in range({x.shape[d]}):" for n, d in enumerate(axes)]
    return _running_loop(L, acc, x, sub, ctx, B, e.prim[len("reduce_"):], out.dtype, headers)


for _r in REDUCTIONS:
    RULES[_r] = _partial_reduce

#: ``jnp.prod`` of a whole array into one value is a sequential loop that every thread runs
#: after the barrier behind the array (loopkern's grid reductions are sums, maxima and minima),
#: so it is compiled up to this many elements
PROD_WHOLE_MAX = 4096


@rule("reduce_prod")
def _reduce_prod(L, e, out, idx, ctx, B):
    """``jnp.prod``: along axes, a sequential loop per element (as the sums along an axis); of a
    whole array of at most PROD_WHOLE_MAX elements, the same loop over every element."""
    x = e.ins[0]
    if x.shape and len(e.params["axes"]) == len(x.shape) and x.size > PROD_WHOLE_MAX:
        L.unsupported(e, f"a product of {x.size} elements into one value (loopkern multiplies at most "
                         f"{PROD_WHOLE_MAX} in one thread; its grid reductions are sums, maxima and minima)")
    return _partial_reduce(L, e, out, idx, ctx, B)


@rule("nested_loop")
def _nested(L, e, out, idx, ctx, B):
    """One result of a nested loop: the loop is emitted once per block, index and condition."""
    key = ("nested", e, tuple(i.expr for i in idx) if out.shape else None, ctx)
    names = B.memo.get(key)
    if names is None:
        names = L.nested_loop(e, idx if out.shape else None, ctx, B)
        B.memo[key] = names
    return names[e.outs.index(out)]


@rule("cumsum", "cumprod", "cummax", "cummin")
def _cumulative(L, e, out, idx, ctx, B):
    """``jnp.cumsum`` and friends along one axis: a sequential loop per element over the
    elements up to its own (from it to the end with ``reverse``). Integers agree with JAX
    bit for bit; floats to rounding, since JAX's own order of operations is a parallel scan."""
    x = e.ins[0]
    axis, rev = e.params["axis"], e.params.get("reverse", False)
    dt = out.dtype
    if dt.kind not in "iuf":
        L.unsupported(e, f"dtype {dt}")
    n = x.shape[axis]
    here = idx[axis]
    acc, r = L.fresh("q"), L.fresh("r")
    sub = list(idx)
    sub[axis] = Ix(r, 0, here.lo if rev else 0, n - 1 if rev else here.hi)
    span = f"range({here.expr}, {n})" if rev else f"range(({here.expr}) + 1)"
    return _running_loop(L, acc, x, sub, ctx, B, e.prim[len("cum"):], dt, [f"for {r} in {span}:"])


@rule("dot_general")
def _dot(L, e, out, idx, ctx, B):
    """A dot (matvec, matmul) to an array: a sequential sum over the contracted axes per element."""
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    x, y = e.ins
    pet = e.params.get("preferred_element_type")
    if pet is not None and np.dtype(pet) != out.dtype:
        L.unsupported(e, "preferred_element_type")
    if x.dtype != out.dtype or y.dtype != out.dtype:
        L.unsupported(e, "mixed dtypes")
    # output dims: batch, then x's free dims, then y's free dims
    xf = [d for d in range(len(x.shape)) if d not in lc and d not in lb]
    yf = [d for d in range(len(y.shape)) if d not in rc and d not in rb]
    xs, ys = [None] * len(x.shape), [None] * len(y.shape)
    k = 0
    for a, b in zip(lb, rb):
        xs[a] = ys[b] = idx[k]
        k += 1
    for d in xf:
        xs[d] = idx[k]
        k += 1
    for d in yf:
        ys[d] = idx[k]
        k += 1
    loopvars = [L.fresh("r") for _ in lc]
    for n, (a, b) in enumerate(zip(lc, rc)):
        xs[a] = ys[b] = Ix(loopvars[n], 0, 0, x.shape[a] - 1)
    dt = out.dtype
    acc = L.fresh("q")
    inner = Block(B.stage, B.indent, loop=B.loop)
    val = _arith("*", L.E(x, tuple(xs), None, inner), L.E(y, tuple(ys), None, inner), dt)
    headers = [f"for {loopvars[n]} in range({x.shape[a]}):" for n, a in enumerate(lc)]
    _guarded_loops(B, f"{acc} = {zero(dt)}", ctx, headers, inner.lines + [f"{acc} = {_arith('+', acc, val, dt)}"])
    return acc
