"""Step functions used by the tests, each with a float64 (or exact integer) NumPy reference."""

import math

import numpy as np

import loopkern as lk

# ---------------------------------------------------------------- 1D heat with swap
def heat_step(t, u, v, alpha):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = u[i] + alpha * (u[i - 1] - 2.0 * u[i] + u[i + 1])
    for i in lk.range(0, n, n - 1):     # boundaries: copied so swap keeps them
        v[i] = u[i]


def heat_ref(u0, steps, alpha):
    u = u0.astype(np.float64).copy()
    for _ in range(steps):
        v = u.copy()
        v[1:-1] = u[1:-1] + alpha * (u[:-2] - 2 * u[1:-1] + u[2:])
        u = v
    return u


# ---------------------------------------------------------------- 2D Jacobi to tolerance
def jacobi_step(t, u, v, tol):
    n = u.shape[0]
    m = u.shape[1]
    err = 0.0
    for i, j in lk.grid((1, n - 1), (1, m - 1)):
        new = 0.25 * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
        v[i, j] = new
        err = max(err, abs(new - u[i, j]))
    return lk.max(err) > tol


def jacobi_ref(u0, tol, max_steps):
    u = u0.astype(np.float64).copy()
    steps = 0
    while steps < max_steps:
        v = u.copy()
        v[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        err = np.abs(v - u).max()
        u = v
        steps += 1
        if not err > tol:
            break
    return u, steps


# ---------------------------------------------------------------- Game of Life (int, periodic)
def life_step(t, a, b, pop):
    n = a.shape[0]
    m = a.shape[1]
    alive = 0
    for i, j in lk.grid(n, m):
        s = 0
        for di in range(-1, 2):
            for dj in range(-1, 2):
                if di != 0 or dj != 0:
                    s += a[(i + di + n) % n, (j + dj + m) % m]
        c = a[i, j]
        nxt = 1 if (s == 3 or (c == 1 and s == 2)) else 0
        b[i, j] = nxt
        alive += nxt
    total = lk.sum(alive)
    if lk.thread_id() == 0:
        pop[t] = total


def life_ref(a0, steps):
    a = a0.copy()
    pops = []
    for _ in range(steps):
        s = sum(np.roll(np.roll(a, di, 0), dj, 1) for di in (-1, 0, 1) for dj in (-1, 0, 1) if di or dj)
        a = ((s == 3) | ((a == 1) & (s == 2))).astype(a.dtype)
        pops.append(int(a.sum()))
    return a, np.array(pops, np.int64)


# ---------------------------------------------------------------- multi-phase step with lk.sync
def two_phase_step(t, x, tmp, out):
    # phase 1: tmp = neighbour average of x; phase 2 (after the barrier): x += shifted tmp
    n = x.shape[0]
    for i in lk.range(n):
        tmp[i] = 0.5 * (x[i] + x[(i + 1) % n])
    lk.sync()
    for i in lk.range(n):
        x[i] = x[i] + 0.1 * tmp[(i + n - 1) % n]
    lk.sync()
    for i in lk.range(n):
        out[i] = tmp[i] - x[i]


def two_phase_ref(x0, steps):
    x = x0.astype(np.float64).copy()
    out = np.zeros_like(x)
    for _ in range(steps):
        tmp = 0.5 * (x + np.roll(x, -1))
        x = x + 0.1 * np.roll(tmp, 1)
        out = tmp - x
    return x, out


# ---------------------------------------------------------------- two reductions in one step
def normalize_step(t, x, stats):
    # center x by its mean and scale by its max |x|: two reductions each step, plus a count
    n = x.shape[0]
    s = 0.0
    for i in lk.range(n):
        s += x[i]
    mean = lk.sum(s) / n
    m = 0.0
    for i in lk.range(n):
        m = max(m, abs(x[i] - mean))
    scale = lk.max(m)
    for i in lk.range(n):
        x[i] = (x[i] - mean) / scale * 0.5 + 0.01 * math.sin(float(i + t))
    k = 0
    for i in lk.range(n):
        if x[i] > 0:
            k += 1
    positives = lk.sum(k)
    smallest = lk.min(x[0] if lk.thread_id() == 0 else 1e30)
    if lk.thread_id() == 0:
        stats[t, 0] = mean
        stats[t, 1] = scale
        stats[t, 2] = positives
        stats[t, 3] = smallest


def normalize_ref(x0, steps):
    x = x0.astype(np.float64).copy()
    stats = np.zeros((steps, 4))
    idx = np.arange(x.shape[0])
    for t in range(steps):
        mean = x.sum() / x.shape[0]
        scale = np.abs(x - mean).max()
        x = (x - mean) / scale * 0.5 + 0.01 * np.sin((idx + t).astype(np.float64))
        stats[t] = (mean, scale, (x > 0).sum(), x[0])
    return x, stats


# ---------------------------------------------------------------- a helper function
def damp(value, factor):
    if value > 1.0:
        return value * factor
    return value


def laplacian(u, i):
    return u[i - 1] - 2.0 * u[i] + u[i + 1]


def helper_step(t, u, v, alpha):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = damp(u[i] + alpha * laplacian(u, i), 0.5)
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]


def helper_ref(u0, steps, alpha):
    u = u0.astype(np.float64).copy()
    for _ in range(steps):
        v = u.copy()
        w = u[1:-1] + alpha * (u[:-2] - 2 * u[1:-1] + u[2:])
        v[1:-1] = np.where(w > 1.0, w * 0.5, w)
        u = v
    return u


# ---------------------------------------------------------------- integer counter (race catcher)
def counter_step(t, a, b, mod):
    # b[i] = (a[i-1] + a[i] + a[i+1] + t) % mod, periodic: any read of a stale or future value
    # changes the result, so a missing or broken barrier shows up as a mismatch.
    n = a.shape[0]
    for i in lk.range(n):
        b[i] = (a[(i + n - 1) % n] + a[i] + a[(i + 1) % n] + t) % mod


def counter_ref(a0, steps, mod):
    a = a0.astype(np.int64).copy()
    for t in range(steps):
        a = (np.roll(a, 1) + a + np.roll(a, -1) + t) % mod
    return a


# ---------------------------------------------------------------- a sequential scalar recursion
def logistic_step(t, x, r):
    # the whole trajectory is recorded: x[t + 1] from x[t]; no parallel construct, so
    # scope="auto" runs it on one thread with no barrier
    x[t + 1] = r * x[t] * (1.0 - x[t])


def logistic_ref(x0, steps, r):
    x = np.zeros(steps + 1)
    x[0] = x0
    for t in range(steps):
        x[t + 1] = r * x[t] * (1.0 - x[t])
    return x


# ---------------------------------------------------------------- a step that can be made slow
def busy_step(t, x, slow_at, spin):
    # one thread counts the steps in x[0]; step 'slow_at' spins 'spin' iterations (slow, finite)
    if lk.thread_id() == 0:
        acc = x[1]
        if t == slow_at:
            for k in range(spin):
                acc = acc * 0.999999 + 1e-6
        x[1] = acc
        x[0] = x[0] + 1.0


def oob_step(t, u, v, shift):
    # reads and writes past the end of u once t reaches 2 (shift > 0): a planted bug
    n = u.shape[0]
    for i in lk.range(n):
        j = i + shift if t >= 2 else i
        v[j] = u[i] * 0.5


def peek(u, j):
    return u[j]


def oob_helper_step(t, u, v):
    # the helper reads u[n] for the last index: a planted bug
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = peek(u, i + 1)


def scale_step(t, x, y, a):
    # a Python-float literal and a Python-float argument meeting float32 arrays
    for i in lk.range(x.shape[0]):
        y[i] = x[i] * 0.1 + a * x[i]


def count_step(t, c, slow_at, spin):
    # no parallel construct: one thread (scope "thread" on the GPU) counts the steps in c[0];
    # from step 'slow_at' on, each step first spins 'spin' iterations (slower steps)
    if t >= slow_at:
        acc = c[1]
        for k in range(spin):
            acc = acc * 0.5 + 1.0
        c[1] = acc
    c[0] = c[0] + 1


# ---------------------------------------------------------------- lk.atomic: histogram, scatter
def histogram_step(t, data, hist, lo, width):
    # several iterations land in one bin: their increments must all count (lk.atomic.add)
    nb = hist.shape[0]
    for i in lk.range(data.shape[0]):
        b = int((data[i] - lo) / width)
        lk.atomic.add(hist, min(max(b, 0), nb - 1), 1)


def histogram_ref(data, nbins, lo, width, steps=1):
    b = np.clip(((data.astype(np.float64) - lo) / width).astype(np.int64), 0, nbins - 1)
    return steps * np.bincount(b, minlength=nbins)


def scatter_step(t, idx, vals, acc, hi, lo, count, order):
    # scatter-add, max and min into the elements idx[i] picks (a 2-D index and a negative one);
    # a counter hands out one slot per iteration
    for i in lk.range(idx.shape[0]):
        k = idx[i]
        lk.atomic.add(acc, k, vals[i])
        lk.atomic.max(hi, (k % 2, k // 2), vals[i])
        lk.atomic.min(lo, -1 - k, vals[i])
        slot = lk.atomic.add(count, 0, 1)
        order[slot % order.shape[0]] = i


def scatter_ref(idx, vals, acc, hi, lo):
    """acc, hi, lo after one scatter_step (float64 references, from copies of the inputs)."""
    acc, hi, lo = acc.astype(np.float64), hi.astype(np.float64), lo.astype(np.float64)
    np.add.at(acc, idx, vals.astype(np.float64))
    np.maximum.at(hi, (idx % 2, idx // 2), vals.astype(np.float64))
    np.minimum.at(lo, -1 - idx, vals.astype(np.float64))
    return acc, hi, lo


# ---------------------------------------------------------------- reductions of several value types
def mixed_reductions_step(t, x, out):
    # one lk.max and one lk.sum each over two value types in one kernel (float32 and float64,
    # int32 and int64): the GPU once rejected such kernels as invalid IR
    n = x.shape[0]
    m32 = np.float32(-1e30)
    m64 = -1e300
    c32 = np.int32(0)
    c64 = 0
    for i in lk.range(n):
        m32 = max(m32, x[i])
        m64 = max(m64, np.float64(x[i]) * 2.0)
        if x[i] > 0.5:
            c32 += np.int32(1)
            c64 += 2
    a = lk.max(m32)
    b = lk.max(m64)
    c = lk.sum(c32)
    d = lk.sum(c64)
    if lk.thread_id() == 0:
        out[t, 0] = a
        out[t, 1] = b
        out[t, 2] = c
        out[t, 3] = d
    for i in lk.range(n):
        x[i] = x[i] * np.float32(0.5)


def mixed_reductions_ref(x0, steps):
    x = x0.copy()
    out = np.zeros((steps, 4))
    for t in range(steps):
        out[t] = (x.max(), 2.0 * x.astype(np.float64).max(), (x > 0.5).sum(), 2 * (x > 0.5).sum())
        x = x * np.float32(0.5)
    return x, out


# ---------------------------------------------------------------- reductions that may be short-circuited
# Each step smooths u into v (swap) and stops when the change is small. The first three
# evaluate the reduction only on some steps (they need the barrier between steps); the last on
# every step (its reduction's barrier replaces it).
def stop_or_later(t, u, v, tol):
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        new = 0.5 * u[i] + 0.25 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    return t < 5 or lk.max(err) > tol


def reduce_only_after_first(t, u, v, tol):
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        new = 0.5 * u[i] + 0.25 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    return lk.max(err) > tol if t > 0 else True


def chained(t, u, v, tol):
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        new = 0.5 * u[i] + 0.25 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    return t < 1000000 < lk.max(err) + 1000000 + tol or t < 6


def reduce_every_step(t, u, v, tol):
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        new = 0.5 * u[i] + 0.25 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    return lk.max(err) > tol or t < 5


# The form lk.while_loop lowers a carried reduction to: the reduction assigned to a local, its
# value stored by one iteration into a write-only swap pair, the verdict returned. Its barrier
# replaces the one between steps (codegen.reduction_barrier_at); each variant below breaks one
# condition of that proof and keeps the barrier.
def reduce_then_store(t, u, v, e, en, tol):
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        new = 0.5 * u[i] + 0.25 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    r = lk.max(err)
    go = r > tol
    for q in lk.range(1):
        en[0] = r
    return go


def reduce_then_store_read(t, u, v, e, en, tol):
    # e, the partner of the stored array, is read: the next step would read this step's store
    n = u.shape[0]
    err = 0.0 * e[0]
    for i in lk.range(1, n - 1):
        new = 0.5 * u[i] + 0.25 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    r = lk.max(err)
    for q in lk.range(1):
        en[0] = r
    return r > tol


def reduce_then_store_state(t, u, v, e, en, tol):
    # a store after the reduction into the state that other threads read next step
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        new = 0.5 * u[i] + 0.25 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    r = lk.max(err)
    for q in lk.range(1):
        en[0] = r
        v[0] = u[0]
    return r > tol


def reduce_then_store_moving(t, u, v, e, en, tol):
    # the stored element's thread changes from step to step (a loop bound that is not constant)
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        new = 0.5 * u[i] + 0.25 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    r = lk.max(err)
    for q in lk.range(t % 2, 1):
        en[0] = r
    return r > tol


def smooth_carried_step(t, u, v, tol, last):
    """1-D Jacobi smoothing to a tolerance with its error carried as ``lk.while_loop`` carries a
    reduction: assigned, stored into a write-only array, then the verdict."""
    n = u.shape[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        new = 0.5 * (u[i - 1] + u[i + 1])
        v[i] = new
        err = max(err, abs(new - u[i]))
    r = lk.max(err)
    for q in lk.range(1):
        last[0] = r
    return r > tol


def smooth_carried_ref(u0, tol, max_steps):
    """(state, steps, last error) of smooth_carried_step in float64 NumPy."""
    u, steps, err = u0.astype(np.float64), 0, np.inf
    while steps < max_steps:
        v = u.copy()
        v[1:-1] = 0.5 * (u[:-2] + u[2:])
        err = np.abs(v - u).max()
        u, steps = v, steps + 1
        if not err > tol:
            break
    return u, steps, err


def reduce_then_count(t, u, v, cnt, seen):
    # an lk.atomic update after the reduction: the counter is read by one thread next step, so
    # the barrier between steps must stay (every thread's update of step t lands before it)
    n = u.shape[0]
    for q in lk.range(1):
        seen[t] = cnt[0]
    err = 0.0
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
        err = max(err, abs(v[i] - u[i]))
    r = lk.max(err)
    old = lk.atomic.add(cnt, 0, 1)
    return r > -1.0


# Tile mode keeps the swap pair's tiles on chip and gives each block the loop indices in its
# tile; loops over other arrays may run past the pair's extent or start below 0 (Python's
# w[-2], w[-1]): every index must still run once, as in the grid scope.
def smooth_and_count_longer(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    for i in lk.range(w.shape[0]):
        w[i] = w[i] + 1.0


def smooth_and_count_below_zero(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    for i in lk.range(-2, 0):
        w[i] = w[i] + 1.0


def smooth_until_a_longer_sum(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])
    s = 0.0
    for i in lk.range(w.shape[0]):
        s += w[i]
    return lk.sum(s) + t < w.shape[0] + 4.0


def smooth2d_and_count_longer(t, u, v, w):
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid((1, n - 1), (1, m - 1)):
        v[i, j] = 0.25 * (u[i - 1, j] + u[i + 1, j] + u[i, j - 1] + u[i, j + 1])
    for i, j in lk.grid(w.shape[0], w.shape[1]):
        w[i, j] = w[i, j] + 1.0


def beyond_the_pair_refs(fn, u0, w0, steps):
    """(u, w, steps run) of one of the steps above in float64 NumPy; w0 all ones for
    smooth_until_a_longer_sum (the run stops once t + w's length reaches len + 4: 5 steps)."""
    u, w = u0.astype(np.float64).copy(), w0.astype(np.float64).copy()
    done = 0
    for t in range(steps):
        v = u.copy()
        if u.ndim == 1:
            v[1:-1] = 0.5 * (u[:-2] + u[2:])
        else:
            v[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        go = True
        if fn is smooth_and_count_below_zero:
            w[-2:] += 1.0
        elif fn is smooth_until_a_longer_sum:
            go = w.sum() + t < w.shape[0] + 4.0
        else:
            w += 1.0
        u, done = v, done + 1
        if not go:
            break
    return u, w, done


def smooth_ref(u0, tol, max_steps, keep_going):
    """float64 NumPy: the same iteration; ``keep_going(t, err)`` is the step's verdict."""
    u = u0.astype(np.float64).copy()
    prev = u.copy()
    steps = 0
    while steps < max_steps:
        v = u.copy()
        v[1:-1] = 0.5 * u[1:-1] + 0.25 * (u[:-2] + u[2:])
        err = np.abs(v[1:-1] - u[1:-1]).max()
        prev, u = u, v
        steps += 1
        if not keep_going(steps - 1, err):
            break
    return u, prev, steps


# ---------------------------------------------------------------- steps that wrap around along dimension 0
def ring_rows_step(t, u, v):
    # a 1-D ring of width two: each cell mixes the cells up to two places away, across the end
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = 0.5 * u[i] + 0.125 * (u[(i + 1) % n] + u[(i - 2 + n) % n]) + 0.25 * u[(i + n - 1) % n]


def ring_rows_ref(u0, steps):
    u = u0.astype(np.float64)
    for _ in range(steps):
        u = 0.5 * u + 0.125 * (np.roll(u, -1) + np.roll(u, 2)) + 0.25 * np.roll(u, 1)
    return u


def drift_step(t, u, v):
    # advection on a torus: rows come from above (a neighbour named once), columns from the right
    n = u.shape[0]
    m = u.shape[1]
    for i, j in lk.grid(n, m):
        up = i - 1 if i > 0 else n - 1
        v[i, j] = 0.6 * u[i, j] + 0.3 * u[up, j] + 0.1 * u[i, (j + 1) % m]


def drift_ref(u0, steps):
    u = u0.astype(np.float64)
    for _ in range(steps):
        u = 0.6 * u + 0.3 * np.roll(u, 1, axis=0) + 0.1 * np.roll(u, -1, axis=1)
    return u


def back_step(t, u, v):
    n = u.shape[0]
    for i in lk.range(n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])     # u[-1] at i = 0 is u[n - 1], as in Python


def back_ref(u0, steps):
    u = u0.astype(np.float64)
    for _ in range(steps):
        v = u.copy()
        v[:-1] = 0.5 * (np.roll(u, 1)[:-1] + u[1:])
        u = v
    return u


def implicit_heat_cg(a, tol, maxit):
    """A jnp fori_loop body (for lk.fori_loop): backward Euler for 1-D heat with zero ends,
    (1 + 2a) u_new - a (left + right) = u, solved by conjugate gradients until the squared
    residual is at most ``tol`` or after ``maxit`` iterations (a nested lax.while_loop)."""
    import jax.numpy as jnp
    from jax import lax

    def apply(v):
        nb = jnp.pad(v, 1)
        return (1 + 2 * a) * v - a * (nb[:-2] + nb[2:])

    def step(i, u):
        def cg(c):
            x, r, p, rs, k = c
            ap = apply(p)
            alpha = rs / jnp.dot(p, ap)
            x = x + alpha * p
            r = r - alpha * ap
            rs_new = jnp.dot(r, r)
            return x, r, r + (rs_new / rs) * p, rs_new, k + 1
        r0 = u - apply(u)
        return lax.while_loop(lambda c: (c[3] > tol) & (c[4] < maxit), cg, (u, r0, r0, jnp.dot(r0, r0), jnp.int32(0)))[0]
    return step


# ---------------------------------------------------------------- NaN in a reduction
def nan_extremes_step(t, x, out):
    # lk.max and lk.min of row t: each thread keeps a NaN of its share (v != v), and the
    # reductions across threads, warps and blocks must then give NaN whichever thread holds it
    n = x.shape[1]
    hi = x[t, 0]
    lo = x[t, 0]
    for i in lk.range(n):
        v = x[t, i]
        hi = v if (v > hi or v != v) else hi
        lo = v if (v < lo or v != v) else lo
    a = lk.max(hi)
    b = lk.min(lo)
    if lk.thread_id() == 0:
        out[t, 0] = a
        out[t, 1] = b


def nan_rows(rng, n, dtype, threads):
    """Rows of ``n`` random values, each row past the first holding one NaN: in the first and the
    last element, in the first and last thread's share (grid-stride: element k is thread k's when
    k < threads), and at random places; the first row has none."""
    places = [0, n - 1, min(threads, n) - 1, min(threads, n) // 2, 31, 32] + list(rng.integers(0, n, 4))
    x = rng.standard_normal((1 + len(places), n)).astype(dtype)
    for row, k in enumerate(places, start=1):
        x[row, min(int(k), n - 1)] = np.nan
    return x


# ---------------------------------------------------------------- division by zero
def zero_division_step(t, x, k, out, iout):
    # float division by zero (inf, -inf, NaN) and integer division and remainder by zero
    for i in lk.range(x.size):
        out[0, i] = 1.0 / x[i]
        out[1, i] = x[i] / x[i]
        out[2, i] = -x[i] / (x[i] * 0.0)
        iout[0, i] = k[i] // (k[i] - k[i])
        iout[1, i] = k[i] % (k[i] - k[i])



def int_power_step(t, x, k, out):
    # a float to an integer power, zero bases included (0.0 ** -n is an infinity, as NumPy gives)
    for i in lk.range(x.size):
        y = x[i]
        y **= k[i]
        out[0, i] = y
        out[1, i] = x[i] ** (k[i] - 1)
        out[2, i] = x[i] ** 2


def check_int_power(kernel, backend, dtype, rng):
    """Run int_power_step's kernel on zero bases (both signs) and random ones with negative,
    zero and positive exponents; compare with float64 NumPy, infinities and their signs exactly."""
    x = np.array([0.0, -0.0, 0.0, -0.0, 2.0, -3.0, 0.5, 0.0], dtype)
    x = np.concatenate([x, rng.normal(size=8).astype(dtype)])
    k = np.array([-1, -1, -2, -2, -3, 3, 0, 0] + list(rng.integers(-4, 5, 8)), np.int64)
    out = np.zeros((3, x.size), dtype)
    kernel(x, k, out, steps=1, backend=backend)
    with np.errstate(all="ignore"):
        x64 = x.astype(np.float64)
        want = np.stack([x64 ** k, x64 ** (k - 1), x64 ** 2])
    np.testing.assert_allclose(out, want, rtol=2e-6 if dtype == np.float32 else 1e-15)
    inf = np.isinf(want)
    np.testing.assert_array_equal(np.isinf(out), inf)
    np.testing.assert_array_equal(np.signbit(out[inf]), np.signbit(want[inf]))


def failing_step(t, u, v, w, bad_at):
    # divides by zero at step bad_at (element 2): Python's error model (debug=True) raises there
    n = u.shape[0]
    for i in lk.range(n):
        e = 0.0 if (t == bad_at and i == 2) else 1.0
        v[i] = u[i] + 1.0 / e
        w[i] += 1.0


def uint64_extremes_step(t, a, out):
    # lk.max / lk.min of uint64 values, 2**63 and above included
    hi = a[0]
    lo = a[0]
    for i in lk.range(a.shape[0]):
        hi = max(hi, a[i])
        lo = min(lo, a[i])
    top = lk.max(hi)
    bottom = lk.min(lo)
    if lk.thread_id() == 0:
        out[0] = top
        out[1] = bottom


def shifts_step(t, a, s, left, right):
    """Shifts by per-element counts (any int64, negative or 64 and more included), in the plain
    and the augmented form."""
    for i in lk.range(a.shape[0]):
        left[i] = a[i] << s[i]
        right[i] = a[i] >> s[i]
        x = a[i]
        x >>= s[i]
        right[i] -= x          # the augmented form gives the same: 0


def constant_shifts_step(t, a, out):
    """Shifts by constant counts at and past the width (NVVM dropped such stores)."""
    for i in lk.range(a.shape[0]):
        out[0, i] = a[i] << 65
        out[1, i] = a[i] >> 64
        out[2, i] = a[i] << 63
        out[3, i] = a[i] >> 70
        out[4, i] = a[i] << 3


def shifts_ref(a, s):
    """(a << s, a >> s) as NumPy shifts int64 scalars: a count outside 0..63 gives 0 or the sign."""
    left, right = [], []
    for x, k in zip(a.tolist(), s.tolist()):
        inside = 0 <= k < 64
        left.append(((x << k) + 2 ** 63) % 2 ** 64 - 2 ** 63 if inside else 0)
        right.append(x >> k if inside else -(x < 0))
    return np.array(left, np.int64), np.array(right, np.int64)


def constant_shifts_ref(a):
    counts = (65, 64, 63, 70, 3)
    left = [shifts_ref(a, np.full(a.size, k, np.int64))[0] for k in counts]
    right = [shifts_ref(a, np.full(a.size, k, np.int64))[1] for k in counts]
    return np.stack([left[0], right[1], left[2], right[3], left[4]])


# ---------------------------------------------------------------- scalars used here and there
def bias(b, k):
    return b * k


def scalars_step(t, u, v, a, b, k, tol):
    # a scalar used inside a parallel loop (a), before it and through a helper (b, k), and only
    # in the return, after the loop's reduction (tol): kernel.jax reads each where it is used
    n = u.shape[0]
    c = bias(b, k + 1)
    err = 0.0
    for i in lk.range(1, n - 1):
        new = u[i] + a * (u[i - 1] - 2.0 * u[i] + u[i + 1]) + c
        v[i] = new
        err = max(err, abs(new - u[i]))
    for i in lk.range(0, n, n - 1):
        v[i] = u[i]
    return lk.max(err) > tol


def scalars_ref(u0, steps, a, b, k, tol):
    """(the field, steps done) of ``scalars_step`` in float64."""
    u = u0.astype(np.float64).copy()
    for done in range(1, steps + 1):
        new = u[1:-1] + a * (u[:-2] - 2 * u[1:-1] + u[2:]) + b * (k + 1)
        err = np.abs(new - u[1:-1]).max()
        u = np.concatenate([u[:1], new, u[-1:]])
        if not err > tol:
            return u, done
    return u, steps


def coupled_rings_step(t, a, b, c, d):
    # two fields on a torus, each reading the other's rows above and below (weights summing to
    # one: the fields keep their scale): a 2-D tile exchanges the edge rows of both swap pairs
    # (each wrapped row is found modulo its own array's extent: the stencil analysis asks it)
    n = a.shape[0]
    m = a.shape[1]
    nc = c.shape[0]
    for i, j in lk.grid(n, m):
        up = i - 1 if i > 0 else n - 1
        dn = i + 1 if i < n - 1 else 0
        upc = i - 1 if i > 0 else nc - 1
        dnc = i + 1 if i < nc - 1 else 0
        b[i, j] = 0.5 * a[i, j] + 0.25 * (c[upc, j] + c[dnc, j])
        d[i, j] = 0.4 * c[i, j] + 0.3 * a[up, j] + 0.2 * a[dn, j] + 0.1 * a[i, (j + 1) % m]


def coupled_rings_ref(a0, c0, steps):
    a, c = a0.astype(np.float64), c0.astype(np.float64)
    for _ in range(steps):
        up_c, dn_c = np.roll(c, 1, axis=0), np.roll(c, -1, axis=0)
        up_a, dn_a = np.roll(a, 1, axis=0), np.roll(a, -1, axis=0)
        a, c = 0.5 * a + 0.25 * (up_c + dn_c), 0.4 * c + 0.3 * up_a + 0.2 * dn_a + 0.1 * np.roll(a, -1, axis=1)
    return a, c


def _example(name):
    """A module of examples/ (its main() guarded), loaded by path."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_lk_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: examples/life.py's step, spelled with tuple assignments (n, m = a.shape[0], a.shape[1];
#: up, down = (i + n - 1) % n, (i + 1) % n): the function under its decorator
life_tuple_step = _example("life").life.fn
