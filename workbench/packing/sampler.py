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
consumed: ``state_dict(consumed=k)``. A state loads only into a sampler that gives the same
batches (:mod:`workbench.packing.state`): ``load_state_dict`` names every setting that differs.

Arguments are checked when the sampler is made (:mod:`workbench.packing.checks`): counts and
seeds are integers (``int`` or numpy integers, never ``bool`` or ``float``), the capacity a finite
number > 0, ``shuffle`` a bool; epochs (``set_epoch``) are integers >= 0.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from workbench.packing.api import Packing, algorithm_named, batch_settings, pack, pack_inputs
from workbench.packing.checks import check_int
from workbench.packing.state import check_state, sizes_fingerprint


class EpochBatchSampler(Sampler[list[int]]):
    """The resume bookkeeping every batch sampler here shares: the epoch, and how many of its
    batches ``__iter__`` has yielded (``state_dict`` / ``load_state_dict``).

    A subclass calls ``set_epoch(0)`` in ``__init__``, yields through :meth:`_yield_from`, and
    names in :meth:`_identity` what a saved position is only valid for (and in ``_since`` the
    identity fields that states of older versions may lack, see :mod:`workbench.packing.state`).
    """

    _since: tuple[str, ...] = ()

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
        """Select the epoch (as ``DistributedSampler.set_epoch``), an integer >= 0; resets the resume point."""
        self.epoch = check_int("epoch", epoch)
        self._start = 0
        self._yielded = 0

    def state_dict(self, consumed: int | None = None) -> dict:
        """Epoch and batches consumed so far on this rank (``consumed`` overrides the count yielded)."""
        done = self._yielded if consumed is None else check_int("consumed", consumed)
        return {"epoch": self.epoch, "batches_done": done, **self._identity()}

    def check_state(self, state: dict) -> dict:
        """``state`` checked against this sampler (:func:`workbench.packing.state.check_state`):
        a ``ValueError`` names what is malformed or differs; an older state lacking fields of
        ``_since`` comes back with them filled in, after a warning."""
        return check_state(state, self._identity(), self._since)

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``__iter__`` yields the rest of ``state["epoch"]``.

        Refuses (``ValueError``, naming the fields) a malformed state and one saved by a sampler
        over other graphs or another batch sequence (the keys of :meth:`_identity`): its batch
        position would point into different batches."""
        state = self.check_state(state)
        epoch, done = state["epoch"], state["batches_done"]
        before, self.epoch = self.epoch, epoch
        if done > len(self):
            self.epoch = before
            raise ValueError(f"sampler state: batches_done={done} is outside 0..{len(self)} (epoch {epoch})")
        self._start = self._yielded = done


class BinPackingBatchSampler(EpochBatchSampler):
    """Yield this rank's batches (lists of dataset indices) of a bin packing.

    Parameters
    ----------
    costs : per-graph cost (or structured sizes array, see :func:`pack`).
    capacity : maximum cost per batch, a finite number > 0 (a float is valid).
    num_replicas, rank : default to ``torch.distributed`` world size and rank
        (1 and 0 when it is not initialised).
    shuffle : ``True`` or ``False``: permute the steps every epoch (and let randomised
        algorithms draw a new packing).
    seed : shared by all ranks, an integer >= 0.
    algorithm : a key of :data:`workbench.packing.ALGORITHMS`.
    pack_options : passed to :func:`pack` (``oversize``, ``atoms``, ...).
    """

    #: identity fields that states written before they were recorded lack (they load, with a warning)
    _since = ("shuffle", "sizes", "options")

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
        initialised = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        self.num_replicas = check_int("num_replicas", num_replicas, 1)
        self.rank = check_int("rank", rank)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas - 1}], got {rank}")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise ValueError(f"shuffle must be True or False, got {shuffle!r} ({type(shuffle).__name__})")
        self.spec = algorithm_named(algorithm)
        self.seed = check_int("seed", seed)
        # Everything pack() would refuse is refused here, before the first epoch.
        self._settings = batch_settings(algorithm, pack_options)
        field = self._settings["cost_field"]
        given = {k: pack_options.get(k) for k in ("atoms", "edges")}
        raw = pack_inputs(costs, field, given["atoms"], given["edges"], capacity, self.num_replicas)[0]
        self._sizes = (int(raw.shape[0]), sizes_fingerprint(raw))
        self.costs, self.capacity, self.shuffle = costs, capacity, bool(shuffle)
        self.algorithm, self.pack_options = algorithm, pack_options
        self.set_epoch(0)
        self._cache: tuple[int, Packing] | None = None

    def packing(self, epoch: int | None = None) -> Packing:
        """The packing of ``epoch`` (default: the current one), before step shuffling."""
        epoch = self.epoch if epoch is None else check_int("epoch", epoch)
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
        epoch = self.epoch if epoch is None else check_int("epoch", epoch)
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
        """Everything that decides this rank's batch sequence (see :mod:`workbench.packing.state`)."""
        return {
            "seed": self.seed,
            "algorithm": self.algorithm,
            "num_replicas": self.num_replicas,
            "n_graphs": self._sizes[0],
            "capacity": float(self.capacity),
            "rank": self.rank,
            "shuffle": self.shuffle,
            "sizes": self._sizes[1],
            "options": dict(self._settings),
        }
