r"""Allegro's ``Contracter`` as one sparse polynomial, swapped in place.

For edge :math:`z`, channel :math:`u` and output component :math:`k`
(nequip-allegro 0.8, ``allegro/nn/_strided/_contract.py``):

.. math::

    \mathrm{out}[z, u, k] = \sum_{p} w[u, p] \sum_{i j} C[p, i, j, k]\,
        x_1[z, u, i]\, x_2[\mathrm{idx}_z, u, j]

with ``x1`` ``[num_edges, mul, d1]`` (the edge's tensor features), ``x2`` ``[num_nodes, mul, d2]``
(the centre's environment, gathered by ``idx``), :math:`C` the module's own ``w3j`` buffer
(Wigner 3j times :math:`\sqrt{2 l_\mathrm{out} + 1}`, its path axis dropped for one path and its
``j`` axis for an ``ij``-diagonal coupling) and :math:`w` its ``weights``: ``(mul, paths)`` with
path-channel coupling, ``(paths,)`` without (the same for every channel), either without the
path axis for one path. Only the non-zero :math:`C` become terms. The polynomial is an atom op
whose rows are the edges and whose one "species" row holds :math:`w` (so its gradient sums over
edges), evaluated by :func:`~workbench.kernels.ops.apply_poly_op` on any descriptor backend and
differentiable to any order; the gather of ``x2`` stays torch's ``index_select``.
"""

from __future__ import annotations

import numpy as np
import torch

from workbench.kernels.class_swap import ClassSwap, KeepsOp
from workbench.kernels.descriptor import Operand, SparsePolynomial
from workbench.kernels.lazy_class import LazyClass
from workbench.kernels.nequip.companions import COMPANIONS
from workbench.kernels.ops import PolyOp, apply_poly_op
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["SWAP", "WorkbenchContracter", "contracter_polynomial", "is_native", "is_workbench"]  # noqa: F822


def _coupling(m: torch.nn.Module) -> np.ndarray:
    """The module's ``w3j`` as ``[paths, d1, d2, dout]`` (diagonal and single-path forms expanded)."""
    c = m.w3j.detach().double().cpu().numpy()
    if m.num_paths == 1:
        c = c[None]
    if m.w3j_is_ij_diagonal:  # [p, i, k] -> [p, i, i, k]
        full = np.zeros((c.shape[0], c.shape[1], c.shape[1], c.shape[2]))
        idx = np.arange(c.shape[1])
        full[:, idx, idx, :] = c
        c = full
    return c


def contracter_polynomial(m: torch.nn.Module) -> SparsePolynomial:
    """The polynomial of an Allegro ``Contracter`` ``m`` (its buffers and flags; see module doc)."""
    c = _coupling(m)
    paths, d1, d2, dout = c.shape
    mul = m.mul

    def strided(name: str, size: int, rows: str) -> Operand:
        return Operand(name, size, rows, tuple(range(size)), (size,) * size, mul * size)

    x1, x2, out = strided("x1", d1, "atom"), strided("x2", d2, "atom"), strided("out", dout, "atom")
    w_cstride = paths if m.path_channel_coupling else 0  # uncoupled: one weight per path for all channels
    w = Operand("w", paths, "species", tuple(range(paths)), (w_cstride,) * paths, m.weights.numel())
    terms = [
        (int(k), [(0, int(i)), (1, int(j)), (2, int(p))], float(c[p, i, j, k])) for p, i, j, k in np.argwhere(c != 0.0)
    ]
    return SparsePolynomial.from_terms((x1, x2, w), out, terms)


def _make_class() -> type:
    class WorkbenchContracter(KeepsOp, SWAP.native()):
        """Allegro's ``Contracter`` whose contraction runs the workbench's sparse polynomial."""

        def _contract_conv(self, x1: torch.Tensor, x2: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
            x2 = torch.index_select(x2, 0, idxs)
            n = x1.shape[0]
            rows = torch.zeros(n, dtype=torch.long, device=x1.device)
            backend = self.__dict__.get("kernel_backend", DEFAULT_BACKEND)
            tensors = (x1.reshape(n, -1), x2.reshape(n, -1), self.weights.reshape(1, -1))
            (out,) = apply_poly_op(self.contraction_op(), rows, 1, *tensors, backend=backend)
            return out.view(n, self.mul, self.base_dim_out)

        def contraction_op(self) -> PolyOp:
            def build() -> PolyOp:
                poly = contracter_polynomial(self)
                return PolyOp(poly.operands, [poly])

            return self.cached_op(build)

    return WorkbenchContracter


# the subclass is built on first use: importing workbench.kernels does not import allegro
SWAP = ClassSwap(
    "strided_contraction",
    "allegro.nn._strided._contract.Contracter",
    LazyClass(globals(), "WorkbenchContracter", _make_class),
    "Allegro's Contracter",
    "Allegro's own modifiers (enable_CuEquivarianceContracter, enable_TritonContracter)",
    contracter_polynomial,
    lambda m: (m.contraction_op(), m.mul),
    companions=COMPANIONS,  # nequip's modules around the hot op
)
__getattr__ = SWAP.ours.module_getattr
is_native, is_workbench = SWAP.is_native, SWAP.is_ours
