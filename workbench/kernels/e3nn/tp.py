r"""An e3nn ``TensorProduct`` of weighted ``"uvu"`` instructions, fused with the gather of its
first input at the sender and the scatter-sum of its output to the receiver, as one sparse edge
polynomial. Model-agnostic: MACE's interaction blocks (:mod:`workbench.kernels.mace`) and
NequIP's ``TensorProductScatter`` (:mod:`workbench.kernels.nequip`) both run it.

.. math::

    M[r, u, (k, m_3)] = \sum_{e: r_e = r} \alpha_k \, W[e, k, u]
        \sum_{m_1 m_2} C^{l_1 l_2 l_3}_{m_1 m_2 m_3} \, x[s_e, u, (i_1^k, m_1)] \, Y[e, (i_2^k, m_2)]

for every instruction :math:`k = (i_1, i_2, i_3)`: channel :math:`u` of the sender features
:math:`x` (irrep :math:`l_1`) times the edge attributes :math:`Y` (irrep :math:`l_2`, one copy)
into channel :math:`u` of output irrep :math:`l_3`, with :math:`C` e3nn's ``wigner_3j``,
:math:`\alpha_k` the instruction's normalised ``path_weight`` (e3nn 0.4 and 0.6 alike) and
:math:`W` the per-edge weights ``[num_edges, weight_numel]`` (``W[e, k, u]`` at column
``offset_k + u``). Only the non-zero :math:`\alpha_k C_{m_1 m_2 m_3}` become terms.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.kernels.class_swap import KeepsOp
from workbench.kernels.descriptor import Operand, SparsePolynomial
from workbench.kernels.ops import EdgePolyOp

__all__ = ["ChannelwiseOpCache", "ChannelwiseTPStats", "channelwise_tp_op", "channelwise_tp_polynomial"]

_OP_CACHE: dict = {}
_OP_CACHE_LOCK = threading.Lock()


@dataclass
class ChannelwiseTPStats:
    r"""Sparsity of the coupling: ``dense`` = :math:`\sum_k (2l_1+1)(2l_2+1)(2l_3+1)` CG entries
    a dense per-path contraction touches, ``nonzero`` = non-zero ones (= terms per channel and
    edge of the forward polynomial); ``per_instruction``: ``(l1, l2, l3, dense, nonzero)``."""

    dense: int
    nonzero: int
    terms: int
    per_instruction: list = field(default_factory=list)

    @property
    def nonzero_fraction(self) -> float:
        return self.nonzero / max(self.dense, 1)


def _irreps_layout(irreps, channels: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Per-channel component offsets / cstrides in e3nn's ``mul_ir`` layout, and per block
    ``(first component, dim)``."""
    offsets, cstrides, blocks = [], [], []
    start = 0
    comp = 0
    for mul, ir in irreps:
        if mul != channels:
            raise ValueError(f"channelwise TP needs {channels} channels in every irrep, got {irreps}")
        blocks.append((comp, ir.dim))
        for m in range(ir.dim):
            offsets.append(start + m)
            cstrides.append(ir.dim)
        start += mul * ir.dim
        comp += ir.dim
    return offsets, cstrides, blocks


def _edge_irreps_layout(irreps) -> tuple[list[tuple[int, int]], int]:
    """Per irrep of the spherical harmonics (one copy each, broadcast over channels) ``(first
    component, dim)``, and the number of components."""
    blocks, comp = [], 0
    for mul, ir in irreps:
        if mul != 1:
            raise ValueError(f"channelwise TP needs one copy of each edge irrep, got {irreps}")
        blocks.append((comp, ir.dim))
        comp += ir.dim
    return blocks, comp


def _check_instruction(k: int, ins, channels: int) -> None:
    """Refuse an instruction the channelwise polynomial does not describe: not weighted ``"uvu"``,
    or a path shape other than ``(channels, 1)``."""
    if ins.connection_mode != "uvu" or not ins.has_weight:
        raise ValueError(f"instruction {k}: only weighted 'uvu' instructions are supported, got {ins}")
    if tuple(ins.path_shape) != (channels, 1):
        raise ValueError(f"instruction {k}: path shape {ins.path_shape} != ({channels}, 1)")


def channelwise_tp_polynomial(
    irreps_in1, irreps_in2, irreps_out, instructions: Sequence
) -> tuple[SparsePolynomial, ChannelwiseTPStats]:
    r"""Sparse edge polynomial of an e3nn ``TensorProduct`` with ``"uvu"`` instructions, fused
    with the gather of ``in1`` at the sender and the scatter-sum of the output to the receiver.

    Parameters
    ----------
    irreps_in1, irreps_in2, irreps_out : e3nn ``Irreps`` of the ``TensorProduct`` (``in1`` and
        ``out`` with the same multiplicity :math:`C` everywhere, ``in2`` with multiplicity 1)
    instructions : the ``TensorProduct.instructions`` (e3nn ``Instruction`` with normalised
        ``path_weight`` and ``path_shape``), all ``"uvu"`` with weights

    Returns
    -------
    (polynomial, stats). Operands: ``x`` (``"sender"``, ``[num_nodes, in1.dim]``), ``Y``
    (``"edge"``, ``[num_edges, in2.dim]``, broadcast over channels), ``W`` (``"edge"``,
    ``[num_edges, weight_numel]``); output ``out`` (``"receiver"``, ``[num_nodes, out.dim]``).
    """
    from e3nn import o3

    irreps_in1, irreps_in2, irreps_out = o3.Irreps(irreps_in1), o3.Irreps(irreps_in2), o3.Irreps(irreps_out)
    if len(irreps_in1) == 0 or len(irreps_out) == 0:
        raise ValueError("empty irreps")
    C = irreps_in1[0].mul
    x_off, x_cs, x_blocks = _irreps_layout(irreps_in1, C)
    o_off, o_cs, o_blocks = _irreps_layout(irreps_out, C)
    y_blocks, comp = _edge_irreps_layout(irreps_in2)
    w_off = []
    off = 0
    terms = []
    dense = nonzero = 0
    per_ins = []
    for k, ins in enumerate(instructions):
        _check_instruction(k, ins, C)
        w_off.append(off)
        off += C
        l1, l2, l3 = irreps_in1[ins.i_in1].ir.l, irreps_in2[ins.i_in2].ir.l, irreps_out[ins.i_out].ir.l
        cg = o3.wigner_3j(l1, l2, l3, dtype=torch.float64).numpy()
        (a1, _), (a2, _), (a3, _) = x_blocks[ins.i_in1], y_blocks[ins.i_in2], o_blocks[ins.i_out]
        nz = np.argwhere(cg != 0.0)
        for i, j, m in nz:
            terms.append(
                (a3 + int(m), [(0, a1 + int(i)), (1, a2 + int(j)), (2, k)], float(ins.path_weight) * float(cg[i, j, m]))
            )
        dense += cg.size
        nonzero += len(nz)
        per_ins.append((l1, l2, l3, int(cg.size), len(nz)))
    x = Operand("x", len(x_off), "sender", tuple(x_off), tuple(x_cs), irreps_in1.dim)
    Y = Operand("Y", comp, "edge", tuple(range(comp)), (0,) * comp, irreps_in2.dim)
    W = Operand("W", len(w_off), "edge", tuple(w_off), (1,) * len(w_off), off)
    out = Operand("out", len(o_off), "receiver", tuple(o_off), tuple(o_cs), irreps_out.dim)
    poly = SparsePolynomial.from_terms((x, Y, W), out, terms)
    return poly, ChannelwiseTPStats(dense, nonzero, poly.num_terms, per_ins)


def channelwise_tp_op(tp: torch.nn.Module) -> tuple[EdgePolyOp, ChannelwiseTPStats]:
    """The (cached) :class:`EdgePolyOp` of an e3nn ``TensorProduct``; shared by every module
    with the same irreps and instructions, so derivatives are derived once."""
    ins = tuple(
        (i.i_in1, i.i_in2, i.i_out, i.connection_mode, i.has_weight, float(i.path_weight), tuple(i.path_shape))
        for i in tp.instructions
    )
    key = (str(tp.irreps_in1), str(tp.irreps_in2), str(tp.irreps_out), ins)
    with _OP_CACHE_LOCK:
        if key not in _OP_CACHE:
            poly, stats = channelwise_tp_polynomial(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, tp.instructions)
            _OP_CACHE[key] = (EdgePolyOp(poly.operands, [poly]), stats)
        return _OP_CACHE[key]


class ChannelwiseOpCache(KeepsOp):
    """Mixin for a module that runs an e3nn ``TensorProduct``'s channelwise op: the op is built
    once per object (from ``channelwise_tp_module()``, the module itself by default) and never
    pickled, since it is rebuilt from the instructions after loading."""

    def channelwise_tp_module(self) -> torch.nn.Module:
        return self

    def channelwise_op(self) -> tuple[EdgePolyOp, ChannelwiseTPStats]:
        return self.cached_op(lambda: channelwise_tp_op(self.channelwise_tp_module()))

    def channelwise_stats(self) -> ChannelwiseTPStats:
        return self.channelwise_op()[1]
