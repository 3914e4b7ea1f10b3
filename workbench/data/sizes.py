"""Graph sizes: atoms and edges per structure, measured or synthetic.

A *graph* is one structure with an edge for every ordered pair of atoms closer
than ``cutoff`` (periodic images included, self-pairs at zero shift excluded),
exactly the graph MACE builds. Both functions return a structured array with
dtype :data:`SIZES_DTYPE`::

    sizes["atoms"]   int64  vertices per graph
    sizes["edges"]   int64  directed edges per graph (i->j and j->i both counted)
    sizes["family"]  str    Table-3 family (the extxyz ``config_type``)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import lru_cache
from importlib import resources

import ase
import numpy as np

from workbench.data.chemical_families import FAMILY_NAMES, family_counts, sample_natoms

SIZES_DTYPE = np.dtype([("atoms", np.int64), ("edges", np.int64), ("family", "U14")])
EDGE_STATS_FILE = "edge_stats.json"


def count_edges(atoms: ase.Atoms, cutoff: float = 4.5) -> int:
    """Number of directed edges of ``atoms`` at ``cutoff`` Å (periodic images included; the
    count of vesin's full neighbour list, by :func:`workbench.data.neighbours.neighbour_stats`)."""
    from workbench.data.neighbours import neighbour_stats

    if len(atoms) == 0:
        return 0
    return neighbour_stats(atoms.positions, atoms.cell.array, atoms.pbc, cutoff).edges


def graph_sizes(structures: Iterable[ase.Atoms], cutoff: float = 4.5, progress: bool = False) -> np.ndarray:
    """Measure atoms, edges and family of every structure.

    ``structures``: any iterable of :class:`ase.Atoms`; the family is
    ``info["config_type"]`` (``"unknown"`` when absent). Returns an array of
    dtype :data:`SIZES_DTYPE`, one row per structure, in input order.
    """
    structures = list(structures)
    out = np.zeros(len(structures), dtype=SIZES_DTYPE)
    from workbench.progress import bar

    with bar(total=len(structures), desc="neighbour lists", unit="graph", disable=not progress) as b:
        for k, atoms in enumerate(structures):
            out[k] = (len(atoms), count_edges(atoms, cutoff), str(atoms.info.get("config_type", "unknown")))
            b.update(1)
    return out


def edge_stats_from_sizes(sizes: np.ndarray, cutoff: float, source: str) -> dict:
    """Per-family edges-per-atom samples, the input of :func:`synthetic_sizes`."""
    fams = {}
    for name in FAMILY_NAMES:
        sel = sizes[sizes["family"] == name]
        if sel.size == 0:
            continue
        epa = sel["edges"] / np.maximum(sel["atoms"], 1)
        fams[name] = {
            "n_graphs": int(sel.size),
            "edges_per_atom_mean": round(float(epa.mean()), 3),
            "edges_per_atom_min": round(float(epa.min()), 3),
            "edges_per_atom_max": round(float(epa.max()), 3),
            "edges_per_atom": [round(float(v), 4) for v in np.sort(epa)],
        }
    return {"cutoff": cutoff, "source": source, "families": fams}


@lru_cache(maxsize=1)
def load_edge_stats() -> dict:
    """Edges-per-atom samples measured by :func:`graph_sizes` on the embedded dataset.

    Regenerate with ``workbench data stats`` after changing the generators.
    """
    text = resources.files("workbench.data").joinpath(EDGE_STATS_FILE).read_text()
    return json.loads(text)


def synthetic_sizes(
    n: int, seed: int = 0, families: Sequence[str] | dict[str, int] | None = None, stats: dict | None = None
) -> np.ndarray:
    """Sizes only, at the paper's scale: ``synthetic_sizes(2_650_000)`` takes ~1 s.

    Families follow Table-3 proportions (or ``families``, as in
    :func:`workbench.data.chemical_families.family_counts`); atoms come from
    :func:`~workbench.data.chemical_families.sample_natoms`, the same draw the structure
    generators use; edges are ``round(atoms * e)`` with ``e`` resampled from the
    edges-per-atom values measured on real generated structures of that family
    (:func:`load_edge_stats`). Rows are in a random order.
    """
    stats = load_edge_stats() if stats is None else stats
    counts = family_counts(n, families)
    rng = np.random.default_rng(seed)
    out = np.zeros(sum(counts.values()), dtype=SIZES_DTYPE)
    start = 0
    for name, count in counts.items():
        if count == 0:
            continue
        if name not in stats["families"]:
            raise KeyError(f"no measured edges-per-atom for family {name!r}; run `workbench data stats`")
        epa = np.asarray(stats["families"][name]["edges_per_atom"], dtype=float)
        atoms = sample_natoms(name, count, rng)
        block = out[start : start + count]
        block["atoms"] = atoms
        block["edges"] = np.rint(atoms * epa[rng.integers(0, epa.size, size=count)]).astype(np.int64)
        block["family"] = name
        start += count
    return out[rng.permutation(out.size)]
