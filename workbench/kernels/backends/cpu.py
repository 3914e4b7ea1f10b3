r"""CPU path: numba ``njit(parallel=True)`` evaluation of a compiled sparse polynomial.

Same numerics as the CUDA kernels (:mod:`workbench.kernels.backends.cuda`): for every (row, channel)
the used operand components are gathered into a small buffer ``v`` (last entry 1, which pads
terms of lower degree), then terms, sorted by output component, are accumulated in one scalar
and flushed when the output component changes. Atom outputs are parallel over atoms; species
outputs (weight gradients, a reduction over atoms) are parallel over channels, so no two
threads ever write the same element and no atomics are needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from workbench.kernels.backends.gather import pick
from workbench.kernels.descriptor.layout import MAX_ATOM_ARRAYS

__all__ = ["accumulate", "evaluate_cpu", "run"]


@njit(cache=True, inline="always")
def _load(v, a0, a1, a2, a3, a4, a5, s0, s1, s2, s3, b, z, c, slot_src, slot_off, slot_cs):
    for s in range(slot_src.shape[0]):
        src = slot_src[s]
        row = np.int64(b) if src < MAX_ATOM_ARRAYS else np.int64(z)  # prange indices may be unsigned
        v[s] = pick(a0, a1, a2, a3, a4, a5, s0, s1, s2, s3, src, row, slot_off[s] + c * slot_cs[s])
    v[slot_src.shape[0]] = 1.0


@njit(cache=True, inline="always")
def accumulate(v, out, row, c, t_out, t_fac, t_coef, out_off, out_cs):
    T = t_out.shape[0]
    D = t_fac.shape[1]
    cur = t_out[0]
    acc = t_coef[0] * 0.0  # typed zero of the compute dtype
    for t in range(T):
        o = t_out[t]
        if o != cur:
            out[row, out_off[cur] + c * out_cs[cur]] += acc
            acc = t_coef[0] * 0.0
            cur = o
        p = t_coef[t]
        for j in range(D):
            p *= v[t_fac[t, j]]
        acc += p
    out[row, out_off[cur] + c * out_cs[cur]] += acc


@njit(parallel=True, cache=True)
def evaluate_cpu(a0, a1, a2, a3, a4, a5, s0, s1, s2, s3, species, C,
                 slot_src, slot_off, slot_cs, t_out, t_fac, t_coef,
                 out, out_off, out_cs, species_output):
    """Accumulate one compiled polynomial into ``out`` (zero-initialised by the caller).

    ``a*``: atom operands ``[num_atoms, width]``; ``s*``: species operands
    ``[num_species, width]``; ``species``: ``[num_atoms]`` int64; ``out``: ``[num_atoms, width]``
    or, if ``species_output``, ``[num_species, width]``.
    """
    B = species.shape[0]
    S = slot_src.shape[0]
    if t_out.shape[0] == 0:
        return
    if not species_output:
        for b in prange(B):
            v = np.empty(S + 1, dtype=out.dtype)
            z = species[b]
            for c in range(C):
                _load(v, a0, a1, a2, a3, a4, a5, s0, s1, s2, s3, b, z, c, slot_src, slot_off, slot_cs)
                accumulate(v, out, b, c, t_out, t_fac, t_coef, out_off, out_cs)
    else:
        for c in prange(C):
            v = np.empty(S + 1, dtype=out.dtype)
            for b in range(B):
                z = species[b]
                _load(v, a0, a1, a2, a3, a4, a5, s0, s1, s2, s3, b, z, c, slot_src, slot_off, slot_cs)
                accumulate(v, out, z, c, t_out, t_fac, t_coef, out_off, out_cs)


def run(comp: Any, arrays: list, species: np.ndarray, channels: int, out: np.ndarray) -> None:
    """Evaluate one compiled atom polynomial (:class:`~workbench.kernels.backends.compiled.CompiledPolynomial`)
    into ``out``; ``arrays``: the 10 operand arrays (dummies where unused)."""
    if comp.num_terms == 0:
        return
    t = comp.host_tables(str(out.dtype))
    evaluate_cpu(*arrays, species, channels, t[0], t[2], t[3], t[4], t[5], t[6], out, t[7], t[8], comp.species_output)
