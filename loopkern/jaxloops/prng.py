"""``jax.random`` inside a loop body: PRNG keys as the ``uint32`` words that hold them, and
JAX's PRNG primitives spelled in primitives the lowering already supports.

A key of JAX's default implementation (``threefry2x32``; ``jax.random.key`` and the legacy
``jax.random.PRNGKey``) is two ``uint32`` words, so a key array of shape ``K`` becomes a
``uint32`` value of shape ``K + (2,)`` (what ``jax.random.key_data`` returns), and
``random_wrap``/``random_unwrap`` change nothing. ``random_bits``, ``random_split``,
``random_fold_in`` and ``random_seed`` become the Threefry-2x32 hash (20 rounds of 32-bit
adds, rotations and xors) of counters made from ``iota``, exactly as JAX defines them with
``jax_threefry_partitionable`` on (its default since JAX 0.5): every element of a draw is a
function of its key and its flat index alone, so the draw is elementwise and fuses into the
phase that uses it, and the bits are those JAX draws, bit for bit.

Shape-only operations on keys (slices, squeezes, reshapes, broadcasts, concatenation,
``select_n`` of a ``lax.cond``, ``dynamic_slice``) get the trailing word axis added to their
parameters; any other operation on a key array runs the ``jax.lax`` loop.

Only JAX is imported here (at call time); nothing is compiled.
"""

from __future__ import annotations

import math

import numpy as np

from .trace import Lit, Unsupported, take

THREEFRY = "threefry2x32"
U32 = np.dtype(np.uint32)
#: the primitives :func:`lower_prng` spells out
PRNG_PRIMS = frozenset({"random_wrap", "random_unwrap", "random_clone", "random_bits", "random_split",
                        "random_fold_in", "random_seed", "threefry2x32"})
#: Threefry-2x32's rotation distances, alternating every four rounds (Salmon et al., SC'11)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def key_impl(aval) -> str | None:
    """The name of the PRNG implementation of a key-typed value (``aval``), else None."""
    dtype = getattr(aval, "dtype", None)
    try:
        np.dtype(dtype)
        return None
    except TypeError:
        pass
    impl = getattr(dtype, "_impl", None)
    return str(getattr(impl, "name", dtype))


def key_data_shape(aval, where) -> tuple:
    """The shape of the ``uint32`` words of a key array (its shape, then 2); Unsupported for a
    key of another implementation than threefry2x32."""
    impl = key_impl(aval)
    if impl != THREEFRY:
        raise Unsupported(f"values of type {aval.dtype}", where,
                          f"loopkern compiles jax.random's default {THREEFRY} keys; this key's implementation is "
                          f"{impl} (jax.random.key(seed, impl=...) or jax_default_prng_impl)")
    return tuple(int(d) for d in aval.shape) + (2,)


def _lit(v, dtype=U32):
    return Lit(np.asarray(v, dtype=dtype))


class _Spell:
    """Emits the equations of one PRNG primitive (``emit`` as in :func:`trace.flatten`)."""

    def __init__(self, emit, where):
        self.emit, self.where = emit, where

    def op(self, prim, a, b, shape, dtype=U32, params=None):
        return self.emit(prim, params or {}, [a, b], shape, dtype, self.where)

    @staticmethod
    def shape_of(*atoms) -> tuple:
        """The shape of an elementwise result: the operands' (scalars and literals broadcast)."""
        return max((tuple(getattr(a, "shape", ())) for a in atoms), key=len)

    def add(self, a, b):
        return self.op("add", a, b, self.shape_of(a, b))

    def xor(self, a, b):
        return self.op("xor", a, b, self.shape_of(a, b))

    def rotl(self, x, r):
        s = self.shape_of(x)
        hi = self.op("shift_left", x, _lit(r), s)
        lo = self.op("shift_right_logical", x, _lit(32 - r), s)
        return self.op("or", hi, lo, s)

    def convert(self, x, dtype):
        return self.emit("convert_element_type", {"new_dtype": np.dtype(dtype), "weak_type": False, "sharding": None},
                         [x], self.shape_of(x), dtype, self.where)

    def broadcast(self, x, shape, dims):
        """``x`` (of the leading dimensions ``dims`` of ``shape``) spread over ``shape``."""
        if tuple(getattr(x, "shape", ())) == tuple(shape) or isinstance(x, Lit):
            return x
        return self.emit("broadcast_in_dim", {"shape": tuple(shape), "broadcast_dimensions": tuple(dims),
                                              "sharding": None}, [x], shape, x.dtype, self.where)

    def word(self, keys, w):
        """Word ``w`` (0 or 1) of every key in ``keys`` (uint32 of shape K + (2,)): shape K."""
        return take(self.emit, keys, len(keys.shape) - 1, w, self.where)

    def stack(self, parts, shape):
        """The values ``parts`` (each of ``shape``) along a new last axis."""
        return self.emit("stack", {"axis": len(shape)}, list(parts), tuple(shape) + (len(parts),), U32, self.where)

    def threefry(self, k1, k2, x1, x2):
        """Threefry-2x32 with 20 rounds of the counter words (x1, x2) under the key words
        (k1, k2), elementwise (operands of one shape, or scalars); the two output words."""
        ks = [k1, k2, self.xor(self.xor(k1, k2), _lit(_PARITY))]
        x = [self.add(x1, ks[0]), self.add(x2, ks[1])]
        for i in range(5):
            for r in _ROTATIONS[i % 2]:
                x[0] = self.add(x[0], x[1])
                x[1] = self.xor(x[0], self.rotl(x[1], r))
            # the key schedule: the words of the key rotated by one per block, and the block count
            x = [self.add(x[0], ks[(i + 1) % 3]), self.add(x[1], self.add(ks[(i + 2) % 3], _lit(i + 1)))]
        return x

    def counters(self, lead: tuple, shape: tuple):
        """The low word of every element's flat index over ``shape`` (row-major; the high word
        is 0), as an array of ``lead + shape`` (the same for every leading index), or a literal 0."""
        if not shape:
            return _lit(0)
        if math.prod(shape) > 2 ** 32:
            raise Unsupported("random_bits", self.where, f"a draw of {math.prod(shape)} values (more than 2**32)")
        full = tuple(lead) + tuple(shape)
        flat, stride = None, 1
        for d in range(len(shape) - 1, -1, -1):
            i = self.emit("iota", {"dtype": U32, "shape": full, "dimension": len(lead) + d, "sharding": None}, [],
                          full, U32, self.where)
            if stride != 1:
                i = self.op("mul", i, _lit(stride), full)
            flat = i if flat is None else self.op("add", flat, i, full)
            stride *= shape[d]
        return flat

    def hashed(self, keys, shape):
        """Both output words of hashing every flat index over ``shape`` under each key of
        ``keys`` (uint32 K + (2,)): arrays of K + shape."""
        lead = tuple(keys.shape[:-1])
        full = lead + tuple(shape)
        dims = tuple(range(len(lead)))
        k1 = self.broadcast(self.word(keys, 0), full, dims)
        k2 = self.broadcast(self.word(keys, 1), full, dims)
        return self.threefry(k1, k2, _lit(0), self.counters(lead, tuple(shape)))


def _partitionable(where):
    import jax
    if not jax.config.jax_threefry_partitionable:
        raise Unsupported("random_bits", where, "jax_threefry_partitionable is off: loopkern draws bits as JAX does "
                                                "with it on (JAX's default since 0.5)")


def lower_prng(e, ins, emit, where) -> list:
    """The atoms of the results of the PRNG equation ``e`` (a jaxpr equation whose primitive is
    in :data:`PRNG_PRIMS`) on the atoms ``ins`` (keys as their uint32 words)."""
    name = e.primitive.name
    sp = _Spell(emit, where)
    if name in ("random_wrap", "random_seed"):
        impl = getattr(e.params.get("impl"), "name", str(e.params.get("impl")))
        if impl != THREEFRY:
            raise Unsupported(name, where, f"a PRNG key of the {impl} implementation (loopkern compiles {THREEFRY}, "
                                           f"JAX's default)")
    if name in ("random_wrap", "random_unwrap", "random_clone"):
        return [ins[0]]
    if name == "random_seed":
        seed = ins[0]
        bits = np.dtype(seed.dtype).itemsize * 8
        if np.dtype(seed.dtype).kind not in "iu":
            raise Unsupported(name, where, f"a seed of type {seed.dtype}")
        # JAX's threefry_seed: the high word is bits 32-63 (0 for a seed of 32 bits or fewer)
        hi = sp.convert(sp.op("shift_right_logical", seed, Lit(np.asarray(32, seed.dtype)), sp.shape_of(seed),
                              seed.dtype), U32) if bits == 64 else _lit(0)
        lo = sp.convert(seed, U32)
        shape = sp.shape_of(seed)
        return [sp.stack([sp.broadcast(hi, shape, ()), lo], shape)]
    if name == "random_fold_in":
        keys, msgs = ins
        lead = tuple(keys.shape[:-1])
        k1, k2 = sp.word(keys, 0), sp.word(keys, 1)
        o1, o2 = sp.threefry(k1, k2, _lit(0), msgs)
        return [sp.stack([sp.broadcast(o1, lead, ()), sp.broadcast(o2, lead, ())], lead)]
    if name == "random_split":
        _partitionable(where)
        keys = ins[0]
        shape = tuple(keys.shape[:-1]) + tuple(e.params["shape"])
        o1, o2 = sp.hashed(keys, tuple(e.params["shape"]))
        return [sp.stack([sp.broadcast(o1, shape, ()), sp.broadcast(o2, shape, ())], shape)]
    if name == "random_bits":
        _partitionable(where)
        keys = ins[0]
        width = int(e.params["bit_width"])
        o1, o2 = sp.hashed(keys, tuple(e.params["shape"]))
        shape = tuple(keys.shape[:-1]) + tuple(e.params["shape"])
        if width == 64:
            # the first word high, the second low (float64 draws with jax_enable_x64 on)
            u64 = np.dtype(np.uint64)
            hi = sp.op("shift_left", sp.convert(o1, u64), Lit(np.asarray(32, u64)), sp.shape_of(o1), u64)
            bits = sp.op("or", hi, sp.convert(o2, u64), sp.shape_of(o1, o2), u64)
            return [sp.broadcast(bits, shape, ())]
        bits = sp.broadcast(sp.xor(o1, o2), shape, ())
        return [bits if width == 32 else sp.convert(bits, np.dtype(f"uint{width}"))]
    if name == "threefry2x32":
        shape = sp.shape_of(*ins)
        k1, k2, x1, x2 = (sp.broadcast(a, shape, ()) if not getattr(a, "shape", ()) else a for a in ins)
        return sp.threefry(k1, k2, x1, x2)
    raise AssertionError(name)      # pragma: no cover


def on_keys(e, ins, emit, where):
    """(params, ins) of the shape-only equation ``e`` that reads or makes key arrays, for the
    keys' uint32 words (a trailing axis of 2); Unsupported for any other operation on keys."""
    name = e.primitive.name
    p = dict(e.params)
    out = e.outvars[0].aval
    if name in ("copy", "copy_p", "optimization_barrier"):
        return p, ins
    if name == "slice":
        p["start_indices"] = tuple(p["start_indices"]) + (0,)
        p["limit_indices"] = tuple(p["limit_indices"]) + (2,)
        if p.get("strides") is not None:
            p["strides"] = tuple(p["strides"]) + (1,)
        return p, ins
    if name == "squeeze":
        nd = len(e.invars[0].aval.shape)
        p["dimensions"] = tuple(d % nd for d in p["dimensions"])
        return p, ins
    if name in ("rev", "concatenate"):
        return p, ins
    if name == "reshape" and p.get("dimensions") in (None, ()):
        p["new_sizes"] = tuple(p["new_sizes"]) + (2,)
        return p, ins
    if name == "broadcast_in_dim":
        p["shape"] = tuple(p["shape"]) + (2,)
        p["broadcast_dimensions"] = tuple(p["broadcast_dimensions"]) + (len(out.shape),)
        return p, ins
    if name == "transpose":
        p["permutation"] = tuple(p["permutation"]) + (len(p["permutation"]),)
        return p, ins
    if name == "select_n":
        pred = ins[0]
        if getattr(pred, "shape", ()):
            shape = tuple(pred.shape)
            pred = _Spell(emit, where).broadcast(pred, shape + (2,), tuple(range(len(shape))))
        return p, [pred] + list(ins[1:])
    if name == "dynamic_slice":
        p["slice_sizes"] = tuple(p["slice_sizes"]) + (2,)
        zero = Lit(np.asarray(0, dtype=ins[1].dtype)) if len(ins) > 1 else Lit(np.asarray(0, np.int32))
        return p, list(ins) + [zero]
    if name == "dynamic_update_slice":
        zero = Lit(np.asarray(0, dtype=ins[2].dtype)) if len(ins) > 2 else Lit(np.asarray(0, np.int32))
        return p, list(ins) + [zero]
    if name.startswith("random_"):
        raise Unsupported(name, where, "a jax.random primitive loopkern does not compile (it compiles bits, split, "
                                       "fold_in and key, and the draws built on them; gamma, beta and dirichlet "
                                       "draw in a rejection loop per element)")
    raise Unsupported(name, where, "this operation on PRNG keys (loopkern moves keys through slices, reshapes, "
                                   "broadcasts, concatenation, cond and dynamic_slice; draw from them with "
                                   "jax.random, or pass jax.random.key_data(keys) instead)")
