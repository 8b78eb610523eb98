"""Step functions that break the rules; tests/test_validate.py checks each error's location.

Each line that should be reported carries a marker comment: ``# ERR: <fragment of message>``.
"""

import numpy as np

import loopkern as lk

TABLE = [1, 2, 3]
SCALE = 2.5


def uses_list(t, u):
    x = [1, 2]  # ERR: lists are not supported
    u[0] = x


def sync_in_parallel_loop(t, u):
    for i in lk.range(u.shape[0]):
        u[i] = 1.0
        lk.sync()  # ERR: inside the parallel loop


def reduction_under_varying_if(t, u, out):
    for i in lk.range(u.shape[0]):
        out[i] = u[i]
    v = u[0]
    if v > 0.5:
        s = lk.sum(v)  # ERR: under an 'if'
        out[0] = s


def thread_id_while(t, u):
    k = lk.thread_id()
    while k < 3:
        lk.sync()  # ERR: inside a while loop
        k += 1


def varying_return(t, u):
    for i in lk.range(u.shape[0]):
        u[i] += 1.0
    return u[0] < 10.0  # ERR: return value can differ between threads


def return_under_varying_if(t, u):
    if lk.thread_id() == 0:
        return False  # ERR: 'return' is under an 'if'
    return True


def many_problems(t, u):
    print("step", t)  # ERR: print() is not supported
    d = {"a": 1}  # ERR: dicts are not supported
    f = lambda x: x  # ERR: lambda is not supported  # noqa: E731
    try:  # ERR: exceptions are not supported
        pass
    except Exception:
        pass
    return TABLE  # ERR: closures over Python objects are not supported


def break_in_parallel(t, u):
    for i in lk.range(u.shape[0]):
        if u[i] > 0:
            break  # ERR: 'break' out of a lk.range() loop
        u[i] = 0.0


def reduction_in_helper_helper(x):
    return lk.sum(x)  # ERR: can only be called in the step function itself


def calls_bad_helper(t, u):
    s = reduction_in_helper_helper(u[0])
    u[0] = s


def recursive(x):
    return recursive(x - 1)  # ERR: recursive call


def calls_recursive(t, u):
    u[0] = recursive(3)


def short_circuit(t, u):
    for i in lk.range(u.shape[0]):
        u[i] = 1.0
    a = lk.thread_id() > 3 and lk.max(1.0) > 0.0  # ERR: short-circuit
    u[0] = a


def conditional_expression(t, u):
    x = lk.sum(1.0) if lk.thread_id() == 0 else 0.0  # ERR: conditional expression


def loop_with_varying_break(t, u):
    k = 0
    while k < 10:
        if u[k] > 0.5:
            break
        lk.sync()  # ERR: leave early
        k += 1


def nested_def(t, u):
    def inner(x):  # ERR: nested functions are not supported
        return x
    u[0] = 1.0


def string_and_slice(t, u):
    u[1:3] = 0.0  # ERR: slices are not supported
    s = "text"  # ERR: str constants are not supported


def undefined_name(t, u):
    u[0] = undefined_thing  # ERR: name 'undefined_thing' is not defined  # noqa: F821


def uses_numpy_function(t, u):
    u[0] = np.sum(u)  # ERR: NumPy functions are not supported in step code


def reserved_name(t, u):
    _lk_tid = 3  # ERR: reserved for generated code
    u[0] = _lk_tid


def keyword_call(t, u):
    u[0] = max(1.0, 2.0, key=None)  # ERR: keyword arguments are not supported


def array_as_number(t, u, v):
    for i in lk.range(u.shape[0]):
        v[i] = u[i]
    v[0] = u * 2.0  # ERR: used as an array


def mixed_returns(t, u):
    if t > 3:
        return  # ERR: has no value
    return lk.max(1.0) > 0


def varying_for_bounds(t, u):
    n = int(u[0])
    for k in range(n):
        lk.sync()  # ERR: bounds differ between threads


def reduction_after_loop_is_fine(t, u, out):
    s = 0.0
    for i in lk.range(u.shape[0]):
        s += u[i]
    total = lk.sum(s)
    if total > 0:          # uniform: a reduction result
        lk.sync()
    k = 0
    while k < 3:           # uniform loop with a barrier
        lk.sync()
        k += 1
    if lk.thread_id() == 0:
        out[0] = total * SCALE
    return total > 1.0


# ---------------------------------------------------------------- parallel loops every thread must reach
def nested_parallel_loops(t, a):
    for i in lk.range(a.shape[0]):
        for j in lk.range(a.shape[1]):  # ERR: is inside the parallel loop at line
            a[i, j] = 1.0


def parallel_loop_under_varying_if(t, a):
    if lk.thread_id() == 0:
        for i in lk.range(a.shape[0]):  # ERR: under an 'if' at line
            a[i] = 1.0


def parallel_loop_after_varying_break(t, a):
    k = 0
    while k < 4:
        if a[k] > 0.5:
            break
        for i in lk.range(a.shape[0]):  # ERR: some threads leave early
            a[i] = 0.0
        k += 1


def fill(a):
    for i in lk.range(a.shape[0]):
        a[i] = 0.0


def helper_loop_in_parallel_loop(t, a, b):
    for i in lk.range(b.shape[0]):
        b[i] = 1.0
        fill(a)  # ERR: helper 'fill' runs a parallel loop


def helper_loop_under_varying_if(t, a):
    if a[0] > 0.5:
        fill(a)  # ERR: helper 'fill' runs a parallel loop


# ---------------------------------------------------------------- racing read-modify-writes
def racing_histogram(t, data, hist):
    for i in lk.range(data.shape[0]):
        b = int(data[i] * hist.shape[0])
        hist[b] += 1  # ERR: not provably this iteration's own


def racing_read_then_write(t, a, idx):
    for i in lk.range(idx.shape[0]):
        c = a[idx[i]]
        a[idx[i]] = c + 1.0  # ERR: not provably this iteration's own


def racing_offsets(t, a):
    for i in lk.range(a.shape[0] - 1):
        a[i] += 1.0
        a[i + 1] += 1.0  # ERR: at other offsets than at line


def racing_top_level(t, a, count):
    for i in lk.range(a.shape[0]):
        a[i] = 0.0
    count[0] += 1  # ERR: outside any parallel loop of a step that runs on many threads


def bump(a, k):
    a[k] += 1.0


def racing_in_helper(t, a, idx):
    for i in lk.range(idx.shape[0]):
        bump(a, i)
        bump(a, idx[i])  # ERR: helper 'bump' updates 'a[k]'


# ---------------------------------------------------------------- assignments to parameters
def assigns_parameters(t, u, total):
    s = 0.0
    for i in lk.range(u.shape[0]):
        s += u[i]
    total = lk.sum(s)  # ERR: 'total' is a parameter of the step
    t = t + 1  # ERR: 't' is the step index, a parameter of the step
    u = total  # ERR: 'u' is a parameter of the step


# ---------------------------------------------------------------- modules, NumPy functions, lk.atomic
def math_not_imported(t, u):
    for i in lk.range(u.shape[0]):
        u[i] = math.sin(u[i])  # ERR: name 'math' is not defined in the step's module  # noqa: F821


def numpy_function(t, u):
    for i in lk.range(u.shape[0]):
        u[i] = np.sqrt(u[i])  # ERR: NumPy functions are not supported in step code


def bad_atomics(t, h, u):
    for i in lk.range(u.shape[0]):
        lk.atomic.add(h, i)  # ERR: takes 3 arguments (array, index, value), got 2
        lk.atomic.max(u[i], 0, 1.0)  # ERR: the first argument of lk.atomic.max() must be an array


def range_bound_differs_between_threads(t, a, c):
    m = a.shape[0] - lk.thread_id()
    for j in lk.range(m):  # ERR: differs between threads
        lk.atomic.add(c, j, 1)


def grid_bound_read_from_an_array(t, a, n):
    for i, j in lk.grid(a.shape[0], (1, n[0])):  # ERR: bound ('(1, n[0])') differs between threads
        a[i, j] = 0.0


def range_step_of_zero(t, u):
    for i in lk.range(0, u.shape[0], 0):  # ERR: step must not be zero
        u[i] = 0.0


def range_of_a_float(t, u):
    for i in lk.range(5.5):  # ERR: '5.5' is a float
        u[i] = 0.0


def range_of_a_true_division(t, u):
    half = u.shape[0] / 2
    for i in lk.range(half):  # ERR: 'half' is a float
        u[i] = 0.0
    for i, j in lk.grid(u.shape[0] // 2, (1, u.shape[0] / 3)):  # ERR: 'u.shape[0] / 3' is a float
        u[i] = 0.0


# ---------------------------------------------------------------- names (session 29)
def array_given_another_name(t, h, x):
    g = h  # ERR: array 'h' cannot be given another name
    for i in lk.range(x.shape[0]):
        g[i] = x[i] + 2.0


def ping_pong_by_name(t, a, b):
    src = a if t % 2 == 0 else b  # ERR: array 'a' cannot be given another name
    dst = b if t % 2 == 0 else a  # ERR: array 'b' cannot be given another name
    for i in lk.range(a.shape[0]):
        dst[i] = 0.5 * src[i]


def assigned_only_under_an_if(t, a, b):
    for i in lk.range(a.shape[0]):
        if a[i] > 0.5:
            y = 10.0 * a[i]
        b[i] = y  # ERR: local 'y' may be read before it is assigned


def loop_variable_after_its_loop(t, a):
    for i in lk.range(a.shape[0]):
        a[i] = 1.0
    s = 0.0
    for k in range(3):
        s += 1.0
    a[0] = s + k  # ERR: local 'k' may be read before it is assigned


def read_before_assigned_in_a_loop_body(t, a):
    for i in lk.range(a.shape[0]):
        acc = 0.0
        for k in range(4):
            acc += prev  # ERR: local 'prev' may be read before it is assigned
            prev = a[i] * k
        a[i] = acc


def parameter_named_like_an_option(t, u, seed):  # ERR: parameter 'seed' has the name of an option
    for i in lk.range(u.shape[0]):
        u[i] = seed


def random_key_of_a_float(t, u):
    for i in lk.range(u.shape[0]):
        h = i / 2
        u[i] = lk.random.uniform(h)  # ERR: the key of lk.random.uniform() is a float
        u[i] += lk.random.normal(i, 0.5)  # ERR: the subkey of lk.random.normal() is a float


# ---------------------------------------------------------------- phases without lk.sync() (session 29)
def neighbour_read_without_sync(t, u, v, w):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i] * 0.5
    for i in lk.range(1, n - 1):
        w[i] = v[i - 1] + v[i + 1]  # ERR: 'v' is written in the parallel loop at line


def flux_update_without_sync(t, a, f):
    n = a.shape[0]
    for i in lk.range(n - 1):
        a[i] -= f[i]
    for i in lk.range(n - 1):
        a[i + 1] += f[i]  # ERR: 'a' is written in the parallel loop at line


def scatter_then_read_without_sync(t, a, idx, out):
    for i in lk.range(idx.shape[0]):
        lk.atomic.add(a, idx[i], 1.0)
    for i in lk.range(a.shape[0]):
        out[i] = a[i] * 2.0  # ERR: 'a' is written in the parallel loop at line


def copy_then_overwrite_without_sync(t, u, v):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = u[i]
    for i in lk.range(1, n - 1):
        v[i] = 0.5 * (u[i - 1] + u[i + 1])  # ERR: 'v' is written in the parallel loop at line


def read_then_overwrite_without_sync(t, u, w):
    n = u.shape[0]
    for i in lk.range(1, n):
        w[i] = u[i - 1]
    for i in lk.range(n):
        u[i] = 0.0  # ERR: 'u' is read in the parallel loop at line


def add_then_max_without_sync(t, a, idx):
    for i in lk.range(idx.shape[0]):
        lk.atomic.add(a, idx[i], 1.0)
    for i in lk.range(idx.shape[0]):
        lk.atomic.max(a, idx[i], 2.0)  # ERR: 'a' is written in the parallel loop at line


def overlapping_edges_without_sync(t, u, v):
    n = u.shape[0]
    m = u.shape[1]
    for j in lk.range(m):
        v[0, j] = u[0, j] * 2.0
    for i in lk.range(n):
        v[i, 0] = u[i, 0] + 1.0  # ERR: 'v' is written in the parallel loop at line



HUGE = 10 ** 20


def integer_constants_past_int64(t, a):
    for i in lk.range(a.shape[0]):
        a[i] = a[i] + 2 ** 64  # ERR: this integer expression is 18446744073709551616
        a[i] += (2 ** 70) >> 10  # ERR: int64 arithmetic cannot represent
        a[i] -= HUGE  # ERR: the integer 100000000000000000000 does not fit in 64 bits
        a[i] *= 10 ** 1000 ** 10  # ERR: too large to compute
        a[i] += 36893488147419103232  # ERR: does not fit in 64 bits


def in_place_stencil(t, a):
    for i in lk.range(1, a.shape[0] - 1):
        a[i] = 0.5 * (a[i - 1] + a[i + 1])  # ERR: 'a' is stored at another element in this parallel loop


def in_place_stencil_2d_behind_a_bounds_test(t, a):
    for i, j in lk.grid(a.shape[0], a.shape[1]):
        if 0 < i < a.shape[0] - 1:
            a[i, j] = a[i, j] + a[i + 1, j]  # ERR: the element read here is another iteration's


def in_place_stencil_through_named_neighbours(t, a):
    for i in lk.range(1, a.shape[0] - 1):
        im = i - 1
        ip = i + 1
        a[i] = 0.5 * (a[im] + a[ip])  # ERR: 'a' is stored at another element in this parallel loop


HALF16 = np.float16(0.5)
GLOBAL_ARRAY = np.zeros(3)


def float16_global(t, u):
    u[0] = HALF16  # ERR: is a numpy.float16 number


def returns_an_array(t, u):
    u[0] = 1.0
    return u  # ERR: is used as an array


def yields(t, u):
    u[0] = 1.0
    yield 1  # ERR: generators and coroutines are not supported


def unknown_lk_function(t, u):
    lk.foo(u[0])  # ERR: the module 'loopkern' has no function 'foo'


def unknown_numpy_function(t, u):
    u[0] = np.nosuch(u[1])  # ERR: the module 'numpy' has no function 'nosuch'


def parameter_named_like_the_module(t, u, lk):
    for i in lk.range(u.shape[0]):  # ERR: 'lk' is a parameter here
        u[i] = 1.0


def reassigned_parallel_index(t, u):
    for i in lk.range(u.shape[0] - 1):
        u[i] = u[i] + 1.0  # ERR: the loop assigns its variable 'i' in its body
        i = i + 1


def indexes_a_list(t, u):
    u[0] = [1.0, 2.0][0]  # ERR: lists are not supported


def writes_a_global_array(t, u):
    GLOBAL_ARRAY[0] = u[0]  # ERR: 'GLOBAL_ARRAY' is not an argument of the step


def parallel_index_read_after_its_loop(t, u):
    i = 0
    for i in lk.range(u.shape[0]):
        u[i] = 1.0
    lk.sync()
    u[0] = i  # ERR: is read after the parallel loop at line


def sums_a_sequence(t, u):
    u[0] = sum(u)  # ERR: sum() cannot be called in step code
