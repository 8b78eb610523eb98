"""Forward-mode tangent kernels (loopkern/tangent.py, MegaKernel.tangent): the directional
derivative after many steps against central finite differences of a float64 NumPy reference
of the same loop (not of the kernel), on the CPU backend and under the CUDA simulator."""

import math

import numpy as np
import pytest

import loopkern as lk
import workloads as W
from loopkern.errors import ArgumentError, StepSyntaxError


def nonlinear_step(t, u, v, w, k):
    # if, conditional expression, math, abs/min/max, a division, a power, an integer local (no
    # tangent), a per-thread partial sum reduced with lk.sum and used by every element
    n = u.shape[0]
    for i in lk.range(n):
        left = u[i - 1] if i > 0 else u[n - 1]
        x = 0.5 * (left + u[i])
        if x > 0.5:
            x = math.exp(-x) + x ** 2 / 4.0
        else:
            x = math.sin(x) * abs(u[i] - 0.5)
        m = i % 3
        v[i] = min(x, 2.0) + max(k * u[i], 0.1) + m * 0.01
    acc = 0.0
    for i in lk.range(n):
        acc += u[i] * u[i]
    s = lk.sum(acc)
    for i in lk.range(n):
        w[i] = v[i] / (1.0 + math.sqrt(v[i] * v[i] + s))


def nonlinear_ref(u0, w0, k, steps):
    u, w = u0.astype(np.float64).copy(), w0.astype(np.float64).copy()
    n = u.shape[0]
    for _ in range(steps):
        v = np.empty_like(u)
        for i in range(n):
            left = u[i - 1] if i > 0 else u[n - 1]
            x = 0.5 * (left + u[i])
            x = math.exp(-x) + x ** 2 / 4.0 if x > 0.5 else math.sin(x) * abs(u[i] - 0.5)
            v[i] = min(x, 2.0) + max(k * u[i], 0.1) + (i % 3) * 0.01
        w = v / (1.0 + np.sqrt(v * v + (u * u).sum()))
        u, v = v, u
    return u, w


def scatter_step(t, x, y, g):
    n = x.shape[0]
    for i in lk.range(n):
        lk.atomic.add(y, i % 4, g * x[i] * x[i])


def _fd(ref, args, dirs, h=1e-6):
    plus = ref(*[a + h * d for a, d in zip(args, dirs)])
    minus = ref(*[a - h * d for a, d in zip(args, dirs)])
    return [(p - m) / (2 * h) for p, m in zip(plus, minus)]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_heat_tangent_is_the_exact_directional_derivative(backend, rng):
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    kt = k.tangent("u", "v", "alpha")
    n, steps, alpha = 40 if backend == "cuda" else 300, 7 if backend == "cuda" else 101, 0.2
    u0, du = rng.random(n), rng.standard_normal(n)
    da = 0.3
    u, v, ud, vd = u0.copy(), u0.copy(), du.copy(), du.copy()
    run = kt(u, ud, v, vd, alpha, da, steps=steps, backend=backend)
    assert run.steps == steps
    np.testing.assert_allclose(u, W.heat_ref(u0, steps, alpha), rtol=1e-12, atol=1e-12)   # primal unchanged
    (fd,) = _fd(lambda x, a: [W.heat_ref(x, steps, a)], [u0, alpha], [du, da])
    np.testing.assert_allclose(ud, fd, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_a_nonlinear_step_with_branches_math_and_reductions(backend, rng):
    k = lk.megakernel(nonlinear_step, swap=[("u", "v")])
    kt = k.tangent("u", "v", "w", "k")
    n, steps = 24, 5
    u0 = rng.random(n)
    w0 = np.zeros(n)
    du, dk = rng.standard_normal(n), 0.7
    u, v, w = u0.copy(), u0.copy(), w0.copy()
    ud, vd, wd = du.copy(), du.copy(), np.zeros(n)
    kt(u, ud, v, vd, w, wd, 1.3, dk, steps=steps, backend=backend)
    ru, rw = nonlinear_ref(u0, w0, 1.3, steps)
    np.testing.assert_allclose(u, ru, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w, rw, rtol=1e-12, atol=1e-12)
    fu, fw = _fd(lambda x, kk: nonlinear_ref(x, w0, kk, steps), [u0, 1.3], [du, dk])
    np.testing.assert_allclose(ud, fu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(wd, fw, rtol=1e-5, atol=1e-6)


def test_an_atomic_scatter_carries_its_tangent(rng):
    k = lk.megakernel(scatter_step)
    kt = k.tangent("x", "y", "g")
    x0, dx = rng.random(30), rng.standard_normal(30)
    y, yd = np.zeros(4), np.zeros(4)
    kt(x0.copy(), dx, y, yd, 2.0, 0.5, steps=3, backend="cpu")
    ref = np.zeros(4)
    for i in range(30):
        ref[i % 4] += 3 * (0.5 * x0[i] ** 2 + 2.0 * 2 * x0[i] * dx[i])
    np.testing.assert_allclose(yd, ref, rtol=1e-12)


def test_the_tangent_step_keeps_the_users_lines_and_names():
    kt = lk.megakernel(W.heat_step, swap=[("u", "v")]).tangent("u", "v")
    assert kt.spec.param_names == ("u", "u_dot", "v", "v_dot", "alpha")
    src = kt.source(backend="cpu")
    assert "v_dot[" in src and "alpha_dot" not in src
    line = W.heat_step.__code__.co_firstlineno + 3          # v[i] = u[i] + alpha * (...)
    assert f"# line {line}" in src


def test_what_has_no_rule_is_named_with_its_line():
    def with_max(t, u, v):
        n = u.shape[0]
        m = 0.0
        for i in lk.range(n):
            m = m + u[i]
        top = lk.max(m)
        for i in lk.range(n):
            v[i] = u[i] - top

    with pytest.raises(StepSyntaxError, match=r"test_tangent.py:\d+:\d+: .*lk.max has a derivative only of a "
                                              r"running max"):
        lk.megakernel(with_max, swap=[("u", "v")]).tangent("u", "v")
    with pytest.raises(ArgumentError, match="expected names of the step's parameters"):
        lk.megakernel(W.heat_step, swap=[("u", "v")]).tangent("t")


# ------------------------------------------------------------- through kernel.jax (JAX's CPU)
def _jax():
    return pytest.importorskip("jax")


def _heat_jnp(u, a, steps):
    import jax

    def body(i, x):
        return x.at[1:-1].set(x[1:-1] + a * (x[:-2] - 2 * x[1:-1] + x[2:]))
    return jax.lax.fori_loop(0, steps, body, u)


def test_jax_jvp_and_jacfwd_through_kernel_jax(rng):
    jax = _jax()
    import jax.numpy as jnp
    k = lk.megakernel(W.heat_step, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random(64).astype(np.float32))
    du = jnp.asarray(rng.standard_normal(64).astype(np.float32))

    def f(u, a):
        return k.jax(u, u, a, steps=30)[0]

    ref_p, ref_t = jax.jvp(lambda u, a: _heat_jnp(u, a, 30), (u0, np.float32(0.2)), (du, np.float32(0.5)))
    for fn in (f, jax.jit(f)):
        p, t = jax.jvp(fn, (u0, np.float32(0.2)), (du, np.float32(0.5)))
        np.testing.assert_allclose(np.asarray(p), np.asarray(ref_p), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(t), np.asarray(ref_t), rtol=1e-4, atol=1e-5)
    j = jax.jacfwd(f, argnums=1)(u0, np.float32(0.2))
    j_ref = jax.jacfwd(lambda u, a: _heat_jnp(u, a, 30), argnums=1)(u0, np.float32(0.2))
    np.testing.assert_allclose(np.asarray(j), np.asarray(j_ref), rtol=1e-4, atol=1e-5)


def test_jax_jvp_of_a_loop_to_tolerance_holds_the_step_count(rng):
    jax = _jax()
    import jax.numpy as jnp
    k = lk.megakernel(W.jacobi_step, swap=[("u", "v")])
    u0 = jnp.asarray(rng.random((12, 10)).astype(np.float32))
    du = jnp.asarray(rng.standard_normal((12, 10)).astype(np.float32))

    def f(u):
        out, _, count = k.jax(u, u, 1e-3, max_steps=500)
        return out, count
    (p, n), (t, _) = jax.jvp(f, (u0,), (du,))
    # Jacobi is linear in u: with the step count held, the tangent is the same iteration on du
    ref = np.asarray(du, np.float64)
    for _ in range(int(n)):
        v = ref.copy()
        v[1:-1, 1:-1] = 0.25 * (ref[:-2, 1:-1] + ref[2:, 1:-1] + ref[1:-1, :-2] + ref[1:-1, 2:])
        ref = v
    np.testing.assert_allclose(np.asarray(t), ref, rtol=1e-4, atol=1e-5)
    assert int(n) == int(k.jax(u0, u0, 1e-3, max_steps=500)[-1])


def test_an_accumulating_loop_keeps_accumulating_its_tangent():
    # x += e gets x_dot += de, so the tangent of a warp-split loop (loopkern/warpsplit.py) is
    # warp-split too
    import test_warpsplit as WS
    src = lk.megakernel(WS.forces).tangent("pos", "acc").source()
    assert "_lk_rt.warp_sum(ax_dot)" in src and "_lk_rt.warp_sum(ax)" in src


@pytest.mark.sim
def test_the_tangent_of_a_warp_split_loop_under_the_simulator(rng):
    import test_warpsplit as WS
    kt = lk.megakernel(WS.forces).tangent("pos", "acc")
    n = 5                                       # 5 iterations * 32 lanes <= 256 threads: split
    pos0, dpos = rng.standard_normal((n, 2)), rng.standard_normal((n, 2))
    acc0 = rng.standard_normal((n, 2))
    acc, dacc = acc0.copy(), np.zeros((n, 2))
    kt(pos0.copy(), dpos, acc, dacc, 1e-2, steps=2, backend="cuda", threads=256)
    (fd,) = _fd(lambda p: [WS.forces_ref(p, acc0, 1e-2, 2)], [pos0], [dpos])
    np.testing.assert_allclose(dacc, fd, rtol=1e-6, atol=1e-7)


def wave_step(t, u, v, c2, energy):
    # a two-level scheme (v is read and written at the same cell), a reduction recorded by
    # thread 0 at energy[t]
    n = u.shape[0]
    e = 0.0
    for i in lk.range(1, n - 1):
        v[i] = 2.0 * u[i] - v[i] + c2 * (u[i - 1] - 2.0 * u[i] + u[i + 1])
        e += u[i] * u[i]
    total = lk.sum(e)
    if lk.thread_id() == 0:
        energy[t] = total


def wave_ref(u0, v0, c2, steps):
    u, v = u0.astype(np.float64).copy(), v0.astype(np.float64).copy()
    energy = np.zeros(steps)
    for t in range(steps):
        new = v.copy()
        new[1:-1] = 2.0 * u[1:-1] - v[1:-1] + c2 * (u[:-2] - 2.0 * u[1:-1] + u[2:])
        energy[t] = (u[1:-1] ** 2).sum()
        u, v = new, u
    return u, v, energy


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_a_two_level_scheme_with_a_recorded_reduction(backend, rng):
    k = lk.megakernel(wave_step, swap=[("u", "v")])
    kt = k.tangent("u", "v", "c2", "energy")
    n, steps = 30, 9
    u0, v0 = rng.random(n), rng.random(n)
    du, dv, dc = rng.standard_normal(n), rng.standard_normal(n), 0.4
    u, v, e = u0.copy(), v0.copy(), np.zeros(steps)
    ud, vd, ed = du.copy(), dv.copy(), np.zeros(steps)
    kt(u, ud, v, vd, 0.3, dc, e, ed, steps=steps, backend=backend)
    fu, fv, fe = _fd(lambda a, b, c: wave_ref(a, b, c, steps), [u0, v0, 0.3], [du, dv, dc])
    np.testing.assert_allclose(ud, fu, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(vd, fv, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ed, fe, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_phases_separated_by_sync(backend, rng):
    k = lk.megakernel(W.two_phase_step)
    kt = k.tangent("x", "tmp", "out")
    n, steps = 17, 6
    x0, dx = rng.random(n), rng.standard_normal(n)
    x, tmp, out = x0.copy(), np.zeros(n), np.zeros(n)
    xd, tmpd, outd = dx.copy(), np.zeros(n), np.zeros(n)
    kt(x, xd, tmp, tmpd, out, outd, steps=steps, backend=backend)
    fx, fo = _fd(lambda a: W.two_phase_ref(a, steps), [x0], [dx])
    np.testing.assert_allclose(xd, fx, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(outd, fo, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fn,x0,deriv", [
    (math.tan, 0.3, lambda x: 1 / math.cos(x) ** 2), (math.tanh, 0.4, lambda x: 1 - math.tanh(x) ** 2),
    (math.log, 1.7, lambda x: 1 / x), (math.log1p, 0.2, lambda x: 1 / (1 + x)),
    (math.expm1, 0.3, math.exp), (math.atan, 0.8, lambda x: 1 / (1 + x * x)),
    (math.sinh, 0.5, math.cosh), (math.cosh, 0.5, math.sinh), (math.cos, 0.9, lambda x: -math.sin(x)),
    (math.sqrt, 2.5, lambda x: 0.5 / math.sqrt(x))])
def test_each_math_rule(fn, x0, deriv):
    name = fn.__name__
    ns = {"lk": lk, "math": math}
    src = (f"def rule_step(t, x, y):\n"
           f"    for i in lk.range(x.shape[0]):\n"
           f"        y[i] = math.{name}(x[i])\n")
    import linecache
    import types
    path = f"<tangent-rule-{name}>"
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)
    exec(compile(src, path, "exec"), ns)
    fn_step = types.FunctionType(ns["rule_step"].__code__, ns)
    kt = lk.megakernel(fn_step).tangent("x", "y")
    x, y = np.array([x0]), np.zeros(1)
    xd, yd = np.array([1.0]), np.zeros(1)
    kt(x, xd, y, yd, steps=1, backend="cpu")
    assert y[0] == pytest.approx(fn(x0), rel=1e-14)
    assert yd[0] == pytest.approx(deriv(x0), rel=1e-12)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.sim)])
def test_tangent_and_adjoint_steps_draw_what_the_step_draws(backend, rng):
    # a draw is numbered by its call site in the step; the generated steps name that site and
    # the step index explicitly, so their copies of a draw give the step's number (against the
    # reference interpreter's Philox)
    import interp

    def noisy(t, u, v):
        n = u.shape[0]
        for i in lk.range(n):
            v[i] = u[i] * lk.random.uniform(i) + lk.random.normal(i, 2)

    k = lk.megakernel(noisy)
    n, seed, t0 = 16, 77, 5
    r = np.array([interp.ref_uniform(seed, t0, i, 0, 1) for i in range(n)])
    u, ud, g = rng.random(n), rng.standard_normal(n), rng.standard_normal(n)

    def run(kernel, *arrays):
        dev = [a.copy() for a in arrays]
        if backend == "cuda":
            from numba import cuda
            dev = [cuda.to_device(a) for a in dev]
        kernel(*dev, steps=1, start=t0, seed=seed, backend=backend)
        return [d.copy_to_host() if backend == "cuda" else d for d in dev]

    kt = k.tangent("u", "v")
    assert list(kt.spec.param_names) == ["u", "u_dot", "v", "v_dot"]
    _, _, _, vd = run(kt, u, ud, np.zeros(n), np.zeros(n))
    np.testing.assert_allclose(vd, ud * r, rtol=1e-12)
    ka = k.adjoint("u", "v")
    assert list(ka.spec.param_names) == ["u", "u_bar", "v", "v_bar"]
    _, ub, _, vb = run(ka, u, np.zeros(n), np.zeros(n), g)
    np.testing.assert_allclose(ub, g * r, rtol=1e-12)
    np.testing.assert_array_equal(vb, 0.0)


def test_a_generated_kernel_keeps_its_own_step():
    # the tangent kernel's step is the generated one: differentiating it again (second order)
    # works on that step, not on the user's function
    kt = lk.megakernel(W.heat_step, swap=[("u", "v")]).tangent("u", "v")
    assert kt.__name__ == "heat_step_jvp"
    k2 = kt.tangent("u_dot", "v_dot")
    assert k2.spec.param_names == ("u", "u_dot", "u_dot_dot", "v", "v_dot", "v_dot_dot", "alpha")


def _phased(t, x, f):
    n = x.shape[0]
    for i in lk.range(n):
        f[i] = x[i] * x[i]
    lk.sync()
    for i in lk.range(n):
        x[i] += 0.1 * f[(i + 1) % n]


def _counts(t, x, k):
    for i in lk.range(x.shape[0]):
        k[i] = int(x[i] * 10.0)          # an integer of an active value: no derivative to keep
        x[i] = x[i] * 0.5


def test_a_differentiated_value_stored_into_an_array_left_out_is_refused(rng):
    # tangent("u") of a swap pair (u, v) left u_dot unchanged, and tangent("x") of a step with an
    # intermediate array f silently dropped the path through f; now each names the array
    heat = lk.megakernel(W.heat_step, swap=[("u", "v")])
    for k, wrt, name in ((heat, ("u",), "v"), (lk.megakernel(_phased), ("x",), "f")):
        for make in (k.tangent, k.adjoint):
            with pytest.raises(StepSyntaxError, match=rf"is stored into '{name}', which is not differentiated"):
                make(*wrt)
    # named too, the derivative matches central differences of a float64 NumPy reference
    x0, dx = rng.random(7), rng.standard_normal(7)

    def ref(x, steps=3):
        x = x.copy()
        for _ in range(steps):
            x = x + 0.1 * np.roll(x * x, -1)
        return x
    h = 1e-6
    fd = (ref(x0 + h * dx) - ref(x0 - h * dx)) / (2 * h)
    x, xd, f, fd_ = x0.copy(), dx.copy(), np.zeros(7), np.zeros(7)
    lk.megakernel(_phased).tangent("x", "f")(x, xd, f, fd_, steps=3, backend="cpu")
    np.testing.assert_allclose(xd, fd, rtol=1e-6, atol=1e-8)
    # an int(...) of an active value into an integer array is no derivative to lose
    x, xd, kk = x0.copy(), dx.copy(), np.zeros(7, np.int64)
    lk.megakernel(_counts).tangent("x")(x, xd, kk, steps=2, backend="cpu")
    np.testing.assert_allclose(xd, dx * 0.25)
