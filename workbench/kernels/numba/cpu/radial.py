r"""The CPU kernels of a tabulated radial function (:mod:`workbench.kernels.radial_table`).

Forward, per edge ``e`` on interval ``k`` at :math:`s = 2 ((r_e - lo)/h - k) - 1`:
:math:`\mathrm{out}[e, j] = \sum_{p=0}^{7} c[k, p, j]\, s^p` (Horner). Backward, for the forces:
:math:`\bar r_e = \sum_j \bar{\mathrm{out}}[e, j]\, R_j'(r_e)`, the slope from the same
coefficients. Edges are visited interval by interval (a counting sort of their interval
numbers), so the ``[8, J]`` coefficients of an interval are read from memory once and stay in
cache for every edge on it: a float64 table of 512 intervals at ``J = 1280`` is 42 MB.
Chunks of consecutive sorted edges run in parallel; each writes its own rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["interval_order", "table_slope_dot", "table_values"]

#: sorted edges per parallel chunk
CHUNK = 64


@njit(cache=True, nogil=True)
def interval_order(r: np.ndarray, lo: float, inv_h: float, n: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """``order`` of the edges by interval (counting sort, stable) and each edge's interval."""
    k = np.empty(r.size, dtype=np.int64)
    counts = np.zeros(n + 1, dtype=np.int64)
    for e in range(r.size):
        i = min(int((r[e] - lo) * inv_h), n - 1)
        k[e] = i
        counts[i + 1] += 1
    for i in range(n):
        counts[i + 1] += counts[i]
    order = np.empty(r.size, dtype=np.int64)
    for e in range(r.size):
        order[counts[k[e]]] = e
        counts[k[e]] += 1
    return order, k


@njit(cache=True, nogil=True, inline="always")
def _edge(r, order, k, lo, inv_h, coeffs, i):  # pragma: no cover - compiled
    """The ``i``-th edge in interval order: ``(edge, interval, centred coordinate s)``."""
    e = order[i]
    q = k[e]
    return e, q, coeffs.dtype.type(2.0 * ((r[e] - lo) * inv_h - q) - 1.0)


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _values(r, order, k, lo, inv_h, coeffs, out):  # pragma: no cover - compiled
    num_chunks = (r.size + CHUNK - 1) // CHUNK
    J = coeffs.shape[2]
    for c in prange(num_chunks):
        for i in range(c * CHUNK, min(r.size, (c + 1) * CHUNK)):
            e, q, s = _edge(r, order, k, lo, inv_h, coeffs, i)
            c0, c1, c2, c3 = coeffs[q, 0], coeffs[q, 1], coeffs[q, 2], coeffs[q, 3]
            c4, c5, c6, c7 = coeffs[q, 4], coeffs[q, 5], coeffs[q, 6], coeffs[q, 7]
            row = out[e]
            for j in range(J):
                v = ((((c7[j] * s + c6[j]) * s + c5[j]) * s + c4[j]) * s + c3[j]) * s + c2[j]
                row[j] = (v * s + c1[j]) * s + c0[j]


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract", "reassoc", "nsz"})
def _slope_dot(r, order, k, lo, inv_h, coeffs, grad, out):  # pragma: no cover - compiled
    num_chunks = (r.size + CHUNK - 1) // CHUNK
    J = coeffs.shape[2]
    zero = coeffs.dtype.type(0.0)
    for c in prange(num_chunks):
        for i in range(c * CHUNK, min(r.size, (c + 1) * CHUNK)):
            e, q, s = _edge(r, order, k, lo, inv_h, coeffs, i)
            c1, c2, c3, c4 = coeffs[q, 1], coeffs[q, 2], coeffs[q, 3], coeffs[q, 4]
            c5, c6, c7 = coeffs[q, 5], coeffs[q, 6], coeffs[q, 7]
            g = grad[e]
            acc = zero
            for j in range(J):
                d = (((7 * c7[j] * s + 6 * c6[j]) * s + 5 * c5[j]) * s + 4 * c4[j]) * s + 3 * c3[j]
                acc += g[j] * ((d * s + 2 * c2[j]) * s + c1[j])
            out[e] = acc * (2.0 * inv_h)


def table_values(r: np.ndarray, lo: float, h: float, coeffs: np.ndarray) -> tuple[np.ndarray, tuple]:
    """``([E, J] values, plan)`` at lengths ``r`` ``[E]`` (in ``[lo, lo + N h]``); ``plan`` is the
    edges' order and intervals, for :func:`table_slope_dot` on the same lengths."""
    n = coeffs.shape[0]
    plan = interval_order(r, lo, 1.0 / h, n)
    out = np.empty((r.size, coeffs.shape[2]), dtype=coeffs.dtype)
    _values(r, plan[0], plan[1], lo, 1.0 / h, coeffs, out)
    return out, plan


def table_slope_dot(
    r: np.ndarray, plan: tuple, lo: float, h: float, coeffs: np.ndarray, grad: np.ndarray
) -> np.ndarray:
    """``[E]``: :math:`\\sum_j \\mathrm{grad}[e, j] R_j'(r_e)`, ``grad`` ``[E, J]`` C-contiguous."""
    out = np.empty(r.size, dtype=coeffs.dtype)
    _slope_dot(r, plan[0], plan[1], lo, 1.0 / h, coeffs, grad, out)
    return out
