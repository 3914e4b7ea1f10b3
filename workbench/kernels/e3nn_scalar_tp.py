r"""e3nn's ``FullyConnectedTensorProduct`` with a scalar second input, as two products, in place.

When the second input holds only even scalars (NequIP's self-connection: node features times
the species embedding), every path keeps the first input's irrep and its Clebsch-Gordan
coefficients are the identity, so

.. math::

    y_o[n, w, m] = \sum_{i \to o} c_{io} \sum_{u, v} W_{io}[u, v, w]\, x_i[n, u, m]\, s[n, v]

with ``x`` ``[N, dim_in1]``, ``s`` ``[N, K]`` and :math:`c_{io}` the path's factor. e3nn
generates it as a chain of small einsums per path. Here the weights meet the scalars first,
in one ``mm`` for all paths: :math:`T = s\,B`, ``[N, sum_d M_in,d * M_out,d]``, with ``B``
``[K, ...]`` built from ``weight`` on every call (``index_put``, differentiable); then one
``bmm`` per irrep dimension :math:`d`, ``x_d^T T_d`` (``[N, d, M_in] x [N, M_in, M_out]``), and
the outputs in ``irreps_out`` order by one gather (as :mod:`~workbench.kernels.e3nn_linear`
groups them). The path factors are read off e3nn's module by probing it (float64), and the
check compares the whole map with e3nn's on random input, so a product of another form is
refused and stays e3nn's.

:data:`SWAP` turns ``e3nn.o3.FullyConnectedTensorProduct`` modules with internal shared weights
and scalar second inputs into :class:`WorkbenchScalarTP` (a companion of a family's hot-op swap).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from workbench.kernels.class_swap import ClassSwap, KeepsOp
from workbench.kernels.e3nn_linear import DimensionGroup, _columns, _group_muls, _offsets, _renumber_rows, column_index
from workbench.kernels.lazy_class import LazyClass

__all__ = ["SWAP", "ScalarTPPlan", "WorkbenchScalarTP", "apply_scalar_tp", "scalar_tp_plan"]  # noqa: F822


@dataclass(frozen=True)
class ScalarTPPlan:
    """``B``'s entries (``position`` in the flat ``[k, width]`` matrix, ``source`` index into
    ``weight``, ``coef`` the path factor), the ``groups`` (each: the first input's columns of one
    irrep dimension and the ``offset`` of their ``[M_in, M_out]`` slice of :math:`T`) and
    ``permute`` (``None``: outputs in order)."""

    position: torch.Tensor
    source: torch.Tensor
    coef: torch.Tensor
    k: int
    width: int
    groups: tuple[DimensionGroup, ...]
    permute: torch.Tensor | None


def _path_factors(tp: torch.nn.Module) -> list[float]:
    """Each path's factor :math:`c_{io}`: e3nn's output for one unit weight and unit inputs."""
    probe = copy.deepcopy(tp).to(torch.float64)
    factors, start = [], 0
    in1, in2, out = _offsets(tp.irreps_in1), _offsets(tp.irreps_in2), _offsets(tp.irreps_out)
    for ins in tp.instructions:
        x = torch.zeros(1, tp.irreps_in1.dim, dtype=torch.float64)
        s = torch.zeros(1, tp.irreps_in2.dim, dtype=torch.float64)
        x[0, in1[ins.i_in1]], s[0, in2[ins.i_in2]] = 1.0, 1.0
        with torch.no_grad():
            probe.weight.zero_()
            probe.weight[start] = 1.0
            factors.append(float(SWAP.native().forward(probe, x, s)[0, out[ins.i_out]]))
        start += ins.path_shape[0] * ins.path_shape[1] * ins.path_shape[2]
    return factors


def _entries(tp, d: int, rows: dict[int, int], out_rows: dict[int, int], m_out: int, factors) -> list[tuple]:
    """``(row of B, column within the group, weight index, factor)`` for the paths of dimension ``d``."""
    entries, start, in2 = [], 0, _offsets(tp.irreps_in2)
    for ins, c in zip(tp.instructions, factors):
        mul1, mul2, mul_out = ins.path_shape
        if tp.irreps_in1[ins.i_in1].ir.dim == d:
            r0, c0 = rows[ins.i_in1], out_rows[ins.i_out]
            for u in range(mul1):
                for v in range(mul2):
                    at = start + (u * mul2 + v) * mul_out
                    entries += [(in2[ins.i_in2] + v, (r0 + u) * m_out + c0 + w, at + w, c) for w in range(mul_out)]
        start += mul1 * mul2 * mul_out
    return entries


def scalar_tp_plan(tp: torch.nn.Module, device: torch.device) -> ScalarTPPlan:
    """The :class:`ScalarTPPlan` of ``tp``, its index tensors on ``device``."""
    factors, used = _path_factors(tp), {ins.i_in1 for ins in tp.instructions}
    groups, entries, order, offset = [], [], [], 0
    out_offsets = _offsets(tp.irreps_out)
    for d in dict.fromkeys(ir.dim for _, ir in tp.irreps_out):
        rows = _renumber_rows(_group_muls(tp.irreps_in1, d), tp.irreps_in1, used)
        out_rows = _group_muls(tp.irreps_out, d)
        m_in, m_out = sum(tp.irreps_in1[i].mul for i in rows), sum(tp.irreps_out[i].mul for i in out_rows)
        columns = column_index(_columns(tp.irreps_in1, rows, used), device)
        groups.append(DimensionGroup(d, m_in, m_out, columns, offset))
        entries += [(r, offset + c, k, f) for r, c, k, f in _entries(tp, d, rows, out_rows, m_out, factors)]
        order += [c for i in out_rows for c in range(out_offsets[i], out_offsets[i + 1])]
        offset += m_in * m_out
    permute = None if order == sorted(order) else torch.tensor(order, device=device).argsort()
    index = {"dtype": torch.long, "device": device}
    position = torch.tensor([r * offset + c for r, c, _, _ in entries], **index)
    source = torch.tensor([k for _, _, k, _ in entries], **index)
    coef = torch.tensor([f for _, _, _, f in entries], dtype=torch.float64, device=device)
    return ScalarTPPlan(position, source, coef, tp.irreps_in2.dim, offset, tuple(groups), permute)


def _group_product(x: torch.Tensor, g: DimensionGroup, t: torch.Tensor) -> torch.Tensor:
    """``[N, M_out * d]``: one group's outputs, mul-major like e3nn's blocks."""
    n = x.shape[0]
    if g.m_in == 0:
        return x.new_zeros(n, g.m_out * g.d)
    tg = t[:, g.offset : g.offset + g.m_in * g.m_out].view(n, g.m_in, g.m_out)
    xd = x[:, g.columns] if isinstance(g.columns, slice) else x.index_select(1, g.columns)
    if g.d == 1:
        return torch.bmm(xd.unsqueeze(1), tg).view(n, g.m_out)
    y = torch.bmm(xd.view(n, g.m_in, g.d).transpose(1, 2), tg)  # [N, d, M_out]
    return y.transpose(1, 2).reshape(n, g.m_out * g.d)


def apply_scalar_tp(plan: ScalarTPPlan, x: torch.Tensor, s: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[N, dim_out]``: the product of ``plan`` with flat ``weight`` on ``x`` ``[N, dim_in1]`` and ``s`` ``[N, k]``."""
    values = weight[plan.source] * plan.coef.to(weight.dtype)
    b = weight.new_zeros(plan.k * plan.width).index_put((plan.position,), values).view(plan.k, plan.width)
    t = s @ b
    outs = [_group_product(x, g, t) for g in plan.groups]
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
    return out if plan.permute is None else out.index_select(1, plan.permute)


def _check(m: torch.nn.Module) -> None:
    """A ValueError for the products this form does not cover (they stay e3nn's)."""
    if not (m.internal_weights and m.shared_weights) or m.weight.dim() != 1:
        raise ValueError("only internal, shared weights")
    if any(ir.l != 0 or ir.p != 1 for _, ir in m.irreps_in2):
        raise ValueError(f"the second input {m.irreps_in2} is not even scalars")
    if any(ins.connection_mode != "uvw" or not ins.has_weight for ins in m.instructions):
        raise ValueError("only weighted 'uvw' paths")
    probe, g = copy.deepcopy(m).to(torch.float64), torch.Generator().manual_seed(0)
    x = torch.randn(3, m.irreps_in1.dim, dtype=torch.float64, generator=g)
    s = torch.randn(3, m.irreps_in2.dim, dtype=torch.float64, generator=g)
    ours = apply_scalar_tp(scalar_tp_plan(m, torch.device("cpu")), x, s, probe.weight.detach())
    if not torch.allclose(ours, SWAP.native().forward(probe, x, s), rtol=1e-12, atol=1e-12):
        raise ValueError("the paths do not reproduce e3nn's product on a probe")


def _make_class() -> type:
    class WorkbenchScalarTP(KeepsOp, SWAP.native()):
        """e3nn's ``FullyConnectedTensorProduct`` with scalar second input as two products (module docstring)."""

        def forward(self, x, y, weight=None):
            if weight is not None or x.shape[:-1] != y.shape[:-1]:  # explicit weights, broadcasting
                return super().forward(x, y, weight)
            x2, y2 = x.reshape(-1, self.irreps_in1.dim), y.reshape(-1, self.irreps_in2.dim)
            out = apply_scalar_tp(self.plan(x.device), x2, y2, self.weight)
            return out.reshape(*x.shape[:-1], self.irreps_out.dim)

        def plan(self, device: torch.device) -> ScalarTPPlan:
            return self.cached_op(lambda: scalar_tp_plan(self, device), lambda plan: plan.position.device == device)

    return WorkbenchScalarTP


SWAP = ClassSwap.companion(
    "e3nn_scalar_tp",
    "e3nn.o3.FullyConnectedTensorProduct",
    LazyClass(globals(), "WorkbenchScalarTP", _make_class),
    "e3nn's FullyConnectedTensorProduct",
    _check,
)
__getattr__ = SWAP.ours.module_getattr
