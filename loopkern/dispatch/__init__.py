"""The call path: from ``kernel(...)`` to a running kernel and back.

Modules, in the order a call meets them:

- ``dispatcher``: :class:`Dispatcher`, one per kernel: options, binding, the plan cache,
  running a plan (blocking or in the background);
- ``signature``: a call's signature, read cheaply from its arguments;
- ``args``: full classification of arguments (NumPy, GPU arrays, DLPack, numbers);
- ``checks``: the argument and option checks, shared with ``kernel.jax``;
- ``config``: backend choice, scope, occupancy, grid size, shared-memory staging;
- ``kernels``: the compiled variants of one step;
- ``plan``: :class:`~loopkern.dispatch.plan.LaunchPlan` (what a signature decided) and its slots;
- ``buffers``: scratch buffers, control blocks and their free lists;
- ``driver``: launching and waiting through ``libcuda`` directly.
"""

from .dispatcher import Dispatcher

__all__ = ["Dispatcher"]
