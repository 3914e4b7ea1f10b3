"""A ``DataLoader`` whose batches are the bin packer's, for another library's graph dataset.

For training loops that are not the workbench's own (nequip's Lightning ``NequIPDataModule``,
for one): give the dataset, get a ``torch.utils.data.DataLoader`` over
:class:`~workbench.packing.sampler.BinPackingBatchSampler`, with the same guarantees as in the
workbench's trainer: every rank gets the same number of batches, an epoch uses every graph once,
the batches are a function of ``(seed, epoch, num_replicas)`` alone, and ``state_dict`` /
``load_state_dict`` resume mid-epoch. A nequip config switches to it with::

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


def graph_sizes(dataset: Sequence) -> np.ndarray:
    """Atoms and edges of every graph of ``dataset`` (a structured array with fields ``atoms``,
    ``edges``), read item by item: the dataset's own transforms (the neighbour list) run once."""
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
    sizes : per-graph atom counts (or a structured sizes array); default: read from the dataset.
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
