r"""mace's ``reshape_irreps`` as one column permutation (the module swapped in place).

Every mace interaction ends with ``reshape_irreps``: the message ``[N, dim]`` (irrep blocks
``mul x d``, each mul-major) becomes ``[N, C, \sum d]`` for the product block,

.. math::

    y[n, c, o_b + m] = x[n, s_b + c\, d_b + m]

(block ``b`` of dimension :math:`d_b` at input offset :math:`s_b`, output column :math:`o_b`;
every block has the same multiplicity :math:`C`). mace cuts the blocks (``narrow``), reshapes
each (a copy) and concatenates them; the gradient of each ``narrow`` is a zero-filled ``[N, dim]``
tensor added into the next. Here it is one ``index_select`` with the permutation, and the
gradient one with its inverse (differentiable again, for force training), each row-parallel on
CPU tensors (:func:`permute_columns`). At
1,536 atoms of the paper configuration the four fills and adds of ``[N, 2048]`` and the
concatenation were about 15 ms of an MD step.

:data:`SWAP` turns mace's ``reshape_irreps`` with ``mul x ir`` layout (no cuEquivariance
``ir_mul`` layout) and equal multiplicities into :class:`WorkbenchReshapeIrreps`, a companion of
the MACE swap that the MD calculator puts in (:func:`~workbench.kernels.mace.adapter.use_companions`).
"""

from __future__ import annotations

import torch

from workbench.kernels.class_swap import ClassSwap, KeepsOp
from workbench.kernels.library import host_float
from workbench.kernels.rowwise import batch_as_rows

__all__ = ["SWAP", "WorkbenchReshapeIrreps", "column_permutation", "permute_columns"]  # noqa: F822 (module __getattr__)


def column_permutation(muls: list[int], dims: list[int]) -> list[int]:
    """The input column of each output column ``c * sum(dims) + o_b + m`` (see the module docstring)."""
    width, offsets, start = sum(dims), [], 0
    for mul, d in zip(muls, dims):
        offsets.append(start)
        start += mul * d
    perm = [0] * (muls[0] * width if muls else 0)
    for c in range(muls[0] if muls else 0):
        col = 0
        for s, d in zip(offsets, dims):
            for m in range(d):
                perm[c * width + col] = s + c * d + m
                col += 1
    return perm


def permute_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x[:, perm]``: on CPU float tensors outside a trace row-parallel
    (:func:`~workbench.kernels.numba.cpu.columns.gather_columns`; torch's ``index_select`` along
    columns runs on one thread), else ``index_select``."""
    if not host_float(x):
        return x.index_select(1, perm)
    from workbench.kernels.numba.cpu.columns import gather_columns

    out = x.new_empty(x.shape[0], perm.shape[0])
    gather_columns(x.detach().contiguous().numpy(), perm.numpy(), out.numpy())
    return out


class _Permute(torch.autograd.Function):
    """``x[:, perm]``; backward: ``g[:, inverse]`` (a permutation: no zero fill, no scatter);
    forward-mode: the same permutation; under ``vmap`` the batch becomes more rows."""

    @staticmethod
    def forward(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        return permute_columns(x, perm)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.perms = inputs[1:]

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        perm, inverse = ctx.perms
        return _Permute.apply(g, inverse, perm), None, None

    @staticmethod
    def jvp(ctx, x_t: torch.Tensor, *_) -> torch.Tensor:
        perm, inverse = ctx.perms
        return _Permute.apply(x_t, perm, inverse)

    @staticmethod
    def vmap(info, in_dims, x, perm, inverse):
        return batch_as_rows(_Permute.apply, in_dims[0], x, perm, inverse)


def _check(m: torch.nn.Module) -> None:
    if getattr(m, "cueq_config", None) is not None:
        raise ValueError("a cuEquivariance layout")
    if len(set(m.muls)) > 1:
        raise ValueError(f"multiplicities {m.muls} differ")


def _make_class() -> type:
    class WorkbenchReshapeIrreps(KeepsOp, SWAP.native()):
        """mace's ``reshape_irreps`` as one permutation (module docstring)."""

        def forward(self, tensor: torch.Tensor) -> torch.Tensor:
            perm, inverse = self.cached_op(
                lambda: self._permutations(tensor.device), lambda p: p[0].device == tensor.device
            )
            if tensor.dim() != 2 or tensor.shape[1] != perm.shape[0]:  # mace's own reading of other widths
                return super().forward(tensor)
            out = _Permute.apply(tensor, perm, inverse)
            return out.view(tensor.shape[0], self.muls[0] if self.muls else 0, sum(self.dims))

        def _permutations(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            perm = torch.tensor(column_permutation(list(self.muls), list(self.dims)), dtype=torch.long)
            return perm.to(device), torch.argsort(perm).to(device)

    return WorkbenchReshapeIrreps


SWAP = ClassSwap.companion(
    "mace_reshape", "mace.modules.irreps_tools.reshape_irreps", globals(), _make_class, _check, "WorkbenchReshapeIrreps"
)
__getattr__ = SWAP.ours.module_getattr
