r"""Sparse polynomial descriptors: one description of a channelwise sparse operation.

A :class:`SparsePolynomial` describes, for every channel :math:`c` independently,

.. math::

    \mathrm{out}[c, o] = \sum_{t} \alpha_t \prod_{(a, i) \in F_t} \mathrm{operand}_a[c, i]

where each term :math:`t = (o, F_t, \alpha_t)` names one output component :math:`o`, a
multiset of factors :math:`F_t` (operand :math:`a`, component :math:`i`) and a real
coefficient. Each operand says how its rows are indexed (:data:`ROWS`): per atom (one row
per atom), per species (one row per chemical element, gathered by the atom's species; as an
*output* its rows are summed over the atoms of that species), or, for message passing, per
edge / sender node / receiver node (gathered through the edge's end points; as an output,
scatter-summed).

Every kernel in :mod:`workbench.kernels` evaluates only this form, and derivatives are
derived, never hand written: the vector-Jacobian product of a sparse polynomial with
respect to an operand is again a sparse polynomial (:meth:`SparsePolynomial.vjp`), so
forward, backward and double backward share one description (as in cuEquivariance's
segmented polynomials). Factors inside a term are kept sorted and equal monomials are
merged, which exploits the symmetry of products :math:`x_{i_1} \cdots x_{i_\nu}` of one operand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from workbench.kernels.descriptor.layout import ROWS

__all__ = ["ROWS", "Operand", "SparsePolynomial"]

Factor = tuple[int, int]  # (operand position, component index)


@dataclass(frozen=True)
class Operand:
    r"""One operand (or output) of a channelwise sparse polynomial.

    Parameters
    ----------
    name : str
        unique name inside a polynomial (``"x"``, ``"W"``, ``"grad_out"``, ...)
    size : int
        number of components :math:`i` per channel
    rows : str
        how the array's rows are indexed, one of :data:`ROWS`: ``"atom"`` (``[num_atoms,
        width]``) or ``"species"`` (``[num_species, width]``, row picked by the atom's species,
        summed over atoms when it is an output); for edge ops ``"edge"`` (one row per edge),
        ``"sender"`` / ``"receiver"`` (a node array whose row is the edge's sender / receiver:
        gathered as an input, scatter-summed as an output).
    offsets, cstrides : tuple of int
        memory layout: element :math:`(c, i)` of a row is ``row[offsets[i] + c * cstrides[i]]``;
        a zero cstride broadcasts the component over channels (as an output: summed over them)
    width : int
        row length of the array
    """

    name: str
    size: int
    rows: str
    offsets: tuple[int, ...]
    cstrides: tuple[int, ...]
    width: int

    def __post_init__(self) -> None:
        if self.rows not in ROWS:
            raise ValueError(f"rows must be one of {ROWS}, got {self.rows!r}")
        if len(self.offsets) != self.size or len(self.cstrides) != self.size:
            raise ValueError(f"operand {self.name}: layout length does not match size {self.size}")

    @property
    def batch(self) -> str:
        """The former name of :attr:`rows` (kept for existing code)."""
        return self.rows

    @staticmethod
    def channel_major(name: str, size: int, channels: int, rows: str = "atom", *, batch: str | None = None) -> Operand:
        """Layout ``[rows, channels, size]`` (e.g. equivariant features ``[atoms, channels, (lmax+1)^2]``);
        ``batch`` is the former name of ``rows``."""
        return Operand(name, size, batch or rows, tuple(range(size)), (size,) * size, channels * size)

    @staticmethod
    def component_major(
        name: str, size: int, channels: int, rows: str = "species", *, batch: str | None = None
    ) -> Operand:
        """Layout ``[rows, size, channels]`` (e.g. per-element weights ``[elements, k, channels]``);
        ``batch`` is the former name of ``rows``."""
        return Operand(
            name, size, batch or rows, tuple(k * channels for k in range(size)), (1,) * size, size * channels
        )

    def renamed(self, name: str) -> Operand:
        return Operand(name, self.size, self.rows, self.offsets, self.cstrides, self.width)


@dataclass(frozen=True, eq=False)
class SparsePolynomial:
    r"""Sum of monomials mapping operands to one output, per channel.

    Parameters
    ----------
    operands : tuple of :class:`Operand`
        the inputs; factors refer to them by position
    output : :class:`Operand`
        the output
    terms : dict
        ``{(o, ((a, i), ...)): coefficient}`` with factors sorted; build with
        :meth:`from_terms`, which merges duplicates
    """

    operands: tuple[Operand, ...]
    output: Operand
    terms: Mapping[tuple[int, tuple[Factor, ...]], float] = field(repr=False)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_terms(
        operands: Sequence[Operand],
        output: Operand,
        terms: Iterable[tuple[int, Sequence[Factor], float]],
        rtol: float = 1e-14,
    ) -> SparsePolynomial:
        """Canonicalise ``(o, factors, coefficient)`` triples: sort factors, merge equal
        monomials, drop coefficients below ``rtol * max|coefficient|`` (exact cancellations)."""
        names = [op.name for op in operands]
        if len(set(names)) != len(names) or output.name in names:
            raise ValueError(f"operand names must be unique: {names} -> {output.name}")
        merged: dict[tuple[int, tuple[Factor, ...]], float] = {}
        for o, factors, coeff in terms:
            key = (int(o), tuple(sorted((int(a), int(i)) for a, i in factors)))
            merged[key] = merged.get(key, 0.0) + float(coeff)
        if merged:
            scale = max(abs(v) for v in merged.values())
            merged = {k: v for k, v in merged.items() if abs(v) > rtol * scale}
        return SparsePolynomial(tuple(operands), output, merged)

    # ------------------------------------------------------------------ algebra
    def operand_index(self, name: str) -> int:
        for k, op in enumerate(self.operands):
            if op.name == name:
                return k
        raise KeyError(f"no operand {name!r} in {[op.name for op in self.operands]}")

    def vjp(self, wrt: str, cotangent: Operand | None = None) -> SparsePolynomial:
        r"""Vector-Jacobian product with respect to operand ``wrt``.

        .. math::

            \bar{a}[c, i] = \sum_o \bar{y}[c, o] \, \frac{\partial y[c, o]}{\partial a[c, i]}

        The result is a sparse polynomial over ``operands + (cotangent,)`` whose output has
        the layout and rows of ``wrt``. A factor that occurs :math:`n` times gives
        :math:`n` equal terms, merged into one with coefficient :math:`n \alpha`.
        """
        a = self.operand_index(wrt)
        if cotangent is None:
            cotangent = self.output.renamed(f"d({self.output.name})")
        if cotangent.size != self.output.size or cotangent.rows != self.output.rows:
            raise ValueError("cotangent must match the output's size and rows")
        cot = len(self.operands)
        new_terms = []
        for (o, factors), coeff in self.terms.items():
            for p, (fa, fi) in enumerate(factors):
                if fa != a or (p > 0 and factors[p - 1] == (fa, fi)):
                    continue  # one term per distinct factor; its multiplicity below
                mult = sum(1 for f in factors if f == (fa, fi))
                rest = list(factors[:p]) + list(factors[p + 1 :]) + [(cot, o)]
                new_terms.append((fi, rest, mult * coeff))
        out = self.operands[a].renamed(f"d({wrt})")
        return SparsePolynomial.from_terms(self.operands + (cotangent,), out, new_terms)

    def with_operands(self, operands: Sequence[Operand]) -> SparsePolynomial:
        """The same polynomial over a larger operand list (matched by name)."""
        pos = {op.name: k for k, op in enumerate(operands)}
        remap = [pos[op.name] for op in self.operands]
        terms = {(o, tuple(sorted((remap[a], i) for a, i in f))): c for (o, f), c in self.terms.items()}
        return SparsePolynomial(tuple(operands), self.output, terms)

    def __add__(self, other: SparsePolynomial) -> SparsePolynomial:
        if (other.output.size, other.output.rows) != (self.output.size, self.output.rows):
            raise ValueError("can only add polynomials with the same output")
        ops = list(self.operands)
        for op in other.operands:
            if op.name not in [o.name for o in ops]:
                ops.append(op)
        lhs, rhs = self.with_operands(ops), other.with_operands(ops)
        terms = [(o, f, c) for (o, f), c in lhs.terms.items()] + [(o, f, c) for (o, f), c in rhs.terms.items()]
        return SparsePolynomial.from_terms(ops, self.output, terms)

    def scaled(self, alpha: float) -> SparsePolynomial:
        return SparsePolynomial(self.operands, self.output, {k: alpha * v for k, v in self.terms.items()})

    # ------------------------------------------------------------------ inspection
    @property
    def num_terms(self) -> int:
        return len(self.terms)

    @property
    def max_degree(self) -> int:
        return max((len(f) for _, f in self.terms), default=0)

    def flops_per_channel(self) -> int:
        """Multiplications plus additions per (row, channel) for a plain term-by-term evaluation."""
        return sum(len(f) + 1 for _, f in self.terms)

    def evaluate_numpy(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """Reference evaluation for one channel: ``values[a]`` is a 1-D array of operand ``a``."""
        out = np.zeros(self.output.size, dtype=np.float64)
        for (o, factors), coeff in self.terms.items():
            p = coeff
            for a, i in factors:
                p *= values[a][i]
            out[o] += p
        return out

    def __repr__(self) -> str:
        ops = ", ".join(f"{op.name}[{op.size}]" for op in self.operands)
        return f"SparsePolynomial({ops} -> {self.output.name}[{self.output.size}], terms={self.num_terms}, max_degree={self.max_degree})"
