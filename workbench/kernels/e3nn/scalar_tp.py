r"""e3nn's ``FullyConnectedTensorProduct`` with a scalar second input, one ``mm`` per path, in place.

When the second input holds only even scalars (NequIP's self-connection: node features times
the species embedding), every path keeps the first input's irrep and its Clebsch-Gordan
coefficients are the identity, so

.. math::

    y_o[n, w, m] = \sum_{i \to o} c_{io} \sum_{u, v} W_{io}[u, v, w]\, x_i[n, u, m]\, s[n, v]

with ``x`` ``[N, dim_in1]``, ``s`` ``[N, K]`` and :math:`c_{io}` the path's factor. e3nn
generates it as a chain of small einsums per path. Here each path is the outer product
:math:`z[n, m, (u, v)] = x_i[n, u, m]\, s[n, v]` (``[N d, M_i K_j]``) times the path's weights
viewed as ``[M_i K_j, M_o]`` (scaled by :math:`c_{io}`): one elementwise product and one
``mm``, whose backward is two more. (Contracting the scalars with the weights first is fewer
multiply-adds but lands on MKL's slow shapes: ``[256, 16] x [16, 768]`` took 0.33 ms where the
outer product's ``[256, 256] x [256, 48]`` took 0.05 ms.) The path factors are read off e3nn's
module by probing it (float64), and the check compares the whole map with e3nn's on random
input, so a product of another form is refused and stays e3nn's. In ``eval()``, when the scalars
take few distinct rows (a species embedding: one per species), the map runs as one matrix per
group of rows instead (:mod:`~workbench.kernels.e3nn.scalar_tp_groups`).

:data:`SWAP` turns ``e3nn.o3.FullyConnectedTensorProduct`` modules with internal shared weights
and scalar second inputs into :class:`WorkbenchScalarTP` (a companion of a family's hot-op swap).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workbench.kernels.class_swap import ClassSwap, KeepsOp, probe_copy
from workbench.kernels.e3nn.linear import irreps_offsets
from workbench.kernels.e3nn.scalar_tp_groups import GroupedScalarTP, grouped_plan, shared_row_groups
from workbench.kernels.library import no_sync

__all__ = ["SWAP", "ScalarPath", "WorkbenchScalarTP", "apply_scalar_tp", "scalar_tp_plan"]  # noqa: F822


@dataclass(frozen=True)
class ScalarPath:
    """One path: first-input columns ``x_cols`` (``mul_in`` copies of a ``d``-dimensional irrep),
    scalar columns ``s_cols``, its weights ``weight[start:start + mul_in * mul_s * mul_out]``
    times ``factor``, and the output irrep it adds to (index ``out``)."""

    x_cols: slice
    d: int
    mul_in: int
    s_cols: slice
    mul_s: int
    mul_out: int
    start: int
    factor: float
    out: int


def _path_factor(probe: torch.nn.Module, ins, start: int, in1: list[int], in2: list[int], out: list[int]) -> float:
    """The path's factor :math:`c_{io}`: e3nn's output for its first weight at 1, all others 0,
    and unit inputs (``probe`` a float64 CPU copy, its weights overwritten; ``in1``, ``in2``,
    ``out``: the irrep offsets of its inputs and output)."""
    x = torch.zeros(1, probe.irreps_in1.dim, dtype=torch.float64)
    s = torch.zeros(1, probe.irreps_in2.dim, dtype=torch.float64)
    x[0, in1[ins.i_in1]], s[0, in2[ins.i_in2]] = 1.0, 1.0
    with torch.no_grad():
        probe.weight.zero_()
        probe.weight[start] = 1.0
        return float(SWAP.native().forward(probe, x, s)[0, out[ins.i_out]])


def scalar_tp_plan(tp: torch.nn.Module) -> tuple[ScalarPath, ...]:
    """The paths of ``tp`` (e3nn's instruction order; paths of no weights left out)."""
    probe, in1, in2 = probe_copy(tp), irreps_offsets(tp.irreps_in1), irreps_offsets(tp.irreps_in2)
    out = irreps_offsets(tp.irreps_out)
    paths, start = [], 0
    for ins in tp.instructions:
        mul_in, mul_s, mul_out = ins.path_shape
        if not mul_in * mul_s * mul_out:
            continue
        x_cols, s_cols = slice(in1[ins.i_in1], in1[ins.i_in1 + 1]), slice(in2[ins.i_in2], in2[ins.i_in2 + 1])
        d, factor = tp.irreps_in1[ins.i_in1].ir.dim, _path_factor(probe, ins, start, in1, in2, out)
        paths.append(ScalarPath(x_cols, d, mul_in, s_cols, mul_s, mul_out, start, factor, ins.i_out))
        start += mul_in * mul_s * mul_out
    return tuple(paths)


def _path(p: ScalarPath, x: torch.Tensor, s: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[N, mul_out * d]``: one path's output, mul-major like e3nn's blocks."""
    n, size = x.shape[0], p.mul_in * p.mul_s
    w = weight[p.start : p.start + size * p.mul_out].reshape(size, p.mul_out) * p.factor
    xi, si = x[:, p.x_cols].view(n, p.mul_in, p.d), s[:, p.s_cols]
    if p.d == 1:
        return (xi * si.unsqueeze(1)).view(n, size) @ w
    z = xi.transpose(1, 2).unsqueeze(-1) * si[:, None, None, :]  # [N, d, mul_in, mul_s]
    return (z.reshape(n * p.d, size) @ w).view(n, p.d, p.mul_out).transpose(1, 2).reshape(n, p.mul_out * p.d)


def apply_scalar_tp(
    paths: tuple[ScalarPath, ...], out_widths: Sequence[int], x: torch.Tensor, s: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``[N, sum(out_widths)]``: ``paths`` with flat ``weight`` on ``x`` ``[N, dim_in1]`` and
    ``s`` ``[N, K]``; ``out_widths``: each output irrep's ``mul * dim``, as ints."""
    blocks: dict[int, torch.Tensor] = {}
    for p in paths:
        y = _path(p, x, s, weight)
        blocks[p.out] = y if p.out not in blocks else blocks[p.out] + y
    n = x.shape[0]
    outs = [blocks[o] if o in blocks else x.new_zeros(n, width) for o, width in enumerate(out_widths)]
    return torch.cat(outs, 1) if len(outs) > 1 else outs[0]


def _widths(irreps) -> tuple[int, ...]:
    return tuple(mul * ir.dim for mul, ir in irreps)


def _check(m: torch.nn.Module) -> None:
    """A ValueError for the products this form does not cover (they stay e3nn's)."""
    if not (m.internal_weights and m.shared_weights) or m.weight.dim() != 1:
        raise ValueError("only internal, shared weights")
    if any(ir.l != 0 or ir.p != 1 for _, ir in m.irreps_in2):
        raise ValueError(f"the second input {m.irreps_in2} is not even scalars")
    if any(ins.connection_mode != "uvw" or not ins.has_weight for ins in m.instructions):
        raise ValueError("only weighted 'uvw' paths")
    probe, g = probe_copy(m), torch.Generator().manual_seed(0)
    x = torch.randn(3, m.irreps_in1.dim, dtype=torch.float64, generator=g)
    s = torch.randn(3, m.irreps_in2.dim, dtype=torch.float64, generator=g)
    ours = apply_scalar_tp(scalar_tp_plan(m), _widths(m.irreps_out), x, s, probe.weight.detach())
    if not torch.allclose(ours, SWAP.native().forward(probe, x, s), rtol=1e-12, atol=1e-12):
        raise ValueError("the paths do not reproduce e3nn's product on a probe")


def _make_class() -> type:
    class WorkbenchScalarTP(KeepsOp, SWAP.native()):
        """e3nn's ``FullyConnectedTensorProduct`` with scalar second input: per path an outer product
        and one ``mm``, or in ``eval()`` one matrix per group of equal scalar rows (module docstring)."""

        def forward(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
            if weight is not None or x.shape[:-1] != y.shape[:-1]:  # explicit weights, broadcasting
                return super().forward(x, y, weight)
            dim1, dim2, out_widths = self.dims()
            x2, y2 = x.reshape(-1, dim1), y.reshape(-1, dim2)
            paths, grouped = self.plans(x.device)
            outer = functools.partial(apply_scalar_tp, paths, out_widths)
            # in training the forces' backward keeps a graph, which the outer form differentiates
            # directly; a trace takes it too (finding the groups reads the data on the host)
            groups = None if self.training or no_sync() else shared_row_groups(y2, grouped.max_groups)
            if groups is None:
                out = outer(x2, y2, self.weight)
            else:  # few distinct scalar rows (species): one matrix per group
                out = GroupedScalarTP.apply(grouped, groups, outer, x2, y2, self.weight)
            return out.reshape(*x.shape[:-1], sum(out_widths))

        def dims(self) -> tuple[int, int, tuple[int, ...]]:
            """Both input widths and each output irrep's, as ints, kept: a forward that reads
            e3nn's ``Irreps`` makes dynamo guard on ``len(Irrep)``, which e3nn refuses."""
            dims = self.__dict__.get("_dims")
            if dims is None:
                dims = self.__dict__["_dims"] = (self.irreps_in1.dim, self.irreps_in2.dim, _widths(self.irreps_out))
            return dims

        def plans(self, device: torch.device) -> tuple:
            """``(paths, GroupedPlan)``, built on first use on ``device``."""

            def build() -> tuple:
                paths = scalar_tp_plan(self)
                out_at = irreps_offsets(self.irreps_out)
                dims = (self.irreps_in1.dim, self.irreps_in2.dim, self.weight.numel())
                return paths, grouped_plan(paths, out_at, *dims, device)

            return self.cached_op(build, lambda plans: plans[1].spread.device == device)

    return WorkbenchScalarTP


SWAP = ClassSwap.companion(
    "e3nn_scalar_tp", "e3nn.o3.FullyConnectedTensorProduct", globals(), _make_class, _check, "WorkbenchScalarTP"
)
__getattr__ = SWAP.ours.module_getattr
