"""Device-side runtime imported by generated kernels (barriers, reductions).

``cuda_rt`` serves the CUDA backend (and Numba's CUDA simulator), ``cpu_rt`` the CPU backend.
These modules import numba; they are loaded only when a kernel is compiled.
"""
