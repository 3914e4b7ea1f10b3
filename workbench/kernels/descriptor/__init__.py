"""Descriptor layer: sparse polynomials, their kernel-ready term tables and the kernel layout.

Nothing here imports a backend (numba, CUDA): every backend reads these tables.
"""

from workbench.kernels.descriptor.layout import MAX_ATOM_ARRAYS, MAX_EDGE_ARRAYS, MAX_SPECIES_ARRAYS, ROW_CODES, ROWS
from workbench.kernels.descriptor.polynomial import Operand, SparsePolynomial
from workbench.kernels.descriptor.tables import TermTable, term_table

__all__ = [
    "MAX_ATOM_ARRAYS",
    "MAX_EDGE_ARRAYS",
    "MAX_SPECIES_ARRAYS",
    "ROWS",
    "ROW_CODES",
    "Operand",
    "SparsePolynomial",
    "TermTable",
    "term_table",
]
