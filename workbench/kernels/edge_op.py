r"""Edge (message-passing) sparse-polynomial ops: gather, product and scatter in one pass.

An edge op is a :class:`~workbench.kernels.op.PolyOp` whose operands have the row kinds
``"edge"`` (one row per edge), ``"sender"`` / ``"receiver"`` (a node array read at the edge's
sender :math:`s_e` / receiver :math:`r_e`). For an output polynomial :math:`P` of kind

* ``"edge"``: :math:`\mathrm{out}[e, c, o] = P(\text{rows of } e)`;
* ``"receiver"``: :math:`\mathrm{out}[n, c, o] = \sum_{e : r_e = n} P(\text{rows of } e)`
  (``"sender"`` likewise) - the gather and the scatter-sum are part of the op.

Because the vector-Jacobian product of a gathered operand is the scatter-sum of the same
polynomial through the same index (and vice versa), :meth:`SparsePolynomial.vjp` needs no
change: the derivative of a ``"sender"`` operand is a ``"sender"`` output, the cotangent of a
``"receiver"`` output is a ``"receiver"`` operand, a channel-broadcast operand (zero cstride,
the spherical harmonics) gets a channel-summed gradient. So backward and double backward are
derived from the forward descriptor exactly as in Kernels I, and :func:`apply_edge_poly_op` is
differentiable to any order (it launches its derivative through itself).

Dispatch as in :mod:`workbench.kernels.op`: CUDA tensors with numba's CUDA target -> the fused
kernels of :mod:`workbench.kernels.edge_cuda`; otherwise the numba CPU path
(:mod:`workbench.kernels.edge_cpu`); ``WORKBENCH_KERNELS_CUDASIM=1`` with
``NUMBA_ENABLE_CUDASIM=1`` routes CPU tensors through the CUDA kernels in the simulator.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch

from workbench.kernels import cuda as _cuda
from workbench.kernels import edge_cpu as _ecpu
from workbench.kernels.descriptor import Operand, SparsePolynomial
from workbench.kernels.op import PolyOp, _warn_no_cuda_target
from workbench.kernels.tables import CompiledTables, term_table

__all__ = ["EdgeGraph", "EdgePolyOp", "apply_edge_poly_op"]


class EdgeGraph:
    r"""Edges ``edge_index`` ``[2, num_edges]`` (row 0 sender, row 1 receiver, as in MACE) over
    ``num_nodes`` nodes, with the CSR segments the node kernels walk, built lazily on the
    tensors' device and shared by the forward and every backward launch of one call.
    """

    def __init__(self, edge_index: torch.Tensor, num_nodes: int):
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must be [2, num_edges], got {tuple(edge_index.shape)}")
        ei = edge_index.detach().to(torch.int64)
        self.sender = ei[0].contiguous()
        self.receiver = ei[1].contiguous()
        self.num_nodes = int(num_nodes)
        self.num_edges = int(ei.shape[1])
        self._csr: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def csr(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ptr [num_nodes + 1], perm [num_edges])``: edges ``perm[ptr[n]:ptr[n+1]]`` have
        ``kind`` (``"sender"`` or ``"receiver"``) equal to ``n``."""
        if kind not in self._csr:
            idx = self.sender if kind == "sender" else self.receiver
            perm = torch.argsort(idx, stable=True)
            counts = torch.bincount(idx, minlength=self.num_nodes)
            ptr = torch.zeros(self.num_nodes + 1, dtype=torch.int64, device=idx.device)
            torch.cumsum(counts, 0, out=ptr[1:])
            self._csr[kind] = (ptr, perm)
        return self._csr[kind]


class EdgeCompiledPolynomial(CompiledTables):
    """Term tables of one edge polynomial: slot ``q`` reads array ``slot_arr[q]`` at the row of
    kind ``slot_kind[q]`` (0 edge, 1 sender, 2 receiver), element ``slot_off + c * slot_cs``."""

    def __init__(self, poly: SparsePolynomial):
        kinds = [_ecpu.KIND_CODES[op.batch] for op in poly.operands]
        super().__init__(poly, term_table(poly, range(len(poly.operands)), kinds))
        self.out_size = poly.output.size
        self.out_kind = poly.output.batch
        self.node_output = poly.output.batch in ("sender", "receiver")
        cs = set(poly.output.cstrides)
        if 0 in cs and cs != {0}:
            raise ValueError("an output must be either channelwise or channel-broadcast in every component")
        self.reduce_channels = cs == {0}

    def host_tables(self, dtype: str) -> tuple:
        t = self.table
        return (t.slot_arr, t.slot_kind, t.slot_off, t.slot_cs, t.t_out, t.t_fac, self._coef[dtype], t.out_off, t.out_cs)


class EdgePolyOp(PolyOp):
    r"""Sparse polynomials over edge / sender / receiver operands, evaluated with gather and
    scatter fused (see the module docstring).

    Parameters
    ----------
    operands : sequence of :class:`Operand`
        at most 8, each of batch ``"edge"``, ``"sender"`` or ``"receiver"``
    outputs : sequence of :class:`SparsePolynomial`
        each over (a subset of) ``operands``, matched by name
    """

    def __init__(self, operands: Sequence[Operand], outputs: Sequence[SparsePolynomial]):
        self.operands = tuple(operands)
        for op in self.operands:
            if op.batch not in _ecpu.KIND_CODES:
                raise ValueError(f"edge ops take 'edge', 'sender' or 'receiver' operands, got {op.name}: {op.batch}")
        if len(self.operands) > _ecpu.MAX_ARRAYS:
            raise ValueError(
                f"edge kernels take at most {_ecpu.MAX_ARRAYS} operands, got {len(self.operands)} "
                "(derivatives beyond the second order of a 3-operand product need more)"
            )
        self.outputs = tuple(p.with_operands(self.operands) for p in outputs)
        self.array_ids = tuple(range(len(self.operands)))
        chan = [op.width // op.size for op in self.operands if op.size and all(cs > 0 for cs in op.cstrides)]
        if not chan:
            raise ValueError("need at least one channelwise operand to know the channel count")
        self.channels = chan[0]
        self.compiled = tuple(EdgeCompiledPolynomial(p) for p in self.outputs)
        self._derivatives: dict = {}
        self._lock = threading.Lock()

    def _make(self, operands, outputs) -> "EdgePolyOp":
        return EdgePolyOp(operands, outputs)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tensors: Sequence[torch.Tensor], graph: EdgeGraph) -> list[torch.Tensor]:  # type: ignore[override]
        """Evaluate every output; ``tensors`` follow ``operands`` (edge operands
        ``[num_edges, width]``, node operands ``[num_nodes, width]``)."""
        ref = tensors[0]
        dtype, device = ref.dtype, ref.device
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"sparse polynomial kernels support float32 and float64, got {dtype}")
        for op, t in zip(self.operands, tensors):
            rows = graph.num_edges if op.batch == "edge" else graph.num_nodes
            if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != op.width:
                raise ValueError(f"operand {op.name}: expected [{rows}, {op.width}], got {tuple(t.shape)}")
        tensors = [t.to(dtype).contiguous() for t in tensors]
        outs = []
        for comp in self.compiled:
            rows = graph.num_nodes if comp.node_output else graph.num_edges
            outs.append(torch.zeros((rows, comp.output.width), dtype=dtype, device=device))
        if graph.num_edges == 0:
            return outs  # empty graph: every message and gradient is zero
        if device.type == "cuda" and _cuda.cuda_available():
            self._evaluate_cuda(tensors, graph, outs)
        elif device.type != "cpu":
            _warn_no_cuda_target(device)
            host = [torch.zeros(o.shape, dtype=dtype) for o in outs]
            g = EdgeGraph(torch.stack([graph.sender.cpu(), graph.receiver.cpu()]), graph.num_nodes)
            self._evaluate_host([t.cpu() for t in tensors], g, host, sim=False)
            for o, h in zip(outs, host):
                o.copy_(h)
        else:
            self._evaluate_host(tensors, graph, outs, sim=_cuda.cudasim_enabled())
        return outs

    def _evaluate_host(self, tensors, graph, outs, sim: bool):
        np_dtype = "float64" if tensors[0].dtype == torch.float64 else "float32"
        dummy = np.zeros((1, 1), dtype=np_dtype)
        arrays = [t.detach().numpy() for t in tensors] + [dummy] * (_ecpu.MAX_ARRAYS - len(tensors))
        snd = graph.sender.numpy()
        rcv = graph.receiver.numpy()
        empty = np.zeros(1, dtype=np.int64)
        for comp, out in zip(self.compiled, outs):
            if comp.num_terms == 0:
                continue
            seg = tuple(a.numpy() for a in graph.csr(comp.out_kind)) if comp.node_output else None
            if sim:
                from workbench.kernels import edge_cuda

                edge_cuda.launch(comp, arrays, snd, rcv, seg, self.channels, out.numpy())
            else:
                ptr, perm = seg if seg is not None else (empty, empty)
                work = graph.num_edges * self.channels * comp.num_terms
                fn = _ecpu.evaluate_edge_cpu_serial if work < _ecpu.SERIAL_WORK else _ecpu.evaluate_edge_cpu
                fn(*arrays, snd, rcv, ptr, perm, self.channels, *comp.host_tables(np_dtype)[:7],
                                        out.numpy(), comp.out_off, comp.out_cs, _ecpu.KIND_CODES[comp.out_kind])

    def _evaluate_cuda(self, tensors, graph, outs):
        from numba import cuda

        from workbench.kernels import edge_cuda

        device = tensors[0].device
        with torch.cuda.device(device):
            stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
            dummy = cuda.as_cuda_array(torch.zeros((1, 1), dtype=tensors[0].dtype, device=device))
            arrays = [cuda.as_cuda_array(t.detach()) for t in tensors]
            arrays += [dummy] * (_ecpu.MAX_ARRAYS - len(arrays))
            snd = cuda.as_cuda_array(graph.sender)
            rcv = cuda.as_cuda_array(graph.receiver)
            for comp, out in zip(self.compiled, outs):
                seg = tuple(cuda.as_cuda_array(a) for a in graph.csr(comp.out_kind)) if comp.node_output else None
                edge_cuda.launch(comp, arrays, snd, rcv, seg, self.channels, cuda.as_cuda_array(out), stream)


class _EdgePolyFunction(torch.autograd.Function):
    """``outputs = op(graph, *tensors)``; backward launches ``op.derivative`` through this same
    function, so every order of derivative is differentiable."""

    @staticmethod
    def forward(ctx, op: EdgePolyOp, graph: EdgeGraph, *tensors: torch.Tensor):
        outs = op.evaluate(tensors, graph)
        ctx.set_materialize_grads(False)  # None cotangents let the derivative skip whole outputs
        ctx.op = op
        ctx.graph = graph
        ctx.save_for_backward(*tensors)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        needed = tuple(bool(n) for n in ctx.needs_input_grad[2:])
        present = tuple(g is not None for g in grads)
        if not any(needed) or not any(present):
            return (None, None) + (None,) * len(tensors)
        d = ctx.op.derivative(needed, present)
        cot = [g for g in grads if g is not None]
        res = list(_EdgePolyFunction.apply(d, ctx.graph, *tensors, *cot))
        out = [res.pop(0) if n else None for n in needed]
        return (None, None) + tuple(out)


def apply_edge_poly_op(op: EdgePolyOp, graph: EdgeGraph, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Differentiable evaluation of an :class:`EdgePolyOp` on ``graph``."""
    return _EdgePolyFunction.apply(op, graph, *tensors)
