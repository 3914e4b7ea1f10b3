"""CG-sparse fused kernels for MACE (paper §4): descriptors, numba CUDA and CPU paths,
autograd to any order, and :func:`accelerate` to swap them into mace-torch models.

* :class:`SparsePolynomial` / :class:`Operand` - one descriptor of a sparse channelwise
  operation; :meth:`SparsePolynomial.vjp` derives backward and double backward from it.
* :class:`PolyOp` / :func:`apply_poly_op` - evaluation (CUDA kernel on GPU tensors, numba CPU
  otherwise) wrapped in a self-differentiating ``torch.autograd.Function``.
* :class:`SymmetricContraction` - drop-in for mace's symmetric contraction.
* :class:`EdgePolyOp` / :func:`apply_edge_poly_op` / :class:`EdgeGraph` - sparse polynomials
  over edges with the gather from sender / receiver nodes and the scatter-sum fused in.
* :func:`channelwise_tp_polynomial` / :func:`channelwise_tp_op` - an e3nn channelwise ("uvu")
  tensor product + scatter (the message op of MACE and NequIP) as one edge polynomial;
  :func:`fuse_conv_tp` swaps it into a MACE interaction block through mace's ``conv_fusion`` hook.
* :func:`accelerate` - ``accelerate(model, backend=DEFAULT_BACKEND, ops=None)``; the backends and model
  families are listed in :mod:`~workbench.kernels.registry`.
* :func:`compile_ready` / :func:`energy_program` - an accelerated MACE model traced by dynamo as
  one graph (``torch.compile(fullgraph=True)``) and exported (``torch.export``); the kernels
  are the custom op ``workbench::sparse_poly`` there (:mod:`~workbench.kernels.library`).

Layers (imports run one way, top to bottom):

* :mod:`~workbench.kernels.descriptor` - polynomials, term tables, kernel layout;
* :mod:`~workbench.kernels.numba` - numba CPU, table-driven and unrolled CUDA kernels;
* :mod:`~workbench.kernels.ops` - :class:`PolyOp`, its autograd function and the dispatch;
  :mod:`~workbench.kernels.launches` (the kernels a force-training step launches, planned without
  running) and :mod:`~workbench.kernels.precompile` (those kernels compiled ahead, in parallel,
  once per node, into a cache folder that can be shared);
* :mod:`~workbench.kernels.mace` - the MACE ops and :func:`accelerate`;
* :mod:`~workbench.kernels.tools` - resource report, CLI, benchmark fixtures.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what static readers (the API reference, type checkers) see; __getattr__ imports at run time
    from workbench.kernels.acceleration import AVAILABLE_OPS, KERNEL_BACKENDS, accelerate
    from workbench.kernels.compiling import compile_ready, energy_program
    from workbench.kernels.descriptor import Operand, SparsePolynomial
    from workbench.kernels.e3nn.tp import ChannelwiseTPStats, channelwise_tp_op, channelwise_tp_polynomial
    from workbench.kernels.mace.channelwise_tp import SUPPORTED_INTERACTION_BLOCKS, fuse_conv_tp, unfuse_conv_tp
    from workbench.kernels.mace.symmetric_contraction import (
        SymmetricContraction,
        SymmetricContractionStats,
        symmetric_contraction_polynomial,
    )
    from workbench.kernels.ops import EdgeGraph, EdgePolyOp, PolyOp, apply_edge_poly_op, apply_poly_op

#: public name -> the module that owns it; imported on first access (PEP 562), so that reading
#: the registries (:mod:`workbench.kernels.registry`) or building the CLI does not import torch
_OWNERS = {
    "AVAILABLE_OPS": "workbench.kernels.acceleration",
    "KERNEL_BACKENDS": "workbench.kernels.acceleration",
    "accelerate": "workbench.kernels.acceleration",
    "compile_ready": "workbench.kernels.compiling",
    "energy_program": "workbench.kernels.compiling",
    "Operand": "workbench.kernels.descriptor",
    "SparsePolynomial": "workbench.kernels.descriptor",
    "SUPPORTED_INTERACTION_BLOCKS": "workbench.kernels.mace.channelwise_tp",
    "ChannelwiseTPStats": "workbench.kernels.e3nn.tp",
    "channelwise_tp_op": "workbench.kernels.e3nn.tp",
    "channelwise_tp_polynomial": "workbench.kernels.e3nn.tp",
    "fuse_conv_tp": "workbench.kernels.mace.channelwise_tp",
    "unfuse_conv_tp": "workbench.kernels.mace.channelwise_tp",
    "SymmetricContraction": "workbench.kernels.mace.symmetric_contraction",
    "SymmetricContractionStats": "workbench.kernels.mace.symmetric_contraction",
    "symmetric_contraction_polynomial": "workbench.kernels.mace.symmetric_contraction",
    "EdgeGraph": "workbench.kernels.ops",
    "EdgePolyOp": "workbench.kernels.ops",
    "PolyOp": "workbench.kernels.ops",
    "apply_edge_poly_op": "workbench.kernels.ops",
    "apply_poly_op": "workbench.kernels.ops",
}


def __getattr__(name: str) -> Any:
    if name not in _OWNERS:
        raise AttributeError(f"module 'workbench.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_OWNERS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_OWNERS])


__all__ = [
    "AVAILABLE_OPS",
    "KERNEL_BACKENDS",
    "SUPPORTED_INTERACTION_BLOCKS",
    "ChannelwiseTPStats",
    "EdgeGraph",
    "EdgePolyOp",
    "Operand",
    "PolyOp",
    "SparsePolynomial",
    "SymmetricContraction",
    "SymmetricContractionStats",
    "accelerate",
    "apply_edge_poly_op",
    "apply_poly_op",
    "channelwise_tp_op",
    "channelwise_tp_polynomial",
    "compile_ready",
    "energy_program",
    "fuse_conv_tp",
    "symmetric_contraction_polynomial",
    "unfuse_conv_tp",
]
