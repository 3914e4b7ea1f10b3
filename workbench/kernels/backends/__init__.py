"""Backend layer: kernels that evaluate :mod:`~workbench.kernels.descriptor` term tables.

:mod:`.cpu` (numba CPU: vector programs, SIMD over channels), :mod:`.cuda` / :mod:`.edge_cuda` (table-driven
numba CUDA), :mod:`.unrolled` (CUDA source generated per table), :mod:`.compiled` (tables with
their device copies), :mod:`.device` (CUDA target and simulator switches).
"""
