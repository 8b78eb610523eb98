"""Compile the CUDA kernels of the test workloads to PTX without a GPU (run by test_ptx.py).

Numba asks the current device for its compute capability while compiling device functions;
with no GPU there is none, so a stand-in device reporting cc 9.0 is installed for this process
only. Prints one JSON line per kernel.
"""

import json
import os
import re
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
sys.path.insert(0, os.path.dirname(__file__))

import numba.cuda.api as _api  # noqa: E402
import numba.cuda.dispatcher as _disp  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda, typeof, types  # noqa: E402


class _Device:
    compute_capability = (9, 0)
    id = 0
    name = b"stand-in for compiling only"


_api.get_current_device = _disp.get_current_device = lambda: _Device()
# as where nvJitLink is installed (the GPU machine): Numba's default for a kernel is then
# link-time optimisation, which loopkern turns off (the records' "lto"); only compile_ptx
# compiles here, which does not link
import numba.cuda.decorators as _decorators  # noqa: E402

_decorators._have_nvjitlink = lambda: True

import loopkern as lk  # noqa: E402
import test_random as R  # noqa: E402
import test_warpsplit as WS  # noqa: E402
import workloads as W  # noqa: E402
from loopkern import codegen  # noqa: E402
from loopkern.compile import compile_kernel  # noqa: E402

f32, f64, i32, i64 = np.float32, np.float64, np.int32, np.int64
CASES = [
    ("heat", W.heat_step, [("u", "v")], [np.zeros(8, f32), np.zeros(8, f32), f32(0.25)], ("grid", "block")),
    ("jacobi", W.jacobi_step, [("u", "v")], [np.zeros((4, 4)), np.zeros((4, 4)), 1e-3], ("grid", "block")),
    ("life", W.life_step, [("a", "b")], [np.zeros((4, 4), i32), np.zeros((4, 4), i32), np.zeros(3, i64)],
     ("grid", "block")),
    ("two_phase", W.two_phase_step, [], [np.zeros(8), np.zeros(8), np.zeros(8)], ("grid", "block")),
    ("normalize", W.normalize_step, [], [np.zeros(8), np.zeros((3, 4))], ("grid", "block")),
    ("helper", W.helper_step, [("u", "v")], [np.zeros(8), np.zeros(8), 0.3], ("grid",)),
    ("random", R.draws, [], [0, 0, 7, np.zeros((2, 8)), np.zeros((2, 8, 2))], ("grid",)),
    ("logistic", W.logistic_step, [], [np.zeros(8), 2.9], ("thread",)),
    # scalars used inside a loop, before it through a helper, and after its reduction only:
    # kernel.jax's form reads each where it is used (codegen._scalar_reads_at_use)
    ("scalars", W.scalars_step, [("u", "v")], [np.zeros(8, f32), np.zeros(8, f32), f32(0.2), f32(1e-3), 3,
                                               f32(-1.0)], ("grid", "block")),
    # a warp-split loop (loopkern/warpsplit.py): its accumulators summed with shuffles
    ("warpsplit", WS.forces, [], [np.zeros((4, 2)), np.zeros((4, 2)), 1e-2], ("grid", "block")),
    # groups of warps exchange partial sums of every type: int64 and float32 accumulators
    ("warpsplit_int", WS.counts, [], [np.zeros(8, i64), np.zeros((2, 2), i64), 0, 1], ("grid",)),
    ("warpsplit_f32", WS.backwards, [], [np.zeros(8, f32), np.zeros(2, f32)], ("grid",)),
    ("mixed_reductions", W.mixed_reductions_step, [], [np.zeros(8, f32), np.zeros((3, 4))], ("grid", "block")),
    ("uint64_extremes", W.uint64_extremes_step, [], [np.zeros(8, np.uint64), np.zeros(2, np.uint64)],
     ("grid", "block")),
    # lk.atomic: integer add (a histogram); float add, max and min, 2-D and negative indices, values
    # cast to the array's dtype, the old value used
    ("histogram", W.histogram_step, [], [np.zeros(8, f32), np.zeros(4, i32), f32(0.0), f32(0.25)], ("grid", "block")),
    ("scatter", W.scatter_step, [], [np.zeros(8, i64), np.zeros(8, f32), np.zeros(4), np.zeros((2, 2), f32),
                                     np.zeros(4, i32), np.zeros(1, np.uint32), np.zeros(8, i64)], ("grid", "block")),
]
ATOMIC_KERNELS = {"histogram", "scatter"}
SCRATCH = (types.float64[:, ::1], types.int64[:, ::1], types.uint32[::1])


def scalar_type(v):
    return typeof(np.float64(v) if isinstance(v, float) else v)


def measure(ptx) -> dict:
    """What the tests check in a kernel's PTX."""
    return dict(own_barrier=ptx.count("atom.add.release.gpu"), cg=ptx.count("cudaCGSynchronize"),
                cluster_barrier=ptx.count("barrier.cluster.arrive"),
                shuffles=ptx.count("shfl.sync"), globaltimer=ptx.count("%globaltimer"),
                volatile_host=ptx.count("st.volatile.u64"), sys_fence=ptx.count("membar.sys"),
                bounds_records=ptx.count("atom.global.cas") + ptx.count("atom.cas"),
                dynamic_shared=ptx.count(".extern .shared"), extern_funcs=ptx.count(".extern .func"),
                # lk.atomic: hardware atomics (float max/min are compare-and-swap loops)
                atom_add=ptx.count("atom.global.add") + ptx.count("red.global.add"),
                atom_minmax=ptx.count("atom.global.max") + ptx.count("atom.global.min"),
                atom_cas=ptx.count("atom.global.cas"),
                # element accesses in the global state space (runtime/arrays.py)
                ld_global=len(re.findall(r"\bld\.global\.(?:[suf]\d+|b\d+)\b", ptx)),
                st_global=len(re.findall(r"\bst\.global\.(?:[suf]\d+|b\d+)\b", ptx)),
                # ... and the staged arrays' (or tiles') in the shared state space
                ld_shared=len(re.findall(r"\bld\.shared\.(?:[suf]\d+|b\d+)\b", ptx)),
                st_shared=len(re.findall(r"\bst\.shared\.(?:[suf]\d+|b\d+)\b", ptx)))


for name, fn, swap, args, scopes in CASES:
    k = lk.megakernel(fn, swap=swap)
    for scope in scopes:
        for by_ref, debug, staged, bits in ((None, False, False, None), ("refs", False, False, None),
                                            (None, True, False, None), (None, False, True, None),
                                            (None, False, False, 64), ("refs", False, False, 64),
                                            (None, False, False, 32)):
            if (by_ref or debug) and scope == "block" or staged and (scope != "block" or not swap):
                continue
            staged = tuple(sorted(i for pair in k.spec.swap for i in pair)) if staged else ()
            refs = frozenset(i for i, a in enumerate(args) if not isinstance(a, np.ndarray)) if by_ref else None
            params = []
            for i, a in enumerate(args):
                if isinstance(a, np.ndarray):
                    params.append(typeof(a))
                elif refs is not None:
                    params.append(types.Array(scalar_type(a), 1, "C"))
                else:
                    params.append(scalar_type(a))
            # ..., seed, info (stop-decision slots), control block [, debug record]
            control = (types.int64[::1], types.int64[::1]) + ((types.int64[::1],) if debug else ())
            # step count and first step index (start=), the arguments, scratch, seed, control
            if refs is None:
                sig = (types.int64, types.int64, *params, *SCRATCH, types.uint64, *control)
            else:
                sig = (types.int64[::1], types.int64[::1], *params, *SCRATCH, types.uint32[::1], *control)
            rec = dict(kernel=name, scope=scope, by_ref=bool(by_ref), debug=debug, staged=bool(staged),
                       atomics=name in ATOMIC_KERNELS, index_bits=bits)
            try:
                src = codegen.render_kernel(k.spec, "cuda", scope, cache=False, by_ref=refs, debug=debug,
                                            staged=staged, index_bits=bits)
                dispatcher = compile_kernel(src).dispatcher
                ptx, _ = cuda.compile_ptx(dispatcher.py_func, sig, cc=(9, 0))
                # the option the dispatcher compiles with (compile._without_link_time_optimisation)
                rec.update(ok=True, lto=dispatcher.targetoptions.get("lto"), **measure(ptx))
            except Exception as exc:
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            print(json.dumps(rec), flush=True)

# tile mode (scope="tile"): 1-D heat and 2-D Jacobi (a reduction and a condition) kept on chip
from loopkern.stencil import find_stencil  # noqa: E402

# (by_ref: kernel.jax's form of the tile kernel, the step count, start, seed and scalars in
# device arrays)
for name, fn, swap, args in (("heat", W.heat_step, [("u", "v")], [np.zeros(8, f32), np.zeros(8, f32), f32(0.25)]),
                             ("jacobi", W.jacobi_step, [("u", "v")], [np.zeros((4, 4)), np.zeros((4, 4)), 1e-3])):
    for cluster, by_ref in ((False, False), (True, False), (False, True)):
        k = lk.megakernel(fn, swap=swap)
        if by_ref:
            sig = (types.int64[::1], types.int64[::1], *[typeof(a) for a in args[:2]],
                   types.Array(scalar_type(args[2]), 1, "C"), *SCRATCH, types.uint32[::1], types.int64[::1],
                   types.int64[::1])
        else:
            sig = (types.int64, types.int64, *[typeof(a) for a in args[:2]], scalar_type(args[2]), *SCRATCH,
                   types.uint64, types.int64[::1], types.int64[::1])
        rec = dict(kernel=name, scope="cluster" if cluster else "tile", by_ref=by_ref, debug=False, staged=False,
                   atomics=False, index_bits=None)
        try:
            src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=find_stencil(k.spec), cluster=cluster,
                                        by_ref=frozenset({2}) if by_ref else None)
            ptx, _ = cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))
            # the tiles' element accesses are in the shared state space (runtime/arrays.py)
            rec.update(ok=True, **measure(ptx))
        except Exception as exc:
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        print(json.dumps(rec), flush=True)

# tile mode with several steps per exchange, the field on chip (heat_rounds) or streamed
# (heat_stream, heat2d_stream): the kernels take the halo scratch last
import test_tile as TT  # noqa: E402

# (by_ref: kernel.jax's form, the step count, start, seed and scalars in device arrays)
for name, fn, arr, depth, tiles, by_ref in (("heat_rounds", W.heat_step, np.zeros(8, f32), 8, 0, False),
                                            ("heat_stream", W.heat_step, np.zeros(8, f32), 4, 3, False),
                                            ("heat2d_stream", TT.heat2d_step, np.zeros((4, 4), f32), 4, 2, False),
                                            ("heat_rounds", W.heat_step, np.zeros(8, f32), 8, 0, True),
                                            ("heat_stream", W.heat_step, np.zeros(8, f32), 4, 3, True)):
    k = lk.megakernel(fn, swap=[("u", "v")])
    if by_ref:
        sig = (types.int64[::1], types.int64[::1], typeof(arr), typeof(arr), types.float32[::1], *SCRATCH,
               types.uint32[::1], types.int64[::1], types.int64[::1], types.float32[::1])
    else:
        sig = (types.int64, types.int64, typeof(arr), typeof(arr), scalar_type(f32(0.25)), *SCRATCH, types.uint64,
               types.int64[::1], types.int64[::1], types.float32[::1])
    rec = dict(kernel=name, scope="tile", by_ref=by_ref, debug=False, staged=False, atomics=False, index_bits=None)
    try:
        src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, tile=find_stencil(k.spec), depth=depth,
                                    tiles=tiles, by_ref=frozenset({2}) if by_ref else None)
        ptx, _ = cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))
        rec.update(ok=True, **measure(ptx))
    except Exception as exc:
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    print(json.dumps(rec), flush=True)

# derived steps (loopkern/tangent.py, loopkern/adjoint.py): tangent and adjoint kernels with
# lk.random draws named by site, lk.sum reductions and their adjoints, scratch versions of
# arrays, lk.atomic.add scatters, unrolled inner loops, a dropped condition, a segment sweep
import test_adjoint as T  # noqa: E402
import test_gather_adjoint as TG  # noqa: E402
import test_inline as TN  # noqa: E402
import test_inner_loop_adjoint as TI  # noqa: E402
from loopkern.interop.jax_bridge import _segment_kernels  # noqa: E402

n = 8
v1 = np.zeros(n, f32)
one = np.zeros(1, f32)
DERIVED = [
    ("normalized", lk.megakernel(T.normalized).adjoint("x", "c"), [v1, v1, f32(0.3), one]),
    ("noisy_heat", lk.megakernel(T.noisy_heat, swap=[("u", "v")]).adjoint("u", "v", "a", "s"),
     [v1, v1, v1, v1, f32(0.2), one, f32(0.1), one]),
    ("noisy_heat_jvp", lk.megakernel(T.noisy_heat, swap=[("u", "v")]).tangent("u", "v", "a", "s"),
     [v1, v1, v1, v1, f32(0.2), f32(0), f32(0.1), f32(0)]),
    ("windowed", lk.megakernel(T.windowed, swap=[("u", "v")]).adjoint("u", "v", "c"), [v1, v1, v1, v1, f32(0.5), one]),
    ("heat_if", lk.megakernel(T.heat_if, swap=[("u", "v")]).adjoint("u", "v", "a"), [v1, v1, v1, v1, f32(0.2), one]),
]
for label, fn, wrt, head in (("clipped_mean", T.clipped_mean, ("x", "y", "a"), [v1, v1, v1, v1, f32(0.7), one]),
                             ("deposit", T.deposit, ("w", "grid", "c"),
                              [v1, v1, np.zeros(n, np.int32), np.zeros(5, f32), np.zeros(5, f32), f32(0.3), one]),
                             ("deposit_if", T.deposit_if, ("w", "grid", "c"),
                              [v1, v1, np.zeros(n, np.int32), np.zeros(5, f32), np.zeros(5, f32), f32(0.3), one]),
                             ("smooth_then_flux", T.smooth_then_flux, ("u", "v", "f", "c"),
                              [v1] * 6 + [f32(0.2), one])):
    k = lk.megakernel(fn).adjoint(*wrt)
    scratch = [np.zeros_like(head[list(k.spec.param_names).index(name.rsplit("_after", 1)[0])])
               for name in k.spec.param_names[len(head):]]
    DERIVED.append((label, k, head + scratch))
# Jacobi is linear in u: its sweep records nothing and reads u only for its shape
_, seg, _, recorded = _segment_kernels(lk.megakernel(W.jacobi_step, swap=[("u", "v")]), ["u", "v"], ["u", "v"],
                                       {"u": 2, "v": 2})
assert recorded == []
s3, s2 = np.zeros((3, 4, 4), f32), np.zeros((4, 4), f32)
DERIVED.append(("jacobi_seg", seg, [s2, s2, s2, s2, f32(1e-3), np.int64(2), np.int64(0)]))
# heat with respect to alpha too: u recorded (the recorder without lk.sync), the sweep reads
# its stack, alpha's adjoint summed per block (runtime atomic_add_block)
rec, seg, _, recorded = _segment_kernels(lk.megakernel(W.heat_step, swap=[("u", "v")]), ["u", "v", "alpha"],
                                         ["u", "v"], {"u": 1, "v": 1})
assert recorded == ["u"]
m1 = np.zeros((3, n), f32)
DERIVED += [("heat_alpha_rec", rec, [v1, v1, f32(0.2), m1, np.int64(0)]),
            ("heat_alpha_seg", seg, [m1, v1, v1, v1, f32(0.2), one, np.int64(2), np.int64(0)]),
            # lk.max/lk.min of running extrema: the ties counted, in both modes
            ("peak_scaled", lk.megakernel(T.peak_scaled).adjoint("x", "c"), [v1, v1, f32(0.3), one]),
            ("peak_scaled_jvp", lk.megakernel(T.peak_scaled).tangent("x", "c"), [v1, v1, f32(0.3), f32(0)]),
            # an inner loop's sums (one pass) and a recurrence (walked backwards) of computed bounds
            ("attract", lk.megakernel(TI.attract, swap=[("x", "y")]).adjoint("x", "y", "w", "c"),
             [v1, v1, v1, v1, v1, v1, f32(0.7), one]),
            ("substeps", lk.megakernel(TI.substeps, swap=[("x", "y")]).adjoint("x", "y", "h"),
             [v1, v1, v1, v1, f32(0.2), one, np.int64(3), f32(0.7)]),
            # helpers inlined, in both modes; terms under a branch gathered
            ("burgers", lk.megakernel(TN.burgers, swap=[("u", "v")]).adjoint("u", "v", "a"),
             [v1, v1, v1, v1, f32(0.2), one]),
            ("burgers_jvp", lk.megakernel(TN.burgers, swap=[("u", "v")]).tangent("u", "v", "a"),
             [v1, v1, v1, v1, f32(0.2), f32(0)]),
            ("branchy", lk.megakernel(TG.branchy, swap=[("u", "v")]).adjoint("u", "v", "a"),
             [v1, v1, v1, v1, f32(0.2), one])]
for label, k, vals in DERIVED:
    rec = dict(kernel=f"derived:{label}", scope="grid", by_ref=False, debug=False, staged=False, atomics=True,
               index_bits=None)
    sig = (types.int64, types.int64, *[typeof(v) for v in vals], *SCRATCH, types.uint64, types.int64[::1],
           types.int64[::1])
    try:
        src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, float_type="float32")
        ptx, _ = cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))
        rec.update(ok=True, **measure(ptx))
    except Exception as exc:
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    print(json.dumps(rec), flush=True)

# steps lowered from jnp loop bodies (loopkern/jaxloops): scatters to computed indices (a
# buffer, barriers, atomic adds) and nested loops (a sequential range / while per element)
try:
    import jax
except ImportError:      # the JAX extra is not installed: no such kernels
    jax = None
if jax is not None:
    from jax import lax

    from loopkern.jaxloops import loops as JL
    jnp = jax.numpy
    ix = jnp.asarray(np.arange(12, dtype=np.int32) % 5)
    BODIES = [("segment_sum", lambda i, x: 0.5 * x + jax.ops.segment_sum(x[ix], ix[::-1], num_segments=8),
               np.zeros(8, f32)),
              ("histogram", lambda i, h: h.at[ix + i].add(1), np.zeros(8, i32)),
              ("nested_newton", lambda i, x: lax.fori_loop(0, 4, lambda j, y: y - (y * y - x) / (2 * y), x),
               np.ones(8, f32)),
              ("nested_while", lambda i, x: lax.fori_loop(0, i % 3 + 1, lambda j, y: y * 0.5 + 1.0, x),
               np.ones(8, f32)),
              ("unrolled", lambda i, x: lax.fori_loop(0, 3, lambda j, y: jnp.roll(y, 1) * 0.5 + x, x),
               np.ones(8, f32)),
              ("sort_round", lambda i, x: jnp.sort(jnp.round(x * 3.0) + jnp.floor(x)) * 0.25, np.ones(8, f32)),
              ("solve", lambda i, x: jnp.linalg.solve(jnp.eye(8) * 2.0 + 0.1 * x[:, None], x)
               + jnp.linalg.cholesky(jnp.eye(8) * 2.0 + 0.1 * jnp.outer(x, x))[:, 0], np.ones(8, f32)),
              ("phased", lambda i, x: lax.while_loop(lambda c: c[1] > 1e-3, lambda c: (
                  jnp.roll(c[0], 1) * 0.5, jnp.max(c[0]) * 0.5), (x, jnp.float32(1.0)))[0], np.ones(8, f32))]
    for label, body, c in BODIES:
        traced = JL._trace_body(lambda i, x, body=body: [body(i, x)], [JL._aval(c)],
                                lead=(jax.ShapeDtypeStruct((), np.int32),))
        prog = JL.flatten(traced[0])
        plan = JL._lower(prog, [("index",), ("carry", 0)], {0: 0}, {0: 1})
        vals = []
        for _, role, payload in plan.params:
            vals.append(c if role in ("carry", "carry_next") else np.int32(0) if role == "lo" else
                        np.zeros(*payload) if role == "scratch" else np.asarray(prog.consts[payload][1]))
        rec = dict(kernel=f"jaxloops:{label}", scope="grid", by_ref=False, debug=False, staged=False,
                   atomics="lk.atomic" in plan.source, index_bits=None)
        sig = (types.int64, types.int64, *[typeof(v) for v in vals], *SCRATCH, types.uint64, types.int64[::1],
               types.int64[::1])
        try:
            src = codegen.render_kernel(JL._kernel(plan).spec, "cuda", "grid", cache=False)
            ptx, _ = cuda.compile_ptx(compile_kernel(src).dispatcher.py_func, sig, cc=(9, 0))
            rec.update(ok=True, **measure(ptx))
        except Exception as exc:
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        print(json.dumps(rec), flush=True)

# launch bounds (dispatch.kernels.LAUNCH_BOUNDS, on loopkern-sized grid launches): the option the rendered
# decorator gives Numba's dispatcher, and the PTX directives it compiles to
k = lk.megakernel(W.heat_step, swap=[("u", "v")])
args = [np.zeros(8, f32), np.zeros(8, f32), f32(0.25)]
rec = dict(kernel="heat_bounds", scope="grid", by_ref=False, debug=False, staged=False, atomics=False,
           index_bits=None)
try:
    src = codegen.render_kernel(k.spec, "cuda", "grid", cache=False, launch_bounds=(256, 2))
    dispatcher = compile_kernel(src).dispatcher
    bounds = dispatcher.targetoptions.get("launch_bounds")
    sig = (types.int64, types.int64, *[typeof(a) for a in args[:2]], scalar_type(args[2]), *SCRATCH, types.uint64,
           types.int64[::1], types.int64[::1])
    ptx, _ = cuda.compile_ptx(dispatcher.py_func, sig, cc=(9, 0), launch_bounds=bounds)
    rec.update(ok=True, lto=dispatcher.targetoptions.get("lto"), launch_bounds=list(bounds) if bounds else None,
               maxntid=re.findall(r"\.maxntid\s+(\d+)", ptx), minnctapersm=re.findall(r"\.minnctapersm\s+(\d+)", ptx),
               **measure(ptx))
except Exception as exc:
    rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
print(json.dumps(rec), flush=True)
