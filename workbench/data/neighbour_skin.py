"""A neighbour list kept across MD steps: built once with a skin, filtered at every step.

mace's ``get_neighborhood`` (matscipy) searches the whole structure at every call: 25-29 ms at
1,536 water atoms and 4.5 Å, on one core, while the model's step runs on all of them. Between
two MD steps atoms move by hundredths of an Å, so :class:`SkinNeighbourList` searches at
``cutoff + skin`` and, while no atom has moved more than ``skin / 2`` since (and the cell, the
periodicity, the atom count and the cutoff are the same), answers from that list: a pair now
closer than ``cutoff`` was closer than ``cutoff + skin`` then. It keeps the pairs within
``cutoff`` by their current distance (``D = x_j - x_i + S . cell``), so the edges are exactly
mace's set; their order within an atom's list can differ (the search's bins depend on the cutoff).

Drop-in for ``get_neighborhood``: same arguments, same ``(edge_index, shifts, unit_shifts,
cell)``, the cell of non-periodic directions widened as mace widens it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["SKIN_A", "SkinNeighbourList"]

#: Å searched beyond the cutoff: at 0.5 fs steps in water the list lasts tens of steps
SKIN_A = 0.5


class SkinNeighbourList:
    """``get_neighborhood`` with a list reused while it is valid; ``builds`` counts searches, and
    ``search`` (default: mace's ``get_neighborhood``) is what searches."""

    def __init__(self, skin: float = SKIN_A, search: Callable | None = None) -> None:
        if not skin > 0:
            raise ValueError(f"skin must be positive, got {skin!r}")
        self.skin = float(skin)
        self.search = search
        self.builds = 0
        self._kept: tuple | None = None  # (key, positions, edge_index, unit_shifts)

    def __call__(
        self,
        positions: np.ndarray,
        cutoff: float,
        pbc: tuple | None = None,
        cell: np.ndarray | None = None,
        true_self_interaction: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        positions = np.asarray(positions)
        pbc = tuple(bool(p) for p in (pbc if pbc is not None else (False, False, False)))
        cell = np.array(cell if cell is not None else np.zeros((3, 3)), dtype=float)
        key = (float(cutoff), pbc, bool(true_self_interaction), positions.shape, cell.tobytes())
        if not self._valid(key, positions):
            edge_index, _, unit_shifts, _ = self._search()(
                positions, cutoff + self.skin, pbc, cell.copy(), true_self_interaction
            )
            self._kept = (key, positions.copy(), edge_index, unit_shifts)
            self.builds += 1
        _, _, edge_index, unit_shifts = self._kept
        used_cell = _widened_cell(positions, float(cutoff), pbc, cell)
        shifts = unit_shifts @ used_cell
        sender, receiver = edge_index
        d = positions[receiver] - positions[sender] + shifts
        keep = np.einsum("ij,ij->i", d, d) < cutoff * cutoff
        return edge_index[:, keep], shifts[keep], unit_shifts[keep], used_cell

    def _search(self) -> Callable:
        if self.search is None:
            from mace.data.neighborhood import get_neighborhood

            return get_neighborhood
        return self.search

    def _valid(self, key: tuple, positions: np.ndarray) -> bool:
        if self._kept is None or self._kept[0] != key:
            return False
        moved = positions - self._kept[1]
        return bool(np.einsum("ij,ij->i", moved, moved).max(initial=0.0) <= (self.skin / 2) ** 2)


def _widened_cell(positions: np.ndarray, cutoff: float, pbc: tuple, cell: np.ndarray) -> np.ndarray:
    """The cell mace's ``get_neighborhood`` returns: rows of non-periodic directions widened to
    ``5 x cutoff x (max |coordinate| + 1)``; an all-zero cell taken as the identity first."""
    out = np.identity(3) if not cell.any() else cell.copy()
    wide = (np.max(np.absolute(positions)) + 1) * 5 * cutoff if positions.size else 5 * cutoff
    for axis in range(3):
        if not pbc[axis]:
            out[axis] = wide * np.identity(3)[axis]
    return out
