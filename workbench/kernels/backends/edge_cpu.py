r"""CPU path of the edge (message-passing) sparse polynomials: numba ``njit(parallel=True)``.

Same numerics as the CUDA kernels (:mod:`workbench.kernels.backends.edge_cuda`): for every (edge,
channel) the used operand components are gathered into a small buffer ``v`` (rows of
``"sender"`` / ``"receiver"`` operands picked through the edge's end points, last entry 1 to
pad lower-degree terms), then the terms, sorted by output component, are summed in one scalar
and flushed when the output component changes (:func:`workbench.kernels.backends.cpu.accumulate`).

Race-free without atomics:

* edge outputs (``[num_edges, width]``): parallel over edges, channels in the inner loop, so a
  channel-broadcast output (zero cstride, e.g. the gradient of the spherical harmonics) is
  summed over channels by the one thread that owns the edge;
* node outputs (``[num_nodes, width]``, scatter-sum through the sender or receiver):
  parallel over nodes, each node walking its own CSR segment of incident edges.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from workbench.kernels.backends.cpu import accumulate
from workbench.kernels.backends.gather import pick
from workbench.kernels.descriptor.layout import ROW_CODES

__all__ = ["SERIAL_WORK", "evaluate_edge_cpu", "evaluate_edge_cpu_serial", "run"]

#: below this many term evaluations (rows x channels x terms) the serial loop is used
SERIAL_WORK = 200_000


@njit(cache=True, inline="always")
def _load(v, a0, a1, a2, a3, a4, a5, a6, a7, e, s, r, c, slot_arr, slot_rows, slot_off, slot_cs):
    for q in range(slot_arr.shape[0]):
        code = slot_rows[q]
        row = np.int64(e)  # prange indices may be unsigned: keep every row index int64
        if code == 1:
            row = np.int64(s)
        elif code == 2:
            row = np.int64(r)
        v[q] = pick(a0, a1, a2, a3, a4, a5, a6, a7, a7, a7, slot_arr[q], row, slot_off[q] + c * slot_cs[q])
    v[slot_arr.shape[0]] = 1.0


@njit(cache=True, inline="always")
def _row(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
         slot_arr, slot_rows, slot_off, slot_cs, t_out, t_fac, t_coef, out, out_off, out_cs, out_rows, n, v):
    """All contributions to output row ``n`` (an edge, or a node and its CSR segment)."""
    if out_rows == 0:
        s = sender[n]
        r = receiver[n]
        for c in range(C):
            _load(v, a0, a1, a2, a3, a4, a5, a6, a7, n, s, r, c, slot_arr, slot_rows, slot_off, slot_cs)
            accumulate(v, out, n, c, t_out, t_fac, t_coef, out_off, out_cs)
    else:
        for p in range(seg_ptr[n], seg_ptr[n + 1]):
            e = seg_perm[p]
            s = sender[e]
            r = receiver[e]
            for c in range(C):
                _load(v, a0, a1, a2, a3, a4, a5, a6, a7, e, s, r, c, slot_arr, slot_rows, slot_off, slot_cs)
                accumulate(v, out, n, c, t_out, t_fac, t_coef, out_off, out_cs)


@njit(parallel=True, cache=True)
def evaluate_edge_cpu(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
                      slot_arr, slot_rows, slot_off, slot_cs, t_out, t_fac, t_coef,
                      out, out_off, out_cs, out_rows):
    """Accumulate one compiled edge polynomial into ``out`` (zero-initialised by the caller).

    ``a*``: operand arrays ``[rows, width]`` (edge rows or node rows); ``sender``,
    ``receiver``: ``[num_edges]`` int64; ``seg_ptr`` ``[num_nodes + 1]`` / ``seg_perm``
    ``[num_edges]``: CSR of the edges grouped by the output's node (unused for edge outputs);
    ``out``: ``[num_edges or num_nodes, width]``. Parallel over output rows.
    """
    if t_out.shape[0] == 0:
        return
    rows = sender.shape[0] if out_rows == 0 else seg_ptr.shape[0] - 1
    for n in prange(rows):
        v = np.empty(slot_arr.shape[0] + 1, dtype=out.dtype)
        _row(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
             slot_arr, slot_rows, slot_off, slot_cs, t_out, t_fac, t_coef, out, out_off, out_cs, out_rows, np.int64(n), v)


@njit(cache=True)
def evaluate_edge_cpu_serial(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
                             slot_arr, slot_rows, slot_off, slot_cs, t_out, t_fac, t_coef,
                             out, out_off, out_cs, out_rows):
    """:func:`evaluate_edge_cpu` on one thread: for small problems, where waking numba's thread
    pool costs more (0.5-10 ms on a loaded machine) than the work."""
    if t_out.shape[0] == 0:
        return
    rows = sender.shape[0] if out_rows == 0 else seg_ptr.shape[0] - 1
    v = np.empty(slot_arr.shape[0] + 1, dtype=out.dtype)
    for n in range(rows):
        _row(a0, a1, a2, a3, a4, a5, a6, a7, sender, receiver, seg_ptr, seg_perm, C,
             slot_arr, slot_rows, slot_off, slot_cs, t_out, t_fac, t_coef, out, out_off, out_cs, out_rows, n, v)


def run(comp: Any, arrays: list, sender: np.ndarray, receiver: np.ndarray, seg: tuple | None, channels: int,
        out: np.ndarray) -> None:
    """Evaluate one compiled edge polynomial into ``out``; ``arrays``: the 8 operand arrays
    (dummies where unused), ``seg``: ``(seg_ptr, seg_perm)`` for node outputs, else None."""
    if comp.num_terms == 0:
        return
    empty = np.zeros(1, dtype=np.int64)
    ptr, perm = seg if seg is not None else (empty, empty)
    work = sender.shape[0] * channels * comp.num_terms
    fn = evaluate_edge_cpu_serial if work < SERIAL_WORK else evaluate_edge_cpu
    t = comp.host_tables(str(out.dtype))
    fn(*arrays, sender, receiver, ptr, perm, channels, *t[:7], out, t[7], t[8], ROW_CODES[comp.out_rows])
