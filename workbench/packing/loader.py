"""A ``DataLoader`` whose batches are the bin packer's, for another library's graph dataset.

For training loops that are not the workbench's own (nequip's Lightning ``NequIPDataModule``,
for one): give the dataset, get a ``torch.utils.data.DataLoader`` over
:class:`~workbench.packing.sampler.BinPackingBatchSampler`, with the same guarantees as in the
workbench's trainer: every rank gets the same number of batches, an epoch uses every graph once,
the batches are a function of ``(seed, epoch, num_replicas)`` alone, and ``state_dict`` /
``load_state_dict`` resume mid-epoch (a state saved by a loader of other batches is refused,
naming the setting that differs: :mod:`workbench.packing.state`). A nequip config switches to it with::

    train_dataloader:
      _target_: workbench.packing.loader.PackedDataLoader
      capacity: 2048          # atoms per batch
      algorithm: paper        # or shuffled-paper, ffd, ... (workbench.packing.ALGORITHMS)

With Lightning's DDP set ``use_distributed_sampler: false`` on the trainer: the packer shards
the batches over the ranks itself (``num_replicas`` and ``rank`` default to
``torch.distributed``'s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from workbench.packing.sampler import BinPackingBatchSampler

__all__ = ["PackedDataLoader", "graph_sizes"]


def _size(item: Any, index: int) -> tuple[int, int]:
    if not isinstance(item, dict) or "pos" not in item:
        raise TypeError(
            f"graph {index}: {type(item).__name__} has no 'pos'; PackedDataLoader reads atom counts from "
            "dict-like graphs (nequip's AtomicDataDict); pass sizes= for other datasets"
        )
    atoms = int(item["pos"].shape[0])
    edges = int(item["edge_index"].shape[1]) if "edge_index" in item else 0
    return atoms, edges


def _atom_counts(dataset: Any) -> np.ndarray | None:
    """Atom counts without running the dataset's transforms, where the dataset can tell them:
    nequip's ``AtomicDataset.num_atoms`` (also through ``torch.utils.data.Subset`` and
    ``ConcatDataset``); None otherwise."""
    if isinstance(dataset, torch.utils.data.Subset):
        inner = _atom_counts(dataset.dataset)
        return None if inner is None else inner[np.asarray(dataset.indices, dtype=np.int64)]
    if isinstance(dataset, torch.utils.data.ConcatDataset):
        parts = [_atom_counts(d) for d in dataset.datasets]
        return None if any(p is None for p in parts) else np.concatenate(parts)
    count = getattr(dataset, "num_atoms", None)
    if not callable(count):
        return None
    return np.asarray(count(list(range(len(dataset)))), dtype=np.int64).reshape(len(dataset))


def graph_sizes(dataset: Sequence, edges: bool = False) -> np.ndarray:
    """Atoms (and with ``edges``, edges) of every graph of ``dataset``, as a structured array
    with fields ``atoms`` (and ``edges``). The packer needs atoms only; a nequip dataset reports
    them without its transforms. Edges, which only the straggler metrics read, come from reading
    every item: the dataset's transforms (its neighbour list) run once per graph, a full epoch of
    data loading."""
    atoms = None if edges else _atom_counts(dataset)
    if atoms is not None:
        sizes = np.zeros(len(dataset), dtype=[("atoms", np.int64)])
        sizes["atoms"] = atoms
        return sizes
    sizes = np.zeros(len(dataset), dtype=[("atoms", np.int64), ("edges", np.int64)])
    for i in range(len(dataset)):
        sizes[i] = _size(dataset[i], i)
    return sizes


class _EpochAware(BinPackingBatchSampler):
    """Lightning sets each epoch through ``loader.batch_sampler.sampler.set_epoch``: be that sampler."""

    @property
    def sampler(self) -> BinPackingBatchSampler:
        return self


class PackedDataLoader(DataLoader):
    """``DataLoader(dataset, batch_sampler=BinPackingBatchSampler(...))``.

    Parameters
    ----------
    dataset : a map-style dataset of graphs.
    capacity : atoms per batch (the paper's bin capacity).
    algorithm, seed, shuffle, num_replicas, rank : as :class:`BinPackingBatchSampler`.
    sizes : per-graph atom counts (or a structured sizes array); default: :func:`graph_sizes`
        (a nequip dataset's atom counts, without running its transforms).
    collate_fn, num_workers, **kwargs : as ``DataLoader``.
    batch_size, generator : accepted and unused, so that configs written for a plain
        ``DataLoader`` (nequip passes both) work unchanged: the packer decides batch sizes and
        draws from ``seed``.
    """

    def __init__(
        self,
        dataset: Sequence,
        capacity: float,
        algorithm: str = "paper",
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
        sizes: np.ndarray | None = None,
        collate_fn: Callable | None = None,
        batch_size: int | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        sizes = graph_sizes(dataset) if sizes is None else np.asarray(sizes)
        if len(sizes) != len(dataset):
            raise ValueError(f"sizes has {len(sizes)} entries, the dataset {len(dataset)} graphs")
        sampler = _EpochAware(sizes, capacity, num_replicas, rank, shuffle, seed, algorithm)
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_fn, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Where this rank is in the epoch (the sampler's state)."""
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)
