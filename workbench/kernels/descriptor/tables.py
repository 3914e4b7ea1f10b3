r"""Term tables: one flat, kernel-ready layout of a :class:`~workbench.kernels.descriptor.SparsePolynomial`.

Every kernel (CPU loops, table-driven CUDA, unrolled CUDA) reads the same tables:

* **slots** - the operand components the polynomial actually uses, each one an element
  ``array[row, off + c * cs]`` of a kernel array argument (``slot_arr``) at the row given by
  its row code ``slot_rows`` (:data:`~workbench.kernels.descriptor.layout.ROW_CODES`: the
  thread's own row, or one reached through an index: species / sender / receiver), where
  ``c`` is the channel;
* **terms** - sorted by output component: ``out[t_out[t]] += t_coef[t] * prod_j v[t_fac[t, j]]``
  (a lower-degree term pads ``t_fac`` with slot ``num_slots``, which holds 1);
* **output** - component ``o`` of the output is ``out[row, out_off[o] + c * out_cs[o]]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from workbench.kernels.descriptor.polynomial import SparsePolynomial

__all__ = ["TermTable", "rows_property", "term_table"]


def rows_property(name: str) -> property:
    """A read-only property: the number of rows of the array attribute ``name``, as an int."""

    def rows(self) -> int:
        return int(getattr(self, name).shape[0])

    return property(rows)


@dataclass(frozen=True, eq=False)
class TermTable:
    """Flat tables of one output polynomial (see the module docstring); int64 index arrays."""

    slot_arr: np.ndarray
    slot_rows: np.ndarray
    slot_off: np.ndarray
    slot_cs: np.ndarray
    t_out: np.ndarray
    t_fac: np.ndarray
    coef64: np.ndarray = field(repr=False)
    out_off: np.ndarray
    out_cs: np.ndarray
    #: output components an earlier part of a term split already stored: this part adds to them
    add_to: tuple[int, ...] = ()

    num_slots = rows_property("slot_arr")
    num_terms = rows_property("t_out")

    def coef(self, dtype: str) -> np.ndarray:
        return self.coef64 if dtype == "float64" else self.coef64.astype(np.float32)

    def monomials(self) -> list[tuple[int, float, tuple[int, ...]]]:
        """``(output component, coefficient, used slots)`` per term, padding slots dropped."""
        S = self.num_slots
        return [
            (int(o), float(a), tuple(int(q) for q in f if q != S))
            for o, a, f in zip(self.t_out, self.coef64, self.t_fac)
        ]


def term_table(poly: SparsePolynomial, array_of: Sequence[int], rows_of: Sequence[int]) -> TermTable:
    """Tables of ``poly``; operand ``a`` lives in kernel array ``array_of[a]`` with row code ``rows_of[a]``."""
    used = sorted({f for _, fs in poly.terms for f in fs})
    slot_of = {f: q for q, f in enumerate(used)}
    S = len(used)
    items = sorted(poly.terms.items())  # by output component, then factors
    D = max(poly.max_degree, 1)
    t_fac = np.full((len(items), D), S, dtype=np.int64)  # slot S holds 1.0
    for t, ((_, fs), _) in enumerate(items):
        for j, f in enumerate(fs):
            t_fac[t, j] = slot_of[f]
    if not items:  # numba wants a non-empty second axis to type the loops
        t_fac = np.zeros((0, 1), dtype=np.int64)

    def ints(values) -> np.ndarray:
        return np.array(list(values), dtype=np.int64)

    return TermTable(
        slot_arr=ints(array_of[a] for a, _ in used),
        slot_rows=ints(rows_of[a] for a, _ in used),
        slot_off=ints(poly.operands[a].offsets[i] for a, i in used),
        slot_cs=ints(poly.operands[a].cstrides[i] for a, i in used),
        t_out=ints(o for (o, _), _ in items),
        t_fac=t_fac,
        coef64=np.array([c for _, c in items], dtype=np.float64),
        out_off=ints(poly.output.offsets),
        out_cs=ints(poly.output.cstrides),
    )
