"""``lax.conv_general_dilated`` in a loop body (``jnp.convolve``, ``jax.scipy.signal.convolve``
and ``convolve2d``, ``lax.conv``): spelled as the sum of the kernel's taps, each a slice of
the zero-padded input times one weight, in primitives the lowering already supports. So a
stencil written as a convolution is the same program as the one written with slices: the
stencil analysis sees its offsets and halo, and each output element is a few multiply-adds.

Supported: unit window strides and input dilation, any kernel dilation, one feature and batch
group, the layouts (N, C, spatial...), (O, I, spatial...), (N, O, spatial...) that ``jnp`` and
``jax.scipy.signal`` use, at most :data:`MAX_TERMS` products per output element. A kernel
known when the body is traced (a closed-over constant, through ``rev``/``broadcast``/
``reshape``) becomes literal weights; otherwise each weight is read from the kernel. Every
product is kept, zero weights too (``0 * inf`` is NaN in XLA's convolution as well); the sum
runs in tap order, so floats equal XLA's to rounding.

Only JAX's jaxpr is read here; nothing is compiled.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .trace import Lit, Unsupported

#: products per output element (output channels x input channels x taps) spelled out at most
MAX_TERMS = 512
_FOLDABLE = ("rev", "broadcast_in_dim", "reshape", "squeeze", "convert_element_type", "transpose", "copy",
             "copy_p")


def known_value(a, consts: dict):
    """The value of ``a`` as a NumPy array when it is known at trace time: a literal, a concrete
    closed-over constant (``consts``: Var -> value), or one of them moved by a shape-only
    primitive; else None."""
    if isinstance(a, Lit):
        return np.asarray(a.value)
    if a in consts:
        try:
            return np.asarray(consts[a])
        except Exception:       # a traced value (jax.jit closing over an argument)
            return None
    e = getattr(a, "eqn", None)
    if e is None or e.prim not in _FOLDABLE or len(e.outs) != 1:
        return None
    x = known_value(e.ins[0], consts)
    if x is None:
        return None
    p = e.params
    if e.prim == "rev":
        return np.flip(x, axis=tuple(p["dimensions"]))
    if e.prim == "broadcast_in_dim":
        shape, dims = tuple(p["shape"]), tuple(p["broadcast_dimensions"])
        expanded = x.reshape([x.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))])
        return np.broadcast_to(expanded, shape)
    if e.prim in ("reshape", "squeeze"):
        return x.reshape(a.shape)
    if e.prim == "convert_element_type":
        return x.astype(a.dtype)
    if e.prim == "transpose":
        return np.transpose(x, p["permutation"])
    return x


def lower_conv(e, ins, emit, where, consts: dict):
    """The atom of the result of the ``conv_general_dilated`` jaxpr equation ``e`` on the atoms
    ``ins`` (input, kernel); Unsupported outside what the module docstring lists."""
    p = e.params
    lhs, rhs = ins
    out_aval = e.outvars[0].aval
    nd = len(lhs.shape)

    def refuse(why):
        raise Unsupported("conv_general_dilated", where, why)
    dn = p.get("dimension_numbers")
    ident = tuple(range(nd))
    specs = (getattr(dn, "lhs_spec", None), getattr(dn, "rhs_spec", None), getattr(dn, "out_spec", None))
    if any(tuple(s) != ident for s in specs if s is not None) or None in specs:
        refuse("a convolution in another layout than jnp's (N, C, spatial...), (O, I, spatial...)")
    if any(int(s) != 1 for s in p["window_strides"]) or any(int(d) != 1 for d in p["lhs_dilation"]):
        refuse("a strided or input-dilated convolution")
    if int(p["feature_group_count"]) != 1 or int(p["batch_group_count"]) != 1:
        refuse("a grouped convolution")
    n, c = lhs.shape[:2]
    o, i_ch = rhs.shape[:2]
    taps = tuple(rhs.shape[2:])
    if i_ch != c:                   # pragma: no cover - JAX checks this
        refuse("input channels that differ from the kernel's")
    terms = o * i_ch * math.prod(taps)
    if terms > MAX_TERMS:
        refuse(f"{terms} products per output element (loopkern spells out at most {MAX_TERMS})")
    dt = np.dtype(lhs.dtype)
    if dt != np.dtype(rhs.dtype):   # pragma: no cover - JAX promotes first
        refuse(f"an input of {dt} and a kernel of {rhs.dtype}")
    weights = known_value(rhs, consts)
    acc_dt = np.dtype(out_aval.dtype)
    if acc_dt != dt:
        # preferred_element_type: the products and their sum in the result's type, as XLA
        # computes them (int8 inputs summed in int32 do not wrap at 8 bits)
        if not np.can_cast(dt, acc_dt, "safe"):
            refuse(f"a convolution of {dt} values with a result of {acc_dt} (preferred_element_type narrower "
                   f"than the inputs)")
        lhs, rhs = (emit("convert_element_type", {"new_dtype": acc_dt, "weak_type": False, "sharding": None},
                         [v], tuple(v.shape), acc_dt, where) for v in (lhs, rhs))
        dt = acc_dt
    out_sp = tuple(out_aval.shape[2:])
    rdil = tuple(int(d) for d in p["rhs_dilation"])
    pads = [(int(lo), int(hi)) for lo, hi in p["padding"]]
    x = lhs
    if any(lo or hi for lo, hi in pads):
        shape = (n, c) + tuple(s + lo + hi for s, (lo, hi) in zip(lhs.shape[2:], pads))
        x = emit("pad", {"padding_config": ((0, 0, 0), (0, 0, 0)) + tuple((lo, hi, 0) for lo, hi in pads)},
                 [lhs, Lit(np.zeros((), dt))], shape, dt, where)
    outs = []
    for oc in range(o):
        acc = None
        for ic in range(i_ch):
            for k in itertools.product(*(range(t) for t in taps)):
                at = tuple(kk * d for kk, d in zip(k, rdil))
                win = emit("slice", {"start_indices": (0, ic) + at,
                                     "limit_indices": (n, ic + 1) + tuple(a + s for a, s in zip(at, out_sp)),
                                     "strides": None}, [x], (n, 1) + out_sp, dt, where)
                if weights is not None:
                    w = Lit(np.asarray(weights[(oc, ic) + k], dt))
                else:
                    one = emit("slice", {"start_indices": (oc, ic) + k,
                                         "limit_indices": (oc + 1, ic + 1) + tuple(kk + 1 for kk in k),
                                         "strides": None}, [rhs], (1,) * nd, dt, where)
                    w = emit("reshape", {"new_sizes": (), "dimensions": None, "sharding": None}, [one], (), dt, where)
                term = emit("mul", {}, [win, w], (n, 1) + out_sp, dt, where)
                acc = term if acc is None else emit("add", {}, [acc, term], (n, 1) + out_sp, dt, where)
        outs.append(acc)
    return outs[0] if o == 1 else emit("concatenate", {"dimension": 1}, outs, (n, o) + out_sp, dt, where)
