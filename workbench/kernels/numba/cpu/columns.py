r"""A column permutation of a row-major array, row by row in parallel: :func:`gather_columns`.

:math:`\mathrm{out}[n, i] = x[n, \mathrm{columns}[i]]`. Layout changes between e3nn's mul-major
irrep blocks and the kernels' component-major operands are such permutations (the CPU passes'
channels-last copies, mace's ``reshape_irreps``). torch's ``index_select`` along columns runs
on one thread: at 1,536 atoms of the paper configuration it took 31 ms of a 2-thread MD step,
the same as on one thread. Here each row is gathered from the cache by one thread, with
unsigned 32-bit column numbers (no negative-index wraparound to test per element): a
``[1536, 2048]`` float32 permutation took 0.57 ms on 2 threads against ``index_select``'s
2.48 ms. A copy, so the values are the input's bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

__all__ = ["SERIAL_ELEMENTS", "gather_columns"]

#: below this many elements the gather runs on the calling thread (waking the pool costs more)
SERIAL_ELEMENTS = 1 << 16


@njit(cache=True, nogil=True, inline="always")
def _row(x, columns, out, n):  # pragma: no cover - compiled
    src, dst = x[n], out[n]
    for i in range(columns.size):
        dst[i] = src[uint64(columns[i])]


@njit(cache=True, nogil=True, parallel=True)
def _parallel(x, columns, out):  # pragma: no cover - compiled
    for n in prange(x.shape[0]):
        _row(x, columns, out, n)


@njit(cache=True, nogil=True)
def _serial(x, columns, out):  # pragma: no cover - compiled
    for n in range(x.shape[0]):
        _row(x, columns, out, n)


def gather_columns(x: np.ndarray, columns: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x[:, columns]`` (``x`` ``[rows, width]`` C-contiguous; ``columns`` every entry in
    ``[0, width)``) into ``out`` (a new ``[rows, len(columns)]`` array if ``None``)."""
    if x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError(f"gather_columns takes a C-contiguous 2-d array, got shape {x.shape}")
    if x.shape[1] >= 2**32:
        raise ValueError(f"{x.shape[1]} columns: the column numbers are 32-bit")
    if columns.size and (columns.min() < 0 or columns.max() >= x.shape[1]):
        raise ValueError(f"a column outside [0, {x.shape[1]})")
    columns = columns.astype(np.uint32, copy=False)
    if out is None:
        out = np.empty((x.shape[0], columns.size), dtype=x.dtype)
    elif out.shape != (x.shape[0], columns.size) or out.dtype != x.dtype or out.strides[-1] != out.itemsize:
        raise ValueError(
            f"out must be {x.dtype} [{x.shape[0]}, {columns.size}] with contiguous rows, got {out.dtype} {out.shape}"
        )
    (_serial if x.shape[0] * columns.size < SERIAL_ELEMENTS else _parallel)(x, columns, out)
    return out
