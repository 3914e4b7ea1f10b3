r"""Deterministic segmented sum on CUDA: the second stage of every reduction over atoms.

A species output (the weight gradient of the symmetric contraction) is a sum over the atoms
of each species. Adding into ``[num_species, width]`` with atomics from every (atom, channel)
thread is racy in order, so float sums differ from run to run. Instead the atom kernel writes
one row per atom (a partial ``P [num_atoms, width]``, no atomics), and this kernel sums the
rows of each species in ascending atom order:

.. math::

    \mathrm{out}[z, j] = \sum_{p = \mathrm{ptr}[z]}^{\mathrm{ptr}[z+1] - 1} P[\mathrm{perm}[p], j]

A block takes one species and 32 consecutive columns; its 8 warps are row lanes: lane ``l``
sums rows ``ptr[z] + l, ptr[z] + l + 8, ...`` in ascending order (a warp reads 32 consecutive
columns of one row, coalesced), then lane 0 adds the 8 lane sums in lane order. One thread per
(species, column) summing every row alone left most of the GPU idle where a batch holds few
species (a water box: 2, so 2 x width threads, each walking ~1,500 rows one after another):
the H100 profile of a 3072-atom step gave the six species sums 2.0 ms of the 12 ms in workbench
kernels. ``(ptr, perm)`` is the species CSR (:meth:`workbench.kernels.ops.SpeciesIndex.csr`),
built on the device without a host sync. Every element of ``out`` is written, so it needs no
zero fill. The order of additions is fixed: the same inputs give the same bits on every run.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from workbench.kernels.options import kernel_options

__all__ = ["COLUMNS", "LANES", "THREADS_PER_BLOCK", "get_segment_sum_kernel", "lanes", "plan_segment_sum"]

#: columns per block: a warp reads 32 consecutive columns of one row
COLUMNS = 32
#: row lanes per column: lane l sums every LANES-th row of a segment, from its l-th
LANES = 8
THREADS_PER_BLOCK = COLUMNS * LANES
cuda = None  # numba.cuda, bound on first use (after NUMBA_ENABLE_CUDASIM is read)


def lanes() -> int:
    """Row lanes per column: :data:`LANES`; 1 under the simulator (it runs every thread in Python,
    and the other tests launch many sums), unless ``WORKBENCH_SEGMENT_LANES`` says otherwise."""
    from workbench.kernels.numba.gpu.device import cudasim_enabled

    return kernel_options().segment_lanes or (1 if cudasim_enabled() else LANES)


@cache
def get_segment_sum_kernel(dtype: str, L: int = LANES) -> Any:
    """``segment_sum(partial, ptr, perm, out)`` for ``dtype`` with ``L`` row lanes (compiled on
    first launch); launched on ``num_segments * ceil(width / COLUMNS)`` blocks of
    ``COLUMNS * L`` threads."""
    import numba

    global cuda
    from numba import cuda

    nb_dtype = numba.float64 if dtype == "float64" else numba.float32
    C = COLUMNS

    @cuda.jit
    def segment_sum(partial, ptr, perm, out):
        lanes = cuda.shared.array((L, C), nb_dtype)
        tid = cuda.threadIdx.x
        lane = tid // C
        col = tid - lane * C
        width = out.shape[1]
        tiles = (width + C - 1) // C
        z = cuda.blockIdx.x // tiles
        j = (cuda.blockIdx.x - z * tiles) * C + col
        acc = nb_dtype(0.0)  # typed zero: a bare 0.0 would accumulate float32 in float64
        if j < width:
            for p in range(ptr[z] + lane, ptr[z + 1], L):
                acc += partial[perm[p], j]
        lanes[lane, col] = acc
        cuda.syncthreads()
        if lane == 0 and j < width:
            total = lanes[0, col]
            for k in range(1, L):
                total += lanes[k, col]
            out[z, j] = total

    return segment_sum


def plan_segment_sum(partial: Any, ptr: Any, perm: Any, out: Any) -> tuple | None:
    """``(kernel, blocks, threads_per_block, args)`` summing ``partial``'s rows per segment into ``out``."""
    import numpy as np

    segments, width = out.shape[0], out.shape[1]
    if segments * width == 0:
        return None
    L = lanes()
    kernel = get_segment_sum_kernel(str(np.dtype(out.dtype)), L)
    return kernel, segments * ((width + COLUMNS - 1) // COLUMNS), COLUMNS * L, (partial, ptr, perm, out)
