"""CG-sparse fused kernels for MACE (paper §4): descriptors, numba CUDA and CPU paths,
autograd to any order, and :func:`accelerate` to swap them into mace-torch models.

* :class:`SparsePolynomial` / :class:`Operand` - one descriptor of a sparse channelwise
  operation; :meth:`SparsePolynomial.vjp` derives backward and double backward from it.
* :class:`PolyOp` / :func:`apply_poly_op` - evaluation (CUDA kernel on GPU tensors, numba CPU
  otherwise) wrapped in a self-differentiating ``torch.autograd.Function``.
* :class:`SymmetricContraction` - drop-in for mace's symmetric contraction.
* :func:`accelerate` - ``accelerate(model, backend="numba" | "e3nn" | "cueq", ops=None)``.
"""

from workbench.kernels.accelerate import AVAILABLE_OPS, accelerate
from workbench.kernels.descriptor import Operand, SparsePolynomial
from workbench.kernels.op import PolyOp, apply_poly_op
from workbench.kernels.symmetric_contraction import (
    SymmetricContraction,
    SymmetricContractionStats,
    symmetric_contraction_polynomial,
)

__all__ = [
    "AVAILABLE_OPS",
    "Operand",
    "PolyOp",
    "SparsePolynomial",
    "SymmetricContraction",
    "SymmetricContractionStats",
    "accelerate",
    "apply_poly_op",
    "symmetric_contraction_polynomial",
]
