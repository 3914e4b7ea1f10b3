r"""CPU path of the edge (message-passing) sparse polynomials: numba ``njit(parallel=True)``.

Same numerics as the CUDA kernels (:mod:`workbench.kernels.edge_cuda`): for every (edge,
channel) the used operand components are gathered into a small buffer ``v`` (rows of
``"sender"`` / ``"receiver"`` operands picked through the edge's end points, last entry 1 to
pad lower-degree terms), then the terms, sorted by output component, are summed in one scalar
and flushed when the output component changes (:func:`workbench.kernels.cpu._accumulate`).

Race-free without atomics:

* edge outputs (``[num_edges, width]``): parallel over edges, channels in the inner loop, so a
  channel-broadcast output (zero cstride, e.g. the gradient of the spherical harmonics) is
  summed over channels by the one thread that owns the edge;
* node outputs (``[num_nodes, width]``, scatter-sum through the sender or receiver):
  parallel over nodes, each node walking its own CSR segment of incident edges.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from workbench.kernels.cpu import _accumulate

MAX_ARRAYS = 8
#: below this many term evaluations (rows x channels x terms) the serial loop is used
SERIAL_WORK = 200_000
EDGE, SENDER, RECEIVER = 0, 1, 2
KIND_CODES = {"edge": EDGE, "sender": SENDER, "receiver": RECEIVER}


@njit(cache=True, inline="always")
def _load(v, a0, a1, a2, a3, a4, a5, a6, a7, e, s, r, c, slot_arr, slot_kind, slot_off, slot_cs):
    for q in range(slot_arr.shape[0]):
        kind = slot_kind[q]
        row = np.int64(e)  # prange indices may be unsigned: keep every row index int64
        if kind == 1:
            row = np.int64(s)
        elif kind == 2:
            row = np.int64(r)
        k = slot_off[q] + c * slot_cs[q]
        src = slot_arr[q]
        if src == 0:
            v[q] = a0[row, k]
        elif src == 1:
            v[q] = a1[row, k]
        elif src == 2:
            v[q] = a2[row, k]
        elif src == 3:
            v[q] = a3[row, k]
        elif src == 4:
            v[q] = a4[row, k]
        elif src == 5:
            v[q] = a5[row, k]
        elif src == 6:
            v[q] = a6[row, k]
        else:
            v[q] = a7[row, k]
    v[slot_arr.shape[0]] = 1.0


@njit(cache=True, inline="always")
def _row(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
         slot_arr, slot_kind, slot_off, slot_cs, t_out, t_fac, t_coef, out, out_off, out_cs, out_kind, n, v):
    """All contributions to output row ``n`` (an edge, or a node and its CSR segment)."""
    if out_kind == 0:
        s = sender[n]
        r = receiver[n]
        for c in range(C):
            _load(v, a0, a1, a2, a3, a4, a5, a6, a7, n, s, r, c, slot_arr, slot_kind, slot_off, slot_cs)
            _accumulate(v, out, n, c, t_out, t_fac, t_coef, out_off, out_cs)
    else:
        for p in range(seg_ptr[n], seg_ptr[n + 1]):
            e = seg_perm[p]
            s = sender[e]
            r = receiver[e]
            for c in range(C):
                _load(v, a0, a1, a2, a3, a4, a5, a6, a7, e, s, r, c, slot_arr, slot_kind, slot_off, slot_cs)
                _accumulate(v, out, n, c, t_out, t_fac, t_coef, out_off, out_cs)


@njit(parallel=True, cache=True)
def evaluate_edge_cpu(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
                      slot_arr, slot_kind, slot_off, slot_cs, t_out, t_fac, t_coef,
                      out, out_off, out_cs, out_kind):
    """Accumulate one compiled edge polynomial into ``out`` (zero-initialised by the caller).

    ``a*``: operand arrays ``[rows, width]`` (edge rows or node rows); ``sender``,
    ``receiver``: ``[num_edges]`` int64; ``seg_ptr`` ``[num_nodes + 1]`` / ``seg_perm``
    ``[num_edges]``: CSR of the edges grouped by the output's node (unused for edge outputs);
    ``out``: ``[num_edges or num_nodes, width]``. Parallel over output rows.
    """
    if t_out.shape[0] == 0:
        return
    rows = sender.shape[0] if out_kind == 0 else seg_ptr.shape[0] - 1
    for n in prange(rows):
        v = np.empty(slot_arr.shape[0] + 1, dtype=out.dtype)
        _row(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
             slot_arr, slot_kind, slot_off, slot_cs, t_out, t_fac, t_coef, out, out_off, out_cs, out_kind, np.int64(n), v)


@njit(cache=True)
def evaluate_edge_cpu_serial(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
                             slot_arr, slot_kind, slot_off, slot_cs, t_out, t_fac, t_coef,
                             out, out_off, out_cs, out_kind):
    """:func:`evaluate_edge_cpu` on one thread: for small problems, where waking numba's thread
    pool costs more (0.5-10 ms on a loaded machine) than the work."""
    if t_out.shape[0] == 0:
        return
    rows = sender.shape[0] if out_kind == 0 else seg_ptr.shape[0] - 1
    v = np.empty(slot_arr.shape[0] + 1, dtype=out.dtype)
    for n in range(rows):
        _row(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
             slot_arr, slot_kind, slot_off, slot_cs, t_out, t_fac, t_coef, out, out_off, out_cs, out_kind, n, v)
