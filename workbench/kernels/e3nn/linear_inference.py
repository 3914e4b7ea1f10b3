r"""e3nn's ``o3.Linear`` with frozen weights (MD, inference): the map and its transpose as one
autograd function, :func:`apply_frozen`.

With the weights frozen, the only gradient is the input's, and it is the same map transposed:

.. math::

    y_o[n, w, m] = \sum_{i \to o} \alpha_{io} \sum_u x_i[n, u, m]\, W_{io}[u, w], \qquad
    \bar x_i[n, u, m] = \sum_{i \to o} \alpha_{io} \sum_w W_{io}[u, w]\, \bar y_o[n, w, m]

Per irrep dimension ``d`` (a :class:`~workbench.kernels.e3nn.linear.DimensionGroup`), the
group's input blocks (``[N, mul, d]``, mul-major as e3nn stores them) are gathered
component-major into one ``[N d, M_in]`` buffer (one copy; none for ``d = 1``), multiplied by
the group's ``[M_in, M_out]`` block matrix (its transpose going back), and each output block is
written mul-major straight into its columns of the result (one strided copy). Autograd's form of
the same map (a ``split``, transposes, a concatenation of the groups and a reordering gather,
each differentiated in turn) copies every row three to five times each way. The backward calls
this function transposed, so derivatives of every order in the input work (gradgradcheck).
Shapes: ``x`` ``[N, dim_in]`` -> ``[N, dim_out]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workbench.kernels.rowwise import batch_as_rows

__all__ = ["apply_frozen", "grouped_map"]


def _gathered(x: torch.Tensor, places: Sequence[tuple[int, int, int]], d: int, width: int) -> torch.Tensor:
    """``[N d, width]``: the blocks at ``places`` of ``x``, component-major, side by side."""
    n = x.shape[0]
    if len(places) == 1 and places[0][1] == width:
        column, mul, _ = places[0]
        block = x[:, column : column + mul * d]
        return block if d == 1 else block.view(n, mul, d).transpose(1, 2).reshape(n * d, mul)
    covered = sum(mul for _, mul, _ in places) == width  # the plans' blocks tile their rows
    out = x.new_empty(n, d, width) if covered else x.new_zeros(n, d, width)
    for column, mul, row in places:
        out[:, :, row : row + mul].copy_(x[:, column : column + mul * d].view(n, mul, d).transpose(1, 2))
    return out.view(n * d, width)


def grouped_map(
    x: torch.Tensor, blocks: torch.Tensor, groups: Sequence[Any], dim_out: int, transpose: bool
) -> torch.Tensor:
    """``[N, dim_out]``: the linear map of ``groups`` with flat block matrices ``blocks`` applied
    to ``x`` ``[N, dim_in]`` (``transpose``: the transposed map, from outputs back to inputs)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, written = x.shape[0], 0
    out = x.new_empty(n, dim_out)
    for g in groups:
        ins, outs, m_in, m_out = (g.outs, g.ins, g.m_out, g.m_in) if transpose else (g.ins, g.outs, g.m_in, g.m_out)
        w = blocks[g.offset : g.offset + g.m_in * g.m_out].view(g.m_in, g.m_out)
        y = (_gathered(x, ins, g.d, m_in) @ (w.t() if transpose else w)).view(n, g.d, m_out)
        for column, mul, row in outs:
            out[:, column : column + mul * g.d].view(n, mul, g.d).copy_(y[:, :, row : row + mul].transpose(1, 2))
            written += mul * g.d
    if written < dim_out:  # columns no block reaches (outputs without inputs; unused inputs going back)
        return _with_zeros(out, groups, transpose)
    return out


def _with_zeros(out: torch.Tensor, groups: Sequence[Any], transpose: bool) -> torch.Tensor:
    """``out`` with every column no group writes set to zero."""
    keep = torch.zeros(out.shape[1], dtype=torch.bool, device=out.device)
    for g in groups:
        for column, mul, _ in g.ins if transpose else g.outs:
            keep[column : column + mul * g.d] = True
    return out.masked_fill_(~keep, 0.0)


class _Frozen(torch.autograd.Function):
    """``x -> grouped_map(x)``; its backward and its forward-mode derivative are the transposed and
    the same map, each this function again. Under ``vmap`` (mace's Hessians batch the second
    backward) the batch becomes more rows: the map acts on each row alone."""

    @staticmethod
    def forward(x, blocks, groups, dims, transpose):
        return grouped_map(x, blocks, groups, dims[0] if transpose else dims[1], transpose)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        blocks, groups, dims, transpose = ctx.args
        return _Frozen.apply(grad, blocks, groups, dims, not transpose), None, None, None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        blocks, groups, dims, transpose = ctx.args
        return _Frozen.apply(x_t, blocks, groups, dims, transpose)

    @staticmethod
    def vmap(info, in_dims, x, blocks, groups, dims, transpose):
        if in_dims[1] is not None:
            raise ValueError("a frozen linear's weights cannot be batched under vmap")
        return batch_as_rows(_Frozen.apply, in_dims[0], x, blocks, groups, dims, transpose)


def apply_frozen(
    x: torch.Tensor, blocks: torch.Tensor, groups: Sequence[Any], dim_in: int, dim_out: int
) -> torch.Tensor:
    """``[N, dim_out]``: the map of a plan's ``groups`` (:class:`~workbench.kernels.e3nn.linear.DimensionGroup`)
    with their flat block matrices ``blocks`` (no gradient taken) applied to ``x`` ``[N, dim_in]``,
    differentiable in ``x`` to any order."""
    return _Frozen.apply(x, blocks.detach(), tuple(groups), (dim_in, dim_out), False)
