"""JAX for the GPU test modules that use it (test_jax_gpu, test_jaxloops_gpu,
test_sharded_gpu): imported here, with XLA told not to grab most of the GPU's memory first;
a missing JAX, or a JAX without a GPU backend, skips each test that calls
:func:`require_gpu_jax` (a failure under LOOPKERN_REQUIRE_GPU=1, tests/conftest.py)."""

import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
try:
    import jax
    import jax.numpy as jnp
    JAX_ERROR = None
except ImportError as exc:
    jax = jnp = None
    JAX_ERROR = f"{type(exc).__name__}: {exc}"


def require_gpu_jax(hint: str = ""):
    """Skip the calling test unless JAX is installed and has a GPU backend."""
    if jax is None:
        pytest.skip(f"JAX is not installed ({JAX_ERROR})")
    if jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (default backend: {jax.default_backend()}){hint}")
