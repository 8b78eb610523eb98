"""Probe (GPU): jax.grad of a vmapped kernel.jax call. Usage: python bench/probe_vmap_grad.py [VMAP_METHOD]"""
import os
import sys
import numpy as np
import jax
import jax.numpy as jnp
import loopkern as lk
import test_adjoint as TA

if len(sys.argv) > 1:
    orig = jax.ffi.ffi_call
    jax.ffi.ffi_call = lambda *a, **kw: orig(*a, **{**kw, "vmap_method": sys.argv[1]})
    print("vmap_method", sys.argv[1])
out = os.environ.get("OUT", "/tmp")
rng = np.random.default_rng(0)
xs = rng.random((3, 64)).astype(np.float32)
k = lk.megakernel(TA.nonlinear_inplace)
cpu = jax.devices("cpu")[0]


def ref_rows(s):
    with jax.default_device(cpu):
        jax.config.update("jax_enable_x64", True)
        g = [float(jax.grad(lambda s_, x=x: TA._nonlinear_jnp(x.astype(np.float64) * s_, 0.8, 5).sum())(s))
             for x in xs]
        jax.config.update("jax_enable_x64", False)
    return np.array(g)


def show(label, f):
    try:
        v = f()
        print(label, np.asarray(v).ravel()[:6], flush=True)
    except Exception as e:          # noqa
        print(label, "RAISED", type(e).__name__, str(e)[:300], flush=True)


s = np.float32(0.7)
want = ref_rows(0.7)
print("ref per-row", want, "sum", want.sum())
row = lambda s_, x, **kw: k.jax(x * s_, np.float32(0.8), steps=5, **kw)[0].sum()
show("fwd vmap - rows (max diff)", lambda: np.abs(np.asarray(jax.vmap(lambda x: k.jax(x, np.float32(0.8), steps=5)[0])(jnp.asarray(xs)))
                                      - np.stack([np.asarray(k.jax(jnp.asarray(x), np.float32(0.8), steps=5)[0]) for x in xs])).max())
show("grad per row (no vmap)", lambda: [float(jax.grad(row)(s, jnp.asarray(x))) for x in xs])
show("grad per row every=10", lambda: [float(jax.grad(lambda a, b: row(a, b, checkpoint_every=10))(s, jnp.asarray(x))) for x in xs])
show("vmap(grad) rows", lambda: jax.vmap(jax.grad(row), in_axes=(None, 0))(s, jnp.asarray(xs)))
show("vmap(grad) rows every=10", lambda: jax.vmap(jax.grad(lambda a, b: row(a, b, checkpoint_every=10)), in_axes=(None, 0))(s, jnp.asarray(xs)))
ours = lambda s_: jax.vmap(lambda x: row(s_, x))(jnp.asarray(xs)).sum()
ours10 = lambda s_: jax.vmap(lambda x: row(s_, x, checkpoint_every=10))(jnp.asarray(xs)).sum()
show("grad(vmap) eager", lambda: jax.grad(ours)(s))
show("grad(vmap) jit", lambda: jax.jit(jax.grad(ours))(s))
show("grad(vmap) every=10", lambda: jax.grad(ours10)(s))
X = jnp.asarray(xs)
vj = lambda: jax.vjp(lambda X_: jax.vmap(lambda x: k.jax(x, np.float32(0.8), steps=5)[0])(X_), X)[1](jnp.ones_like(X))[0]
rows_vjp = lambda: np.stack([np.asarray(jax.vjp(lambda x_: k.jax(x_, np.float32(0.8), steps=5)[0], jnp.asarray(x))[1](jnp.ones(64, jnp.float32))[0]) for x in xs])
show("vjp(vmap) X bar", vj)
show("vjp rows X bar", rows_vjp)
with open(f"{out}/jaxpr-{sys.argv[1] if len(sys.argv) > 1 else 'default'}.txt", "w") as f:
    f.write(str(jax.make_jaxpr(jax.grad(ours))(s)))
    f.write("\n\n==== HLO\n")
    f.write(jax.jit(jax.grad(ours)).lower(s).compile().as_text())
# the second half of the failing test: jacfwd of jacfwd
x1 = jnp.asarray(xs[0, :8])
show("jacfwd(jacfwd) diag", lambda: jnp.diagonal(jax.jacfwd(jax.jacfwd(lambda x: k.jax(x, np.float32(0.8), steps=3)[0].sum()))(x1)))
with jax.default_device(cpu):
    jax.config.update("jax_enable_x64", True)
    show("jacfwd(jacfwd) ref diag", lambda: jnp.diagonal(jax.jacfwd(jax.jacfwd(lambda x: TA._nonlinear_jnp(x, 0.8, 3).sum()))(jnp.asarray(xs[0, :8], jnp.float64))))
