r"""Deterministic segmented sum on CUDA: the second stage of every reduction over atoms.

A species output (the weight gradient of the symmetric contraction) is a sum over the atoms
of each species. Adding into ``[num_species, width]`` with atomics from every (atom, channel)
thread is racy in order, so float sums differ from run to run. Instead the atom kernel writes
one row per atom (a partial ``P [num_atoms, width]``, no atomics), and this kernel sums the
rows of each species in ascending atom order:

.. math::

    \mathrm{out}[z, j] = \sum_{p = \mathrm{ptr}[z]}^{\mathrm{ptr}[z+1] - 1} P[\mathrm{perm}[p], j]

one thread per (species, column), consecutive threads on consecutive columns (coalesced rows of
``P``). ``(ptr, perm)`` is the species CSR (:meth:`workbench.kernels.ops.SpeciesIndex.csr`),
built on the device without a host sync. Every element of ``out`` is written, so it needs no
zero fill. The same inputs give the same bits on every run.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["THREADS_PER_BLOCK", "get_segment_sum_kernel", "plan_segment_sum"]

THREADS_PER_BLOCK = 128
cuda = None  # numba.cuda, bound on first use (after NUMBA_ENABLE_CUDASIM is read)


@lru_cache(maxsize=None)
def get_segment_sum_kernel(dtype: str) -> Any:
    """``segment_sum(partial, ptr, perm, out)`` for ``dtype`` (compiled on first launch)."""
    import numba

    global cuda
    from numba import cuda

    nb_dtype = numba.float64 if dtype == "float64" else numba.float32

    @cuda.jit
    def segment_sum(partial, ptr, perm, out):
        gid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        width = out.shape[1]
        if gid >= out.shape[0] * width:
            return
        z = gid // width
        j = gid - z * width
        acc = nb_dtype(0.0)  # typed zero: a bare 0.0 would accumulate float32 in float64
        for p in range(ptr[z], ptr[z + 1]):
            acc += partial[perm[p], j]
        out[z, j] = acc

    return segment_sum


def plan_segment_sum(partial: Any, ptr: Any, perm: Any, out: Any) -> tuple | None:
    """``(kernel, blocks, threads_per_block, args)`` summing ``partial``'s rows per segment into ``out``."""
    import numpy as np

    n = out.shape[0] * out.shape[1]
    if n == 0:
        return None
    kernel = get_segment_sum_kernel(str(np.dtype(out.dtype)))
    tpb = THREADS_PER_BLOCK
    return kernel, (n + tpb - 1) // tpb, tpb, (partial, ptr, perm, out)
