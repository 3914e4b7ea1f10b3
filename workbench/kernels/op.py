r"""Executable sparse-polynomial ops and their infinitely differentiable autograd wrapper.

A :class:`PolyOp` is a list of :class:`~workbench.kernels.descriptor.SparsePolynomial`
outputs over one operand list. :meth:`PolyOp.derivative` builds, from the same terms, the
op that maps ``(operands, output cotangents)`` to the cotangent of every operand, so the
autograd function below differentiates itself: backward is a :class:`PolyOp` launched
through the same function, hence double backward (and beyond) come for free.

Dispatch: tensors on CUDA and numba's CUDA target available -> fused CUDA kernel
(:mod:`workbench.kernels.cuda`); otherwise the numba CPU path (:mod:`workbench.kernels.cpu`).
"""

from __future__ import annotations

import threading
import warnings
from typing import Sequence

import numpy as np
import torch

from workbench.kernels import cpu as _cpu
from workbench.kernels import cuda as _cuda
from workbench.kernels.descriptor import Operand, SparsePolynomial
from workbench.kernels.tables import CompiledTables, term_table

__all__ = ["CompiledPolynomial", "PolyOp", "apply_poly_op"]

_WARNED: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _warn_no_cuda_target(device: torch.device) -> None:
    # no numba CUDA target here (e.g. numba-cuda not installed): correct but slow
    _warn_once(
        f"workbench.kernels: no numba CUDA target for {device} tensors; running the CPU path "
        "on host copies. Install numba-cuda (the [cuda] extra) or convert back with "
        "accelerate(model, backend='e3nn')."
    )


class CompiledPolynomial(CompiledTables):
    """Term tables of one output polynomial, ready for the kernels.

    Slots are the operand components the polynomial actually uses; ``slot_src`` says in which
    of the 10 kernel array arguments (0-5 atom, 6-9 species) each one lives.
    """

    def __init__(self, poly: SparsePolynomial, array_ids: Sequence[int]):
        species_kind = [int(i >= _cpu.MAX_ATOM_ARRAYS) for i in array_ids]
        super().__init__(poly, term_table(poly, array_ids, species_kind))
        self.species_output = poly.output.batch == "species"

    def host_tables(self, dtype: str) -> tuple:
        t = self.table
        return (t.slot_arr, t.slot_off, t.slot_cs, t.t_out, t.t_fac, self._coef[dtype], t.out_off, t.out_cs)


class PolyOp:
    r"""Several sparse polynomials over one operand list, evaluated together.

    Parameters
    ----------
    operands : sequence of :class:`Operand`
        at most 6 atom and 4 species operands
    outputs : sequence of :class:`SparsePolynomial`
        each over (a subset of) ``operands``, matched by name
    """

    def __init__(self, operands: Sequence[Operand], outputs: Sequence[SparsePolynomial]):
        self.operands = tuple(operands)
        self.outputs = tuple(p.with_operands(self.operands) for p in outputs)
        n_atom = sum(op.batch == "atom" for op in self.operands)
        n_species = len(self.operands) - n_atom
        if n_atom > _cpu.MAX_ATOM_ARRAYS or n_species > _cpu.MAX_SPECIES_ARRAYS:
            raise ValueError(f"too many operands for the kernels: {n_atom} atom, {n_species} species")
        ids, ia, isp = [], 0, 0
        for op in self.operands:
            if op.batch == "atom":
                ids.append(ia)
                ia += 1
            else:
                ids.append(_cpu.MAX_ATOM_ARRAYS + isp)
                isp += 1
        self.array_ids = tuple(ids)
        self.compiled = tuple(CompiledPolynomial(p, ids) for p in self.outputs)
        self._derivatives: dict = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_derivatives"] = {}
        state.pop("_lock")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def derivative(self, needed: tuple[bool, ...], present: tuple[bool, ...] | None = None) -> "PolyOp":
        r"""Op for :math:`(\text{operands}, \bar{y}_k \text{ for present } k) \mapsto \bar{a}` for
        each operand ``a`` with ``needed[a]``: :math:`\bar{a} = \sum_k \mathrm{vjp}_a(P_k)(\bar{y}_k)`.

        ``present[k]`` is False for an output whose cotangent is known to be zero (autograd gave
        None): its terms are left out. In force training the weight gradient of the force
        computation is never used, so the double backward skips all of its terms.
        Cached per ``(needed, present)``."""
        if present is None:
            present = (True,) * len(self.outputs)
        key = (needed, present)
        with self._lock:
            if key in self._derivatives:
                return self._derivatives[key]
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
        d = self._make(ops, outs)
        with self._lock:
            self._derivatives[key] = d
        return d

    def _make(self, operands, outputs) -> "PolyOp":
        """A new op of this kind (subclasses with other row kinds reuse :meth:`derivative`)."""
        return PolyOp(operands, outputs)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tensors: Sequence[torch.Tensor], species: torch.Tensor, num_species: int) -> list[torch.Tensor]:
        """Evaluate every output. ``tensors`` follow ``operands``: atom operands
        ``[num_atoms, width]``, species operands ``[num_species, width]``; ``species``: ``[num_atoms]``."""
        ref = tensors[0]
        dtype, device = ref.dtype, ref.device
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"sparse polynomial kernels support float32 and float64, got {dtype}")
        B = species.shape[0]
        C = self._channels(tensors)
        tensors = [t.to(dtype).contiguous() for t in tensors]
        outs = []
        for comp in self.compiled:
            rows = num_species if comp.species_output else B
            outs.append(torch.zeros((rows, comp.output.width), dtype=dtype, device=device))
        if device.type == "cuda" and _cuda.cuda_available():
            self._evaluate_cuda(tensors, species, C, outs)
        elif device.type != "cpu":
            _warn_no_cuda_target(device)
            host = [torch.zeros(o.shape, dtype=dtype) for o in outs]
            self._evaluate_cpu([t.cpu() for t in tensors], species.cpu(), C, host)
            for o, h in zip(outs, host):
                o.copy_(h)
        elif _cuda.cudasim_enabled():
            self._evaluate_cudasim(tensors, species, C, outs)
        else:
            self._evaluate_cpu(tensors, species, C, outs)
        return outs

    def _channels(self, tensors: Sequence[torch.Tensor]) -> int:
        # width = channels * size for every layout the workbench builds
        op, t = self.operands[0], tensors[0]
        return t.shape[1] // op.size

    def _slots(self, tensors, dummy, convert):
        args = [dummy] * (_cpu.MAX_ATOM_ARRAYS + _cpu.MAX_SPECIES_ARRAYS)
        for aid, t in zip(self.array_ids, tensors):
            args[aid] = convert(t)
        return args

    def _evaluate_cpu(self, tensors, species, C, outs):
        np_dtype = "float64" if tensors[0].dtype == torch.float64 else "float32"
        dummy = np.zeros((1, 1), dtype=np_dtype)
        args = self._slots(tensors, dummy, lambda t: t.detach().numpy())
        sp = species.detach().to(torch.int64).contiguous().numpy()
        for comp, out in zip(self.compiled, outs):
            if comp.num_terms == 0:
                continue
            _cpu.evaluate_cpu(*args, sp, C, *comp.host_tables(np_dtype)[:6], out.numpy(), comp.out_off, comp.out_cs, comp.species_output)

    def _evaluate_cudasim(self, tensors, species, C, outs):
        np_dtype = "float64" if tensors[0].dtype == torch.float64 else "float32"
        dummy = np.zeros((1, 1), dtype=np_dtype)
        args = self._slots(tensors, dummy, lambda t: t.detach().numpy())
        sp = species.detach().to(torch.int64).contiguous().numpy()
        for comp, out in zip(self.compiled, outs):
            _cuda.launch(comp, args, sp, C, out.numpy())

    def _evaluate_cuda(self, tensors, species, C, outs):
        from numba import cuda

        device = tensors[0].device
        with torch.cuda.device(device):
            stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
            dummy = torch.zeros((1, 1), dtype=tensors[0].dtype, device=device)
            args = self._slots(tensors, cuda.as_cuda_array(dummy.detach()), lambda t: cuda.as_cuda_array(t.detach()))
            sp_t = species.detach().to(torch.int64).contiguous()
            sp = cuda.as_cuda_array(sp_t)
            for comp, out in zip(self.compiled, outs):
                _cuda.launch(comp, args, sp, C, cuda.as_cuda_array(out), stream)


class _SparsePolyFunction(torch.autograd.Function):
    """``outputs = op(*tensors)``; backward launches ``op.derivative`` through this same
    function, so every order of derivative is differentiable."""

    @staticmethod
    def forward(ctx, op: PolyOp, species: torch.Tensor, num_species: int, *tensors: torch.Tensor):
        outs = op.evaluate(tensors, species, num_species)
        ctx.set_materialize_grads(False)  # None cotangents let the derivative skip whole outputs
        ctx.op = op
        ctx.num_species = num_species
        ctx.save_for_backward(species, *tensors)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        species, *tensors = ctx.saved_tensors
        needed = tuple(bool(n) for n in ctx.needs_input_grad[3:])
        if not any(needed):
            return (None, None, None) + (None,) * len(tensors)
        present = tuple(g is not None for g in grads)
        if not any(present):
            return (None, None, None) + (None,) * len(tensors)
        d = ctx.op.derivative(needed, present)
        cot = [g for g in grads if g is not None]
        res = list(_SparsePolyFunction.apply(d, species, ctx.num_species, *tensors, *cot))
        out = []
        for n in needed:
            out.append(res.pop(0) if n else None)
        return (None, None, None) + tuple(out)


def apply_poly_op(op: PolyOp, species: torch.Tensor, num_species: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Differentiable evaluation of ``op`` (see :class:`PolyOp`)."""
    return _SparsePolyFunction.apply(op, species, num_species, *tensors)
