"""``BinPackingBatchSampler``: a packing served to DDP as a ``batch_sampler``.

Every rank computes the same packing from ``(seed, epoch)`` (all randomness comes
from ``numpy.random.default_rng([seed, epoch])``), so ranks agree with no
communication. The packing's ``K = S * R`` batches form ``S`` steps of ``R``
batches; with ``shuffle=True`` the order of the steps is permuted each epoch
(the ``R`` batches of a step stay together, so load balance is kept). Rank ``r``
yields batch ``r`` of each step, hence ``len(sampler) == S`` on every rank and
DDP never waits on a rank that has run out of batches. No batch is empty.

Resuming: ``state_dict()`` records the epoch and how many batches this rank has
yielded in it; ``load_state_dict`` makes the next ``__iter__`` continue from
there. With a multi-worker ``DataLoader`` the sampler runs ahead of training by
the prefetch depth, so a trainer should pass the number of batches it actually
consumed: ``state_dict(consumed=k)``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from workbench.packing.api import Packing, algorithm_named, pack


class EpochBatchSampler(Sampler[list[int]]):
    """The resume bookkeeping every batch sampler here shares: the epoch, and how many of its
    batches ``__iter__`` has yielded (``state_dict`` / ``load_state_dict``).

    A subclass calls ``set_epoch(0)`` in ``__init__``, yields through :meth:`_yield_from`, and
    names in :meth:`_identity` what a saved position is only valid for.
    """

    def _identity(self) -> dict:
        raise NotImplementedError

    def _yield_from(self, n_batches: int, batch_at) -> Iterator[list[int]]:
        """Batches ``batch_at(k)`` for ``k`` from the resume point to ``n_batches``, counted."""
        start, self._start = self._start, 0
        self._yielded = start
        for k in range(start, n_batches):
            self._yielded = k + 1
            yield batch_at(k)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (as ``DistributedSampler.set_epoch``); resets the resume point."""
        self.epoch = int(epoch)
        self._start = 0
        self._yielded = 0

    def state_dict(self, consumed: int | None = None) -> dict:
        """Epoch and batches consumed so far on this rank (``consumed`` overrides the count yielded)."""
        done = self._yielded if consumed is None else int(consumed)
        return {"epoch": self.epoch, "batches_done": done, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``__iter__`` yields the rest of ``state["epoch"]``.

        Refuses a state saved by a sampler over other graphs or another batch sequence (the keys
        of :meth:`_identity`): its batch position would point into different batches."""
        for key, value in self._identity().items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r}, this sampler has {value!r}; "
                    "resume only with the same data and batching settings"
                )
        self.epoch = int(state["epoch"])
        if not 0 <= int(state["batches_done"]) <= len(self):
            raise ValueError(f"sampler state: batches_done={state['batches_done']} is outside 0..{len(self)}")
        self._start = int(state["batches_done"])
        self._yielded = self._start


class BinPackingBatchSampler(EpochBatchSampler):
    """Yield this rank's batches (lists of dataset indices) of a bin packing.

    Parameters
    ----------
    costs : per-graph cost (or structured sizes array, see :func:`pack`).
    capacity : maximum cost per batch.
    num_replicas, rank : default to ``torch.distributed`` world size and rank
        (1 and 0 when it is not initialised).
    shuffle : permute the steps every epoch (and let randomised algorithms
        draw a new packing).
    seed : shared by all ranks.
    algorithm : a key of :data:`workbench.packing.ALGORITHMS`.
    pack_options : passed to :func:`pack` (``oversize``, ``atoms``, ...).
    """

    def __init__(
        self,
        costs,
        capacity: float,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        algorithm: str = "paper",
        **pack_options,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}], got {rank}")
        self.spec = algorithm_named(algorithm)
        self.costs = costs
        self.capacity = capacity
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.algorithm = algorithm
        self.pack_options = pack_options
        self.set_epoch(0)
        self._cache: tuple[int, Packing] | None = None

    def packing(self, epoch: int | None = None) -> Packing:
        """The packing of ``epoch`` (default: the current one), before step shuffling."""
        epoch = self.epoch if epoch is None else epoch
        # Deterministic algorithms give the same packing every epoch: compute it once.
        key = epoch if (self.spec.randomized and self.shuffle) else 0
        if self._cache is None or self._cache[0] != key:
            p = pack(
                self.costs,
                self.capacity,
                self.num_replicas,
                algorithm=self.algorithm,
                seed=self.seed,
                epoch=key,
                **self.pack_options,
            )
            self._cache = (key, p)
        return self._cache[1]

    def step_order(self, epoch: int | None = None) -> np.ndarray:
        """Order in which the steps of ``epoch`` run (identical on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        n_steps = self.packing(epoch).n_steps
        if not self.shuffle:
            return np.arange(n_steps)
        # A stream separate from the packing's own, so step order and packing are independent.
        return np.random.default_rng([self.seed, epoch, 1]).permutation(n_steps)

    def _rank_slices(self, epoch: int | None = None):
        """``(flat, offsets, batch numbers)`` of this rank's batches in run order (CSR, no copies)."""
        p = self.packing(epoch)
        return p.flat, p.offsets, self.step_order(epoch) * self.num_replicas + self.rank

    def rank_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches this rank runs in ``epoch``, in order."""
        flat, offsets, order = self._rank_slices(epoch)
        return [flat[offsets[b] : offsets[b + 1]].tolist() for b in order]

    def __iter__(self) -> Iterator[list[int]]:
        # Batches are cut from the packing's CSR arrays one at a time: at a million graphs a
        # list of every batch would cost tens of MB per rank.
        flat, offsets, order = self._rank_slices()
        return self._yield_from(order.size, lambda k: flat[offsets[order[k]] : offsets[order[k] + 1]].tolist())

    def __len__(self) -> int:
        return self.packing().n_steps

    def _identity(self) -> dict:
        return {
            "seed": self.seed,
            "algorithm": self.algorithm,
            "num_replicas": self.num_replicas,
            "n_graphs": int(np.shape(np.asarray(self.costs))[0]),
            "capacity": float(self.capacity),
            "rank": self.rank,
        }
