r"""The self-connection when its scalars take few distinct rows: one matrix per group of rows.

The self-connection of :mod:`~workbench.kernels.e3nn.scalar_tp` is bilinear,

.. math::

    y[n, o] = \sum_{v, i} s[n, v]\, x[n, i]\, T[v, i, o],

with :math:`T[v]` the ``[dim_in1, dim_out]`` matrix of scalar channel :math:`v` (every path's
weights times its factor, each repeated over the irrep's components). Rows with equal scalars
share one matrix :math:`M_g = \sum_v s_g[v]\, T[v]`. NequIP's scalars are the species
embedding, so a batch has as many distinct rows :math:`G` as species, and the map is

* ``C = s_g @ W`` (``[G, K] x [K, R]``: ``W`` the weights as ``[K, R]``, ``R`` the distinct
  ``(input block, output block, u, w)`` entries), spread into ``M`` (``[G, I * O]``) by a gather;
* ``x @ M`` (``[N, I] x [I, G * O]``) and a gather of each row's group.

A constant handful of calls whatever the number of paths, and no ``[N d, M_in K]`` outer product
(NequIP's tutorial layer 1, one species: forward and the features' gradient 0.6 ms by the outer
product, most of it in calls). The plan (:class:`GroupedPlan`) is used when ``G`` is at most
:attr:`GroupedPlan.max_groups` (no more multiply-adds than the outer product).

Groups are found by exact equality (:func:`row_groups`, on the CPU: a GPU runs the outer
product), so values are the outer product's to rounding. Derivatives (:class:`GroupedScalarTP`):

* without a graph (an MD step's forces, a plain ``backward``): the features' gradient through
  ``M``, the weights' through per-group sums, the scalars' per row (each row's own gradient,
  not its group's), each only when the run uses it;
* with a graph (``create_graph``: force training): the outer-product form, differentiated by
  autograd, so every order is exact per row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numba import njit

from workbench.kernels.e3nn.linear import WeightMap, column_index, take_columns
from workbench.kernels.rows import same_tensor, tensor_key

__all__ = ["GroupedPlan", "GroupedScalarTP", "RowGroups", "grouped_plan", "row_groups", "shared_row_groups"]


@dataclass(frozen=True)
class RowGroups:
    """Rows grouped by equal values: ``inverse`` ``[N]`` the group of each row, ``first`` ``[G]`` a
    row of each group."""

    inverse: torch.Tensor
    first: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.first.shape[0])


@njit(cache=True)
def _row_hashes(bits: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled by numba
    """FNV-1a over each row's words: equal bits, equal hash (exact, unlike a float projection,
    whose rounding may depend on where the row falls in a blocked product)."""
    out = np.empty(bits.shape[0], dtype=np.uint64)
    for i in range(bits.shape[0]):
        h = np.uint64(14695981039346656037)
        for j in range(bits.shape[1]):
            h = (h ^ np.uint64(bits[i, j])) * np.uint64(1099511628211)
        out[i] = h
    return out


def row_groups(s: torch.Tensor) -> RowGroups | None:
    """The groups of equal rows of CPU float tensor ``s`` ``[N, K]`` (by their bits), or None for
    no rows, a value that equals nothing (NaN), a tensor elsewhere than the CPU or of another dtype."""
    n = s.shape[0]
    if n == 0 or s.shape[1] == 0 or s.device.type != "cpu":
        return None
    if s.dtype not in (torch.float32, torch.float64):
        return None
    with torch.no_grad():
        s = s.detach().contiguous()
        words = s.numpy().view(np.uint32 if s.dtype == torch.float32 else np.uint64)
        hashes = torch.from_numpy(_row_hashes(words).view(np.int64))
        keys, inverse = torch.unique(hashes, return_inverse=True)
        rows = torch.arange(n)
        first = torch.full((keys.shape[0],), n, dtype=rows.dtype).scatter_reduce_(0, inverse, rows, "amin")
        groups = RowGroups(inverse, first)
        return groups if _holds(groups, s) else None  # two rows on one hash, or NaN: the outer product


def _holds(groups: RowGroups, s: torch.Tensor) -> bool:
    """Whether every row of ``s`` equals its group's first row."""
    with torch.no_grad():
        s = s.detach()
        return torch.equal(s.index_select(0, groups.first).index_select(0, groups.inverse), s)


_LAST = threading.local()


def shared_row_groups(s: torch.Tensor, max_groups: int) -> RowGroups | None:
    """:func:`row_groups` when there are at most ``max_groups``, else None; found once for the
    layers of one step: a model's self-connections all take the same species embedding, and the
    last grouping on this thread is kept while the same tensor, unmodified, comes again. A kept
    grouping is checked against the rows again (one comparison): a change through ``.data``
    keeps the version."""
    key = tensor_key(s)
    last = getattr(_LAST, "value", None)
    if last is not None and same_tensor(last[0], key) and (last[1] is None or _holds(last[1], s)):
        groups = last[1]
    else:
        groups = row_groups(s)
        _LAST.value = (key, groups)
    return groups if groups is not None and groups.size <= max_groups else None


@dataclass(frozen=True)
class GroupedPlan:
    """``weights``: the flat weights as ``W`` ``[K, R]`` (times the path factors);
    ``spread``: ``[I * O]`` column of ``C`` (``R``: zero) of each entry of ``M``, over the
    ``I`` input columns some path reads (``cols_in``) and the ``O`` output columns some path
    writes (``cols_out``; ``dim_out`` in all); ``entry_in``, ``entry_out``, ``entry_r``: every
    non-zero entry of ``M`` (for the scalars' gradient); ``max_groups``: the most groups worth
    this form."""

    weights: WeightMap
    spread: torch.Tensor
    entry_in: torch.Tensor
    entry_out: torch.Tensor
    entry_r: torch.Tensor
    cols_in: torch.Tensor | slice
    cols_out: torch.Tensor | slice
    k: int
    r: int
    dim_in: int
    dim_out: int
    max_groups: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(I, O)``: the used input and output columns."""
        return self.spread.shape[0] // max(self.width_out, 1), self.width_out

    @property
    def width_out(self) -> int:
        c = self.cols_out
        return c.stop - c.start if isinstance(c, slice) else int(c.shape[0])


def _path_entries(p: Any, out_start: int, base: int) -> tuple[np.ndarray, ...]:
    """One path's ``(v, r, weight index)`` of every weight and ``(x column, out column, r)`` of
    every entry of ``M``, in the order ``u, w, v`` and ``u, w, m``; ``r = base + u * mul_out + w``."""
    u = np.arange(p.mul_in)[:, None, None]
    w = np.arange(p.mul_out)[None, :, None]
    v = np.arange(p.mul_s)[None, None, :]
    r = base + u * p.mul_out + w
    src = p.start + (u * p.mul_s + v) * p.mul_out + w
    weights = (np.broadcast_to(p.s_cols.start + v, src.shape), np.broadcast_to(r, src.shape), src)
    m = np.arange(p.d)[None, None, :]
    x_col, out_col = p.x_cols.start + u * p.d + m, out_start + w * p.d + m
    shape = np.broadcast_shapes(x_col.shape, out_col.shape)
    entries = tuple(np.broadcast_to(a, shape) for a in (x_col, out_col, r))
    return *(a.ravel() for a in weights), *(a.ravel() for a in entries)


def grouped_plan(
    paths: Sequence[Any], out_at: Sequence[int], dim_in: int, k: int, num_weights: int, device: torch.device
) -> GroupedPlan:
    """The :class:`GroupedPlan` of the self-connection ``paths`` (``out_at``: output irrep
    offsets; ``k`` scalar channels), its tensors on ``device``. Columns ``r`` are numbered by
    (input block, output block) in path order, ``u * mul_out + w`` inside one (paths between the
    same blocks share them); built with numpy (MACE-MP-0's 89 elements: 1.5 M weights)."""
    bases: dict[tuple[int, int], int] = {}
    parts, outer_macs, r_count = [], 0, 0
    for p in paths:
        outer_macs += p.d * p.mul_in * p.mul_s * p.mul_out
        key = (p.x_cols.start, out_at[p.out])
        if key not in bases:
            bases[key], r_count = r_count, r_count + p.mul_in * p.mul_out
        parts.append(_path_entries(p, out_at[p.out], bases[key]))
    columns = list(zip(*parts)) or [()] * 6  # a product without paths: empty columns
    v, r_w, src, x_col, out_col, r_e = (np.concatenate(c) if c else np.zeros(0, np.int64) for c in columns)
    factor = np.concatenate([np.full(p.mul_in * p.mul_out * p.mul_s, p.factor) for p in paths] or [np.zeros(0)])
    weights = WeightMap.of_arrays(k * r_count, num_weights, v * r_count + r_w, src, factor, device)
    _, first = np.unique(x_col * (int(out_col.max(initial=0)) + 1) + out_col, return_index=True)
    keep = np.sort(first)  # each entry of M once, in the order the paths reach it
    used_in, used_out = np.unique(x_col), np.unique(out_col)
    ins, outs, rs = np.searchsorted(used_in, x_col[keep]), np.searchsorted(used_out, out_col[keep]), r_e[keep]
    spread = torch.full((len(used_in) * len(used_out),), r_count, dtype=torch.long)
    spread[torch.as_tensor(ins * len(used_out) + outs)] = torch.as_tensor(rs, dtype=torch.long)
    as_long = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long, device=device)  # noqa: E731
    max_groups = outer_macs // max(len(used_in) * len(used_out), 1)
    index = (spread.to(device), as_long(ins), as_long(outs), as_long(rs))
    cols = (column_index(used_in.tolist(), device), column_index(used_out.tolist(), device))
    return GroupedPlan(weights, *index, *cols, k, r_count, dim_in, out_at[-1], max_groups)


def _matrices(plan: GroupedPlan, sg: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``M`` ``[G, I, O]`` of the groups' scalars ``sg`` ``[G, K]``: ``C = sg @ W`` over the scalar
    channels some group holds (a one-hot species row: MACE-MP-0's 89 elements, a few present;
    gathering all of ``W``, 1.5 M weights, cost more than the map at a few hundred atoms)."""
    used = torch.nonzero(sg.ne(0).any(0)).flatten()
    if used.shape[0] * 2 > plan.k:
        return _spread(plan, sg @ plan.weights.matrix(weight).view(plan.k, plan.r))
    return _spread(plan, sg.index_select(1, used) @ plan.weights.rows(weight, used, plan.r))


def _spread(plan: GroupedPlan, c: torch.Tensor) -> torch.Tensor:
    """``M`` ``[G, I, O]`` of the groups' ``C`` ``[G, R]``."""
    m = torch.cat((c, c.new_zeros(c.shape[0], 1)), 1).index_select(1, plan.spread)
    return m.view(-1, *plan.shape)


def _put_columns(part: torch.Tensor, cols: torch.Tensor | slice, width: int) -> torch.Tensor:
    """``[N, width]`` zeros with ``part`` at columns ``cols`` (``part`` itself when it is all of them)."""
    if isinstance(cols, slice) and cols.start == 0 and cols.stop == width:
        return part
    out = part.new_zeros(part.shape[0], width)
    if isinstance(cols, slice):
        out[:, cols] = part
        return out
    return out.index_copy_(1, cols, part)


def _by_group(rows: torch.Tensor, m: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """``[N, J]``: each row of ``rows`` ``[N, I]`` times its group's ``m[g]`` ``[I, J]``."""
    if groups.size == 1:
        return rows @ m[0]
    n, g, j = rows.shape[0], m.shape[0], m.shape[2]
    out = (rows @ m.permute(1, 0, 2).reshape(m.shape[1], g * j)).view(n, g, j)
    return out.gather(1, groups.inverse.view(n, 1, 1).expand(n, 1, j)).view(n, j)


def _weight_grad(plan: GroupedPlan, groups: RowGroups, x, gout, sg, num_weights: int) -> torch.Tensor:
    """The flat weights' gradient: per group :math:`x_g^T \\bar{y}_g`, back through ``M``, ``C`` and ``W``."""
    if groups.size == 1:
        dm = (x.t() @ gout).view(1, -1)
    else:
        onehot = torch.nn.functional.one_hot(groups.inverse, groups.size).to(x.dtype)  # [N, G]
        per = (x.unsqueeze(2) * onehot.unsqueeze(1)).reshape(x.shape[0], -1).t() @ gout  # [I * G, O]
        dm = per.view(plan.shape[0], groups.size, plan.shape[1]).transpose(0, 1).reshape(groups.size, -1)
    dc = dm.new_zeros(groups.size, plan.r + 1).index_add_(1, plan.spread, dm)[:, : plan.r]
    dw = (sg.t() @ dc).reshape(-1) * plan.weights.scale_as(x.dtype)
    return dw.new_zeros(num_weights + 1).index_add_(0, plan.weights.gather, dw)[:num_weights]


def _grads(ctx, gout: torch.Tensor, needed: Sequence[bool]) -> list[torch.Tensor | None]:
    """The gradients of ``(x, s, weight)`` that are ``needed``, without a graph."""
    x, s, weight = ctx.saved_tensors
    plan, groups = ctx.plan, ctx.groups
    x, gout = take_columns(x, plan.cols_in), take_columns(gout, plan.cols_out)
    sg = s.index_select(0, groups.first)
    gx = None
    if needed[0]:
        gx = _put_columns(
            _by_group(gout, _matrices(plan, sg, weight).transpose(1, 2), groups), plan.cols_in, plan.dim_in
        )
    gs = None
    if needed[1]:  # each row's own: sum over M's entries of x[n, i] gout[n, o], per column of W
        prod = x.index_select(1, plan.entry_in) * gout.index_select(1, plan.entry_out)
        a = prod.new_zeros(x.shape[0], plan.r).index_add_(1, plan.entry_r, prod)
        gs = a @ plan.weights.matrix(weight).view(plan.k, plan.r).t()
    gw = _weight_grad(plan, groups, x, gout, sg, weight.shape[0]) if needed[2] else None
    return [gx, gs, gw]


class GroupedScalarTP(torch.autograd.Function):
    """``y = GroupedScalarTP.apply(plan, groups, outer, x, s, weight)``: the map by its groups'
    matrices; ``outer(x, s, weight)`` is the outer-product form, which a backward with a graph
    differentiates instead (module docstring)."""

    @staticmethod
    def forward(
        ctx,
        plan: GroupedPlan,
        groups: RowGroups,
        outer: Callable,
        x: torch.Tensor,
        s: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        ctx.plan, ctx.groups, ctx.outer = plan, groups, outer
        ctx.save_for_backward(x, s, weight)
        m = _matrices(plan, s.index_select(0, groups.first), weight)
        return _put_columns(_by_group(take_columns(x, plan.cols_in), m, groups), plan.cols_out, plan.dim_out)

    @staticmethod
    def backward(ctx, gout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from workbench.kernels.ops import used_inputs

        needed = used_inputs(ctx, 3)
        if not any(needed):
            return (None,) * 6
        if torch.is_grad_enabled():  # create_graph: the outer-product form, exact to every order
            x, s, weight = ctx.saved_tensors
            inputs = [t for t, k in zip((x, s, weight), needed) if k]
            got = list(torch.autograd.grad(ctx.outer(x, s, weight), inputs, gout, create_graph=True, allow_unused=True))
            grads = [got.pop(0) if k else None for k in needed]
        else:
            grads = _grads(ctx, gout.contiguous(), needed)
        return (None, None, None, *grads)
