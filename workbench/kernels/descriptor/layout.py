r"""Kernel layout: how operands map to kernel array arguments and how their rows are indexed.

Every kernel takes a fixed number of operand arrays (unused ones get a dummy) and, per used
operand component (a *slot*), a row code saying which row of its array the thread reads:

* atom ops: arrays ``0 .. MAX_ATOM_ARRAYS - 1`` are per atom (row code ``ATOM``, the thread's
  atom ``b``), the next ``MAX_SPECIES_ARRAYS`` per species (row code ``SPECIES``, the atom's
  species ``z``);
* edge ops: ``MAX_EDGE_ARRAYS`` arrays in operand order, read at the thread's edge ``e``
  (``EDGE``), at its sender ``s`` (``SENDER``) or at its receiver ``r`` (``RECEIVER``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ATOM_ROWS",
    "EDGE_ROWS",
    "MAX_ATOM_ARRAYS",
    "MAX_EDGE_ARRAYS",
    "MAX_SPECIES_ARRAYS",
    "ROWS",
    "ROW_CODES",
    "array_ids",
    "row_codes",
]

#: how an operand's rows are indexed: atom ops ("atom", "species"), edge ops ("edge", "sender", "receiver")
ATOM_ROWS: tuple[str, ...] = ("atom", "species")
EDGE_ROWS: tuple[str, ...] = ("edge", "sender", "receiver")
ROWS: tuple[str, ...] = ATOM_ROWS + EDGE_ROWS

MAX_ATOM_ARRAYS = 6
MAX_SPECIES_ARRAYS = 4
MAX_EDGE_ARRAYS = 8

ATOM, SPECIES = 0, 1
EDGE, SENDER, RECEIVER = 0, 1, 2
#: row code of each kind of rows, as the kernels read it
ROW_CODES: dict[str, int] = {"atom": ATOM, "species": SPECIES, "edge": EDGE, "sender": SENDER, "receiver": RECEIVER}


def array_ids(rows: Sequence[str]) -> tuple[int, ...]:
    """Kernel array argument of each operand (given its rows); raises when they do not fit.

    Atom ops: atom operands fill arrays ``0..5`` and species operands ``6..9`` in operand order;
    edge ops: operand ``a`` is array ``a``. Atom and edge rows never mix in one op."""
    if all(r in EDGE_ROWS for r in rows):
        if len(rows) > MAX_EDGE_ARRAYS:
            raise ValueError(
                f"edge kernels take at most {MAX_EDGE_ARRAYS} operands, got {len(rows)} "
                "(derivatives beyond the second order of a 3-operand product need more)"
            )
        return tuple(range(len(rows)))
    if not all(r in ATOM_ROWS for r in rows):
        raise ValueError(f"an op's operands are either all {ATOM_ROWS} or all {EDGE_ROWS}, got {tuple(rows)}")
    n_atom = sum(r == "atom" for r in rows)
    n_species = len(rows) - n_atom
    if n_atom > MAX_ATOM_ARRAYS or n_species > MAX_SPECIES_ARRAYS:
        raise ValueError(f"too many operands for the kernels: {n_atom} atom, {n_species} species")
    ids, ia, isp = [], 0, 0
    for r in rows:
        if r == "atom":
            ids.append(ia)
            ia += 1
        else:
            ids.append(MAX_ATOM_ARRAYS + isp)
            isp += 1
    return tuple(ids)


def row_codes(rows: Sequence[str]) -> tuple[int, ...]:
    """:data:`ROW_CODES` of each operand."""
    return tuple(ROW_CODES[r] for r in rows)
