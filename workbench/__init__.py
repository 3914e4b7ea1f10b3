"""cfm-workbench: fast training of chemistry foundation models (MACE) on heterogeneous graphs.

Subpackages: :mod:`workbench.data` (the Table-3 mixture, extxyz I/O, graph sizes),
:mod:`workbench.packing` (bin packing as a distributed batch sampler),
:mod:`workbench.kernels` (CG-sparse fused kernels), :mod:`workbench.train`,
:mod:`workbench.launch` and :mod:`workbench.viz`.
"""

from workbench import _compat  # noqa: F401  (must run before anything imports e3nn)

__version__ = "0.1.0"
