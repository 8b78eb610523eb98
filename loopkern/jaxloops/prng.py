"""``jax.random`` inside a loop body: PRNG keys as the ``uint32`` words that hold them, and
JAX's PRNG primitives spelled in primitives the lowering already supports.

A key of JAX's default implementation (``threefry2x32``; ``jax.random.key`` and the legacy
``jax.random.PRNGKey``) is two ``uint32`` words, so a key array of shape ``K`` becomes a
:class:`Keys`: two ``uint32`` values of shape ``K``, its first and its second words (the
trace's inputs and outputs hold them stacked, as ``jax.random.key_data`` does:
``random_wrap`` and ``random_unwrap`` split and stack them). ``random_bits``,
``random_split``, ``random_fold_in`` and ``random_seed`` become the Threefry-2x32 hash (20
rounds of 32-bit adds, rotations and xors) of counters made from ``iota``, exactly as JAX
defines them with ``jax_threefry_partitionable`` on (its default since JAX 0.5): every element
of a draw is a function of its key and its flat index alone, so the draw is elementwise and
fuses into the phase that uses it, and the bits are those JAX draws, bit for bit.

An operation that only moves keys (slices, squeezes, reshapes, broadcasts, concatenation,
``select_n`` of a ``lax.cond``, gathers, scatters, ``dynamic_slice``) is the same operation
on each word, so keys stay elementwise values of their own shape: a nested loop can carry
them per element (``jax.random.gamma``'s rejection loop). Any other operation on a key array
runs the ``jax.lax`` loop.

Only JAX is imported here (at call time); nothing is compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def check_impl(aval, where) -> tuple:
    """The shape of the key array ``aval``; Unsupported for a key of another implementation
    than threefry2x32."""
    impl = key_impl(aval)
    if impl != THREEFRY:
        raise Unsupported(f"values of type {aval.dtype}", where,
                          f"loopkern compiles jax.random's default {THREEFRY} keys; this key's implementation is "
                          f"{impl} (jax.random.key(seed, impl=...) or jax_default_prng_impl)")
    return tuple(int(d) for d in aval.shape)


@dataclass(frozen=True, eq=False)
class Keys:
    """A key array of ``shape`` as the trace holds it: its words ``w0`` and ``w1``, uint32
    Vars of that shape."""
    w0: object
    w1: object
    shape: tuple

    @property
    def words(self) -> tuple:
        return (self.w0, self.w1)


def flat(atoms) -> list:
    """``atoms`` with every :class:`Keys` replaced by its two words."""
    return [w for a in atoms for w in (a.words if isinstance(a, Keys) else (a,))]


def unpack(data, emit, where) -> "Keys":
    """The :class:`Keys` whose words are stacked along the last axis of the uint32 value
    ``data`` (a closed-over key array's ``jax.random.key_data``)."""
    return _Spell(emit, where).unpack(data)


def unflat(avals, words) -> list:
    """The inverse of :func:`flat` for values of ``avals`` (JAX avals; key arrays take two)."""
    out, it = [], iter(words)
    for aval in avals:
        out.append(Keys(next(it), next(it), tuple(int(d) for d in aval.shape)) if key_impl(aval) is not None
                   else next(it))
    return out


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

    def keys(self, w0, w1, shape) -> Keys:
        """The :class:`Keys` of ``shape`` whose words are ``w0`` and ``w1`` (spread over it):
        Vars, never literals, so that any operation moving keys applies to them."""
        shape = tuple(shape)
        w0, w1 = (self.convert(w, U32) if isinstance(w, Lit) and not shape else
                  self.emit("broadcast_in_dim", {"shape": shape, "broadcast_dimensions": (), "sharding": None},
                            [w], shape, U32, self.where) if isinstance(w, Lit) else self.broadcast(w, shape, ())
                  for w in (w0, w1))
        return Keys(w0, w1, shape)

    def unpack(self, data) -> Keys:
        """The :class:`Keys` whose words are stacked along the last axis of ``data``."""
        axis = len(data.shape) - 1
        return Keys(take(self.emit, data, axis, 0, self.where), take(self.emit, data, axis, 1, self.where),
                    tuple(data.shape[:-1]))

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
        ``keys`` (:class:`Keys` of shape K): arrays of K + shape."""
        lead = tuple(keys.shape)
        full = lead + tuple(shape)
        dims = tuple(range(len(lead)))
        k1 = self.broadcast(keys.w0, full, dims)
        k2 = self.broadcast(keys.w1, full, dims)
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
    if name == "random_wrap":
        return [sp.unpack(ins[0])]
    if name == "random_unwrap":
        keys = ins[0]
        return [sp.stack([sp.broadcast(w, keys.shape, ()) for w in keys.words], keys.shape)]
    if name == "random_clone":
        return [ins[0]]
    if name == "random_seed":
        seed = ins[0]
        bits = np.dtype(seed.dtype).itemsize * 8
        if np.dtype(seed.dtype).kind not in "iu":
            raise Unsupported(name, where, f"a seed of type {seed.dtype}")
        # JAX's threefry_seed: the high word is bits 32-63 (0 for a seed of 32 bits or fewer)
        hi = sp.convert(sp.op("shift_right_logical", seed, Lit(np.asarray(32, seed.dtype)), sp.shape_of(seed),
                              seed.dtype), U32) if bits == 64 else _lit(0)
        return [sp.keys(hi, sp.convert(seed, U32), sp.shape_of(seed))]
    if name == "random_fold_in":
        keys, msgs = ins
        o1, o2 = sp.threefry(keys.w0, keys.w1, _lit(0), msgs)
        return [sp.keys(o1, o2, keys.shape)]
    if name == "random_split":
        _partitionable(where)
        keys = ins[0]
        o1, o2 = sp.hashed(keys, tuple(e.params["shape"]))
        return [sp.keys(o1, o2, tuple(keys.shape) + tuple(e.params["shape"]))]
    if name == "random_bits":
        _partitionable(where)
        keys = ins[0]
        width = int(e.params["bit_width"])
        o1, o2 = sp.hashed(keys, tuple(e.params["shape"]))
        shape = tuple(keys.shape) + tuple(e.params["shape"])
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


def gamma_jaxpr(e, where):
    """The ClosedJaxpr of JAX's own definition of the ``random_gamma`` equation ``e``: per
    element, Marsaglia and Tsang's rejection loop (a ``while_loop`` drawing normals and uniforms
    from the element's key), vmapped as XLA runs it on a GPU; the trace inlines it, so its
    loops become nested loops of the body and its draws the hash above."""
    import functools

    import jax
    try:
        from jax._src.random.core import _gamma_impl
    except ImportError:
        try:
            from jax._src.random import _gamma_impl
        except ImportError:
            raise Unsupported("random_gamma", where, "this JAX version's gamma sampler is not where loopkern "
                                                     "looks for it (jax._src.random._gamma_impl)") from None
    key, a = e.invars
    check_impl(key.aval, where)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in (key, a)]
    return jax.make_jaxpr(functools.partial(_gamma_impl, use_vmap=True, **e.params))(*avals)


#: the operations that only move the elements of their operands: on keys, the same operation
#: on each word
MOVES = frozenset({"copy", "copy_p", "slice", "squeeze", "rev", "concatenate", "reshape", "broadcast_in_dim",
                   "transpose", "select_n", "dynamic_slice", "dynamic_update_slice", "gather", "scatter",
                   "expand_dims", "pad", "device_put", "sharding_constraint"})


def on_keys(e, ins, emit, where) -> list:
    """The results of the jaxpr equation ``e`` that reads or makes key arrays (:class:`Keys`
    among ``ins``) when it only moves keys: the operation applied to each word; Unsupported
    for any other operation on keys."""
    name = e.primitive.name
    if name == "optimization_barrier":
        return list(ins)
    if name.startswith("random_"):
        raise Unsupported(name, where, "a jax.random primitive loopkern does not compile (it compiles bits, split, "
                                       "fold_in, key and gamma, and the draws built on them)")
    outs = [o.aval for o in e.outvars]
    if name not in MOVES or len(outs) != 1 or key_impl(outs[0]) is None:
        raise Unsupported(name, where, "this operation on PRNG keys (loopkern moves keys through slices, reshapes, "
                                       "broadcasts, concatenation, gathers, scatters, cond and dynamic_slice; draw "
                                       "from them with jax.random, or pass jax.random.key_data(keys) instead)")
    shape = check_impl(outs[0], where)
    words = []
    for w in (0, 1):
        args = [a.words[w] if isinstance(a, Keys) else a for a in ins]
        words.append(emit(name, dict(e.params), args, shape, U32, where))
    return [Keys(words[0], words[1], shape)]
