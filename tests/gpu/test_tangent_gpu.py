"""Tangent kernels (MegaKernel.tangent, kernel.jax under jax.jvp) and jax.grad on the GPU: heat and the
two-level wave scheme with a recorded reduction, at several block counts, against central
finite differences of float64 NumPy references."""

import numpy as np
import pytest

import loopkern as lk
import test_tangent as TT
import workloads as W

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("blocks", [None, 3, 132])
def test_heat_tangent_on_the_gpu(blocks, rng):
    kt = lk.megakernel(W.heat_step, swap=[("u", "v")]).tangent("u", "v", "alpha")
    n, steps = 65536 + 3, 301
    u0, du = rng.random(n), rng.standard_normal(n)
    u, v, ud, vd = u0.copy(), u0.copy(), du.copy(), du.copy()
    run = kt(u, ud, v, vd, 0.2, 0.3, steps=steps, backend="cuda", scope="grid", blocks=blocks)
    assert run.steps == steps
    (fd,) = TT._fd(lambda x, a: [W.heat_ref(x, steps, a)], [u0, 0.2], [du, 0.3])
    np.testing.assert_allclose(ud, fd, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("blocks", [None, 5])
def test_wave_tangent_on_the_gpu(blocks, rng):
    kt = lk.megakernel(TT.wave_step, swap=[("u", "v")]).tangent("u", "v", "c2", "energy")
    n, steps = 4099, 50
    u0, v0 = rng.random(n), rng.random(n)
    du, dv = rng.standard_normal(n), rng.standard_normal(n)
    u, v, e, ud, vd, ed = u0.copy(), v0.copy(), np.zeros(steps), du.copy(), dv.copy(), np.zeros(steps)
    kt(u, ud, v, vd, 0.3, 0.4, e, ed, steps=steps, backend="cuda", scope="grid", blocks=blocks)
    fu, fv, fe = TT._fd(lambda a, b, c: TT.wave_ref(a, b, c, steps), [u0, v0, 0.3], [du, dv, 0.4])
    np.testing.assert_allclose(ud, fu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ed, fe, rtol=1e-5, atol=1e-5)


def test_jax_jvp_through_kernel_jax_on_the_gpu(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(65536).astype(np.float32))
    du = jnp.asarray(rng.standard_normal(65536).astype(np.float32))

    def f(u, a):
        return k.jax(u, u, a, steps=100)[0]
    p, t = jax.jit(lambda u, a, du, da: jax.jvp(f, (u, a), (du, da)))(u0, np.float32(0.2), du, np.float32(0.5))
    ref_p, ref_t = jax.jvp(lambda u, a: TT._heat_jnp(u, a, 100), (u0, np.float32(0.2)), (du, np.float32(0.5)))
    np.testing.assert_allclose(np.asarray(p), np.asarray(ref_p), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(t), np.asarray(ref_t), rtol=1e-4, atol=1e-4)


def test_jax_grad_through_kernel_jax_on_the_gpu(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(65536).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(65536).astype(np.float32))

    def loss(u, a):
        return (k.jax(u, u, a, steps=200)[0] * w).sum()

    def ref(u, a):
        return (TT._heat_jnp(u, a, 200) * w).sum()
    gu, ga = jax.jit(jax.grad(loss, argnums=(0, 1)))(u0, np.float32(0.2))
    ru, ra = jax.grad(ref, argnums=(0, 1))(u0, np.float32(0.2))
    np.testing.assert_allclose(np.asarray(gu), np.asarray(ru), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(float(ga), float(ra), rtol=1e-3)
