r"""Executable sparse-polynomial ops and their infinitely differentiable autograd wrapper.

A :class:`PolyOp` is a list of :class:`~workbench.kernels.descriptor.SparsePolynomial`
outputs over one operand list. Each operand's rows are indexed one way
(:data:`~workbench.kernels.descriptor.ROWS`); the indices live in a *row index* passed at
evaluation:

* :class:`SpeciesIndex` (atom ops): ``"atom"`` operands ``[num_atoms, width]``, ``"species"``
  operands ``[num_species, width]`` read at the atom's species (summed over atoms as outputs);
* :class:`EdgeGraph` (edge ops, message passing): ``"edge"`` operands ``[num_edges, width]``,
  ``"sender"`` / ``"receiver"`` operands ``[num_nodes, width]`` read at the edge's sender
  :math:`s_e` / receiver :math:`r_e`. An output of rows ``"receiver"`` is
  :math:`\mathrm{out}[n, c, o] = \sum_{e : r_e = n} P(\text{rows of } e)`: gather, product and
  scatter-sum in one pass.

:meth:`PolyOp.derivative` builds, from the same terms, the op that maps ``(operands, output
cotangents)`` to the cotangent of every operand (:meth:`SparsePolynomial.vjp`; the derivative
of a gathered operand is the scatter-sum through the same index and vice versa), so the one
autograd function below differentiates itself: backward is a :class:`PolyOp` launched through
the same function, hence double backward (and beyond) come for free.

Evaluation goes through the backend registry (:mod:`workbench.kernels.registry`): a
``"descriptor"`` backend's ``evaluate(op, tensors, index, channels)`` computes the outputs, and
this module only checks the inputs and differentiates. The default backend's kernels and their
dispatch (CPU, CUDA, the CUDA simulator) are :mod:`workbench.kernels.numba`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from workbench.kernels.descriptor.layout import EDGE_ROWS, array_ids
from workbench.kernels.descriptor.polynomial import Operand, SparsePolynomial
from workbench.kernels.library import op_key, register, sparse_poly, tracing
from workbench.kernels.numba.compiled import CompiledPolynomial, TransientCache
from workbench.kernels.registry import DEFAULT_BACKEND
from workbench.kernels.rows import EdgeGraph, RowIndex, SpeciesIndex

__all__ = [
    "CompiledPolynomial",
    "EdgeGraph",
    "EdgePolyOp",
    "PolyOp",
    "SpeciesIndex",
    "apply_edge_poly_op",
    "apply_poly_op",
    "edge_poly_op",
]


class PolyOp(TransientCache):
    r"""Several sparse polynomials over one operand list, evaluated together.

    Parameters
    ----------
    operands : sequence of :class:`Operand`
        atom ops: at most 6 ``"atom"`` and 4 ``"species"`` operands; edge ops: at most 8
        ``"edge"`` / ``"sender"`` / ``"receiver"`` operands
    outputs : sequence of :class:`SparsePolynomial`
        each over (a subset of) ``operands``, matched by name
    """

    def __init__(self, operands: Sequence[Operand], outputs: Sequence[SparsePolynomial]):
        self.operands = tuple(operands)
        self.array_ids = array_ids([op.rows for op in self.operands])
        self.edge = all(op.rows in EDGE_ROWS for op in self.operands)
        self.outputs = tuple(p.with_operands(self.operands) for p in outputs)
        chan = [op.width // op.size for op in self.operands if op.size and all(cs > 0 for cs in op.cstrides)]
        if self.edge and not chan:
            raise ValueError("need at least one channelwise operand to know the channel count")
        self.channels = chan[0] if chan else None
        self.compiled = tuple(CompiledPolynomial(p, self.array_ids) for p in self.outputs)
        self._init_cache()
        self.library_key = register(self)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("library_key", None)  # a key names an op in one process only
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.library_key = register(self)

    def derivative(self, needed: tuple[bool, ...], present: tuple[bool, ...] | None = None) -> PolyOp:
        r"""Op for :math:`(\text{operands}, \bar{y}_k \text{ for present } k) \mapsto \bar{a}` for
        each operand ``a`` with ``needed[a]``: :math:`\bar{a} = \sum_k \mathrm{vjp}_a(P_k)(\bar{y}_k)`.

        ``present[k]`` is False for an output whose cotangent is known to be zero (autograd gave
        None): its terms are left out. In force training the weight gradient of the force
        computation is never used, so the double backward skips all of its terms.
        Cached per ``(needed, present)``; the derivative is an op of the same class."""
        if present is None:
            present = (True,) * len(self.outputs)
        return self._cached((needed, present), lambda: self._derivative(needed, present))

    def _derivative(self, needed: tuple[bool, ...], present: tuple[bool, ...]) -> PolyOp:
        cots = []
        names = {op.name for op in self.operands}
        for p, keep in zip(self.outputs, present):
            name = f"d({p.output.name})"
            while name in names:
                name += "'"
            names.add(name)
            cots.append(p.output.renamed(name) if keep else None)
        ops = self.operands + tuple(c for c in cots if c is not None)
        outs = []
        for a, op in enumerate(self.operands):
            if not needed[a]:
                continue
            total = SparsePolynomial(ops, op.renamed(f"d({op.name})"), {})
            for p, cot in zip(self.outputs, cots):
                if cot is not None:
                    total = total + p.vjp(op.name, cot).with_operands(ops)
            outs.append(total)
        return type(self)(ops, outs)

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        tensors: Sequence[torch.Tensor],
        species: torch.Tensor | None = None,
        num_species: int = 0,
        *,
        graph: EdgeGraph | None = None,
    ) -> list[torch.Tensor]:
        """Evaluate every output. ``tensors`` follow ``operands``. Atom ops take ``species``
        ``[num_atoms]`` and ``num_species``, edge ops ``graph`` (see the module docstring)."""
        return self.evaluate_rows(tensors, graph if graph is not None else SpeciesIndex(species, num_species))

    def evaluate_rows(
        self, tensors: Sequence[torch.Tensor], index: RowIndex, backend: str = DEFAULT_BACKEND
    ) -> list[torch.Tensor]:
        """:meth:`evaluate` with the row index given as one object; ``backend``: a registered
        ``"descriptor"`` backend (:mod:`workbench.kernels.registry`)."""
        if isinstance(index, EdgeGraph) != self.edge:
            raise TypeError(f"{'edge' if self.edge else 'atom'} op evaluated with a {type(index).__name__}")
        ref = tensors[0]
        dtype, device = ref.dtype, ref.device
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"sparse polynomial kernels support float32 and float64, got {dtype}")
        index.check(self.operands, tensors)
        channels = self.channels if self.edge else tensors[0].shape[1] // self.operands[0].size
        tensors = [t.to(dtype).contiguous() for t in tensors]
        if self.edge and index.num_edges == 0:  # empty graph: every message and gradient is zero
            return [
                torch.zeros((index.num_rows(c.out_rows), c.output.width), dtype=dtype, device=device)
                for c in self.compiled
            ]
        return _evaluator(backend)(self, tensors, index, channels)


def _evaluator(backend: str) -> Callable:
    """The evaluate function of a registered descriptor backend."""
    from workbench.kernels.registry import backend_names, get_backend

    b = get_backend(backend)
    evaluate = b.evaluator()
    if b.kind != "descriptor" or evaluate is None:
        raise ValueError(
            f"backend {backend!r} does not evaluate descriptor polynomials; choose one of {backend_names('descriptor')}"
        )
    return evaluate


class EdgePolyOp(PolyOp):
    r"""A :class:`PolyOp` over edge / sender / receiver operands, evaluated with gather and
    scatter fused (see the module docstring); the constructor checks the operands' rows.

    Parameters
    ----------
    operands : sequence of :class:`Operand`
        at most 8, each with rows ``"edge"``, ``"sender"`` or ``"receiver"``
    outputs : sequence of :class:`SparsePolynomial`
        each over (a subset of) ``operands``, matched by name
    """

    def __init__(self, operands: Sequence[Operand], outputs: Sequence[SparsePolynomial]):
        for op in operands:
            if op.rows not in EDGE_ROWS:
                raise ValueError(f"edge ops take 'edge', 'sender' or 'receiver' operands, got {op.name}: {op.rows}")
        super().__init__(operands, outputs)


def engine_uses(ctx, i: int) -> bool:
    """Whether this backward run will use the gradient of tensor input ``i``. ``needs_input_grad``
    says only that it requires grad: forces (``autograd.grad`` to positions) need no gradient
    toward an input that reaches only weights, e.g. the first layer's node features. Under
    ``autograd.grad`` torch refuses the query for a leaf the run asks for, and a torch without
    the query cannot answer at all: then the input counts as used."""
    node = ctx.next_functions[i][0]
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):
        return True


def used_inputs(ctx, first: int = 0) -> tuple[bool, ...]:
    """For each tensor input of a custom Function (``needs_input_grad[first:]``; the earlier
    arguments are not tensors): whether it requires grad and this backward run uses it
    (:func:`engine_uses`), where the inputs line up with ``ctx.next_functions``; else
    ``needs_input_grad`` alone."""
    requires = ctx.needs_input_grad[first:]
    if len(ctx.next_functions) != len(requires):
        return tuple(bool(n) for n in requires)
    return tuple(bool(n) and engine_uses(ctx, i) for i, n in enumerate(requires))


class _SparsePolyFunction(torch.autograd.Function):
    """``outputs = op(index, *tensors)``; backward launches ``op.derivative`` through this same
    function, so every order of derivative is differentiable. Under ``vmap`` (mace's Hessians
    batch the second backward over cotangents) a batch of ``B`` is one call on ``B`` disjoint
    copies of the rows (:meth:`~workbench.kernels.rows.EdgeGraph.copies`)."""

    @staticmethod
    def forward(op: PolyOp, index: RowIndex, backend: str, *tensors: torch.Tensor):
        return tuple(op.evaluate_rows(tensors, index, backend))

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, index, backend, *tensors = inputs
        ctx.set_materialize_grads(False)  # None cotangents let the derivative skip whole outputs
        ctx.op, ctx.index, ctx.backend = op, index, backend
        ctx.save_for_backward(*tensors)

    @staticmethod
    def vmap(info, in_dims, op: PolyOp, index: RowIndex, backend: str, *tensors: torch.Tensor):
        size, rows = info.batch_size, []
        for t, d in zip(tensors, in_dims[3:]):
            t = t.movedim(d, 0) if d is not None else t.expand(size, *t.shape)
            rows.append(t.reshape(size * t.shape[1], t.shape[2]))
        outs = _SparsePolyFunction.apply(op, index.copies(size), backend, *rows)
        return tuple(o.reshape(size, -1, o.shape[-1]) for o in outs), (0,) * len(outs)

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        needed = used_inputs(ctx, 3)
        present = tuple(g is not None for g in grads)
        if not any(needed) or not any(present):
            return (None, None, None) + (None,) * len(tensors)
        d = ctx.op.derivative(needed, present)
        cot = [g for g in grads if g is not None]
        res = list(_SparsePolyFunction.apply(d, ctx.index, ctx.backend, *tensors, *cot))
        out = [res.pop(0) if n else None for n in needed]
        return (None, None, None) + tuple(out)


def apply_poly_op(
    op: PolyOp, species: torch.Tensor, num_species: int, *tensors: torch.Tensor, backend: str = DEFAULT_BACKEND
) -> tuple[torch.Tensor, ...]:
    """Differentiable evaluation of an atom ``op`` (see :class:`PolyOp`) with a descriptor
    ``backend``; under ``torch.compile`` / ``torch.export``, the custom op of
    :mod:`workbench.kernels.library`."""
    if tracing():
        return tuple(sparse_poly(op_key(op), backend, species, None, num_species, list(tensors)))
    return _SparsePolyFunction.apply(op, SpeciesIndex(species, num_species), backend, *tensors)


def apply_edge_poly_op(
    op: PolyOp, graph: EdgeGraph, *tensors: torch.Tensor, backend: str = DEFAULT_BACKEND
) -> tuple[torch.Tensor, ...]:
    """Differentiable evaluation of an edge ``op`` (an :class:`EdgePolyOp`) on ``graph``."""
    return _SparsePolyFunction.apply(op, graph, backend, *tensors)


def edge_poly_op(
    op: PolyOp,
    sender: torch.Tensor,
    receiver: torch.Tensor,
    num_nodes: int,
    *tensors: torch.Tensor,
    backend: str = DEFAULT_BACKEND,
) -> tuple[torch.Tensor, ...]:
    """:func:`apply_edge_poly_op` on the graph of ``sender`` / ``receiver`` ``[edges]`` over
    ``num_nodes`` nodes (shared by a forward's layers: :meth:`EdgeGraph.of`); under
    ``torch.compile`` / ``torch.export``, the custom op of :mod:`workbench.kernels.library`."""
    if tracing():
        return tuple(sparse_poly(op_key(op), backend, sender, receiver, num_nodes, list(tensors)))
    return _SparsePolyFunction.apply(op, EdgeGraph.of(sender, receiver, num_nodes), backend, *tensors)
