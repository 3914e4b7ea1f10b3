r"""SiLU whose derivatives are one pass each: what a radial MLP pays in force training.

.. math::

    f(z) = z\,\sigma(z), \quad
    f' = \sigma\,(1 + z(1-\sigma)), \quad
    f'' = \sigma(1-\sigma)\,(2 + z(1-2\sigma)), \quad
    f''' = \sigma(1-\sigma)\,\big((1-2\sigma)(3 + z(1-2\sigma)) - 2z\sigma(1-\sigma)\big)

Training on forces differentiates a radial MLP twice (forces, then the loss's gradient to the
weights). torch writes SiLU's second derivative as about ten elementwise ops over ``[edges,
width]``, each a pass through memory; here it is one numba pass on the CPU
(:func:`_second_cpu`, after torch's sigmoid) that writes both of its outputs. The chain is

* :class:`_SiLU`: ``z -> f(z)`` (torch's own kernel), backward :class:`_SiLUGrad`;
* :class:`_SiLUGrad`: ``(z, g) -> g f'(z)`` (torch's ``silu_backward``), backward :class:`_SiLUGrad2`;
* :class:`_SiLUGrad2`: ``(z, g, h) -> (h g f''(z), h f'(z))``, backward in torch ops, so every
  higher order is still right (slowly).

Values agree with torch's SiLU to rounding. On CUDA tensors, in other dtypes than float32 and
float64, or with ``fused=False``, the second derivative runs as torch ops. The module swap
passes ``fused`` for the ``numba`` backend whatever ``WORKBENCH_CPU_KERNELS`` says (that
variable picks how the descriptor's passes run; this pass has one form). :data:`SWAP` turns ``torch.nn.SiLU`` modules into
:class:`WorkbenchSiLU` in place (a companion of a family's hot-op swap,
:class:`~workbench.kernels.class_swap.ClassSwap`).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from workbench.kernels.class_swap import ClassSwap
from workbench.kernels.library import host_float
from workbench.kernels.registry import DEFAULT_BACKEND, get_backend

__all__ = ["SWAP", "WorkbenchSiLU", "silu"]  # noqa: F822 (module __getattr__)


@njit(parallel=True, cache=True, fastmath={"contract"})
def _second_cpu(z, sig, g, h, dz, dg):  # pragma: no cover - compiled by numba
    for i in prange(z.shape[0]):  # the sigmoid comes from torch: numba's exp is scalar, 3x slower
        zi, s = z[i], sig[i]
        u = s * (1.0 - s)
        dz[i] = h[i] * g[i] * (u * (2.0 + zi * (1.0 - 2.0 * s)))
        dg[i] = h[i] * (s + zi * u)


def _sigmoid_terms(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(f', f'', s, s(1-s))`` of SiLU at ``z`` with ``s = sigmoid(z)``, in torch ops (differentiable)."""
    s = torch.sigmoid(z)
    u = s * (1 - s)
    return s + z * u, u * (2 + z * (1 - 2 * s)), s, u


def _second_torch(z: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d1, d2, _, _ = _sigmoid_terms(z)
    return h * g * d2, h * d1


def _flat(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).numpy()


class _SiLUGrad2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, g, h, fused: bool):
        ctx.save_for_backward(z, g, h)
        if not (fused and host_float(z)):
            return _second_torch(z, g, h)
        dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
        dg = torch.empty_like(dz)
        sig = _flat(torch.sigmoid(z.detach()))
        _second_cpu(_flat(z), sig, _flat(g), _flat(h), dz.view(-1).numpy(), dg.view(-1).numpy())
        return dz, dg

    @staticmethod
    def backward(ctx, a, b):
        z, g, h = ctx.saved_tensors
        d1, d2, s, u = _sigmoid_terms(z)  # torch ops: every higher order stays right
        d3 = u * ((1 - 2 * s) * (3 + z * (1 - 2 * s)) - 2 * z * u)
        return a * h * g * d3 + b * h * d2, a * h * d2, a * g * d2 + b * d1, None


class _SiLUGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, g, fused: bool):
        ctx.save_for_backward(z, g)
        ctx.fused = fused
        return torch.ops.aten.silu_backward(g, z)

    @staticmethod
    def backward(ctx, h):
        z, g = ctx.saved_tensors
        dz, dg = _SiLUGrad2.apply(z, g, h, ctx.fused)
        return dz, dg, None


class _SiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, fused: bool):
        ctx.save_for_backward(z)
        ctx.fused = fused
        return torch.nn.functional.silu(z)

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return _SiLUGrad.apply(z, g, ctx.fused), None


#: below this many elements the module keeps torch's SiLU: three Python autograd Functions cost
#: ~40 us a step, and the fused pass saves ~2 ns an element in float32, ~25 ns in float64
MIN_ELEMENTS = {torch.float32: 32768, torch.float64: 4096}


def silu(z: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """``z * sigmoid(z)``, shape kept, differentiable to any order; ``fused``: the second
    derivative as one numba pass when ``z`` is on the CPU."""
    return _SiLU.apply(z, fused)


def _make_class() -> type:
    class WorkbenchSiLU(torch.nn.SiLU):
        """``torch.nn.SiLU`` through :func:`silu` (never in place) from :data:`MIN_ELEMENTS` on
        and in training, torch's own below and in ``eval()`` (an MD step differentiates once,
        where the Python Functions cost and the fused pass gives nothing; torch's SiLU is right to
        every order, so a later second derivative is right too, only slower); the fused second
        derivative on a ``compiled`` backend (the registry's), torch ops on the others."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if not self.training or input.numel() < MIN_ELEMENTS.get(input.dtype, 0):
                return torch.nn.functional.silu(input)
            return silu(input, fused=get_backend(self.__dict__.get("kernel_backend", DEFAULT_BACKEND)).compiled)

    return WorkbenchSiLU


SWAP = ClassSwap.companion("silu", "torch.nn.SiLU", globals(), _make_class)
__getattr__ = SWAP.ours.module_getattr
