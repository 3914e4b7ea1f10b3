r"""MACE's channelwise ("uvu") tensor product and scatter-sum as one sparse edge polynomial
(paper §4.1.1, Algorithm 2).

In every mace-torch interaction block the message is ``scatter_sum(conv_tp(h[sender], Y, R),
receiver)``: an e3nn ``TensorProduct`` of weighted ``"uvu"`` instructions (node features
``h``, spherical harmonics ``Y``, radial weights ``R``). Gather, product and scatter are one
:class:`~workbench.kernels.ops.EdgePolyOp` of only the non-zero Clebsch-Gordan terms, built by
:func:`workbench.kernels.e3nn.tp.channelwise_tp_op` (the math is there).

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

import torch

from workbench.kernels.class_swap import CACHE
from workbench.kernels.e3nn.tp import ChannelwiseOpCache, channelwise_tp_op
from workbench.kernels.lazy_class import LazyClass
from workbench.kernels.ops import edge_poly_op
from workbench.kernels.registry import DEFAULT_BACKEND
from workbench.kernels.tabulated_edge import TabulatedWeights, tabulated_edge_op

__all__ = [
    "SUPPORTED_INTERACTION_BLOCKS",
    "FusedChannelwiseTensorProduct",  # noqa: F822  (built on first access by the module __getattr__)
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


def _e3nn_tp_class():
    from e3nn import o3

    return o3.TensorProduct


def _make_fused_class():
    TP = _e3nn_tp_class()

    class FusedChannelwiseTensorProduct(ChannelwiseOpCache, TP):
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
            backend = self.__dict__.get("kernel_backend", DEFAULT_BACKEND)
            if isinstance(weight, TabulatedWeights):
                outs = tabulated_edge_op(op, edge_index[0], edge_index[1], x.shape[0], x, y, weight, backend=backend)
                if outs is not None:
                    return outs[0]
                weight = weight.values()
            (out,) = edge_poly_op(op, edge_index[0], edge_index[1], x.shape[0], x, y, weight, backend=backend)
            return out

    return FusedChannelwiseTensorProduct


# built on first use so that importing workbench.kernels does not import e3nn; pickles
# refer to ``workbench.kernels.mace.channelwise_tp.FusedChannelwiseTensorProduct``
_fused_class = LazyClass(globals(), "FusedChannelwiseTensorProduct", _make_fused_class)
__getattr__ = _fused_class.module_getattr


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
    tp.__dict__.pop(CACHE, None)
    tp.__dict__.pop("kernel_backend", None)
    if getattr(block, "conv_fusion", None) == _FUSION_TAG:
        del block.conv_fusion
    return True
