r"""An edge op's operand read from a table of polynomials in each edge's length, on the CPU.

MACE's message op reads its radial weights ``R(r_e)`` ``[E, J]`` (``J = 1280`` at the paper
configuration: 313 MB in float32 at 61,240 edges) and its backward writes their cotangent
``[E, J]``, which the table's slope kernel then reads back to give
:math:`\bar r_e = \sum_j \bar R_{ej} R_j'(r_e)`. Here the fused passes evaluate the table where
they read the weights (eight coefficients of one interval, :math:`O(J)` of cache per edge) and
dot the cotangent with the slopes where they computed it, so no ``[E, J]`` array exists
(:class:`~workbench.kernels.numba.cpu.fused.TableRead` writes the code).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.kernels.numba.cpu.fused import TableRead
from workbench.kernels.numba.cpu.passes import CpuPlan, RowPass

__all__ = ["TableOperand"]


@dataclass(frozen=True, eq=False)
class TableOperand:
    """An edge op's ``[edges, J]`` operand given as a table of polynomials in each edge's scalar
    (a radial network's table at the edge lengths, :mod:`workbench.kernels.radial_table`):
    kernel array ``array`` is replaced by ``coeffs`` ``[N, 8, J]``, ``tk`` / ``ts`` ``[edges]``
    are each edge's interval and centred coordinate. Op output ``output`` (-1: none), the
    operand's cotangent, is not stored but dotted with the slopes (in ``s``) into ``dr``."""

    array: int
    coeffs: np.ndarray
    tk: np.ndarray
    ts: np.ndarray
    output: int = -1
    dr: np.ndarray | None = None

    def _slope(self, rp: RowPass) -> int:
        """The program output of ``rp`` that is the operand's cotangent, or -1."""
        return next((p for p, k in enumerate(rp.outputs) if k == self.output), -1)

    def read(self, rp: RowPass) -> tuple[TableRead, tuple] | None:
        """How ``rp`` reads the table (and the row arrays its kernel takes), or None: it does not."""
        slope = self._slope(rp)
        if self.array not in rp.vec_arr and slope < 0:
            return None
        return TableRead(self.array, int(self.coeffs.shape[2]), slope), (self.tk, self.ts) + (
            (self.dr,) if slope >= 0 else ()
        )

    def supports(self, cp: CpuPlan) -> bool:
        """Whether every pass of ``cp`` can read the table: fused, the operand a channel vector in
        its own column order, its cotangent stored per edge."""
        if cp.order[cp.array_ids.index(self.array)] is not None:
            return False
        for _, rp in cp.passes:
            slope = self._slope(rp)
            if self.array in rp.sca_arr or (slope >= 0 and rp.acc_seg[rp.acc_out == slope].any()):
                return False
            if (self.array in rp.vec_arr or slope >= 0) and not rp.fused():
                return False
        return True
