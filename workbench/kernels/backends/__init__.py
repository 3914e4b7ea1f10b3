"""Backend layer: kernels that evaluate :mod:`~workbench.kernels.descriptor` term tables.

:mod:`.cpu` / :mod:`.edge_cpu` (numba CPU), :mod:`.cuda` / :mod:`.edge_cuda` (table-driven
numba CUDA), :mod:`.unrolled` (CUDA source generated per table), :mod:`.compiled` (tables with
their device copies), :mod:`.device` (CUDA target and simulator switches).
"""
