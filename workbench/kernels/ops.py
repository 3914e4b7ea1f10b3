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

Dispatch: tensors on CUDA and numba's CUDA target available -> fused CUDA kernels
(:mod:`~workbench.kernels.backends.cuda`, :mod:`~workbench.kernels.backends.edge_cuda`; an edge
op's outputs in one launch per pass where :mod:`~workbench.kernels.backends.edge_pass` applies);
``WORKBENCH_KERNELS_CUDASIM=1`` with ``NUMBA_ENABLE_CUDASIM=1`` -> the same kernels in the
simulator on CPU tensors; otherwise the numba CPU path (:mod:`~workbench.kernels.backends.cpu`:
vector programs, SIMD over channels).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from workbench.kernels.backends import atom_pass as _apass
from workbench.kernels.backends import cpu as _cpu
from workbench.kernels.backends import cuda as _cuda
from workbench.kernels.backends import edge_cuda as _ecuda
from workbench.kernels.backends import edge_pass as _epass
from workbench.kernels.backends.compiled import CompiledPolynomial, TransientCache
from workbench.kernels.backends.device import cuda_available, cudasim_enabled
from workbench.kernels.descriptor.layout import EDGE_ROWS, array_ids
from workbench.kernels.descriptor.polynomial import Operand, SparsePolynomial
from workbench.kernels.options import ENV, kernel_options
from workbench.kernels.rows import EdgeGraph, RowIndex, SpeciesIndex

__all__ = [
    "CompiledPolynomial",
    "EdgeGraph",
    "EdgePolyOp",
    "PolyOp",
    "SpeciesIndex",
    "apply_edge_poly_op",
    "apply_poly_op",
]

_WARNED: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


#: set to 0 to launch an op's outputs (and their parts) one kernel each instead of one fused kernel per pass
FUSE_ENV = ENV["fuse_passes"][0]
#: set to 1 to let CUDA tensors run the CPU kernels on host copies when numba has no CUDA target
HOST_FALLBACK_ENV = ENV["host_fallback"][0]


def _no_cuda_target(device: torch.device) -> None:
    """A CUDA tensor, but numba cannot launch here: an error naming why, unless host copies are allowed."""
    from workbench.kernels.backends.device import cuda_status

    why = cuda_status()[1]
    if not kernel_options().host_fallback:
        raise RuntimeError(
            f"workbench.kernels: {device} tensors, but {why}. Install numba-cuda (the [cuda] extra) with a "
            f"working driver, convert back with accelerate(model, backend='e3nn'), or set {HOST_FALLBACK_ENV}=1 "
            "to run the CPU kernels on host copies (correct, slow)"
        )
    _warn_once(f"workbench.kernels: {device} tensors run the CPU kernels on host copies ({HOST_FALLBACK_ENV}=1): {why}")


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
        self, tensors: Sequence[torch.Tensor], index: RowIndex, backend: str = "numba"
    ) -> list[torch.Tensor]:
        """:meth:`evaluate` with the row index given as one object; ``backend``: a registered
        ``"descriptor"`` backend (:mod:`workbench.kernels.registry`), numba's dispatch by default."""
        if isinstance(index, EdgeGraph) != self.edge:
            raise TypeError(f"{'edge' if self.edge else 'atom'} op evaluated with a {type(index).__name__}")
        ref = tensors[0]
        dtype, device = ref.dtype, ref.device
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"sparse polynomial kernels support float32 and float64, got {dtype}")
        index.check(self.operands, tensors)
        channels = self.channels if self.edge else tensors[0].shape[1] // self.operands[0].size
        tensors = [t.to(dtype).contiguous() for t in tensors]
        on_gpu = device.type == "cuda" and cuda_available()
        kernels = on_gpu or (device.type == "cpu" and cudasim_enabled())
        if self.edge and index.num_edges == 0:  # empty graph: every message and gradient is zero
            return [
                torch.zeros((index.num_rows(c.out_rows), c.output.width), dtype=dtype, device=device)
                for c in self.compiled
            ]
        if backend != "numba":
            return _evaluator(backend)([c.poly for c in self.compiled], tensors, index, channels)
        outs = [self._output(c, index, dtype, device, kernels) for c in self.compiled]
        if on_gpu:
            self._run_cuda(tensors, index, channels, outs)
        elif device.type != "cpu":
            _no_cuda_target(device)
            host = [torch.zeros(o.shape, dtype=dtype) for o in outs]
            self._run_host([t.cpu() for t in tensors], index.cpu(), channels, host, sim=False)
            for o, h in zip(outs, host):
                o.copy_(h)
        else:
            self._run_host(tensors, index, channels, outs, sim=kernels)
        return outs

    def _output(self, comp: CompiledPolynomial, index: RowIndex, dtype, device, kernels: bool) -> torch.Tensor:
        """The output of ``comp``: uninitialised where the kernels write every element
        (poisoned with NaN under the simulator and with ``WORKBENCH_KERNELS_POISON=1``, so a
        missed element fails the parity tests), zeros for the accumulating kernels."""
        shape = (index.num_rows(comp.out_rows), comp.output.width)
        if comp.num_terms == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        if not kernels:  # the CPU row passes store every row, and sum species outputs whole
            return (
                _cpu_output(shape, dtype)
                if comp.covers_output or comp.species_output
                else torch.zeros(shape, dtype=dtype)
            )
        full = comp.species_output or (_ecuda if self.edge else _cuda).writes_every_element(comp, _dtype_name(dtype))
        return _uninitialised(shape, dtype, device) if full else torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def _partial(comp: CompiledPolynomial, index: RowIndex, out: torch.Tensor) -> torch.Tensor | None:
        """Per-atom partial rows of a species output (summed per species by the CUDA path)."""
        if not comp.species_output:
            return None
        shape = (int(index.species.shape[0]), comp.output.width)
        if _cuda.writes_every_element(comp, _dtype_name(out.dtype)):
            return _uninitialised(shape, out.dtype, out.device)
        return torch.zeros(shape, dtype=out.dtype, device=out.device)

    def _arrays(self, tensors, dummy, convert, num_arrays: int) -> list:
        args = [dummy] * num_arrays
        for aid, t in zip(self.array_ids, tensors):
            args[aid] = convert(t.detach())
        return args

    def _run_host(self, tensors, index: RowIndex, channels: int, outs, sim: bool) -> None:
        """numba CPU kernels, or (``sim``) the CUDA kernels in the simulator, on numpy views."""
        dummy = np.zeros((1, 1), dtype="float64" if tensors[0].dtype == torch.float64 else "float32")
        arrays = self._arrays(tensors, dummy, lambda t: t.numpy(), _cpu.NUM_ARRAYS if not sim else index.num_arrays)
        if not sim:
            self._run_cpu(arrays, index, channels, [o.numpy() for o in outs])
            return
        fused = self._launch_pass(arrays, index, channels, outs, lambda t: t.numpy(), 0)
        for k, (comp, out) in enumerate(zip(self.compiled, outs)):
            if comp.num_terms == 0 or k in fused:
                continue
            idx = index.arrays(comp, lambda t: t.numpy())
            self._launch(comp, arrays, idx, index, channels, out, lambda t: t.numpy(), 0)

    def cpu_plan(self, channels: int) -> _cpu.CpuPlan:
        """The CPU row passes of this op's outputs (vector programs, built once per channel count)."""
        return self._cached(
            ("cpu", channels), lambda: _cpu.plan([c.poly for c in self.compiled], self.array_ids, channels)
        )

    def _run_cpu(self, arrays, index: RowIndex, channels: int, outs) -> None:
        cp = self.cpu_plan(channels)
        if self.edge:
            _cpu.run_edge(
                cp,
                arrays,
                index.sender.numpy(),
                index.receiver.numpy(),
                lambda rows: tuple(t.numpy() for t in index.csr(rows)),
                index.num_nodes,
                channels,
                outs,
            )
        else:
            _cpu.run_atom(cp, arrays, index.species.detach().to(torch.int64).numpy(), index.num_species, channels, outs)

    def _run_cuda(self, tensors, index: RowIndex, channels: int, outs) -> None:
        from numba import cuda

        device = tensors[0].device
        with torch.cuda.device(device):
            stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
            dummy = cuda.as_cuda_array(torch.zeros((1, 1), dtype=tensors[0].dtype, device=device))
            arrays = self._arrays(tensors, dummy, cuda.as_cuda_array, index.num_arrays)
            fused = self._launch_pass(arrays, index, channels, outs, cuda.as_cuda_array, stream)
            for k, (comp, out) in enumerate(zip(self.compiled, outs)):
                if k in fused:
                    continue
                idx = index.arrays(comp, cuda.as_cuda_array)
                self._launch(comp, arrays, idx, index, channels, out, cuda.as_cuda_array, stream)

    def _launch_pass(
        self, arrays, index: RowIndex, channels: int, outs, convert: Callable[[torch.Tensor], Any], stream
    ) -> tuple[int, ...]:
        """The outputs of the pass in one launch (:mod:`~workbench.kernels.backends.edge_pass`,
        :mod:`~workbench.kernels.backends.atom_pass`: then a per-species sum of each weight
        gradient) when it applies (``WORKBENCH_FUSE_PASSES=0``: never); the indices of those it
        computed."""
        if not kernel_options().fuse_passes:
            return ()
        if not self.edge:
            kernels = _apass.pass_kernels(self.compiled, _dtype_name(outs[0].dtype))
            if kernels is None:
                return ()  # before allocating partials the per-output launches would allocate again
            partials = [self._partial(c, index, o) for c, o in zip(self.compiled, outs)]
            return _apass.launch(
                self.compiled,
                arrays,
                *index.arrays(self.compiled[0], convert),
                channels,
                [convert(o) for o in outs],
                [None if p is None else convert(p) for p in partials],
                tuple(convert(t) for t in index.csr()) if any(c.species_output for c in self.compiled) else None,
                stream,
                kernels,
            )
        planned = _epass.plan(
            self.compiled,
            arrays,
            convert(index.sender),
            convert(index.receiver),
            lambda rows: tuple(convert(t) for t in index.csr(rows)),
            channels,
            [convert(o) for o in outs],
        )
        return _epass.launch(planned, stream)

    def _launch(
        self,
        comp: CompiledPolynomial,
        arrays,
        idx,
        index: RowIndex,
        channels: int,
        out: torch.Tensor,
        convert: Callable[[torch.Tensor], Any],
        stream,
    ) -> None:
        """One output through the CUDA kernels (or the simulator): ``convert`` hands tensors over."""
        if self.edge:
            _ecuda.launch(comp, arrays, *idx, channels, convert(out), stream)
            return
        partial = self._partial(comp, index, out)
        _cuda.launch(
            comp,
            arrays,
            *idx,
            channels,
            convert(out),
            stream,
            partial=None if partial is None else convert(partial),
            csr=tuple(convert(t) for t in index.csr()) if comp.species_output else None,
        )


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


def _dtype_name(dtype: torch.dtype) -> str:
    return "float64" if dtype == torch.float64 else "float32"


#: set to 1 to fill the CPU kernels' uninitialised outputs with NaN (the tests do)
POISON_ENV = ENV["poison"][0]


def _cpu_output(shape: tuple, dtype) -> torch.Tensor:
    if kernel_options().poison:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def _uninitialised(shape: tuple, dtype, device) -> torch.Tensor:
    if device.type == "cpu":  # the simulator: NaN, so an element a kernel misses cannot pass a test
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.empty(shape, dtype=dtype, device=device)


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
    function, so every order of derivative is differentiable."""

    @staticmethod
    def forward(ctx, op: PolyOp, index: RowIndex, backend: str, *tensors: torch.Tensor):
        outs = op.evaluate_rows(tensors, index, backend)
        ctx.set_materialize_grads(False)  # None cotangents let the derivative skip whole outputs
        ctx.op = op
        ctx.index = index
        ctx.backend = backend
        ctx.save_for_backward(*tensors)
        return tuple(outs)

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
    op: PolyOp, species: torch.Tensor, num_species: int, *tensors: torch.Tensor, backend: str = "numba"
) -> tuple[torch.Tensor, ...]:
    """Differentiable evaluation of an atom ``op`` (see :class:`PolyOp`) with a descriptor ``backend``."""
    return _SparsePolyFunction.apply(op, SpeciesIndex(species, num_species), backend, *tensors)


def apply_edge_poly_op(
    op: PolyOp, graph: EdgeGraph, *tensors: torch.Tensor, backend: str = "numba"
) -> tuple[torch.Tensor, ...]:
    """Differentiable evaluation of an edge ``op`` (an :class:`EdgePolyOp`) on ``graph``."""
    return _SparsePolyFunction.apply(op, graph, backend, *tensors)
