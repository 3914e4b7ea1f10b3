r"""One launch per pass of an atom op: every output of the symmetric contraction's forward,
backward or double backward, in all its parts, from one generated kernel.

A polynomial too large for one thread's registers is split into parts
(:func:`~workbench.kernels.numba.gpu.unrolled.unrolled_parts`: groups of output components, or
runs of terms). Launched one kernel per part, the paper configuration's double backward took
9 launches (d(x) in 5, d(W) in 3, d(d(out))). Here thread (atom :math:`b`, channel :math:`c`)
runs the parts one after another in one kernel:

.. code-block:: python

    def kernel(x0, ..., x9, species, C, out0, out1, out2):
        ...                                   # b, c, the rows and channel offsets, once
        if go:                                # part 0 (a basic block of its own):
            a0v0 = x0_bu[cu16 + U0]           #   its operand components (x0_bu = x0[bu], once),
            a0acc = a0P(a0Z, ((a0v0, ...),))  #   its sums (one generated polynomial),
            out0_bu[cu16 + U3] = a0acc[0]     #   its stores
        if go:                                # part 1: loads again (an L1 hit) ...

Each part's stores may alias the next part's loads (numba declares no ``noalias``), so neither
NVVM nor ptxas moves a load above them: a part's registers are dead before the next begins,
and the kernel needs the registers of its largest part, not of their sum. Runs of terms of
one component (``+=``) follow each other in one thread, so the sum keeps its order. A species
output (weight gradient) is written as per-atom partials and summed per species by
:mod:`~workbench.kernels.numba.gpu.segment`, one more launch each: two launches for the
contraction's backward and double backward, one for its forward.

float64 passes are not fused: their parts take up to 255 registers alone (two a value), and
one kernel of them spilled 1.2 KB (paper backward) to 2.8 KB (double backward) where the parts
launched apart spill at most 32 B. A float32 pass is fused when every live output runs
unrolled (the others are launched apart by the caller). Its parts go into as few kernels as
keep each within ``WORKBENCH_PASS_MAX_TERMS`` terms (default :data:`MAX_KERNEL_TERMS`), which
bounds compile time: one kernel for each pass at the three benchmark configurations (the paper's,
128x0e+128x1o+128x2e and 256x0e+256x1o).
``WORKBENCH_FUSE_PASSES=0`` (:attr:`~workbench.kernels.options.KernelOptions.fuse_passes`) turns fusion off.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

from workbench.kernels.descriptor.tables import TermTable
from workbench.kernels.numba.gpu import segment, unrolled
from workbench.kernels.numba.gpu.unrolled_source import Index
from workbench.kernels.numba.gpu.unrolled_sums import Definitions
from workbench.kernels.options import kernel_options

__all__ = ["FUSED_SCALE", "MAX_KERNEL_TERMS", "kernel_source", "launch", "pass_kernels", "plan"]

#: the float32 register budget of a fused pass's parts, against a part launched alone: the
#: parts share the kernel's row and channel offsets, which stay live from part to part
#: (the paper configuration's backward d(W), 1909 terms into 81 components, takes 254
#: registers alone and spills 8 B after d(x) in one kernel)
FUSED_SCALE = 0.75
#: terms of one fused kernel, which bounds its compile time (one core, numba-cuda 0.30, loads
#: from per-thread row views): the paper configuration's double backward (18,933 terms) in
#: ~6 s, 128x0e+128x1o+128x2e's (62,580 terms in 58 parts) in 35 s
MAX_KERNEL_TERMS = 70_000

Part = tuple[int, TermTable]  # (the output it writes, its term table)


def pass_kernels(compiled: Sequence[Any], dtype: str) -> tuple[tuple[int, ...], tuple[tuple[Part, ...], ...]] | None:
    """``(outputs, kernels)``: the indices of the outputs fused and the parts of each kernel,
    in launch order (consecutive parts while their terms stay within ``WORKBENCH_PASS_MAX_TERMS``,
    default :data:`MAX_KERNEL_TERMS`); None when fewer than two kernels would be fused, and for
    float64. Only outputs that run unrolled are fused (the caller launches the others)."""
    if dtype == "float64":
        return None
    ks, parts = [], []
    for k, comp in enumerate(compiled):
        if comp.num_terms == 0:
            continue
        p = unrolled.unrolled_parts(comp, dtype, scale=FUSED_SCALE if comp.species_output else 1.0)
        if p is not None:
            ks.append(k)
            parts += [(k, t) for t in p]
    if len(parts) < 2:
        return None
    most = kernel_options().pass_max_terms or MAX_KERNEL_TERMS
    kernels: list[list[Part]] = [[]]
    terms = 0
    for part in parts:
        if kernels[-1] and terms + part[1].num_terms > most:
            kernels.append([])
            terms = 0
        kernels[-1].append(part)
        terms += part[1].num_terms
    return tuple(ks), tuple(tuple(g) for g in kernels)


def kernel_source(parts: Sequence[Part], outputs: Sequence[int], dtype: str) -> str:
    """Python source of the kernel running ``parts`` one after another; its output arguments
    ``out0, out1, ...`` are the op's outputs ``outputs``."""
    consts = Definitions(dtype)
    index = Index()
    ind = "    "
    body: list[str] = []
    for n, (k, t) in enumerate(parts):
        # one basic block per part (``go`` is always true): numba's lowering scans a
        # block's statements once per variable it defines, quadratic in the block's size
        lines = unrolled.atom_lines(t, dtype, consts, index, out=f"out{outputs.index(k)}", tag=f"a{n}")
        body += ["if go:"] + [ind + line for line in lines]
    head = unrolled.atom_head(", ".join(f"out{j}" for j in range(len(outputs))))
    lines = head[1:] + index.channel_lines() + index.view_lines() + ["go = C > 0"] + body
    kernel = "\n".join([head[0]] + [ind + line for line in lines]) + "\n"
    return "\n".join(consts.lines() + index.globals()) + "\n\n\n" + kernel


@cache
def _kernel(parts: tuple[Part, ...], outputs: tuple[int, ...], dtype: str) -> Any:
    return unrolled._compile(kernel_source(parts, outputs, dtype))


def plan(
    compiled: Sequence[Any],
    arrays: list,
    species: Any,
    channels: int,
    outs: Sequence[Any],
    kernels: tuple | None = None,
) -> tuple[list[tuple], tuple[int, ...]] | None:
    """``([(kernel, blocks, threads_per_block, args)], fused)``: the fused kernels in launch
    order, where ``outs[k]`` is output ``k``'s array (for a species output, its per-atom
    partials) and ``fused`` the indices of the outputs they compute; None when nothing is fused.
    ``kernels``: :func:`pass_kernels`' answer when the caller has it (computed otherwise)."""
    n = species.shape[0] * channels
    if n == 0:
        return None
    dtype = str(np.dtype(outs[0].dtype))
    pk = pass_kernels(compiled, dtype) if kernels is None else kernels
    if pk is None:
        return None
    ks, kernels = pk
    tpb = unrolled.block_size()
    args = (*arrays, species, channels, *(outs[k] for k in ks))
    return [(_kernel(parts, ks, dtype), (n + tpb - 1) // tpb, tpb, args) for parts in kernels], ks


def launch(
    compiled: Sequence[Any],
    arrays: list,
    species: Any,
    channels: int,
    outs: Sequence[Any],
    partials: Sequence[Any],
    csr: tuple[Any, Any] | None,
    stream: Any = 0,
    kernels: tuple | None = None,
) -> tuple[int, ...]:
    """Launch the fused pass on ``stream``, then one per-species sum of each species output's
    ``partials[k]`` into ``outs[k]``; the indices of the outputs it computed (none when it does
    not apply). ``kernels``: as for :func:`plan`."""
    targets = [p if c.species_output else o for c, o, p in zip(compiled, outs, partials)]
    p = plan(compiled, arrays, species, channels, targets, kernels)
    if p is None:
        return ()
    launches, fused = p
    for kernel, blocks, tpb, args in launches:
        kernel[blocks, tpb, stream](*args)
    for k in fused:
        if compiled[k].species_output:
            s = segment.plan_segment_sum(partials[k], csr[0], csr[1], outs[k])
            if s is not None:
                sk, sb, st, sa = s
                sk[sb, st, stream](*sa)
    return fused
