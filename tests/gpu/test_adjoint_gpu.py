"""Reverse mode on the GPU: jax.grad through kernel.jax (float32, XLA's GPU stream, several
block counts, fields of tens of thousands of elements so that many blocks and grid barriers
take part) against jax.grad of the same loop written in jnp, evaluated in float64 on JAX's
CPU backend. The steps are test_adjoint's: lk.sync() phases, several loops storing one array,
lk.sum reductions, an lk.atomic.add scatter, lk.random draws, stores inside if statements, an
unrolled inner loop, a step that returns a condition, and a run split with start=."""

import numpy as np
import pytest

import loopkern as lk
import test_adjoint as TA
import workloads as W
from gpu.jax_gpu import jax, jnp, require_gpu_jax
from refs import jax_x64

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def gpu_jax():
    require_gpu_jax()


def _draw(rng, *shapes, scale=1.0, uniform=False):
    """float32 draws (widened exactly for the float64 reference)."""
    out = [((rng.random(s) if uniform else rng.standard_normal(s)) * scale).astype(np.float32) for s in shapes]
    return out[0] if len(out) == 1 else out


def _f32(values):
    return jnp.asarray(np.asarray(values, np.float32))


def _reference(fn, *args, argnums):
    """jax.grad of ``fn`` at ``args`` in float64 on the CPU (float arrays and scalars widened,
    integer arrays kept)."""
    cpu = jax.devices("cpu")[0]
    with jax_x64(), jax.default_device(cpu):
        wide = []
        for a in args:
            a = np.asarray(a)
            wide.append(jnp.asarray(a.astype(np.float64) if a.dtype.kind == "f" else a))
        got = jax.grad(fn, argnums=argnums)(*wide)
        return [np.asarray(g) for g in got]


def _close(got, want, tol=2e-3):
    """float32 gradients against float64 ones: the largest error within tol of the largest
    component (a component-wise rtol would fail on components that cancel to near zero)."""
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape
        assert np.isfinite(g).all()
        scale = max(float(np.abs(r).max()), 1e-30)
        err = float(np.abs(g - r).max())
        assert err <= tol * scale, f"max error {err:.3e} against max |grad| {scale:.3e}"


def _on_gpu(x):
    assert {d.platform for d in x.devices()} == {"gpu"}


@pytest.mark.parametrize("blocks", [None, 5])
def test_grad_of_a_step_in_phases_on_the_gpu(blocks, rng):
    k = lk.megakernel(W.two_phase_step)
    n, steps = 100_003, 7
    x0, w = _draw(rng, n, n)
    z = jnp.zeros(n, jnp.float32)

    def loss(run):
        def f(x):
            xo, tmp, out = run(x)
            return (xo * w).sum() + (out ** 2).sum() + (tmp * xo).sum()
        return f
    got = jax.jit(jax.grad(loss(lambda x: k.jax(x, z, z, steps=steps, blocks=blocks))))(_f32(x0))
    _on_gpu(got)
    want = _reference(loss(lambda x: TA._two_phase_jnp(x, steps)), x0, argnums=(0,))
    _close([got], want)


def test_grad_of_phases_whose_arrays_several_loops_store_on_the_gpu(rng):
    k = lk.megakernel(TA.smooth_then_flux)
    n, steps = 65_537, 6
    u0, v0, f0, w1, w2 = _draw(rng, *[n] * 5)

    def loss(run):
        def f(u, v, ff, c):
            a, b, d = run(u, v, ff, c)
            return (a * w1).sum() + (b ** 2).sum() + (d * w2).sum()
        return f
    got = jax.grad(loss(lambda u, v, ff, c: k.jax(u, v, ff, c, steps=steps)), argnums=(0, 1, 2, 3))(
        _f32(u0), _f32(v0), _f32(f0), np.float32(0.2))
    want = _reference(loss(lambda u, v, ff, c: TA._smooth_then_flux_jnp(u, v, ff, c, steps)),
                      u0, v0, f0, 0.2, argnums=(0, 1, 2, 3))
    _close(got, want)


@pytest.mark.parametrize("blocks", [None, 3])
def test_grad_through_lk_sum_reductions_on_the_gpu(blocks, rng):
    k = lk.megakernel(TA.normalized)
    n = 65_536
    x0, w = _draw(rng, n, n)

    def ref(x, c):
        return jax.lax.fori_loop(0, 3, lambda t, x: x / (jnp.sqrt(jnp.mean(x * x)) + c), x)
    got = jax.grad(lambda x, c: (k.jax(x, c, steps=3, blocks=blocks)[0] * w).sum(), argnums=(0, 1))(
        _f32(x0), np.float32(0.3))
    want = _reference(lambda x, c: (ref(x, c) * w).sum(), x0, 0.3, argnums=(0, 1))
    _close(got, want)

    # two reductions, a conditional accumulation; scaled so that the state stays of order one
    k2 = lk.megakernel(TA.clipped_mean)
    n2 = 20_000
    x0, y0, w = _draw(rng, n2, n2, n2, scale=0.1)

    def loss(run):
        def f(x, y, a):
            xo, yo = run(x, y, a)
            return (xo * w).sum() + (yo ** 2).sum() * 1e-3
        return f
    got = jax.grad(loss(lambda x, y, a: k2.jax(x, y, a, steps=3, blocks=blocks)), argnums=(0, 1, 2))(
        _f32(x0), _f32(y0), np.float32(0.7))
    want = _reference(loss(lambda x, y, a: TA._clipped_mean_jnp(x, y, a, 3)), x0, y0, 0.7, argnums=(0, 1, 2))
    _close(got, want)


@pytest.mark.parametrize("blocks", [None, 6])
def test_grad_through_an_atomic_scatter_on_the_gpu(blocks, rng):
    k = lk.megakernel(TA.deposit)
    n, m = 50_000, 997
    w0, g0, u = _draw(rng, n, m, n)
    cell = rng.integers(0, m, n).astype(np.int32)

    def loss(run):
        def f(w, g, c):
            wo, go = run(w, g, c)
            return (wo * u).sum() + (go ** 2).sum() * 1e-2
        return f

    def ours(w, g, c):
        wo, _, go = k.jax(w, jnp.asarray(cell), g, c, steps=5, blocks=blocks)
        return wo, go
    got = jax.grad(loss(ours), argnums=(0, 1, 2))(_f32(w0), _f32(g0), np.float32(0.3))
    cpu_cell = cell

    def ref(w, g, c):
        return TA._deposit_jnp(w, jnp.asarray(cpu_cell), g, c, 5)
    want = _reference(loss(ref), w0, g0, 0.3, argnums=(0, 1, 2))
    _close(got, want)


def test_grad_through_lk_random_draws_on_the_gpu(rng):
    k = lk.megakernel(TA.noisy_heat, swap=[("u", "v")])
    n, steps, seed = 4099, 9, 777
    u0, w = _draw(rng, n, uniform=True), _draw(rng, n)
    got = jax.grad(lambda u, a, s: (k.jax(u, u, a, s, steps=steps, seed=seed)[0] ** 2 * w).sum(),
                   argnums=(0, 1, 2))(_f32(u0), np.float32(0.2), np.float32(0.05))
    want = _reference(lambda u, a, s: (TA._noisy_heat_jnp(u, a, s, steps, seed) ** 2 * w).sum(),
                      u0, 0.2, 0.05, argnums=(0, 1, 2))
    _close(got, want)


def test_grad_through_stores_inside_if_statements_on_the_gpu(rng):
    c = lk.megakernel(TA.clipped)
    n, steps = 65_536, 9
    x0 = _draw(rng, n, scale=2.0)
    y0, wy = _draw(rng, n, n)

    def loss(run):
        def f(x, y, kk):
            a, b = run(x, y, kk)
            return (a ** 2).sum() + (b * wy).sum()
        return f
    got = jax.grad(loss(lambda x, y, kk: c.jax(x, y, kk, steps=steps, blocks=7)), argnums=(0, 1, 2))(
        _f32(x0), _f32(y0), np.float32(0.9))
    want = _reference(loss(lambda x, y, kk: TA._clipped_jnp(x, y, kk, steps)), x0, y0, 0.9, argnums=(0, 1, 2))
    _close(got, want)
    assert float(np.abs(np.asarray(got[1])).max()) == 0.0        # y is overwritten before it is read


def test_grad_through_an_inner_loop_of_constant_bounds_on_the_gpu(rng):
    k = lk.megakernel(TA.windowed, swap=[("u", "v")])
    n, steps = 65_537, 4
    u0, w = _draw(rng, n, uniform=True), _draw(rng, n)

    def ref(u, c):
        def body(t, s):
            x, _ = s
            acc = sum(jnp.roll(x, -j) * (j + c) for j in range(3))
            return acc / 3.0 + jnp.exp(-x * x), x
        return jax.lax.fori_loop(0, steps, body, (u, u))[0]
    got = jax.grad(lambda u, c: (k.jax(u, u, c, steps=steps)[0] * w).sum(), argnums=(0, 1))(
        _f32(u0), np.float32(0.5))
    want = _reference(lambda u, c: (ref(u, c) * w).sum(), u0, 0.5, argnums=(0, 1))
    _close(got, want)


@pytest.mark.parametrize("blocks", [None, 4])
def test_grad_of_a_while_loop_on_the_gpu(blocks, rng):
    # the executed step count, found on the GPU in float32, is held: the reference runs as many
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0, w = _draw(rng, (96, 97), uniform=True), _draw(rng, (96, 97))
    tol, max_steps = np.float32(1e-2), 2000
    out = k.jax(_f32(u0), _f32(u0), tol, max_steps=max_steps, blocks=blocks)
    steps = int(out[-1])
    assert 10 < steps < max_steps
    got = jax.jit(jax.grad(lambda u: (k.jax(u, u, tol, max_steps=max_steps, blocks=blocks)[0] * w).sum()))(_f32(u0))
    want = _reference(lambda u: (TA._jacobi_jnp(u, steps) * w).sum(), u0, argnums=(0,))
    _close([got], want)


def test_the_gradient_of_a_chunked_run_on_the_gpu(rng):
    k = lk.megakernel(TA.nonlinear_inplace)
    n = 65_536
    x0 = _draw(rng, n)

    def chunked(x, kk):
        y = k.jax(x, kk, steps=10)[0]
        y = k.jax(y, kk, steps=4, start=10)[0]
        return (k.jax(y, kk, steps=3, start=14)[0] ** 2).sum()
    got = jax.grad(chunked, argnums=(0, 1))(_f32(x0), np.float32(1.3))
    want = _reference(lambda x, kk: (TA._nonlinear_jnp(x, kk, 17) ** 2).sum(), x0, 1.3, argnums=(0, 1))
    _close(got, want)


@pytest.mark.parametrize("blocks", [None, 5])
@pytest.mark.parametrize("ties", [False, True])
def test_grad_through_lk_max_and_min_on_the_gpu(blocks, ties, rng):
    # with ties spread over many threads and blocks, the split must be JAX's (the mean of the
    # tied values' tangents), whichever threads hold them
    k = lk.megakernel(TA.peak_scaled)
    n = 6 * 10_923
    x0 = np.tile(np.array([1.0, -2.0, 2.0, 0.5, -2.0, 2.0], np.float32), n // 6) if ties else _draw(rng, n)
    w = _draw(rng, n)
    got = jax.grad(lambda x, c: (k.jax(x, c, steps=3, blocks=blocks)[0] * w).sum(), argnums=(0, 1))(
        _f32(x0), np.float32(0.3))
    want = _reference(lambda x, c: (TA._peak_scaled_jnp(x, c, 3) * w).sum(), x0, 0.3, argnums=(0, 1))
    _close(got, want)


def test_gather_form_gradients_are_the_same_in_every_run_and_launch_shape(rng):
    # the gather form (the default): each element of u's adjoint is summed by one thread in one
    # order, so the gradient with respect to the field is bitwise the same whatever the block
    # count and from run to run; against float64 jax.grad of the jnp loop (2-D heat, 300 x 257,
    # 60 steps)
    k = lk.megakernel(TA.heat2d, swap=[("u", "v")])
    u0, w = _draw(rng, (300, 257), (300, 257), uniform=True)
    a, steps = np.float32(0.2), 60

    def loss(run):
        return lambda u, a: ((run(u, a) - w) ** 2).sum()
    got = []
    for blocks in (None, 1, 7, 7):
        g = jax.jit(jax.grad(loss(lambda u, a: k.jax(u, u, a, steps=steps, blocks=blocks, adjoint_form="gather")[0]),
                             argnums=(0, 1)))(_f32(u0), a)
        _on_gpu(g[0])
        got.append([np.asarray(x) for x in g])
    want = _reference(loss(lambda u, a: TA._heat2d_jnp(u, a, steps)), u0, a, argnums=(0, 1))
    for g in got:
        _close(g, want)
        np.testing.assert_array_equal(g[0], got[0][0])
    # the scatter form (atomics) agrees to float tolerance
    s = jax.jit(jax.grad(loss(lambda u, a: k.jax(u, u, a, steps=steps, adjoint_form="scatter")[0]),
                         argnums=(0, 1)))(_f32(u0), a)
    _close(s, want)


@pytest.mark.parametrize("blocks", [None, 5])
def test_grad_through_an_inner_loop_of_computed_bounds_on_the_gpu(blocks, rng):
    # all pairs between 20,000 bodies and 300 sources, the inner loop over the sources (bounds
    # from a shape, not unrolled): every thread adds into the sources' adjoint with atomics
    import test_inner_loop_adjoint as TI
    k = lk.megakernel(TI.attract, swap=[("x", "y")])
    x0, w, wt = _draw(rng, 20_000, 300, 20_000)
    c, steps = np.float32(0.7), 4

    def loss(run):
        def f(x, ww, cc):
            a, b = run(x, ww, cc)
            return (a * wt).sum() + (b ** 2).sum()
        return f
    got = jax.jit(jax.grad(loss(lambda x, ww, cc: k.jax(x, x, ww, cc, steps=steps, blocks=blocks)[:2]),
                           argnums=(0, 1, 2)))(_f32(x0), _f32(w), c)
    _on_gpu(got[0])
    want = _reference(loss(lambda x, ww, cc: TI._attract_jnp(x, x, ww, cc, steps)), x0, w, c, argnums=(0, 1, 2))
    _close(got, want)


@pytest.mark.parametrize("blocks", [None, 5])
def test_grad_and_jvp_through_helpers_on_the_gpu(blocks, rng):
    # helpers in expression form (a local, a module constant, a helper calling helpers) inlined
    # into the tangent and adjoint steps
    import test_inline as TN
    k = lk.megakernel(TN.burgers, swap=[("u", "v")])
    u0, w = _draw(rng, 50_001, 50_001)
    a, steps = np.float32(0.2), 30

    def loss(run):
        return lambda u, a: ((run(u, a) - w) ** 2).sum()
    got = jax.jit(jax.grad(loss(lambda u, a: k.jax(u, u, a, steps=steps, blocks=blocks)[0]), argnums=(0, 1)))(
        _f32(u0), a)
    _on_gpu(got[0])
    want = _reference(loss(lambda u, a: TN._burgers_jnp(u, a, steps)), u0, a, argnums=(0, 1))
    _close(got, want)
    du = _draw(rng, 50_001)
    _, t = jax.jvp(loss(lambda u, a: k.jax(u, u, a, steps=steps, blocks=blocks)[0]), (_f32(u0), a),
                   (_f32(du), np.float32(0.5)))
    cpu = jax.devices("cpu")[0]
    with jax_x64(), jax.default_device(cpu):
        _, t_ref = jax.jvp(loss(lambda u, a: TN._burgers_jnp(u, a, steps)),
                           (jnp.asarray(u0, jnp.float64), 0.2), (jnp.asarray(du, jnp.float64), 0.5))
    assert abs(float(t) - float(t_ref)) <= 2e-3 * abs(float(t_ref))


def test_grad_through_vmap_and_forward_over_forward_on_the_gpu(rng):
    """jax.grad of a vmapped call (the batched tangent run transposed by the vmapped reverse
    sweep) and jacfwd of jacfwd (the tangent kernel's own tangent kernel), on the GPU, against
    the jnp loop's in float64 on the CPU (session 28)."""
    k = lk.megakernel(TA.nonlinear_inplace)
    xs = _draw(rng, (3, 64), uniform=True)

    def ours(s):
        return jax.vmap(lambda x: k.jax(x * s, np.float32(0.8), steps=5)[0])(jnp.asarray(xs)).sum()

    def ref(s):
        return jax.vmap(lambda x: TA._nonlinear_jnp(x * s, 0.8, 5))(jnp.asarray(xs.astype(np.float64))).sum()
    got = jax.grad(ours)(np.float32(0.7))
    cpu = jax.devices("cpu")[0]
    with jax_x64(), jax.default_device(cpu):
        want = jax.grad(ref)(0.7)
    _close([got], [want])
    x0 = xs[0, :6]
    h = jax.jacfwd(jax.jacfwd(lambda x: k.jax(x, np.float32(0.8), steps=3)[0]))(jnp.asarray(x0))
    _on_gpu(h)
    with jax_x64(), jax.default_device(cpu):
        r = jax.jacfwd(jax.jacfwd(lambda x: TA._nonlinear_jnp(x, 0.8, 3)))(jnp.asarray(x0.astype(np.float64)))
    _close([h], [r])
