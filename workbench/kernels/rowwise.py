"""The ``vmap`` rule of an autograd function that acts on each row of a ``[rows, width]`` input
alone (a frozen linear map, a column permutation): the batch becomes more rows.

mace's Hessians batch a second backward with ``torch.vmap``; a function whose forward runs
outside torch (numba) or writes into slices of a new tensor has no batching rule of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["batch_as_rows"]


def batch_as_rows(apply: Callable[..., torch.Tensor], in_dim: int, x: torch.Tensor, *args) -> tuple[torch.Tensor, int]:
    """``(apply(x as rows, *args) shaped back, 0)``: ``x`` batched along ``in_dim``, its last axis
    the row width; for an ``autograd.Function``'s ``vmap`` staticmethod."""
    x = x.movedim(in_dim, 0)
    out = apply(x.reshape(-1, x.shape[-1]), *args)
    return out.reshape(*x.shape[:-1], out.shape[-1]), 0
