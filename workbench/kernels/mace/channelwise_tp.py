r"""MACE's channelwise ("uvu") tensor product and scatter-sum as one sparse edge polynomial
(paper §4.1.1, Algorithm 2).

In every mace-torch interaction block the message to receiver :math:`r` is

.. math::

    M[r, u, (k, m_3)] = \sum_{e: r_e = r} \alpha_k \, R[e, k, u]
        \sum_{m_1 m_2} C^{l_1 l_2 l_3}_{m_1 m_2 m_3} \, h[s_e, u, (i_1^k, m_1)] \, Y[e, (i_2^k, m_2)]

for every instruction :math:`k = (i_1, i_2, i_3)` of ``conv_tp`` (``"uvu"``: channel :math:`u`
of the sender features :math:`h` (irrep :math:`l_1`) times the spherical harmonics :math:`Y`
(irrep :math:`l_2`, one copy) into channel :math:`u` of output irrep :math:`l_3`), with
:math:`C` e3nn's ``wigner_3j(l1, l2, l3)``, :math:`\alpha_k` the instruction's normalised
``path_weight`` and :math:`R` ``tp_weights`` ``[num_edges, weight_numel]`` (``R[e, k, u]`` at
column ``offset_k + u``). Shapes: ``h`` ``[num_nodes, irreps_in1.dim]``, ``Y``
``[num_edges, irreps_in2.dim]``, ``M`` ``[num_nodes, irreps_out.dim]`` (e3nn ``mul_ir``
layout everywhere). e3nn computes ``conv_tp(h[sender], Y, R)`` into an
``[num_edges, irreps_out.dim]`` tensor and ``scatter_sum`` s it; here gather, product and
scatter are one :class:`~workbench.kernels.ops.EdgePolyOp` whose terms are only the
non-zero :math:`\alpha_k C_{m_1 m_2 m_3}`.

Drop-in: :func:`fuse_conv_tp` uses mace's own fused-convolution hook. Every interaction block
of mace-torch 0.3.16 runs ``message = self.conv_tp(node_feats, edge_attrs, tp_weights,
edge_index)`` (gather + TP + scatter) when it has a ``conv_fusion`` attribute (the path mace
uses for cuEquivariance / openequivariance). We switch the ``conv_tp`` *object* to the subclass
:class:`FusedChannelwiseTensorProduct` of e3nn's ``TensorProduct`` (``__class__`` assignment:
same object, same buffers, same ``state_dict`` keys, e3nn's own pickling) whose ``forward``
accepts that 4-argument call, and set ``block.conv_fusion``. The rest of the block (linear,
division by ``avg_num_neighbors``, skip connection, ghost truncation) stays mace's code, so the
swap is exact for every block class with the hook; :func:`unfuse_conv_tp` reverts both.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.kernels.descriptor import Operand, SparsePolynomial
from workbench.kernels.ops import EdgeGraph, EdgePolyOp, apply_edge_poly_op

__all__ = [
    "SUPPORTED_INTERACTION_BLOCKS",
    "ChannelwiseTPStats",
    "FusedChannelwiseTensorProduct",  # noqa: F822  (built on first access by the module __getattr__)
    "channelwise_tp_op",
    "channelwise_tp_polynomial",
    "fuse_conv_tp",
    "unfuse_conv_tp",
]

#: mace-torch 0.3.16 interaction blocks whose ``forward`` takes the fused ``conv_tp`` path
#: (``if hasattr(self, "conv_fusion"): message = self.conv_tp(node_feats, edge_attrs, tp_weights, edge_index)``)
SUPPORTED_INTERACTION_BLOCKS: tuple[str, ...] = (
    "RealAgnosticInteractionBlock",
    "RealAgnosticResidualInteractionBlock",
    "RealAgnosticDensityInteractionBlock",
    "RealAgnosticDensityResidualInteractionBlock",
    "RealAgnosticAttResidualInteractionBlock",
    "RealAgnosticResidualNonLinearInteractionBlock",
)
_FUSION_TAG = "workbench-numba"

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


def _e3nn_tp_class():
    from e3nn import o3

    return o3.TensorProduct


def _make_fused_class():
    TP = _e3nn_tp_class()

    class FusedChannelwiseTensorProduct(TP):
        r"""e3nn ``TensorProduct`` whose 4-argument call is the fused message op.

        ``forward(x, y, weight, edge_index)``: ``x`` ``[num_nodes, irreps_in1.dim]`` node
        features, ``y`` ``[num_edges, irreps_in2.dim]`` spherical harmonics, ``weight``
        ``[num_edges, weight_numel]`` radial weights, ``edge_index`` ``[2, num_edges]`` (sender,
        receiver) -> ``[num_nodes, irreps_out.dim]``
        :math:`= \mathrm{scatter\_sum}(\mathrm{TP}(x[\mathrm{sender}], y, w), \mathrm{receiver})`
        through the sparse kernels (CUDA on GPU tensors, numba CPU otherwise), differentiable
        to any order. Called with three arguments it is e3nn's per-edge ``TensorProduct``.
        Objects get this class by ``__class__`` assignment (:func:`fuse_conv_tp`), so buffers,
        ``state_dict`` keys and pickling are e3nn's.
        """

        def forward(self, x, y, weight=None, edge_index=None):
            if edge_index is None:
                return super().forward(x, y, weight)
            op, _ = self.channelwise_op()
            graph = EdgeGraph(edge_index, x.shape[0])
            (out,) = apply_edge_poly_op(op, graph, x, y, weight, backend=self.__dict__.get("kernel_backend", "numba"))
            return out

        def channelwise_op(self):
            if self.__dict__.get("_wb_op") is None:
                self.__dict__["_wb_op"] = channelwise_tp_op(self)
            return self.__dict__["_wb_op"]

        def channelwise_stats(self) -> ChannelwiseTPStats:
            return self.channelwise_op()[1]

        def __getstate__(self):
            state = super().__getstate__()
            state = dict(state)
            state.pop("_wb_op", None)  # rebuilt from the instructions after loading
            return state

    FusedChannelwiseTensorProduct.__module__ = __name__
    FusedChannelwiseTensorProduct.__qualname__ = "FusedChannelwiseTensorProduct"
    return FusedChannelwiseTensorProduct


_FUSED_LOCK = threading.Lock()


def _fused_class():
    with _FUSED_LOCK:
        if "FusedChannelwiseTensorProduct" not in globals():
            globals()["FusedChannelwiseTensorProduct"] = _make_fused_class()
        return globals()["FusedChannelwiseTensorProduct"]


def __getattr__(name: str):
    # built on first use so that importing workbench.kernels does not import e3nn; pickles
    # refer to ``workbench.kernels.mace.channelwise_tp.FusedChannelwiseTensorProduct``
    if name == "FusedChannelwiseTensorProduct":
        return _fused_class()
    raise AttributeError(name)


def _check_block(block: torch.nn.Module) -> None:
    from mace.modules.blocks import InteractionBlock

    name = type(block).__name__
    if not isinstance(block, InteractionBlock) or name not in SUPPORTED_INTERACTION_BLOCKS:
        raise TypeError(
            f"accelerate(ops=('channelwise_tp',)): interaction block class {type(block).__module__}.{name} "
            f"is not supported (supported: {', '.join(SUPPORTED_INTERACTION_BLOCKS)}); "
            "use ops=('symmetric_contraction',) for this model"
        )


def _is_interaction_block(m: torch.nn.Module) -> bool:
    # anything that owns a conv_tp the way mace's interaction blocks do
    return hasattr(m, "conv_tp") and isinstance(m.conv_tp, torch.nn.Module) and hasattr(m, "conv_tp_weights")


def fuse_conv_tp(block: torch.nn.Module) -> bool:
    """Switch one mace interaction block to the fused message op, in place. Returns True when
    it was switched, False when it already was; raises ``TypeError`` naming the class for
    blocks or ``conv_tp`` modules that are not supported."""
    Fused = _fused_class()
    tp = block.conv_tp
    if isinstance(tp, Fused):
        return False
    _check_block(block)
    if type(tp) is not _e3nn_tp_class():
        raise TypeError(
            f"accelerate(ops=('channelwise_tp',)): {type(block).__name__}.conv_tp is a {type(tp).__module__}."
            f"{type(tp).__name__}, not e3nn's o3.TensorProduct (cuEquivariance / openequivariance "
            "models: convert back to e3nn first)"
        )
    if hasattr(block, "conv_fusion"):
        raise TypeError(f"{type(block).__name__} already has conv_fusion={block.conv_fusion!r}")
    channelwise_tp_op(tp)  # validates the instructions before anything is changed
    tp.__class__ = Fused
    block.conv_fusion = _FUSION_TAG
    return True


def unfuse_conv_tp(block: torch.nn.Module) -> bool:
    """Revert :func:`fuse_conv_tp` (same object back to e3nn's class, ``conv_fusion`` removed)."""
    Fused = _fused_class()
    tp = block.conv_tp
    if not isinstance(tp, Fused):
        return False
    tp.__class__ = _e3nn_tp_class()
    tp.__dict__.pop("_wb_op", None)
    tp.__dict__.pop("kernel_backend", None)
    if getattr(block, "conv_fusion", None) == _FUSION_TAG:
        del block.conv_fusion
    return True
