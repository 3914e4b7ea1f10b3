r"""NequIP's ``TensorProductScatter`` on the workbench kernels, in place.

``TensorProductScatter.forward(x, edge_attr, edge_weight, edge_dst, edge_src)`` computes

.. math::

    \mathrm{out}[r] = \sum_{e:\, \mathrm{dst}_e = r} \mathrm{TP}(x[\mathrm{src}_e], Y_e, W_e)

with ``x`` ``[num_nodes, irreps_in1.dim]``, ``edge_attr`` (:math:`Y`) ``[num_edges,
irreps_in2.dim]`` and ``edge_weight`` (:math:`W`) ``[num_edges, weight_numel]``; the output is
``[num_nodes, irreps_out.dim]``. :class:`WorkbenchTensorProductScatter` is nequip's class
with that forward as one :class:`~workbench.kernels.ops.EdgePolyOp`
(:func:`~workbench.kernels.e3nn.tp.channelwise_tp_op`), differentiable to any order. Modules
get it by ``__class__`` assignment (:data:`SWAP`, a :class:`~workbench.kernels.class_swap.ClassSwap`):
the same object, so parameters, buffers (persistent or not), ``state_dict`` keys and the
module's ``model_dtype`` stay nequip's.
"""

from __future__ import annotations

import torch

from workbench.kernels.class_swap import ClassSwap
from workbench.kernels.e3nn.tp import ChannelwiseOpCache, channelwise_tp_op
from workbench.kernels.lazy_class import LazyClass
from workbench.kernels.nequip.companions import COMPANIONS
from workbench.kernels.ops import EdgePolyOp, edge_poly_op
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["SWAP", "WorkbenchTensorProductScatter", "is_native", "is_workbench"]  # noqa: F822 (module __getattr__)


def _make_class() -> type:
    class WorkbenchTensorProductScatter(ChannelwiseOpCache, SWAP.native()):
        """nequip's ``TensorProductScatter`` whose forward runs the workbench's edge polynomial."""

        def forward(self, x, edge_attr, edge_weight, edge_dst, edge_src):
            backend = self.__dict__.get("kernel_backend", DEFAULT_BACKEND)
            op = self.channelwise_op()[0]
            (out,) = edge_poly_op(op, edge_src, edge_dst, x.shape[0], x, edge_attr, edge_weight, backend=backend)
            return out

        def channelwise_tp_module(self) -> torch.nn.Module:
            return self.tp

    return WorkbenchTensorProductScatter


def _check(m: torch.nn.Module) -> None:
    channelwise_tp_op(m.tp)  # refuses instructions the polynomial does not describe (unequal multiplicities)


def _site(m: torch.nn.Module) -> tuple[EdgePolyOp, int]:
    op = m.channelwise_op()[0]
    return op, op.channels


# the subclass is built on first use: importing workbench.kernels does not import nequip
SWAP = ClassSwap(
    "channelwise_tp",
    "nequip.nn._tp_scatter_base.TensorProductScatter",
    LazyClass(globals(), "WorkbenchTensorProductScatter", _make_class),
    "nequip's e3nn TensorProductScatter",
    "nequip's own modifiers (enable_CuEquivariance, enable_OpenEquivariance)",
    _check,
    _site,
    companions=COMPANIONS,  # nequip's modules around the hot op
)
__getattr__ = SWAP.ours.module_getattr
is_native, is_workbench = SWAP.is_native, SWAP.is_ours
