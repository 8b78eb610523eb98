"""What did Numba build for the hand-written Jacobi step, called directly and through kernel.jax?
(kernel.jax's Jacobi 2048² runs at 22.5 against the direct call's 16.2 µs/step on an H100,
session 39, on the same buffers and at either block count.) Runs both once at ``side``², then
for every kernel variant and argument signature compiled prints the variant's key, the Numba
signature, registers and local memory per thread, and writes each cubin and its SASS (when
``cuobjdump`` is on PATH) under ``out``; with ``ptx``, each kernel's PTX instead, and what
``ptxas -v`` (when on PATH) makes of it for the device's architecture, at the default
register usage level and at the highest.

    python bench/cubin_probe.py [side] [out] [sass|ptx]
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from numba import cuda  # noqa: E402

from bench.jacobi import jacobi_kernel, jacobi_problem  # noqa: E402

side = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
out = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/cubins")
out.mkdir(parents=True, exist_ok=True)
what = sys.argv[3] if len(sys.argv) > 3 else "sass"
tol = np.float32(-1.0)
u0 = jacobi_problem(side, np.random.default_rng(0))

k = jacobi_kernel()
du, dv = cuda.to_device(u0), cuda.to_device(u0)
r = k(du, dv, tol, max_steps=20)
print(f"direct: scope {r.scope}, {r.blocks} blocks x {r.threads} threads")
f = jax.jit(lambda u, v: k.jax(u, v, tol, max_steps=20))
jax.block_until_ready(f(jnp.asarray(u0), jnp.asarray(u0)))

cuobjdump, ptxas = shutil.which("cuobjdump"), shutil.which("ptxas")
cc = cuda.get_current_device().compute_capability
arch = f"sm_{cc[0]}{cc[1]}" + ("a" if cc >= (9, 0) else "")
n = 0
for key, compiled in k.dispatcher.kernels.variants.items():
    for sig, kern in compiled.dispatcher.overloads.items():
        n += 1
        regs = kern.regs_per_thread if hasattr(kern, "regs_per_thread") else "?"
        local = kern.local_mem_per_thread if hasattr(kern, "local_mem_per_thread") else "?"
        print(f"[{n}] variant {key}\n    signature {sig}\n    registers {regs}, local bytes {local}, "
              f"max threads per block {kern.max_threads_per_block}")
        if what == "ptx":
            ptx = kern.inspect_asm()
            (out / f"k{n}.ptx").write_text(ptx)
            if ptxas:
                for extra in ([], ["-register-usage-level=10"]):
                    res = subprocess.run([ptxas, "-arch=" + arch, "-O3", "-v", *extra, str(out / f"k{n}.ptx"),
                                          "-o", "/dev/null"], capture_output=True, text=True)
                    used = [ln.strip() for ln in res.stderr.splitlines() if "registers" in ln]
                    print(f"    ptxas -arch={arch} -O3 {' '.join(extra)}: {used or res.stderr.strip()[-300:]}")
            continue
        cubin = kern._codelibrary.get_cubin()
        path = out / f"k{n}.cubin"
        path.write_bytes(bytes(getattr(cubin, "code", cubin)))
        if cuobjdump:
            sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True).stdout
            (out / f"k{n}.sass").write_text(sass)
            lines = [ln for ln in sass.splitlines() if ln.strip().startswith("/*") and "*/" in ln and ";" in ln]
            print(f"    {len(lines)} SASS instructions")
