r"""e3nn's ``o3.Linear`` as one matrix product per irrep dimension, in place.

An equivariant linear map sends each input irrep block :math:`x_i` (``[N, mul_i, d]``) to the
output blocks :math:`o` of the same irrep:

.. math::

    y_o[n, w, m] = \sum_{i \to o} \alpha_{io} \sum_u x_i[n, u, m]\, W_{io}[u, w]

with :math:`W_{io}` ``[mul_i, mul_o]`` the instruction's slice of the flat ``weight`` and
:math:`\alpha_{io}` its path weight. e3nn generates one einsum per instruction and a
concatenation; at a few hundred atoms and 16 channels (NequIP's tutorial models) those calls,
not the arithmetic, are the linear. At MACE's sizes its backward is the cost: each input block
is a ``narrow``, whose gradient is a zero-filled ``[N, dim_in]`` tensor added into the next
(10 of them for a 5,120-wide message at 1,536 atoms: 210 ms of forward and backward). Here the
input is cut by one ``split`` (one concatenation back), and every block of one irrep dimension
:math:`d` goes in one product: the blocks of dimension :math:`d` gathered component-major as
``[N d, M_in]`` (``M_in`` their summed multiplicities: one copy), one ``mm`` with the
``[M_in, M_out]`` matrix of every instruction between them (zero where irreps of one dimension
but different parity meet), turned back to mul-major ``[N, M_out d]``, and the outputs put back
in ``irreps_out`` order by one gather. Few rows make even that too many calls: while
``N * dim_in * dim_out`` stays within :data:`DENSE_MAX_MACS` the map is one ``mm`` with the dense
``[dim_in, dim_out]`` matrix (each block as :math:`W_{io} \otimes I_d`), more multiply-adds and
fewer calls (:class:`DensePlan`). The matrices are built from ``weight`` on every call (one
gather and one product, :class:`WeightMap`: differentiable), so parameters, the state dict and
any optimizer stay e3nn's.
Values agree with e3nn's to rounding.

:data:`SWAP` turns ``e3nn.o3.Linear`` modules with internal, shared weights and no biases into
:class:`WorkbenchLinear` (a companion of a family's hot-op swap); the others stay e3nn's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.kernels.class_swap import ClassSwap, KeepsOp
from workbench.kernels.library import no_sync
from workbench.kernels.options import kernel_options

__all__ = [  # noqa: F822 (module __getattr__)
    "DENSE_MAX_MACS",
    "SWAP",
    "DensePlan",
    "LinearPlan",
    "WeightMap",
    "WorkbenchLinear",
    "apply_dense",
    "apply_plan",
    "column_index",
    "dense_plan",
    "irreps_offsets",
    "linear_plan",
    "take_columns",
]

#: the largest ``rows * dim_in * dim_out`` run as one dense ``mm``: below it the calls saved
#: outweigh the zero blocks multiplied (2 threads, NequIP's tutorial linears: at 256 atoms the
#: dense form took 0.8 ms of forward and backward where e3nn took 2.1 ms)
DENSE_MAX_MACS = 1 << 25


def _gather_weights(weight: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """``weight[gather]``, zero where ``gather == weight.numel()`` (differentiable in ``weight``)."""
    return torch.cat((weight, weight.new_zeros(1))).index_select(0, gather)


@dataclass(frozen=True)
class WeightMap:
    """How a flat ``weight`` fills a flat matrix of ``gather.shape[0]`` entries: entry ``k`` is
    ``weight[gather[k]] * scale[k]``, zero where ``gather[k] == weight.numel()`` (a weight's path
    weight, once per irrep component). One gather and one product a call: an ``index_put`` into
    zeros cost 2-3x as much at NequIP's linears."""

    gather: torch.Tensor
    scale: torch.Tensor  # float64; per dtype in ``scales``
    scales: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, size: int, num_weights: int, entries: list[tuple[int, int, float]], device) -> WeightMap:
        """The map of ``(entry, weight index, path weight)`` ``entries`` (each entry at most once)."""
        columns = [list(c) for c in zip(*entries)] if entries else [[], [], []]
        return cls.of_arrays(size, num_weights, *(np.asarray(c) for c in columns), device=device)

    @classmethod
    def of_arrays(
        cls, size: int, num_weights: int, position: np.ndarray, source: np.ndarray, coef: np.ndarray, device
    ) -> WeightMap:
        """:meth:`of` with the entries as three arrays (built vectorised: MACE's 5,120-wide map
        has 164,000 weights)."""
        gather = torch.full((size,), num_weights, dtype=torch.long)
        scale = torch.zeros(size, dtype=torch.float64)
        if len(position):
            index = torch.as_tensor(np.asarray(position, dtype=np.int64))
            gather[index] = torch.as_tensor(np.asarray(source, dtype=np.int64))
            scale[index] = torch.as_tensor(np.asarray(coef, dtype=np.float64))
        return cls(gather.to(device), scale.to(device))

    def scale_as(self, dtype: torch.dtype) -> torch.Tensor:
        """``scale`` in ``dtype`` (converted once per dtype)."""
        scale = self.scales.get(dtype)
        if scale is None:
            scale = self.scales[dtype] = self.scale.to(dtype)
        return scale

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """The flat matrix of ``weight`` (differentiable in ``weight``)."""
        return _gather_weights(weight, self.gather) * self.scale_as(weight.dtype)

    def rows(self, weight: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Rows ``rows`` of the matrix viewed as ``[-1, width]``, built from their entries alone
        (``[len(rows), width]``, differentiable in ``weight``)."""
        gather = self.gather.view(-1, width).index_select(0, rows).reshape(-1)
        scale = self.scale_as(weight.dtype).view(-1, width).index_select(0, rows)
        return _gather_weights(weight, gather).view_as(scale) * scale


@dataclass(frozen=True)
class DimensionGroup:
    """The irreps of one dimension ``d``: the ``inputs`` (indices into ``irreps_in``, in the
    block matrix's row order) and their block matrix at ``offset`` in the flat blocks. ``ins``
    and ``outs``: per input and output irrep of the group, ``(first column in the flat row,
    multiplicity, first row or column in the block matrix)``."""

    d: int
    m_in: int
    m_out: int
    inputs: tuple[int, ...]
    offset: int
    ins: tuple[tuple[int, int, int], ...] = ()
    outs: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class LinearPlan:
    """How to evaluate one ``o3.Linear``: the flat block matrices of every group (``blocks``),
    the ``groups`` in output order of their first irrep, ``permute`` (``None``: outputs
    already in order) and the ``sizes`` of the input irrep blocks (one ``split``)."""

    blocks: WeightMap
    groups: tuple[DimensionGroup, ...]
    permute: torch.Tensor | None
    sizes: tuple[int, ...]  # of the input irrep blocks

    @property
    def device(self) -> torch.device:
        return self.blocks.gather.device


@dataclass(frozen=True)
class DensePlan:
    """The whole map as one ``[dim_in, dim_out]`` matrix (``matrix``, row-major)."""

    matrix: WeightMap
    dim_in: int
    dim_out: int

    @property
    def device(self) -> torch.device:
        return self.matrix.gather.device


def irreps_offsets(irreps) -> list[int]:
    """Where each irrep's block starts in a flat ``[..., irreps.dim]`` row, and the end."""
    out = [0]
    for mul, ir in irreps:
        out.append(out[-1] + mul * ir.dim)
    return out


def _group_muls(irreps, d: int) -> dict[int, int]:
    """Irrep index -> its first multiplicity row within the group of dimension ``d``."""
    rows, at = {}, 0
    for i, (mul, ir) in enumerate(irreps):
        if ir.dim == d:
            rows[i], at = at, at + mul
    return rows


def _entries(lin, d: int, in_rows: dict[int, int], out_rows: dict[int, int], m_out: int) -> list[tuple]:
    """Per instruction of dimension ``d``: ``(positions within the group's block matrix, weight
    indices, path weight)`` of its weights (for :func:`_joined`)."""
    parts, start = [], 0
    for ins in lin.instructions:
        mul_in, mul_out = lin.irreps_in[ins.i_in].mul, lin.irreps_out[ins.i_out].mul
        if lin.irreps_in[ins.i_in].ir.dim == d:
            u, w = np.arange(mul_in)[:, None], np.arange(mul_out)[None, :]
            position = (in_rows[ins.i_in] + u) * m_out + out_rows[ins.i_out] + w
            parts.append((position.ravel(), (start + u * mul_out + w).ravel(), ins.path_weight))
        start += mul_in * mul_out
    return parts


def _joined(parts: list[tuple[np.ndarray, np.ndarray, float]]) -> tuple[np.ndarray, ...]:
    """``(positions, sources, coefficients)`` of blocks of entries that share one coefficient."""
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    return (
        np.concatenate([p for p, _, _ in parts]),
        np.concatenate([k for _, k, _ in parts]),
        np.concatenate([np.full(p.size, c) for p, _, c in parts]),
    )


def _renumber_rows(rows: dict[int, int], irreps, used: set[int]) -> dict[int, int]:
    """Rows of the used input irreps only (the gather skips the unused ones)."""
    out, at = {}, 0
    for i in rows:
        if i in used:
            out[i], at = at, at + irreps[i].mul
    return out


def _placed(rows: dict[int, int], irreps, offsets: list[int]) -> tuple[tuple[int, int, int], ...]:
    """``(column, multiplicity, block row)`` of each irrep in ``rows`` (:attr:`DimensionGroup.ins`)."""
    return tuple((offsets[i], irreps[i].mul, r) for i, r in rows.items())


def linear_plan(lin: torch.nn.Module, device: torch.device) -> LinearPlan:
    """The :class:`LinearPlan` of e3nn ``o3.Linear`` ``lin``, its index tensors on ``device``."""
    dims = list(dict.fromkeys(ir.dim for _, ir in lin.irreps_out))
    used = {ins.i_in for ins in lin.instructions}
    groups, parts, order, offset = [], [], [], 0
    in_offsets, out_offsets = irreps_offsets(lin.irreps_in), irreps_offsets(lin.irreps_out)
    for d in dims:
        in_rows = _renumber_rows(_group_muls(lin.irreps_in, d), lin.irreps_in, used)
        out_rows = _group_muls(lin.irreps_out, d)
        m_in = sum(lin.irreps_in[i].mul for i in in_rows)
        m_out = sum(lin.irreps_out[i].mul for i in out_rows)
        ins, outs = _placed(in_rows, lin.irreps_in, in_offsets), _placed(out_rows, lin.irreps_out, out_offsets)
        groups.append(DimensionGroup(d, m_in, m_out, tuple(in_rows), offset, ins, outs))
        parts += [(offset + p, k, c) for p, k, c in _entries(lin, d, in_rows, out_rows, m_out)]
        order += [c for i in out_rows for c in range(out_offsets[i], out_offsets[i + 1])]
        offset += m_in * m_out
    permute = None if order == sorted(order) else torch.tensor(order, device=device).argsort()
    sizes = tuple(mul * ir.dim for mul, ir in lin.irreps_in)
    blocks = WeightMap.of_arrays(offset, lin.weight.numel(), *_joined(parts), device=device)
    return LinearPlan(blocks, tuple(groups), permute, sizes)


def dense_plan(lin: torch.nn.Module, device: torch.device) -> DensePlan:
    """The :class:`DensePlan` of e3nn ``o3.Linear`` ``lin``, its index tensors on ``device``."""
    in_at, out_at = irreps_offsets(lin.irreps_in), irreps_offsets(lin.irreps_out)
    dim_out, parts, start = out_at[-1], [], 0
    for ins in lin.instructions:
        mul_in, mul_out = lin.irreps_in[ins.i_in].mul, lin.irreps_out[ins.i_out].mul
        d = lin.irreps_in[ins.i_in].ir.dim
        u, w, m = np.arange(mul_in)[:, None, None], np.arange(mul_out)[None, :, None], np.arange(d)[None, None, :]
        position = (in_at[ins.i_in] + u * d + m) * dim_out + out_at[ins.i_out] + w * d + m
        source = np.broadcast_to(start + u * mul_out + w, position.shape)
        parts.append((position.ravel(), source.ravel(), ins.path_weight))
        start += mul_in * mul_out
    matrix = WeightMap.of_arrays(in_at[-1] * dim_out, lin.weight.numel(), *_joined(parts), device=device)
    return DensePlan(matrix, in_at[-1], dim_out)


def apply_dense(plan: DensePlan, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[N, dim_out]``: ``x`` ``[N, dim_in]`` times the dense matrix of ``plan`` and ``weight``."""
    return x @ plan.matrix.matrix(weight).view(plan.dim_in, plan.dim_out)


def take_columns(x: torch.Tensor, columns: slice | torch.Tensor) -> torch.Tensor:
    """``x[:, columns]``: a view for a slice, one ``index_select`` for an index tensor."""
    return x[:, columns] if isinstance(columns, slice) else x.index_select(1, columns)


def column_index(columns: list[int], device: torch.device) -> torch.Tensor | slice:
    """A slice when the columns are one contiguous run (or none), else an index tensor on ``device``."""
    if not columns or columns == list(range(columns[0], columns[0] + len(columns))):
        return slice(columns[0], columns[0] + len(columns)) if columns else slice(0, 0)
    return torch.tensor(columns, device=device)


def _group_product(blocks_in: Sequence[torch.Tensor], g: DimensionGroup, blocks: torch.Tensor) -> torch.Tensor:
    """``[N, M_out * d]``: one group's outputs, mul-major like e3nn's blocks, from the input
    irrep blocks ``blocks_in`` (each ``[N, mul * d]``, mul-major)."""
    n = blocks_in[0].shape[0]
    if g.m_in == 0:
        return blocks_in[0].new_zeros(n, g.m_out * g.d)
    w = blocks[g.offset : g.offset + g.m_in * g.m_out].view(g.m_in, g.m_out)
    if g.d == 1:
        parts = [blocks_in[i] for i in g.inputs]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)) @ w
    parts = [blocks_in[i].view(n, -1, g.d).transpose(1, 2) for i in g.inputs]  # [N, d, mul] views
    xd = (parts[0] if len(parts) == 1 else torch.cat(parts, 2)).reshape(n * g.d, g.m_in)
    return (xd @ w).view(n, g.d, g.m_out).transpose(1, 2).reshape(n, g.m_out * g.d)


def _check(m: torch.nn.Module) -> None:
    """A ValueError for the linears this form does not cover (they stay e3nn's)."""
    if not (m.internal_weights and m.shared_weights) or m.weight.dim() != 1 or m.bias_numel:
        raise ValueError("only internal, shared weights without biases")
    pairs = [(ins.i_in, ins.i_out) for ins in m.instructions]
    if len(set(pairs)) != len(pairs):  # their weights would land on the same matrix entries
        raise ValueError("an instruction between the same irreps is repeated")
    for ins in m.instructions:
        if tuple(ins.path_shape) != (m.irreps_in[ins.i_in].mul, m.irreps_out[ins.i_out].mul):
            raise ValueError(f"instruction {ins} has path shape {ins.path_shape}")


def apply_plan(plan: LinearPlan, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[N, dim_out]``: the linear map of ``plan`` with flat ``weight`` applied to ``x`` ``[N, dim_in]``."""
    blocks = plan.blocks.matrix(weight)
    blocks_in = x.split(plan.sizes, dim=1)
    outs = [_group_product(blocks_in, g, blocks) for g in plan.groups]
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
    return out if plan.permute is None else out.index_select(1, plan.permute)


def _frozen_form(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a call runs as the frozen map (:mod:`.linear_inference`): frozen weights (MD), CPU
    tensors (where it was measured), no trace, and the option on."""
    return not (weight.requires_grad or no_sync()) and x.device.type == "cpu" and kernel_options().frozen_linears


def _make_class() -> type:
    class WorkbenchLinear(KeepsOp, SWAP.native()):
        """e3nn's ``o3.Linear`` as one product per irrep dimension (module docstring)."""

        def forward(self, features, weight=None, bias=None):
            if weight is not None or bias is not None:
                return super().forward(features, weight, bias)
            dim_in, dim_out = self.io_dims()
            x = features.reshape(-1, dim_in)
            # a trace or a CUDA-graph step takes the per-dimension plan at every size: no guard on
            # the row count, and no plan built on first use inside a capture
            if not no_sync() and x.shape[0] * dim_in * dim_out <= DENSE_MAX_MACS:
                out = apply_dense(self.plan(dense_plan, x.device), x, self.weight)
            elif _frozen_form(self.weight, x):
                from workbench.kernels.e3nn.linear_inference import apply_frozen

                plan = self.plan(linear_plan, x.device)
                out = apply_frozen(x, plan.blocks.matrix(self.weight.detach()), plan.groups, dim_in, dim_out)
            else:
                out = apply_plan(self.plan(linear_plan, x.device), x, self.weight)
            return out.reshape(*features.shape[:-1], dim_out)

        def io_dims(self) -> tuple[int, int]:
            """The input and output widths as ints, kept: a forward that reads e3nn's ``Irreps``
            makes dynamo guard on ``len(Irrep)``, which e3nn refuses."""
            dims = self.__dict__.get("_io_dims")
            if dims is None:
                dims = self.__dict__["_io_dims"] = (self.irreps_in.dim, self.irreps_out.dim)
            return dims

        def plan(self, build, device: torch.device):
            """The plan ``build`` (:func:`linear_plan` or :func:`dense_plan`) makes, on ``device``;
            each is built on first use (a dense plan of MACE's 5,120 x 2,048 map is 10^7 entries)."""
            plans = self.cached_op(dict, lambda kept: all(p.device == device for p in kept.values()))
            if build not in plans:
                plans[build] = build(self, device)
            return plans[build]

    return WorkbenchLinear


SWAP = ClassSwap.companion("e3nn_linear", "e3nn.o3.Linear", globals(), _make_class, _check)
__getattr__ = SWAP.ours.module_getattr
