r"""A smooth function of the edge length, tabulated as piecewise polynomials for inference.

A MACE radial network maps one number per edge, its length :math:`r`, to ``J`` weights
(``J = 1280`` at the paper config): :math:`R(r) = \mathrm{MLP}(B(r))`, ``B`` the Bessel basis
times the cutoff. Evaluated as a network it costs two ``[E, 64] @ [64, J]`` products per MD step
(forward, and backward for the forces); tabulated it costs a few multiply-adds per weight.

On ``N`` equal intervals of width ``h`` from ``lo``, each weight is the polynomial of degree 7 in
the interval's centred coordinate :math:`s = 2 (r - r_k)/h - 1 \in [-1, 1)` that matches
:math:`R` and :math:`R'` at :math:`s = -1, -\tfrac13, \tfrac13, 1`:

.. math::

    R_j(r) \approx \sum_{p=0}^{7} c_{k p j}\, s^p, \qquad
    R_j'(r) \approx \frac2h \sum_{p=1}^{7} p\, c_{k p j}\, s^{p-1}

so the table is continuous with a continuous slope across knots (forces stay continuous along
an MD trajectory), and errs by :math:`O(h^8)` in values and :math:`O(h^7)` in slopes. The centred
coordinate keeps the rounding of the slopes near 1e-12 (on ``[0, 1)`` degree 7 lost two digits).
:func:`build` doubles ``N`` until the error it measures between the nodes, against ``R``
itself in float64, is under the dtype's tolerance (:data:`TOLERANCE`). At the paper config
(``J = 1280``) that is 512 intervals in float64 (a 42 MB table) and 64 in float32.

Shapes: ``coeffs`` ``[N, 8, J]``; the kernels are in
:mod:`workbench.kernels.numba.cpu.radial`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DEGREE", "MAX_TABLE_BYTES", "NODES", "TOLERANCE", "RadialTable", "TableRefused", "build", "evaluate"]

#: dtype -> (value, slope) error allowed, relative to the largest value and slope on the domain
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {torch.float64: (1e-13, 1e-11), torch.float32: (1e-7, 1e-6)}
#: the largest table :func:`build` makes (one interaction's weights); past it the network stays
MAX_TABLE_BYTES = 256 * 2**20
_FIRST_INTERVALS = 32
#: the centred coordinates where the polynomial matches the function and its slope
NODES = (-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0)
DEGREE = 2 * len(NODES) - 1
#: slope errors above this that stop falling are not rounding: the function is not smooth
_ROUNDING = 1e-8


class TableRefused(ValueError):
    """The function cannot be tabulated within the tolerance (or is not finite on the domain)."""


def _hermite_inverse() -> np.ndarray:
    """``[8, 8]``: (value, slope in s) at the :data:`NODES` -> coefficients of s^0 .. s^7."""
    rows = []
    for s in NODES:
        rows.append([s**p for p in range(DEGREE + 1)])
        rows.append([p * s ** (p - 1) if p else 0.0 for p in range(DEGREE + 1)])
    return np.linalg.inv(np.array(rows))


_HERMITE = _hermite_inverse()


@dataclass(frozen=True)
class RadialTable:
    """``coeffs[k, p, j]``: weight ``j`` on interval ``k`` is :math:`\\sum_p c_{kpj} s^p`.
    ``value_error`` / ``slope_error``: the largest error measured between the nodes, relative to
    the largest value / slope, of the float64 coefficients (a float32 table adds its rounding)."""

    lo: float
    h: float
    coeffs: np.ndarray
    value_error: float
    slope_error: float

    @property
    def num_intervals(self) -> int:
        return int(self.coeffs.shape[0])

    @property
    def outputs(self) -> int:
        return int(self.coeffs.shape[2])

    @property
    def hi(self) -> float:
        return self.lo + self.h * self.num_intervals

    def covers(self, lengths: torch.Tensor) -> bool:
        """Whether every length lies on the tabulated domain ``[lo, hi]``."""
        if lengths.numel() == 0:
            return True
        return bool(lengths.min() >= self.lo) and bool(lengths.max() <= self.hi)


def _value_and_slope(fn: Callable[[torch.Tensor], torch.Tensor], r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(r)`` and ``d fn / dr`` (forward mode: one pass for all ``J`` outputs), ``[K, J]`` each."""
    from torch.func import jvp

    with torch.no_grad():
        value, slope = jvp(fn, (r,), (torch.ones_like(r),))
    return value, slope


def _fit(fn, lo: float, hi: float, n: int) -> np.ndarray:
    """``[n, 8, J]`` coefficients of ``fn`` on ``n`` intervals of ``[lo, hi]``."""
    h = (hi - lo) / n
    m = len(NODES) - 1  # nodes per interval, not counting the shared right end
    offsets = (np.array(NODES) + 1.0) / 2.0
    r = lo + h * (np.arange(n)[:, None] + offsets[None, :])  # [n, 4]
    value, slope = (a.numpy() for a in _value_and_slope(fn, torch.from_numpy(r.reshape(-1))))
    J = value.shape[1]
    value, slope = value.reshape(n, m + 1, J), slope.reshape(n, m + 1, J) * (h / 2)
    data = np.stack([x for i in range(m + 1) for x in (value[:, i], slope[:, i])])  # [8, n, J]
    return np.einsum("pq,qnj->npj", _HERMITE, data)


def evaluate(coeffs: np.ndarray, k: np.ndarray, s: np.ndarray, h: float) -> tuple[np.ndarray, np.ndarray]:
    """``(values, slopes)`` ``[K, J]`` at centred coordinates ``s`` ``[K]`` of intervals ``k`` (numpy)."""
    c, s = coeffs[k], s[:, None]
    value, slope = c[:, DEGREE], DEGREE * c[:, DEGREE]
    for p in range(DEGREE - 1, -1, -1):
        value = value * s + c[:, p]
        if p:
            slope = slope * s + p * c[:, p]
    return value, slope * (2.0 / h)


def _errors(fn, lo: float, h: float, coeffs: np.ndarray) -> tuple[float, float]:
    """Largest (value, slope) error halfway between the nodes of every interval, relative to the
    largest value and slope there."""
    n = coeffs.shape[0]
    mids = (np.array(NODES[:-1]) + np.array(NODES[1:])) / 2.0
    k = np.repeat(np.arange(n), len(mids))
    s = np.tile(mids, n)
    r = lo + h * (k + (s + 1.0) / 2.0)
    value, slope = (a.numpy() for a in _value_and_slope(fn, torch.from_numpy(r)))
    if not (np.isfinite(value).all() and np.isfinite(slope).all() and np.isfinite(coeffs).all()):
        raise TableRefused(f"the function is not finite on [{lo:g}, {lo + h * n:g}]")
    got, got_slope = evaluate(coeffs, k, s, h)
    scale_v = float(np.abs(value).max()) or 1.0
    scale_s = float(np.abs(slope).max()) or 1.0
    return float(np.abs(got - value).max()) / scale_v, float(np.abs(got_slope - slope).max()) / scale_s


def build(
    fn: Callable[[torch.Tensor], torch.Tensor],
    lo: float,
    hi: float,
    dtype: torch.dtype,
    tolerance: tuple[float, float] | None = None,
    max_bytes: int = MAX_TABLE_BYTES,
) -> RadialTable:
    """Tabulate ``fn`` (float64 ``[K]`` lengths -> ``[K, J]``, differentiable in forward mode) on
    ``[lo, hi]``, stored in ``dtype``. The number of intervals doubles from 32 until the measured
    errors meet ``tolerance`` (default :data:`TOLERANCE` of ``dtype``); raises
    :class:`TableRefused` when that would pass ``max_bytes``, when ``fn`` is not finite, or when
    the errors stop falling (a kink, or an op whose forward-mode derivative torch leaves at zero,
    such as ``torch.special.chebyshev_polynomial_t``, the basis of mace's ``radial_type="chebyshev"``)."""
    if not hi > lo:
        raise ValueError(f"an empty domain [{lo}, {hi}]")
    tol_v, tol_s = tolerance or TOLERANCE[dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    n, last = _FIRST_INTERVALS, None
    while True:
        coeffs = _fit(fn, lo, hi, n)
        h = (hi - lo) / n
        err_v, err_s = _errors(fn, lo, h, coeffs)
        if err_v <= tol_v and err_s <= tol_s:
            stored = np.ascontiguousarray(coeffs, dtype=np.float32 if itemsize == 4 else np.float64)
            return RadialTable(lo, h, stored, err_v, err_s)
        if last is not None and n >= 4 * _FIRST_INTERVALS and err_s > max(last / 4, _ROUNDING):
            raise TableRefused(
                f"the slope errors do not fall as the intervals double ({last:.1e} at {n // 2}, {err_s:.1e} "
                f"at {n}): the function or its forward-mode slope is not smooth on [{lo:g}, {hi:g}]"
            )
        if coeffs.size * itemsize * 2 > max_bytes:
            raise TableRefused(
                f"{n} intervals leave errors {err_v:.1e} (values) and {err_s:.1e} (slopes) over the "
                f"tolerance {tol_v:.0e} / {tol_s:.0e}, and a finer table would pass {max_bytes / 2**20:g} MiB"
            )
        n, last = 2 * n, err_s
