"""The ``numba`` backend: the kernels that evaluate :mod:`~workbench.kernels.descriptor` term tables.

* :mod:`~workbench.kernels.numba.dispatch` - the backend's ``evaluate``: which kernels run an
  op's outputs on the CPU, on CUDA, or on the CUDA simulator;
* :mod:`~workbench.kernels.numba.cpu` - vector programs run by numba, SIMD over channels
  (:mod:`~workbench.kernels.numba.cpu.passes`), fused passes, the radial tables' kernels;
* :mod:`~workbench.kernels.numba.gpu` - CUDA: table-driven (:mod:`~workbench.kernels.numba.gpu.atom`,
  :mod:`~workbench.kernels.numba.gpu.edge`) and unrolled CUDA kernels, one launch per pass, the
  CUDA target and the toolkit;
* shared: :mod:`~workbench.kernels.numba.compiled` (term tables with their device copies),
  :mod:`~workbench.kernels.numba.generated` (generated modules under the kernel cache),
  :mod:`~workbench.kernels.numba.cache_folder`, :mod:`~workbench.kernels.numba.numba_cache`,
  :mod:`~workbench.kernels.numba.gather`.
"""
