"""The one operand gather of the table-driven kernels, compiled for the CPU and for CUDA.

Kernels take their operand arrays as separate arguments (numba cannot index a tuple of
arrays by a run-time value), so a slot's array is picked by an ``if`` chain over its kernel
array number ``src``. Atom kernels pass their 6 atom and 4 species arrays, edge kernels their
8 arrays and the last one twice more (``src <= 7`` there).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from numba import njit

from workbench.kernels.options import numba_simulator

__all__ = ["cuda_edge_loader", "cuda_pick", "cuda_split", "cuda_term", "pick", "pick_py"]


def pick_py(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, src, row, k):
    """``x{src}[row, k]``."""
    if src == 0:
        return x0[row, k]
    elif src == 1:
        return x1[row, k]
    elif src == 2:
        return x2[row, k]
    elif src == 3:
        return x3[row, k]
    elif src == 4:
        return x4[row, k]
    elif src == 5:
        return x5[row, k]
    elif src == 6:
        return x6[row, k]
    elif src == 7:
        return x7[row, k]
    elif src == 8:
        return x8[row, k]
    return x9[row, k]


#: :func:`pick_py` for the numba CPU kernels
pick = njit(cache=True, inline="always")(pick_py)


def _device(fn):
    """``fn`` as an inlined CUDA device function. Under numba's simulator, the plain Python
    function: the simulator calls it ~2.5x faster than an emulated device function, and the
    simulator tests run every kernel thread in Python."""
    if numba_simulator():
        return fn
    from numba import cuda

    return cuda.jit(device=True, inline="always")(fn)


@cache
def cuda_pick() -> Any:
    """:func:`pick_py` as a CUDA device function, inlined into every kernel that calls it."""
    return _device(pick_py)


@cache
def cuda_split() -> Any:
    """Device function ``(gid, n) -> (gid // n, gid % n)``: a thread's row and its index in the row."""

    def split(gid, n):
        q = gid // n
        return q, gid - q * n

    return _device(split)


@cache
def cuda_edge_loader() -> Any:
    """Device function filling row ``tid`` of the shared buffer ``v`` with the used operand
    components of edge ``e`` (sender ``s``, receiver ``r``) in channel ``c``."""
    pick = cuda_pick()

    def load(v, tid, a0, a1, a2, a3, a4, a5, a6, a7, e, s, r, c, slot_arr, slot_rows, slot_off, slot_cs):
        for q in range(slot_arr.shape[0]):
            code = slot_rows[q]
            row = e if code == 0 else (s if code == 1 else r)
            v[tid, q] = pick(a0, a1, a2, a3, a4, a5, a6, a7, a7, a7, slot_arr[q], row, slot_off[q] + c * slot_cs[q])

    return _device(load)


@cache
def cuda_term() -> Any:
    """Device function: term ``t`` of a table, ``t_coef[t] * prod_j v[tid, t_fac[t, j]]``."""

    def term(v, tid, t_coef, t_fac, t):
        prod = t_coef[t]
        for j in range(t_fac.shape[1]):
            prod *= v[tid, t_fac[t, j]]
        return prod

    return _device(term)
