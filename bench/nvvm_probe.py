"""Where NVVM and the linker run for one new kernel under kernel.jax: ``python
bench/nvvm_probe.py`` prints the Python stack (loopkern and numba frames) at each
``nvvm.compile_ir`` call and each ``driver._Linker`` construction, with the arguments that
tell them apart (the arch option, the linker's cc and lto), for a step no other process has
compiled (an empty ``LOOPKERN_CACHE_DIR``)."""
import os
import tempfile
import traceback

os.environ["LOOPKERN_CACHE_DIR"] = tempfile.mkdtemp()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from numba.cuda.cudadrv import driver, nvvm  # noqa: E402

import loopkern as lk  # noqa: E402

compile_ir, linker = nvvm.compile_ir, driver._Linker


def _where():
    keep = [f for f in traceback.extract_stack()[:-2] if "loopkern" in f.filename or "numba" in f.filename]
    return "\n".join(f"    {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in keep[-14:])


def counted_compile(*a, **k):
    print(f"NVVM compile_ir arch={k.get('arch')} options={sorted(k)}\n{_where()}", flush=True)
    return compile_ir(*a, **k)


def counted_linker(*a, **k):
    print(f"Linker {k}\n{_where()}", flush=True)
    return linker(*a, **k)


nvvm.compile_ir = counted_compile
driver._Linker = counted_linker


def probe_scaled(t, u, v, a):
    n = u.shape[0]
    for i in lk.range(n):
        v[i] = a * u[i] + np.float32(0.375) * t


k = lk.megakernel(probe_scaled, swap=[("u", "v")])
u0 = np.random.default_rng(1).random(5000).astype(np.float32)
print("== kernel.jax, scope='grid'", flush=True)
u, _ = k.jax(jnp.asarray(u0), jnp.asarray(u0), np.float32(0.5), steps=3, scope="grid")
print("== done", np.asarray(u)[:2], flush=True)
