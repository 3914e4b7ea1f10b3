r"""The ``torch`` backend: a sparse polynomial evaluated with plain torch gathers and ``index_add_``.

It reads nothing but the descriptor (:class:`~workbench.kernels.descriptor.SparsePolynomial`), so
it is the reference every other backend is tested against, and the smallest example of a
backend: this module plus one registration line in :mod:`workbench.kernels.registry`.

For each output polynomial :math:`P` and each loop row :math:`r` (an atom, or an edge):

.. math::

    y[\rho(r), c, o] \mathrel{+}= \sum_{(o, f) \in P} \alpha_{o,f} \prod_{(a, i) \in f} x_a[\rho_a(r), c, i]

where :math:`\rho_a` picks operand :math:`a`'s row (the atom, its species, the edge, its sender or
receiver) and :math:`\rho` the output's (a per-species or per-node output is summed with
``index_add_``). Terms of equal degree are evaluated together, in chunks of
:data:`TERMS_PER_CHUNK` terms, as ``[rows, channels, terms]`` products: memory stays bounded, and
no loop runs per row or channel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from workbench.kernels.descriptor.polynomial import Operand, SparsePolynomial

__all__ = ["TERMS_PER_CHUNK", "evaluate"]

#: terms multiplied at once; bounds the ``[rows, channels, terms]`` temporary
TERMS_PER_CHUNK = 256


def _loop_rows(index: Any) -> tuple[int, dict[str, torch.Tensor | None]]:
    """Rows the polynomial loops over, and per kind of operand rows the gather index (``None``:
    the loop row itself)."""
    if hasattr(index, "sender"):  # an edge graph
        return index.num_edges, {"edge": None, "sender": index.sender, "receiver": index.receiver}
    species = index.species.detach().to(torch.int64)
    return int(species.shape[0]), {"atom": None, "species": species}


@functools.lru_cache(maxsize=4096)
def _constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, made once: a CUDA-graph capture (which the warm-up
    precedes) can copy nothing from the host, and each copy would cost a sync anyway."""
    return torch.tensor(values, dtype=dtype, device=device)


def _columns(op: Operand, channels: int, device: torch.device) -> torch.Tensor:
    """``[channels, size]`` column of element ``(c, i)`` in a row of ``op``'s array."""
    off = _constant(tuple(op.offsets), torch.int64, device)
    cs = _constant(tuple(op.cstrides), torch.int64, device)
    return off[None, :] + torch.arange(channels, device=device)[:, None] * cs[None, :]


def _gathered(tensors: Sequence[torch.Tensor], poly: SparsePolynomial, gathers: dict, channels: int) -> torch.Tensor:
    """All operands read at the loop rows, concatenated along components: ``[rows, channels, sum(size)]``."""
    parts = []
    for op, t in zip(poly.operands, tensors):
        rows = t if gathers[op.rows] is None else t.index_select(0, gathers[op.rows])
        parts.append(rows[:, _columns(op, channels, t.device)])
    return torch.cat(parts, dim=2)


def _accumulate(poly: SparsePolynomial, x: torch.Tensor) -> torch.Tensor:
    """``[rows, channels, output size]``: every term of ``poly`` on the gathered operands ``x``."""
    starts = [0]
    for op in poly.operands:
        starts.append(starts[-1] + op.size)
    by_degree: dict[int, list] = {}
    for (o, factors), coeff in poly.terms.items():
        by_degree.setdefault(len(factors), []).append((o, [starts[a] + i for a, i in factors], coeff))
    acc = x.new_zeros(x.shape[0], x.shape[1], poly.output.size)
    for degree, terms in sorted(by_degree.items()):
        for lo in range(0, len(terms), TERMS_PER_CHUNK):
            chunk = terms[lo : lo + TERMS_PER_CHUNK]
            out = _constant(tuple(o for o, _, _ in chunk), torch.int64, x.device)
            coef = _constant(tuple(c for _, _, c in chunk), x.dtype, x.device)
            if degree == 0:
                value = coef.expand(x.shape[0], x.shape[1], -1)
            else:
                factors = _constant(tuple(tuple(f) for _, f, _ in chunk), torch.int64, x.device)
                value = x[:, :, factors].prod(dim=-1) * coef
            acc.index_add_(2, out, value)
    return acc


def _store(acc: torch.Tensor, output: Operand, target: torch.Tensor | None, out: torch.Tensor) -> None:
    """Write ``acc`` ``[rows, channels, size]`` into ``out``'s columns, summed into rows ``target``
    when given; a zero channel stride sums over channels."""
    channels = acc.shape[1]
    cols = _columns(output, channels, out.device).reshape(-1)
    flat = out.new_zeros(acc.shape[0], out.shape[1]).index_add_(1, cols, acc.reshape(acc.shape[0], -1))
    if target is None:
        out.copy_(flat)
    else:
        out.zero_().index_add_(0, target, flat)


def evaluate(op: Any, tensors: Sequence[torch.Tensor], index: Any, channels: int) -> list:
    """Every output of ``op`` (a :class:`~workbench.kernels.ops.PolyOp`: its polynomials
    ``op.outputs`` over the same ``tensors``), with ``index`` a
    :class:`~workbench.kernels.ops.SpeciesIndex` or :class:`~workbench.kernels.ops.EdgeGraph`.

    Returns one ``[output rows, output width]`` tensor per polynomial, in the operands' dtype and
    device. Runs without autograd: :class:`~workbench.kernels.ops.PolyOp` differentiates itself.
    """
    num_rows, gathers = _loop_rows(index)
    outs = []
    with torch.no_grad():
        for poly in op.outputs:
            rows = index.num_rows(poly.output.rows)
            out = tensors[0].new_zeros(rows, poly.output.width)
            if poly.terms and num_rows:
                x = _gathered(tensors, poly, gathers, channels)
                _store(_accumulate(poly, x), poly.output, gathers[poly.output.rows], out)
            outs.append(out)
    return outs
