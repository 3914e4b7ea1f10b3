r"""numba-CUDA kernel for a compiled sparse polynomial (one fused launch per output).

One thread per (atom, channel); consecutive threads take consecutive channels of one atom.
Each thread gathers the operand components its polynomial uses into its own row of a
shared-memory buffer (rows padded to an odd length so a warp reading the same slot hits 32
different banks), then walks the term table, which every thread of a warp reads at the same
address (a broadcast), accumulating one output component at a time in a register. Nothing
intermediate goes to global memory: all correlation orders of the contraction (and all
terms of a derivative) are one pass. Species outputs (weight gradients) are written as
per-atom partial rows and summed per species in a fixed order by
:mod:`~workbench.kernels.numba.gpu.segment`: no atomics, bit-reproducible.

Torch tensors are handed over without copies through ``__cuda_array_interface__``
(``numba.cuda.as_cuda_array``) and launched on torch's current stream. Kernels are compiled
once per (buffer length, threads per block, dtype) and cached; term tables are uploaded once
per device and cached on the compiled polynomial.

``numba.cuda`` is imported lazily so that ``NUMBA_ENABLE_CUDASIM=1`` can be set first. Under
the simulator the same kernels run on numpy arrays (see ``WORKBENCH_KERNELS_CUDASIM``).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from workbench.kernels.descriptor.layout import MAX_ATOM_ARRAYS
from workbench.kernels.numba.gather import cuda_pick
from workbench.kernels.numba.gpu import segment, unrolled
from workbench.kernels.numba.gpu.device import cuda_available, cudasim_enabled, threads_per_block

__all__ = ["cuda_available", "cudasim_enabled", "get_kernel", "launch", "plans", "writes_every_element"]

cuda = None  # numba.cuda, bound on first use (after NUMBA_ENABLE_CUDASIM is read)


@cache
def get_kernel(buffer_len: int, tpb: int, dtype: str, degree: int = 4) -> Any:
    """The fused table kernel for one configuration, compiled on first launch and cached.

    Lean by construction (the static review counted ~190 SASS instructions per term in the
    first version, 5 of them floating point): tables in 8/16/32-bit unsigned integers
    (:meth:`CompiledPolynomial.lean_tables`), every index unsigned 64-bit so numba emits no
    negative-index fix-ups, and the factors of a term in a flat array walked by a loop of
    ``degree`` (a compile-time constant) that LLVM unrolls."""
    import numba

    global cuda  # a module global: the simulator swaps the kernel's global ``cuda`` for its fake
    from numba import cuda

    nb_dtype = numba.float64 if dtype == "float64" else numba.float32
    SP = buffer_len if buffer_len % 2 == 1 else buffer_len + 1  # odd row stride: no bank conflicts
    return _table_kernel(nb_dtype, SP, tpb, cuda_pick(), numba.uint64, np.uint64(degree), np.uint64(MAX_ATOM_ARRAYS))


def _table_kernel(nb_dtype: Any, SP: int, TPB: int, pick: Any, u64: Any, D: np.uint64, NA: np.uint64) -> Any:
    """The table kernel with its compile-time constants (:func:`get_kernel`) as closure variables."""

    def sparse_poly_kernel(
        a0, a1, a2, a3, a4, a5, s0, s1, s2, s3, species, C,
        slot_src, slot_off, slot_cs, t_out, t_fac, t_coef, out, out_off, out_cs,
    ):  # fmt: skip
        v = cuda.shared.array((TPB, SP), nb_dtype)
        tid = u64(cuda.threadIdx.x)
        gid = u64(cuda.blockIdx.x) * u64(cuda.blockDim.x) + tid
        n = u64(C)
        if gid >= u64(species.shape[0]) * n:
            return
        b = gid // n
        c = gid - b * n
        z = u64(species[b])
        S = u64(slot_src.shape[0])
        for s in range(S):
            src = slot_src[s]
            row = b if src < NA else z
            v[tid, s] = pick(a0, a1, a2, a3, a4, a5, s0, s1, s2, s3, src, row, u64(slot_off[s]) + c * u64(slot_cs[s]))
        v[tid, S] = 1.0
        cur = t_out[0]
        acc = nb_dtype(0.0)  # typed zero: a bare 0.0 would make float32 kernels accumulate in float64
        base = u64(0)
        for t in range(u64(t_out.shape[0])):
            o = t_out[t]
            if o != cur:
                out[b, u64(out_off[cur]) + c * u64(out_cs[cur])] += acc
                acc = nb_dtype(0.0)
                cur = o
            p = t_coef[t]
            for j in range(D):
                p *= v[tid, t_fac[base + j]]
            acc += p
            base += D
        out[b, u64(out_off[cur]) + c * u64(out_cs[cur])] += acc

    return cuda.jit(sparse_poly_kernel)


def plans(compiled: Any, arrays: list, species: Any, channels: int, out: Any, host: bool = False) -> list[tuple]:
    """``[(kernel, blocks, threads_per_block, args)]`` for one compiled polynomial: the generated
    kernel of each part (:func:`workbench.kernels.numba.gpu.unrolled.unrolled_parts`), or the one
    table-driven kernel; empty when there is nothing to do.

    ``arrays``: the 10 operand arrays (6 atom + 4 species slots, dummies where unused) as numba
    device arrays (numpy arrays under the simulator or for PTX compilation); ``out``: the
    ``[num_atoms, width]`` output, for a species output the per-atom partials that
    :func:`launch` then sums per species (zero-initialised unless :func:`writes_every_element`);
    ``host``: table arguments as host arrays (for PTX compilation).
    """
    n = species.shape[0] * channels
    if compiled.num_terms == 0 or n == 0:
        return []
    dtype = str(np.dtype(out.dtype))
    parts = unrolled.unrolled_parts(compiled, dtype)
    if parts is not None:
        tpb = unrolled.block_size()
        return [
            (
                unrolled.get_unrolled_kernel(t, "atom", dtype),
                (n + tpb - 1) // tpb,
                tpb,
                (*arrays, species, channels, out),
            )
            for t in parts
        ]
    itemsize = np.dtype(out.dtype).itemsize
    buffer_len = compiled.num_slots + 1
    tpb = threads_per_block(buffer_len + (buffer_len + 1) % 2, itemsize)
    kernel = get_kernel(buffer_len, tpb, dtype, compiled.degree)
    t = compiled.lean_tables(dtype, device=not host)
    args = (*arrays, species, channels, *t[:6], out, t[6], t[7])
    return [(kernel, (n + tpb - 1) // tpb, tpb, args)]


def writes_every_element(compiled: Any, dtype: str) -> bool:
    """Whether the atom kernels :func:`plans` picks store every element of its ``[num_atoms, width]``
    output (the unrolled kernel, every component reached by a term), so it needs no zero fill."""
    return unrolled.unroll(compiled, dtype) and compiled.covers_output


def launch(
    compiled: Any,
    arrays: list,
    species: Any,
    channels: int,
    out: Any,
    stream: Any = 0,
    partial: Any = None,
    csr: tuple | None = None,
) -> None:
    """Launch one compiled polynomial on ``stream`` (see :func:`plans`). A species output is two
    launches: the atom kernel into ``partial`` ``[num_atoms, width]``, then the per-species sum
    through ``csr = (ptr, perm)`` into ``out`` ``[num_species, width]``."""
    for kernel, blocks, tpb, args in plans(
        compiled, arrays, species, channels, partial if compiled.species_output else out
    ):
        kernel[blocks, tpb, stream](*args)
    if compiled.species_output:  # always: it writes every element of ``out``, zeros included
        s = segment.plan_segment_sum(partial, csr[0], csr[1], out)
        if s is not None:
            kernel, blocks, tpb, args = s
            kernel[blocks, tpb, stream](*args)
