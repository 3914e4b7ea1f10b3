"""nequip's batched ``AtomicDataDict`` of ``ase.Atoms`` frames, as nequip's own data pipeline
builds it (``from_ase``, its neighbour list, the species-to-type map): inputs for benchmarks
and tests of NequIP and Allegro models."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["atomic_data"]


def atomic_data(frames: Sequence, type_names: Sequence[str], r_max: float, shuffle_edges: int | None = None) -> dict:
    """One batch of ``frames`` for a model with ``type_names`` and cutoff ``r_max`` (float64
    positions, as nequip keeps them). ``shuffle_edges``: permute each frame's edges with this
    seed (the kernels must not rely on nequip's edge order)."""
    from nequip.data import AtomicDataDict, from_ase
    from nequip.data._nl import compute_neighborlist_
    from nequip.data.transforms import ChemicalSpeciesToAtomTypeMapper

    mapper = ChemicalSpeciesToAtomTypeMapper(model_type_names=list(type_names))
    data = []
    for atoms in frames:
        d = mapper(compute_neighborlist_(from_ase(atoms), r_max))
        if shuffle_edges is not None:
            perm = torch.randperm(d["edge_index"].shape[1], generator=torch.Generator().manual_seed(shuffle_edges))
            d["edge_index"] = d["edge_index"][:, perm]
            if "edge_cell_shift" in d:
                d["edge_cell_shift"] = d["edge_cell_shift"][perm]
        data.append(d)
    return AtomicDataDict.batched_from_list(data)
