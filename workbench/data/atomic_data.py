"""Conversion to mace-torch's ``AtomicData`` through mace's own builders.

We call ``mace.data.config_from_atoms`` and ``AtomicData.from_config`` rather than
re-implementing them, so graphs, shifts and label weights are exactly what
mace-torch's own training would build from the same extxyz (a non-periodic structure far from
the origin is centred first: :mod:`workbench.data.neighbour_frame`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import ase

from workbench.data.keys import ENERGY_KEY, FORCES_KEY, STRESS_KEY, VIRIALS_KEY


def key_specification(
    energy_key: str = ENERGY_KEY,
    forces_key: str = FORCES_KEY,
    stress_key: str = STRESS_KEY,
    virials_key: str = VIRIALS_KEY,
):
    """mace's ``KeySpecification`` for our keys (``REF_energy``, ``REF_forces``, ``REF_stress``,
    ``REF_virials``): a graph without a stress or virial label gets weight 0 for it."""
    from mace.data.utils import KeySpecification

    return KeySpecification(
        info_keys={"energy": energy_key, "stress": stress_key, "virials": virials_key},
        arrays_keys={"forces": forces_key},
    )


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
    stress_key: str = STRESS_KEY,
    virials_key: str = VIRIALS_KEY,
) -> list:
    """Convert structures to a list of ``mace.data.AtomicData`` graphs.

    Unlabelled frames are kept; mace gives their missing labels weight 0.
    ``z_table`` defaults to the elements present in ``structures``; pass the
    model's table when the data is for an existing model.
    """
    from mace.data import config_from_atoms

    from workbench.data.neighbour_frame import graph_from_config

    if isinstance(structures, ase.Atoms):
        structures = [structures]
    z_table = z_table_for(structures) if z_table is None else z_table
    missing = sorted({int(z) for a in structures for z in a.numbers} - {int(z) for z in z_table.zs})
    if missing:
        raise ValueError(f"elements with atomic numbers {missing} are not in the model's z_table {list(z_table.zs)}")
    spec = key_specification(energy_key, forces_key, stress_key, virials_key)
    out = []
    for atoms in structures:
        config = config_from_atoms(atoms, key_specification=spec, head_name=head)
        out.append(graph_from_config(config, z_table, cutoff, heads=[head]))
    return out
