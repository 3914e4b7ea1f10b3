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

from workbench.kernels.ops import engine_uses
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
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.is_leaf.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.__len__,
}
_IN_PLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")}
_UNREAD = (
    "tabulated radial weights reached a gradient without their values (a custom autograd Function "
    "read them directly): pass weights.values() to it, or set WORKBENCH_TABLE_IN_PASSES=0"
)


class _Unread(torch.autograd.Function):
    """The storage-free base of a :class:`TabulatedWeights`: NaN, so a reader that bypasses
    ``__torch_function__`` cannot take it for numbers, and linked to the lengths, so a gradient
    through it raises instead of leaving out the lengths' share."""

    @staticmethod
    def forward(ctx, lengths: torch.Tensor, width: int) -> torch.Tensor:
        return lengths.new_full((), float("nan")).expand(lengths.shape[0], width)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(_UNREAD)


class TabulatedWeights(torch.Tensor):
    """``[E, J]`` = ``table`` at ``lengths`` ``[E]``, computed only when a torch function needs the
    values (:meth:`values`); :func:`tabulated_edge_op` reads the table instead. Read-only: an
    in-place op on it raises."""

    lengths: torch.Tensor
    table: RadialTable

    @staticmethod
    def __new__(cls, lengths: torch.Tensor, table: RadialTable) -> TabulatedWeights:
        if lengths.dim() != 1:
            raise ValueError(f"tabulated weights take [edges] lengths, got {tuple(lengths.shape)}")
        return _Unread.apply(lengths, table.outputs).as_subclass(cls)

    def __init__(self, lengths: torch.Tensor, table: RadialTable):
        self.lengths, self.table, self._values = lengths, table, None

    def values(self) -> torch.Tensor:
        """The ``[E, J]`` values as an ordinary tensor, differentiable once in the lengths (kept
        for the next call, unless computed without the gradient the lengths need)."""
        if self._values is not None:
            return self._values
        values = TableValues.apply(self.lengths, self.table)
        if values.grad_fn is not None or not self.lengths.requires_grad:
            self._values = values
        return values

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
        targets = torch.utils._pytree.tree_leaves(kwargs.get("out"))
        if (in_place and args and isinstance(args[0], TabulatedWeights)) or any(
            isinstance(t, TabulatedWeights) for t in targets
        ):
            raise RuntimeError(f"tabulated radial weights are read-only ({name}): change weights.values() instead")
        args, kwargs = torch.utils._pytree.tree_map(_values, (args, kwargs))
        return func(*args, **kwargs)


def _values(x: Any) -> Any:
    return x.values() if isinstance(x, TabulatedWeights) else x


def _needed(ctx, w: int, n: int) -> list[bool]:
    """Which of (lengths, operands...) the backward must give a gradient, the slot ``w`` (no
    tensor) counting as the lengths: ``needs_input_grad``, pruned by :func:`engine_uses` where
    ``next_functions`` lines up with the tensor inputs."""
    flags = list(ctx.needs_input_grad[4:])
    slots = [0] + [1 + a for a in range(n) if a != w]  # the tensor inputs' positions
    if len(ctx.next_functions) == len(slots):
        for k, i in enumerate(slots):
            flags[i] = bool(flags[i]) and engine_uses(ctx, k)
    flags[1 + w] = bool(flags[0])
    return [bool(f) for f in flags]


class _TabulatedEdge(torch.autograd.Function):
    """``op``'s outputs with operand ``w`` read from ``table`` at ``lengths``; gradients to the
    other operands and to the lengths (the weights' cotangent dotted with the slopes)."""

    @staticmethod
    def forward(ctx, op: Any, graph: EdgeGraph, w: int, table: RadialTable, lengths: torch.Tensor, *tensors):
        from workbench.kernels.numba.cpu.radial import table_rows
        from workbench.kernels.numba.dispatch import evaluate_tabulated

        r = lengths.detach().contiguous().numpy()
        rows = table_rows(r, table.lo, table.h, table.num_intervals, table.coeffs.dtype)
        outs, _ = evaluate_tabulated(op, list(tensors), graph, w, table.coeffs, rows)
        ctx.set_materialize_grads(False)
        ctx.op, ctx.graph, ctx.w, ctx.table, ctx.rows, ctx.r = op, graph, w, table, rows, r
        ctx.save_for_backward(lengths, *[t for a, t in enumerate(tensors) if a != w])  # version-checked
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(_ONCE)
        saved = list(ctx.saved_tensors)[1:]
        needed = _needed(ctx, ctx.w, len(saved) + 1)  # the lengths, then the operands
        present = tuple(g is not None for g in grads)
        if not any(needed) or not any(present):
            return (None,) * (4 + len(needed))
        d = ctx.op.derivative(tuple(needed[1:]), present)
        operands = [None if a == ctx.w else saved.pop(0) for a in range(len(needed) - 1)]
        operands += [g.contiguous() for g in grads if g is not None]
        cot = sum(needed[1 : 1 + ctx.w]) if needed[0] else -1
        res, dr = _derivative(ctx, d, operands, cot)
        out = [res.pop(0) if n and a != ctx.w else None for a, n in enumerate(needed[1:])]
        return (None, None, None, None, None if dr is None else torch.from_numpy(dr), *out)


def _derivative(ctx, d: Any, operands: list, cot: int) -> tuple[list[torch.Tensor], np.ndarray | None]:
    """The derivative op's outputs (but the weights' cotangent) and the lengths' gradient."""
    from workbench.kernels.numba.dispatch import evaluate_tabulated, tabulated_supported

    t = ctx.table
    if tabulated_supported(d, ctx.w, t.coeffs, cot):
        res, dots = evaluate_tabulated(d, operands, ctx.graph, ctx.w, t.coeffs, ctx.rows, cot)
        return res, None if dots is None else dots * (2.0 / t.h)  # slopes in s to slopes in r
    from workbench.kernels.numba.cpu.radial import table_slope_dot, table_values

    values, plan = table_values(ctx.r, t.lo, t.h, t.coeffs)  # passes that cannot read the table
    operands[ctx.w] = torch.from_numpy(values)
    res = d.evaluate_rows(operands, ctx.graph)
    if cot < 0:
        return res, None
    return res, table_slope_dot(ctx.r, plan, t.lo, t.h, t.coeffs, res.pop(cot).contiguous().numpy())


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
    graph.check(op.operands, [torch.empty(()).expand(weights.shape) if a == w else t for a, t in enumerate(tensors)])
    operands = [None if a == w else t.contiguous() for a, t in enumerate(tensors)]
    return _TabulatedEdge.apply(op, graph, w, weights.table, weights.lengths, *operands)


_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}
