"""Where a structure sits when mace's neighbour list sees it: far from the origin, it is moved.

mace's ``get_neighborhood`` gives every non-periodic direction a cell of
``5 x cutoff x (max |coordinate| + 1)`` Å and matscipy bins that cell: the bins grow with the
cube of the distance from the origin, not with the structure. A water molecule 100 Å away costs
0.5 GB, 10^4 Å away matscipy fails with "Failed to allocate seed array". Float32 models lose the
geometry too (at 10^6 Å float32 resolves 0.06 Å). Energy, forces and stress do not change under
a translation, so a structure that is not periodic in every direction and whose bounding box is
centred more than :data:`CENTRE_BEYOND_A` from the origin is built into its graph with that box
centred on the origin (the shift computed in float64, before any cast). Only the graph moves: the
caller's ``ase.Atoms`` and the positions MD writes keep the user's coordinates. A structure near
the origin is passed on untouched, so its graph is bit for bit mace's.

Every path that builds graphs for a model goes through here: :func:`graph_from_config` (training,
prepared stores, ``workbench eval``) and :func:`centred_atoms` (the MD calculator).
"""

from __future__ import annotations

from dataclasses import replace

import ase
import numpy as np

__all__ = ["CENTRE_BEYOND_A", "centred_atoms", "centred_config", "graph_from_config", "neighbour_shift"]

#: Å: a structure not periodic in every direction whose bounding-box centre is farther than this
#: from the origin (in any coordinate) is centred for its neighbour list
CENTRE_BEYOND_A = 10.0


def neighbour_shift(positions: np.ndarray, pbc) -> np.ndarray | None:
    """The translation (3,) Å that centres the structure's bounding box on the origin, or ``None``
    when it needs none (periodic in every direction, or already within :data:`CENTRE_BEYOND_A`)."""
    pbc = np.broadcast_to(np.asarray(pbc if pbc is not None else False, dtype=bool), (3,))
    positions = np.asarray(positions, dtype=np.float64)
    if pbc.all() or positions.size == 0:
        return None
    centre = 0.5 * (positions.min(axis=0) + positions.max(axis=0))
    if np.abs(centre).max() <= CENTRE_BEYOND_A:
        return None
    return -centre


def centred_config(config):
    """mace's ``Configuration``, or a copy of it moved by :func:`neighbour_shift`."""
    shift = neighbour_shift(config.positions, config.pbc)
    if shift is None:
        return config
    return replace(config, positions=np.asarray(config.positions, dtype=np.float64) + shift)


def centred_atoms(atoms: ase.Atoms) -> ase.Atoms:
    """``atoms`` itself, or a copy moved by :func:`neighbour_shift` (the original is not touched)."""
    shift = neighbour_shift(atoms.positions, atoms.pbc)
    if shift is None:
        return atoms
    moved = atoms.copy()
    moved.positions = atoms.positions + shift
    return moved


def graph_from_config(config, z_table, cutoff: float, **kwargs):
    """``mace.data.AtomicData.from_config`` of the :func:`centred_config` (``kwargs``: ``heads``)."""
    from mace.data import AtomicData

    return AtomicData.from_config(centred_config(config), z_table=z_table, cutoff=cutoff, **kwargs)
