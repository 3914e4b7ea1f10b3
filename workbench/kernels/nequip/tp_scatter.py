r"""NequIP's ``TensorProductScatter`` on the workbench kernels, in place.

``TensorProductScatter.forward(x, edge_attr, edge_weight, edge_dst, edge_src)`` computes

.. math::

    \mathrm{out}[r] = \sum_{e:\, \mathrm{dst}_e = r} \mathrm{TP}(x[\mathrm{src}_e], Y_e, W_e)

with ``x`` ``[num_nodes, irreps_in1.dim]``, ``edge_attr`` (:math:`Y`) ``[num_edges,
irreps_in2.dim]`` and ``edge_weight`` (:math:`W`) ``[num_edges, weight_numel]``; the output is
``[num_nodes, irreps_out.dim]``. :class:`WorkbenchTensorProductScatter` is nequip's class
with that forward as one :class:`~workbench.kernels.ops.EdgePolyOp`
(:func:`~workbench.kernels.e3nn_tp.channelwise_tp_op`), differentiable to any order. Modules
get it by ``__class__`` assignment: the same object, so parameters, buffers (persistent or
not), ``state_dict`` keys and the module's ``model_dtype`` stay nequip's; :func:`unswap`
assigns nequip's class back.
"""

from __future__ import annotations

import torch

from workbench.kernels.e3nn_tp import ChannelwiseOpCache, channelwise_tp_op
from workbench.kernels.lazy_class import LazyClass
from workbench.kernels.ops import EdgeGraph, apply_edge_poly_op

__all__ = ["WorkbenchTensorProductScatter", "is_native", "swap", "unswap"]  # noqa: F822 (module __getattr__)


def _native_class() -> type:
    from nequip.nn._tp_scatter_base import TensorProductScatter

    return TensorProductScatter


def _make_class() -> type:
    class WorkbenchTensorProductScatter(ChannelwiseOpCache, _native_class()):
        """nequip's ``TensorProductScatter`` whose forward runs the workbench's edge polynomial."""

        def forward(self, x, edge_attr, edge_weight, edge_dst, edge_src):
            graph = EdgeGraph(torch.stack((edge_src, edge_dst)), x.shape[0])
            backend = self.__dict__.get("kernel_backend", "numba")
            (out,) = apply_edge_poly_op(self.channelwise_op()[0], graph, x, edge_attr, edge_weight, backend=backend)
            return out

        def channelwise_tp_module(self) -> torch.nn.Module:
            return self.tp

    return WorkbenchTensorProductScatter


# built on first use: importing workbench.kernels does not import nequip
_workbench_class = LazyClass(globals(), "WorkbenchTensorProductScatter", _make_class)
__getattr__ = _workbench_class.module_getattr


def is_native(m: torch.nn.Module) -> bool:
    """``m`` is exactly nequip's e3nn ``TensorProductScatter`` (not ours, nor a cuEquivariance one)."""
    try:
        return type(m) is _native_class()
    except ImportError:
        return False


def is_workbench(m: torch.nn.Module) -> bool:
    try:
        return isinstance(m, _workbench_class())
    except ImportError:
        return False


def check(m: torch.nn.Module, name: str) -> None:
    """Refuse, naming the module, one the workbench cannot run: another library's subclass, or
    instructions the channelwise polynomial does not describe (e.g. ``num_features`` that differ
    between irreps)."""
    if is_native(m) or is_workbench(m):
        try:
            channelwise_tp_op(m.tp)
        except ValueError as exc:
            raise TypeError(f"{name} ({type(m).__name__}): {exc}") from None
        return
    raise TypeError(
        f"{name} is a {type(m).__module__}.{type(m).__name__}, not nequip's e3nn TensorProductScatter "
        "(a model with the cuEquivariance or OpenEquivariance modifier applied: build it without)"
    )


def swap(m: torch.nn.Module, backend: str) -> None:
    """``m`` (nequip's class, checked) runs on the workbench kernels of ``backend`` from now on."""
    m.__class__ = _workbench_class()
    m.kernel_backend = backend


def unswap(m: torch.nn.Module) -> None:
    """Back to nequip's class; same object, same parameters."""
    m.__class__ = _native_class()
    m.__dict__.pop("_wb_op", None)
    m.__dict__.pop("kernel_backend", None)
