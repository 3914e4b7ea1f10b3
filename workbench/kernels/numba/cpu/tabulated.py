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
from numba import njit, prange

from workbench.kernels.numba.cpu.fused import TableRead
from workbench.kernels.numba.cpu.passes import CpuPlan, RowPass

__all__ = ["TableOperand", "table_rows"]


@njit(cache=True, nogil=True, parallel=True)
def _rows(r, lo, inv_h, n, k, s):  # pragma: no cover - compiled
    for e in prange(r.size):
        x = (r[e] - lo) * inv_h
        q = min(int(x), n - 1)
        k[e] = q
        s[e] = 2.0 * (x - q) - 1.0


def table_rows(
    r: np.ndarray, lo: float, h: float, num_intervals: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Each length's interval ``k`` ``[E]`` and centred coordinate ``s`` ``[E]`` (in ``dtype``), as
    :func:`workbench.kernels.numba.cpu.radial.table_values` computes them."""
    k = np.empty(r.size, dtype=np.int64)
    s = np.empty(r.size, dtype=dtype)
    _rows(r, lo, 1.0 / h, num_intervals, k, s)
    return k, s


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

    def read(self, rp: RowPass) -> tuple[TableRead, tuple] | None:
        """How ``rp`` reads the table (and the row arrays its kernel takes), or None: it does not."""
        slope = next((p for p, k in enumerate(rp.outputs) if k == self.output), -1)
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
            slope = [p for p, k in enumerate(rp.outputs) if k == self.output]
            if self.array in rp.sca_arr or any(rp.acc_seg[rp.acc_out == p].any() for p in slope):
                return False
            if (self.array in rp.vec_arr or slope) and not rp.fused():
                return False
        return True
