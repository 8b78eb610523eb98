"""The CUDA kernels compile to PTX (with NVVM, no GPU needed): catches CUDA-only compile errors
in CI, where only the simulator can run kernels."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def test_cuda_kernels_compile_to_ptx():
    p = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "ptx_check.py")],
                       env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(recs) >= 20
    if not any(r["ok"] for r in recs) and all(r["error"].startswith(("DynamicLibNotFoundError", "NvvmSupportError"))
                                              for r in recs):
        pytest.skip("NVVM/NVRTC are not installed (pip install 'cuda-toolkit[nvvm,nvrtc]==13.*')")
    failed = [r for r in recs if not r["ok"]]
    assert not failed, failed
    for r in recs:
        assert r["cg"] == 0                       # loopkern's own barrier, not cudadevrt's
        # nothing to link (Numba cannot cache a kernel that links a library, e.g. reshape's)
        assert r["extern_funcs"] == 0, r
        if r["scope"] in ("grid", "tile"):
            assert r["own_barrier"] >= 1, r       # every grid kernel synchronises with it
        if r["scope"] == "cluster":
            # a cluster launch synchronises with the cluster's hardware barrier only
            assert r["own_barrier"] == 0 and r["cluster_barrier"] >= 1, r
        else:
            assert r.get("cluster_barrier", 0) == 0, r
        if r["scope"] == "thread":
            assert r["own_barrier"] == 0, r       # a sequential step pays no barrier
        # run control: the leader reads the GPU clock and publishes to host memory with a fence
        assert r["globaltimer"] >= 1 and r["volatile_host"] >= 1 and r["sys_fence"] >= 1, r
        if r["atomics"]:
            # lk.atomic lowers to the GPU's atomic instructions (float max/min: compare-and-swap
            # loops, so the bounds records cannot be told apart by counting CAS)
            assert r["atom_add"] >= 1, r
            assert r["bounds_records"] >= 1 or not r["debug"], r
        else:
            assert (r["bounds_records"] >= 1) == r["debug"], r   # only debug kernels check bounds
        if r["staged"] or r["scope"] in ("tile", "cluster"):
            assert r["dynamic_shared"] >= 1, r         # the arrays live in dynamic shared memory
        if r["scope"] in ("tile", "cluster") or r["staged"] and r["kernel"] in ("heat", "jacobi", "life", "scalars"):
            # the step's accesses to shared memory: ld.shared/st.shared (Numba's own would be
            # generic ld/st)
            assert r["ld_shared"] >= 3 and r["st_shared"] >= 1, r
        else:
            assert r["dynamic_shared"] == 0, r
    # a generated kernel links nothing: no link-time optimisation (which runs NVVM a second time)
    assert [r for r in recs if "lto" in r] and all(r["lto"] is False for r in recs if "lto" in r)
    assert any(r["shuffles"] for r in recs if r["kernel"] in ("jacobi", "normalize"))
    assert all(r["shuffles"] >= 5 for r in recs if r["kernel"] == "warpsplit")     # 5 xor steps per sum
    # launch bounds (dispatch.kernels.LAUNCH_BOUNDS) reach Numba's dispatcher and the PTX
    bounded = [r for r in recs if r["kernel"] == "heat_bounds"]
    assert len(bounded) == 1 and bounded[0]["launch_bounds"] == [256, 2], bounded
    assert bounded[0]["maxntid"] == ["256"] and bounded[0]["minnctapersm"] == ["2"], bounded
    assert all("maxntid" not in r for r in recs if r["kernel"] != "heat_bounds")
    assert [(r["kernel"], r["by_ref"]) for r in recs if r["scope"] == "tile"] == [
        ("heat", False), ("heat", True), ("jacobi", False), ("jacobi", True), ("heat_rounds", False),
        ("heat_stream", False), ("heat2d_stream", False), ("heat_rounds", True), ("heat_stream", True)]
    assert [r["kernel"] for r in recs if r["scope"] == "cluster"] == ["heat", "jacobi"]
    # the derived (tangent, adjoint, segment-sweep) kernels compile too
    assert len([r for r in recs if r["kernel"].startswith("derived:")]) == 19
    # alpha's adjoint summed per block before one atomic update: a block reduction's shuffles
    assert all(r["shuffles"] >= 5 for r in recs if r["kernel"] in ("derived:heat_alpha_seg", "derived:peak_scaled"))
    # loopkern's own element accesses: the stencils' loads and stores in the global state space
    # (Numba's own lowering emits generic ld/st for them)
    own = [r for r in recs if r["index_bits"] and r["kernel"] in ("heat", "jacobi", "life")]
    assert {r["index_bits"] for r in own} == {32, 64} and {r["by_ref"] for r in own} == {False, True}
    for r in own:
        assert r["ld_global"] >= 3 and r["st_global"] >= 1, r
    # the steps lowered from jnp bodies, when JAX is installed
    lowered = {r["kernel"]: r for r in recs if r["kernel"].startswith("jaxloops:")}
    if importlib.util.find_spec("jax") is not None:
        assert sorted(lowered) == ["jaxloops:histogram", "jaxloops:nested_newton", "jaxloops:nested_while",
                                   "jaxloops:phased", "jaxloops:segment_sum", "jaxloops:solve",
                                   "jaxloops:sort_round", "jaxloops:unrolled"]
        assert lowered["jaxloops:histogram"]["atomics"] and lowered["jaxloops:segment_sum"]["atomics"]
        assert not lowered["jaxloops:nested_newton"]["atomics"]
    else:
        assert not lowered
    scatter = [r for r in recs if r["kernel"] == "scatter"]
    assert scatter and all(r["atom_minmax"] >= 1 and r["atom_cas"] >= 1 for r in scatter)   # int min, float max
