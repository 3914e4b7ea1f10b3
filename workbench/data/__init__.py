"""Structures and sizes: the Table-3 mixture, extxyz I/O, graph sizes, MACE ``AtomicData``.

>>> from workbench.data import make_mixture, graph_sizes, synthetic_sizes
>>> atoms = make_mixture(n=200, seed=0)          # list[ase.Atoms] with REF_energy / REF_forces
>>> sizes = graph_sizes(atoms, cutoff=4.5)       # fields "atoms", "edges", "family"
>>> big = synthetic_sizes(n=2_650_000, seed=0)   # same dtype, sizes only
"""

from workbench.data.atomic_data import to_atomic_data, z_table_for
from workbench.data.chemical_families import FAMILIES, FAMILY_NAMES, family_counts, proportions, sample_natoms
from workbench.data.embedded import EMBEDDED_PATH, load_embedded
from workbench.data.io import StructureError, read_structures, validate_structure, write_structures
from workbench.data.sizes import SIZES_DTYPE, count_edges, graph_sizes, synthetic_sizes
from workbench.data.synth.mixture import make_mixture

__all__ = [
    "EMBEDDED_PATH",
    "FAMILIES",
    "FAMILY_NAMES",
    "SIZES_DTYPE",
    "StructureError",
    "count_edges",
    "family_counts",
    "graph_sizes",
    "load_embedded",
    "make_mixture",
    "proportions",
    "read_structures",
    "sample_natoms",
    "synthetic_sizes",
    "to_atomic_data",
    "validate_structure",
    "write_structures",
    "z_table_for",
]
