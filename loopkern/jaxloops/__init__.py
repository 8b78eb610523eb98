"""Drop-in replacements for ``jax.lax.fori_loop``, ``while_loop`` and ``scan`` that compile the
loop body into one megakernel (``lk.fori_loop``, ``lk.while_loop``, ``lk.scan``).

    trace.py   the body's jaxpr, flattened (calls inlined) into a small program
    lower.py   the program -> the source of a restricted-Python step (index functions)
    loops.py   the public loops: trace, lower, build the MegaKernel (cached), run it with
               kernel.jax, fall back to jax.lax outside the subset

Needs JAX (the ``jax`` extra); ``import loopkern`` does not import this package.
"""

from .loops import DEFAULT_CHUNK, JaxLoopWarning, fori_loop, scan, while_loop

__all__ = ["fori_loop", "while_loop", "scan", "JaxLoopWarning", "DEFAULT_CHUNK"]
