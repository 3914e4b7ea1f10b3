"""Training data: read, filter, split and convert structures to mace ``AtomicData``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.train.config import TrainConfig

#: The ``TrainConfig`` fields ``prepare_data`` reads: configs equal on these get equal ``TrainData``.
PREPARE_FIELDS = ("dataset", "families", "energy_key", "forces_key", "seed", "max_structures", "valid_fraction",
                  "cutoff", "dtype")


@dataclass
class TrainData:
    """Train/validation splits as mace ``Configuration`` and ``AtomicData`` lists, plus sizes."""

    train_configs: list
    valid_configs: list
    train: list
    valid: list
    z_table: object
    train_atoms: np.ndarray  # atoms per training graph, int64
    train_edges: np.ndarray  # directed edges per training graph, int64
    stats: object | None = None  # ModelStats of the training split, filled by the first run that needs it


def load_structures(config: TrainConfig) -> list:
    """Read ``config.dataset`` (default: embedded mixture); keep labelled frames of the chosen families."""
    from workbench.data.embedded import EMBEDDED_PATH
    from workbench.data.io import read_structures

    path = config.dataset or EMBEDDED_PATH
    structures = read_structures(path, energy_key=config.energy_key, forces_key=config.forces_key)
    structures = [a for a in structures if a.info.get("labelled", True)]
    if config.families:
        keep = set(config.families)
        structures = [a for a in structures if a.info.get("config_type") in keep]
    if not structures:
        raise ValueError(f"{path}: no labelled structures to train on"
                         + (f" in families {config.families}" if config.families else ""))
    return structures


def prepare_data(config: TrainConfig, structures: list | None = None) -> TrainData:
    """Seeded shuffle, optional ``max_structures`` cut, train/validation split, mace conversion.

    Tensors are built in ``config.dtype`` (the torch default dtype is set while this runs).
    """
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, config.dtype))  # mace builds AtomicData in the default dtype
    try:
        return _prepare_data(config, structures)
    finally:
        torch.set_default_dtype(previous)


def _prepare_data(config: TrainConfig, structures: list | None) -> TrainData:
    from mace.data import AtomicData, config_from_atoms

    from workbench.data.atomic_data import key_specification, z_table_for

    structures = load_structures(config) if structures is None else structures
    order = np.random.default_rng(config.seed).permutation(len(structures))
    if config.max_structures:
        order = order[: config.max_structures]
    n_valid = int(round(config.valid_fraction * len(order)))
    if config.valid_fraction > 0 and len(order) >= 2:
        n_valid = max(n_valid, 1)
    if len(order) - n_valid < 1:
        raise ValueError(f"dataset has {len(order)} structure(s): too few for a train/validation split "
                         f"with valid_fraction={config.valid_fraction}")
    chosen = [structures[i] for i in order]
    z_table = z_table_for(chosen)
    spec = key_specification(config.energy_key, config.forces_key)
    configs = [config_from_atoms(a, key_specification=spec) for a in chosen]
    data = [AtomicData.from_config(c, z_table=z_table, cutoff=config.cutoff) for c in configs]
    train_configs, valid_configs = configs[n_valid:], configs[:n_valid]
    train, valid = data[n_valid:], data[:n_valid]
    atoms = np.array([int(d.num_nodes) for d in train], dtype=np.int64)
    edges = np.array([int(d.edge_index.shape[1]) for d in train], dtype=np.int64)
    return TrainData(train_configs, valid_configs, train, valid, z_table, atoms, edges)
