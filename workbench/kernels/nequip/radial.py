r"""nequip's ``BesselEdgeLengthEncoding``: the same edge embedding in fewer passes, in place.

For an edge of normalised length :math:`x = r / r_c` nequip embeds

.. math::

    e_n(x) = w_n\,\mathrm{sinc}(w_n x)\, u(x) = \sin(\pi w_n x)\,\frac{u(x)}{\pi x}, \qquad
    u(x) = \Big(1 - x^p \big(a - x (b - c\,x)\big)\Big)\,[x < 1]

with :math:`w_n` the module's ``bessel_weights`` (:math:`1 \dots N`, trainable or not),
:math:`u` the polynomial cutoff and :math:`a, b, c = \frac{(p+1)(p+2)}{2}, p(p+2),
\frac{p(p+1)}{2}`; ``e`` is ``[num_edges, num_bessels]``. nequip writes it as ``sinc`` over
``[num_edges, num_bessels]`` (a scalar loop in torch, whose derivatives add ``sin``, ``cos`` and
divisions over the same shape) times three ``pow`` of the cutoff. Here it is one ``sin`` over
``[num_edges, num_bessels]`` times an ``[num_edges, 1]`` factor, in float64 as nequip keeps
it and plain torch, so every derivative order is exact. Values agree with nequip's to float64
rounding, and at :math:`x = 0` (two atoms in one place) the embedding is the limit
:math:`w_n u(0)`, as nequip's ``sinc`` gives. A cutoff module other than exactly nequip's
``PolynomialCutoff`` (a subclass, a user's own) is called as nequip calls it.
"""

from __future__ import annotations

import math

import torch

from workbench.kernels.class_swap import ClassSwap

__all__ = ["SWAP", "WorkbenchBesselEdgeLengthEncoding", "polynomial_cutoff"]  # noqa: F822 (module __getattr__)


def polynomial_cutoff(x: torch.Tensor, p: float) -> torch.Tensor:
    """nequip's ``PolynomialCutoff(p)`` at ``x`` (any shape) by Horner's rule: one ``pow``."""
    a, b, c = (p + 1.0) * (p + 2.0) / 2.0, p * (p + 2.0), p * (p + 1.0) / 2.0
    return (1.0 - torch.pow(x, p) * (a - x * (b - c * x))) * (x < 1.0)


_SCRIPTED_NAME = "__torch__.nequip.nn.embedding.cutoffs.PolynomialCutoff"


def _power(cutoff: torch.nn.Module) -> float | None:
    """The power of exactly nequip's ``PolynomialCutoff`` (plain or TorchScript), else ``None``."""
    from nequip.nn.embedding import PolynomialCutoff

    if type(cutoff) is PolynomialCutoff:
        return float(cutoff.p)
    if isinstance(cutoff, torch.jit.ScriptModule) and cutoff._c._type().qualified_name() == _SCRIPTED_NAME:
        return float(cutoff.p)
    return None


def _make_class() -> type:
    from nequip.data import AtomicDataDict

    class WorkbenchBesselEdgeLengthEncoding(SWAP.native()):
        """nequip's ``BesselEdgeLengthEncoding`` with the embedding as ``sin`` times one factor per edge."""

        def forward(self, data: dict) -> dict:
            x = data[self.norm_length_field]  # [num_edges, 1], float64
            p = _power(self.cutoff)
            cutoff = self.cutoff(x) if p is None else polynomial_cutoff(x, p)
            data[AtomicDataDict.EDGE_CUTOFF_KEY] = cutoff.to(self._output_dtype)
            w, apart = self.bessel_weights, x != 0.0
            scale = cutoff / (math.pi * torch.where(apart, x, 1.0))  # [num_edges, 1]: no 0/0 at x = 0
            embedding = torch.where(apart, torch.sin((math.pi * x) * w) * scale, w * cutoff)
            data[self.edge_invariant_field] = embedding.to(self._output_dtype)
            return data

    return WorkbenchBesselEdgeLengthEncoding


# built on first use: importing the workbench does not import nequip
SWAP = ClassSwap.companion("bessel_encoding", "nequip.nn.embedding.BesselEdgeLengthEncoding", globals(), _make_class)
__getattr__ = SWAP.ours.module_getattr
