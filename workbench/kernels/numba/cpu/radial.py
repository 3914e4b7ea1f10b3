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

__all__ = ["interval_order", "table_rows", "table_slope_dot", "table_values"]

#: sorted edges per parallel chunk
CHUNK = 64
#: edges of one interval evaluated together, so each coefficient is loaded once for all of them
#: (paper config, 61,240 edges, J = 1,280, float32, 2 threads: values 27 -> 22 -> 18 ms at one,
#: four and eight edges, slope-dot 30 -> 19 -> 14 ms); the kernels are written for eight
BLOCK = 8


@njit(cache=True, nogil=True, inline="always")
def _interval(r, e, lo, inv_h, n):  # pragma: no cover - compiled
    """Edge ``e``'s interval (the last one holds the domain's right end)."""
    return min(int((r[e] - lo) * inv_h), n - 1)


@njit(cache=True, nogil=True)
def interval_order(r: np.ndarray, lo: float, inv_h: float, n: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """``order`` of the edges by interval (counting sort, stable) and each edge's interval."""
    k = np.empty(r.size, dtype=np.int64)
    counts = np.zeros(n + 1, dtype=np.int64)
    for e in range(r.size):
        i = _interval(r, e, lo, inv_h, n)
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
def _edges8(r, order, i, q, lo, inv_h, T):  # pragma: no cover - compiled
    """Sorted edges ``i .. i + 7`` and their coordinates on their interval ``q``."""
    e0, e1, e2, e3 = order[i], order[i + 1], order[i + 2], order[i + 3]
    e4, e5, e6, e7 = order[i + 4], order[i + 5], order[i + 6], order[i + 7]
    s0, s1 = _coordinate(r, e0, q, lo, inv_h, T), _coordinate(r, e1, q, lo, inv_h, T)
    s2, s3 = _coordinate(r, e2, q, lo, inv_h, T), _coordinate(r, e3, q, lo, inv_h, T)
    s4, s5 = _coordinate(r, e4, q, lo, inv_h, T), _coordinate(r, e5, q, lo, inv_h, T)
    s6, s7 = _coordinate(r, e6, q, lo, inv_h, T), _coordinate(r, e7, q, lo, inv_h, T)
    return (e0, e1, e2, e3, e4, e5, e6, e7), (s0, s1, s2, s3, s4, s5, s6, s7)


@njit(cache=True, nogil=True, inline="always")
def _horner(a0, a1, a2, a3, a4, a5, a6, a7, s):  # pragma: no cover - compiled
    return ((((((a7 * s + a6) * s + a5) * s + a4) * s + a3) * s + a2) * s + a1) * s + a0


@njit(cache=True, nogil=True, inline="always")
def _values8(cq, s, out, e):  # pragma: no cover - compiled
    """The values of the eight edges ``e`` on one interval (coefficients ``cq``), each loaded once."""
    s0, s1, s2, s3, s4, s5, s6, s7 = s
    r0, r1, r2, r3 = out[e[0]], out[e[1]], out[e[2]], out[e[3]]
    r4, r5, r6, r7 = out[e[4]], out[e[5]], out[e[6]], out[e[7]]
    for j in range(cq.shape[1]):
        a0, a1, a2, a3, a4, a5, a6, a7 = cq[0, j], cq[1, j], cq[2, j], cq[3, j], cq[4, j], cq[5, j], cq[6, j], cq[7, j]
        r0[j] = _horner(a0, a1, a2, a3, a4, a5, a6, a7, s0)
        r1[j] = _horner(a0, a1, a2, a3, a4, a5, a6, a7, s1)
        r2[j] = _horner(a0, a1, a2, a3, a4, a5, a6, a7, s2)
        r3[j] = _horner(a0, a1, a2, a3, a4, a5, a6, a7, s3)
        r4[j] = _horner(a0, a1, a2, a3, a4, a5, a6, a7, s4)
        r5[j] = _horner(a0, a1, a2, a3, a4, a5, a6, a7, s5)
        r6[j] = _horner(a0, a1, a2, a3, a4, a5, a6, a7, s6)
        r7[j] = _horner(a0, a1, a2, a3, a4, a5, a6, a7, s7)


@njit(cache=True, nogil=True, inline="always")
def _values1(cq, s, row):  # pragma: no cover - compiled
    for j in range(cq.shape[1]):
        row[j] = _horner(cq[0, j], cq[1, j], cq[2, j], cq[3, j], cq[4, j], cq[5, j], cq[6, j], cq[7, j], s)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _values_chunk(r, order, k, lo, inv_h, coeffs, out, i, end):  # pragma: no cover - compiled
    """The values of sorted edges ``i .. end - 1`` (one thread's chunk)."""
    T = coeffs.dtype.type
    while i < end:
        q = k[order[i]]
        if _blocked(order, k, i, end):
            e, s = _edges8(r, order, i, q, lo, inv_h, T)
            _values8(coeffs[q], s, out, e)
            i += BLOCK
        else:
            _values1(coeffs[q], _coordinate(r, order[i], q, lo, inv_h, T), out[order[i]])
            i += 1


@njit(cache=True, nogil=True, parallel=True)
def _values(r, order, k, lo, inv_h, coeffs, out):  # pragma: no cover - compiled
    for c in prange((r.size + CHUNK - 1) // CHUNK):
        _values_chunk(r, order, k, lo, inv_h, coeffs, out, c * CHUNK, min(r.size, (c + 1) * CHUNK))


@njit(cache=True, nogil=True, inline="always")
def _slopes8(cq, s, grad, e):  # pragma: no cover - compiled
    """``sum_j g_b[j] dR_j/ds`` at ``s_b`` for eight edges ``b`` on one interval; constants in
    the table's dtype (an integer literal times a float32 is a float64: half the vector lanes)."""
    T = cq.dtype.type
    t2, t3, t4, t5, t6, t7 = T(2.0), T(3.0), T(4.0), T(5.0), T(6.0), T(7.0)
    s0, s1, s2, s3, s4, s5, s6, s7 = s
    g0, g1, g2, g3 = grad[e[0]], grad[e[1]], grad[e[2]], grad[e[3]]
    g4, g5, g6, g7 = grad[e[4]], grad[e[5]], grad[e[6]], grad[e[7]]
    x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = T(0.0)
    for j in range(cq.shape[1]):
        a1, a2, a3, a4 = cq[1, j], t2 * cq[2, j], t3 * cq[3, j], t4 * cq[4, j]
        a5, a6, a7, z = t5 * cq[5, j], t6 * cq[6, j], t7 * cq[7, j], T(0.0)
        x0 += g0[j] * _horner(a1, a2, a3, a4, a5, a6, a7, z, s0)
        x1 += g1[j] * _horner(a1, a2, a3, a4, a5, a6, a7, z, s1)
        x2 += g2[j] * _horner(a1, a2, a3, a4, a5, a6, a7, z, s2)
        x3 += g3[j] * _horner(a1, a2, a3, a4, a5, a6, a7, z, s3)
        x4 += g4[j] * _horner(a1, a2, a3, a4, a5, a6, a7, z, s4)
        x5 += g5[j] * _horner(a1, a2, a3, a4, a5, a6, a7, z, s5)
        x6 += g6[j] * _horner(a1, a2, a3, a4, a5, a6, a7, z, s6)
        x7 += g7[j] * _horner(a1, a2, a3, a4, a5, a6, a7, z, s7)
    return x0, x1, x2, x3, x4, x5, x6, x7


@njit(cache=True, nogil=True, inline="always")
def _slope1(cq, s, g):  # pragma: no cover - compiled
    T = cq.dtype.type
    t2, t3, t4, t5, t6, t7 = T(2.0), T(3.0), T(4.0), T(5.0), T(6.0), T(7.0)
    x = T(0.0)
    for j in range(cq.shape[1]):
        a1, a2, a3, a4 = cq[1, j], t2 * cq[2, j], t3 * cq[3, j], t4 * cq[4, j]
        x += g[j] * _horner(a1, a2, a3, a4, t5 * cq[5, j], t6 * cq[6, j], t7 * cq[7, j], T(0.0), s)
    return x


@njit(cache=True, nogil=True, fastmath={"contract", "reassoc", "nsz"})
def _slopes_chunk(r, order, k, lo, inv_h, coeffs, grad, out, i, end):  # pragma: no cover - compiled
    """The slope dots of sorted edges ``i .. end - 1`` (one thread's chunk)."""
    T, scale = coeffs.dtype.type, 2.0 * inv_h
    while i < end:
        q = k[order[i]]
        if _blocked(order, k, i, end):
            e, s = _edges8(r, order, i, q, lo, inv_h, T)
            x0, x1, x2, x3, x4, x5, x6, x7 = _slopes8(coeffs[q], s, grad, e)
            out[e[0]], out[e[1]], out[e[2]], out[e[3]] = x0 * scale, x1 * scale, x2 * scale, x3 * scale
            out[e[4]], out[e[5]], out[e[6]], out[e[7]] = x4 * scale, x5 * scale, x6 * scale, x7 * scale
            i += BLOCK
        else:
            out[order[i]] = _slope1(coeffs[q], _coordinate(r, order[i], q, lo, inv_h, T), grad[order[i]]) * scale
            i += 1


@njit(cache=True, nogil=True, parallel=True)
def _slope_dot(r, order, k, lo, inv_h, coeffs, grad, out):  # pragma: no cover - compiled
    for c in prange((r.size + CHUNK - 1) // CHUNK):
        _slopes_chunk(r, order, k, lo, inv_h, coeffs, grad, out, c * CHUNK, min(r.size, (c + 1) * CHUNK))


@njit(cache=True, nogil=True, parallel=True)
def _rows(r, lo, inv_h, n, k, s):  # pragma: no cover - compiled
    T = s.dtype.type
    for e in prange(r.size):
        q = _interval(r, e, lo, inv_h, n)
        k[e], s[e] = q, _coordinate(r, e, q, lo, inv_h, T)


def table_rows(
    r: np.ndarray, lo: float, h: float, num_intervals: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Each length's interval ``k`` ``[E]`` and centred coordinate ``s`` ``[E]`` (in ``dtype``), as
    :func:`table_values` computes them, for kernels that evaluate the table in edge order
    (:mod:`~workbench.kernels.numba.cpu.tabulated`)."""
    k = np.empty(r.size, dtype=np.int64)
    s = np.empty(r.size, dtype=dtype)
    _rows(r, lo, 1.0 / h, num_intervals, k, s)
    return k, s


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
