r"""e3nn's ``o3.SphericalHarmonics`` as one numba pass over edges, forward and backward.

Every real spherical harmonic e3nn returns is a homogeneous polynomial of degree ``l`` in the
(normalised) edge vector, times a constant per ``l`` (``normalization``):

.. math::

    Y^l_m(u) = s_l \sum_{a+b+c=l} C^l_{m,abc}\, u_x^a u_y^b u_z^c, \qquad
    u = \frac{v}{\max(\lVert v \rVert, \epsilon)}, \qquad
    s_l = \begin{cases} \sqrt{2l+1} & \text{component} \\ \sqrt{(2l+1)/4\pi} & \text{integral}
    \\ 1 & \text{norm} \end{cases}

The coefficients :math:`C` are read off e3nn's own polynomials (:func:`sh_table`: a least-squares
fit on the monomials of each degree, its residual checked: 1e-15 relative up to l = 3, 9e-13 at
l = 8 and 11; the nonzero ones kept). e3nn evaluates
the polynomials as about 40 elementwise torch ops over ``[E]`` (plus as many in autograd's
backward): at 61,240 edges (MACE's paper config, water-1,536) that was ~20 ms of an MD step.
Here the forward is one pass writing ``[E, dim]`` and the backward one pass writing ``[E, 3]``:

.. math::

    \bar u_k = \sum_{l,m} \bar Y^l_m\, \partial_{u_k} Y^l_m, \qquad
    \bar v = \frac{\bar u - u (u \cdot \bar u)}{\lVert v \rVert} \;
    (\text{or } \bar u / \epsilon \text{ where } \lVert v \rVert \le \epsilon)

as torch's ``normalize`` differentiates. A second derivative (force training through the
calculator) recomputes e3nn's ops and differentiates them, so every order stays right; a batched
second backward (``vmap``, mace's Hessians) runs the pass on the batch as more edges.

:data:`SWAP` turns e3nn's ``SphericalHarmonics`` into :class:`WorkbenchSphericalHarmonics` (a
companion of MACE's MD calculator, :func:`~workbench.kernels.mace.adapter.companions`, and of the
nequip-built families, :mod:`workbench.kernels.nequip.companions`); training mode, CUDA tensors,
other dtypes, traces and ``WORKBENCH_CPU_HARMONICS=0`` keep e3nn's forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from numba import njit, prange

from workbench.kernels.class_swap import ClassSwap
from workbench.kernels.library import host_float
from workbench.kernels.options import kernel_options

__all__ = ["SWAP", "ShTable", "WorkbenchSphericalHarmonics", "sh_table", "spherical_harmonics"]  # noqa: F822

EPS = 1e-12  # torch.nn.functional.normalize's
#: the largest relative residual of a degree's fit (measured: 1e-15 at l <= 3, 9e-13 at l = 8 and 11)
FIT_TOLERANCE = 1e-11
CHUNK = 256  # edges per parallel chunk


@dataclass(frozen=True)
class ShTable:
    """The terms of every output component: term ``t`` adds ``coef[t] * u_x^a u_y^b u_z^c``
    (``powers[t] = (a, b, c)``) to component ``comp[t]``; ``dim`` components, degrees to ``lmax``.
    Shapes: ``comp`` ``[T]``, ``powers`` ``[T, 3]``, ``coef`` ``[T]`` (float64)."""

    comp: np.ndarray
    powers: np.ndarray
    coef: np.ndarray
    dim: int
    lmax: int


def _monomials(l: int) -> np.ndarray:
    """``[M, 3]``: the exponents ``(a, b, c)`` with ``a + b + c = l``."""
    return np.array([(a, b, l - a - b) for a in range(l, -1, -1) for b in range(l - a, -1, -1)], dtype=np.int64)


def _fit_degree(l: int) -> np.ndarray:
    """``[M, 2l+1]``: e3nn's unnormalised harmonics of degree ``l`` on :func:`_monomials`."""
    from e3nn import o3

    powers = _monomials(l)
    points = torch.randn(4 * len(powers) + 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(l))
    values = o3.spherical_harmonics(l, points, normalize=False, normalization="norm").numpy()
    p = points.numpy()
    basis = np.prod(p[:, None, :] ** powers[None, :, :], axis=2)
    coef, *_ = np.linalg.lstsq(basis, values, rcond=None)
    coef = np.where(np.abs(coef) > 1e-12 * np.abs(coef).max(), coef, 0.0)
    residual = np.abs(basis @ coef - values).max() / np.abs(values).max()
    if residual > FIT_TOLERANCE:  # e3nn's polynomials would not be these monomials'
        raise ValueError(f"degree {l}: e3nn's harmonics fit the monomials to {residual:.1e} only")
    return coef


def _scale(l: int, normalization: str) -> float:
    return {"component": math.sqrt(2 * l + 1), "integral": math.sqrt((2 * l + 1) / (4 * math.pi)), "norm": 1.0}[
        normalization
    ]


@lru_cache(maxsize=16)
def sh_table(ls: tuple[int, ...], normalization: str) -> ShTable:
    """The :class:`ShTable` of e3nn's harmonics of degrees ``ls`` (in order, repeats allowed)."""
    comp, powers, coef, at = [], [], [], 0
    for l in ls:
        fit, mono = _fit_degree(l), _monomials(l)
        rows, cols = np.nonzero(fit)
        comp.append(at + cols)
        powers.append(mono[rows])
        coef.append(fit[rows, cols] * _scale(l, normalization))
        at += 2 * l + 1
    return ShTable(np.concatenate(comp), np.concatenate(powers), np.concatenate(coef), at, max(ls))


@njit(cache=True, nogil=True, inline="always")
def _unit(v, e, normalize):  # pragma: no cover - compiled
    """``(x, y, z, r)``: edge ``e`` normalised as torch's ``normalize`` does (``r`` its divisor)."""
    x, y, z = v[e, 0], v[e, 1], v[e, 2]
    if not normalize:
        return x, y, z, v.dtype.type(1.0)
    r = v.dtype.type(max(math.sqrt(x * x + y * y + z * z), EPS))
    return x / r, y / r, z / r, r


@njit(cache=True, nogil=True, inline="always")
def _powers(p, x, y, z):  # pragma: no cover - compiled
    p[0, 0] = p[1, 0] = p[2, 0] = 1.0
    for k in range(1, p.shape[1]):
        p[0, k], p[1, k], p[2, k] = p[0, k - 1] * x, p[1, k - 1] * y, p[2, k - 1] * z


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _values(v, normalize, comp, powers, coef, lmax, out):  # pragma: no cover - compiled
    for c in prange((v.shape[0] + CHUNK - 1) // CHUNK):
        p = np.empty((3, lmax + 1), dtype=out.dtype)
        for e in range(c * CHUNK, min(v.shape[0], (c + 1) * CHUNK)):
            x, y, z, _ = _unit(v, e, normalize)
            _powers(p, x, y, z)
            row = out[e]
            row[:] = 0.0
            for t in range(comp.size):
                row[comp[t]] += coef[t] * p[0, powers[t, 0]] * p[1, powers[t, 1]] * p[2, powers[t, 2]]


@njit(cache=True, nogil=True, inline="always")
def _slope(p, a, b, c, k):  # pragma: no cover - compiled
    """``d/du_k`` of ``u_x^a u_y^b u_z^c`` from the powers ``p``."""
    e = (a, b, c)
    if e[k] == 0:
        return p.dtype.type(0.0)
    out = p.dtype.type(e[k]) * p[k, e[k] - 1]  # an int64 times a float32 would be a float64
    for j in range(3):
        if j != k:
            out *= p[j, e[j]]
    return out


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _vjp(v, g, normalize, comp, powers, coef, lmax, out):  # pragma: no cover - compiled
    for c in prange((v.shape[0] + CHUNK - 1) // CHUNK):
        p = np.empty((3, lmax + 1), dtype=out.dtype)
        du = np.empty(3, dtype=out.dtype)
        for e in range(c * CHUNK, min(v.shape[0], (c + 1) * CHUNK)):
            x, y, z, r = _unit(v, e, normalize)
            _powers(p, x, y, z)
            du[:] = 0.0
            for t in range(comp.size):
                w = g[e, comp[t]] * coef[t]
                for k in range(3):
                    du[k] += w * _slope(p, powers[t, 0], powers[t, 1], powers[t, 2], k)
            dot = du[0] * x + du[1] * y + du[2] * z if normalize and r > EPS else 0.0
            out[e, 0], out[e, 1], out[e, 2] = (du[0] - x * dot) / r, (du[1] - y * dot) / r, (du[2] - z * dot) / r


def _arrays(table: ShTable, dtype: torch.dtype) -> tuple:
    return table.comp, table.powers, table.coef.astype(np.float32 if dtype == torch.float32 else np.float64)


class _Harmonics(torch.autograd.Function):
    """``[E, 3] -> [E, dim]``; first derivative by :func:`_vjp`, higher ones by e3nn's ops."""

    @staticmethod
    def forward(ctx, v, table, normalize, native):
        ctx.save_for_backward(v)
        ctx.args = (table, normalize, native)
        out = torch.empty(v.shape[0], table.dim, dtype=v.dtype)
        _values(v.detach().numpy(), normalize, *_arrays(table, v.dtype), table.lmax, out.numpy())
        return out

    @staticmethod
    def backward(ctx, grad):
        (v,) = ctx.saved_tensors
        table, normalize, native = ctx.args
        if torch.is_grad_enabled():  # create_graph: e3nn's ops on the saved input, every order right
            y = native(v)
            if not y.requires_grad:  # l = 0 only: a constant
                return torch.zeros_like(v), None, None, None
            (gv,) = torch.autograd.grad(y, v, grad, create_graph=True)
            return gv, None, None, None
        return _HarmonicsVjp.apply(v.detach(), grad, table, normalize), None, None, None


class _HarmonicsVjp(torch.autograd.Function):
    """``(v [E, 3], g [E, dim]) -> [E, 3]``, the harmonics' vector-Jacobian product (:func:`_vjp`),
    not differentiated again (a second derivative goes through e3nn's ops). Under ``vmap`` (mace's
    Hessians batch the second backward over cotangents) the batch becomes more edges."""

    @staticmethod
    def forward(v, g, table, normalize):
        out = torch.empty_like(v)
        _vjp(v.numpy(), g.contiguous().numpy(), normalize, *_arrays(table, v.dtype), table.lmax, out.numpy())
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, v, g, table, normalize):
        size = info.batch_size
        v = v.movedim(in_dims[0], 0) if in_dims[0] is not None else v.expand(size, *v.shape)
        g = g.movedim(in_dims[1], 0) if in_dims[1] is not None else g.expand(size, *g.shape)
        out = _HarmonicsVjp.apply(v.reshape(-1, 3).contiguous(), g.reshape(-1, g.shape[-1]), table, normalize)
        return out.reshape(size, -1, 3), 0


def spherical_harmonics(module: torch.nn.Module, vectors: torch.Tensor) -> torch.Tensor:
    """``[..., dim]``: e3nn ``SphericalHarmonics`` ``module`` at ``vectors`` ``[..., 3]`` by the
    numba passes (CPU float32 / float64 tensors)."""
    table = sh_table(tuple(module._ls_list), module.normalization)
    flat = vectors.reshape(-1, 3).contiguous()
    native = SWAP.native().forward.__get__(module)
    out = _Harmonics.apply(flat, table, bool(module.normalize), native)
    return out.reshape(*vectors.shape[:-1], table.dim)


def _make_class() -> type:
    class WorkbenchSphericalHarmonics(SWAP.native()):
        """e3nn's ``SphericalHarmonics`` through :func:`spherical_harmonics` in ``eval()`` on CPU
        float32 and float64 tensors outside a trace; e3nn's forward otherwise (training
        differentiates twice, where the second derivative would recompute e3nn's forward)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training or not host_float(x) or not kernel_options().cpu_harmonics:
                return super().forward(x)
            return spherical_harmonics(self, x)

    return WorkbenchSphericalHarmonics


SWAP = ClassSwap.companion("spherical_harmonics", "e3nn.o3.SphericalHarmonics", globals(), _make_class)
__getattr__ = SWAP.ours.module_getattr
