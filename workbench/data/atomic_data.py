"""Conversion to mace-torch's ``AtomicData`` through mace's own builders.

We call ``mace.data.config_from_atoms`` and ``AtomicData.from_config`` rather than
re-implementing them, so graphs, shifts and label weights are exactly what
mace-torch's own training would build from the same extxyz.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import ase

from workbench.data.io import ENERGY_KEY, FORCES_KEY


def key_specification(energy_key: str = ENERGY_KEY, forces_key: str = FORCES_KEY):
    """mace's ``KeySpecification`` for our extxyz keys (``REF_energy``/``REF_forces``)."""
    from mace.data.utils import KeySpecification

    return KeySpecification(info_keys={"energy": energy_key}, arrays_keys={"forces": forces_key})


def z_table_for(structures: Iterable[ase.Atoms]):
    """The sorted ``AtomicNumberTable`` of every element present."""
    from mace.tools import AtomicNumberTable

    zs = sorted({int(z) for a in structures for z in a.numbers})
    return AtomicNumberTable(zs)


def to_atomic_data(
    structures: Sequence[ase.Atoms] | ase.Atoms,
    cutoff: float = 4.5,
    z_table=None,
    energy_key: str = ENERGY_KEY,
    forces_key: str = FORCES_KEY,
    head: str = "Default",
) -> list:
    """Convert structures to a list of ``mace.data.AtomicData`` graphs.

    Unlabelled frames are kept; mace gives their missing labels weight 0.
    ``z_table`` defaults to the elements present in ``structures``; pass the
    model's table when the data is for an existing model.
    """
    from mace.data import AtomicData, config_from_atoms

    if isinstance(structures, ase.Atoms):
        structures = [structures]
    z_table = z_table_for(structures) if z_table is None else z_table
    missing = sorted({int(z) for a in structures for z in a.numbers} - {int(z) for z in z_table.zs})
    if missing:
        raise ValueError(f"elements with atomic numbers {missing} are not in the model's z_table {list(z_table.zs)}")
    spec = key_specification(energy_key, forces_key)
    out = []
    for atoms in structures:
        config = config_from_atoms(atoms, key_specification=spec, head_name=head)
        out.append(AtomicData.from_config(config, z_table=z_table, cutoff=cutoff, heads=[head]))
    return out
