r"""Radial weights as a table that the message passes read in place, for MD on the CPU.

A tabulated radial network (:mod:`workbench.kernels.radial_table`) gives an interaction's
tensor-product weights :math:`W_{ej} = R_j(r_e)` ``[E, J]``. Written out they are the largest
arrays of an MD step (``J = 1280``, 61,240 edges: 313 MB in float32), written once, read by the
message pass, read again by its backward, whose cotangent :math:`\bar W` ``[E, J]`` is written
and read once more for :math:`\bar r_e = \sum_j \bar W_{ej} R_j'(r_e)`.

Here they are never written:

- :class:`TabulatedWeights` is what a tabulated network returns: an ``[E, J]`` tensor that holds
  only the lengths and the table. Any torch function it reaches computes the values first
  (:class:`TableValues`, differentiable once), so every consumer sees the right numbers;
- the fused message op (:func:`tabulated_edge_op`) does not: its passes evaluate the eight
  coefficients of each edge's interval where they read a weight, and its backward dots each
  weight's cotangent with the slope where it computes it
  (:class:`~workbench.kernels.numba.cpu.tabulated.TableOperand`). Its gradient goes to the
  lengths directly.

Like the table itself this is differentiable once (forces, stress), on CPU tensors, with the
numba backend's fused passes; anything else gets the values (:meth:`TabulatedWeights.values`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from workbench.kernels.ops import used_inputs
from workbench.kernels.radial_table import RadialTable
from workbench.kernels.registry import DEFAULT_BACKEND
from workbench.kernels.rows import EdgeGraph

__all__ = ["TableValues", "TabulatedWeights", "tabulated_edge_op"]

_ONCE = (
    "a tabulated radial network is differentiable once (forces, stress), not twice: train with the "
    "network (untabulate_radial(model), or radial='mlp' in load_calculator)"
)


class TableValues(torch.autograd.Function):
    """``[E]`` lengths -> ``[E, J]`` table values; backward: the slopes dotted with the gradient."""

    @staticmethod
    def forward(ctx, lengths: torch.Tensor, table: RadialTable) -> torch.Tensor:
        from workbench.kernels.numba.cpu.radial import table_values

        r = lengths.detach().contiguous().numpy()
        values, plan = table_values(r, table.lo, table.h, table.coeffs)
        ctx.saved = (r, plan, table)
        return torch.from_numpy(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from workbench.kernels.numba.cpu.radial import table_slope_dot

        if torch.is_grad_enabled():  # create_graph: a second derivative would miss the table's
            raise RuntimeError(_ONCE)
        r, plan, table = ctx.saved
        g = grad.contiguous().numpy()
        return torch.from_numpy(table_slope_dot(r, plan, table.lo, table.h, table.coeffs, g)), None


#: torch functions a :class:`TabulatedWeights` answers without computing its values
_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
}


class TabulatedWeights(torch.Tensor):
    """``[E, J]`` = ``table`` at ``lengths`` ``[E]``, computed only when a torch function needs the
    values (:meth:`values`, once); :func:`tabulated_edge_op` reads the table instead."""

    lengths: torch.Tensor
    table: RadialTable

    @staticmethod
    def __new__(cls, lengths: torch.Tensor, table: RadialTable) -> TabulatedWeights:
        shape = (lengths.shape[0], table.outputs)
        return torch.Tensor._make_subclass(cls, torch.zeros((), dtype=lengths.dtype).expand(shape))

    def __init__(self, lengths: torch.Tensor, table: RadialTable):
        self.lengths, self.table, self._values = lengths, table, None

    def values(self) -> torch.Tensor:
        """The ``[E, J]`` values as an ordinary tensor, differentiable once in the lengths."""
        if self._values is None:
            self._values = TableValues.apply(self.lengths, self.table)
        return self._values

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = torch.utils._pytree.tree_map(_values, (args, kwargs))
        return func(*args, **kwargs)


def _values(x: Any) -> Any:
    return x.values() if isinstance(x, TabulatedWeights) else x


class _TabulatedEdge(torch.autograd.Function):
    """``op``'s outputs with operand ``w`` read from ``table`` at ``lengths``; gradients to the
    other operands and to the lengths (the weights' cotangent dotted with the slopes)."""

    @staticmethod
    def forward(ctx, op: Any, graph: EdgeGraph, w: int, table: RadialTable, lengths: torch.Tensor, *tensors):
        from workbench.kernels.numba.cpu.tabulated import table_rows
        from workbench.kernels.numba.dispatch import evaluate_tabulated

        r = lengths.detach().contiguous().numpy()
        rows = table_rows(r, table.lo, table.h, table.num_intervals, table.coeffs.dtype)
        outs, _ = evaluate_tabulated(op, list(tensors), graph, w, table.coeffs, rows)
        ctx.set_materialize_grads(False)
        ctx.op, ctx.graph, ctx.w, ctx.table, ctx.rows, ctx.r = op, graph, w, table, rows, r
        ctx.save_for_backward(*[t for a, t in enumerate(tensors) if a != w])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(_ONCE)
        needed = list(used_inputs(ctx, 4))  # the lengths, then the operands (w's slot: its placeholder)
        needed[1 + ctx.w] = needed[0]
        present = tuple(g is not None for g in grads)
        if not any(needed) or not any(present):
            return (None,) * (4 + len(needed))
        d = ctx.op.derivative(tuple(needed[1:]), present)
        saved = list(ctx.saved_tensors)
        operands = [None if a == ctx.w else saved.pop(0) for a in range(len(needed) - 1)]
        operands += [g.contiguous() for g in grads if g is not None]
        cot = sum(needed[1 : 1 + ctx.w]) if needed[0] else -1
        res, dr = _derivative(ctx, d, operands, cot)
        out = [res.pop(0) if n and a != ctx.w else None for a, n in enumerate(needed[1:])]
        grad_lengths = torch.from_numpy(dr * (2.0 / ctx.table.h)) if needed[0] else None
        return (None, None, None, None, grad_lengths, *out)


def _derivative(ctx, d: Any, operands: list, cot: int) -> tuple[list[torch.Tensor], np.ndarray | None]:
    """The derivative op's outputs (but the weights' cotangent) and the lengths' slope dot."""
    from workbench.kernels.numba.dispatch import evaluate_tabulated, tabulated_supported

    if tabulated_supported(d, ctx.w, ctx.table.coeffs, cot):
        return evaluate_tabulated(d, operands, ctx.graph, ctx.w, ctx.table.coeffs, ctx.rows, cot)
    from workbench.kernels.numba.cpu.radial import table_slope_dot, table_values

    t = ctx.table  # a pass that cannot read the table: the values written out, as TableValues does
    values, plan = table_values(ctx.r, t.lo, t.h, t.coeffs)
    operands[ctx.w] = torch.from_numpy(values)
    res = d.evaluate_rows(operands, ctx.graph)
    if cot < 0:
        return res, None
    dw = res.pop(cot).contiguous().numpy()
    return res, table_slope_dot(ctx.r, plan, t.lo, t.h, t.coeffs, dw) * (t.h / 2.0)


def tabulated_edge_op(
    op: Any,
    sender: torch.Tensor,
    receiver: torch.Tensor,
    num_nodes: int,
    *tensors: torch.Tensor,
    backend: str = DEFAULT_BACKEND,
) -> tuple[torch.Tensor, ...] | None:
    """:func:`~workbench.kernels.ops.edge_poly_op` where one operand is a
    :class:`TabulatedWeights`, read from its table in the passes; None where that path does not
    apply (then pass the weights' :meth:`~TabulatedWeights.values`): another backend, a GPU, an
    empty graph, a dtype other than the table's, passes that are not fused."""
    from workbench.kernels.numba.dispatch import tabulated_supported

    ws = [a for a, t in enumerate(tensors) if isinstance(t, TabulatedWeights)]
    if len(ws) != 1 or backend != DEFAULT_BACKEND or sender.shape[0] == 0:
        return None
    w, weights = ws[0], tensors[ws[0]]
    others = [t for a, t in enumerate(tensors) if a != w]
    if _DTYPES.get(weights.table.coeffs.dtype) != weights.dtype:
        return None
    if any(t.device.type != "cpu" or t.dtype != weights.dtype for t in others):
        return None
    if not tabulated_supported(op, w, weights.table.coeffs):
        return None
    graph = EdgeGraph.of(sender, receiver, num_nodes)
    graph.check([o for a, o in enumerate(op.operands) if a != w], others)
    operands = [None if a == w else t.contiguous() for a, t in enumerate(tensors)]
    return _TabulatedEdge.apply(op, graph, w, weights.table, weights.lengths, *operands)


_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}
