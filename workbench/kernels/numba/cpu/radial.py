r"""The CPU kernels of a tabulated radial function (:mod:`workbench.kernels.radial_table`).

Forward, per edge ``e`` on interval ``k`` at :math:`s = 2 ((r_e - lo)/h - k) - 1`:
:math:`\mathrm{out}[e, j] = \sum_{p=0}^{7} c[k, p, j]\, s^p` (Horner). Backward, for the forces:
:math:`\bar r_e = \sum_j \bar{\mathrm{out}}[e, j]\, R_j'(r_e)`, the slope from the same
coefficients. Edges are visited interval by interval (a counting sort of their interval
numbers), so the ``[8, J]`` coefficients of an interval are read from memory once and stay in
cache for every edge on it: a float64 table of 512 intervals at ``J = 1280`` is 42 MB. Runs
of :data:`BLOCK` edges on one interval are evaluated together, each coefficient loaded into a
register once for all of them. Chunks of consecutive sorted edges run in parallel; each writes
its own rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["interval_order", "table_slope_dot", "table_values"]

#: sorted edges per parallel chunk
CHUNK = 64
#: edges of one interval evaluated together, so each coefficient is loaded once for all of them
#: (paper config, 61,240 edges, J = 1,280, float32, 2 threads: values 27 -> 22 ms, slope-dot
#: 30 -> 19 ms)
BLOCK = 4


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
def _coordinate(r, e, q, lo, inv_h, T):  # pragma: no cover - compiled
    """Edge ``e``'s centred coordinate ``s`` on its interval ``q``, in the table's dtype ``T``."""
    return T(2.0 * ((r[e] - lo) * inv_h - q) - 1.0)


@njit(cache=True, nogil=True, inline="always")
def _blocked(order, k, i, end):  # pragma: no cover - compiled
    """Whether sorted edges ``i .. i + BLOCK - 1`` (before ``end``) share one interval."""
    return i + BLOCK - 1 < end and k[order[i + BLOCK - 1]] == k[order[i]]


@njit(cache=True, nogil=True, inline="always")
def _run(r, order, i, q, lo, inv_h, T):  # pragma: no cover - compiled
    """The next three sorted edges after ``i`` and the coordinates of all four on interval ``q``."""
    e0, e1, e2, e3 = order[i], order[i + 1], order[i + 2], order[i + 3]
    s0, s1 = _coordinate(r, e0, q, lo, inv_h, T), _coordinate(r, e1, q, lo, inv_h, T)
    s2, s3 = _coordinate(r, e2, q, lo, inv_h, T), _coordinate(r, e3, q, lo, inv_h, T)
    return e1, e2, e3, s0, s1, s2, s3


@njit(cache=True, nogil=True, inline="always")
def _values4(cq, s0, s1, s2, s3, r0, r1, r2, r3):  # pragma: no cover - compiled
    for j in range(cq.shape[1]):
        a0, a1, a2, a3, a4, a5, a6, a7 = cq[0, j], cq[1, j], cq[2, j], cq[3, j], cq[4, j], cq[5, j], cq[6, j], cq[7, j]
        r0[j] = ((((((a7 * s0 + a6) * s0 + a5) * s0 + a4) * s0 + a3) * s0 + a2) * s0 + a1) * s0 + a0
        r1[j] = ((((((a7 * s1 + a6) * s1 + a5) * s1 + a4) * s1 + a3) * s1 + a2) * s1 + a1) * s1 + a0
        r2[j] = ((((((a7 * s2 + a6) * s2 + a5) * s2 + a4) * s2 + a3) * s2 + a2) * s2 + a1) * s2 + a0
        r3[j] = ((((((a7 * s3 + a6) * s3 + a5) * s3 + a4) * s3 + a3) * s3 + a2) * s3 + a1) * s3 + a0


@njit(cache=True, nogil=True, inline="always")
def _values1(cq, s, row):  # pragma: no cover - compiled
    for j in range(cq.shape[1]):
        v = ((((cq[7, j] * s + cq[6, j]) * s + cq[5, j]) * s + cq[4, j]) * s + cq[3, j]) * s + cq[2, j]
        row[j] = (v * s + cq[1, j]) * s + cq[0, j]


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _values(r, order, k, lo, inv_h, coeffs, out):  # pragma: no cover - compiled
    T = coeffs.dtype.type
    for c in prange((r.size + CHUNK - 1) // CHUNK):
        i, end = c * CHUNK, min(r.size, (c + 1) * CHUNK)
        while i < end:
            e0 = order[i]
            q = k[e0]
            if _blocked(order, k, i, end):
                e1, e2, e3, s0, s1, s2, s3 = _run(r, order, i, q, lo, inv_h, T)
                _values4(coeffs[q], s0, s1, s2, s3, out[e0], out[e1], out[e2], out[e3])
                i += BLOCK
            else:
                _values1(coeffs[q], _coordinate(r, e0, q, lo, inv_h, T), out[e0])
                i += 1


@njit(cache=True, nogil=True, inline="always")
def _slopes4(cq, s0, s1, s2, s3, g0, g1, g2, g3):  # pragma: no cover - compiled
    """``(sum_j g_b[j] dR_j/ds at s_b)`` for the four edges ``b``; constants in the table's dtype:
    an integer literal times a float32 is a float64, half the vector lanes."""
    T = cq.dtype.type
    t2, t3, t4, t5, t6, t7 = T(2.0), T(3.0), T(4.0), T(5.0), T(6.0), T(7.0)
    x0 = x1 = x2 = x3 = T(0.0)
    for j in range(cq.shape[1]):
        a1, a2, a3, a4 = cq[1, j], t2 * cq[2, j], t3 * cq[3, j], t4 * cq[4, j]
        a5, a6, a7 = t5 * cq[5, j], t6 * cq[6, j], t7 * cq[7, j]
        x0 += g0[j] * ((((((a7 * s0 + a6) * s0 + a5) * s0 + a4) * s0 + a3) * s0 + a2) * s0 + a1)
        x1 += g1[j] * ((((((a7 * s1 + a6) * s1 + a5) * s1 + a4) * s1 + a3) * s1 + a2) * s1 + a1)
        x2 += g2[j] * ((((((a7 * s2 + a6) * s2 + a5) * s2 + a4) * s2 + a3) * s2 + a2) * s2 + a1)
        x3 += g3[j] * ((((((a7 * s3 + a6) * s3 + a5) * s3 + a4) * s3 + a3) * s3 + a2) * s3 + a1)
    return x0, x1, x2, x3


@njit(cache=True, nogil=True, inline="always")
def _slope1(cq, s, g):  # pragma: no cover - compiled
    T = cq.dtype.type
    t2, t3, t4, t5, t6, t7 = T(2.0), T(3.0), T(4.0), T(5.0), T(6.0), T(7.0)
    x = T(0.0)
    for j in range(cq.shape[1]):
        d = (((t7 * cq[7, j] * s + t6 * cq[6, j]) * s + t5 * cq[5, j]) * s + t4 * cq[4, j]) * s + t3 * cq[3, j]
        x += g[j] * ((d * s + t2 * cq[2, j]) * s + cq[1, j])
    return x


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract", "reassoc", "nsz"})
def _slope_dot(r, order, k, lo, inv_h, coeffs, grad, out):  # pragma: no cover - compiled
    T, scale = coeffs.dtype.type, 2.0 * inv_h
    for c in prange((r.size + CHUNK - 1) // CHUNK):
        i, end = c * CHUNK, min(r.size, (c + 1) * CHUNK)
        while i < end:
            e0 = order[i]
            q = k[e0]
            if _blocked(order, k, i, end):
                e1, e2, e3, s0, s1, s2, s3 = _run(r, order, i, q, lo, inv_h, T)
                x = _slopes4(coeffs[q], s0, s1, s2, s3, grad[e0], grad[e1], grad[e2], grad[e3])
                out[e0], out[e1], out[e2], out[e3] = x[0] * scale, x[1] * scale, x[2] * scale, x[3] * scale
                i += BLOCK
            else:
                out[e0] = _slope1(coeffs[q], _coordinate(r, e0, q, lo, inv_h, T), grad[e0]) * scale
                i += 1


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
