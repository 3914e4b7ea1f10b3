"""The NequIP family for :func:`~workbench.kernels.accelerate`: its hot op (the message's
``TensorProductScatter``), how it goes to the workbench kernels and back.

Registered in :mod:`workbench.kernels.registry` as ``"nequip"``; the functions are the adapter
protocol (:class:`~workbench.kernels.registry.ModelAdapter`). cuEquivariance and
OpenEquivariance are nequip's own modifiers (``enable_CuEquivariance``,
``enable_OpenEquivariance``), so this adapter converts to nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workbench.kernels.nequip import tp_scatter

__all__ = ["OPS", "accelerated", "convert", "matches", "model_ops", "to_native", "to_workbench"]

#: the ops this family can swap
OPS: tuple[str, ...] = ("channelwise_tp",)


def _sites(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if tp_scatter.is_native(m) or tp_scatter.is_workbench(m)]


def matches(model: torch.nn.Module) -> bool:
    """A module tree holding nequip's ``TensorProductScatter`` (ours or nequip's class)."""
    return bool(_sites(model))


def to_workbench(model: torch.nn.Module, ops: Sequence[str], backend: str) -> None:
    """Every ``TensorProductScatter`` onto descriptor ``backend``: all checked first, then swapped."""
    if "channelwise_tp" not in ops:
        return
    sites = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TensorProductScatter")]
    for name, m in sites:
        tp_scatter.check(m, name or type(model).__name__)
    for _, m in sites:
        tp_scatter.swap(m, backend)


def to_native(model: torch.nn.Module, ops: Sequence[str]) -> None:
    """Back to nequip's e3nn modules, in place."""
    if "channelwise_tp" in ops:
        for _, m in _sites(model):
            if tp_scatter.is_workbench(m):
                tp_scatter.unswap(m)


def accelerated(model: torch.nn.Module) -> dict[str, bool]:
    return {"channelwise_tp": any(tp_scatter.is_workbench(m) for _, m in _sites(model))}


def convert(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    raise ValueError(
        f"nequip models convert to {backend!r} with nequip's own modifiers "
        "(enable_CuEquivariance, enable_OpenEquivariance), not through accelerate()"
    )


def model_ops(model: torch.nn.Module) -> list:
    """An :class:`~workbench.kernels.launches.OpSite` per accelerated ``TensorProductScatter``."""
    from workbench.kernels.launches import OpSite

    out = []
    for name, m in _sites(model):
        if tp_scatter.is_workbench(m):
            op = m.channelwise_op()[0]
            out.append(OpSite(name, op, op.channels))
    return out
