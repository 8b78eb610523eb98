"""kernel.sharded on JAX's CPU backend with several host devices (tests/conftest.py asks XLA for
4): 1-D heat (fixed and periodic), 2-D Jacobi to a tolerance, Life, split along one or two
dimensions, against float64 NumPy references, and bit for bit against the single-device run;
the checks that refuse steps which cannot be split; the cost model."""

import math

import numpy as np
import pytest

import loopkern as lk
from loopkern import sharding
from loopkern.errors import ArgumentError, StepSyntaxError

import workloads as W

jax = pytest.importorskip("jax")
jnp = jax.numpy
P = jax.sharding.PartitionSpec


@pytest.fixture(autouse=True)
def four_cpu_devices():
    if jax.default_backend() != "cpu":
        pytest.skip("these tests run on JAX's CPU backend (tests/gpu has the GPU ones)")
    if len(jax.devices()) < 4:
        pytest.fail("tests/conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=4; JAX sees "
                    f"{len(jax.devices())} device(s): was XLA_FLAGS set elsewhere, or JAX imported first?")


def mesh(*shape):
    return jax.make_mesh(shape, ("x", "y")[:len(shape)])


# ------------------------------------------------------------------------------ steps
@lk.megakernel(swap=[("u", "v")])
def heat(t, u, v, a):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + a * (u[i - 1] - 2.0 * u[i] + u[i + 1])


def heat_ref(u0, a, steps):
    u, v = u0.astype(np.float64), u0.astype(np.float64)
    for _ in range(steps):
        v[1:-1] = u[1:-1] + a * (u[:-2] - 2.0 * u[1:-1] + u[2:])
        u, v = v, u
    return u, v


@lk.megakernel(swap=[("u", "v")])
def ring(t, u, v, a):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i] + a * (u[(i + n - 1) % n] - 2.0 * u[i] + u[(i + 1) % n]) + 0.001 * t


def ring_ref(u0, a, steps, start=0):
    u = u0.astype(np.float64)
    for t in range(start, start + steps):
        u = u + a * (np.roll(u, 1) - 2.0 * u + np.roll(u, -1)) + 0.001 * t
    return u


@lk.megakernel(swap=[("u", "v")])
def wide(t, u, v, k):
    n = u.shape[0]
    for i in lk.range(2, n - 2):
        v[i] = u[i] + k[i] * (u[i - 2] + u[i + 2] - 2.0 * u[i]) * 0.1


jacobi = lk.megakernel(W.jacobi_step, swap=[("u", "v")])


def jacobi_ref(u0, tol, max_steps, every):
    """The iteration with its condition checked after every ``every``-th step."""
    u, v = u0.astype(np.float64), u0.astype(np.float64)
    for k in range(max_steps):
        v[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        err = np.abs(v[1:-1, 1:-1] - u[1:-1, 1:-1]).max()
        u, v = v, u
        if (k + 1) % every == 0 and not err > tol:
            return u, v, k + 1
    return u, v, max_steps


@lk.megakernel(swap=[("a", "b")])
def life(t, a, b):
    n, m = a.shape[0], a.shape[1]
    for i, j in lk.grid(n, m):
        up, down = (i + n - 1) % n, (i + 1) % n
        left, right = (j + m - 1) % m, (j + 1) % m
        s = (a[up, left] + a[up, j] + a[up, right] + a[i, left] + a[i, right]
             + a[down, left] + a[down, j] + a[down, right])
        b[i, j] = 1 if s == 3 or (s == 2 and a[i, j] == 1) else 0


@lk.megakernel(swap=[("a", "b")])
def life_until(t, a, b, floor):
    n, m = a.shape[0], a.shape[1]
    alive = 0
    for i, j in lk.grid(n, m):
        up, down = (i + n - 1) % n, (i + 1) % n
        left, right = (j + m - 1) % m, (j + 1) % m
        s = (a[up, left] + a[up, j] + a[up, right] + a[i, left] + a[i, right]
             + a[down, left] + a[down, j] + a[down, right])
        cell = 1 if s == 3 or (s == 2 and a[i, j] == 1) else 0
        b[i, j] = cell
        alive += cell
    total = lk.sum(alive)
    return total > floor


def life_ref(board, steps):
    a, prev = board.copy(), board.copy()
    pops = []
    for _ in range(steps):
        s = sum(np.roll(np.roll(a, di, 0), dj, 1) for di in (-1, 0, 1) for dj in (-1, 0, 1) if (di, dj) != (0, 0))
        prev, a = a, ((s == 3) | ((s == 2) & (a == 1))).astype(np.int32)
        pops.append(int(a.sum()))
    return a, prev, pops


def put(x):
    return jnp.asarray(x)


# ------------------------------------------------------------------------------ results
@pytest.mark.parametrize("every", [1, 2, 3, None])
def test_heat_fixed_edges_matches_numpy_and_the_single_device_run(rng, every):
    u0 = rng.random(64).astype(np.float32)
    sk = heat.sharded(mesh(4), P("x"), exchange_every=every)
    for steps in (0, 1, 5, 7, 20):
        u, v = sk(put(u0), put(u0), 0.25, steps=steps)
        ru, rv = heat_ref(u0, 0.25, steps)
        np.testing.assert_allclose(np.asarray(u), ru, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(v), rv, rtol=1e-5, atol=1e-6)
        su, sv = heat.jax(put(u0), put(u0), 0.25, steps=steps)
        assert np.array_equal(np.asarray(u), np.asarray(su)) and np.array_equal(np.asarray(v), np.asarray(sv))
        assert u.sharding.spec == P("x")
    assert sk.last_plan["parts"] == (4,) and sk.last_plan["radius"] == (1,)
    if every:
        assert sk.last_plan["exchange_every"] == every and sk.last_plan["halo"] == (every,)


@pytest.fixture
def x64():
    # the global flag, not the jax.enable_x64 context: with several devices JAX runs host
    # callbacks (kernel.jax on the CPU) on its own threads, which do not see a thread's context
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


def test_float64_bit_for_bit_with_the_single_device_run(rng, x64):
    u0 = rng.random(96)
    u, v = heat.sharded(mesh(4), P("x"), exchange_every=5)(put(u0), put(u0), 0.3, steps=33)
    assert u.dtype == jnp.float64
    su, sv = heat.jax(put(u0), put(u0), 0.3, steps=33)
    assert np.array_equal(np.asarray(u), np.asarray(su)) and np.array_equal(np.asarray(v), np.asarray(sv))
    np.testing.assert_allclose(np.asarray(u), heat_ref(u0, 0.3, 33)[0], rtol=1e-13, atol=1e-14)


def test_periodic_ring_with_t_and_start(rng):
    u0 = rng.random(48).astype(np.float32)
    sk = ring.sharded(mesh(4), P("x"), exchange_every=4)
    assert sk.plan.periodic == (True,)
    u, _ = sk(put(u0), put(u0), 0.2, steps=11)
    np.testing.assert_allclose(np.asarray(u), ring_ref(u0, 0.2, 11), rtol=1e-5, atol=1e-5)
    # continued: 11 then 9 steps from start=11 equal 20 steps
    u2, _ = sk(u, put(np.zeros(48, np.float32)), 0.2, steps=9, start=11)
    np.testing.assert_allclose(np.asarray(u2), ring_ref(u0, 0.2, 20), rtol=1e-5, atol=1e-5)
    whole, _ = ring.jax(put(u0), put(u0), 0.2, steps=20)
    assert np.array_equal(np.asarray(u2), np.asarray(whole))


def test_radius_two_with_a_read_only_sharded_coefficient_and_traced_steps(rng):
    u0 = rng.random(64).astype(np.float32)
    k = rng.random(64).astype(np.float32)
    sk = wide.sharded(mesh(4), P("x"))
    assert sk.plan.radius == (2,) and sk.plan.fixed == (2,) and sk.plan.state == (0, 1)

    @jax.jit
    def run(u, kk, n):
        return sk(u, u, kk, steps=n)
    u, v, kout = run(put(u0), put(k), jnp.int32(9))
    ref_u, ref_v = u0.astype(np.float64), u0.astype(np.float64)
    for _ in range(9):
        ref_v[2:-2] = ref_u[2:-2] + k[2:-2] * (ref_u[:-4] + ref_u[4:] - 2.0 * ref_u[2:-2]) * 0.1
        ref_u, ref_v = ref_v, ref_u
    np.testing.assert_allclose(np.asarray(u), ref_u, rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.asarray(kout), k)
    su, _, _ = wide.jax(put(u0), put(u0), put(k), steps=9)
    assert np.array_equal(np.asarray(u), np.asarray(su))


@pytest.mark.parametrize("shape,spec", [((4,), P("x")), ((2, 2), P("x", "y")), ((4,), P(None, "x"))])
@pytest.mark.parametrize("every", [1, 5])
def test_jacobi_to_tolerance_stops_at_a_multiple_of_k(rng, shape, spec, every):
    n = 40
    u0 = np.zeros((n, n), np.float32)
    u0[0, :], u0[-1, :], u0[:, 0], u0[:, -1] = (rng.random(n) for _ in range(4))
    sk = jacobi.sharded(mesh(*shape), spec, exchange_every=every)
    u, v, steps = sk(put(u0), put(u0), 2e-3, max_steps=1000)
    ru, rv, rsteps = jacobi_ref(u0, 2e-3, 1000, every)
    assert int(steps) == rsteps and rsteps % every == 0 and rsteps < 1000
    np.testing.assert_allclose(np.asarray(u), ru, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(v), rv, rtol=1e-5, atol=1e-6)
    if every == 1:      # the condition checked every step: the single-device run
        su, sv, ssteps = jacobi.jax(put(u0), put(u0), 2e-3, max_steps=1000)
        assert int(ssteps) == int(steps)
        assert np.array_equal(np.asarray(u), np.asarray(su)) and np.array_equal(np.asarray(v), np.asarray(sv))


@pytest.mark.parametrize("shape,spec", [((4,), P("x")), ((2, 2), P("x", "y")), ((4,), P(None, "x"))])
def test_life_on_a_torus_is_exact(rng, shape, spec):
    board = (rng.random((32, 32)) < 0.3).astype(np.int32)
    sk = life.sharded(mesh(*shape), spec)
    assert sk.plan.periodic == (True, True)
    for steps in (1, 13, 40):
        a, b = sk(put(board), put(np.zeros_like(board)), steps=steps)
        ra, rb, _ = life_ref(board, steps)
        assert np.array_equal(np.asarray(a), ra) and np.array_equal(np.asarray(b), rb)


def test_an_integer_sum_in_the_condition_is_combined_across_shards(rng):
    board = (rng.random((32, 32)) < 0.35).astype(np.int32)
    _, _, pops = life_ref(board, 200)
    floor = sorted(pops)[len(pops) // 2]        # a population the run falls to at some step
    every = 3
    sk = life_until.sharded(mesh(2, 2), P("x", "y"), exchange_every=every)
    assert sk.plan.slots == (("sum", "alive"),)
    a, b, steps = sk(put(board), put(np.zeros_like(board)), floor, max_steps=200)
    expect = next((k + 1 for k in range(200) if (k + 1) % every == 0 and not pops[k] > floor), 200)
    assert int(steps) == expect
    ra, _, _ = life_ref(board, expect)
    assert np.array_equal(np.asarray(a), ra)


def test_a_one_device_mesh_is_the_single_device_run(rng):
    n = 16
    u0 = np.zeros((n, n), np.float32)
    u0[0, :] = rng.random(n)
    one = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    u, v, steps = jacobi.sharded(one, P("x"))(put(u0), put(u0), 1e-3, max_steps=300)
    su, sv, ssteps = jacobi.jax(put(u0), put(u0), 1e-3, max_steps=300)
    assert int(steps) == int(ssteps)
    assert np.array_equal(np.asarray(u), np.asarray(su)) and np.array_equal(np.asarray(v), np.asarray(sv))


# ------------------------------------------------------------------------------ what is refused
@lk.megakernel(swap=[("u", "v")])
def uses_position(t, u, v, dx):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        x = i * dx
        v[i] = u[i] + x * (u[i - 1] - 2.0 * u[i] + u[i + 1])


@lk.megakernel(swap=[("u", "v")])
def uses_extent(t, u, v):
    n = u.shape[0]
    h = 1.0 / n
    for i in lk.range(1, n - 1):
        v[i] = u[i] + h * (u[i - 1] - 2.0 * u[i] + u[i + 1])


@lk.megakernel(swap=[("u", "v")])
def literal_bounds(t, u, v):
    for i in lk.range(1, 63):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])


@lk.megakernel(swap=[("u", "v")])
def normalises(t, u, v):
    n = u.shape[0]
    s = 0.0
    for i in lk.range(n):
        s += u[i]
    total = lk.sum(s)
    for i in lk.range(1, n - 1):
        v[i] = u[i] / total


@lk.megakernel(swap=[("u", "v")])
def numbers_threads(t, u, v):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + lk.thread_id()


@lk.megakernel(swap=[("u", "v")])
def reads_a_table(t, u, v, c):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] * c[i]


@lk.megakernel
def in_place(t, u):
    # red-black: each step stores the cells of one parity and reads the other's
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        if (i + t) % 2 == 0:
            u[i] = 0.5 * (u[i - 1] + u[i + 1])


@lk.megakernel(swap=[("u", "v")])
def gathers(t, u, v, idx):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[idx[i]]


@lk.megakernel(swap=[("u", "v")])
def carries(t, u, v):
    n = u.shape[0]
    run = 0.0
    for i in lk.range(1, n - 1):
        run = run + u[i]
        v[i] = run
    return lk.max(run) > 0.0


@pytest.mark.parametrize("kernel,specs,needle", [
    (uses_position, P("x"), "'x' (computed from 'i', an index along dimension 0, which is split across devices)"),
    (uses_extent, P("x"), "'n' (the extent along dimension 0, which is split across devices) is used outside"),
    (literal_bounds, P("x"), "measured from the array's edges"),
    (normalises, P("x"), "lk.sum()'s value is used by the step itself"),
    (numbers_threads, P("x"), "lk.thread_id()"),
    (reads_a_table, {"u": P("x"), "v": P("x")}, "'c' is replicated on every shard but indexed by 'i'"),
    (in_place, P("x"), "'u' is written by the step and also accessed at offset"),
    (gathers, {"u": P("x"), "v": P("x"), "idx": P("x")}, "is not its loop index plus a constant"),
    (carries, P("x"), "'run' carries a value from one cell to the next"),
])
def test_steps_that_cannot_be_split_are_refused_at_their_line(kernel, specs, needle):
    with pytest.raises(StepSyntaxError) as e:
        kernel.sharded(mesh(4), specs)
    msg = str(e.value)
    assert needle in msg and "test_sharded.py:" in msg, msg


def test_bad_arguments(rng):
    u0 = put(rng.random(64).astype(np.float32))
    m = mesh(4)
    cases = [
        (lambda: heat.sharded("mesh", P("x")), "mesh must be a jax.sharding.Mesh"),
        (lambda: heat.sharded(m, P("z")), "'z' is not an axis of the mesh"),
        (lambda: heat.sharded(m, P("x"), exchange_every=0), "exchange_every=0"),
        (lambda: heat.sharded(m, P("x"), radius=0), "the halo must be at least"),
        (lambda: heat.sharded(m, {"a": P("x")}), "'a' is a scalar"),
        (lambda: heat.sharded(m, {"u": P("x")}), "'v' is replicated (P()) but the step writes it"),
        (lambda: heat.sharded(m, (P("x"),)), "expected one entry per parameter"),
        (lambda: heat.sharded(m, P("x"))(put(np.zeros(62, np.float32)), put(np.zeros(62, np.float32)), 0.1,
                                         steps=2), "not a multiple of the 4 shards"),
        (lambda: heat.sharded(m, P("x"))(u0, put(np.zeros(32, np.float32)), 0.1, steps=2), "shape"),
        (lambda: heat.sharded(m, P("x"), exchange_every=9)(u0, u0, 0.1, steps=2), "at most 8 steps"),
        (lambda: heat.sharded(m, P("x"))(put(np.zeros(4, np.float32)), put(np.zeros(4, np.float32)), 0.1,
                                         steps=2), "thinner than one step's halo exchange"),
        (lambda: heat.sharded(m, P("x"))(u0, u0, 0.1), "exactly one of steps= or max_steps="),
        (lambda: heat.sharded(m, P("x"))(np.zeros(64, np.float32), u0, 0.1, steps=1), "kernel.jax takes JAX arrays"),
    ]
    for call, needle in cases:
        with pytest.raises(ArgumentError) as e:
            call()
        assert needle in str(e.value), (needle, str(e.value))


# ------------------------------------------------------------------------------ the cost model
def test_cost_model_trades_exchanges_against_redundant_work():
    plan = jacobi.sharded(mesh(4), P("x")).plan
    free = sharding.ExchangeCosts(launch_s=0, collective_s=0, link_bytes_s=math.inf, memory_bytes_s=1e12,
                                  step_floor_s=0, launch_passes=0)
    costly = sharding.ExchangeCosts(launch_s=1.0, collective_s=1.0, link_bytes_s=1e9, memory_bytes_s=1e12,
                                    step_floor_s=0)
    block, parts = (4096, 4096), (4, 1)
    top = sharding.max_exchange_every(plan, block, parts)
    assert top == 2048      # a neighbour sends a slab of 2K rows from its 4096
    assert sharding.choose_exchange_every(plan, block, parts, 4, free) == 1
    assert sharding.choose_exchange_every(plan, block, parts, 4, costly) == top
    k = sharding.choose_exchange_every(plan, block, parts, 4, sharding.GPU_COSTS)
    t = [sharding.model_step_time(plan, block, parts, j, 4, sharding.GPU_COSTS) for j in (1, k, top)]
    assert 1 < k < top and t[1] < t[0] and t[1] < t[2]
    assert sharding.max_exchange_every(plan, block, (1, 1)) is None
