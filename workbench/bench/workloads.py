"""What the model benchmarks run on: the model configurations, and systems as mace batches.

* ``water-<atoms>``: one periodic liquid-water box (:func:`water_box`);
* ``crystal-<atoms>``: a strained, rattled fcc CuNi alloy supercell (:func:`crystal`), which
  has a stress;
* ``mixed``: a batch of the embedded data as a packer fills it (random graphs while they fit in
  :data:`MIXED_CAPACITY` atoms);
* ``mixture-<capacity>``: the embedded mixture packed by the paper's algorithm at ``capacity``
  atoms, every step its own batch (:func:`mixture_batches`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "CUTOFF",
    "MODELS",
    "crystal",
    "mace_batch",
    "mixture_batches",
    "system_batch",
    "system_structures",
    "to_device",
    "water_box",
    "workload_batches",
]

#: name -> (hidden irreps, max_ell, correlation)
MODELS: dict[str, tuple[str, int, int]] = {
    "paper": ("128x0e+128x1o", 3, 3),
    "small": ("32x0e+32x1o", 2, 2),
    "mp0": ("128x0e+128x1o", 3, 3),
}
CUTOFF = 4.5
#: what a model sets beyond :data:`MODELS`: its cutoff (Å; default :data:`CUTOFF`) and the
#: elements of its embedding (default: the system's). ``mp0`` is shaped like MACE-MP-0 medium:
#: 6 Å and the 89 elements H to Ac, whatever the structure holds
MODEL_SETTINGS: dict[str, dict] = {"mp0": {"r_max": 6.0, "elements": tuple(range(1, 90))}}


def model_cutoff(model: str) -> float:
    """``model``'s cutoff radius in Å."""
    return float(MODEL_SETTINGS.get(model, {}).get("r_max", CUTOFF))


def model_elements(model: str, present: Sequence[int]) -> list[int]:
    """The atomic numbers of ``model``'s embedding on a structure holding ``present``."""
    elements = MODEL_SETTINGS.get(model, {}).get("elements")
    if elements is None:
        return sorted({int(z) for z in present})
    missing = sorted({int(z) for z in present} - set(elements))
    if missing:
        raise ValueError(f"model {model!r} has no embedding for atomic numbers {missing}")
    return list(elements)


#: atoms of the ``mixed`` batch
MIXED_CAPACITY = 768
#: atoms of the largest liquid-water box :func:`~workbench.data.synth.generators.build_liquid_water`
#: fills (343 grid sites); larger boxes repeat a :data:`WATER_TILE`-atom box periodically
WATER_MAX_ATOMS = 1029
WATER_TILE = 768


def mace_batch(structures: Sequence, dtype: str, cutoff: float = CUTOFF, z_table=None) -> tuple[dict, list[int]]:
    """One mace batch dict of ``structures`` (tensors in ``dtype``, mace's own ``AtomicData`` and
    collation) and the atomic numbers of its ``z_table`` (default: the elements present)."""
    from mace.tools import torch_geometric

    from workbench.data.atomic_data import to_atomic_data, z_table_for
    from workbench.dtypes import default_dtype

    with default_dtype(dtype):
        z_table = z_table_for(structures) if z_table is None else z_table
        data = to_atomic_data(structures, cutoff=cutoff, z_table=z_table)
        batch = torch_geometric.batch.Batch.from_data_list(data).to_dict()
    return batch, [int(z) for z in z_table.zs]


def _repeats(k: int) -> tuple[int, int, int]:
    """Three repeat counts of product ``k``, as cubic as possible (prime factors onto the shortest side)."""
    reps, f = [1, 1, 1], 2
    while k > 1:
        while k % f == 0:
            k //= f
            reps[reps.index(min(reps))] *= f
        f += 1
    return tuple(reps)  # type: ignore[return-value]


def crystal(n: int, rng: np.random.Generator):
    """A periodic fcc Cu/Ni alloy of ``n`` atoms (a multiple of 4), strained by 1% and rattled by
    0.05 Å, so that its stress is not zero."""
    from ase.build import bulk

    if n % 4 or n < 4:
        raise ValueError(f"system crystal-{n}: an fcc supercell holds a multiple of 4 atoms")
    atoms = bulk("Cu", "fcc", a=3.58, cubic=True).repeat(_repeats(n // 4))
    atoms.numbers = rng.choice([28, 29], size=n)
    atoms.set_cell(atoms.cell.array @ (np.eye(3) + rng.normal(0, 0.01, (3, 3))), scale_atoms=True)
    atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
    return atoms


def perovskite(n: int, rng: np.random.Generator):
    """A periodic cubic SrTiO3 perovskite of ``n`` atoms (a multiple of 5), strained by 1% and
    rattled by 0.05 Å: three elements, as a foundation model meets them in a crystal."""
    from ase import Atoms

    if n % 5 or n < 5:
        raise ValueError(f"system perovskite-{n}: a SrTiO3 supercell holds a multiple of 5 atoms")
    a = 3.905
    cell = Atoms(
        "SrTiO3",
        scaled_positions=[(0, 0, 0), (0.5, 0.5, 0.5), (0.5, 0.5, 0), (0.5, 0, 0.5), (0, 0.5, 0.5)],
        cell=[a, a, a],
        pbc=True,
    )
    atoms = cell.repeat(_repeats(n // 5))
    atoms.set_cell(atoms.cell.array @ (np.eye(3) + rng.normal(0, 0.01, (3, 3))), scale_atoms=True)
    atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
    return atoms


def water_box(n: int, rng: np.random.Generator):
    """A periodic liquid-water box of ``n`` atoms: generated directly up to
    :data:`WATER_MAX_ATOMS`, else a :data:`WATER_TILE`-atom box repeated (``n / WATER_TILE`` a
    product of the three repeat counts, as cubic as possible)."""
    from workbench.data.synth.generators import build_liquid_water

    if n % 3 or n < 3:
        raise ValueError(f"system water-{n}: a water box needs a multiple of 3 atoms")
    if n <= WATER_MAX_ATOMS:
        return build_liquid_water(n, rng)
    if n % WATER_TILE:
        raise ValueError(
            f"system water-{n}: boxes above {WATER_MAX_ATOMS} atoms repeat a {WATER_TILE}-atom box; "
            f"use a multiple of {WATER_TILE}"
        )
    return build_liquid_water(WATER_TILE, rng).repeat(_repeats(n // WATER_TILE))


def system_structures(name: str, seed: int = 0) -> list:
    """The ``ase.Atoms`` of system ``name`` (``water-<atoms>``, ``crystal-<atoms>``,
    ``perovskite-<atoms>``: one structure; ``mixed``: the graphs of one packed batch)."""
    rng = np.random.default_rng(seed)
    if name.startswith("water-"):
        return [water_box(int(name.split("-", 1)[1]), rng)]
    if name.startswith("crystal-"):
        return [crystal(int(name.split("-", 1)[1]), rng)]
    if name.startswith("perovskite-"):
        return [perovskite(int(name.split("-", 1)[1]), rng)]
    if name == "mixed":
        from workbench.data.embedded import load_embedded

        frames = load_embedded(validate=False)
        structures, room = [], MIXED_CAPACITY
        for k in rng.permutation(len(frames)):  # a packed batch: random graphs while they fit
            if len(frames[k]) <= room:
                structures.append(frames[k])
                room -= len(frames[k])
        return structures
    raise ValueError(
        f"unknown system {name!r}: use water-<atoms> (a multiple of 3), crystal-<atoms> (a multiple of 4), "
        "perovskite-<atoms> (a multiple of 5) or mixed"
    )


def system_batch(
    name: str, dtype: str, cutoff: float = CUTOFF, seed: int = 0, model: str | None = None
) -> tuple[dict, list[int], dict]:
    """A mace batch for ``name`` (a system of :func:`system_structures`), its atomic numbers and
    ``{atoms, edges, graphs, families}``; with ``model``, at that model's cutoff and elements."""
    structures = system_structures(name, seed)
    z_table = None
    if model is not None:
        from mace.tools.utils import AtomicNumberTable

        cutoff = model_cutoff(model)
        z_table = AtomicNumberTable(model_elements(model, [z for a in structures for z in a.numbers]))
    batch, zs = mace_batch(structures, dtype, cutoff, z_table)
    info = {
        "atoms": int(batch["positions"].shape[0]),
        "edges": int(batch["edge_index"].shape[1]),
        "graphs": len(structures),
        "families": sorted({a.info.get("config_type", "?") for a in structures}),
    }
    return batch, zs, info


def _mixture_pool(capacity: int, n_batches: int, seed: int) -> list:
    """Labelled graphs of the embedded mixture that fit ``capacity``, in a seeded random order,
    enough atoms (1.5 x ``capacity`` x ``n_batches``) to fill the first bins; the mixture is tiled
    with rattled copies (``workbench bench train``'s) where it has too few."""
    from workbench.bench.train import bench_structures
    from workbench.data.embedded import load_embedded

    def eligible(frames: list) -> list:
        return [a for a in frames if a.info.get("labelled", True) and len(a) <= capacity]

    want = 1.5 * capacity * n_batches
    frames = eligible(load_embedded(validate=False))
    have = sum(len(a) for a in frames)
    if have < want:
        frames = eligible(bench_structures(int(len(frames) * want / max(have, 1)) + 1, seed=seed))
    rng = np.random.default_rng(seed)
    pool, atoms = [], 0
    for k in rng.permutation(len(frames)):
        if atoms >= want:
            break
        pool.append(frames[k])
        atoms += len(frames[k])
    return pool


def mixture_batches(capacity: int, n_batches: int, dtype: str, seed: int = 0) -> tuple[list[dict], list[int], dict]:
    """``n_batches`` distinct mace batches of the embedded mixture, packed by ``pack(...,
    algorithm="paper")`` at ``capacity`` atoms (the fullest bins first, as the packer orders them),
    with one z_table over all of them; ``info``: mean atoms/edges per batch and the packing."""
    from workbench.data.atomic_data import z_table_for
    from workbench.packing import pack

    pool = _mixture_pool(capacity, n_batches, seed)
    sizes = np.array([len(a) for a in pool], dtype=np.int64)
    packing = pack(sizes, capacity=capacity, num_replicas=1, algorithm="paper", seed=seed)
    chosen = [[pool[i] for i in b] for b in packing.batches[:n_batches]]
    if len(chosen) < n_batches:
        raise ValueError(f"mixture-{capacity}: {len(chosen)} batches packed, {n_batches} wanted")
    z_table = z_table_for(a for b in chosen for a in b)
    batches = [mace_batch(b, dtype, CUTOFF, z_table)[0] for b in chosen]
    atoms_per = [int(b["positions"].shape[0]) for b in batches]
    edges_per = [int(b["edge_index"].shape[1]) for b in batches]
    info = {
        "atoms": float(np.mean(atoms_per)),
        "edges": float(np.mean(edges_per)),
        "graphs": float(np.mean([len(b) for b in chosen])),
        "batches": n_batches,
        "capacity": capacity,
        "atoms_per_batch": atoms_per,
        "edges_per_batch": edges_per,
        "atoms_max": max(atoms_per),
        "families": sorted({a.info.get("config_type", "?") for b in chosen for a in b}),
    }
    return batches, [int(z) for z in z_table.zs], info


def workload_batches(name: str, dtype: str, n_batches: int, seed: int = 0) -> tuple[list[dict], list[int], dict]:
    """The batches a workload's steps walk (``n_batches`` of them; a water box repeats its one
    batch), its atomic numbers and ``{atoms, edges, graphs, edges_per_atom, ...}`` (per batch)."""
    if name.startswith("mixture-"):
        batches, zs, info = mixture_batches(int(name.split("-", 1)[1]), n_batches, dtype, seed)
    elif name.startswith("water-"):
        batch, zs, info = system_batch(name, dtype, seed=seed)
        batches = [batch] * n_batches
    else:
        raise ValueError(f"unknown workload {name!r}: use water-<atoms> or mixture-<capacity>")
    info["edges_per_atom"] = info["edges"] / max(info["atoms"], 1)
    return batches, zs, info


def to_device(batches: Sequence[dict], device: str) -> list[dict]:
    """``batches`` on ``device``, a batch repeated in the list moved once."""
    moved: dict[int, dict] = {}
    for b in batches:
        if id(b) not in moved:
            moved[id(b)] = {k: v.to(device) for k, v in b.items()}
    return [moved[id(b)] for b in batches]
