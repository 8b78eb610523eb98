"""Reverse mode on random differentiable steps: ``jax.grad`` through ``kernel.jax`` (float64, JAX's
CPU backend) against central finite differences of the reference interpreter
(``tests/interp.py``) along random directions.

The steps are drawn from a small grammar of what reverse mode covers (``loopkern/adjoint.py``):
1-D and 2-D stencils whose reads sit at constant offsets of radius up to 2 (some wrapping
around the start, ``u[i - 2]`` at ``i = 1``, which keeps atomics; the others are gathered),
smooth ``math`` functions, locals, conditional expressions on loaded values, boundary loops,
helpers in expression form, inner ``range`` loops of a count given as an argument (computed
bounds: sums, and a recurrence) or of constant bounds (unrolled), a second phase after
``lk.sync()``, and a float parameter. Each program is written to a file (loopkern reads a step's source) and checked in
both adjoint forms."""

import importlib.util
import sys

import numpy as np
import pytest

import interp
import loopkern as lk

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from refs import jax_x64  # noqa: E402

HEADER = '''import math
import loopkern as lk


def soft(x):
    d = x - 0.5
    return d * math.tanh(d) + 0.1 * x


def mix(x, y):
    return 0.5 * (x + y) - 0.1 * x * y
'''

FUNCS = ["{}", "math.sin({})", "math.tanh({})", "({} * {})", "soft({})"]


class _Gen:
    def __init__(self, rng, ndim):
        self.rng = rng
        self.ndim = ndim

    def read(self, arr, radius, idx):
        offs = [int(self.rng.integers(-radius, radius + 1)) for _ in range(self.ndim)]
        parts = [v if o == 0 else f"{v} + {o}" if o > 0 else f"{v} - {-o}" for v, o in zip(idx, offs)]
        return f"{arr}[{', '.join(parts)}]"

    def term(self, arr, radius, idx):
        f = FUNCS[int(self.rng.integers(len(FUNCS)))]
        r = self.read(arr, radius, idx)
        e = f.format(r, r) if f.count("{}") == 2 else f.format(r)
        c = float(np.round(self.rng.uniform(-0.3, 0.3), 3))
        if self.rng.random() < 0.2:
            e = f"mix({e}, {self.read(arr, radius, idx)})"
        if self.rng.random() < 0.2:
            other = self.read(arr, radius, idx)
            e = f"({e} if {self.read(arr, 0, idx)} > 0.5 else 0.5 * {other})"
        return f"{c} * {e}"


def _program(seed):
    """(source, ndim, uses an int radius argument)."""
    rng = np.random.default_rng(seed)
    ndim = 1 + int(rng.random() < 0.4)
    gen = _Gen(rng, ndim)
    radius = int(rng.integers(1, 3))
    start = radius if rng.random() < 0.8 else radius - 1      # radius - 1: the lowest reads wrap
    idx = ["i"] if ndim == 1 else ["i", "j"]
    lines = ["", "", "def step(t, u, v, a, q):", "    n = u.shape[0]"]
    if ndim == 2:
        lines.append("    m = u.shape[1]")
        loop = f"for i, j in lk.grid(({start}, n - {radius}), ({radius}, m - {radius})):"
    else:
        loop = f"for i in lk.range({start}, n - {radius}):"
    lines.append("    " + loop)
    body = []
    if rng.random() < 0.5:
        body.append(f"s = {gen.term('u', radius, idx)} + {gen.term('u', radius, idx)}")
        extra = " + s * s"
    else:
        extra = ""
    inner = rng.random()
    if inner < 0.35 and ndim == 1:
        body += ["acc = 0.0", "for k in range(-q, q + 1):", "    w = u[i + k]", "    acc += w * math.cos(w)"]
        extra += " + 0.05 * acc"
    elif inner < 0.5:
        # a recurrence over an inner loop of computed bounds (walked backwards by the adjoint)
        body += [f"z = {gen.read('u', radius, idx)}", "for k in range(q + 1):", "    z = z + 0.1 * math.sin(z)"]
        extra += " + 0.2 * z"
    elif inner < 0.65:
        body += ["acc = 0.0", "for k in range(3):", f"    acc += {gen.term('u', radius, idx)} * (k + 1)"]
        extra += " + 0.05 * acc"
    terms = " + ".join(gen.term("u", radius, idx) for _ in range(int(rng.integers(1, 4))))
    me = f"u[{', '.join(idx)}]"
    body.append(f"v[{', '.join(idx)}] = {me} + a * ({terms}{extra})")
    lines += ["        " + b for b in body]
    if rng.random() < 0.5:
        # a second phase reading what the first stored, at offsets, into u itself
        lines.append("    lk.sync()")
        if ndim == 2:
            lines.append(f"    for i, j in lk.grid(({radius + 1}, n - {radius + 1}), ({radius}, m - {radius})):")
            lines.append("        u[i, j] = 0.5 * (v[i - 1, j] + v[i + 1, j]) + 0.1 * math.sin(v[i, j])")
        else:
            lines.append(f"    for i in lk.range({radius + 1}, n - {radius + 1}):")
            lines.append("        u[i] = 0.5 * (v[i - 1] + v[i + 1]) + 0.1 * math.sin(v[i])")
    return HEADER + "\n".join(lines) + "\n", ndim, "q" in "".join(body)


def _load(source, tmp_path, seed):
    path = tmp_path / f"lkadjfuzz_{seed}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"lkadjfuzz_{seed}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.step


@pytest.mark.parametrize("seed", range(16))
def test_grad_of_random_differentiable_steps_against_finite_differences(seed, tmp_path):
    source, ndim, _ = _program(seed)
    step = _load(source, tmp_path, seed)
    rng = np.random.default_rng(1000 + seed)
    shape = (23,) if ndim == 1 else (11, 9)
    u0, w, du = rng.random(shape), rng.standard_normal(shape), rng.standard_normal(shape)
    a, da, q, steps = 0.3, 0.7, 2, 6

    def loss_ref(u, a):
        uu, vv = u.copy(), u.copy()
        interp.run(step, [uu, vv, a, q], steps, swap=[("u", "v")])
        return float((w * uu).sum() + 0.5 * (uu ** 2).sum() + 0.25 * (vv ** 2).sum())
    h = 1e-6
    fd = (loss_ref(u0 + h * du, a + h * da) - loss_ref(u0 - h * du, a - h * da)) / (2 * h)
    k = lk.megakernel(step, swap=[("u", "v")])
    for form in ("gather", "scatter"):
        with jax_x64():
            def loss(u, a):
                uu, vv = k.jax(u, u, a, q, steps=steps, adjoint_form=form)
                return (w * uu).sum() + 0.5 * (uu ** 2).sum() + 0.25 * (vv ** 2).sum()
            gu, ga = jax.grad(loss, argnums=(0, 1))(jnp.asarray(u0), a)
            got = float((np.asarray(gu) * du).sum() + float(ga) * da)
        assert got == pytest.approx(fd, rel=1e-5, abs=1e-6), f"{form} form\n{source}"
