r"""MACE's symmetric tensor contraction as one sparse polynomial (paper §4.1.2, Algorithm 3).

For output irrep :math:`L` (components :math:`M`), channel :math:`c` and an atom of species
:math:`z`, mace-torch computes

.. math::

    B[c, LM] = \sum_{\nu=1}^{\nu_{max}} \sum_k W^{L\nu}[z, k, c]
               \sum_{i_1 \ldots i_\nu} U^{L\nu}[M, i_1, \ldots, i_\nu, k] \, x[c, i_1] \cdots x[c, i_\nu]

with the generalised Clebsch-Gordan tensors :math:`U^{L\nu}` (``Contraction.U_matrix_ν``),
``x`` of shape ``[atoms, channels, (l_max+1)^2]`` and weights ``[elements, k, channels]``
(``weights_max`` is :math:`\nu = \nu_{max}`, ``weights[j]`` is :math:`\nu = \nu_{max}-1-j`).
The output of irrep :math:`j` is ``[atoms, channels * (2L_j+1)]``, concatenated over irreps.

:func:`symmetric_contraction_polynomial` keeps only the non-zero entries of every
:math:`U^{L\nu}`, merges the entries that the symmetry of :math:`x_{i_1}\cdots x_{i_\nu}` makes
equal (sorted index tuples), and writes it as one :class:`SparsePolynomial` over the operands
``x`` (per atom) and ``W`` (per species, all orders and irreps concatenated along ``k``).
:class:`SymmetricContraction` is a drop-in for mace's module with the same parameters,
buffers and ``state_dict`` keys.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workbench.dtypes import default_dtype
from workbench.kernels.descriptor import Operand, SparsePolynomial
from workbench.kernels.library import no_sync, tracing
from workbench.kernels.ops import PolyOp, apply_poly_op
from workbench.kernels.options import kernel_options
from workbench.kernels.registry import DEFAULT_BACKEND

_OP_CACHE: dict = {}
_OP_CACHE_LOCK = threading.Lock()

__all__ = [
    "SymmetricContraction",
    "SymmetricContractionStats",
    "fold_species_weights",
    "symmetric_contraction_polynomial",
]


@dataclass
class SymmetricContractionStats:
    """Sparsity of the coupling tensors: ``dense`` entries of all :math:`U^{L\\nu}`, ``nonzero``
    entries, and ``terms`` after merging symmetric index tuples (the work per channel)."""

    dense: int
    nonzero: int
    terms: int
    per_block: list  # (L dim, nu, dense, nonzero, terms)

    @property
    def nonzero_fraction(self) -> float:
        return self.nonzero / max(self.dense, 1)

    @property
    def terms_fraction(self) -> float:
        return self.terms / max(self.dense, 1)


def _u_blocks(U_list: Sequence[Sequence[np.ndarray]], out_dims: Sequence[int]):
    # normalise scalar-output U (mace squeezes the M axis when 2L+1 == 1)
    for j, (Us, d) in enumerate(zip(U_list, out_dims)):
        for nu, U_raw in enumerate(Us, start=1):
            U = np.asarray(U_raw, dtype=np.float64)
            if U.ndim == nu + 1:
                U = U[None]
            assert U.shape[0] == d and U.ndim == nu + 2, (U.shape, d, nu)
            yield j, nu, U


def _k_slices(U_list: Sequence[Sequence[np.ndarray]]) -> tuple[list[list[tuple[int, int]]], int]:
    """``(k_slices, K_total)``: the range of the concatenated weight axis that holds each
    :math:`W^{L_j \\nu}` (``k_slices[j][nu-1]``), and the axis length."""
    k_slices: list[list[tuple[int, int]]] = []
    k0 = 0
    for j, Us in enumerate(U_list):
        k_slices.append([])
        for U in Us:
            K = np.asarray(U).shape[-1]
            k_slices[j].append((k0, k0 + K))
            k0 += K
    return k_slices, k0


def _merged_entries(U: np.ndarray, nu: int) -> tuple[dict[tuple[int, tuple[int, ...], int], float], int]:
    """The non-zero entries of one coupling tensor ``[M, i_1, ..., i_nu, k]`` as
    ``{(M, sorted (i_1..i_nu), k): coefficient}`` (entries equal by the symmetry of
    :math:`x_{i_1} \\cdots x_{i_\\nu}` added up), and the number of non-zero entries."""
    idx = np.nonzero(U)
    vals = U[idx]
    merged: dict[tuple[int, tuple[int, ...], int], float] = {}
    for n in range(vals.shape[0]):
        M = int(idx[0][n])
        ii = tuple(sorted(int(idx[1 + p][n]) for p in range(nu)))
        k = int(idx[nu + 1][n])
        key = (M, ii, k)
        merged[key] = merged.get(key, 0.0) + float(vals[n])
    return merged, int(vals.shape[0])


def _output_operand(out_dims: Sequence[int], M_starts: np.ndarray, C: int) -> Operand:
    """The output ``[atoms, sum_j C * (2L_j+1)]``, irrep ``j``'s component ``m`` of channel ``c``
    at ``C * M_start_j + c * (2L_j+1) + m``."""
    offsets, cstrides = [], []
    for j, d in enumerate(out_dims):
        for m in range(d):
            offsets.append(C * int(M_starts[j]) + m)
            cstrides.append(d)
    return Operand("out", int(sum(out_dims)), "atom", tuple(offsets), tuple(cstrides), C * int(sum(out_dims)))


def symmetric_contraction_polynomial(
    U_list: Sequence[Sequence[np.ndarray]], out_dims: Sequence[int], channels: int
) -> tuple[SparsePolynomial, SymmetricContractionStats, list[list[tuple[int, int]]]]:
    r"""Sparse polynomial of a MACE symmetric contraction.

    Parameters
    ----------
    U_list : ``U_list[j][nu-1]``, the coupling tensor of output irrep ``j`` and order ``nu``,
        shape ``[2L_j+1, I, ..., I, K_{j,nu}]`` (leading axis absent for scalars)
    out_dims : ``2L_j+1`` per output irrep
    channels : number of channels :math:`C` (fixes the memory layouts only)

    Returns
    -------
    (polynomial, stats, k_slices) where ``k_slices[j][nu-1] = (start, stop)`` is the range of
    the concatenated weight axis that holds :math:`W^{L_j \nu}`.
    """
    I = None
    blocks = list(_u_blocks(U_list, out_dims))
    k_slices, K_total = _k_slices(U_list)
    M_starts = np.concatenate([[0], np.cumsum(out_dims)[:-1]]).astype(int)
    terms = []
    per_block = []
    dense = nonzero = 0
    for j, nu, U in blocks:
        I = U.shape[1]
        ks = k_slices[j][nu - 1][0]
        block_terms, block_nonzero = _merged_entries(U, nu)
        for (M, ii, k), coeff in block_terms.items():
            terms.append((int(M_starts[j]) + M, [(0, i) for i in ii] + [(1, ks + k)], coeff))
        scale = max((abs(v) for v in block_terms.values()), default=0.0)
        n_terms = sum(1 for v in block_terms.values() if abs(v) > 1e-14 * scale)
        per_block.append((out_dims[j], nu, int(U.size), block_nonzero, n_terms))
        dense += int(U.size)
        nonzero += block_nonzero
    if I is None:
        raise ValueError("no coupling tensors")
    x = Operand.channel_major("x", I, channels, rows="atom")
    W = Operand.component_major("W", K_total, channels, rows="species")
    poly = SparsePolynomial.from_terms((x, W), _output_operand(out_dims, M_starts, channels), terms)
    stats = SymmetricContractionStats(dense, nonzero, poly.num_terms, per_block)
    return poly, stats, k_slices


def fold_species_weights(poly: SparsePolynomial) -> tuple[SparsePolynomial, np.ndarray]:
    r"""The contraction with its per-species weights folded into the coupling coefficients.

    Every term of :func:`symmetric_contraction_polynomial` is
    :math:`u \, W[z, k, c] \, x_{i_1} \cdots x_{i_\nu}` into an output component :math:`M`. The
    terms of one pair :math:`t = (M, i_1 \ldots i_\nu)` differ only in :math:`k`, so

    .. math::

        V[z, t, c] = \sum_k S[t, k] \, W[z, k, c], \qquad
        B[c, M] = \sum_{t \ni M} V[z, t, c] \, x[c, i_1] \cdots x[c, i_\nu]

    leaves one unit-coefficient term per pair. The paper configuration's first product goes from
    1,909 terms to 410 (its forward program from 2,768 vector instructions to 888, the gradient
    in ``x`` from 6,064 to 2,117), the second from 293 to 94. ``V`` is ``[species, T, channels]``
    (species rows, like ``W``); ``S`` is the dense float64 ``[T, K]`` fold, a matrix product away
    from ``W`` (and differentiable through it).

    Returns ``(folded polynomial over (x, V), S)``.
    """
    x, W = poly.operands
    pairs: dict[tuple[int, tuple[int, ...]], int] = {}
    entries: list[tuple[int, int, float]] = []
    for (o, factors), coeff in poly.terms.items():
        xs = tuple(i for a, i in factors if a == 0)
        (k,) = (i for a, i in factors if a == 1)
        entries.append((pairs.setdefault((o, xs), len(pairs)), k, coeff))
    S = np.zeros((len(pairs), W.size))
    for t, k, coeff in entries:
        S[t, k] += coeff
    V = Operand.component_major("V", len(pairs), W.width // W.size, rows="species")
    terms = [(o, [(0, i) for i in xs] + [(1, t)], 1.0) for (o, xs), t in pairs.items()]
    return SparsePolynomial.from_terms((x, V), poly.output, terms, rtol=0.0), S


#: the correlations whose kernels are checked against mace's own module (tests/test_kernels_mace.py
#: and the CUDA simulator suite); a model of another is refused, not computed unchecked
PROVEN_CORRELATIONS = (1, 2, 3, 4, 5)


class _ContractionParams(torch.nn.Module):
    """Parameters and buffers of one output irrep, named as in mace's ``Contraction``."""

    def __init__(self, src: torch.nn.Module):
        super().__init__()
        self.correlation = int(src.correlation)
        if self.correlation not in PROVEN_CORRELATIONS:
            raise TypeError(
                f"{type(src).__name__} of correlation {self.correlation}: the workbench kernels are checked "
                f"against mace for correlation {PROVEN_CORRELATIONS[0]}-{PROVEN_CORRELATIONS[-1]} only; keep this "
                "model on backend 'e3nn' (or 'torch')"
            )
        self.num_features = int(src.num_features)
        self.weights_max = src.weights_max  # the same Parameter objects: optimizers keep working
        self.weights = src.weights
        for name, buf in src.named_buffers(recurse=False):
            self.register_buffer(name, buf)

    def U_tensors(self, nu: int) -> torch.Tensor:
        return getattr(self, f"U_matrix_{nu}")

    def weights_by_order(self) -> list[torch.Tensor]:
        """``[W^{nu=1}, ..., W^{nu=max}]``, each ``[elements, k, channels]``."""
        ws = [self.weights[self.correlation - 1 - nu] for nu in range(1, self.correlation)]
        return ws + [self.weights_max]


def one_hot_species(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(species, empty)`` of one-hot node attributes ``y`` ``[atoms, elements]``: the element
    of each row, and a mask of all-zero rows (None when there is none). A row that is neither
    one-hot nor zero (a soft mixture) is refused, naming it: the kernels pick one weight row per
    atom, where e3nn would mix them."""
    species = y.argmax(dim=-1)
    total = y.sum(dim=-1)
    picked = y.gather(1, species[:, None]).squeeze(1)
    empty = total == 0
    bad = ~empty & ((picked != 1) | (total != 1))
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"node_attrs row {row} is not one-hot ({y[row].tolist()[:8]}...): the numba symmetric "
            "contraction needs one species per atom; use backend='e3nn' for mixed attributes"
        )
    return species, (empty if bool(empty.any()) else None)


class SymmetricContraction(torch.nn.Module):
    r"""Drop-in for ``mace.modules.symmetric_contraction.SymmetricContraction`` on the
    sparse-polynomial kernels (numba CUDA on GPU tensors, numba CPU otherwise).

    ``forward(x, y)``: ``x`` ``[atoms, channels, (l_max+1)^2]``, ``y`` ``[atoms, elements]`` one-hot
    node attributes (the species is ``y.argmax(-1)``, as in cuEquivariance's MACE path) ->
    ``[atoms, sum_j channels * (2L_j+1)]``. Same parameters, buffers and ``state_dict`` keys
    as mace's module, so state dicts load both ways.
    """

    #: the descriptor backend evaluating the polynomial (:mod:`workbench.kernels.registry`); a
    #: class default, so models pickled before it existed load as numba
    kernel_backend: str = DEFAULT_BACKEND

    def __init__(self, src: torch.nn.Module):
        super().__init__()
        self.irreps_in = src.irreps_in
        self.irreps_out = src.irreps_out
        self.internal_weights = getattr(src, "internal_weights", True)
        self.shared_weights = getattr(src, "shared_weights", None)
        self.contractions = torch.nn.ModuleList([_ContractionParams(c) for c in src.contractions])
        self._op: PolyOp | None = None

    @classmethod
    def from_mace(cls, src: torch.nn.Module) -> SymmetricContraction:
        """Wrap a mace ``SymmetricContraction``, sharing its parameters and buffers."""
        return cls(src)

    def to_mace(self) -> torch.nn.Module:
        """A mace ``SymmetricContraction`` holding this module's parameters and buffers."""
        from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

        ref = self.contractions[0].weights_max
        with default_dtype(ref.dtype):
            m = MaceSC(
                irreps_in=self.irreps_in,
                irreps_out=self.irreps_out,
                correlation=self.contractions[0].correlation,
                num_elements=ref.shape[0],
            )
        for dst, src in zip(m.contractions, self.contractions):
            dst.weights_max = src.weights_max
            dst.weights = src.weights
            for name, buf in src.named_buffers(recurse=False):
                dst.register_buffer(name, buf)
        return m.to(ref.device)

    # ------------------------------------------------------------------ descriptor
    @property
    def num_channels(self) -> int:
        return self.contractions[0].num_features

    def polynomial(self) -> tuple[SparsePolynomial, SymmetricContractionStats, list]:
        U_list = [
            [c.U_tensors(nu).detach().cpu().double().numpy() for nu in range(1, c.correlation + 1)]
            for c in self.contractions
        ]
        out_dims = [ir.dim for _, ir in self.irreps_out]
        return symmetric_contraction_polynomial(U_list, out_dims, self.num_channels)

    def _op_key(self) -> tuple:
        # U depends only on the irreps: one op (and its cached derivatives) is shared by every
        # module with the same coupling tensors and channel count
        h = hashlib.sha1()
        for c in self.contractions:
            for nu in range(1, c.correlation + 1):
                U = np.ascontiguousarray(c.U_tensors(nu).detach().cpu().double().numpy())
                h.update(U.tobytes())
                h.update(str(U.shape).encode())
        return (h.hexdigest(), str(self.irreps_out), self.num_channels)

    @property
    def op(self) -> PolyOp:
        if getattr(self, "_op", None) is None:
            key = self._op_key()
            with _OP_CACHE_LOCK:
                if key not in _OP_CACHE:
                    poly, stats, _ = self.polynomial()
                    _OP_CACHE[key] = (PolyOp(poly.operands, [poly]), stats)
                self._op, self._stats = _OP_CACHE[key]
        return self._op

    @property
    def folded_op(self) -> tuple[PolyOp, np.ndarray]:
        """``(op over (x, V), S)``: the contraction with the weights folded in
        (:func:`fold_species_weights`), shared like :attr:`op`."""
        if getattr(self, "_folded", None) is None:
            key = ("folded", *self._op_key())
            with _OP_CACHE_LOCK:
                if key not in _OP_CACHE:
                    poly, S = fold_species_weights(self.polynomial()[0])
                    _OP_CACHE[key] = (PolyOp(poly.operands, [poly]), S)
                self._folded = _OP_CACHE[key]
        return self._folded

    def stats(self) -> SymmetricContractionStats:
        _ = self.op  # builds the op and its stats on first use
        return self._stats

    def __getstate__(self):  # the compiled op is rebuilt from the buffers after loading
        state = self.__dict__.copy()
        state["_op"] = None
        for name in ("_stats", "_folded", "_fold_matrices"):
            state.pop(name, None)
        return state

    def concatenated_weights(self) -> torch.Tensor:
        """All weights as ``[elements, K_total, channels]`` in the polynomial's ``k`` order."""
        return torch.cat([w for c in self.contractions for w in c.weights_by_order()], dim=1)

    def fold(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` folds the weights first (``KernelOptions.fold_species``;
        default: where the CPU kernels run, the only place it is measured; the CUDA kernels keep
        the plan :mod:`~workbench.kernels.precompile` compiles ahead). Never while tracing or replaying a CUDA
        graph: the species present are read on the host."""
        if tracing() or no_sync():
            return False
        options = kernel_options()
        if options.fold_species is not None:
            return options.fold_species
        return x.device.type == "cpu" and not options.cudasim  # where the CPU kernels run

    def folded_weights(self, W: torch.Tensor, species: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(V, species)``: :math:`V = S W` ``[present species, T, channels]`` for the species
        present only (89 elements of a foundation model, a few in one structure), and each
        atom's row of ``V``."""
        _, S = self.folded_op
        cache = self.__dict__.setdefault("_fold_matrices", {})
        key = (W.dtype, W.device)
        if key not in cache:
            with torch.inference_mode(False):  # kept for later calls that save it for backward
                cache[key] = torch.as_tensor(S, dtype=W.dtype, device=W.device)
        present, rows = torch.unique(species, return_inverse=True)
        if present.numel() == 0:  # no atoms: one row keeps the shapes valid
            present = species.new_zeros(1)
        return torch.matmul(cache[key], W.index_select(0, present)), rows

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        W = self.concatenated_weights()
        if y.dim() != 2:
            species, empty = y.to(torch.int64), None
        elif no_sync():  # no host sync: every row masked, and the one-hot check left to eager calls
            species, empty = y.argmax(dim=-1), y.sum(dim=-1) == 0
        else:
            species, empty = one_hot_species(y)
        op = self.op
        if self.fold(x):
            op = self.folded_op[0]
            W, species = self.folded_weights(W, species)
        Z = W.shape[0]
        (out,) = apply_poly_op(op, species, Z, x.reshape(B, -1), W.reshape(Z, -1), backend=self.kernel_backend)
        # e3nn mixes the weights by y: an all-zero row (an atom of no species) gives zeros.
        return out * (~empty).to(out.dtype)[:, None] if empty is not None else out

    def extra_repr(self) -> str:
        return f"{self.irreps_in} -> {self.irreps_out}, correlation={self.contractions[0].correlation}, backend=numba"
