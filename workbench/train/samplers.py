"""The trainer's batch samplers: the packing algorithms of the registry
(:data:`workbench.packing.api.ALGORITHMS`) and ``mace-order`` (:mod:`workbench.train.mace_order`).

What an algorithm bounds decides what it is given: one that respects a capacity gets
``TrainConfig.capacity`` (and the training graphs are checked against it), one that batches by
count gets ``TrainConfig.batch_size`` graphs per batch. Their names, with ``mace-order``, are
:data:`workbench.train.config.SAMPLERS`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np
import torch

from workbench.packing.api import ALGORITHMS
from workbench.packing.core import oversize_mask
from workbench.packing.sampler import BinPackingBatchSampler
from workbench.train import mace_order
from workbench.train.config import TrainConfig
from workbench.train.mace_order import MaceOrderSampler

#: What :func:`make_sampler` returns: both resume mid-epoch and give the epoch's ``packing()``.
TrainSampler = BinPackingBatchSampler | MaceOrderSampler


def make_sampler(
    config: TrainConfig, atoms: np.ndarray, num_replicas: int, rank: int, file_order: np.ndarray | None = None
) -> TrainSampler:
    """The training batch sampler of ``config.sampler`` over graphs of ``atoms`` atoms.

    ``file_order``: for ``mace-order``, the dataset index of each training-file position
    (:func:`workbench.train.mace_order.file_order`).
    """
    if config.sampler == mace_order.NAME:
        mace_order.check_ranks(num_replicas)
        passes = mace_order.statistics_passes(config)
        return MaceOrderSampler(
            len(atoms), config.batch_size, seed=config.seed, order=file_order, atoms=atoms, statistics_passes=passes
        )
    spec = ALGORITHMS[config.sampler]
    options = {}
    if spec.respects_capacity:  # before the sampler, so that the error names the config's field
        oversize_mask(np.asarray(atoms), config.capacity, "error", "TrainConfig.capacity", "or train without them")
    if spec.takes_graphs_per_batch:
        options["graphs_per_batch"] = config.batch_size
    return BinPackingBatchSampler(
        atoms,
        capacity=config.capacity,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=True,
        seed=config.seed,
        algorithm=config.sampler,
        **options,
    )


class RecordingSampler(torch.utils.data.Sampler):
    """Pass batches through and remember them, so the trainer knows which graphs each step saw."""

    def __init__(self, sampler: TrainSampler) -> None:
        self.sampler = sampler
        self.queue: deque[list[int]] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.sampler:
            self.queue.append(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.sampler)
